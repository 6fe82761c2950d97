//! What `PgKvStore::stats()` costs: the recordings of one write, one shared statement and one
//! renewal, in nanoseconds, without a database.
//!
//! The store's own recorder is compiled in from `src/stats.rs` (by `#[path]`), with the same
//! features as the library. So this measures the library's code, not a copy. Only the few lines
//! of `Executor::record` and `admitted` (src/exec.rs) around it are copied here.
//!
//! - `write`: what every write, remove, batch and read records. Two clock reads (start and end),
//!   then `Recorder::operation`: three or four relaxed atomic additions. With the `metrics`
//!   feature, the same values also go through the facade, and the pool's gauges are set from
//!   the pool's status (one lock of the pool's mutex). No `metrics` recorder is installed here:
//!   the facade's handles are no-ops, as in an application without an exporter.
//! - `write_exported` (`metrics` feature only): the same, with a recorder of plain atomics
//!   installed. An exporter's own recording (Prometheus, StatsD) costs what it costs on top.
//! - `write_2_threads`: `write` on two threads at once, on one store's counters, which then
//!   bounce between the cores' caches. Time per recording per thread. On a loaded machine the
//!   two threads may seldom run at the same moment, so this may miss some of the contention.
//! - `shared`: what one statement shared by several writes adds.
//! - `renewal`: what one confirmed renewal records (every `renew_interval`, 10 s by default),
//!   and the time left that the renewal thread sets whenever it wakes (at least once a second).
//! - `clock`: the two clock reads alone, for scale.
//!
//! Every figure is CPU time per recording (the thread's CPU clock), so the machine's load
//! inflates it far less than wall time. `cargo bench --bench stats`, then
//! `cargo bench --features metrics --bench stats`.
//! docs/benchmarks-archive.md ("Stats") compares the results with a fenced write's latency.

#[path = "../src/stats.rs"]
// Unused here: the snapshot side, and the imports of the unit tests module.
#[allow(dead_code, unused_imports)]
mod stats;

/// What `src/stats.rs` imports from the library's `error` module. Its own `LossReason`, with
/// the library's variants: the library's is `#[non_exhaustive]`, so its matches in
/// `src/stats.rs` only compile in the library. No bench records a loss.
mod error {
    #[derive(Debug, Clone, PartialEq, Eq)]
    pub(crate) enum LossReason {
        Fenced,
        TakenOver,
        DeadlinePassed,
        WriteOutcomeUnknown,
    }
}

use std::hint::black_box;
use std::sync::Barrier;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use pgfence::deadpool_postgres::{Manager, Pool};
use rustix::time::{ClockId, clock_gettime};
use stats::{Op, PoolStats, Recorder};

/// A pool like the store's, never connected: `Pool::status` only reads its counters.
fn pool() -> Pool {
    let manager =
        Manager::new(pgfence::tokio_postgres::Config::new(), pgfence::tokio_postgres::NoTls);
    Pool::builder(manager).max_size(4).build().expect("a pool")
}

/// `Executor::pool_stats` (src/exec.rs).
fn pool_stats(pool: &Pool) -> PoolStats {
    let status = pool.status();
    PoolStats {
        max_size: status.max_size,
        size: status.size,
        in_use: status.size.saturating_sub(status.available),
        waiting: status.waiting,
    }
}

/// What `admitted` and `Executor::record` (src/exec.rs) do around one write: the clock read
/// before it, and the recording after it. `work` stands for the write itself.
fn recorded_write(stats: &Recorder, pool: &Pool, work: impl FnOnce() -> bool) {
    let started = Instant::now();
    let failed = work();
    stats.operation(Op::Write, started.elapsed(), failed);
    if cfg!(feature = "metrics") {
        stats.pool(&pool_stats(pool));
    }
}

/// The CPU time this thread spends running `f` `iters` times. Not the wall time: on a loaded
/// machine that counts the time the thread waits for a core, several times the work itself.
fn cpu_time(iters: u64, mut f: impl FnMut()) -> Duration {
    let began = thread_cpu();
    for _ in 0..iters {
        f();
    }
    thread_cpu().saturating_sub(began)
}

fn thread_cpu() -> Duration {
    let t = clock_gettime(ClockId::ThreadCPUTime);
    Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
}

