//! A store that LDK nodes really wrote, moved into pgfence, with its channel monitors read back.
//!
//! Two nodes of LDK's functional test utilities open two channels, pay each other, and
//! force-close one channel. Each node persists its monitors to a `FilesystemStore` of its own:
//! node 0 whole at every update, node 1 through a `MonitorUpdatingPersister`.
//! Then the nodes stop, and each store moves into tables the ways an operator moves a node:
//! LDK's `migrate_kv_store_data` into an `LdkStore`, and (feature `ldk-import`) the CLI's
//! `pgfence import --from-ldk-fs DIR`. LDK reads every table back (`read_channel_monitors`, and
//! `read_all_channel_monitors_with_updates` for node 1).
//! Each monitor must come back whole: the same channel id, latest update id, funding outpoint and
//! stored bytes as read from the directory, and the update id the live node last had.
//!
//! One run per `lightning` line. The scenario is written once ([`moved_node_tests`]); each line's
//! module names its crate `ldk` and adds the few calls whose signatures differ.
#![cfg(any(feature = "ldk", feature = "ldk-0_2"))]

use std::collections::BTreeMap;
#[cfg(feature = "ldk-import")]
use std::path::Path;

/// The channel value of `create_announced_chan_between_nodes`, in satoshis.
const CHANNEL_VALUE: u64 = 100_000;

/// The channel monitors of a store: what must survive a move.
#[derive(Debug)]
struct Monitors {
    /// Per channel id (hex), as LDK reads the monitor at start-up: its latest update id and its
    /// funding outpoint.
    channels: BTreeMap<String, (u64, String)>,
    /// The stored bytes of each monitor, by key. Re-encoding a monitor that was read is not the
    /// same bytes twice: LDK writes some of its hash maps in their (random) iteration order.
    stored: BTreeMap<String, Vec<u8>>,
}

/// Every key and value of a store.
type Contents = BTreeMap<(String, String, String), Vec<u8>>;

/// `monitors`, read from a moved table, against `original`, read from the node's directory, and
/// `live`, the latest update id of each channel as the node held it in memory.
fn assert_same_monitors(
    how: &str,
    monitors: &Monitors,
    original: &Monitors,
    live: &BTreeMap<String, u64>,
) {
    let ids = |m: &Monitors| m.channels.keys().cloned().collect::<Vec<_>>();
    assert_eq!(ids(monitors), ids(original), "{how}: the same channels");
    for (channel, (update_id, funding)) in &monitors.channels {
        let (was_update_id, was_funding) = &original.channels[channel];
        assert_eq!(update_id, was_update_id, "{how}: {channel}: latest update id");
        assert_eq!(funding, was_funding, "{how}: {channel}: funding outpoint");
    }
    let update_ids: BTreeMap<String, u64> =
        monitors.channels.iter().map(|(c, (id, _))| (c.clone(), *id)).collect();
    assert_eq!(&update_ids, live, "{how}: the update ids the live node last persisted");
    let keys = |m: &Monitors| m.stored.keys().cloned().collect::<Vec<_>>();
    assert_eq!(keys(monitors), keys(original), "{how}: the same monitor keys");
    assert_eq!(monitors.stored.len(), monitors.channels.len(), "{how}: one key per monitor");
    for (key, bytes) in &monitors.stored {
        assert!(bytes == &original.stored[key], "{how}: monitor {key}: stored bytes differ");
    }
}

