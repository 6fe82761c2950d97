//! How pgfence's costs grow with the table, and what a batch costs at a real round trip.
//!
//! ```text
//! cargo run --release -p pgfence-testing --example scale -- [--rows 1000,100000,10000000]
//!     [--samples 300] [--batch-delays-us 0,400] [--batch-rounds 200] [--no-table]
//!     [--no-batch] [--json]
//! ```
//!
//! Table size, for each `--rows` N: a store opens a fresh table, and SQL fills it with N rows of
//! 1 KiB (`generate_series`, not through the store), then `VACUUM ANALYZE` (the steady state
//! autovacuum keeps). Then `--samples` rounds time, interleaved: a fenced `write` over an
//! existing key, a `read`, a `remove` of a distinct existing key, and `list_paginated` at the
//! first page and at the middle of the table. The query plan of both pages is printed
//! (`EXPLAIN ANALYZE`). Last, `list_all_keys` runs once with its peak resident memory measured
//! (`VmHWM` of /proc/self/status, reset through /proc/self/clear_refs first). The table is
//! dropped after each size.
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
use pgfence_testing::{Proxy, TestCluster, unique_name};
use support::{Baseline, BoxError, NS, SUB, json_str};
use tokio_postgres::config::Host;

const USAGE: &str = "usage: scale [--rows 1000,100000,10000000] [--samples 300] \
[--batch-delays-us 0,400] [--batch-rounds 200] [--no-table] [--no-batch] [--json]";

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

struct Args {
    rows: Vec<i64>,
    samples: usize,
    delays_us: Vec<u64>,
    batch_rounds: usize,
    table: bool,
    batch: bool,
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
    let (config, cluster) = match url {
        Some(url) => (url.parse::<tokio_postgres::Config>()?, None),
        None => {
            eprintln!("starting a private PostgreSQL cluster ...");
            let cluster = TestCluster::start()?;
            (cluster.config(), Some(cluster))
        }
    };
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
    let mut text = format!(
        "PostgreSQL {version}; {} CPUs; {}-byte values; {}\n",
        std::thread::available_parallelism().map_or(1, |n| n.get()),
        VALUE_SIZE,
        if cfg!(debug_assertions) { "DEBUG BUILD" } else { "release build" }
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
        "{{\"server_version\":{},\"value_size\":{VALUE_SIZE},\"samples\":{},\"sizes\":[{}],\
         \"batches\":[{}]}}",
        json_str(&version),
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
    let sql =
        format!("DROP TABLE IF EXISTS \"{table}\", \"{table}_lease\", \"{table}_schema_version\"");
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
            "{{\"rows\":{},\"table_bytes\":{},\"fill_s\":{:.1},{},\"list_all_s\":{:.3},\
             \"list_all_peak_bytes\":{},\"plans\":{{{}}}}}",
            self.rows,
            self.table_bytes,
            self.fill.as_secs_f64(),
            series.join(","),
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
