//! Write latency, side by side, on one table shape and one kind of pool, 1 KiB values:
//!
//! - `fenced_write`: `PgKvStore::write` (the fenced single statement).
//! - `unfenced_upsert`: the same upsert without the lease check: the baseline.
//! - `naive_fenced`: a transaction that renews the lease with its own statement, then upserts:
//!   the design the fenced statement replaced.
//! - `read`, `remove`, `batch_100` (a 100-put atomic batch): the store's other operations.
//! - `unfenced_batch_100`: the same 100 puts in one statement without the lease check: the
//!   baseline of `batch_100`.
//!
//! Every write (and every put of a batch) writes a value different in every byte from the
//! key's previous one, like a real state update: PostgreSQL logs only the changed middle of a
//! row updated in place, so rewriting one constant value would hide most of a write's WAL.
//!
//! Each sample times only the awaited operation (`iter_custom`): building values and keys, and
//! the setup of `remove` (writing the key it removes), are outside the timed section, and so is
//! criterion's own executor work between iterations.
//!
//! Runs against `DATABASE_URL`, or a private temporary cluster that is stopped when the bench
//! ends. `PGFENCE_BENCH_DELAY_US=370` puts a delay proxy (370 µs each way: a 1.14-1.41 ms round trip here)
//! between every connection and the server.
//!
//! `cargo bench --bench write_latency` (add `-- fenced` etc. to pick benchmarks).

#[path = "../pgfence-testing/examples/support/mod.rs"]
mod support;

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{Criterion, criterion_group, criterion_main};
use pgfence::PgKvStore;
use pgfence_testing::{Proxy, TestServer, unique_name};
use support::{Baseline, NS, SUB};
use tokio::runtime::Runtime;

const VALUE_SIZE: usize = 1024;
/// Keys each write benchmark cycles through, all created before timing starts, so every timed
/// write is an update of an existing row (the steady state of a KV store).
const KEYS: usize = 1024;
const POOL_SIZE: usize = 4;
const TTL: Duration = Duration::from_secs(30);

struct Fixture {
    rt: Runtime,
    store: PgKvStore,
    baseline: Baseline,
    value: Vec<u8>,
    /// The delay proxy and the runtime its tasks run on (apart from the measured runtime, so
    /// forwarding never competes with the client for the measured thread).
    _proxy: Option<(Proxy, Runtime)>,
}

impl Fixture {
    fn new() -> Fixture {
        let server =
            TestServer::shared().expect("a PostgreSQL server (DATABASE_URL or local binaries)");
        let delay_us: u64 = std::env::var("PGFENCE_BENCH_DELAY_US")
            .ok()
            .map(|v| v.parse().expect("PGFENCE_BENCH_DELAY_US: microseconds"))
            .unwrap_or(0);
        let (config, proxy) = if delay_us > 0 {
            let proxy_rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .enable_all()
                .build()
                .expect("proxy runtime");
            let upstream = server.tcp_addr().expect("the server's TCP address");
            let proxy = proxy_rt.block_on(Proxy::start(upstream)).expect("start the delay proxy");
            proxy.set_delay(Duration::from_micros(delay_us));
            (server.config_via(proxy.addr()), Some((proxy, proxy_rt)))
        } else {
            (server.config(), None)
        };
        // One thread: the measured operation and its connection task share it, so a sample has
        // no cross-thread wake-ups in it (the same for every benchmark).
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("rt");
        let table = unique_name("bench");
        let store = rt
            .block_on(
                PgKvStore::builder_from_config(config.clone())
                    .table(&table)
                    .pool_size(POOL_SIZE)
                    .lease_ttl(TTL)
                    .open(),
            )
            .expect("open the store");
        let baseline = Baseline::new(&store, &table, support::pool(config, POOL_SIZE), TTL);
        let value = support::value(VALUE_SIZE, 1);
        // Create every key the write benchmarks will update (one batch per prefix).
        for prefix in ["f", "u", "n", "b", "v"] {
            let mut batch = store.batch();
            for i in 0..KEYS {
                batch = batch.put(NS, SUB, &format!("{prefix}{i}"), value.clone());
            }
            rt.block_on(batch.commit()).expect("create the keys");
        }
        // Steady state: statistics as autovacuum would have gathered them. On a table that was
        // never analyzed, PostgreSQL 15 may serve point reads from the pagination index and
        // filter the whole namespace (see docs/benchmarks-archive.md, "Surprises").
        rt.block_on(analyze(&baseline, &table)).expect("ANALYZE the table");
        Fixture { rt, store, baseline, value, _proxy: proxy }
    }
}