/// Runs `pgfence --table TABLE import --from-ldk-fs DIR`, the operator's path, to its end.
#[cfg(feature = "ldk-import")]
fn cli_import(table: &str, dir: &Path) {
    use std::process::{Command, Stdio};
    use std::time::Instant;

    let mut command = Command::new(crate::pgfence_cli());
    for variable in pgfence::env::VARIABLES {
        command.env_remove(variable);
    }
    let mut child = command
        .args(["--database-url", &crate::common::server().url(), "--table", table])
        .args(["import", "--from-ldk-fs"])
        .arg(dir)
        .env_remove("DATABASE_URL")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run pgfence import");
    // A hung import fails the test instead of hanging it; the child is killed either way.
    let started = Instant::now();
    while child.try_wait().expect("wait for pgfence").is_none() {
        if started.elapsed() > crate::common::HANG_GUARD {
            let _ = child.kill();
            let _ = child.wait();
            panic!("pgfence import --from-ldk-fs {} hung", dir.display());
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let output = child.wait_with_output().expect("pgfence's output");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "pgfence import: {}\n{stdout}{stderr}", output.status);
    assert!(stdout.contains("all verified"), "{stdout}");
}

/// The scenario, for the `lightning` crate the calling module names `ldk`. The module also
/// provides the node stores' types `Fs0` and `Fs1` with `open_fs0` and `open_fs1`, `configs()`,
/// `closed(node, reason, peer)`, and `MigratableSync` (its line's sync `MigratableKVStore`).
macro_rules! moved_node_tests {
    () => {
        use std::collections::BTreeMap;
        use std::path::Path;

        use crate::common::{self, TempDir};
        use crate::sync_support::guarded;
        use ldk::events::ClosureReason;
        use ldk::ln::functional_test_utils::{
            TestChanMonCfg, check_added_monitors, check_closed_broadcast, connect_block,
            create_announced_chan_between_nodes, create_chanmon_cfgs, create_dummy_block,
            create_network, create_node_cfgs, create_node_chanmgrs, send_payment,
        };
        use ldk::util::persist::{
            KVStoreSync, MonitorUpdatingPersister, migrate_kv_store_data, read_channel_monitors,
        };
        use ldk::util::test_utils::{SyncPersist, TestChainMonitor};
        use pgfence::ldk::LdkStore;

        use super::{Contents, Monitors, assert_same_monitors};

        /// Updates node 1's `MonitorUpdatingPersister` keeps as entries of their own before it
        /// writes a whole monitor again.
        const PENDING_UPDATES: u64 = 3;

        /// The `MonitorUpdatingPersister` of node `cfg` over `store`. A macro, not a function:
        /// the persister's type has six parameters, with bounds that differ between the lines.
        macro_rules! updating_persister {
            ($store:expr, $cfg:expr) => {
                MonitorUpdatingPersister::new(
                    $store,
                    &$cfg.logger,
                    PENDING_UPDATES,
                    &$cfg.keys_manager,
                    &$cfg.keys_manager,
                    &$cfg.tx_broadcaster,
                    &$cfg.fee_estimator,
                )
            };
        }

        /// The monitors `store` holds, as LDK reads them at start-up. Node 0 persists whole
        /// monitors (`read_channel_monitors`); node 1 persists through a
        /// `MonitorUpdatingPersister`, so its monitors are read with their updates applied.
        fn monitors<K: KVStoreSync>(store: &K, node: usize, cfg: &TestChanMonCfg) -> Monitors {
            let read = match node {
                0 => read_channel_monitors(store, &cfg.keys_manager, &cfg.keys_manager),
                _ => updating_persister!(store, cfg).read_all_channel_monitors_with_updates(),
            };
            let read = read.expect("read the channel monitors");
            let channels = read.iter().map(|(_, monitor)| {
                let summary =
                    (monitor.get_latest_update_id(), format!("{:?}", monitor.get_funding_txo()));
                (monitor.channel_id().to_string(), summary)
            });
            let keys = KVStoreSync::list(store, "monitors", "").expect("list the monitors");
            let stored = keys.into_iter().map(|key| {
                let bytes = KVStoreSync::read(store, "monitors", "", &key).expect("read");
                (key, bytes)
            });
            Monitors { channels: channels.collect(), stored: stored.collect() }
        }

        fn contents<S: MigratableSync>(store: &S) -> Contents {
            let keys = MigratableSync::list_all_keys(store).expect("list_all_keys");
            let read = |(p, s, k): (String, String, String)| {
                let value = KVStoreSync::read(store, &p, &s, &k).expect("read");
                ((p, s, k), value)
            };
            keys.into_iter().map(read).collect()
        }

        /// The table `table`, opened as an `LdkStore`: its monitors and all its contents.
        fn read_table(table: &str, node: usize, cfg: &TestChanMonCfg) -> (Monitors, Contents) {
            let store = LdkStore::open(common::builder(table)).expect("open the moved table");
            let found = (monitors(&store, node, cfg), contents(&store));
            store.close().expect("close");
            found
        }

        /// What node `node` left: its monitors and contents as read from its directory, and
        /// the latest update id of each channel as the live node held it.
        struct Left<'a> {
            node: usize,
            #[cfg_attr(not(feature = "ldk-import"), allow(dead_code))] // The CLI reads it.
            dir: &'a Path,
            cfg: &'a TestChanMonCfg,
            monitors: Monitors,
            contents: Contents,
            live: BTreeMap<String, u64>,
        }

        /// Moves the stopped node's store `source` into fresh tables, each way an operator
        /// can, and compares what LDK reads back from each with what the node left.
        fn move_and_compare<S: MigratableSync>(source: &mut S, left: &Left<'_>) {
            let table = common::table("ldkchan_migrated");
            let mut target = LdkStore::open(common::builder(&table)).expect("open");
            migrate_kv_store_data(source, &mut target).expect("migrate_kv_store_data");
            target.close().expect("close");
            let how = format!("node {}, migrate_kv_store_data", left.node);
            compare(&how, &table, left);

            #[cfg(feature = "ldk-import")]
            {
                let table = common::table("ldkchan_imported");
                super::cli_import(&table, left.dir);
                let how = format!("node {}, pgfence import --from-ldk-fs", left.node);
                compare(&how, &table, left);
            }
        }

        fn compare(how: &str, table: &str, left: &Left<'_>) {
            let (moved, moved_contents) = read_table(table, left.node, left.cfg);
            assert_same_monitors(how, &moved, &left.monitors, &left.live);
            assert!(moved_contents == left.contents, "{how}: every key and value");
        }

        /// Two nodes with real channels on two `FilesystemStore`s; then each store moved into
        /// pgfence and its monitors read back and compared.
        #[test]
        fn a_real_nodes_channel_monitors_read_back_after_the_move() {
            guarded("moved node", || {
                let dirs = [TempDir::new("ldkchan-0"), TempDir::new("ldkchan-1")];
                let (mut fs_0, mut fs_1) = (open_fs0(&dirs[0].0), open_fs1(&dirs[1].0));
                let chanmon_cfgs = create_chanmon_cfgs(2);
                let updating = updating_persister!(&fs_1, &chanmon_cfgs[1]);
                let mut node_cfgs = create_node_cfgs(2, &chanmon_cfgs);
                // Node 0 writes the whole monitor at every update. Node 1 writes most updates as
                // entries of their own (`monitor_updates`), as nodes with large monitors do.
                let persisters: [&dyn SyncPersist; 2] = [&fs_0, &updating];
                for (i, cfg) in chanmon_cfgs.iter().enumerate() {
                    node_cfgs[i].chain_monitor = TestChainMonitor::new(
                        Some(&cfg.chain_source),
                        &cfg.tx_broadcaster,
                        &cfg.logger,
                        &cfg.fee_estimator,
                        persisters[i],
                        &cfg.keys_manager,
                    );
                }
                let node_chanmgrs = create_node_chanmgrs(2, &node_cfgs, &configs());
                let nodes = create_network(2, &node_cfgs, &node_chanmgrs);
                let ids = [nodes[0].node.get_our_node_id(), nodes[1].node.get_our_node_id()];

                // Two channels with payments both ways; the first one is force-closed below.
                let closing = create_announced_chan_between_nodes(&nodes, 0, 1).2;
                create_announced_chan_between_nodes(&nodes, 0, 1);
                send_payment(&nodes[0], &[&nodes[1]], 8_000_000);
                send_payment(&nodes[1], &[&nodes[0]], 4_000_000);
                send_payment(&nodes[0], &[&nodes[1]], 1_000_000);

                let message = "moving to pgfence".to_owned();
                nodes[0]
                    .node
                    .force_close_broadcasting_latest_txn(&closing, &ids[1], message.clone())
                    .expect("force-close");
                let reason = ClosureReason::HolderForceClosed {
                    broadcasted_latest_txn: Some(true),
                    message,
                };
                closed(&nodes[0], reason, ids[1]);
                check_closed_broadcast(&nodes[0], 1, true);
                check_added_monitors(&nodes[0], 1);
                let commitment = {
                    let broadcast = nodes[0].tx_broadcaster.txn_broadcasted.lock().unwrap();
                    assert_eq!(broadcast.len(), 1, "the commitment transaction");
                    broadcast[0].clone()
                };
                let block = create_dummy_block(nodes[0].best_block_hash(), 42, vec![commitment]);
                connect_block(&nodes[1], &block);
                check_closed_broadcast(&nodes[1], 1, true);
                closed(&nodes[1], ClosureReason::CommitmentTxConfirmed, ids[0]);
                check_added_monitors(&nodes[1], 1);

                let left: Vec<Left<'_>> = nodes
                    .iter()
                    .enumerate()
                    .map(|(i, node)| {
                        let chain_monitor = &node.chain_monitor.chain_monitor;
                        let live: BTreeMap<String, u64> = chain_monitor
                            .list_monitors()
                            .into_iter()
                            .map(|id| {
                                let monitor = chain_monitor.get_monitor(id).expect("live monitor");
                                (id.to_string(), monitor.get_latest_update_id())
                            })
                            .collect();
                        assert_eq!(live.len(), 2, "node {i}: two channels");
                        assert!(live.values().any(|&id| id > 0), "node {i}: updated: {live:?}");
                        let cfg = &chanmon_cfgs[i];
                        let (from_dir, all) = match i {
                            0 => (monitors(&fs_0, 0, cfg), contents(&fs_0)),
                            _ => (monitors(&fs_1, 1, cfg), contents(&fs_1)),
                        };
                        // The directory holds what the node last had, before anything moves.
                        let on_disk: BTreeMap<String, u64> =
                            from_dir.channels.iter().map(|(c, (id, _))| (c.clone(), *id)).collect();
                        assert_eq!(on_disk, live, "node {i}'s directory: the latest updates");
                        let dir = &dirs[i].0;
                        Left { node: i, dir, cfg, monitors: from_dir, contents: all, live }
                    })
                    .collect();
                // The nodes stop before their stores move: a move never runs beside a node.
                drop(nodes);
                drop(node_chanmgrs);
                drop(node_cfgs);
                drop(updating);
                let updates = left[1].contents.keys().filter(|(p, _, _)| p == "monitor_updates");
                assert!(updates.count() > 0, "node 1 left monitor updates apart from its monitors");
                move_and_compare(&mut fs_0, &left[0]);
                move_and_compare(&mut fs_1, &left[1]);
            });
        }
    };
}

