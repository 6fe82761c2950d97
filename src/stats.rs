//! The store's counters and latency histograms ([`Recorder`]), and the parts of the snapshot
//! that [`crate::PgKvStore::stats`] returns.
//!
//! Recording costs two clock reads, a few relaxed atomic additions and no allocation: about
//! 0.12 µs of CPU per operation (docs/benchmarks-archive.md, "Stats"). So it is always on. The
//! counters are only statistics: nothing reads them to decide anything, which is why relaxed
//! ordering is enough. With the `metrics` feature, every recording also goes to the `metrics`
//! facade (see [`export`] and docs/metrics.md).

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::time::Duration;

use crate::error::LossReason;

/// The upper bounds of the latency buckets, in microseconds; a last bucket takes the rest.
///
/// From 100 µs (a read on a local socket) to 10 s (a retry on a broken connection). The steps
/// are 1-2.5-5 per decade, as Prometheus' defaults are.
const BOUNDS_US: [u64; 16] = [
    100, 250, 500, 1_000, 2_500, 5_000, 10_000, 25_000, 50_000, 100_000, 250_000, 500_000,
    1_000_000, 2_500_000, 5_000_000, 10_000_000,
];

/// The number of buckets: one per bound, and one for everything longer.
const BUCKETS: usize = BOUNDS_US.len() + 1;

/// One exported metric: its name, Prometheus type and help text. The `metrics` feature and
/// [`crate::Stats::prometheus`] both take names from here; docs/metrics.md lists them.
pub(crate) struct Metric {
    pub(crate) name: &'static str,
    pub(crate) kind: &'static str,
    pub(crate) help: &'static str,
}

const fn metric(name: &'static str, kind: &'static str, help: &'static str) -> Metric {
    Metric { name, kind, help }
}

pub(crate) const OPERATIONS: Metric =
    metric("pgfence_operations_total", "counter", "Operations that ran, by kind.");
pub(crate) const OPERATION_ERRORS: Metric = metric(
    "pgfence_operation_errors_total",
    "counter",
    "Operations that returned an error, by kind (a key not found is none).",
);
pub(crate) const OPERATION_DURATION: Metric = metric(
    "pgfence_operation_duration_seconds",
    "histogram",
    "Operation latency from first poll to result, by kind.",
);
pub(crate) const RENEWALS: Metric =
    metric("pgfence_renewals_total", "counter", "Lease renewal attempts, by outcome.");
pub(crate) const RENEWAL_DURATION: Metric = metric(
    "pgfence_renewal_duration_seconds",
    "histogram",
    "Round trips of the confirmed renewals.",
);
pub(crate) const RENEWAL_LAST: Metric =
    metric("pgfence_renewal_last_seconds", "gauge", "Round trip of the last confirmed renewal.");
pub(crate) const SHARED_STATEMENTS: Metric = metric(
    "pgfence_shared_statements_total",
    "counter",
    "Statements shared by concurrent mutations.",
);
pub(crate) const SHARED_MUTATIONS: Metric =
    metric("pgfence_shared_mutations_total", "counter", "Mutations carried by shared statements.");
pub(crate) const RETRIES: Metric =
    metric("pgfence_retries_total", "counter", "Statements retried on a fresh connection.");
pub(crate) const DEFERRED: Metric = metric(
    "pgfence_deferred_total",
    "counter",
    "Deferred writes, removes and batch commits that ran (also counted by kind).",
);
pub(crate) const FAIL_CLOSED: Metric =
    metric("pgfence_fail_closed_total", "counter", "Times the store failed closed, by reason.");
pub(crate) const LEASE_HELD: Metric =
    metric("pgfence_lease_held", "gauge", "1 while this process holds the lease.");
pub(crate) const LEASE_EPOCH: Metric =
    metric("pgfence_lease_epoch", "gauge", "The epoch (fencing token) held or last held.");
pub(crate) const LEASE_DEADLINE: Metric = metric(
    "pgfence_lease_deadline_seconds",
    "gauge",
    "Seconds left until the local deadline, when the store fails closed.",
);
pub(crate) const POOL_CONNECTIONS: Metric =
    metric("pgfence_pool_connections", "gauge", "The store's connection pool, by state.");

