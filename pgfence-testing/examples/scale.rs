//! How pgfence's costs grow with the table, and what a batch costs at a real round trip.
//!
//! ```text
//! cargo run --release -p pgfence-testing --example scale -- [--rows 1000,100000,10000000]
//!     [--samples 300] [--batch-delays-us 0,400] [--batch-rounds 200] [--no-table]
//!     [--no-batch] [--cache os|cold|shared] [--shared-buffers 64MB] [--json]
//! ```
//!
//! Table size, for each `--rows` N: a store opens a fresh table, and SQL fills it with N rows of
//! 1 KiB (`generate_series`, not through the store), then `VACUUM ANALYZE` (the steady state
//! autovacuum keeps). Then `--samples` rounds time, interleaved: a fenced `write` over an
//! existing key, a `read`, a `remove` of a distinct existing key, and `list_paginated` at the
//! first page and at the middle of the table. The query plan of both pages is printed
//! (`EXPLAIN ANALYZE`). So is where a read's pages come from: `EXPLAIN (ANALYZE, BUFFERS)` of
//! the store's read statement for 50 keys not read before, with `track_io_timing`. Last,
//! `list_all_keys` runs once with its peak resident memory measured (`VmHWM` of
//! /proc/self/status, reset through /proc/self/clear_refs first). The table is dropped after
//! each size.
//!
//! Where the table's pages are when the samples start (`--cache`):
//!
//! - `os` (the default): wherever filling left them; mostly in the OS page cache.
//! - `cold`: after a `CHECKPOINT`, the table's and its indexes' files are dropped from the OS
//!   page cache (`dd iflag=nocache`). Reads then come from the disk, as for a table larger than
//!   the RAM. Needs the server on this machine, its files readable by this process.
//! - `shared`: `pg_prewarm` loads them into shared buffers. They fit only if `shared_buffers`
//!   is larger than the table: `--shared-buffers` sets it on the private cluster (a restart).
//!
//! Batch, for each `--batch-delays-us` D (each way, through the harness's delay proxy): a
//! fenced batch of 100 puts (`Batch::commit`), the same statement without the lease check on
//! a pool of its own, and one fenced `write`, in turns, `--batch-rounds` times each.
//!
//! Uses `DATABASE_URL` when set, else a private temporary cluster (stopped at the end). The
//! tables are dropped however the run ends. With `--json`, one JSON object on stdout (the text
//! goes to stderr); `scripts/scale_chart.py` charts it.

#[path = "support/mod.rs"]
mod support;

use std::fmt::Write as _;
use std::net::ToSocketAddrs;
use std::time::{Duration, Instant};

use pgfence::{PageToken, PgKvStore};
use pgfence_testing::{Proxy, unique_name};
use support::{Baseline, BoxError, NS, SUB, json_str};
use tokio_postgres::config::Host;

const USAGE: &str = "usage: scale [--rows 1000,100000,10000000] [--samples 300] \
[--batch-delays-us 0,400] [--batch-rounds 200] [--no-table] [--no-batch] \
[--cache os|cold|shared] [--shared-buffers 64MB] [--json]";

const VALUE_SIZE: usize = 1024;
const BATCH: usize = 100;
/// Rows inserted per statement while filling a table: progress, and no transaction of hours.
const FILL_CHUNK: i64 = 1_000_000;

/// The store's page statement (pgfence's `sql::LIST_PAGE`), for its query plan.
const LIST_PAGE: &str = r#"
SELECT key, created_seq FROM {kv}
 WHERE primary_namespace = $1 AND secondary_namespace = $2 AND created_seq < $3
 ORDER BY created_seq DESC
 LIMIT $4"#;

/// The store's read statement (pgfence's `sql::READ`), for where its pages come from.
const READ: &str = r#"
SELECT value FROM {kv}
 WHERE primary_namespace = $1 AND secondary_namespace = $2 AND key = $3"#;

/// Reads of keys not read before, explained to count their buffers.
const READ_PROBES: usize = 50;