/// `lightning` 0.3: node 0 writes the v1 layout, node 1 the v2 layout (`FilesystemStoreV2`).
#[cfg(feature = "ldk")]
mod v0_3 {
    use lightning as ldk;
    use lightning::bitcoin::secp256k1::PublicKey;
    use lightning::ln::functional_test_utils::{
        Node, check_closed_event, test_legacy_channel_config,
    };
    use lightning::util::config::UserConfig;
    use lightning::util::persist::MigratableKVStoreSync as MigratableSync;
    use lightning_persister::fs_store::v1::FilesystemStore as Fs0;
    use lightning_persister::fs_store::v2::FilesystemStoreV2 as Fs1;

    fn open_fs0(path: &Path) -> Fs0 {
        Fs0::new(path.to_owned())
    }

    fn open_fs1(path: &Path) -> Fs1 {
        Fs1::new(path.to_owned()).expect("a v2 store")
    }

    fn configs() -> [Option<UserConfig>; 2] {
        // Without anchors: a force-close then needs no wallet to bump its fees.
        [Some(test_legacy_channel_config()), Some(test_legacy_channel_config())]
    }

    fn closed(node: &Node<'_, '_, '_>, reason: ClosureReason, peer: PublicKey) {
        check_closed_event(node, 1, reason, &[peer], super::CHANNEL_VALUE);
    }

    moved_node_tests!();
}

/// `lightning` 0.2 (what ldk-node 0.7 uses): both nodes write 0.2's `FilesystemStore` (v1).
#[cfg(feature = "ldk-0_2")]
mod v0_2 {
    use lightning_0_2 as ldk;
    use lightning_0_2::bitcoin::secp256k1::PublicKey;
    use lightning_0_2::ln::functional_test_utils::{Node, check_closed_event};
    use lightning_0_2::util::config::UserConfig;
    use lightning_0_2::util::persist::MigratableKVStore as MigratableSync;
    use lightning_persister_0_2::fs_store::FilesystemStore;

    type Fs0 = FilesystemStore;
    type Fs1 = FilesystemStore;

    fn open_fs0(path: &Path) -> Fs0 {
        FilesystemStore::new(path.to_owned())
    }

    fn open_fs1(path: &Path) -> Fs1 {
        FilesystemStore::new(path.to_owned())
    }

    fn configs() -> [Option<UserConfig>; 2] {
        [None, None]
    }

    fn closed(node: &Node<'_, '_, '_>, reason: ClosureReason, peer: PublicKey) {
        check_closed_event(node, 1, reason, false, &[peer], super::CHANNEL_VALUE);
    }

    moved_node_tests!();
}