fn stats(c: &mut Criterion) {
    let pool = pool();
    let recorder = Recorder::new("bench");
    let mut group = c.benchmark_group("stats");

    group.bench_function("clock", |b| {
        b.iter_custom(|iters| {
            cpu_time(iters, || {
                let started = Instant::now();
                black_box(started.elapsed());
            })
        })
    });

    group.bench_function("write", |b| {
        b.iter_custom(|iters| {
            cpu_time(iters, || recorded_write(&recorder, &pool, || black_box(false)))
        })
    });

    #[cfg(feature = "metrics")]
    {
        let exporter = exporter::Atomics::default();
        let exported = metrics::with_local_recorder(&exporter, || Recorder::new("bench"));
        group.bench_function("write_exported", |b| {
            b.iter_custom(|iters| {
                cpu_time(iters, || recorded_write(&exported, &pool, || black_box(false)))
            })
        });
        assert!(exporter.recorded() > 0, "the recorder received the recordings");
    }

    group.bench_function("write_2_threads", |b| {
        b.iter_custom(|iters| {
            let start = Barrier::new(2);
            let per_thread: Vec<Duration> = std::thread::scope(|s| {
                let threads: Vec<_> = (0..2)
                    .map(|_| {
                        s.spawn(|| {
                            start.wait();
                            cpu_time(iters, || {
                                recorded_write(&recorder, &pool, || black_box(false))
                            })
                        })
                    })
                    .collect();
                threads.into_iter().map(|t| t.join().expect("a recording thread")).collect()
            });
            per_thread.into_iter().max().expect("two threads")
        })
    });

    group.bench_function("shared", |b| {
        b.iter_custom(|iters| cpu_time(iters, || recorder.shared(black_box(4))))
    });

    group.bench_function("renewal", |b| {
        // The renewal thread's part (src/lease/keeper.rs): the time left when it wakes, and
        // the round trip of the confirmed renewal, from a clock read after it.
        b.iter_custom(|iters| {
            cpu_time(iters, || {
                let started = Instant::now();
                recorder.deadline_in(black_box(Duration::from_secs(20)));
                recorder.renewed(started.elapsed());
            })
        })
    });

    group.finish();
    let writes = recorder.operations(Op::Write).count;
    assert!(writes > 0, "the recorder counted the writes");
}

/// A `metrics` recorder of plain atomics: about the cheapest an exporter can record.
#[cfg(feature = "metrics")]
mod exporter {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

    use metrics::{
        Counter, Gauge, Histogram, HistogramFn, Key, KeyName, Metadata, SharedString, Unit,
    };

    /// Prometheus' default buckets, in seconds.
    const BOUNDS: [f64; 11] = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0];

    #[derive(Default)]
    pub(super) struct Buckets {
        counts: [AtomicU64; BOUNDS.len() + 1],
        sum_ns: AtomicU64,
    }

    impl HistogramFn for Buckets {
        fn record(&self, seconds: f64) {
            let bucket = BOUNDS.partition_point(|&bound| bound < seconds);
            self.counts[bucket].fetch_add(1, Relaxed);
            self.sum_ns.fetch_add((seconds * 1e9) as u64, Relaxed);
        }
    }

    #[derive(Default)]
    pub(super) struct Atomics {
        samples: Arc<Buckets>,
    }

    impl Atomics {
        /// How many histogram samples were recorded, all series together.
        pub(super) fn recorded(&self) -> u64 {
            self.samples.counts.iter().map(|c| c.load(Relaxed)).sum()
        }
    }

    impl metrics::Recorder for Atomics {
        fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn register_counter(&self, _: &Key, _: &Metadata<'_>) -> Counter {
            Counter::from_arc(Arc::new(AtomicU64::new(0)))
        }
        fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
            Gauge::from_arc(Arc::new(AtomicU64::new(0)))
        }
        fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> Histogram {
            // One set of buckets for every series: the cost per sample is the same.
            Histogram::from_arc(Arc::clone(&self.samples))
        }
    }
}

fn config() -> Criterion {
    Criterion::default()
        .sample_size(50)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
}

criterion_group! { name = benches; config = config(); targets = stats }
criterion_main!(benches);