/// A table and its indexes: the files a read may touch.
const RELATIONS: &str = r#"
SELECT c.oid, pg_relation_filepath(c.oid) FROM pg_class c
 WHERE c.oid = $1::text::regclass
    OR c.oid IN (SELECT indexrelid FROM pg_index WHERE indrelid = $1::text::regclass)"#;

/// Where the table's pages are when the samples start (see the module docs).
#[derive(Clone, Copy, PartialEq)]
enum Cache {
    Os,
    Cold,
    Shared,
}

impl Cache {
    fn name(self) -> &'static str {
        match self {
            Cache::Os => "os",
            Cache::Cold => "cold",
            Cache::Shared => "shared",
        }
    }
}

struct Args {
    rows: Vec<i64>,
    samples: usize,
    delays_us: Vec<u64>,
    batch_rounds: usize,
    table: bool,
    batch: bool,
    cache: Cache,
    shared_buffers: Option<String>,
    json: bool,
}

fn parse_args() -> Result<Option<Args>, String> {
    let mut args = Args {
        rows: vec![1_000, 100_000, 10_000_000],
        samples: 300,
        delays_us: vec![0, 400],
        batch_rounds: 200,
        table: true,
        batch: true,
        cache: Cache::Os,
        shared_buffers: None,
        json: false,
    };
    let list = |v: Option<String>, name: &str| -> Result<Vec<u64>, String> {
        let v = v.ok_or(format!("{name} needs a value"))?;
        v.split(',').map(|n| n.trim().parse().map_err(|_| format!("{name}: {n:?}"))).collect()
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        match flag.as_str() {
            "--rows" => {
                args.rows = list(it.next(), &flag)?.into_iter().map(|n| n as i64).collect();
                if args.rows.iter().any(|&n| n < 2 * BATCH as i64) {
                    return Err(format!("--rows: at least {}", 2 * BATCH));
                }
            }
            "--samples" => args.samples = list(it.next(), &flag)?[0].max(1) as usize,
            "--batch-delays-us" => args.delays_us = list(it.next(), &flag)?,
            "--batch-rounds" => args.batch_rounds = list(it.next(), &flag)?[0].max(1) as usize,
            "--no-table" => args.table = false,
            "--no-batch" => args.batch = false,
            "--cache" => {
                args.cache = match it.next().as_deref() {
                    Some("os") => Cache::Os,
                    Some("cold") => Cache::Cold,
                    Some("shared") => Cache::Shared,
                    other => return Err(format!("--cache: os, cold or shared, not {other:?}")),
                }
            }
            "--shared-buffers" => {
                // Goes into postgresql.conf: a size like 64MB or 4GB, nothing else.
                let size = it.next().filter(|v| v.chars().all(|c| c.is_ascii_alphanumeric()));
                args.shared_buffers = Some(size.ok_or("--shared-buffers: a size like 4GB")?);
            }
            "--json" => args.json = true,
            "-h" | "--help" => return Ok(None),
            other => return Err(format!("unknown argument {other:?}\n{USAGE}")),
        }
    }
    Ok(Some(args))
}

fn main() {
    support::main("scale", USAGE, parse_args(), |args| run(&args));
}

fn run(args: &Args) -> Result<(), BoxError> {
    let url = std::env::var("DATABASE_URL").ok().filter(|url| !url.is_empty());
    let (config, cluster) = support::server(url.as_deref())?;
    if let Some(size) = &args.shared_buffers {
        let cluster = cluster.as_ref().ok_or("--shared-buffers is for the private cluster")?;
        // The last line of postgresql.conf wins. shared_buffers takes a restart.
        let conf = cluster.data_dir().join("postgresql.conf");
        let text = std::fs::read_to_string(&conf)? + &format!("shared_buffers = '{size}'\n");
        std::fs::write(&conf, text)?;
        cluster.restart()?;
    }
    // The delay proxies' tasks on a runtime of their own, as in the bench command.
    let proxies =
        tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build()?;
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let result = runtime.block_on(scale(args, &config, proxies.handle()));
    // The clients go first, then the proxies, then the server.
    drop(runtime);
    drop(proxies);
    drop(cluster);
    let report = result?;
    if args.json {
        eprint!("{}", report.text);
        println!("{}", report.json);
    } else {
        print!("{}", report.text);
    }
    Ok(())
}

