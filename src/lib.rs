#![doc = include_str!("../README.md")]
#![forbid(unsafe_code)]
#![deny(rust_2018_idioms, rustdoc::broken_intra_doc_links)]
#![warn(missing_docs, missing_debug_implementations, unreachable_pub, clippy::future_not_send)]

mod batch;
mod coalesce;
mod config;
mod connect;
mod error;
mod failover;
mod keys;
mod lease;
mod ordering;
mod schema;
mod sql;
mod store;

pub mod blocking;
#[cfg(feature = "ldk")]
pub mod ldk;

pub use batch::{Batch, MAX_BATCH_BYTES};
pub use config::{Builder, LeaseLossPolicy};
pub use connect::{tls_client_config, tls_client_config_with_cert};
/// The pool crate `builder_from_pool` takes, re-exported so versions always match.
pub use deadpool_postgres;
pub use error::{Error, KeyPath, LossReason, Result};
pub use failover::{Inspector, Standby, StandbyState};
pub use keys::{MAX_KEY_LEN, check_key};
pub use lease::LeaseState;
/// The TLS library whose `ClientConfig` `Builder::tls` takes, re-exported so versions always
/// match.
pub use rustls;
pub use schema::LeaseInfo;
pub use store::{KvStore, Page, PageToken, PgKvStore};
/// The driver whose `Config` `builder_from_config` takes, re-exported so versions always match.
pub use tokio_postgres;