async fn analyze(baseline: &Baseline, table: &str) -> Result<(), support::BoxError> {
    let client = baseline.pool.get().await?;
    client.batch_execute(&format!("ANALYZE \"{table}\"")).await?;
    Ok(())
}

fn write_latency(c: &mut Criterion) {
    let fixture = Fixture::new();
    // The timed futures borrow the fixture (`async move` moves the reference in).
    let f = &fixture;
    let mut group = c.benchmark_group("write_latency");

    group.bench_function("fenced_write", |b| {
        b.to_async(&f.rt).iter_custom(|iters| async move {
            let mut total = Duration::ZERO;
            for i in 0..iters {
                let (key, value) =
                    (format!("f{}", i as usize % KEYS), support::value(VALUE_SIZE, i));
                let start = Instant::now();
                f.store.write(NS, SUB, &key, value).await.expect("fenced write");
                total += start.elapsed();
            }
            total
        })
    });

    group.bench_function("unfenced_upsert", |b| {
        b.to_async(&f.rt).iter_custom(|iters| async move {
            let mut total = Duration::ZERO;
            for i in 0..iters {
                let (key, value) =
                    (format!("u{}", i as usize % KEYS), support::value(VALUE_SIZE, i));
                let start = Instant::now();
                f.baseline.unfenced(&key, &value).await.expect("unfenced upsert");
                total += start.elapsed();
            }
            total
        })
    });

    group.bench_function("naive_fenced", |b| {
        b.to_async(&f.rt).iter_custom(|iters| async move {
            let mut total = Duration::ZERO;
            for i in 0..iters {
                let (key, value) =
                    (format!("n{}", i as usize % KEYS), support::value(VALUE_SIZE, i));
                let start = Instant::now();
                f.baseline.naive(&key, &value).await.expect("naive fenced write");
                total += start.elapsed();
            }
            total
        })
    });

    group.bench_function("read", |b| {
        b.to_async(&f.rt).iter_custom(|iters| async move {
            let mut total = Duration::ZERO;
            for i in 0..iters {
                let key = format!("f{}", i as usize % KEYS);
                let start = Instant::now();
                black_box(f.store.read(NS, SUB, &key).await.expect("read"));
                total += start.elapsed();
            }
            total
        })
    });

    group.bench_function("remove", |b| {
        b.to_async(&f.rt).iter_custom(|iters| async move {
            let mut total = Duration::ZERO;
            for i in 0..iters {
                // Untimed: make sure there is a row to remove.
                let key = format!("r{}", i as usize % KEYS);
                f.store.write(NS, SUB, &key, f.value.clone()).await.expect("write before remove");
                let start = Instant::now();
                f.store.remove(NS, SUB, &key, false).await.expect("remove");
                total += start.elapsed();
            }
            total
        })
    });

    group.bench_function("batch_100", |b| {
        b.to_async(&f.rt).iter_custom(|iters| async move {
            let mut total = Duration::ZERO;
            for i in 0..iters {
                // Untimed: building the batch (key and value copies, validation).
                let mut batch = f.store.batch();
                for j in 0..100 {
                    let key = format!("b{}", (i as usize * 100 + j) % KEYS);
                    batch =
                        batch.put(NS, SUB, &key, support::value(VALUE_SIZE, i * 100 + j as u64));
                }
                let start = Instant::now();
                batch.commit().await.expect("batch of 100");
                total += start.elapsed();
            }
            total
        })
    });

    group.bench_function("unfenced_batch_100", |b| {
        b.to_async(&f.rt).iter_custom(|iters| async move {
            let mut total = Duration::ZERO;
            for i in 0..iters {
                // Untimed, as for `batch_100`: the keys in the order the store sends them.
                let mut puts: Vec<(String, Vec<u8>)> = (0..100)
                    .map(|j| {
                        let key = format!("v{}", (i as usize * 100 + j) % KEYS);
                        (key, support::value(VALUE_SIZE, i * 100 + j as u64))
                    })
                    .collect();
                puts.sort();
                let start = Instant::now();
                f.baseline.unfenced_batch(&puts).await.expect("unfenced batch of 100");
                total += start.elapsed();
            }
            total
        })
    });

    group.finish();
    f.rt.block_on(f.store.close()).expect("close the store");
}

fn config() -> Criterion {
    // Short by default: the whole run takes about a minute on 2 cores. The numbers that count
    // are the ratios between benchmarks of one run, not their absolute values.
    Criterion::default()
        .sample_size(20)
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(4))
}

criterion_group! { name = benches; config = config(); targets = write_latency }
criterion_main!(benches);
