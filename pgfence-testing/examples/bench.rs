//! Side-by-side write benchmark: the fenced write against an unfenced upsert (and the designs
//! the store replaced) in one run, at several numbers of concurrent writers.
//!
//! ```text
//! cargo run --release -p pgfence-testing --example bench -- [--concurrency 1,4,16]
//!     [--value-size 1024] [--duration-secs 5] [--rounds 3] [--delay-us N] [--unix] [--json]
//!     [--database-url URL] [--variants unfenced,fenced,fenced-wc4,solo,pinned,naive,ldk-node,
//!     unfenced-pgb-session,fenced-pgb-session,fenced-pgb-tx]
//!     [--renew-probe-ms 50] [--sample-waits] [--keys-per-writer 64] [--write-concurrency N]
//!     [--pool-mode session|transaction] [--trace-inflight] [--trace-ms 100]
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
//! - `fenced-wcN`: the same on a second store with `write_concurrency` N, on a table of its own
//!   (a lease is per table): an old default against the new one in the same run.
//! - `solo`: the store's fenced single-key statement, one per write, never shared: what
//!   `PgKvStore::write` did before write coalescing (raw SQL with the store's owner id).
//! - `pinned`: `solo` with a CTE that sets `synchronous_commit` for its transaction: what a
//!   pin in every statement would cost, against the store's pin per session.
//! - `naive`: `BEGIN`, renew the lease with an `UPDATE`, upsert, `COMMIT`, one pooled connection
//!   per writer: the seed's first design, which the fenced statement replaced.
//! - `ldk-node`: ldk-node's pattern: the fenced statement of `solo` sent as a SQL string
//!   (prepared again on every write: two round trips), every write on one connection behind a
//!   mutex.
//!
//! Through PgBouncer: a variant named `<variant>-pgb-session` or `<variant>-pgb-tx` (for
//! `unfenced` and the store's variants: `fenced-pgb-tx`, `fenced-wc8-pgb-session`, ...) connects
//! through a private PgBouncer (`pgfence_testing::PgBouncer`, Debian's `/usr/sbin/pgbouncer`) in
//! session or transaction mode, started for the run when a variant needs it, on 127.0.0.1, in
//! front of the server (with `--delay-us`, behind the proxy: a pooler beside the client). A store
//! through the transaction-mode bouncer is opened with `Builder::pool_mode(PoolMode::Transaction)`
//! (whatever `--pool-mode` says): a single write is one unnamed call of the table's fenced
//! PL/pgSQL function. Each store variant through a bouncer has a table of its own (a lease is per
//! table); `unfenced-pgb-session` writes the main table through the session-mode bouncer. There is
//! no `unfenced-pgb-tx`: its prepared statement would not survive PgBouncer 1.18 in transaction
//! mode. The ratios of a `-pgb-` variant are to `unfenced-pgb-session` when it runs (else to
//! `unfenced`), and the table adds, per store variant run both ways, transaction ÷ session mode.
//! The CPU time of each bouncer (one process) is counted per write like the server's.
//!
//! Each concurrency level runs every variant for `--duration-secs`, split into `--rounds`
//! interleaved slices (unfenced, fenced, naive, unfenced, ...) so that drift in the machine's
//! load hits every variant alike. Reported per variant: throughput, latency percentiles, WAL
//! bytes and MultiXacts per write, and the latency of a lease renewal (the store's `RENEW`
//! statement on a connection of its own, every `--renew-probe-ms`) timed while the writers run.
//! `--sample-waits` also samples `pg_stat_activity` wait events of the writers' backends.
//!
//! `--trace-inflight` samples, every millisecond of each timed slice, the statements in flight:
//! the connections in use of the variant's pool (the store's from `PgKvStore::stats`), or
//! whether `ldk-node`'s mutex is held. Every `--trace-ms` (100) it prints to stderr the writes
//! per second, the statements per second and writes per statement (a store's, from its
//! `Stats`: shared statements and their mutations), the mean and largest number in flight,
//! the mean write latency, a statement's mean duration (Little's law: in flight ÷ statements
//! per second) and the rest of the latency, the wait for a statement. The per-slice means go
//! into the tables and the JSON.
//!
//! With `--json`, prints one JSON object on stdout (the tables go to stderr); see
//! `scripts/bench_chart.py` for the chart made from it.

#[path = "support/mod.rs"]
mod support;

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use pgfence::PgKvStore;
use pgfence_testing::{PgBouncer, PoolMode as BouncerMode, Proxy, TestCluster, unique_name};
use support::{Baseline, BoxError, NS, OneConnection, SUB, json_str, percentile};
use tokio::sync::watch;
use tokio_postgres::config::Host;

const USAGE: &str = "usage: bench [--concurrency 1,4,16] [--value-size 1024] [--duration-secs 5] \
[--rounds 3] [--delay-us N] [--unix] [--json] [--database-url URL] \
[--variants unfenced,fenced,fenced-wcN,solo,pinned,naive,ldk-node,<variant>-pgb-session,\
<variant>-pgb-tx] [--renew-probe-ms 50] \
[--sample-waits] [--keys-per-writer 64] [--write-concurrency N] \
[--pool-mode session|transaction] [--trace-inflight] [--trace-ms 100]";

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
    /// `--trace-inflight`: print the statements in flight every this long (`--trace-ms`).
    trace: Option<Duration>,
}

/// What the writers of a variant call (see the module docs).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Variant {
    /// The unfenced upsert, directly or through the session-mode bouncer.
    Unfenced(Route),
    /// A call of the store's API on the store of this [`StoreKey`]. Each key opens a store of
    /// its own.
    Store(StoreApi, StoreKey),
    Solo,
    Pinned,
    Naive,
    LdkNode,
}