/// The values of the `state` label of [`POOL_CONNECTIONS`], in the order of
/// [`PoolStats::by_state`].
pub(crate) const POOL_STATES: [&str; 4] = ["max", "open", "in_use", "waiting"];

/// A latency histogram with fixed buckets, recorded with relaxed atomics.
#[derive(Debug, Default)]
pub(crate) struct Histo {
    buckets: [AtomicU64; BUCKETS],
    sum_us: AtomicU64,
}

impl Histo {
    fn record(&self, took: Duration) {
        let us = u64::try_from(took.as_micros()).unwrap_or(u64::MAX);
        let bucket = BOUNDS_US.partition_point(|&bound| bound < us);
        self.buckets[bucket].fetch_add(1, Relaxed);
        self.sum_us.fetch_add(us, Relaxed);
    }

    fn snapshot(&self) -> Histogram {
        let counts: Vec<u64> = self.buckets.iter().map(|b| b.load(Relaxed)).collect();
        let sum = Duration::from_micros(self.sum_us.load(Relaxed));
        Histogram { count: counts.iter().sum(), sum, counts }
    }
}

/// A latency histogram: how many operations took at most each bound of [`Histogram::bounds`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Histogram {
    /// How many were recorded.
    pub count: u64,
    /// Their total duration (microsecond resolution).
    pub sum: Duration,
    /// Per bucket, not cumulative: `counts[i]` took more than `bounds()[i - 1]` and at most
    /// `bounds()[i]`. The last bucket has no upper bound.
    pub counts: Vec<u64>,
}

impl Histogram {
    /// The upper bounds of the buckets, shortest first. [`Histogram::counts`] has one more
    /// entry, for everything longer than the last.
    pub fn bounds() -> impl ExactSizeIterator<Item = Duration> {
        BOUNDS_US.iter().map(|&us| Duration::from_micros(us))
    }

    /// An upper bound of the `q` quantile (0.0 to 1.0): the bound of the bucket it falls in.
    /// `None` if nothing was recorded, or if it falls in the last bucket, which has no bound.
    pub fn quantile(&self, q: f64) -> Option<Duration> {
        if self.count == 0 {
            return None;
        }
        let rank = ((q.clamp(0.0, 1.0) * self.count as f64).ceil() as u64).max(1);
        let mut seen = 0;
        let bucket = self.counts.iter().position(|&n| {
            seen += n;
            seen >= rank
        })?;
        Histogram::bounds().nth(bucket)
    }
}

/// One kind of operation: writes, removes, batches, reads, lists or flushes.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Operations {
    /// Operations that ran, counted when they end. Input refused before running is not counted.
    pub count: u64,
    /// Of those, the ones that returned an error (`LeaseLost` and `Closed` included).
    pub errors: u64,
    /// How long they took, from the first poll to the result. A write's includes its wait for
    /// the key's turn and for a statement.
    pub latency: Histogram,
}

/// The lease renewals of the renewal thread.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Renewals {
    /// Renewals the database confirmed.
    pub ok: u64,
    /// Attempts that failed, timed out, or found the lease no longer ours.
    pub failed: u64,
    /// The round trip of the last confirmed renewal; `None` before the first.
    pub last_latency: Option<Duration>,
    /// The round trips of the confirmed renewals.
    pub latency: Histogram,
}

/// Statements shared by concurrent mutations of different keys (see
/// [`crate::Builder::write_concurrency`]).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Shared {
    /// Shared statements that ran (two mutations or more each).
    pub statements: u64,
    /// The mutations they carried, all of them counted.
    pub mutations: u64,
}

impl Shared {
    /// Mutations per shared statement, on average; `None` before the first.
    pub fn mutations_per_statement(&self) -> Option<f64> {
        (self.statements > 0).then(|| self.mutations as f64 / self.statements as f64)
    }
}

