//! An ldk-node 0.7 node whose whole state lives in PostgreSQL, in a pgfence table.
//!
//! Run two of these on one table: the first takes the lease and runs the node; the second
//! waits as a standby. SIGTERM or SIGINT stops the node and releases the lease, so the standby
//! starts within milliseconds. After `kill -9`, the standby starts once the lease's TTL ran out.
//! A node whose lease is lost stops and exits 1, within a bound, through
//! `pgfence::shutdown::Watchdog`. With ldk-node 0.7.1, `Node::stop` panics after a lost lease
//! (its last persist fails), so the watchdog aborts the process instead: it ends either way.
//!
//! ```text
//! usage: pgfence-ldk-node-example run NAME            # a node instance (a standby until it holds the lease)
//!        pgfence-ldk-node-example run-fs NAME         # the same node on LDK's FilesystemStore
//!        pgfence-ldk-node-example run-sqlite NAME     # the same node on ldk-node's SQLite store
//!        pgfence-ldk-node-example import-sqlite NAME  # moves NODE_DIR's SQLite store into the table
//! environment: DATABASE_URL (required for run), PGFENCE_TABLE (default ldk_node),
//!              PGFENCE_TTL_SECS (default 30), NODE_DIR (default ./ldk-node-NAME)
//! ```
//!
//! It needs no network. The chain source is Esplora at a stub on 127.0.0.1 that this process
//! serves itself: it answers fee estimates with an empty map (accepted on regtest) and
//! everything else with 404. The node never reaches a real chain: wallet syncs fail and are
//! logged. Both instances use one fixed seed, so they are one node (one node id). A real
//! deployment keeps the seed secret and gives it to both machines.

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ldk_node::bitcoin::Network;
use ldk_node::lightning::util::persist::KVStoreSync;
use pgfence::ldk::LdkStore;
use pgfence::shutdown::Watchdog;
use pgfence::PgKvStore;

/// One node, whichever instance runs it. Never use a fixed seed for real funds.
const SEED: [u8; 64] = [7; 64];

/// How long the node may take to stop after its lease ended before the process aborts.
const SHUTDOWN_BOUND: Duration = Duration::from_secs(10);

type Error = Box<dyn std::error::Error>;

fn main() {
    let started = Instant::now();
    let args: Vec<String> = std::env::args().collect();
    let result = match args.get(1..).unwrap_or_default() {
        [mode, name] if mode == "run" => run(name, started),
        [mode, name] if mode == "run-fs" => run_fs(name),
        [mode, name] if mode == "run-sqlite" => run_sqlite(name),
        [mode, name] if mode == "import-sqlite" => import_sqlite(name),
        _ => Err("usage: pgfence-ldk-node-example run|run-fs|run-sqlite|import-sqlite NAME".into()),
    };
    if let Err(e) = result {
        eprintln!("{}: error: {e}", args.get(2).map_or("node", String::as_str));
        std::process::exit(2);
    }
}

/// A builder for the node, with everything but its store: regtest, the fixed seed, the stub
/// Esplora, logs in NODE_DIR.
fn node_builder(name: &str) -> Result<ldk_node::Builder, Error> {
    let dir = std::env::var("NODE_DIR").unwrap_or_else(|_| format!("ldk-node-{name}"));
    let mut builder = ldk_node::Builder::new();
    builder
        .set_network(Network::Regtest)
        .set_entropy_seed_bytes(SEED)
        .set_storage_dir_path(dir)
        .set_chain_source_esplora(format!("http://{}", stub_esplora()?), None);
    Ok(builder)
}

fn run(name: &str, started: Instant) -> Result<(), Error> {
    let url = std::env::var("DATABASE_URL").map_err(|_| "DATABASE_URL is not set")?;
    let table = std::env::var("PGFENCE_TABLE").unwrap_or_else(|_| "ldk_node".to_owned());
    let ttl = std::env::var("PGFENCE_TTL_SECS").ok().map(|s| s.parse::<u64>()).transpose()?;
    let mut store = PgKvStore::builder(&url).table(table);
    if let Some(ttl) = ttl {
        store = store.lease_ttl(Duration::from_secs(ttl));
    }
    let holding = Arc::new(AtomicBool::new(false));
    let signals = signals(holding.clone())?;

    // A standby until the lease is free; at once if it already is.
    println!("{name}: waiting for the lease");
    let store = Arc::new(LdkStore::open_standby(store.standby())?);
    holding.store(true, Ordering::SeqCst);
    let waited = started.elapsed();
    println!("{name}: lease taken, fencing token {}", store.fencing_token());
    let node = Arc::new(node_builder(name)?.build_with_store(store.clone())?);

    // Lease loss is terminal: stop the node, then exit non-zero so that the supervisor
    // restarts this process, as a standby. The watchdog aborts if stopping hangs.
    let watchdog = Watchdog::spawn(store.lease_watch(), SHUTDOWN_BOUND, {
        let node = node.clone();
        let name = name.to_owned();
        move |state| {
            eprintln!("{name}: lease ended ({state:?}): stopping the node");
            let _ = node.stop();
            std::process::exit(1);
        }
    })?;

    node.start()?;
    println!(
        "{name}: active: node {} on fencing token {}, after {} ms as a standby",
        node.node_id(),
        store.fencing_token(),
        waited.as_millis()
    );
    println!("{name}: {} keys in the table", store.blocking().list_all_keys()?.len());

    // Until SIGTERM or SIGINT.
    let signal = signals.recv()?;
    let stopping = Instant::now();
    // A planned stop: the watchdog first, or the release below would count as an ended lease.
    watchdog.stop();
    node.stop()?;
    drop(node);
    store.close()?;
    println!(
        "{name}: {signal}: node stopped and lease released in {} ms",
        stopping.elapsed().as_millis()
    );
    Ok(())
}

