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
pub mod privileges;
mod sql;
mod stats;

// Connections, what they keep in a server session, libpq's environment, the lease (with its
// loss policy) and the schema setup.
mod connect;
pub mod env;
mod lease;
mod schema;
mod session;

// The statement executor, then the write path on top of it.
mod exec;

mod write;

// Read-only inspection, below the store: it takes a table and a pool, not a builder.
mod inspect;

// The public API. `store` holds the types that name each other: `PgKvStore`, its `Builder`
// (options, checks and every opener), the `Standby` and the `blocking` store.
mod store;

// Many stores sharing one pool and one renewal thread: a way to open stores, above them.
mod fleet;

#[cfg(any(feature = "ldk", feature = "ldk-0_2"))]
pub mod ldk;
pub mod shutdown;

pub use connect::{tls_client_config, tls_client_config_with_cert};
/// The pool crate `builder_from_pool` takes, re-exported so versions always match.
pub use deadpool_postgres;
pub use error::{ConnectStep, Error, KeyPath, LossReason, Result};
pub use fleet::Fleet;
pub use inspect::{Entries, Entry, Inspector};
pub use keys::{MAX_BATCH_BYTES, MAX_KEY_LEN, check_key};
pub use lease::{LeaseLossPolicy, LeaseState};
/// The TLS library whose `ClientConfig` `Builder::tls` takes, re-exported so versions always
/// match.
pub use rustls;
pub use schema::LeaseInfo;
pub use stats::{FailClosed, Histogram, Operations, PoolStats, Renewals, Shared};
pub use store::Stats;
pub use store::blocking;
pub use store::{Builder, KvStore, Page, PageToken, PgKvStore, PoolMode, Standby, StandbyState};
/// The driver whose `Config` `builder_from_config` takes, re-exported so versions always match.
pub use tokio_postgres;
pub use write::batch::Batch;
