//! Wiring pgfence into an LDK node, and stopping the node when the lease is lost.
//!
//! `cargo run --example ldk --features ldk`. Uses `DATABASE_URL` when set; otherwise starts a
//! temporary PostgreSQL cluster from the binaries on this machine and stops it on exit.
//!
//! What a node does, in the order of `main`:
//!
//! 1. Open the store before building anything of LDK. `LeaseHeld` (`AlreadyExists` as an I/O
//!    error) means another instance of this node is live: stay a standby and try again later;
//!    never start LDK without the lease.
//! 2. Hand the store to LDK as `Arc<LdkStore>`: to the `MonitorUpdatingPersister` that the
//!    `ChainMonitor` persists channel monitors through, to the start-up reads, and as the
//!    `KVStore` that persists the `ChannelManager`, the network graph and the scorer (the
//!    background processor's job; a loop persisting the graph stands in for it here).
//! 3. Watch `lease_state()`. When it leaves `Held`, another instance owns the channel state now:
//!    stop the node at once (no more channel updates, no more broadcasts) and exit non-zero, so
//!    that the supervisor restarts this process as a standby. LDK itself keeps running after a
//!    failed persist: stopping it is the application's job. (Or open the store with
//!    `LeaseLossPolicy::Abort` and let the loss end the process without any watcher.)
//!
//! The example then simulates what the fencing exists for: this process stalls past its lease,
//! a second instance takes over, and the first one notices and stops.

use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use lightning::bitcoin::{Network, Transaction};
use lightning::chain::Filter;
use lightning::chain::chaininterface::{
    BroadcasterInterface, ConfirmationTarget, FeeEstimator, TransactionType,
};
use lightning::chain::chainmonitor::ChainMonitor;
use lightning::routing::gossip::NetworkGraph;
use lightning::sign::{InMemorySigner, KeysManager, NodeSigner};
use lightning::util::logger::{Logger, Record};
use lightning::util::persist::{
    KVStore, MonitorUpdatingPersister, NETWORK_GRAPH_PERSISTENCE_KEY,
    NETWORK_GRAPH_PERSISTENCE_PRIMARY_NAMESPACE, NETWORK_GRAPH_PERSISTENCE_SECONDARY_NAMESPACE,
};
use lightning::util::ser::{ReadableArgs, Writeable};
use pgfence::ldk::LdkStore;
use pgfence::{LeaseLossPolicy, LeaseState, PgKvStore};
use pgfence_testing::{TestServer, unique_name};
use tokio::sync::watch;

type Error = Box<dyn std::error::Error + Send + Sync>;

const USAGE: &str = "usage: ldk (no arguments; DATABASE_URL when set, else a temporary PostgreSQL)";

#[tokio::main]
async fn main() -> Result<(), Error> {
    match std::env::args().nth(1).as_deref() {
        None => {}
        Some("-h" | "--help") => {
            println!("{USAGE}");
            return Ok(());
        }
        Some(other) => {
            eprintln!("unknown argument {other:?}\n{USAGE}");
            std::process::exit(2);
        }
    }
    let server = TestServer::shared()?;
    let table = unique_name("ldk_node");
    let node = node(server, &table).await;
    // Dropped however the example ended: on the server of DATABASE_URL they would stay for good.
    let dropped = match server.connect().await {
        Ok(admin) => {
            let sql = format!(
                "DROP TABLE IF EXISTS \"{table}\", \"{table}_lease\", \"{table}_schema_version\", \
                 \"{table}_crash_marker\""
            );
            admin.batch_execute(&sql).await.map_err(Error::from)
        }
        Err(e) => Err(e.into()),
    };
    node.and(dropped)
}

