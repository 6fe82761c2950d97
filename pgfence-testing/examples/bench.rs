//! Side-by-side write benchmark: the fenced write against an unfenced upsert (and the naive
//! two-statement design) in one run, at several numbers of concurrent writers.
//!
//! ```text
//! cargo run --release -p pgfence-testing --example bench -- [--concurrency 1,4,16]
//!     [--value-size 1024] [--duration-secs 5] [--rounds 3] [--delay-us N] [--unix] [--json]
//!     [--database-url URL] [--variants unfenced,fenced,solo,pinned,naive]
//!     [--renew-probe-ms 50] [--sample-waits] [--keys-per-writer 64] [--write-concurrency N]
//!     [--pool-mode session|transaction]
//! ```
//!
//! Without `--database-url` (or `DATABASE_URL`) it starts a private temporary PostgreSQL cluster
//! (from the server binaries on the machine, see `pgfence_testing`) and stops it at the end. On
//! a given server it drops its `bench_*` tables at the end, also after a failure. `--delay-us N`
//! routes every connection through a loopback TCP proxy that delays each direction by N µs
//! (`--delay-us 370` gave a 1.14-1.26 ms round trip here); `--unix` connects to the private cluster over its
//! Unix socket instead of TCP.
//!
//! Variants, all on the store's own table, with pools of one kind and size:
//!
//! - `unfenced`: `INSERT .. ON CONFLICT DO UPDATE`, one prepared statement: the baseline.
//! - `fenced`: `PgKvStore::write`: the fenced statement, shared by the writes that queue while
//!   `write_concurrency` statements are busy (`--write-concurrency`, default the store's). With
//!   `--pool-mode transaction` the store sends it unnamed, parsed and planned on every write
//!   (`Builder::pool_mode`): on a direct connection, the cost of running behind a transaction
//!   pooler, without the pooler.
//! - `solo`: the store's fenced single-key statement, one per write, never shared: what
//!   `PgKvStore::write` did before write coalescing (raw SQL with the store's owner id).
//! - `pinned`: `solo` with a CTE that sets `synchronous_commit` for its transaction: what a
//!   pin in every statement would cost, against the store's pin per session.
//! - `naive`: `BEGIN`, renew the lease with an `UPDATE`, upsert, `COMMIT`: the design the
//!   fenced statement replaced.
//!
//! Each concurrency level runs every variant for `--duration-secs`, split into `--rounds`
//! interleaved slices (unfenced, fenced, naive, unfenced, ...) so that drift in the machine's
//! load hits every variant alike. Reported per variant: throughput, latency percentiles, WAL
//! bytes and MultiXacts per write, and the latency of a lease renewal (the store's `RENEW`
//! statement on a connection of its own, every `--renew-probe-ms`) timed while the writers run.
//! `--sample-waits` also samples `pg_stat_activity` wait events of the writers' backends.
//!
//! With `--json`, prints one JSON object on stdout (the tables go to stderr); see
//! `scripts/bench_chart.py` for the chart made from it.

#[path = "support/mod.rs"]
mod support;

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::{SocketAddr, ToSocketAddrs};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use pgfence::PgKvStore;
use pgfence_testing::{Proxy, TestCluster, unique_name};
use support::{Baseline, BoxError, NS, SUB, json_str, percentile};
use tokio::sync::watch;
use tokio_postgres::config::Host;

const USAGE: &str = "usage: bench [--concurrency 1,4,16] [--value-size 1024] [--duration-secs 5] \
[--rounds 3] [--delay-us N] [--unix] [--json] [--database-url URL] \
[--variants unfenced,fenced,solo,pinned,naive] [--renew-probe-ms 50] [--sample-waits] \
[--keys-per-writer 64] [--write-concurrency N] [--pool-mode session|transaction]";

#[derive(Debug, Clone)]
struct Args {
    concurrency: Vec<usize>,
    value_size: usize,
    duration: Duration,
    rounds: u32,
    delay_us: u64,
    unix: bool,
    json: bool,
    database_url: Option<String>,
    variants: Vec<Variant>,
    renew_probe: Option<Duration>,
    sample_waits: bool,
    keys_per_writer: usize,
    /// `--write-concurrency`: the store's `Builder::write_concurrency` (its default if absent).
    write_concurrency: Option<usize>,
    /// `--pool-mode`: the store's `Builder::pool_mode`.
    pool_mode: pgfence::PoolMode,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Variant {
    Unfenced,
    Fenced,
    Solo,
    Pinned,
    Naive,
}

impl Variant {
    fn name(self) -> &'static str {
        match self {
            Variant::Unfenced => "unfenced",
            Variant::Fenced => "fenced",
            Variant::Solo => "solo",
            Variant::Pinned => "pinned",
            Variant::Naive => "naive",
        }
    }