struct Report {
    text: String,
    json: String,
}

async fn scale(
    args: &Args,
    config: &tokio_postgres::Config,
    proxies: &tokio::runtime::Handle,
) -> Result<Report, BoxError> {
    let admin = connect(config).await?;
    let version: String = admin.query_one("SHOW server_version", &[]).await?.get(0);
    let shared_buffers: String = admin.query_one("SHOW shared_buffers", &[]).await?.get(0);
    let mut text = format!(
        "PostgreSQL {version}; {} CPUs; {}-byte values; {}; shared_buffers {shared_buffers}; \
         cache {}\n",
        std::thread::available_parallelism().map_or(1, |n| n.get()),
        VALUE_SIZE,
        if cfg!(debug_assertions) { "DEBUG BUILD" } else { "release build" },
        args.cache.name()
    );
    let mut sizes = Vec::new();
    if args.table {
        for &rows in &args.rows {
            let table = unique_name("scale");
            let measured = table_size(args, config, &admin, &table, rows).await;
            drop_tables(&admin, &table).await?;
            let measured = measured?;
            text.push_str(&measured.text());
            sizes.push(measured);
        }
    }
    let mut batches = Vec::new();
    if args.batch {
        for &delay_us in &args.delays_us {
            let table = unique_name("scale_batch");
            let measured = batch(args, config, proxies, &table, delay_us).await;
            drop_tables(&admin, &table).await?;
            let measured = measured?;
            text.push_str(&measured.text());
            batches.push(measured);
        }
    }
    let sizes: Vec<String> = sizes.iter().map(Size::json).collect();
    let batches: Vec<String> = batches.iter().map(BatchRun::json).collect();
    let json = format!(
        "{{\"server_version\":{},\"shared_buffers\":{},\"cache\":{},\
         \"value_size\":{VALUE_SIZE},\"samples\":{},\"sizes\":[{}],\"batches\":[{}]}}",
        json_str(&version),
        json_str(&shared_buffers),
        json_str(args.cache.name()),
        args.samples,
        sizes.join(","),
        batches.join(",")
    );
    Ok(Report { text, json })
}

async fn connect(config: &tokio_postgres::Config) -> Result<tokio_postgres::Client, BoxError> {
    let (client, connection) = config.connect(tokio_postgres::NoTls).await?;
    tokio::spawn(connection);
    Ok(client)
}

async fn drop_tables(admin: &tokio_postgres::Client, table: &str) -> Result<(), BoxError> {
    let sql = format!(
        "DROP TABLE IF EXISTS \"{table}\", \"{table}_lease\", \
         \"{table}_schema_version\", \"{table}_crash_marker\""
    );
    admin.batch_execute(&sql).await?;
    Ok(())
}

/// What one table size measured.
struct Size {
    rows: i64,
    fill: Duration,
    table_bytes: i64,
    write: Vec<Duration>,
    read: Vec<Duration>,
    remove: Vec<Duration>,
    first_page: Vec<Duration>,
    middle_page: Vec<Duration>,
    plans: Vec<(String, String)>,
    /// Per read, averaged over [`READ_PROBES`]: shared buffers hit and read (from outside
    /// them), ms spent reading them, and the execution time in ms.
    read_buffers: [f64; 4],
    list_all: Duration,
    list_all_peak: u64,
}

