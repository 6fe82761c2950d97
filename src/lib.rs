#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]
#![warn(missing_docs, missing_debug_implementations, unreachable_pub, clippy::future_not_send)]
#![deny(rust_2018_idioms, rustdoc::broken_intra_doc_links)]

// Modules from the bottom of the dependency graph up, in groups: no module uses one of a
// later group, so imports run one way. A `write` travels down: `store` (the public method),
// `write` (per-key order, coalescing, the fenced statement), `exec` (admission, retries), `sql`
// (the statement text).

// Leaves: errors, input checks, the SQL text, the deadline's clock, the counters.
mod clock;
mod error;
mod keys;
mod sql;
mod stats;

// Connections, options, the lease and the schema setup.
mod config;
mod connect;
pub mod env;
mod lease;
mod schema;

// The statement executor, then the write path on top of it.
mod exec;

mod write;

// The public API: the store, failover, inspection, and the openers of a `Builder`.
mod store;

mod inspect;
mod standby;

mod entry;

pub mod blocking;
#[cfg(any(feature = "ldk", feature = "ldk-0_2"))]
pub mod ldk;

pub use config::{Builder, LeaseLossPolicy};
pub use connect::{tls_client_config, tls_client_config_with_cert};
/// The pool crate `builder_from_pool` takes, re-exported so versions always match.
pub use deadpool_postgres;
pub use error::{Error, KeyPath, LossReason, Result};
pub use inspect::Inspector;
pub use keys::{MAX_BATCH_BYTES, MAX_KEY_LEN, check_key};
pub use lease::LeaseState;
/// The TLS library whose `ClientConfig` `Builder::tls` takes, re-exported so versions always
/// match.
pub use rustls;
pub use schema::LeaseInfo;
pub use standby::{Standby, StandbyState};
pub use stats::{FailClosed, Histogram, Operations, PoolStats, Renewals, Shared};
pub use store::{KvStore, Page, PageToken, PgKvStore, Stats};
/// The driver whose `Config` `builder_from_config` takes, re-exported so versions always match.
pub use tokio_postgres;
pub use write::batch::Batch;