/// How a variant's connections reach the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Route {
    /// To the server (or the delay proxy in front of it).
    Direct,
    /// Through the private PgBouncer in session mode.
    PgbSession,
    /// Through the private PgBouncer in transaction mode.
    PgbTx,
}

impl Route {
    const ALL: [Route; 3] = [Route::Direct, Route::PgbSession, Route::PgbTx];

    /// The end of the names of the variants on this route.
    fn suffix(self) -> &'static str {
        match self {
            Route::Direct => "",
            Route::PgbSession => "-pgb-session",
            Route::PgbTx => "-pgb-tx",
        }
    }

    /// The bouncer's pool mode, for a route through one.
    fn bouncer_mode(self) -> Option<BouncerMode> {
        match self {
            Route::Direct => None,
            Route::PgbSession => Some(BouncerMode::Session),
            Route::PgbTx => Some(BouncerMode::Transaction),
        }
    }
}

/// Which store a [`Variant::Store`] writes through.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct StoreKey {
    /// Its `write_concurrency`: `None` for the one `--write-concurrency` sets, else the
    /// library's default.
    write_concurrency: Option<usize>,
    /// How it reaches the server.
    route: Route,
}

/// The main store: the one the baselines take their table and owner id from.
const MAIN: StoreKey = StoreKey { write_concurrency: None, route: Route::Direct };

/// The store call a [`Variant::Store`] times. Its name is the variant's (`fenced`), and
/// `<name>-wcN` runs it on a store with `write_concurrency` N.
///
/// Stores, tables, tracing and the reports follow from [`Variant::Store`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum StoreApi {
    /// `PgKvStore::write`, awaited.
    Write,
    /// `PgKvStore::write_deferred`, awaited: committed without waiting for the WAL flush.
    Deferred,
    /// `write_deferred`, then `PgKvStore::flush`: what making each write durable that way
    /// costs.
    Flush,
}

impl StoreApi {
    const ALL: [StoreApi; 3] = [StoreApi::Write, StoreApi::Deferred, StoreApi::Flush];

    fn name(self) -> &'static str {
        match self {
            StoreApi::Write => "fenced",
            StoreApi::Deferred => "deferred",
            StoreApi::Flush => "deferred+flush",
        }
    }
}

impl Variant {
    fn name(self) -> String {
        match self {
            Variant::Unfenced(route) => format!("unfenced{}", route.suffix()),
            Variant::Store(api, StoreKey { write_concurrency, route }) => format!(
                "{}{}{}",
                api.name(),
                write_concurrency.map_or(String::new(), |n| format!("-wc{n}")),
                route.suffix()
            ),
            Variant::Solo => "solo".into(),
            Variant::Pinned => "pinned".into(),
            Variant::Naive => "naive".into(),
            Variant::LdkNode => "ldk-node".into(),
        }
    }

    fn parse(s: &str) -> Result<Variant, String> {
        let (rest, route) = Route::ALL
            .into_iter()
            .rev()
            .find_map(|r| Some((s.strip_suffix(r.suffix()).filter(|_| r != Route::Direct)?, r)))
            .unwrap_or((s, Route::Direct));
        let direct = |v: Variant| match route {
            Route::Direct => Ok(v),
            _ => Err(format!("variant {s:?}: only unfenced and the store's run through PgBouncer")),
        };
        match rest {
            "unfenced" if route == Route::PgbTx => {
                return Err(format!(
                    "variant {s:?}: its prepared statement would not survive PgBouncer 1.18 in \
                     transaction mode"
                ));
            }
            "unfenced" => return Ok(Variant::Unfenced(route)),
            "solo" => return direct(Variant::Solo),
            "pinned" => return direct(Variant::Pinned),
            "naive" => return direct(Variant::Naive),
            "ldk-node" => return direct(Variant::LdkNode),
            _ => {}
        }
        let (api, write_concurrency) = match rest.split_once("-wc") {
            Some((api, n)) => {
                let n: usize =
                    n.parse().map_err(|_| format!("variant {s:?}: -wc needs a number"))?;
                (api, Some(n.max(1)))
            }
            None => (rest, None),
        };
        match StoreApi::ALL.into_iter().find(|a| a.name() == api) {
            Some(api) => Ok(Variant::Store(api, StoreKey { write_concurrency, route })),
            None => Err(format!("unknown variant {s:?}")),
        }
    }

    /// The store the variant writes through, if it does.
    fn store(self) -> Option<StoreKey> {
        match self {
            Variant::Store(_, key) => Some(key),
            _ => None,
        }
    }

    /// How its connections reach the server.
    fn route(self) -> Route {
        match self {
            Variant::Unfenced(route) | Variant::Store(_, StoreKey { route, .. }) => route,
            Variant::Solo | Variant::Pinned | Variant::Naive | Variant::LdkNode => Route::Direct,
        }
    }
}

/// The variant of the store's `write` on the main store.
const FENCED: Variant = Variant::Store(StoreApi::Write, MAIN);
/// The unfenced baseline, direct.
const UNFENCED: Variant = Variant::Unfenced(Route::Direct);

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
        variants: vec![UNFENCED, FENCED, Variant::Naive],
        renew_probe: Some(Duration::from_millis(50)),
        sample_waits: false,
        keys_per_writer: 64,
        write_concurrency: None,
        pool_mode: pgfence::PoolMode::Session,
        trace: None,
    };
    let mut trace_every = Duration::from_millis(100);
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
            "--trace-inflight" => args.trace = Some(trace_every),
            "--trace-ms" => {
                trace_every = Duration::from_millis(number(&flag, value(&flag)?)?.max(1));
                args.trace = args.trace.map(|_| trace_every);
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
    if args.unix && args.variants.iter().any(|v| v.route() != Route::Direct) {
        return Err("the -pgb- variants need TCP: PgBouncer connects to the server over TCP".into());
    }
    Ok(Some(args))
}