    fn parse(s: &str) -> Result<Variant, String> {
        match s {
            "unfenced" => Ok(Variant::Unfenced),
            "fenced" => Ok(Variant::Fenced),
            "solo" => Ok(Variant::Solo),
            "pinned" => Ok(Variant::Pinned),
            "naive" => Ok(Variant::Naive),
            other => Err(format!("unknown variant {other:?}")),
        }
    }
}

fn parse_args() -> Result<Option<Args>, String> {
    let mut args = Args {
        concurrency: vec![1, 4, 16],
        value_size: 1024,
        duration: Duration::from_secs(5),
        rounds: 3,
        delay_us: 0,
        unix: false,
        json: false,
        database_url: None,
        variants: vec![Variant::Unfenced, Variant::Fenced, Variant::Naive],
        renew_probe: Some(Duration::from_millis(50)),
        sample_waits: false,
        keys_per_writer: 64,
        write_concurrency: None,
        pool_mode: pgfence::PoolMode::Session,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut value = |name: &str| it.next().ok_or_else(|| format!("{name} needs a value"));
        let number = |name: &str, v: String| -> Result<u64, String> {
            v.parse().map_err(|_| format!("{name}: not a number: {v:?}"))
        };
        match flag.as_str() {
            "--concurrency" => {
                args.concurrency = value(&flag)?
                    .split(',')
                    .map(|c| c.trim().parse().map_err(|_| format!("--concurrency: {c:?}")))
                    .collect::<Result<_, _>>()?;
                if args.concurrency.contains(&0) {
                    return Err("--concurrency: 0 writers".into());
                }
            }
            "--value-size" => args.value_size = number(&flag, value(&flag)?)? as usize,
            "--duration-secs" => {
                let secs: f64 = value(&flag)?.parse().map_err(|_| "--duration-secs: a number")?;
                args.duration = Duration::from_secs_f64(secs);
            }
            "--rounds" => args.rounds = number(&flag, value(&flag)?)?.max(1) as u32,
            "--delay-us" => args.delay_us = number(&flag, value(&flag)?)?,
            "--unix" => args.unix = true,
            "--json" => args.json = true,
            "--database-url" => args.database_url = Some(value(&flag)?),
            "--variants" => {
                args.variants = value(&flag)?
                    .split(',')
                    .map(|v| Variant::parse(v.trim()))
                    .collect::<Result<_, _>>()?;
                args.variants.sort();
                args.variants.dedup();
            }
            "--renew-probe-ms" => {
                let ms = number(&flag, value(&flag)?)?;
                args.renew_probe = (ms > 0).then(|| Duration::from_millis(ms));
            }
            "--sample-waits" => args.sample_waits = true,
            "--keys-per-writer" => {
                args.keys_per_writer = number(&flag, value(&flag)?)?.max(1) as usize
            }
            "--write-concurrency" => {
                args.write_concurrency = Some(number(&flag, value(&flag)?)?.max(1) as usize)
            }
            "--pool-mode" => {
                args.pool_mode = match value(&flag)?.as_str() {
                    "session" => pgfence::PoolMode::Session,
                    "transaction" => pgfence::PoolMode::Transaction,
                    other => return Err(format!("--pool-mode: {other:?}")),
                }
            }
            "-h" | "--help" => return Ok(None),
            other => return Err(format!("unknown argument {other:?}\n{USAGE}")),
        }
    }
    if args.database_url.is_none() {
        // libpq's tools read it too; an empty value counts as unset.
        args.database_url = std::env::var("DATABASE_URL").ok().filter(|url| !url.is_empty());
    }
    if args.unix && (args.database_url.is_some() || args.delay_us > 0) {
        return Err("--unix is for the private cluster without --delay-us (for your own server, \
                    give a socket directory as the host in --database-url or DATABASE_URL)"
            .into());
    }
    Ok(Some(args))
}

fn main() {
    support::main("bench", USAGE, parse_args(), run);
}

/// Where the server is, and what must stay alive (and be stopped at the end) to reach it.
struct Target {
    config: tokio_postgres::Config,
    transport: String,
    /// The private cluster; dropping it stops the server and deletes its files.
    _cluster: Option<TestCluster>,
    /// The delay proxy, with the runtime its tasks run on.
    _proxy: Option<(Proxy, tokio::runtime::Runtime)>,
}

