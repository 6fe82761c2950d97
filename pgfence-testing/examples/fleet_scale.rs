//! What many stores in one process cost: on one `Fleet`, and opened alone.
//!
//! ```text
//! cargo run --release -p pgfence-testing --example fleet_scale -- [--fleet 1,10,100,1000]
//!     [--alone 1,10,100] [--pool 16] [--ttl-ms 30000] [--hold-secs 30] [--json]
//! ```
//!
//! For each count N of `--fleet`: one fleet (a pool of `--pool`) opens N stores on distinct
//! tables, four openings at a time, and each writes one key. For each N of `--alone`: N stores
//! open each with its own pool (default size) and renewal thread. Then the stores are held
//! for `--hold-secs` while renewal runs (TTL `--ttl-ms`; renewal every third of it). Reported:
//! the process's threads (`/proc/self/task`) and resident memory (`VmRSS`) before and while
//! held, the most server connections seen while held (`pg_stat_activity` by the run's
//! `application_name`), and the renewals confirmed while held with their p50 and p99. The
//! quantiles are the upper bounds of the stores' renewal histogram buckets (`Stats`), merged.
//! Then every store and the fleet close and the tables are dropped.
//!
//! Uses `DATABASE_URL` when set, else a private temporary cluster (stopped at the end; its
//! `max_connections` of 400 bounds `--alone`). With `--json`, one JSON object on stdout (the
//! text goes to stderr).

#[path = "support/mod.rs"]
mod support;

use std::sync::Arc;
use std::time::{Duration, Instant};

use pgfence::{Histogram, PgKvStore};
use pgfence_testing::unique_name;
use support::BoxError;

const USAGE: &str = "usage: fleet_scale [--fleet 1,10,100,1000] [--alone 1,10,100] [--pool 16] \
[--ttl-ms 30000] [--hold-secs 30] [--json]";

/// Openings at a time.
const OPENING: usize = 4;

struct Args {
    fleet: Vec<usize>,
    alone: Vec<usize>,
    pool: usize,
    ttl: Duration,
    hold: Duration,
    json: bool,
}

fn parse_args() -> Result<Option<Args>, String> {
    let mut args = Args {
        fleet: vec![1, 10, 100, 1000],
        alone: vec![1, 10, 100],
        pool: 16,
        ttl: Duration::from_secs(30),
        hold: Duration::from_secs(30),
        json: false,
    };
    let list = |v: Option<String>, name: &str| -> Result<Vec<usize>, String> {
        let v = v.ok_or(format!("{name} needs a value"))?;
        if v.is_empty() {
            return Ok(Vec::new());
        }
        v.split(',').map(|n| n.trim().parse().map_err(|_| format!("{name}: {n:?}"))).collect()
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        match flag.as_str() {
            "--fleet" => args.fleet = list(it.next(), &flag)?,
            "--alone" => args.alone = list(it.next(), &flag)?,
            "--pool" => args.pool = list(it.next(), &flag)?[0].max(1),
            "--ttl-ms" => args.ttl = Duration::from_millis(list(it.next(), &flag)?[0] as u64),
            "--hold-secs" => args.hold = Duration::from_secs(list(it.next(), &flag)?[0] as u64),
            "--json" => args.json = true,
            "-h" | "--help" => return Ok(None),
            other => return Err(format!("unknown argument {other:?}\n{USAGE}")),
        }
    }
    Ok(Some(args))
}

fn main() {
    support::main("fleet_scale", USAGE, parse_args(), |args| run(&args));
}