fn main() {
    support::main("bench", USAGE, parse_args(), run);
}

/// Where the server is, and what must stay alive (and be stopped at the end) to reach it.
/// Its fields drop in order: the bouncers, then the proxy they may connect through, then the
/// server.
struct Target {
    config: tokio_postgres::Config,
    transport: String,
    /// The bouncers the variants' routes need, each with the configuration through it and its
    /// process id (for its CPU time), when found.
    bouncers: BTreeMap<Route, (PgBouncer, tokio_postgres::Config, Option<u32>)>,
    /// The bouncers' version, from their log (`PgBouncer 1.18.0`).
    bouncer_version: Option<String>,
    /// The delay proxy, with the runtime its tasks run on.
    _proxy: Option<(Proxy, tokio::runtime::Runtime)>,
    /// The private cluster; dropping it stops the server and deletes its files.
    _cluster: Option<TestCluster>,
}

impl Target {
    /// The connection configuration of `route`.
    fn config(&self, route: Route) -> &tokio_postgres::Config {
        match self.bouncers.get(&route) {
            Some((_, config, _)) => config,
            None => &self.config,
        }
    }

    /// The process id of `route`'s bouncer, when it has one and it was found.
    fn pooler_pid(&self, route: Route) -> Option<u32> {
        self.bouncers.get(&route).and_then(|(_, _, pid)| *pid)
    }
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
    // The bouncers connect to where the variants would: the server, or the delay proxy.
    let mut bouncers = BTreeMap::new();
    let mut bouncer_version = None;
    let mut routes: Vec<Route> = args.variants.iter().map(|v| v.route()).collect();
    routes.sort();
    routes.dedup();
    for route in routes {
        let Some(mode) = route.bouncer_mode() else { continue };
        let upstream = tcp_addr(&config)?;
        let bouncer = PgBouncer::start(upstream, mode)?;
        let pid = pgbouncer_pid(bouncer.addr().port());
        bouncer_version = bouncer_version.or_else(|| {
            let log = bouncer.log();
            let at = log.find("PgBouncer ")?;
            log[at..].split([',', '\n']).next().map(str::to_owned)
        });
        transport += &format!(
            "; *{}: {}, {} mode, on {}",
            route.suffix(),
            bouncer_version.as_deref().unwrap_or("PgBouncer"),
            format!("{mode:?}").to_lowercase(),
            bouncer.addr()
        );
        let via = bouncer.config_via(&config);
        bouncers.insert(route, (bouncer, via, pid));
    }
    Ok(Target { config, transport, bouncers, bouncer_version, _proxy: proxy, _cluster: cluster })
}

/// The process id of the private PgBouncer listening on `port`: the `pgbouncer` process whose
/// ini file (its command line's) sets that `listen_port`. Linux only.
fn pgbouncer_pid(port: u16) -> Option<u32> {
    let wanted = format!("listen_port = {port}");
    std::fs::read_dir("/proc").ok()?.flatten().find_map(|entry| {
        let pid = entry.file_name().to_str()?.parse::<u32>().ok()?;
        let comm = std::fs::read_to_string(format!("/proc/{pid}/comm")).ok()?;
        if comm.trim_end() != "pgbouncer" {
            return None;
        }
        let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).ok()?;
        let ini = cmdline
            .split(|&b| b == 0)
            .filter_map(|arg| std::str::from_utf8(arg).ok())
            .find(|arg| arg.ends_with(".ini"))?
            .to_owned();
        let text = std::fs::read_to_string(ini).ok()?;
        text.lines().any(|line| line.trim() == wanted).then_some(pid)
    })
}

fn tcp_addr(config: &tokio_postgres::Config) -> Result<SocketAddr, BoxError> {
    let port = config.get_ports().first().copied().unwrap_or(5432);
    match config.get_hosts().first() {
        Some(Host::Tcp(host)) => Ok((host.as_str(), port)
            .to_socket_addrs()?
            .next()
            .ok_or_else(|| format!("{host} has no address"))?),
        _ => Err("--delay-us and the -pgb- variants need a TCP host".into()),
    }
}

/// The measurements of one variant at one concurrency, over all its rounds.
#[derive(Debug, Default)]
struct Measured {
    latencies: Vec<Duration>,
    elapsed: Duration,
    /// Per round: writes per second and median latency, for ratios to unfenced round by round.
    rounds: Vec<(f64, Duration)>,
    renewals: Vec<Duration>,
    /// Renewals of the probe that commits with `synchronous_commit = off`.
    renewals_async: Vec<Duration>,
    renewal_errors: usize,
    waits: BTreeMap<String, u64>,
    wal_bytes: i64,
    multixacts: i64,
    server_cpu: Option<Duration>,
    client_cpu: Option<Duration>,
    /// CPU time of the variant's bouncer, for a route through one.
    pooler_cpu: Option<Duration>,
    /// A store's statements, counted from its `Stats` around each slice; `None` for the
    /// baselines, which run one statement (or transaction) per write.
    statements: Option<u64>,
    /// With `--trace-inflight`: the statements in flight, summed over the samples, and the
    /// number of samples.
    in_flight: Option<(f64, u64)>,
}

/// Server-side counters read before and after each slice.
struct Counters {
    wal_lsn: i64,
    mxid_age: i64,
    /// CPU time of the whole server (postmaster and every child), when it runs on this machine.
    server_cpu: Option<Duration>,
    /// CPU time of this process (the client side: driver, pool, store, bench loop).
    client_cpu: Option<Duration>,
    /// CPU time of the variant's bouncer (one process), for a route through one.
    pooler_cpu: Option<Duration>,
}

