//! [`Stats`], the snapshot [`crate::PgKvStore::stats`] returns.

use std::time::Duration;

use crate::exec::Executor;
use crate::lease::LeaseState;
use crate::stats::{FailClosed, Op, Operations, PoolStats, Renewals, Shared};

/// A snapshot of a store's lease, counters, latencies and pool, from
/// [`crate::PgKvStore::stats`].
///
/// The counters start at zero when the store opens and only grow. Each is read on its own, so
/// two of them may be a moment apart. Taking one costs a few atomic loads and a short lock of
/// the pool; it runs no SQL. The `metrics` feature exports the same figures (see
/// docs/metrics.md).
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub struct Stats {
    /// The table, as configured.
    pub table: String,
    /// The lease's state, as [`crate::PgKvStore::lease_state`] publishes it.
    pub lease: LeaseState,
    /// The epoch this store holds or held (the fencing token).
    pub epoch: i64,
    /// Time left until the local deadline, when the store fails closed unless a renewal is
    /// confirmed first. Zero once the lease is no longer held.
    pub deadline_in: Duration,
    /// The renewal thread's renewals.
    pub renewals: Renewals,
    /// `write` calls.
    pub writes: Operations,
    /// `remove` calls.
    pub removes: Operations,
    /// Batch commits.
    pub batches: Operations,
    /// `read` calls. A key not found is not an error.
    pub reads: Operations,
    /// `list`, `list_paginated` and `list_all_keys` calls.
    pub lists: Operations,
    /// Statements shared by concurrent mutations.
    pub shared: Shared,
    /// Statements retried on a fresh connection after a broken connection or an unavailable
    /// server.
    pub retries: u64,
    /// The store's fail-closed event, by reason: all zero while the lease is held.
    pub fail_closed: FailClosed,
    /// The connection pool now.
    pub pool: PoolStats,
}

impl Stats {
    pub(crate) fn of(exec: &Executor) -> Stats {
        let lease = &exec.lease;
        let recorded = &lease.stats;
        let state = lease.subscribe().borrow().clone();
        let held = matches!(state, LeaseState::Held { .. });
        Stats {
            table: exec.table.display(),
            lease: state,
            epoch: lease.epoch,
            deadline_in: if held { lease.remaining() } else { Duration::ZERO },
            renewals: recorded.renewals(),
            writes: recorded.operations(Op::Write),
            removes: recorded.operations(Op::Remove),
            batches: recorded.operations(Op::Batch),
            reads: recorded.operations(Op::Read),
            lists: recorded.operations(Op::List),
            shared: recorded.shared_stats(),
            retries: recorded.retries(),
            fail_closed: recorded.fail_closed(),
            pool: exec.pool_stats(),
        }
    }
}