/// The same node on LDK's FilesystemStore (`NODE_DIR/fs_store`): what a node writes before it
/// moves to pgfence with `pgfence import --from-ldk-fs NODE_DIR/fs_store`.
fn run_fs(name: &str) -> Result<(), Error> {
    let signals = signals(Arc::new(AtomicBool::new(true)))?;
    let node = node_builder(name)?.build_with_fs_store()?;
    node.start()?;
    println!("{name}: active on a FilesystemStore: node {}", node.node_id());
    let signal = signals.recv()?;
    node.stop()?;
    println!("{name}: {signal}: node stopped");
    Ok(())
}

/// The same node on ldk-node's default store, SQLite (`NODE_DIR/ldk_node_data.sqlite`).
fn run_sqlite(name: &str) -> Result<(), Error> {
    let signals = signals(Arc::new(AtomicBool::new(true)))?;
    let node = node_builder(name)?.build()?;
    node.start()?;
    println!("{name}: active on a SQLite store: node {}", node.node_id());
    let signal = signals.recv()?;
    node.stop()?;
    println!("{name}: {signal}: node stopped");
    Ok(())
}

/// Moves a stopped node's SQLite store into the table, in one atomic batch under the lease,
/// then reads every key back through LDK's trait and compares. ldk-node's `SqliteStore` cannot
/// list all its keys (it is not a `MigratableKVStore`), so its table is read directly.
fn import_sqlite(name: &str) -> Result<(), Error> {
    let dir = std::env::var("NODE_DIR").unwrap_or_else(|_| format!("ldk-node-{name}"));
    let path = std::path::Path::new(&dir).join(ldk_node::io::sqlite_store::SQLITE_DB_FILE_NAME);
    if !path.is_file() {
        return Err(format!("no SQLite store at {}", path.display()).into());
    }
    let db =
        rusqlite::Connection::open_with_flags(&path, rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY)?;
    let sql = format!(
        "SELECT primary_namespace, secondary_namespace, key, value FROM {}",
        ldk_node::io::sqlite_store::KV_TABLE_NAME
    );
    let mut statement = db.prepare(&sql)?;
    let rows = statement
        .query_map([], |row| {
            let value: Option<Vec<u8>> = row.get(3)?;
            Ok((row.get(0)?, row.get(1)?, row.get(2)?, value.unwrap_or_default()))
        })?
        .collect::<Result<Vec<(String, String, String, Vec<u8>)>, _>>()?;

    let url = std::env::var("DATABASE_URL").map_err(|_| "DATABASE_URL is not set")?;
    let table = std::env::var("PGFENCE_TABLE").unwrap_or_else(|_| "ldk_node".to_owned());
    // Not a standby: the node must be stopped, so a held lease is an error here.
    let store = LdkStore::open(PgKvStore::builder(&url).table(table))?;
    let existing = store.blocking().list_all_keys()?.len();
    if existing > 0 {
        store.close()?;
        return Err(format!("the table already holds {existing} keys; not importing").into());
    }
    let pg = store.blocking();
    let batch = rows.iter().fold(pg.batch(), |b, (p, s, k, v)| b.put(p, s, k, v.clone()));
    pg.commit(batch)?;
    for (p, s, k, v) in &rows {
        if &KVStoreSync::read(&store, p, s, k)? != v {
            return Err(format!("{p}/{s}/{k} differs after the copy").into());
        }
    }
    store.close()?;
    println!("{name}: imported {} keys from {}, all verified", rows.len(), path.display());
    Ok(())
}

/// SIGTERM and SIGINT, as a channel: a thread waits for them on a small runtime of its own,
/// apart from the node's. Until `holding` is set, a signal ends the process at once: a standby
/// has nothing to stop or release.
fn signals(holding: Arc<AtomicBool>) -> Result<mpsc::Receiver<&'static str>, Error> {
    use tokio::signal::unix::{signal, SignalKind};
    let runtime = tokio::runtime::Builder::new_current_thread().enable_io().build()?;
    let (mut term, mut int) = runtime.block_on(async {
        Ok::<_, std::io::Error>((
            signal(SignalKind::terminate())?,
            signal(SignalKind::interrupt())?,
        ))
    })?;
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let name = runtime.block_on(async {
            tokio::select! {
                _ = term.recv() => "SIGTERM",
                _ = int.recv() => "SIGINT",
            }
        });
        if !holding.load(Ordering::SeqCst) {
            std::process::exit(0);
        }
        let _ = tx.send(name);
    });
    Ok(rx)
}

/// The chain source's stand-in: an HTTP server on a free loopback port that answers Esplora's
/// `GET /fee-estimates` with `{}` and every other request with 404. Returns its address.
fn stub_esplora() -> Result<std::net::SocketAddr, Error> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    std::thread::spawn(move || {
        for stream in listener.incoming().flatten() {
            let mut reader = BufReader::new(stream);
            let mut request = String::new();
            if reader.read_line(&mut request).is_err() {
                continue;
            }
            // Skip the headers; no request of Esplora's client has a body we need.
            let mut line = String::new();
            while reader.read_line(&mut line).is_ok_and(|n| n > 2) {
                line.clear();
            }
            let (status, body) = if request.starts_with("GET /fee-estimates ") {
                ("200 OK", "{}")
            } else {
                ("404 Not Found", "")
            };
            let _ = write!(
                reader.get_mut(),
                "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\
                 Connection: close\r\n\r\n{body}",
                body.len()
            );
        }
    });
    Ok(addr)
}