/// How often the store failed closed, by reason. A store fails closed once at most. These are
/// one store's; exported metrics add up the stores of a process.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
#[non_exhaustive]
pub struct FailClosed {
    /// [`LossReason::Fenced`].
    pub fenced: u64,
    /// [`LossReason::TakenOver`].
    pub taken_over: u64,
    /// [`LossReason::DeadlinePassed`].
    pub deadline_passed: u64,
    /// [`LossReason::WriteOutcomeUnknown`].
    pub write_outcome_unknown: u64,
}

impl FailClosed {
    /// The count for one reason.
    pub fn of(&self, reason: &LossReason) -> u64 {
        match reason {
            LossReason::Fenced => self.fenced,
            LossReason::TakenOver => self.taken_over,
            LossReason::DeadlinePassed => self.deadline_passed,
            LossReason::WriteOutcomeUnknown => self.write_outcome_unknown,
        }
    }
}

/// The store's connection pool (the renewal connection is not in it).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct PoolStats {
    /// The most connections it opens.
    pub max_size: usize,
    /// Connections open now.
    pub size: usize,
    /// Of those, the ones in use.
    pub in_use: usize,
    /// Operations waiting for a connection.
    pub waiting: usize,
}

impl PoolStats {
    /// The four figures in the order of [`POOL_STATES`].
    pub(crate) fn by_state(&self) -> [usize; 4] {
        [self.max_size, self.size, self.in_use, self.waiting]
    }
}

/// An operation kind, for [`Recorder::operation`].
#[derive(Debug, Clone, Copy)]
pub(crate) enum Op {
    Write,
    Remove,
    Batch,
    Read,
    List,
    Flush,
}

impl Op {
    pub(crate) const ALL: [Op; 6] =
        [Op::Write, Op::Remove, Op::Batch, Op::Read, Op::List, Op::Flush];

    /// The `op` label of the exported metrics.
    pub(crate) fn label(self) -> &'static str {
        match self {
            Op::Write => "write",
            Op::Remove => "remove",
            Op::Batch => "batch",
            Op::Read => "read",
            Op::List => "list",
            Op::Flush => "flush",
        }
    }
}

#[derive(Debug, Default)]
struct OpCounters {
    count: AtomicU64,
    errors: AtomicU64,
    latency: Histo,
}

impl OpCounters {
    fn snapshot(&self) -> Operations {
        Operations {
            count: self.count.load(Relaxed),
            errors: self.errors.load(Relaxed),
            latency: self.latency.snapshot(),
        }
    }
}

/// What `u64::MAX` means in [`Recorder::last_renewal_us`]: no renewal yet.
const NONE: u64 = u64::MAX;

/// The counters of one store, shared by its operations and its renewal thread.
#[derive(Debug)]
pub(crate) struct Recorder {
    renewals_ok: AtomicU64,
    renewals_failed: AtomicU64,
    last_renewal_us: AtomicU64,
    renewal: Histo,
    ops: [OpCounters; 6],
    deferred: AtomicU64,
    shared_statements: AtomicU64,
    shared_mutations: AtomicU64,
    retries: AtomicU64,
    fail_closed: [AtomicU64; 4],
    #[cfg(feature = "metrics")]
    export: export::Export,
}

impl Recorder {
    /// The counters of a store of `table` (the `table` label of the exported metrics).
    pub(crate) fn new(table: &str) -> Recorder {
        let _ = table; // Only the exported metrics name it.
        Recorder {
            renewals_ok: AtomicU64::new(0),
            renewals_failed: AtomicU64::new(0),
            last_renewal_us: AtomicU64::new(NONE),
            renewal: Histo::default(),
            ops: Default::default(),
            deferred: AtomicU64::new(0),
            shared_statements: AtomicU64::new(0),
            shared_mutations: AtomicU64::new(0),
            retries: AtomicU64::new(0),
            fail_closed: Default::default(),
            #[cfg(feature = "metrics")]
            export: export::Export::new(table),
        }
    }

    /// An operation of kind `op` ended after `took`, with an error or not.
    pub(crate) fn operation(&self, op: Op, took: Duration, failed: bool) {
        let counters = &self.ops[op as usize];
        counters.count.fetch_add(1, Relaxed);
        if failed {
            counters.errors.fetch_add(1, Relaxed);
        }
        counters.latency.record(took);
        #[cfg(feature = "metrics")]
        self.export.operation(op, took, failed);
    }