fn target(args: &Args) -> Result<Target, BoxError> {
    let (mut config, cluster) = support::server(args.database_url.as_deref())?;
    let mut transport = match config.get_hosts().first() {
        Some(Host::Unix(path)) => format!("unix socket {}", path.display()),
        Some(Host::Tcp(host)) => {
            format!("tcp {host}:{}", config.get_ports().first().unwrap_or(&5432))
        }
        None => "default host".to_owned(),
    };
    if args.unix {
        let cluster = cluster.as_ref().expect("--unix is refused with --database-url");
        // pgfence_testing lays a private cluster out as `<root>/data` and `<root>/sock`.
        let socket_dir = cluster.data_dir().parent().ok_or("cluster without a root")?.join("sock");
        let mut unix = cluster.config();
        unix.host_path(&socket_dir);
        transport = format!("unix socket {}", socket_dir.display());
        config = unix;
    }
    let mut proxy = None;
    if args.delay_us > 0 {
        let upstream = tcp_addr(&config)?;
        let proxy_rt =
            tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build()?;
        let delay_proxy = proxy_rt.block_on(Proxy::start(upstream))?;
        delay_proxy.set_delay(Duration::from_micros(args.delay_us));
        transport = format!(
            "tcp via delay proxy {} -> {upstream}, {} µs each way",
            delay_proxy.addr(),
            args.delay_us
        );
        config = pgfence_testing::redirect(&config, delay_proxy.addr());
        proxy = Some((delay_proxy, proxy_rt));
    }
    Ok(Target { config, transport, _cluster: cluster, _proxy: proxy })
}

fn tcp_addr(config: &tokio_postgres::Config) -> Result<SocketAddr, BoxError> {
    let port = config.get_ports().first().copied().unwrap_or(5432);
    match config.get_hosts().first() {
        Some(Host::Tcp(host)) => Ok((host.as_str(), port)
            .to_socket_addrs()?
            .next()
            .ok_or_else(|| format!("{host} has no address"))?),
        _ => Err("--delay-us needs a TCP host".into()),
    }
}

/// The measurements of one variant at one concurrency, over all its rounds.
#[derive(Debug, Default)]
struct Measured {
    latencies: Vec<Duration>,
    elapsed: Duration,
    renewals: Vec<Duration>,
    /// Renewals of the probe that commits with `synchronous_commit = off`.
    renewals_async: Vec<Duration>,
    renewal_errors: usize,
    waits: BTreeMap<String, u64>,
    wal_bytes: i64,
    multixacts: i64,
    server_cpu: Option<Duration>,
    client_cpu: Option<Duration>,
}

/// Server-side counters read before and after each slice.
struct Counters {
    wal_lsn: i64,
    mxid_age: i64,
    /// CPU time of the whole server (postmaster and every child), when it runs on this machine.
    server_cpu: Option<Duration>,
    /// CPU time of this process (the client side: driver, pool, store, bench loop).
    client_cpu: Option<Duration>,
}

fn run(args: Args) -> Result<(), BoxError> {
    let target = target(&args)?;
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let result = runtime.block_on(bench(&args, &target));
    // The runtime goes first (its connections to the proxy with it), then the proxy and the
    // cluster, when `target` drops.
    drop(runtime);
    drop(target);
    result
}

async fn bench(args: &Args, target: &Target) -> Result<(), BoxError> {
    let table = unique_name("bench");
    let measured = measure(args, target, &table).await;
    // Dropped whatever happened: on a given server they would stay for good.
    let dropped = async {
        let (admin, connection) = target.config.connect(tokio_postgres::NoTls).await?;
        let connection = tokio::spawn(connection);
        admin
            .batch_execute(&format!(
                "DROP TABLE IF EXISTS \"{table}\", \"{table}_lease\", \
                 \"{table}_schema_version\", \"{table}_crash_marker\""
            ))
            .await?;
        drop(admin);
        let _ = connection.await;
        Ok::<_, BoxError>(())
    };
    let dropped = dropped.await;
    measured.and(dropped)
}