async fn table_size(
    args: &Args,
    config: &tokio_postgres::Config,
    admin: &tokio_postgres::Client,
    table: &str,
    rows: i64,
) -> Result<Size, BoxError> {
    let store =
        PgKvStore::builder_from_config(config.clone()).table(table).pool_size(2).open().await?;
    // Keys k000000001 ..: even ones are written and read, odd ones removed.
    let fill_sql = format!(
        "INSERT INTO \"{table}\" (primary_namespace, secondary_namespace, key, value, epoch) \
         SELECT '{NS}', '{SUB}', 'k' || lpad(i::text, 9, '0'), \
                convert_to(repeat(md5(i::text), {}), 'UTF8'), 1 \
           FROM generate_series($1::bigint, $2::bigint) AS i",
        VALUE_SIZE / 32
    );
    let started = Instant::now();
    let mut low = 1;
    while low <= rows {
        let high = (low + FILL_CHUNK - 1).min(rows);
        admin.execute(&fill_sql, &[&low, &high]).await?;
        if rows > FILL_CHUNK {
            eprintln!("{rows} rows: filled {high} in {:.0} s", started.elapsed().as_secs_f64());
        }
        low = high + 1;
    }
    admin.batch_execute(&format!("VACUUM ANALYZE \"{table}\"")).await?;
    let fill = started.elapsed();
    let table_bytes: i64 = admin
        .query_one("SELECT pg_total_relation_size($1::text::regclass)", &[&format!("\"{table}\"")])
        .await?
        .get(0);
    eprintln!(
        "{rows} rows: {:.1} GB, filled and vacuumed in {:.0} s",
        gb(table_bytes),
        fill.as_secs_f64()
    );
    match args.cache {
        Cache::Os => {}
        Cache::Cold => evict(admin, table).await?,
        Cache::Shared => {
            admin.batch_execute("CREATE EXTENSION IF NOT EXISTS pg_prewarm").await?;
            let sql = format!("SELECT pg_prewarm(oid) FROM ({RELATIONS}) AS r");
            admin.execute(&sql, &[&format!("\"{table}\"")]).await?;
        }
    }

    let mut size = Size {
        rows,
        fill,
        table_bytes,
        write: Vec::new(),
        read: Vec::new(),
        remove: Vec::new(),
        first_page: Vec::new(),
        middle_page: Vec::new(),
        plans: Vec::new(),
        read_buffers: [0.0; 4],
        list_all: Duration::ZERO,
        list_all_peak: 0,
    };
    let key = |n: i64| format!("k{n:09}");
    let mut rng = 0x9e37_79b9_7f4a_7c15_u64;
    let mut random = |below: i64| {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        (rng % below as u64) as i64
    };
    let middle = PageToken::new((rows / 2).to_string()); // A `created_seq`: the token's form.
    let value = support::value(VALUE_SIZE, 3);
    // Untimed warm-up: connections opened, statements prepared.
    store.write(NS, SUB, &key(2), value.clone()).await?;
    store.read(NS, SUB, &key(2)).await?;
    store.list_paginated(NS, SUB, None).await?;
    for i in 0..args.samples as i64 {
        let even = 2 * (1 + random(rows / 2));
        let t = Instant::now();
        store.write(NS, SUB, &key(even), value.clone()).await?;
        size.write.push(t.elapsed());
        let even = 2 * (1 + random(rows / 2));
        let t = Instant::now();
        store.read(NS, SUB, &key(even)).await?;
        size.read.push(t.elapsed());
        // Distinct odd keys: 7919 is prime, and no size here is a multiple of it.
        let odd = 2 * ((i * 7919) % (rows / 2)) + 1;
        let t = Instant::now();
        store.remove(NS, SUB, &key(odd), false).await?;
        size.remove.push(t.elapsed());
        let t = Instant::now();
        let page = store.list_paginated(NS, SUB, None).await?;
        size.first_page.push(t.elapsed());
        assert_eq!(page.keys.len(), 100, "a full first page");
        let t = Instant::now();
        let page = store.list_paginated(NS, SUB, Some(middle.clone())).await?;
        size.middle_page.push(t.elapsed());
        assert!(!page.keys.is_empty(), "a page in the middle");
    }
    // Where a read's pages come from. Keys not read by the samples, mostly.
    admin.batch_execute("SET track_io_timing = on").await?;
    let explain = format!(
        "EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) {}",
        READ.replace("{kv}", &format!("\"{table}\""))
    );
    for i in 0..READ_PROBES {
        let even = 2 * (1 + random(rows / 2));
        let plan = admin.query(&explain, &[&NS, &SUB, &key(even)]).await?;
        let plan: Vec<String> = plan.iter().map(|row| row.get(0)).collect();
        for (sum, figure) in size.read_buffers.iter_mut().zip(read_figures(&plan)) {
            *sum += figure / READ_PROBES as f64;
        }
        if i == 0 {
            size.plans.push(("read".to_owned(), plan.join("\n")));
        }
    }
    let page_sql = LIST_PAGE.replace("{kv}", &format!("\"{table}\""));
    for (name, before) in [("first page", i64::MAX), ("middle page", rows / 2)] {
        let explain = format!("EXPLAIN (ANALYZE, BUFFERS, COSTS OFF) {page_sql}");
        let plan = admin.query(&explain, &[&NS, &SUB, &before, &101_i64]).await?;
        let plan: Vec<String> = plan.iter().map(|row| row.get(0)).collect();
        size.plans.push((name.to_owned(), plan.join("\n")));
    }

    // Memory: the peak over this one call, from a reset high-water mark.
    let _ = std::fs::write("/proc/self/clear_refs", "5");
    let before = status_kib("VmRSS:");
    let t = Instant::now();
    let keys = store.list_all_keys().await?;
    size.list_all = t.elapsed();
    size.list_all_peak = status_kib("VmHWM:").saturating_sub(before) * 1024;
    let listed = keys.len() as i64;
    drop(keys);
    let removed = args.samples as i64;
    assert_eq!(listed, rows - removed.min(rows / 2), "list_all_keys lists every key left");
    store.close().await?;
    Ok(size)
}