    /// A deferred write, remove or batch commit is about to run (it is counted by its kind too,
    /// when it ends).
    pub(crate) fn deferred(&self) {
        self.deferred.fetch_add(1, Relaxed);
        #[cfg(feature = "metrics")]
        self.export.deferred();
    }

    /// A renewal the database confirmed, after a round trip of `took`.
    pub(crate) fn renewed(&self, took: Duration) {
        self.renewals_ok.fetch_add(1, Relaxed);
        let us = u64::try_from(took.as_micros()).unwrap_or(NONE - 1);
        self.last_renewal_us.store(us, Relaxed);
        self.renewal.record(took);
        #[cfg(feature = "metrics")]
        self.export.renewed(took);
    }

    /// A renewal attempt that did not extend the lease.
    pub(crate) fn renewal_failed(&self) {
        self.renewals_failed.fetch_add(1, Relaxed);
        #[cfg(feature = "metrics")]
        self.export.renewal_failed();
    }

    /// One statement carried `mutations` mutations of several callers.
    pub(crate) fn shared(&self, mutations: usize) {
        self.shared_statements.fetch_add(1, Relaxed);
        self.shared_mutations.fetch_add(mutations as u64, Relaxed);
        #[cfg(feature = "metrics")]
        self.export.shared(mutations);
    }

    /// A statement is retried on a fresh connection.
    pub(crate) fn retried(&self) {
        self.retries.fetch_add(1, Relaxed);
        #[cfg(feature = "metrics")]
        self.export.retried();
    }

    /// The store failed closed for `reason` (called once, at the loss).
    pub(crate) fn failed_closed(&self, reason: &LossReason) {
        self.fail_closed[reason_index(reason)].fetch_add(1, Relaxed);
        #[cfg(feature = "metrics")]
        self.export.failed_closed(reason);
    }

    /// The lease's state for the exported gauges: held with `epoch`, or not.
    #[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
    pub(crate) fn lease(&self, held: bool, epoch: i64) {
        #[cfg(feature = "metrics")]
        self.export.lease(held, epoch);
    }

    /// Time left to the local deadline, for the exported gauge. The renewal thread calls it
    /// whenever it wakes, at least once a second.
    #[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
    pub(crate) fn deadline_in(&self, left: Duration) {
        #[cfg(feature = "metrics")]
        self.export.deadline_in(left);
    }

    /// The pool's state, for the exported gauges; called after each operation with the feature.
    #[cfg_attr(not(feature = "metrics"), allow(unused_variables))]
    pub(crate) fn pool(&self, pool: &PoolStats) {
        #[cfg(feature = "metrics")]
        self.export.pool(pool);
    }

    pub(crate) fn renewals(&self) -> Renewals {
        let last = self.last_renewal_us.load(Relaxed);
        Renewals {
            ok: self.renewals_ok.load(Relaxed),
            failed: self.renewals_failed.load(Relaxed),
            last_latency: (last != NONE).then(|| Duration::from_micros(last)),
            latency: self.renewal.snapshot(),
        }
    }

    pub(crate) fn operations(&self, op: Op) -> Operations {
        self.ops[op as usize].snapshot()
    }

    pub(crate) fn shared_stats(&self) -> Shared {
        Shared {
            statements: self.shared_statements.load(Relaxed),
            mutations: self.shared_mutations.load(Relaxed),
        }
    }

    pub(crate) fn retries(&self) -> u64 {
        self.retries.load(Relaxed)
    }

    pub(crate) fn deferred_count(&self) -> u64 {
        self.deferred.load(Relaxed)
    }

    pub(crate) fn fail_closed(&self) -> FailClosed {
        let n = |reason| self.fail_closed[reason_index(&reason)].load(Relaxed);
        FailClosed {
            fenced: n(LossReason::Fenced),
            taken_over: n(LossReason::TakenOver),
            deadline_passed: n(LossReason::DeadlinePassed),
            write_outcome_unknown: n(LossReason::WriteOutcomeUnknown),
        }
    }
}