fn run(args: Args) -> Result<(), BoxError> {
    let target = target(&args)?;
    let runtime = tokio::runtime::Builder::new_multi_thread().enable_all().build()?;
    let result = runtime.block_on(bench(&args, &target));
    // The runtime goes first (its connections to the bouncers and the proxy with it), then the
    // bouncers, the proxy and the cluster, when `target` drops.
    drop(runtime);
    drop(target);
    result
}

/// The table of the store `key`: the main one's, or one of its own per `write_concurrency` and
/// route.
fn store_table(table: &str, key: StoreKey) -> String {
    let mut name = table.to_owned();
    if let Some(n) = key.write_concurrency {
        name += &format!("_wc{n}");
    }
    name += match key.route {
        Route::Direct => "",
        Route::PgbSession => "_pgbs",
        Route::PgbTx => "_pgbt",
    };
    name
}

async fn bench(args: &Args, target: &Target) -> Result<(), BoxError> {
    let table = unique_name("bench");
    let measured = measure(args, target, &table).await;
    // Dropped whatever happened: on a given server they would stay for good.
    let dropped = async {
        let (admin, connection) = target.config.connect(tokio_postgres::NoTls).await?;
        let connection = tokio::spawn(connection);
        let mut keys: Vec<StoreKey> = args.variants.iter().filter_map(|v| v.store()).collect();
        keys.push(MAIN);
        keys.sort();
        keys.dedup();
        for key in keys {
            let t = store_table(&table, key);
            admin
                .batch_execute(&format!(
                    "DROP TABLE IF EXISTS \"{t}\", \"{t}_lease\", \"{t}_schema_version\", \
                     \"{t}_crash_marker\""
                ))
                .await?;
        }
        drop(admin);
        let _ = connection.await;
        Ok::<_, BoxError>(())
    };
    let dropped = dropped.await;
    measured.and(dropped)
}