fn run(args: &Args) -> Result<(), BoxError> {
    let url = std::env::var("DATABASE_URL").ok().filter(|url| !url.is_empty());
    let (config, cluster) = support::server(url.as_deref())?;
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let mut runs = Vec::new();
    let mut text = String::new();
    for (fleet, counts) in [(true, &args.fleet), (false, &args.alone)] {
        for &n in counts.iter() {
            let measured = runtime.block_on(measure(args, &config, fleet, n))?;
            let line = measured.text();
            eprintln!("{line}");
            text.push_str(&line);
            text.push('\n');
            runs.push(measured);
        }
    }
    drop(runtime);
    drop(cluster);
    if args.json {
        let runs: Vec<String> = runs.iter().map(Run::json).collect();
        println!(
            "{{\"pool\":{},\"ttl_ms\":{},\"hold_s\":{},\"runs\":[{}]}}",
            args.pool,
            args.ttl.as_millis(),
            args.hold.as_secs(),
            runs.join(",")
        );
    } else {
        print!("{text}");
    }
    Ok(())
}

struct Run {
    fleet: bool,
    stores: usize,
    open_secs: f64,
    threads: (usize, usize),
    rss_mib: (f64, f64),
    connections: i64,
    renewals: u64,
    failed: u64,
    p50: Option<Duration>,
    p99: Option<Duration>,
}

impl Run {
    fn text(&self) -> String {
        let ms = |d: Option<Duration>| d.map_or("-".to_owned(), |d| format!("<= {:?}", d));
        format!(
            "{:>5} stores {:<6} opened in {:>6.1} s: threads {} -> {}, RSS {:.1} -> {:.1} MiB, \
             server connections {}, renewals {} ({} failed) p50 {} p99 {}",
            self.stores,
            if self.fleet { "fleet" } else { "alone" },
            self.open_secs,
            self.threads.0,
            self.threads.1,
            self.rss_mib.0,
            self.rss_mib.1,
            self.connections,
            self.renewals,
            self.failed,
            ms(self.p50),
            ms(self.p99)
        )
    }

    fn json(&self) -> String {
        let ms = |d: Option<Duration>| {
            d.map_or("null".to_owned(), |d| format!("{}", d.as_secs_f64() * 1e3))
        };
        format!(
            "{{\"mode\":\"{}\",\"stores\":{},\"open_s\":{:.2},\"threads_before\":{},\"threads\":{},\
             \"rss_mib_before\":{:.1},\"rss_mib\":{:.1},\"connections\":{},\"renewals\":{},\
             \"renewals_failed\":{},\"renewal_p50_ms\":{},\"renewal_p99_ms\":{}}}",
            if self.fleet { "fleet" } else { "alone" },
            self.stores,
            self.open_secs,
            self.threads.0,
            self.threads.1,
            self.rss_mib.0,
            self.rss_mib.1,
            self.connections,
            self.renewals,
            self.failed,
            ms(self.p50),
            ms(self.p99)
        )
    }
}

fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").map_or(0, |d| d.count())
}

fn rss_mib() -> f64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let kib = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or(0.0);
    kib / 1024.0
}

/// The renewal histograms of `stores`, merged: counts and buckets.
fn renewal_histogram(stores: &[PgKvStore]) -> (u64, Vec<u64>) {
    let mut failed = 0;
    let mut counts = vec![0; Histogram::bounds().len() + 1];
    for store in stores {
        let renewals = store.stats().renewals;
        failed += renewals.failed;
        for (sum, n) in counts.iter_mut().zip(&renewals.latency.counts) {
            *sum += n;
        }
    }
    (failed, counts)
}

/// The upper bound of the bucket the `q` quantile of `counts` falls in.
fn quantile(counts: &[u64], q: f64) -> Option<Duration> {
    let total: u64 = counts.iter().sum();
    if total == 0 {
        return None;
    }
    let rank = ((q * total as f64).ceil() as u64).max(1);
    let mut seen = 0;
    let bucket = counts.iter().position(|&n| {
        seen += n;
        seen >= rank
    })?;
    Histogram::bounds().nth(bucket)
}