async fn measure(args: &Args, target: &Target, table: &str) -> Result<(), BoxError> {
    let max_writers = args.concurrency.iter().copied().max().unwrap_or(1);
    let ttl = Duration::from_secs(30); // The store's defaults: 30 s TTL, renewal every 10 s.
    let mut builder = PgKvStore::builder_from_config(target.config.clone())
        .table(table)
        .pool_size(max_writers)
        .pool_mode(args.pool_mode);
    if let Some(statements) = args.write_concurrency {
        builder = builder.write_concurrency(statements);
    }
    let store = builder.open().await?;
    let baseline =
        Baseline::new(&store, table, support::pool(target.config.clone(), max_writers), ttl);
    // The renewal probe gets a pool (one connection) of its own, like the store's renewal task.
    let probe = Baseline::new(&store, table, support::pool(target.config.clone(), 1), ttl);
    // A second probe commits its renewals without waiting for the WAL flush, set as a startup
    // option of its own connection: how much of the renewal's latency is the flush queue.
    let mut async_config = target.config.clone();
    let options = async_config.get_options().unwrap_or("").to_owned();
    async_config.options(format!("{options} -c synchronous_commit=off").trim());
    let probe_async = Baseline::new(&store, table, support::pool(async_config, 1), ttl);
    let (admin, admin_conn) = target.config.connect(tokio_postgres::NoTls).await?;
    let admin_task = tokio::spawn(admin_conn);
    let server_version: String = admin.query_one("SELECT version()", &[]).await?.get(0);
    // The server's CPU time is read from /proc when it runs here: the admin connection's backend
    // is a child of the postmaster.
    let backend: i32 = admin.query_one("SELECT pg_backend_pid()", &[]).await?.get(0);
    let postmaster = proc_stat(backend as u32).map(|(ppid, _, _)| ppid);

    // Every key any writer will update exists before timing starts.
    let value = support::value(args.value_size, 7);
    let mut batch = store.batch();
    for w in 0..max_writers {
        for k in 0..args.keys_per_writer {
            batch = batch.put(NS, SUB, &key(w, k), value.clone());
        }
    }
    batch.commit().await?;
    // Steady state: statistics as autovacuum would have gathered them (see BENCHMARKS.md).
    admin.batch_execute(&format!("ANALYZE \"{table}\"")).await?;

    // The round trip as the writers see it: a prepared `SELECT 1` on a pooled connection.
    let mut pings = Vec::with_capacity(200);
    for _ in 0..200 {
        let began = Instant::now();
        workload_ping(&probe).await?;
        pings.push(began.elapsed());
    }
    pings.sort();
    let rtt = (percentile(&pings, 50.0), percentile(&pings, 99.0));

    let workload = Workload { store: store.clone(), baseline, value_size: args.value_size };
    let mut results: BTreeMap<(usize, Variant), Measured> = BTreeMap::new();
    for &writers in &args.concurrency {
        // Warm-up, untimed: every pooled connection opened and every statement prepared.
        let warm = args.duration.div_f64(5.0).min(Duration::from_secs(1));
        for &variant in &args.variants {
            slice(&workload, variant, writers, warm, args.keys_per_writer).await?;
        }
        let per_round = args.duration.div_f64(f64::from(args.rounds));
        for round in 0..args.rounds as usize {
            // Rotate who goes first, so no variant always follows the same one.
            let mut order = args.variants.clone();
            let first = round % order.len();
            order.rotate_left(first);
            for variant in order {
                eprintln!("{writers:>3} writers, round {}: {}", round + 1, variant.name());
                let before = counters(&admin, postmaster).await?;
                let (stop, stopped) = watch::channel(false);
                let sampler = args
                    .sample_waits
                    .then(|| tokio::spawn(sample_waits(target.config.clone(), stopped.clone())));
                let prober = args.renew_probe.map(|every| {
                    // Half an interval apart, so the two probes never queue on each other's
                    // row lock of the lease.
                    let sync =
                        probe_renewals(probe.clone(), every, Duration::ZERO, stopped.clone());
                    let not_sync = probe_renewals(probe_async.clone(), every, every / 2, stopped);
                    (tokio::spawn(sync), tokio::spawn(not_sync))
                });
                let (latencies, elapsed) =
                    slice(&workload, variant, writers, per_round, args.keys_per_writer).await?;
                let after = counters(&admin, postmaster).await?;
                stop.send_replace(true);
                let m = results.entry((writers, variant)).or_default();
                m.latencies.extend(latencies);
                m.elapsed += elapsed;
                m.wal_bytes += after.wal_lsn - before.wal_lsn;
                m.server_cpu = add_cpu(m.server_cpu, before.server_cpu, after.server_cpu);
                m.client_cpu = add_cpu(m.client_cpu, before.client_cpu, after.client_cpu);
                m.multixacts += after.mxid_age - before.mxid_age;
                if let Some((prober, prober_async)) = prober {
                    let (renewals, errors) = prober.await?;
                    m.renewals.extend(renewals);
                    m.renewal_errors += errors;
                    let (renewals, errors) = prober_async.await?;
                    m.renewals_async.extend(renewals);
                    m.renewal_errors += errors;
                }
                if let Some(sampler) = sampler {
                    for (wait, n) in sampler.await?? {
                        *m.waits.entry(wait).or_default() += n;
                    }
                }
            }
        }
    }
    store.close().await?;
    drop(admin);
    let _ = admin_task.await;

    let report = Report { args, transport: &target.transport, server_version, rtt, results };
    if args.json {
        // The JSON is the output; the table still goes to stderr for whoever watches the run.
        eprint!("{}", report.table());
        println!("{}", report.json());
    } else {
        print!("{}", report.table());
    }
    Ok(())
}

