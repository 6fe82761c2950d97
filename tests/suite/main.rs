//! The integration tests that can share one process, as one test binary: each binary links the
//! whole library and its dependencies, so fewer binaries build faster.
//!
//! Each module was a test binary of its own (`tests/<name>.rs`); filter by its name
//! (`cargo test --all-features --test suite lease::`). Separate binaries remain for what must
//! run alone: tests/logs.rs installs a log subscriber of its own, tests/partition.rs moves
//! threads into network namespaces, and tests/cli.rs runs the `cli`-feature binary. The tests
//! through LDK's own crates are in tests-ldk, a crate of its own for their dev-dependencies.
//!
//! `lease` and `hazards` install the global error-event observer of `common::errors`: it only
//! observes the store's error events, so the other modules run as they would without it.

#[path = "../common/mod.rs"]
mod common;
mod sync_support;

mod actionable;
mod backpressure;
mod batch;
mod blocking;
mod coalesce;
mod conformance;
mod deferred;
mod durability;
mod failover;
mod faults;
mod fleet;
mod harness;
mod hazards;
mod hung_server;
mod input;
mod interleavings;
mod lease;
mod pgbouncer;
mod privileges;
mod release;
mod replication;
mod standbys;
mod stats;
mod tls;
mod watchdog;
