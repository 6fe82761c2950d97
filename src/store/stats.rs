//! [`Stats`], the snapshot [`crate::PgKvStore::stats`] returns.

use std::fmt::Write as _;
use std::time::Duration;

use crate::exec::Executor;
use crate::lease::LeaseState;
use crate::stats::{
    DEFERRED, FAIL_CLOSED, FailClosed, Histogram, LEASE_DEADLINE, LEASE_EPOCH, LEASE_HELD, Metric,
    OPERATION_DURATION, OPERATION_ERRORS, OPERATIONS, Op, Operations, POOL_CONNECTIONS,
    POOL_STATES, PoolStats, REASONS, RENEWAL_DURATION, RENEWAL_LAST, RENEWALS, RETRIES, Renewals,
    SHARED_MUTATIONS, SHARED_STATEMENTS, Shared, reason_label,
};

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
    /// `flush` calls.
    pub flushes: Operations,
    /// `write_deferred`, `remove_deferred` and `Batch::commit_deferred` calls that ran, counted
    /// when they start. Each is counted in `writes`, `removes` or `batches` too.
    pub deferred: u64,
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
            flushes: recorded.operations(Op::Flush),
            deferred: recorded.deferred_count(),
            shared: recorded.shared_stats(),
            retries: recorded.retries(),
            fail_closed: recorded.fail_closed(),
            pool: exec.pool_stats(),
        }
    }
}

impl Stats {
    /// The snapshot as Prometheus text (exposition format 0.0.4), every sample labelled with
    /// the table. The names are those of the `metrics` feature (docs/metrics.md). Serve it to
    /// a scraper without any metrics crate, as `pgfence hold --metrics-addr` does.
    pub fn prometheus(&self) -> String {
        let mut out = Text::new(&self.table);
        let held = matches!(self.lease, LeaseState::Held { .. });
        out.gauge(&LEASE_HELD, if held { 1.0 } else { 0.0 });
        out.gauge(&LEASE_EPOCH, self.epoch as f64);
        out.gauge(&LEASE_DEADLINE, self.deadline_in.as_secs_f64());

        out.head(&RENEWALS);
        out.sample(RENEWALS.name, "outcome=\"ok\"", self.renewals.ok as f64);
        out.sample(RENEWALS.name, "outcome=\"failed\"", self.renewals.failed as f64);
        let last = self.renewals.last_latency.unwrap_or_default();
        out.gauge(&RENEWAL_LAST, last.as_secs_f64());
        out.head(&RENEWAL_DURATION);
        out.histogram(RENEWAL_DURATION.name, "", &self.renewals.latency);

        let ops = Op::ALL.map(|op| (format!("op=\"{}\"", op.label()), self.operations(op)));
        out.head(&OPERATIONS);
        for (label, o) in &ops {
            out.sample(OPERATIONS.name, label, o.count as f64);
        }
        out.head(&OPERATION_ERRORS);
        for (label, o) in &ops {
            out.sample(OPERATION_ERRORS.name, label, o.errors as f64);
        }
        out.head(&OPERATION_DURATION);
        for (label, o) in &ops {
            out.histogram(OPERATION_DURATION.name, label, &o.latency);
        }

        out.counter(&SHARED_STATEMENTS, self.shared.statements);
        out.counter(&SHARED_MUTATIONS, self.shared.mutations);
        out.counter(&RETRIES, self.retries);
        out.counter(&DEFERRED, self.deferred);
        out.head(&FAIL_CLOSED);
        for reason in &REASONS {
            let label = format!("reason=\"{}\"", reason_label(reason));
            out.sample(FAIL_CLOSED.name, &label, self.fail_closed.of(reason) as f64);
        }
        out.head(&POOL_CONNECTIONS);
        for (state, n) in POOL_STATES.iter().zip(self.pool.by_state()) {
            out.sample(POOL_CONNECTIONS.name, &format!("state=\"{state}\""), n as f64);
        }
        out.out
    }

    /// What [`Stats::prometheus`] shows for a store not open yet (a standby still waiting):
    /// `pgfence_lease_held` 0 alone.
    pub fn prometheus_not_open(table: &str) -> String {
        let mut out = Text::new(table);
        out.gauge(&LEASE_HELD, 0.0);
        out.out
    }

    fn operations(&self, op: Op) -> &Operations {
        match op {
            Op::Write => &self.writes,
            Op::Remove => &self.removes,
            Op::Batch => &self.batches,
            Op::Read => &self.reads,
            Op::List => &self.lists,
            Op::Flush => &self.flushes,
        }
    }
}

/// A Prometheus text exposition being written; every sample gets the `table` label first.
struct Text {
    out: String,
    table: String,
}

impl Text {
    fn new(table: &str) -> Text {
        // A label value as the text format wants it: backslash, quote and newline escaped.
        let table = table.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n");
        Text { out: String::with_capacity(8 << 10), table }
    }

    fn head(&mut self, metric: &Metric) {
        let Metric { name, kind, help } = metric;
        let _ = write!(self.out, "# HELP {name} {help}\n# TYPE {name} {kind}\n");
    }

    fn gauge(&mut self, metric: &Metric, value: f64) {
        self.head(metric);
        self.sample(metric.name, "", value);
    }

    fn counter(&mut self, metric: &Metric, value: u64) {
        self.head(metric);
        self.sample(metric.name, "", value as f64);
    }

    fn sample(&mut self, name: &str, labels: &str, value: f64) {
        let sep = if labels.is_empty() { "" } else { "," };
        let _ = writeln!(self.out, "{name}{{table=\"{}\"{sep}{labels}}} {value}", self.table);
    }

    /// Cumulative `_bucket` samples with `le`, then `_sum` and `_count`.
    fn histogram(&mut self, name: &str, labels: &str, h: &Histogram) {
        let sep = if labels.is_empty() { "" } else { "," };
        let mut seen = 0;
        let bounds = Histogram::bounds().map(|b| b.as_secs_f64().to_string());
        for (le, n) in bounds.chain(["+Inf".to_owned()]).zip(&h.counts) {
            seen += n;
            let labels = format!("{labels}{sep}le=\"{le}\"");
            self.sample(&format!("{name}_bucket"), &labels, seen as f64);
        }
        self.sample(&format!("{name}_sum"), labels, h.sum.as_secs_f64());
        self.sample(&format!("{name}_count"), labels, h.count as f64);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn before_the_store_opens_only_held_0_is_shown() {
        let text = Stats::prometheus_not_open("a\"b");
        assert!(text.ends_with("pgfence_lease_held{table=\"a\\\"b\"} 0\n"), "{text}");
    }
}