fn reason_index(reason: &LossReason) -> usize {
    match reason {
        LossReason::Fenced => 0,
        LossReason::TakenOver => 1,
        LossReason::DeadlinePassed => 2,
        LossReason::WriteOutcomeUnknown => 3,
    }
}

/// The `reason` label of [`FAIL_CLOSED`].
pub(crate) fn reason_label(reason: &LossReason) -> &'static str {
    match reason {
        LossReason::Fenced => "fenced",
        LossReason::TakenOver => "taken_over",
        LossReason::DeadlinePassed => "deadline_passed",
        LossReason::WriteOutcomeUnknown => "write_outcome_unknown",
    }
}

/// Every reason, in the order of [`reason_index`].
pub(crate) const REASONS: [LossReason; 4] = [
    LossReason::Fenced,
    LossReason::TakenOver,
    LossReason::DeadlinePassed,
    LossReason::WriteOutcomeUnknown,
];

/// The `metrics` facade: the same recordings, as metrics of the application's recorder.
///
/// Handles are registered once, when the store opens. So install the recorder (a Prometheus
/// exporter, say) before opening a store. The names and labels are documented in
/// docs/metrics.md. The epoch is a gauge's value, never a label: a label per epoch would make
/// a new series at every failover.
#[cfg(feature = "metrics")]
mod export {
    use std::time::Duration;

    use metrics::{
        Counter, Gauge, Histogram, Unit, counter, describe_counter, describe_gauge,
        describe_histogram, gauge, histogram,
    };

    use super::{
        DEFERRED, FAIL_CLOSED, LEASE_DEADLINE, LEASE_EPOCH, LEASE_HELD, OPERATION_DURATION,
        OPERATION_ERRORS, OPERATIONS, Op, POOL_CONNECTIONS, POOL_STATES, PoolStats, REASONS,
        RENEWAL_DURATION, RENEWAL_LAST, RENEWALS, RETRIES, SHARED_MUTATIONS, SHARED_STATEMENTS,
        reason_index, reason_label,
    };
    use crate::error::LossReason;

    #[derive(Debug)]
    struct OpHandles {
        count: Counter,
        errors: Counter,
        latency: Histogram,
    }

    #[derive(Debug)]
    pub(super) struct Export {
        ops: Vec<OpHandles>,
        renewals_ok: Counter,
        renewals_failed: Counter,
        renewal: Histogram,
        renewal_last: Gauge,
        shared_statements: Counter,
        shared_mutations: Counter,
        retries: Counter,
        deferred: Counter,
        fail_closed: Vec<Counter>,
        held: Gauge,
        epoch: Gauge,
        deadline: Gauge,
        pool: [Gauge; 4],
    }

    /// Describes every metric to the recorder: its `# HELP` line in Prometheus.
    fn describe() {
        for m in [OPERATIONS, OPERATION_ERRORS, RENEWALS, SHARED_STATEMENTS, SHARED_MUTATIONS] {
            describe_counter!(m.name, m.help);
        }
        for m in [RETRIES, DEFERRED, FAIL_CLOSED] {
            describe_counter!(m.name, m.help);
        }
        for m in [OPERATION_DURATION, RENEWAL_DURATION] {
            describe_histogram!(m.name, Unit::Seconds, m.help);
        }
        describe_gauge!(RENEWAL_LAST.name, Unit::Seconds, RENEWAL_LAST.help);
        describe_gauge!(LEASE_DEADLINE.name, Unit::Seconds, LEASE_DEADLINE.help);
        for m in [LEASE_HELD, LEASE_EPOCH, POOL_CONNECTIONS] {
            describe_gauge!(m.name, m.help);
        }
    }