async fn node(server: &TestServer, table: &str) -> Result<(), Error> {
    let builder = |instance: &str| {
        PgKvStore::builder_from_config(server.config())
            .table(table)
            .application_name(instance)
            // Renewal every 2 s, trusted locally for 6 s, valid in the database for 10 s: a
            // stalled or partitioned node stops writing 4 s before a standby can take over.
            .lease_ttl(Duration::from_secs(10))
            .renew_interval(Duration::from_secs(2))
            // The watcher below stops the node. In production, `Abort` is the belt to that
            // watcher's braces: nothing of the process runs on after a loss.
            .on_lease_lost(LeaseLossPolicy::FailClosed)
    };

    // 1. The lease first.
    let store = Arc::new(LdkStore::open_async(builder("ldk-node-a")).await?);
    println!("node A holds the lease on {table:?}, epoch {}", store.fencing_token());

    // 2. LDK on top of it.
    let logger = Arc::new(StdoutLogger);
    let broadcaster = Arc::new(NoBroadcast);
    let fees = Arc::new(FixedFees);
    let now = SystemTime::now().duration_since(UNIX_EPOCH)?;
    let keys = Arc::new(KeysManager::new(&[42; 32], now.as_secs(), now.subsec_nanos(), true));
    let persister = Arc::new(MonitorUpdatingPersister::new(
        Arc::clone(&store),
        Arc::clone(&logger),
        100, // Updates kept per monitor before a full monitor is written again.
        Arc::clone(&keys),
        Arc::clone(&keys),
        Arc::clone(&broadcaster),
        Arc::clone(&fees),
    ));
    // Start-up reads use the sync traits; they work inside this runtime too.
    let monitors = persister.read_all_channel_monitors_with_updates()?;
    println!("node A read {} channel monitors", monitors.len());
    let chain_monitor: ChainMonitor<InMemorySigner, _, _, _, _, _, _> = ChainMonitor::new(
        None::<Arc<dyn Filter + Send + Sync>>,
        Arc::clone(&broadcaster),
        Arc::clone(&logger),
        Arc::clone(&fees),
        Arc::clone(&persister),
        Arc::clone(&keys),
        keys.get_peer_storage_key(),
        false,
    );
    let graph = Arc::new(NetworkGraph::new(Network::Regtest, Arc::clone(&logger)));

    // 3. The node runs until told to stop; the watcher tells it when the lease is gone.
    let (stop, stopped) = watch::channel(false);
    let node = tokio::spawn(run_node(Arc::clone(&store), Arc::clone(&graph), stopped));
    let watcher = tokio::spawn(stop_on_lease_loss(store.lease_state(), stop));

    // Node B is a standby: a second process that waits for the lease and only then starts LDK.
    let standby = tokio::spawn(LdkStore::open_standby_async(builder("ldk-node-b").standby()));

    // The simulation: node A stalls past its lease (its expiry is forced here), and node B takes
    // over.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let admin = server.connect().await?;
    admin
        .execute(
            &format!("UPDATE \"{table}_lease\" SET expires_at = clock_timestamp() WHERE id = 1"),
            &[],
        )
        .await?;
    let node_b = standby.await??;
    println!("node B (standby) took over with epoch {}", node_b.fencing_token());

    // Node A finds out at its next persist (the database refuses it) or its next renewal.
    let state = watcher.await?;
    node.await?;
    println!("node A stopped after {state:?}; a real node now exits non-zero");

    // Node B starts from what A persisted last: the graph is there.
    let bytes = KVStore::read(
        &node_b,
        NETWORK_GRAPH_PERSISTENCE_PRIMARY_NAMESPACE,
        NETWORK_GRAPH_PERSISTENCE_SECONDARY_NAMESPACE,
        NETWORK_GRAPH_PERSISTENCE_KEY,
    )
    .await?;
    let restored = NetworkGraph::read(&mut &bytes[..], Arc::clone(&logger))
        .map_err(|e| format!("network graph: {e:?}"))?;
    println!("node B restored a network graph of {} nodes", restored.read_only().nodes().len());

    drop(chain_monitor);
    node_b.close_async().await?;
    Ok(())
}

/// Stands in for LDK's background processor: persists the network graph every 500 ms until
/// stopped. A persist failing with `PermissionDenied` means the lease is lost: stop too.
async fn run_node(
    store: Arc<LdkStore>,
    graph: Arc<NetworkGraph<Arc<StdoutLogger>>>,
    mut stop: watch::Receiver<bool>,
) {
    loop {
        tokio::select! {
            _ = stop.wait_for(|stop| *stop) => break,
            _ = tokio::time::sleep(Duration::from_millis(500)) => {}
        }
        let persisted = KVStore::write(
            &*store,
            NETWORK_GRAPH_PERSISTENCE_PRIMARY_NAMESPACE,
            NETWORK_GRAPH_PERSISTENCE_SECONDARY_NAMESPACE,
            NETWORK_GRAPH_PERSISTENCE_KEY,
            graph.encode(),
        )
        .await;
        if let Err(e) = persisted {
            // The pgfence error is kept inside LDK's I/O error.
            let cause = e.get_ref().map_or_else(|| format!("{e}"), |cause| cause.to_string());
            println!("node A: persist failed ({:?}): {cause}", e.kind());
            if e.kind() == lightning::io::ErrorKind::PermissionDenied {
                break; // Lease lost: the watcher stops everything else.
            }
        }
    }
    println!("node A: background work stopped");
}

/// Waits until the lease is no longer held, then tells the node to stop. Returns the state.
async fn stop_on_lease_loss(
    mut lease: watch::Receiver<LeaseState>,
    stop: watch::Sender<bool>,
) -> LeaseState {
    let state = match lease.wait_for(|state| !matches!(state, LeaseState::Held { .. })).await {
        Ok(state) => state.clone(),
        // The store is gone entirely: as good as released.
        Err(_) => LeaseState::Released { epoch: 0 },
    };
    if let LeaseState::Lost { reason, .. } = &state {
        println!("node A: lease lost ({reason}); stopping the node");
    }
    let _ = stop.send(true);
    state
}

struct StdoutLogger;

impl Logger for StdoutLogger {
    fn log(&self, record: Record) {
        println!("ldk {:<5} {}", record.level.to_string(), record.args);
    }
}

struct NoBroadcast;

impl BroadcasterInterface for NoBroadcast {
    fn broadcast_transactions(&self, _txs: &[(&Transaction, TransactionType)]) {}
}

struct FixedFees;

impl FeeEstimator for FixedFees {
    fn get_est_sat_per_1000_weight(&self, _target: ConfirmationTarget) -> u32 {
        253
    }
}