async fn workload_ping(probe: &Baseline) -> Result<(), BoxError> {
    let client = probe.pool.get().await?;
    let statement = client.prepare_cached("SELECT 1").await?;
    client.query_one(&statement, &[]).await?;
    Ok(())
}

fn key(writer: usize, k: usize) -> String {
    format!("w{writer}_{k}")
}

/// What a writer of each variant calls.
struct Workload {
    store: PgKvStore,
    baseline: Baseline,
    value_size: usize,
}

impl Workload {
    /// The value of the `n`th write of a writer: different in every byte from the last one, as
    /// a real state update would be (PostgreSQL logs only the changed middle of an updated row
    /// that stays on its page, so rewriting one value again and again would hide most of the
    /// WAL a write costs).
    fn value(&self, n: u64) -> Vec<u8> {
        support::value(self.value_size, n)
    }

    async fn write(&self, variant: Variant, key: &str, value: Vec<u8>) -> Result<(), BoxError> {
        match variant {
            Variant::Unfenced => self.baseline.unfenced(key, &value).await,
            Variant::Fenced => Ok(self.store.write(NS, SUB, key, value).await?),
            Variant::Naive => self.baseline.naive(key, &value).await,
            Variant::Solo => self.baseline.fenced(key, &value).await,
            Variant::Pinned => self.baseline.fenced_pinned(key, &value).await,
        }
    }
}

/// Runs `writers` concurrent writers of one variant for `duration`; returns every write's
/// latency and the wall time until the last writer finished.
async fn slice(
    workload: &Workload,
    variant: Variant,
    writers: usize,
    duration: Duration,
    keys_per_writer: usize,
) -> Result<(Vec<Duration>, Duration), BoxError> {
    let start = Instant::now();
    let deadline = start + duration;
    let tasks = (0..writers).map(|w| async move {
        let mut latencies = Vec::new();
        let mut i = 0;
        while Instant::now() < deadline {
            let key = key(w, i % keys_per_writer);
            let value = workload.value(i as u64);
            i += 1;
            let began = Instant::now();
            workload.write(variant, &key, value).await?;
            latencies.push(began.elapsed());
        }
        Ok::<_, BoxError>(latencies)
    });
    // Writers run as concurrent futures of this task's `join_all`-like loop on a multi-thread
    // runtime: spawning would need 'static borrows, and the I/O (connection tasks) is spawned
    // by the driver anyway.
    let results = join_all(tasks.collect()).await;
    let elapsed = start.elapsed();
    let mut all = Vec::new();
    for r in results {
        all.extend(r?);
    }
    Ok((all, elapsed))
}

/// Polls every future to completion concurrently (a minimal `futures::future::join_all`).
async fn join_all<F: std::future::Future>(futures: Vec<F>) -> Vec<F::Output> {
    let mut futures: Vec<_> = futures.into_iter().map(Box::pin).collect();
    let mut outputs: Vec<Option<F::Output>> = futures.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (future, output) in futures.iter_mut().zip(outputs.iter_mut()) {
            if output.is_none() {
                match future.as_mut().poll(cx) {
                    std::task::Poll::Ready(v) => *output = Some(v),
                    std::task::Poll::Pending => pending = true,
                }
            }
        }
        if pending { std::task::Poll::Pending } else { std::task::Poll::Ready(()) }
    })
    .await;
    outputs.into_iter().map(|o| o.expect("every future finished")).collect()
}

async fn counters(
    admin: &tokio_postgres::Client,
    postmaster: Option<u32>,
) -> Result<Counters, BoxError> {
    // `mxid_age(datminmxid)` is the next MultiXact id minus a value that only VACUUM moves:
    // its growth over a slice is the number of MultiXacts created in it.
    let row = admin
        .query_one(
            "SELECT (pg_current_wal_lsn() - '0/0')::bigint, mxid_age(datminmxid)::bigint
               FROM pg_database WHERE datname = current_database()",
            &[],
        )
        .await?;
    Ok(Counters {
        wal_lsn: row.get(0),
        mxid_age: row.get(1),
        server_cpu: postmaster.and_then(server_cpu),
        client_cpu: process_cpu(std::process::id()),
    })
}

/// A process's parent pid, its own CPU time (`utime + stime`) and that of its exited, reaped
/// children (`cutime + cstime`), from `/proc/<pid>/stat`. Linux only; `None` when the process
/// is not visible (e.g. the server runs elsewhere).
fn proc_stat(pid: u32) -> Option<(u32, Duration, Duration)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may contain spaces; everything after its ')' is numeric.
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let ppid = fields.get(1)?.parse().ok()?;
    let ticks = |a: usize, b: usize| -> Option<Duration> {
        let n = fields.get(a)?.parse::<u64>().ok()? + fields.get(b)?.parse::<u64>().ok()?;
        // USER_HZ is 100 on every mainstream Linux build.
        Some(Duration::from_millis(n * 10))
    };
    Some((ppid, ticks(11, 12)?, ticks(13, 14)?))
}