    impl Export {
        pub(super) fn new(table: &str) -> Export {
            describe();
            let t = table.to_owned();
            let ops = Op::ALL
                .iter()
                .map(|op| OpHandles {
                    count: counter!(OPERATIONS.name, "table" => t.clone(),
                        "op" => op.label()),
                    errors: counter!(OPERATION_ERRORS.name, "table" => t.clone(),
                        "op" => op.label()),
                    latency: histogram!(OPERATION_DURATION.name,
                        "table" => t.clone(), "op" => op.label()),
                })
                .collect();
            let fail_closed = REASONS
                .iter()
                .map(|reason| {
                    counter!(FAIL_CLOSED.name, "table" => t.clone(),
                        "reason" => reason_label(reason))
                })
                .collect();
            let pool = |state: &'static str| gauge!(POOL_CONNECTIONS.name, "table" => t.clone(), "state" => state);
            Export {
                ops,
                renewals_ok: counter!(RENEWALS.name, "table" => t.clone(),
                    "outcome" => "ok"),
                renewals_failed: counter!(RENEWALS.name, "table" => t.clone(),
                    "outcome" => "failed"),
                renewal: histogram!(RENEWAL_DURATION.name, "table" => t.clone()),
                renewal_last: gauge!(RENEWAL_LAST.name, "table" => t.clone()),
                shared_statements: counter!(SHARED_STATEMENTS.name,
                    "table" => t.clone()),
                shared_mutations: counter!(SHARED_MUTATIONS.name,
                    "table" => t.clone()),
                retries: counter!(RETRIES.name, "table" => t.clone()),
                deferred: counter!(DEFERRED.name, "table" => t.clone()),
                fail_closed,
                held: gauge!(LEASE_HELD.name, "table" => t.clone()),
                epoch: gauge!(LEASE_EPOCH.name, "table" => t.clone()),
                deadline: gauge!(LEASE_DEADLINE.name, "table" => t.clone()),
                pool: POOL_STATES.map(pool),
            }
        }

        pub(super) fn operation(&self, op: Op, took: Duration, failed: bool) {
            let handles = &self.ops[op as usize];
            handles.count.increment(1);
            if failed {
                handles.errors.increment(1);
            }
            handles.latency.record(took.as_secs_f64());
        }

        pub(super) fn renewed(&self, took: Duration) {
            self.renewals_ok.increment(1);
            self.renewal.record(took.as_secs_f64());
            self.renewal_last.set(took.as_secs_f64());
        }

        pub(super) fn renewal_failed(&self) {
            self.renewals_failed.increment(1);
        }

        pub(super) fn shared(&self, mutations: usize) {
            self.shared_statements.increment(1);
            self.shared_mutations.increment(mutations as u64);
        }

        pub(super) fn retried(&self) {
            self.retries.increment(1);
        }

        pub(super) fn deferred(&self) {
            self.deferred.increment(1);
        }

        pub(super) fn failed_closed(&self, reason: &LossReason) {
            self.fail_closed[reason_index(reason)].increment(1);
        }

        pub(super) fn lease(&self, held: bool, epoch: i64) {
            self.held.set(if held { 1.0 } else { 0.0 });
            self.epoch.set(epoch as f64);
            if !held {
                self.deadline.set(0.0);
            }
        }

        pub(super) fn deadline_in(&self, left: Duration) {
            self.deadline.set(left.as_secs_f64());
        }

        pub(super) fn pool(&self, pool: &PoolStats) {
            for (gauge, n) in self.pool.iter().zip(pool.by_state()) {
                gauge.set(n as f64);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_and_quantiles() {
        let h = Histo::default();
        assert_eq!(h.snapshot().quantile(0.5), None);
        for us in [50, 100, 101, 3_000, 20_000_000] {
            h.record(Duration::from_micros(us));
        }
        let s = h.snapshot();
        assert_eq!(s.count, 5);
        assert_eq!(s.counts.len(), Histogram::bounds().len() + 1);
        assert_eq!(s.counts[0], 2, "50 µs and 100 µs are at most 100 µs");
        assert_eq!(s.counts[1], 1);
        assert_eq!(s.counts[5], 1, "3 ms is in (2.5 ms, 5 ms]");
        assert_eq!(s.counts[BUCKETS - 1], 1);
        assert_eq!(s.quantile(0.4), Some(Duration::from_micros(100)));
        assert_eq!(s.quantile(0.8), Some(Duration::from_millis(5)));
        assert_eq!(s.quantile(1.0), None, "in the unbounded bucket");
        assert_eq!(s.sum, Duration::from_micros(50 + 100 + 101 + 3_000 + 20_000_000));
    }
}