/// Drops the files of `table` and its indexes from the OS page cache, after a `CHECKPOINT`
/// wrote them out (the kernel keeps dirty pages).
async fn evict(admin: &tokio_postgres::Client, table: &str) -> Result<(), BoxError> {
    admin.batch_execute("CHECKPOINT").await?;
    let dir: String = admin.query_one("SHOW data_directory", &[]).await?.get(0);
    for relation in admin.query(RELATIONS, &[&format!("\"{table}\"")]).await? {
        let path = format!("{dir}/{}", relation.get::<_, String>(1));
        // Segments of 1 GB: `path`, `path.1`, `path.2`, ...
        let segments = (0..).map(|n| if n == 0 { path.clone() } else { format!("{path}.{n}") });
        for file in segments.take_while(|file| std::path::Path::new(file).exists()) {
            let status = std::process::Command::new("dd")
                .args([format!("if={file}").as_str(), "iflag=nocache", "count=0", "status=none"])
                .status()?;
            if !status.success() {
                return Err(format!("dd could not drop {file} from the page cache").into());
            }
        }
    }
    Ok(())
}

/// From an `EXPLAIN (ANALYZE, BUFFERS)` of a read: shared buffers hit and read, ms spent
/// reading (`track_io_timing`), and the execution time in ms. The first of each is the top
/// node's, which counts its children's.
fn read_figures(plan: &[String]) -> [f64; 4] {
    let after = |line: &str, label: &str| -> f64 {
        line.split(label)
            .nth(1)
            .and_then(|rest| rest.split(|c: char| !(c.is_ascii_digit() || c == '.')).next())
            .and_then(|n| n.parse().ok())
            .unwrap_or(0.0)
    };
    let line = |prefix: &str| plan.iter().map(|l| l.trim()).find(|l| l.starts_with(prefix));
    let buffers = line("Buffers:").unwrap_or("");
    let io = line("I/O Timings:").unwrap_or("");
    let execution = line("Execution Time:").unwrap_or("");
    [
        after(buffers, "hit="),
        after(buffers, "read="),
        after(io, "read="),
        after(execution, "Time: "),
    ]
}

/// A field of /proc/self/status in KiB (0 if unreadable).
fn status_kib(field: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|line| line.strip_prefix(field))
        .and_then(|rest| rest.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0)
}

fn gb(bytes: i64) -> f64 {
    bytes as f64 / 1e9
}

fn median_ms(samples: &[Duration]) -> f64 {
    let mut sorted = samples.to_vec();
    sorted.sort();
    support::percentile(&sorted, 50.0).as_secs_f64() * 1e3
}