fn process_cpu(pid: u32) -> Option<Duration> {
    proc_stat(pid).map(|(_, own, _)| own)
}

/// CPU time of the postmaster and all its children (backends, WAL writer, checkpointer, ...),
/// those that exited included (the postmaster reaps them).
fn server_cpu(postmaster: u32) -> Option<Duration> {
    let (_, own, reaped) = proc_stat(postmaster)?;
    let mut total = own + reaped;
    for entry in std::fs::read_dir("/proc").ok()?.flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        if let Some((_, cpu, _)) = proc_stat(pid).filter(|(ppid, _, _)| *ppid == postmaster) {
            total += cpu;
        }
    }
    Some(total)
}

fn add_cpu(
    sum: Option<Duration>,
    before: Option<Duration>,
    after: Option<Duration>,
) -> Option<Duration> {
    Some(sum.unwrap_or_default() + after?.saturating_sub(before?))
}

/// Times a lease renewal every `every`, starting `offset` from now, until `stop`; returns the
/// latencies of the renewals that succeeded and the number that failed.
async fn probe_renewals(
    probe: Baseline,
    every: Duration,
    offset: Duration,
    mut stop: watch::Receiver<bool>,
) -> (Vec<Duration>, usize) {
    let (mut latencies, mut failed) = (Vec::new(), 0);
    let mut interval = tokio::time::interval_at(tokio::time::Instant::now() + offset, every);
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    loop {
        tokio::select! {
            _ = stop.changed() => return (latencies, failed),
            _ = interval.tick() => {}
        }
        let began = Instant::now();
        match probe.renew().await {
            Ok(()) => latencies.push(began.elapsed()),
            Err(_) => failed += 1,
        }
    }
}

/// Samples the state and wait event of the other non-idle client backends of the database
/// every 10 ms until `stop`; returns how often each was seen.
async fn sample_waits(
    config: tokio_postgres::Config,
    mut stop: watch::Receiver<bool>,
) -> Result<BTreeMap<String, u64>, BoxError> {
    let (client, connection) = config.connect(tokio_postgres::NoTls).await?;
    let connection = tokio::spawn(connection);
    let statement = client
        .prepare(
            "SELECT state || ' ' || coalesce(wait_event_type || ':' || wait_event, 'CPU')
               FROM pg_stat_activity
              WHERE backend_type = 'client backend' AND pid <> pg_backend_pid()
                AND datname = current_database() AND state <> 'idle'",
        )
        .await?;
    let mut waits = BTreeMap::new();
    let mut interval = tokio::time::interval(Duration::from_millis(10));
    interval.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    loop {
        tokio::select! {
            _ = stop.changed() => break,
            _ = interval.tick() => {}
        }
        for row in client.query(&statement, &[]).await? {
            *waits.entry(row.get(0)).or_default() += 1;
        }
    }
    drop(client);
    let _ = connection.await;
    Ok(waits)
}

// ---------------------------------------------------------------------------------------------
// Report
// ---------------------------------------------------------------------------------------------

struct Report<'a> {
    args: &'a Args,
    transport: &'a str,
    server_version: String,
    /// Median and p99 of a `SELECT 1` round trip, measured before the writers start.
    rtt: (Duration, Duration),
    results: BTreeMap<(usize, Variant), Measured>,
}

struct Summary {
    ops: usize,
    ops_per_sec: f64,
    p50: Duration,
    p90: Duration,
    p99: Duration,
    max: Duration,
    mean: Duration,
    wal_bytes_per_op: f64,
    multixacts_per_op: f64,
    server_cpu_per_op: Option<Duration>,
    client_cpu_per_op: Option<Duration>,
    renewal: Option<(usize, usize, Duration, Duration, Duration)>,
    renewal_async: Option<(usize, Duration, Duration, Duration)>,
}