async fn measure(args: &Args, target: &Target, table: &str) -> Result<(), BoxError> {
    let load_start = load_average();
    let max_writers = args.concurrency.iter().copied().max().unwrap_or(1);
    let ttl = Duration::from_secs(30); // The store's defaults: 30 s TTL, renewal every 10 s.
    // The main store, and one more per `-wcN` and route of the variants, each on its table.
    let mut keys: Vec<StoreKey> = args.variants.iter().filter_map(|v| v.store()).collect();
    keys.push(MAIN);
    keys.sort();
    keys.dedup();
    let mut stores = BTreeMap::new();
    for key in keys {
        let pool_mode = match key.route {
            Route::PgbTx => pgfence::PoolMode::Transaction,
            Route::Direct | Route::PgbSession => args.pool_mode,
        };
        let mut builder = PgKvStore::builder_from_config(target.config(key.route).clone())
            .table(store_table(table, key))
            .pool_size(max_writers)
            .pool_mode(pool_mode);
        if let Some(statements) = key.write_concurrency.or(args.write_concurrency) {
            builder = builder.write_concurrency(statements);
        }
        stores.insert(key, builder.open().await?);
    }
    let store = stores[&MAIN].clone();
    // The unfenced baseline per route of its variants, on the main store's table; the direct
    // one also for the other baselines.
    let mut baselines = BTreeMap::new();
    for route in args.variants.iter().filter_map(|&v| match v {
        Variant::Unfenced(route) => Some(route),
        _ => None,
    }) {
        let pool = support::pool(target.config(route).clone(), max_writers);
        baselines.insert(route, Baseline::new(&store, table, pool, ttl));
    }
    baselines.entry(Route::Direct).or_insert_with(|| {
        Baseline::new(&store, table, support::pool(target.config.clone(), max_writers), ttl)
    });
    let one_connection = if args.variants.contains(&Variant::LdkNode) {
        Some(OneConnection::connect(&target.config, &store, table).await?)
    } else {
        None
    };
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

    // Every key any writer will update exists before timing starts, in every store's table.
    let value = support::value(args.value_size, 7);
    for (&key, store) in &stores {
        let mut batch = store.batch();
        for w in 0..max_writers {
            for k in 0..args.keys_per_writer {
                batch = batch.put(NS, SUB, &self::key(w, k), value.clone());
            }
        }
        batch.commit().await?;
        // Steady state: statistics as autovacuum would have gathered them (see
        // docs/benchmarks-archive.md, "Surprises").
        admin.batch_execute(&format!("ANALYZE \"{}\"", store_table(table, key))).await?;
    }

    // The round trip as the writers see it: a prepared `SELECT 1` on a pooled connection.
    let mut pings = Vec::with_capacity(200);
    for _ in 0..200 {
        let began = Instant::now();
        workload_ping(&probe).await?;
        pings.push(began.elapsed());
    }
    pings.sort();
    let rtt = (percentile(&pings, 50.0), percentile(&pings, 99.0));

    let workload = Workload {
        stores,
        baselines,
        one_connection,
        value_size: args.value_size,
        next_write: (0..max_writers).map(|_| AtomicU64::new(0)).collect(),
    };
    let mut results: BTreeMap<(usize, Variant), Measured> = BTreeMap::new();
    for &writers in &args.concurrency {
        // Warm-up, untimed: every pooled connection opened and every statement prepared.
        let warm = args.duration.div_f64(5.0).min(Duration::from_secs(1));
        for &variant in &args.variants {
            slice(&workload, variant, writers, warm, args.keys_per_writer, &Tally::default())
                .await?;
        }
        let per_round = args.duration.div_f64(f64::from(args.rounds));
        for round in 0..args.rounds as usize {
            // Rotate who goes first, so no variant always follows the same one.
            let mut order = args.variants.clone();
            let first = round % order.len();
            order.rotate_left(first);
            for variant in order {
                eprintln!("{writers:>3} writers, round {}: {}", round + 1, variant.name());
                let pooler = target.pooler_pid(variant.route());
                let before = counters(&admin, postmaster, pooler).await?;
                let statements_before = workload.statements(variant);
                let (stop, stopped) = watch::channel(false);
                let sampler = args
                    .sample_waits
                    .then(|| tokio::spawn(sample_waits(target.config.clone(), stopped.clone())));
                let prober = args.renew_probe.map(|every| {
                    // Half an interval apart, so the two probes never queue on each other's
                    // row lock of the lease.
                    let sync =
                        probe_renewals(probe.clone(), every, Duration::ZERO, stopped.clone());
                    let not_sync =
                        probe_renewals(probe_async.clone(), every, every / 2, stopped.clone());
                    (tokio::spawn(sync), tokio::spawn(not_sync))
                });
                let tally = Tally::default();
                let tracer = args.trace.map(|every| {
                    let label = format!("{writers:>3} {:<12}", variant.name());
                    trace(&workload, variant, &tally, every, label, stopped)
                });
                let slice =
                    slice(&workload, variant, writers, per_round, args.keys_per_writer, &tally);
                let ((latencies, elapsed), in_flight) = match tracer {
                    Some(tracer) => {
                        // The tracer runs until the slice is over and `stop` is sent.
                        let (result, in_flight) = join_first(slice, tracer, &stop).await;
                        (result?, Some(in_flight))
                    }
                    None => (slice.await?, None),
                };
                let after = counters(&admin, postmaster, pooler).await?;
                stop.send_replace(true);
                let m = results.entry((writers, variant)).or_default();
                let mut sorted = latencies.clone();
                sorted.sort();
                let per_sec = sorted.len() as f64 / elapsed.as_secs_f64().max(1e-9);
                m.rounds.push((per_sec, percentile(&sorted, 50.0)));
                m.latencies.extend(latencies);
                m.elapsed += elapsed;
                m.wal_bytes += after.wal_lsn - before.wal_lsn;
                m.server_cpu = add_cpu(m.server_cpu, before.server_cpu, after.server_cpu);
                m.client_cpu = add_cpu(m.client_cpu, before.client_cpu, after.client_cpu);
                if pooler.is_some() {
                    m.pooler_cpu = add_cpu(m.pooler_cpu, before.pooler_cpu, after.pooler_cpu);
                }
                m.multixacts += after.mxid_age - before.mxid_age;
                if let (Some(b), Some(a)) = (statements_before, workload.statements(variant)) {
                    *m.statements.get_or_insert(0) += a - b;
                }
                if let Some((sum, n)) = in_flight {
                    let total = m.in_flight.get_or_insert((0.0, 0));
                    total.0 += sum;
                    total.1 += n;
                }
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
    for store in workload.stores.values() {
        store.close().await?;
    }
    drop(admin);
    let _ = admin_task.await;

    let load = (load_start, load_average());
    let report = Report {
        args,
        transport: &target.transport,
        server_version,
        rtt,
        results,
        load,
        bouncer_version: target.bouncer_version.clone(),
    };
    if args.json {
        // The JSON is the output; the table still goes to stderr for whoever watches the run.
        eprint!("{}", report.table());
        println!("{}", report.json());
    } else {
        print!("{}", report.table());
    }
    Ok(())
}

/// Runs `slice` and `tracer` concurrently; once the slice is over, sends `stop` so that the
/// tracer ends too, and returns both outputs.
async fn join_first<A, B>(
    slice: impl std::future::Future<Output = A>,
    tracer: impl std::future::Future<Output = B>,
    stop: &watch::Sender<bool>,
) -> (A, B) {
    let slice = async {
        let out = slice.await;
        stop.send_replace(true);
        out
    };
    tokio::join!(slice, tracer)
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
    /// The stores of the [`Variant::Store`] variants, by `write_concurrency`.
    stores: BTreeMap<StoreKey, PgKvStore>,
    /// The baselines, by route: the direct one always (for `solo`, `pinned`, `naive`), and the
    /// others' of the `unfenced` variants.
    baselines: BTreeMap<Route, Baseline>,
    /// `ldk-node`'s one connection, when that variant runs.
    one_connection: Option<OneConnection>,
    value_size: usize,
    /// Per writer, the number of its next write, counted across slices: every write changes
    /// its row's value, also the first of a slice after a slow variant's few (counting from 0
    /// again, a slice rewrote the values the last one wrote, and its WAL shrank to a third).
    next_write: Vec<AtomicU64>,
}

impl Workload {
    /// The value of the `n`th write of a writer: different in every byte from the last one, as
    /// a real state update would be (PostgreSQL logs only the changed middle of an updated row
    /// that stays on its page, so rewriting one value again and again would hide most of the
    /// WAL a write costs).
    fn value(&self, n: u64) -> Vec<u8> {
        support::value(self.value_size, n)
    }

    fn store(&self, key: StoreKey) -> &PgKvStore {
        &self.stores[&key]
    }

    fn baseline(&self, route: Route) -> &Baseline {
        &self.baselines[&route]
    }

    async fn write(&self, variant: Variant, key: &str, value: Vec<u8>) -> Result<(), BoxError> {
        match variant {
            Variant::Unfenced(route) => self.baseline(route).unfenced(key, &value).await,
            Variant::Store(StoreApi::Write, store) => {
                Ok(self.store(store).write(NS, SUB, key, value).await?)
            }
            Variant::Store(StoreApi::Deferred, store) => {
                Ok(self.store(store).write_deferred(NS, SUB, key, value).await?)
            }
            Variant::Store(StoreApi::Flush, store) => {
                let store = self.store(store);
                store.write_deferred(NS, SUB, key, value).await?;
                Ok(store.flush().await?)
            }
            Variant::Naive => self.baseline(Route::Direct).naive(key, &value).await,
            Variant::Solo => self.baseline(Route::Direct).fenced(key, &value).await,
            Variant::Pinned => self.baseline(Route::Direct).fenced_pinned(key, &value).await,
            Variant::LdkNode => {
                let one = self.one_connection.as_ref().expect("connected for ldk-node");
                one.fenced_unprepared(key, &value).await
            }
        }
    }

    /// The statements a store variant's store has run so far: each shared statement once, and
    /// every other write and remove one each. `None` for the baselines.
    fn statements(&self, variant: Variant) -> Option<u64> {
        let stats = self.store(variant.store()?).stats();
        let alone =
            (stats.writes.count + stats.removes.count).saturating_sub(stats.shared.mutations);
        Some(alone + stats.shared.statements)
    }

    /// The statements of `variant` in flight now: the connections in use of its pool (the
    /// store's own for a store variant), or whether `ldk-node`'s one connection is held.
    fn in_flight(&self, variant: Variant) -> usize {
        match variant {
            Variant::Store(_, store) => self.store(store).stats().pool.in_use,
            Variant::LdkNode => {
                usize::from(self.one_connection.as_ref().is_some_and(OneConnection::busy))
            }
            Variant::Unfenced(_) | Variant::Solo | Variant::Pinned | Variant::Naive => {
                let status = self.baseline(variant.route()).pool.status();
                status.size.saturating_sub(status.available)
            }
        }
    }
}

/// The writes of one slice so far, which its tracer reads while it runs.
#[derive(Debug, Default)]
struct Tally {
    writes: AtomicU64,
    /// Their latencies, summed, in nanoseconds.
    latency_nanos: AtomicU64,
}

impl Tally {
    fn add(&self, latency: Duration) {
        self.writes.fetch_add(1, Ordering::Relaxed);
        self.latency_nanos.fetch_add(latency.as_nanos() as u64, Ordering::Relaxed);
    }

    fn read(&self) -> (u64, u64) {
        (self.writes.load(Ordering::Relaxed), self.latency_nanos.load(Ordering::Relaxed))
    }
}

/// `--trace-inflight`: samples the statements in flight every millisecond until `stop`, and
/// prints a line every `every` (see the module docs). Returns the samples' sum and number.
async fn trace(
    workload: &Workload,
    variant: Variant,
    tally: &Tally,
    every: Duration,
    label: String,
    mut stop: watch::Receiver<bool>,
) -> (f64, u64) {
    let started = Instant::now();
    let mut tick = tokio::time::interval(Duration::from_millis(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let (mut total, mut samples) = (0.0, 0);
    // The window being summed: since when, the counters at its start, its samples.
    let mut since = Instant::now();
    let mut at_start = (tally.read(), workload.statements(variant));
    let (mut sum, mut n, mut max) = (0usize, 0u64, 0usize);
    loop {
        tokio::select! {
            _ = stop.changed() => break,
            _ = tick.tick() => {}
        }
        let in_flight = workload.in_flight(variant);
        (sum, n, max) = (sum + in_flight, n + 1, max.max(in_flight));
        total += in_flight as f64;
        samples += 1;
        let window = since.elapsed();
        if window < every {
            continue;
        }
        let now = (tally.read(), workload.statements(variant));
        let writes = now.0.0 - at_start.0.0;
        let latency_ms = (now.0.1 - at_start.0.1) as f64 / 1e6 / writes.max(1) as f64;
        let statements = match (at_start.1, now.1) {
            (Some(a), Some(b)) => b - a,
            _ => writes,
        };
        let secs = window.as_secs_f64();
        let mean = sum as f64 / n.max(1) as f64;
        // Little's law: statements in flight = statements per second × their duration.
        let statement_ms = mean / (statements as f64 / secs).max(1e-9) * 1e3;
        eprintln!(
            "trace {label} t {:>5.2} s  writes/s {:>6.0}  stmts/s {:>6.0}  writes/stmt {:>5.2}  \
             in flight {:>5.2} (max {max:>2})  latency {:>6.2} ms = stmt {:>6.2} + wait {:>6.2}",
            started.elapsed().as_secs_f64(),
            writes as f64 / secs,
            statements as f64 / secs,
            writes as f64 / statements.max(1) as f64,
            mean,
            latency_ms,
            statement_ms.min(latency_ms),
            (latency_ms - statement_ms).max(0.0),
        );
        since = Instant::now();
        at_start = now;
        (sum, n, max) = (0, 0, 0);
    }
    (total, samples)
}

/// Runs `writers` concurrent writers of one variant for `duration`; returns every write's
/// latency and the wall time until the last writer finished. Each write is also added to
/// `tally`.
async fn slice(
    workload: &Workload,
    variant: Variant,
    writers: usize,
    duration: Duration,
    keys_per_writer: usize,
    tally: &Tally,
) -> Result<(Vec<Duration>, Duration), BoxError> {
    let start = Instant::now();
    let deadline = start + duration;
    let tasks = (0..writers).map(|w| async move {
        let mut latencies = Vec::new();
        while Instant::now() < deadline {
            let i = workload.next_write[w].fetch_add(1, Ordering::Relaxed);
            let key = key(w, i as usize % keys_per_writer);
            let value = workload.value(i);
            let began = Instant::now();
            workload.write(variant, &key, value).await?;
            let latency = began.elapsed();
            tally.add(latency);
            latencies.push(latency);
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
    pooler: Option<u32>,
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
        pooler_cpu: pooler.and_then(process_cpu),
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
    /// The 1, 5 and 15 minute load averages before the measurements and after them.
    load: (Option<String>, Option<String>),
    /// The bouncers' version, when a variant ran through one.
    bouncer_version: Option<String>,
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
    pooler_cpu_per_op: Option<Duration>,
    renewal: Option<(usize, usize, Duration, Duration, Duration)>,
    renewal_async: Option<(usize, Duration, Duration, Duration)>,
    /// A store's writes per statement.
    writes_per_statement: Option<f64>,
    /// The mean number of statements in flight (`--trace-inflight`).
    in_flight: Option<f64>,
    /// With `--trace-inflight`: a statement's mean duration, from Little's law (in flight ÷
    /// statements per second), and the rest of the mean write latency: the wait for a
    /// statement, and the client's own time.
    statement_and_wait: Option<(Duration, Duration)>,
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
        pooler_cpu_per_op: m.pooler_cpu.map(|cpu| cpu / ops.max(1) as u32),
        renewal: (!renewals.is_empty() || m.renewal_errors > 0).then(|| {
            (
                renewals.len(),
                m.renewal_errors,
                percentile(&renewals, 50.0),
                percentile(&renewals, 99.0),
                renewals.last().copied().unwrap_or_default(),
            )
        }),
        writes_per_statement: m.statements.map(|n| ops as f64 / n.max(1) as f64),
        in_flight: m.in_flight.map(|(sum, n)| sum / n.max(1) as f64),
        statement_and_wait: m.in_flight.map(|(sum, n)| {
            let statements_per_sec =
                m.statements.unwrap_or(ops as u64) as f64 / m.elapsed.as_secs_f64().max(1e-9);
            let statement = Duration::from_secs_f64(
                (sum / n.max(1) as f64 / statements_per_sec.max(1e-9)).min(1e6),
            );
            let mean = if ops > 0 { total / ops as u32 } else { Duration::ZERO };
            (statement.min(mean), mean.saturating_sub(statement))
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

/// The median of the per-round ratios of `a` to `b` (rounds paired in order): of writes per
/// second with `index` 0, of the median latency with 1.
fn round_ratio(a: &Measured, b: &Measured, index: usize) -> f64 {
    let mut ratios: Vec<f64> = a
        .rounds
        .iter()
        .zip(&b.rounds)
        .map(|(x, y)| match index {
            0 => x.0 / y.0.max(1e-9),
            _ => x.1.as_secs_f64() / y.1.as_secs_f64().max(1e-9),
        })
        .collect();
    ratios.sort_by(f64::total_cmp);
    match ratios.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => ratios[n / 2],
        n => (ratios[n / 2 - 1] + ratios[n / 2]) / 2.0,
    }
}

impl Report<'_> {
    /// What `variant`'s ratios are to at `writers`: `unfenced` on its route if that ran (through
    /// the session-mode bouncer for `-pgb-tx`, which has no unfenced variant), else `unfenced`.
    /// `None` for `unfenced` itself, or when no baseline ran.
    fn base(&self, writers: usize, variant: Variant) -> Option<Variant> {
        let on_route = match variant.route() {
            Route::Direct => UNFENCED,
            Route::PgbSession | Route::PgbTx => Variant::Unfenced(Route::PgbSession),
        };
        [on_route, UNFENCED]
            .into_iter()
            .filter(|&base| base != variant)
            .find(|&base| self.results.contains_key(&(writers, base)))
    }

    /// The store variants run through both bouncers: per number of writers, the variant through
    /// the session-mode bouncer and the same through the transaction-mode one.
    fn mode_pairs(&self) -> Vec<(usize, Variant, Variant)> {
        self.results
            .keys()
            .filter_map(|&(writers, variant)| match variant {
                Variant::Store(api, key) if key.route == Route::PgbTx => {
                    let session = Variant::Store(api, StoreKey { route: Route::PgbSession, ..key });
                    self.results
                        .contains_key(&(writers, session))
                        .then_some((writers, session, variant))
                }
                _ => None,
            })
            .collect()
    }

    fn header(&self) -> String {
        format!(
            "{}{}; {} CPUs; {}; SELECT 1 round trip p50 {:.3} ms, p99 {:.3} ms;\n\
             {}-byte values; {:.1} s per variant and concurrency in {} rounds; \
             load average {} at the start, {} at the end",
            if cfg!(debug_assertions) { "DEBUG BUILD (use --release); " } else { "" },
            self.server_version.split(" on ").next().unwrap_or(&self.server_version),
            cpus(),
            self.transport,
            ms(self.rtt.0),
            ms(self.rtt.1),
            self.args.value_size,
            self.args.duration.as_secs_f64(),
            self.args.rounds,
            self.load.0.as_deref().unwrap_or("?"),
            self.load.1.as_deref().unwrap_or("?"),
        )
    }

    fn table(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(out, "\n{}\n", self.header());
        let _ = writeln!(
            out,
            "{:>7}  {:<20} {:>9} {:>9} {:>9} {:>9}  {:>8} {:>8} {:>8}  {:>8} {:>6} {:>8} {:>8} {:>7} {:>7} {:>7} {:>8} {:>8}",
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
            "cli µs",
            "pgb µs",
            "w/stmt",
            "flight",
            "stmt ms",
            "wait ms"
        );
        for (&(writers, variant), m) in &self.results {
            let s = summarize(m);
            let base = self.base(writers, variant).map(|b| summarize(&self.results[&(writers, b)]));
            let ratio = |f: fn(&Summary) -> f64| match &base {
                Some(b) => format!("{:.2}x", f(&s) / f(b)),
                None => "-".to_owned(),
            };
            let _ = writeln!(
                out,
                "{:>7}  {:<20} {:>9.0} {:>9.3} {:>9.3} {:>9.3}  {:>8} {:>8} {:>8}  {:>8.0} {:>6.2} {:>8} {:>8} {:>7} {:>7} {:>7} {:>8} {:>8}",
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
                s.pooler_cpu_per_op.map_or("-".to_owned(), |d| d.as_micros().to_string()),
                s.writes_per_statement.map_or("-".to_owned(), |w| format!("{w:.2}")),
                s.in_flight.map_or("-".to_owned(), |f| format!("{f:.2}")),
                s.statement_and_wait.map_or("-".to_owned(), |(st, _)| format!("{:.3}", ms(st))),
                s.statement_and_wait.map_or("-".to_owned(), |(_, w)| format!("{:.3}", ms(w))),
            );
        }
        let _ = writeln!(
            out,
            "\n(x: ratio to unfenced at the same number of writers (a -pgb- variant's: to \
             unfenced-pgb-session if it ran); mxact: MultiXacts created per write;\nsrv/cli/pgb \
             µs: CPU time per write of the whole server, of this process and of the variant's \
             PgBouncer;\nw/stmt: a store's writes per statement; with --trace-inflight, flight: \
             mean statements in flight,\nstmt ms: a statement's mean duration (flight ÷ \
             statements per second), wait ms: the rest of the mean latency)"
        );
        let pairs = self.mode_pairs();
        if !pairs.is_empty() {
            let _ = writeln!(
                out,
                "\nthrough {}, transaction ÷ session mode (median of the per-round ratios; whole \
                 run):",
                self.bouncer_version.as_deref().unwrap_or("PgBouncer")
            );
        }
        for (writers, session, tx) in pairs {
            let (a, b) = (&self.results[&(writers, tx)], &self.results[&(writers, session)]);
            let (sa, sb) = (summarize(a), summarize(b));
            let _ = writeln!(
                out,
                "{writers:>7}  {:<20} writes/s {:.2}x ({:.2}x)  p50 {:.2}x ({:.2}x)  server CPU \
                 {:.2}x",
                tx.name(),
                round_ratio(a, b, 0),
                sa.ops_per_sec / sb.ops_per_sec.max(1e-9),
                round_ratio(a, b, 1),
                sa.p50.as_secs_f64() / sb.p50.as_secs_f64().max(1e-9),
                match (sa.server_cpu_per_op, sb.server_cpu_per_op) {
                    (Some(x), Some(y)) => x.as_secs_f64() / y.as_secs_f64().max(1e-9),
                    _ => f64::NAN,
                },
            );
        }
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
                        "{writers:>7}  {:<20} async p50 {:.3} ms  p99 {:.3} ms  max {:.3} ms",
                        variant.name(),
                        ms(p50),
                        ms(p99),
                        ms(max)
                    );
                }
                if let Some((n, errors, p50, p99, max)) = s.renewal {
                    let _ = writeln!(
                        out,
                        "{writers:>7}  {:<20} p50 {:.3} ms  p99 {:.3} ms  max {:.3} ms  ({n} renewals, {errors} failed)",
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
                let _ = writeln!(out, "{writers:>7}  {:<20} {}", variant.name(), line.join(", "));
            }
        }
        out
    }

    fn json(&self) -> String {
        let mut results = Vec::new();
        for (&(writers, variant), m) in &self.results {
            let s = summarize(m);
            let base = self.base(writers, variant);
            let mut fields = vec![
                format!("\"writers\":{writers}"),
                format!("\"variant\":{}", json_str(&variant.name())),
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
            if let Some(cpu) = s.pooler_cpu_per_op {
                fields.push(format!("\"pooler_cpu_us_per_op\":{:.1}", cpu.as_secs_f64() * 1e6));
            }
            let rounds: Vec<String> = m
                .rounds
                .iter()
                .map(|(per_sec, p50)| format!("[{per_sec:.1},{}]", us(*p50)))
                .collect();
            fields.push(format!("\"rounds_ops_per_sec_p50_us\":[{}]", rounds.join(",")));
            if let Some(w) = s.writes_per_statement {
                fields.push(format!("\"writes_per_statement\":{w:.3}"));
            }
            if let Some(f) = s.in_flight {
                fields.push(format!("\"in_flight_mean\":{f:.3}"));
            }
            if let Some((statement, wait)) = s.statement_and_wait {
                fields.push(format!("\"statement_us\":{}", us(statement)));
                fields.push(format!("\"wait_us\":{}", us(wait)));
            }
            if let Some(base) = base {
                let b = summarize(&self.results[&(writers, base)]);
                fields.push(format!(
                    "\"vs_unfenced\":{{\"variant\":{},\"p50\":{:.3},\"p99\":{:.3},\"ops_per_sec\":{:.3}}}",
                    json_str(&base.name()),
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
            "{{\"tool\":\"pgfence-bench\",\"unix_time\":{started},\"load_start\":{},\"load_end\":{},\
\"server_version\":{},\"cpus\":{},\
\"transport\":{},\"rtt_p50_us\":{},\"rtt_p99_us\":{},\"delay_us\":{},\"value_size\":{},\
\"duration_secs\":{},\"rounds\":{},\"write_concurrency\":{},\"pgbouncer_version\":{},\
\"concurrency\":[{}],\"results\":[{}]}}",
            self.load.0.as_deref().map_or("null".to_owned(), json_str),
            self.load.1.as_deref().map_or("null".to_owned(), json_str),
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
            self.bouncer_version.as_deref().map_or("null".to_owned(), json_str),
            a.concurrency.iter().map(|c| c.to_string()).collect::<Vec<_>>().join(","),
            results.join(",")
        )
    }
}

/// The 1, 5 and 15 minute load averages (Linux `/proc/loadavg`), as `"0.52 0.58 0.59"`.
fn load_average() -> Option<String> {
    let text = std::fs::read_to_string("/proc/loadavg").ok()?;
    Some(text.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
}

fn cpus() -> usize {
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
}