fn p99_ms(samples: &[Duration]) -> f64 {
    let mut sorted = samples.to_vec();
    sorted.sort();
    support::percentile(&sorted, 99.0).as_secs_f64() * 1e3
}

impl Size {
    fn text(&self) -> String {
        let mut out = format!(
            "\n{} rows ({:.2} GB with indexes; filled and vacuumed in {:.0} s), medians (p99) \
             in ms over {} samples:\n",
            self.rows,
            gb(self.table_bytes),
            self.fill.as_secs_f64(),
            self.write.len()
        );
        for (name, samples) in self.series() {
            let _ =
                writeln!(out, "  {name:<12} {:>7.3} ({:.3})", median_ms(samples), p99_ms(samples));
        }
        let [hit, read, read_ms, execution_ms] = self.read_buffers;
        let _ = writeln!(
            out,
            "  a read, mean of {READ_PROBES} EXPLAIN ANALYZE: shared buffers hit {hit:.1}, read \
             {read:.1} (in {read_ms:.3} ms); execution {execution_ms:.3} ms"
        );
        let _ = writeln!(
            out,
            "  list_all_keys {:.2} s, peak resident memory +{:.0} MB ({:.0} B per key)",
            self.list_all.as_secs_f64(),
            self.list_all_peak as f64 / 1e6,
            self.list_all_peak as f64 / self.rows as f64
        );
        for (name, plan) in &self.plans {
            let _ = writeln!(out, "  EXPLAIN of the {name}:");
            for line in plan.lines() {
                let _ = writeln!(out, "    {line}");
            }
        }
        out
    }