async fn measure(
    args: &Args,
    config: &tokio_postgres::Config,
    in_fleet: bool,
    n: usize,
) -> Result<Run, BoxError> {
    let (admin, connection) = config.connect(tokio_postgres::NoTls).await?;
    tokio::spawn(connection);
    let app = unique_name("fleetscale");
    let threads_before = threads();
    let rss_before = rss_mib();
    let base =
        PgKvStore::builder_from_config(config.clone()).application_name(&app).lease_ttl(args.ttl);
    let fleet = match in_fleet {
        true => Some(Arc::new(base.clone().pool_size(args.pool).fleet()?)),
        false => None,
    };
    let tables: Vec<String> = (0..n).map(|i| format!("{app}_{i}")).collect();
    let started = Instant::now();
    let gate = Arc::new(tokio::sync::Semaphore::new(OPENING));
    let mut opening = tokio::task::JoinSet::new();
    for (i, table) in tables.iter().enumerate() {
        let builder = match &fleet {
            Some(fleet) => fleet.builder(table),
            None => base.clone().table(table),
        };
        let gate = Arc::clone(&gate);
        opening.spawn(async move {
            let _turn = gate.acquire_owned().await;
            let store = builder.open().await?;
            store.write("bench", "kv", "k", vec![1; 64]).await?;
            Ok::<_, pgfence::Error>((i, store))
        });
    }
    let mut stores: Vec<Option<PgKvStore>> = (0..n).map(|_| None).collect();
    let mut failure = None;
    while let Some(joined) = opening.join_next().await {
        match joined? {
            Ok((i, store)) => stores[i] = Some(store),
            Err(e) => failure = Some(e),
        }
    }
    let stores: Vec<PgKvStore> = stores.into_iter().flatten().collect();
    let open_secs = started.elapsed().as_secs_f64();
    let result = match failure {
        Some(e) => Err(e.into()),
        None => hold(args, &admin, &app, &stores).await,
    };
    for store in &stores {
        let _ = store.close().await;
    }
    drop(stores);
    if let Some(fleet) = fleet {
        match Arc::try_unwrap(fleet) {
            Ok(fleet) => fleet.close().await,
            Err(_) => unreachable!("the builders are gone"),
        }
    }
    for chunk in tables.chunks(100) {
        let drops: Vec<String> = chunk
            .iter()
            .map(|t| {
                format!("\"{t}\", \"{t}_lease\", \"{t}_schema_version\", \"{t}_crash_marker\"")
            })
            .collect();
        admin.batch_execute(&format!("DROP TABLE IF EXISTS {}", drops.join(", "))).await?;
    }
    let held = result?;
    Ok(Run {
        fleet: in_fleet,
        stores: n,
        open_secs,
        threads: (threads_before, held.threads),
        rss_mib: (rss_before, held.rss_mib),
        connections: held.connections,
        renewals: held.renewals.iter().sum(),
        failed: held.failed,
        p50: quantile(&held.renewals, 0.5),
        p99: quantile(&held.renewals, 0.99),
    })
}

/// What holding the stores showed.
struct Held {
    threads: usize,
    rss_mib: f64,
    connections: i64,
    /// The renewals confirmed while held, per histogram bucket.
    renewals: Vec<u64>,
    failed: u64,
}

/// Holds the stores for `--hold-secs`, sampling threads, memory and server connections every
/// 200 ms; the most of each is kept.
async fn hold(
    args: &Args,
    admin: &tokio_postgres::Client,
    app: &str,
    stores: &[PgKvStore],
) -> Result<Held, BoxError> {
    let (failed_before, before) = renewal_histogram(stores);
    let sessions = "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1";
    let app = format!("pgfence {app}");
    let mut held =
        Held { threads: 0, rss_mib: 0.0, connections: 0, renewals: Vec::new(), failed: 0 };
    let until = Instant::now() + args.hold;
    while Instant::now() < until {
        held.threads = held.threads.max(threads());
        held.rss_mib = held.rss_mib.max(rss_mib());
        let connections: i64 = admin.query_one(sessions, &[&app]).await?.get(0);
        held.connections = held.connections.max(connections);
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let (failed_after, after) = renewal_histogram(stores);
    held.renewals = after.iter().zip(&before).map(|(a, b)| a - b).collect();
    held.failed = failed_after - failed_before;
    Ok(held)
}