fn summarize(m: &Measured) -> Summary {
    let mut sorted = m.latencies.clone();
    sorted.sort();
    let ops = sorted.len();
    let total: Duration = sorted.iter().sum();
    let mut renewals = m.renewals.clone();
    renewals.sort();
    let mut renewals_async = m.renewals_async.clone();
    renewals_async.sort();
    Summary {
        ops,
        ops_per_sec: ops as f64 / m.elapsed.as_secs_f64().max(1e-9),
        p50: percentile(&sorted, 50.0),
        p90: percentile(&sorted, 90.0),
        p99: percentile(&sorted, 99.0),
        max: sorted.last().copied().unwrap_or_default(),
        mean: if ops > 0 { total / ops as u32 } else { Duration::ZERO },
        wal_bytes_per_op: m.wal_bytes as f64 / ops.max(1) as f64,
        multixacts_per_op: m.multixacts as f64 / ops.max(1) as f64,
        server_cpu_per_op: m.server_cpu.map(|cpu| cpu / ops.max(1) as u32),
        client_cpu_per_op: m.client_cpu.map(|cpu| cpu / ops.max(1) as u32),
        renewal: (!renewals.is_empty() || m.renewal_errors > 0).then(|| {
            (
                renewals.len(),
                m.renewal_errors,
                percentile(&renewals, 50.0),
                percentile(&renewals, 99.0),
                renewals.last().copied().unwrap_or_default(),
            )
        }),
        renewal_async: (!renewals_async.is_empty()).then(|| {
            (
                renewals_async.len(),
                percentile(&renewals_async, 50.0),
                percentile(&renewals_async, 99.0),
                renewals_async.last().copied().unwrap_or_default(),
            )
        }),
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn us(d: Duration) -> u128 {
    d.as_micros()
}

impl Report<'_> {
    fn header(&self) -> String {
        format!(
            "{}{}; {} CPUs; {}; SELECT 1 round trip p50 {:.3} ms, p99 {:.3} ms;\n\
             {}-byte values; {:.1} s per variant and concurrency in {} rounds",
            if cfg!(debug_assertions) { "DEBUG BUILD (use --release); " } else { "" },
            self.server_version.split(" on ").next().unwrap_or(&self.server_version),
            cpus(),
            self.transport,
            ms(self.rtt.0),
            ms(self.rtt.1),
            self.args.value_size,
            self.args.duration.as_secs_f64(),
            self.args.rounds
        )
    }

    fn table(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "\n{}\n", self.header());
        let _ = writeln!(
            out,
            "{:>7}  {:<9} {:>9} {:>9} {:>9} {:>9}  {:>8} {:>8} {:>8}  {:>8} {:>6} {:>8} {:>8}",
            "writers",
            "variant",
            "ops/s",
            "p50 ms",
            "p99 ms",
            "max ms",
            "p50 x",
            "p99 x",
            "ops/s x",
            "WAL B/op",
            "mxact",
            "srv µs",
            "cli µs"
        );
        for (&(writers, variant), m) in &self.results {
            let s = summarize(m);
            let base = self.results.get(&(writers, Variant::Unfenced)).map(summarize);
            let ratio = |f: fn(&Summary) -> f64| match &base {
                Some(b) if variant != Variant::Unfenced => format!("{:.2}x", f(&s) / f(b)),
                _ => "-".to_owned(),
            };
            let _ = writeln!(
                out,
                "{:>7}  {:<9} {:>9.0} {:>9.3} {:>9.3} {:>9.3}  {:>8} {:>8} {:>8}  {:>8.0} {:>6.2} {:>8} {:>8}",
                writers,
                variant.name(),
                s.ops_per_sec,
                ms(s.p50),
                ms(s.p99),
                ms(s.max),
                ratio(|s| s.p50.as_secs_f64()),
                ratio(|s| s.p99.as_secs_f64()),
                ratio(|s| s.ops_per_sec),
                s.wal_bytes_per_op,
                s.multixacts_per_op,
                s.server_cpu_per_op.map_or("-".to_owned(), |d| d.as_micros().to_string()),
                s.client_cpu_per_op.map_or("-".to_owned(), |d| d.as_micros().to_string()),
            );
        }
        let _ = writeln!(
            out,
            "\n(x: ratio to unfenced at the same number of writers; mxact: MultiXacts created per \
             write; srv/cli µs: CPU time per write of the whole server and of this process)"
        );
        if self.args.renew_probe.is_some() {
            let _ = writeln!(
                out,
                "\nlease renewal latency while the writers run (the store's RENEW statement on a \
                 connection of its own;\nasync: the same with synchronous_commit = off):"
            );
            for (&(writers, variant), m) in &self.results {
                let s = summarize(m);
                if let Some((_, p50, p99, max)) = s.renewal_async {
                    let _ = writeln!(
                        out,
                        "{writers:>7}  {:<9} async p50 {:.3} ms  p99 {:.3} ms  max {:.3} ms",
                        variant.name(),
                        ms(p50),
                        ms(p99),
                        ms(max)
                    );
                }
                if let Some((n, errors, p50, p99, max)) = s.renewal {
                    let _ = writeln!(
                        out,
                        "{writers:>7}  {:<9} p50 {:.3} ms  p99 {:.3} ms  max {:.3} ms  ({n} renewals, {errors} failed)",
                        variant.name(),
                        ms(p50),
                        ms(p99),
                        ms(max)
                    );
                }
            }
        }
        if self.args.sample_waits {
            let _ = writeln!(out, "\nwait events of the writers' backends (share of samples):");
            for (&(writers, variant), m) in &self.results {
                let total: u64 = m.waits.values().sum();
                let mut top: Vec<_> = m.waits.iter().collect();
                top.sort_by(|a, b| b.1.cmp(a.1));
                let line: Vec<String> = top
                    .iter()
                    .take(6)
                    .map(|(w, n)| format!("{w} {:.0}%", **n as f64 * 100.0 / total.max(1) as f64))
                    .collect();
                let _ = writeln!(out, "{writers:>7}  {:<9} {}", variant.name(), line.join(", "));
            }
        }
        out
    }

    fn json(&self) -> String {
        let mut results = Vec::new();
        for (&(writers, variant), m) in &self.results {
            let s = summarize(m);
            let base = self.results.get(&(writers, Variant::Unfenced)).map(summarize);
            let mut fields = vec![
                format!("\"writers\":{writers}"),
                format!("\"variant\":{}", json_str(variant.name())),
                format!("\"ops\":{}", s.ops),
                format!("\"seconds\":{:.3}", m.elapsed.as_secs_f64()),
                format!("\"ops_per_sec\":{:.1}", s.ops_per_sec),
                format!("\"p50_us\":{}", us(s.p50)),
                format!("\"p90_us\":{}", us(s.p90)),
                format!("\"p99_us\":{}", us(s.p99)),
                format!("\"max_us\":{}", us(s.max)),
                format!("\"mean_us\":{}", us(s.mean)),
                format!("\"wal_bytes_per_op\":{:.1}", s.wal_bytes_per_op),
                format!("\"multixacts_per_op\":{:.3}", s.multixacts_per_op),
            ];
            if let Some(cpu) = s.server_cpu_per_op {
                fields.push(format!("\"server_cpu_us_per_op\":{:.1}", cpu.as_secs_f64() * 1e6));
            }
            if let Some(cpu) = s.client_cpu_per_op {
                fields.push(format!("\"client_cpu_us_per_op\":{:.1}", cpu.as_secs_f64() * 1e6));
            }
            if let Some(b) = base.filter(|_| variant != Variant::Unfenced) {
                fields.push(format!(
                    "\"vs_unfenced\":{{\"p50\":{:.3},\"p99\":{:.3},\"ops_per_sec\":{:.3}}}",
                    s.p50.as_secs_f64() / b.p50.as_secs_f64(),
                    s.p99.as_secs_f64() / b.p99.as_secs_f64(),
                    s.ops_per_sec / b.ops_per_sec
                ));
            }
            if let Some((n, errors, p50, p99, max)) = s.renewal {
                fields.push(format!(
                    "\"renewal\":{{\"samples\":{n},\"failed\":{errors},\"p50_us\":{},\"p99_us\":{},\"max_us\":{}}}",
                    us(p50),
                    us(p99),
                    us(max)
                ));
            }
            if let Some((n, p50, p99, max)) = s.renewal_async {
                fields.push(format!(
                    "\"renewal_async_commit\":{{\"samples\":{n},\"p50_us\":{},\"p99_us\":{},\"max_us\":{}}}",
                    us(p50),
                    us(p99),
                    us(max)
                ));
            }
            if !m.waits.is_empty() {
                let waits: Vec<String> =
                    m.waits.iter().map(|(w, n)| format!("{}:{n}", json_str(w))).collect();
                fields.push(format!("\"waits\":{{{}}}", waits.join(",")));
            }
            results.push(format!("{{{}}}", fields.join(",")));
        }
        let a = self.args;
        let started =
            SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0);
        format!(
            "{{\"tool\":\"pgfence-bench\",\"unix_time\":{started},\"server_version\":{},\"cpus\":{},\
\"transport\":{},\"rtt_p50_us\":{},\"rtt_p99_us\":{},\"delay_us\":{},\"value_size\":{},\
\"duration_secs\":{},\"rounds\":{},\"write_concurrency\":{},\"concurrency\":[{}],\"results\":[{}]}}",
            json_str(&self.server_version),
            cpus(),
            json_str(self.transport),
            us(self.rtt.0),
            us(self.rtt.1),
            a.delay_us,
            a.value_size,
            a.duration.as_secs_f64(),
            a.rounds,
            a.write_concurrency.map_or("null".to_owned(), |n| n.to_string()),
            a.concurrency.iter().map(|c| c.to_string()).collect::<Vec<_>>().join(","),
            results.join(",")
        )
    }
}

fn cpus() -> usize {
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
}