    fn series(&self) -> [(&'static str, &Vec<Duration>); 5] {
        [
            ("write", &self.write),
            ("read", &self.read),
            ("remove", &self.remove),
            ("first page", &self.first_page),
            ("middle page", &self.middle_page),
        ]
    }

    fn json(&self) -> String {
        let series: Vec<String> = self
            .series()
            .iter()
            .map(|(name, s)| {
                format!(
                    "{}:{{\"p50_ms\":{:.4},\"p99_ms\":{:.4}}}",
                    json_str(name),
                    median_ms(s),
                    p99_ms(s)
                )
            })
            .collect();
        let plans: Vec<String> = self
            .plans
            .iter()
            .map(|(name, plan)| format!("{}:{}", json_str(name), json_str(plan)))
            .collect();
        format!(
            "{{\"rows\":{},\"table_bytes\":{},\"fill_s\":{:.1},{},\"read_buffers\":{{\"hit\":{:.2},\
             \"read\":{:.2},\"read_ms\":{:.4},\"execution_ms\":{:.4}}},\"list_all_s\":{:.3},\
             \"list_all_peak_bytes\":{},\"plans\":{{{}}}}}",
            self.rows,
            self.table_bytes,
            self.fill.as_secs_f64(),
            series.join(","),
            self.read_buffers[0],
            self.read_buffers[1],
            self.read_buffers[2],
            self.read_buffers[3],
            self.list_all.as_secs_f64(),
            self.list_all_peak,
            plans.join(",")
        )
    }
}

/// What one round trip measured for batches.
struct BatchRun {
    delay_us: u64,
    rtt: Duration,
    fenced_batch: Vec<Duration>,
    unfenced_batch: Vec<Duration>,
    fenced_write: Vec<Duration>,
}

async fn batch(
    args: &Args,
    config: &tokio_postgres::Config,
    proxies: &tokio::runtime::Handle,
    table: &str,
    delay_us: u64,
) -> Result<BatchRun, BoxError> {
    let mut config = config.clone();
    let proxy = if delay_us > 0 {
        let port = config.get_ports().first().copied().unwrap_or(5432);
        let upstream = match config.get_hosts().first() {
            Some(Host::Tcp(host)) => (host.as_str(), port).to_socket_addrs()?.next(),
            _ => None,
        }
        .ok_or("the delay proxy needs a TCP host")?;
        let proxy = proxies.spawn(Proxy::start(upstream)).await??;
        proxy.set_delay(Duration::from_micros(delay_us));
        config = pgfence_testing::redirect(&config, proxy.addr());
        Some(proxy)
    } else {
        None
    };
    let ttl = Duration::from_secs(30);
    let store =
        PgKvStore::builder_from_config(config.clone()).table(table).pool_size(2).open().await?;
    let baseline = Baseline::new(&store, table, support::pool(config.clone(), 2), ttl);
    let keys: Vec<String> = (0..4 * BATCH).map(|i| format!("k{i:04}")).collect();
    let mut fill = store.batch();
    for key in &keys {
        fill = fill.put(NS, SUB, key, support::value(VALUE_SIZE, 1));
    }
    fill.commit().await?;
    let mut pings = Vec::new();
    for _ in 0..50 {
        let client = baseline.pool.get().await?;
        let statement = client.prepare_cached("SELECT 1").await?;
        let t = Instant::now();
        client.query_one(&statement, &[]).await?;
        pings.push(t.elapsed());
    }
    pings.sort();
    let rtt = support::percentile(&pings, 50.0);
    let mut run = BatchRun {
        delay_us,
        rtt,
        fenced_batch: Vec::new(),
        unfenced_batch: Vec::new(),
        fenced_write: Vec::new(),
    };
    const WARMUP: usize = 5;
    for round in 0..args.batch_rounds + WARMUP {
        // A different window of 100 existing keys each round, every value new.
        let window = |shift: usize| -> Vec<(String, Vec<u8>)> {
            let first = ((round * 3 + shift) % 4) * BATCH;
            (first..first + BATCH)
                .map(|i| (keys[i].clone(), support::value(VALUE_SIZE, (round * 7 + shift) as u64)))
                .collect()
        };
        for turn in 0..3 {
            let which = (turn + round) % 3; // Rotated, so drift hits all three alike.
            let t = Instant::now();
            match which {
                0 => {
                    let mut batch = store.batch();
                    for (key, value) in window(0) {
                        batch = batch.put(NS, SUB, &key, value);
                    }
                    batch.commit().await?;
                }
                1 => baseline.unfenced_batch(&window(1)).await?,
                _ => {
                    store
                        .write(
                            NS,
                            SUB,
                            &keys[round % keys.len()],
                            support::value(VALUE_SIZE, round as u64),
                        )
                        .await?
                }
            }
            let elapsed = t.elapsed();
            if round >= WARMUP {
                [&mut run.fenced_batch, &mut run.unfenced_batch, &mut run.fenced_write][which]
                    .push(elapsed);
            }
        }
    }
    store.close().await?;
    drop(baseline);
    drop(proxy);
    Ok(run)
}

impl BatchRun {
    fn text(&self) -> String {
        let (fenced, unfenced, write) = (
            median_ms(&self.fenced_batch),
            median_ms(&self.unfenced_batch),
            median_ms(&self.fenced_write),
        );
        format!(
            "\nBatch of {BATCH} puts, {} µs each way (SELECT 1 round trip p50 {:.3} ms), medians \
             over {} rounds:\n  fenced batch {fenced:.3} ms, unfenced batch statement \
             {unfenced:.3} ms, one fenced write {write:.3} ms\n  fenced/unfenced batch \
             {:.2}x (target <= 1.2x); fenced batch/one fenced write {:.2}x (target <= 3x)\n",
            self.delay_us,
            self.rtt.as_secs_f64() * 1e3,
            self.fenced_batch.len(),
            fenced / unfenced,
            fenced / write
        )
    }

    fn json(&self) -> String {
        format!(
            "{{\"delay_us\":{},\"rtt_p50_ms\":{:.4},\"fenced_batch_p50_ms\":{:.4},\
             \"unfenced_batch_p50_ms\":{:.4},\"fenced_write_p50_ms\":{:.4},\"rounds\":{}}}",
            self.delay_us,
            self.rtt.as_secs_f64() * 1e3,
            median_ms(&self.fenced_batch),
            median_ms(&self.unfenced_batch),
            median_ms(&self.fenced_write),
            self.fenced_batch.len()
        )
    }
}
