//! Deferred writes and `flush()`: durability the caller chooses.
//!
//! - `write_deferred`, `remove_deferred` and `Batch::commit_deferred` commit with
//!   `synchronous_commit = off` for their own transaction only. The next durable statement on the
//!   same server session commits durably, in session mode, on a pool passed in and behind a
//!   transaction pooler. A deferred constraint trigger records the settings each commit obeys: it
//!   fires in the commit itself, after every statement of the transaction.
//! - A shared statement (write coalescing) commits durably if any of its mutations is durable.
//! - Per-key order holds across deferred and durable calls of one key.
//! - `flush()` is an operation like a write: `Closed` after `close()`, `LeaseLost` on a lost
//!   lease, and no loss when it races the store's own change of owner id.
//! - A server crash loses at most the deferred writes since the last completed flush or durable
//!   write, and what survives is a prefix: never a later write without an earlier one.

use crate::coalesce::{Call, stall};
use crate::common;
use crate::interleavings::{proxied_store, wait_for_owner_change, write_committed_unanswered};

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{admin, server, table, within};
use pgfence::{Error, LeaseState, LossReason, PgKvStore};
use pgfence_testing::{Gate, GateMatch, Hold, TestCluster};
use rand::seq::SliceRandom;

/// Records, at the commit of every change to `t`, the operation, the key, the
/// `synchronous_commit` and isolation that commit obeys, and the transaction, into
/// `<t>_commits` (in commit order, `n`). Also records every update of the lease row that
/// changes neither its expiry nor its owner, i.e. every flush, into `<t>_flushes`.
async fn record_commits(t: &str) {
    admin()
        .await
        .batch_execute(&format!(
            "CREATE TABLE \"{t}_commits\" (n BIGSERIAL, op TEXT, key TEXT, sync TEXT,
                 isolation TEXT, xid TEXT);
             CREATE FUNCTION \"{t}_record\"() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN
                 INSERT INTO \"{t}_commits\" (op, key, sync, isolation, xid) VALUES (TG_OP,
                     CASE WHEN TG_OP = 'DELETE' THEN OLD.key ELSE NEW.key END,
                     current_setting('synchronous_commit'),
                     current_setting('transaction_isolation'),
                     pg_current_xact_id()::text);
                 RETURN NULL;
             END $$;
             CREATE CONSTRAINT TRIGGER record AFTER INSERT OR UPDATE OR DELETE ON \"{t}\"
                 DEFERRABLE INITIALLY DEFERRED
                 FOR EACH ROW EXECUTE FUNCTION \"{t}_record\"();
             CREATE TABLE \"{t}_flushes\" (n BIGSERIAL, sync TEXT);
             CREATE FUNCTION \"{t}_record_flush\"() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN
                 INSERT INTO \"{t}_flushes\" (sync) VALUES (current_setting('synchronous_commit'));
                 RETURN NULL;
             END $$;
             CREATE CONSTRAINT TRIGGER record_flush AFTER UPDATE ON \"{t}_lease\"
                 DEFERRABLE INITIALLY DEFERRED FOR EACH ROW
                 WHEN (NEW.expires_at = OLD.expires_at AND NEW.owner_id = OLD.owner_id)
                 EXECUTE FUNCTION \"{t}_record_flush\"();"
        ))
        .await
        .unwrap();
}

/// One recorded commit of a change (see [`record_commits`]).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Commit {
    op: String,
    key: String,
    sync: String,
    isolation: String,
    xid: String,
}

/// Every commit recorded on `t`, in commit order.
async fn commits(t: &str) -> Vec<Commit> {
    let sql = format!("SELECT op, key, sync, isolation, xid FROM \"{t}_commits\" ORDER BY n");
    let rows = admin().await.query(&sql, &[]).await.unwrap();
    rows.iter()
        .map(|r| Commit {
            op: r.get(0),
            key: r.get(1),
            sync: r.get(2),
            isolation: r.get(3),
            xid: r.get(4),
        })
        .collect()
}

/// The `synchronous_commit` of every flush recorded on `t`, in order.
async fn flushes(t: &str) -> Vec<String> {
    let sql = format!("SELECT sync FROM \"{t}_flushes\" ORDER BY n");
    admin().await.query(&sql, &[]).await.unwrap().iter().map(|r| r.get(0)).collect()
}

/// On a store whose pool has a single server session: every kind of deferred mutation, each
/// followed by a durable one. Each deferred commit obeyed `off`, and each durable one `durable`
/// (so nothing of `off` leaked to it), all at read committed. A flush commits with `durable`.
async fn check_deferred_stays_in_its_transaction(store: &PgKvStore, t: &str, durable: &str) {
    let (p, s) = ("d", "s");
    store.write_deferred(p, s, "a", b"1".to_vec()).await.unwrap();
    store.write(p, s, "b", b"2".to_vec()).await.unwrap();
    store.batch().put(p, s, "c", b"3".to_vec()).remove(p, s, "a").commit_deferred().await.unwrap();
    store.batch().put(p, s, "e", b"4".to_vec()).commit().await.unwrap();
    store.remove_deferred(p, s, "b").await.unwrap();
    store.remove(p, s, "c", false).await.unwrap();
    store.batch().put(p, s, "g", b"5".to_vec()).commit_deferred().await.unwrap();
    store.batch().put(p, s, "f", b"6".to_vec()).remove(p, s, "e").commit().await.unwrap();
    store.write_deferred(p, s, "h", b"7".to_vec()).await.unwrap();
    store.flush().await.unwrap();
    store.write(p, s, "i", b"8".to_vec()).await.unwrap();

    let off = "off";
    let expected = [
        ("INSERT", "a", off),
        ("INSERT", "b", durable),
        ("INSERT", "c", off),
        ("DELETE", "a", off),
        ("INSERT", "e", durable),
        ("DELETE", "b", off),
        ("DELETE", "c", durable),
        ("INSERT", "g", off),
        ("INSERT", "f", durable),
        ("DELETE", "e", durable),
        ("INSERT", "h", off),
        ("INSERT", "i", durable),
    ];
    let commits = commits(t).await;
    let seen: Vec<(&str, &str, &str)> =
        commits.iter().map(|c| (c.op.as_str(), c.key.as_str(), c.sync.as_str())).collect();
    // A batch's two rows may be recorded in either order: compare each transaction as a set.
    let mut seen_sorted = seen.clone();
    let mut expected_sorted = expected.to_vec();
    seen_sorted.sort();
    expected_sorted.sort();
    assert_eq!(seen_sorted, expected_sorted, "every commit and its synchronous_commit: {seen:?}");
    let order: Vec<&str> = seen.iter().map(|(_, key, _)| *key).collect();
    assert_eq!(order.first(), Some(&"a"));
    assert_eq!(order.last(), Some(&"i"), "the durable write after the flush came last: {order:?}");
    for c in &commits {
        assert_eq!(c.isolation, "read committed", "{c:?}");
    }
    // One before each durable call made with deferred ones pending (b, e, c, f), and the
    // flush() itself. Not before i: the flush() had vouched for everything.
    assert_eq!(flushes(t).await, [durable; 5], "the flushes, committed durably");
    assert_eq!(store.read(p, s, "h").await.unwrap(), b"7");
}

/// The store's own pool in session mode, with one connection. The session pins
/// `synchronous_commit` (`on`, or a `remote_apply` the connection asked for); a deferred
/// statement turns it off for its own transaction only.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deferred_commit_leaves_the_session_durable_in_session_mode() {
    for (options, durable) in [("", "on"), ("-c synchronous_commit=remote_apply", "remote_apply")] {
        let t = table("defsess");
        let mut config = server().config();
        let base = config.get_options().unwrap_or_default().to_owned();
        config.options(format!("{base} {options}"));
        let store = PgKvStore::builder_from_config(config)
            .table(&t)
            .pool_size(1)
            .lease_ttl(Duration::from_secs(30))
            .open()
            .await
            .unwrap();
        record_commits(&t).await;
        check_deferred_stays_in_its_transaction(&store, &t, durable).await;
        let stats = store.stats();
        assert_eq!(stats.deferred, 5, "{stats:?}");
        assert_eq!((stats.flushes.count, stats.flushes.errors), (1, 0), "{stats:?}");
        store.close().await.unwrap();
    }
}

/// An application's pool of one connection, whose session defaults to asynchronous commits: a
/// durable statement after a deferred one still commits durably.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deferred_commit_leaves_the_session_durable_on_a_pool_passed_in() {
    use pgfence::deadpool_postgres::{Manager, Pool};
    let t = table("defpool");
    let mut config = server().config();
    let base = config.get_options().unwrap_or_default().to_owned();
    config.options(format!("{base} -c synchronous_commit=off"));
    let manager = Manager::new(config, pgfence::tokio_postgres::NoTls);
    let pool = Pool::builder(manager).max_size(1).build().unwrap();
    let store = PgKvStore::builder_from_pool(pool)
        .table(&t)
        .lease_ttl(Duration::from_secs(30))
        .open()
        .await
        .unwrap();
    record_commits(&t).await;
    check_deferred_stays_in_its_transaction(&store, &t, "on").await;
    store.close().await.unwrap();
}

/// Behind a transaction pooler with one server session: every statement of the store runs on
/// that one session, and a deferred one leaves nothing of `off` on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deferred_commit_leaves_the_session_durable_behind_a_transaction_pooler() {
    let t = table("defbounce");
    let (_bouncer, config, store) = crate::durability::behind_one_server_session(&t, 1).await;
    record_commits(&t).await;
    check_deferred_stays_in_its_transaction(&store, &t, "on").await;
    // The one server session itself still says what it said before: nothing was SET on it.
    let (client, connection) = config.connect(pgfence::tokio_postgres::NoTls).await.unwrap();
    let connection = tokio::spawn(connection);
    let row = client.query_one("SHOW synchronous_commit", &[]).await.unwrap();
    assert_eq!(row.get::<_, String>(0), "on");
    drop(client);
    connection.await.unwrap().unwrap();
    store.close().await.unwrap();
}

/// The blocking facade's deferred calls and flush.
#[test]
fn blocking_store_defers_and_flushes() {
    let t = table("defblock");
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let builder = common::builder(&t).pool_size(1);
    let store = pgfence::blocking::PgKvStore::open(builder).unwrap();
    runtime.block_on(record_commits(&t));
    store.write_deferred("b", "s", "k", b"1".to_vec()).unwrap();
    store.write("b", "s", "l", b"2".to_vec()).unwrap();
    store.remove_deferred("b", "s", "l").unwrap();
    store.commit_deferred(store.batch().put("b", "s", "m", b"3".to_vec())).unwrap();
    store.flush().unwrap();
    let seen: Vec<(String, String)> =
        runtime.block_on(commits(&t)).into_iter().map(|c| (c.key, c.sync)).collect();
    let expected = [("k", "off"), ("l", "on"), ("l", "off"), ("m", "off")];
    let expected: Vec<(String, String)> =
        expected.iter().map(|(k, s)| ((*k).to_owned(), (*s).to_owned())).collect();
    assert_eq!(seen, expected);
    // Before the durable write of l (k pending), and the flush() itself.
    assert_eq!(runtime.block_on(flushes(&t)), ["on", "on"]);
    store.close().unwrap();
    assert!(matches!(store.flush(), Err(Error::Closed)));
}

/// Write coalescing: mutations queued behind a busy statement share the next one. A shared
/// statement with a durable mutation commits durably, deferred ones included. One of deferred
/// mutations only commits deferred.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_statement_commits_durably_if_any_of_its_mutations_is_durable() {
    let t = table("defgroup");
    let store = common::builder(&t).write_concurrency(1).open().await.unwrap();
    record_commits(&t).await;
    let (p, s) = ("ns", "sub"); // What `coalesce::stall` writes its blocker to.

    let stalled = stall(&store, &t).await;
    let mixed: Vec<Call> = vec![
        tokio::spawn(store.write_deferred(p, s, "m0", b"0".to_vec())),
        tokio::spawn(store.write(p, s, "m1", b"1".to_vec())),
        tokio::spawn(store.write_deferred(p, s, "m2", b"2".to_vec())),
        tokio::spawn(store.remove_deferred(p, s, "m3")),
    ];
    for result in stalled.release(mixed).await {
        result.unwrap();
    }
    let stalled = stall(&store, &t).await;
    let deferred: Vec<Call> = (0..3)
        .map(|i| tokio::spawn(store.write_deferred(p, s, &format!("d{i}"), vec![i])))
        .collect();
    for result in stalled.release(deferred).await {
        result.unwrap();
    }

    let commits = commits(&t).await;
    let of = |key: &str| commits.iter().find(|c| c.key == key).unwrap_or_else(|| panic!("{key}"));
    // The durable mutation's commit is durable, in whatever statement it ran.
    assert_eq!(of("m1").sync, "on", "{commits:?}");
    for key in ["m0", "m2"] {
        if of(key).xid == of("m1").xid {
            assert_eq!(of(key).sync, "on", "shared with a durable one: {commits:?}");
        }
    }
    // Those two asserts hold however the mutations were grouped; these say they were grouped.
    assert_eq!(of("m0").xid, of("m1").xid, "the queued mutations shared a statement");
    assert_eq!(of("m2").xid, of("m1").xid, "the queued mutations shared a statement");
    let group: Vec<&Commit> = commits.iter().filter(|c| c.key.starts_with('d')).collect();
    assert_eq!(group.len(), 3);
    assert!(group.iter().all(|c| c.xid == group[0].xid), "one statement: {group:?}");
    assert!(group.iter().all(|c| c.sync == "off"), "all deferred, so deferred: {group:?}");
    store.close().await.unwrap();
}

/// A future of one `write` or `write_deferred` call, boxed so that both kinds fit in one list.
type Pending = Pin<Box<dyn Future<Output = pgfence::Result<()>> + Send>>;

/// Calls of one key, deferred and durable mixed at random, take effect in the order they were
/// called, whatever order their futures run in: the key ends with the last call's value. With
/// and without write coalescing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deferred_and_durable_calls_of_one_key_keep_call_order() {
    for concurrency in [4, 1] {
        let t = table("deforder");
        let store = common::builder(&t).write_concurrency(concurrency).open().await.unwrap();
        let mut rng = rand::rng();
        for round in 0..4 {
            let mut calls: Vec<Pending> = Vec::new();
            for i in 0..24 {
                let key = if i % 3 == 0 { "other" } else { "k" };
                let value = format!("{round}-{i}").into_bytes();
                if rand::random::<bool>() {
                    calls.push(Box::pin(store.write_deferred("o", "s", key, value)));
                } else {
                    calls.push(Box::pin(store.write("o", "s", key, value)));
                }
            }
            // The last call of `k` is the 23rd (i = 23); of `other`, the 21st.
            match round {
                0 => calls.reverse(),
                _ => calls.shuffle(&mut rng),
            }
            let handles: Vec<_> = calls.into_iter().map(tokio::spawn).collect();
            for handle in handles {
                within("a call", handle).await.unwrap().unwrap();
            }
            assert_eq!(store.read("o", "s", "k").await.unwrap(), format!("{round}-23").as_bytes());
            assert_eq!(
                store.read("o", "s", "other").await.unwrap(),
                format!("{round}-21").into_bytes()
            );
        }
        store.close().await.unwrap();
    }
}

/// A durable call superseded by a later deferred call of its key writes nothing, and its `Ok`
/// still promises a durable value: it flushes the later call first. Superseded by a later
/// durable call, it has nothing to flush.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_durable_call_superseded_by_a_deferred_one_flushes() {
    let t = table("defsuper");
    let store = common::open(&t).await;
    record_commits(&t).await;
    let earlier = store.write("o", "s", "k", b"durable".to_vec());
    store.write_deferred("o", "s", "k", b"deferred".to_vec()).await.unwrap();
    assert!(flushes(&t).await.is_empty());
    earlier.await.unwrap();
    assert_eq!(flushes(&t).await, ["on"], "the superseded durable call flushed");
    let earlier = store.write("o", "s", "k", b"durable again".to_vec());
    store.write("o", "s", "k", b"durable last".to_vec()).await.unwrap();
    earlier.await.unwrap();
    assert_eq!(flushes(&t).await, ["on"], "nothing to flush after a durable call");
    let earlier = store.batch().put("o", "s", "k", b"batch".to_vec()).commit();
    store.remove_deferred("o", "s", "k").await.unwrap();
    earlier.await.unwrap();
    assert_eq!(flushes(&t).await, ["on", "on"], "a superseded durable batch flushed too");
    let rows = commits(&t).await;
    let ops: Vec<&str> = rows.iter().map(|c| c.op.as_str()).collect();
    assert_eq!(ops, ["INSERT", "UPDATE", "DELETE"], "no superseded call wrote: {rows:?}");
    assert!(matches!(store.read("o", "s", "k").await, Err(Error::NotFound(_))));
    store.close().await.unwrap();
}

/// `flush()` after `close()` is `Closed`, like any operation.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flush_after_close_is_closed() {
    let t = table("defclosed");
    let store = common::open(&t).await;
    store.write_deferred("o", "s", "k", b"v".to_vec()).await.unwrap();
    let flush = store.flush(); // Made before close(), polled after it: not admitted either.
    store.close().await.unwrap();
    assert!(matches!(store.flush().await, Err(Error::Closed)));
    assert!(matches!(flush.await, Err(Error::Closed)));
}

/// `flush()` of a store whose lease was taken over finds no row of its own: `LeaseLost`
/// (`Fenced`), and the store fails closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flush_of_a_lost_lease_fails_closed() {
    let t = table("deflost");
    let store = common::open(&t).await;
    store.write_deferred("o", "s", "k", b"v".to_vec()).await.unwrap();
    common::steal_lease(&admin().await, &t).await;
    let flushed = within("flush", store.flush()).await;
    assert!(
        matches!(flushed, Err(Error::LeaseLost { reason: LossReason::Fenced, .. })),
        "{flushed:?}"
    );
    assert!(matches!(*store.lease_state().borrow(), LeaseState::Lost { .. }));
    let write = store.write("o", "s", "k", b"w".to_vec()).await;
    assert!(matches!(write, Err(Error::LeaseLost { .. })), "fails closed: {write:?}");
    let _ = store.close().await;
}

/// The store's flush (`sql::FLUSH`): the only statement that sets `expires_at` to itself.
fn flush_of(table: &str) -> GateMatch {
    let lease = format!("\"{table}_lease\"");
    GateMatch::sql_where("the flush", move |sql| {
        sql.contains(&lease) && sql.contains("SET expires_at = expires_at")
    })
}

/// A flush carries the store's owner ids as they were when it was sent. Here it is held on its
/// way while the store changes its id to fence off a broken write. It then reaches a row with
/// an id it did not carry. That is the store's own change, not a takeover: the flush goes
/// again with the new id and returns `Ok`, and the lease stays held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flush_racing_the_stores_own_id_change_is_no_loss() {
    let (t, proxy, store) = proxied_store("defrace", |b| b).await;
    record_commits(&t).await;
    // No deferred write first: the durable write below would then wait for the held flush to
    // vouch for it (`durable_calls_flush_only_with_deferred_calls_pending`). A flush runs its
    // statement all the same.
    let owner = store.owner_id();
    let flush_gate: Gate = proxy.gate(flush_of(&t), Hold::Statement);
    let flushing = tokio::spawn(store.flush());
    within("the flush held", flush_gate.held()).await; // Sent with `owner` only.
    let (write_gate, write) = write_committed_unanswered(&proxy, &store, &t, "k", b"v1").await;
    assert!(write_gate.cut());
    wait_for_owner_change(&t, owner).await;
    flush_gate.release();

    let flushed = within("the flush", flushing).await.unwrap();
    assert!(flushed.is_ok(), "the store's own id change is no loss: {flushed:?}");
    assert_eq!(*store.lease_state().borrow(), LeaseState::Held { epoch: 1 });
    assert_ne!(store.owner_id(), owner);
    assert_eq!(flushes(&t).await, ["on"], "one flush committed: the one sent again");
    within("the broken write", write).await.unwrap().expect("retried after the fence");
    within("a later flush", store.flush()).await.unwrap();
    store.close().await.unwrap();
}

// ---------------------------------------------------------------------------------------------
// A server crash
// ---------------------------------------------------------------------------------------------

/// Keys of the crash test, one writer each.
const KEYS: usize = 6;

/// What the writers and the flusher of the crash test saw, by key.
#[derive(Debug)]
struct History {
    /// The highest sequence number of each key whose call returned `Ok`.
    acked: Vec<u64>,
    /// For each key and sequence number (from 1), `acked` as it was when the call was made:
    /// every write that had returned `Ok` by then.
    before: Vec<Vec<Vec<u64>>>,
    /// What must survive a crash: the `before` of every flush that returned `Ok`, and of every
    /// durable write that did with the write itself.
    durable: Vec<u64>,
    deferred_acked: u64,
    durable_acked: u64,
    flushes: u64,
}

impl History {
    fn new() -> History {
        History {
            acked: vec![0; KEYS],
            before: vec![Vec::new(); KEYS],
            durable: vec![0; KEYS],
            deferred_acked: 0,
            durable_acked: 0,
            flushes: 0,
        }
    }

    fn made_durable(&mut self, before: &[u64]) {
        for (durable, seen) in self.durable.iter_mut().zip(before) {
            *durable = (*durable).max(*seen);
        }
    }
}

/// Writes 1, 2, 3, ... to key `k` until `stop`, one call after the other: each call is made
/// after the previous one returned `Ok`. Every 50th is durable, the others deferred.
async fn writer(store: PgKvStore, k: usize, history: Arc<Mutex<History>>, stop: Arc<AtomicBool>) {
    for seq in 1u64.. {
        if stop.load(Ordering::SeqCst) {
            return;
        }
        let durable = seq % 50 == 0;
        let value = seq.to_string().into_bytes();
        let key = format!("k{k}");
        let (before, call): (Vec<u64>, Pending) = {
            let mut h = history.lock().unwrap();
            let before = h.acked.clone();
            h.before[k].push(before.clone());
            let call: Pending = match durable {
                true => Box::pin(store.write("c", "s", &key, value)),
                false => Box::pin(store.write_deferred("c", "s", &key, value)),
            };
            (before, call)
        };
        if call.await.is_err() {
            return; // The server is gone.
        }
        let mut h = history.lock().unwrap();
        h.acked[k] = seq;
        if durable {
            h.durable_acked += 1;
            h.made_durable(&before);
            h.durable[k] = h.durable[k].max(seq);
        } else {
            h.deferred_acked += 1;
        }
    }
}

/// Flushes every 200 ms until `stop`.
async fn flusher(store: PgKvStore, history: Arc<Mutex<History>>, stop: Arc<AtomicBool>) {
    while !stop.load(Ordering::SeqCst) {
        let before = history.lock().unwrap().acked.clone();
        if store.flush().await.is_err() {
            return;
        }
        {
            let mut h = history.lock().unwrap();
            h.made_durable(&before);
            h.flushes += 1;
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Writers write deferred (and now and then durably) to six keys, and a flusher flushes now and
/// then. The server is stopped in immediate mode while they run, as a crash would, and
/// started again once every writer has given up. What survived:
///
/// - every write that a completed flush or durable write vouched for;
/// - for each key, a value that was written, at most the last one called;
/// - a prefix: a surviving write implies every write that had returned `Ok` before it was made,
///   of every key.
///
/// The WAL writer is slowed to once every 10 s so that deferred commits stay in memory long
/// enough to be lost; how many were is printed, and may be zero.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_loses_at_most_the_deferred_writes_since_the_last_flush() {
    let cluster = Arc::new(TestCluster::start().expect("private cluster"));
    let admin = cluster.connect().await.unwrap();
    admin.batch_execute("ALTER SYSTEM SET wal_writer_delay = '10s'").await.unwrap();
    admin.batch_execute("SELECT pg_reload_conf()").await.unwrap();
    let t = table("defcrash");
    let store = PgKvStore::builder_from_config(cluster.config())
        .table(&t)
        .pool_size(4)
        .lease_ttl(Duration::from_secs(6))
        .renew_interval(Duration::from_secs(2))
        .drop_timeout(Duration::from_secs(1))
        .connect_timeout(Duration::from_secs(2))
        .open()
        .await
        .unwrap();
    let history = Arc::new(Mutex::new(History::new()));
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks: Vec<_> = (0..KEYS)
        .map(|k| tokio::spawn(writer(store.clone(), k, history.clone(), stop.clone())))
        .collect();
    tasks.push(tokio::spawn(flusher(store.clone(), history.clone(), stop.clone())));

    // Until enough happened: counted, never timed.
    within("writes and flushes", async {
        loop {
            {
                let h = history.lock().unwrap();
                if h.flushes >= 3 && h.durable_acked >= 3 && h.deferred_acked >= 1000 {
                    break;
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    let crashing = Arc::clone(&cluster);
    tokio::task::spawn_blocking(move || crashing.crash()).await.unwrap().expect("crash");
    stop.store(true, Ordering::SeqCst);
    // Every call still running gives up while the server is down (`retry_for`, one TTL): none
    // can land after the restart.
    for task in tasks {
        within("a writer giving up", task).await.unwrap();
    }
    let _ = store.close().await; // The release fails: the server is down.
    drop(store);
    let restarting = Arc::clone(&cluster);
    tokio::task::spawn_blocking(move || restarting.start_again()).await.unwrap().expect("start");

    let admin = cluster.connect().await.unwrap();
    let sql = format!("SELECT key, value FROM \"{t}\" WHERE primary_namespace = 'c'");
    let mut survived = vec![0u64; KEYS];
    for row in admin.query(&sql, &[]).await.unwrap() {
        let key: String = row.get(0);
        let value: Vec<u8> = row.get(1);
        let k: usize = key[1..].parse().unwrap();
        survived[k] = String::from_utf8(value).unwrap().parse().unwrap();
    }
    let h = history.lock().unwrap();
    let mut lost = 0;
    for k in 0..KEYS {
        let called = h.before[k].len() as u64;
        assert!(survived[k] <= called, "k{k}: {} survived, only {called} were called", survived[k]);
        assert!(
            survived[k] >= h.durable[k],
            "k{k}: {} survived, but a flush or durable write vouched for {}",
            survived[k],
            h.durable[k]
        );
        if survived[k] > 0 {
            let before = &h.before[k][survived[k] as usize - 1];
            for j in 0..KEYS {
                assert!(
                    survived[j] >= before[j],
                    "k{k} = {} survived, but not k{j} = {}, which returned Ok before it was \
                     written (k{j} = {} survived)",
                    survived[k],
                    before[j],
                    survived[j]
                );
            }
        }
        lost += h.acked[k].saturating_sub(survived[k]);
    }
    println!(
        "crash: {} deferred and {} durable writes returned Ok, {} flushes; {lost} acknowledged \
         deferred writes lost; survived {survived:?}, acknowledged {:?}, vouched for {:?}",
        h.deferred_acked, h.durable_acked, h.flushes, h.acked, h.durable
    );
}

/// A durable call with no deferred call pending runs no flush: a store that never defers pays
/// nothing for the crash marker. A durable call made with deferred calls pending flushes first,
/// once. Durable calls made together after one deferred call share one flush.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn durable_calls_flush_only_with_deferred_calls_pending() {
    let t = table("defcost");
    let store = common::open(&t).await;
    record_commits(&t).await;
    let (p, s) = ("c", "s");
    store.write(p, s, "a", b"1".to_vec()).await.unwrap();
    store.remove(p, s, "a", false).await.unwrap();
    store.batch().put(p, s, "b", b"2".to_vec()).commit().await.unwrap();
    assert!(flushes(&t).await.is_empty(), "no deferred call, no flush");

    store.write_deferred(p, s, "d", b"3".to_vec()).await.unwrap();
    store.write(p, s, "e", b"4".to_vec()).await.unwrap();
    assert_eq!(flushes(&t).await, ["on"], "one flush before the durable write");
    store.write(p, s, "f", b"5".to_vec()).await.unwrap();
    store.batch().remove(p, s, "f").commit().await.unwrap();
    assert_eq!(flushes(&t).await, ["on"], "nothing pending any more");

    store.remove_deferred(p, s, "d").await.unwrap();
    let durable: Vec<_> =
        (0..8).map(|i| tokio::spawn(store.write(p, s, &format!("g{i}"), vec![i]))).collect();
    for call in durable {
        call.await.unwrap().unwrap();
    }
    assert_eq!(flushes(&t).await, ["on", "on"], "eight durable calls shared one flush");

    // flush() always runs a statement of its own, unless one that began after the call
    // vouched for it. Eight called at once, before any began: one statement for all.
    store.write_deferred(p, s, "h", b"6".to_vec()).await.unwrap();
    let called: Vec<_> = (0..8).map(|_| store.flush()).collect();
    for flush in called.into_iter().map(tokio::spawn) {
        flush.await.unwrap().unwrap();
    }
    assert_eq!(flushes(&t).await, ["on"; 3], "eight flush() calls shared one statement");
    store.flush().await.unwrap();
    assert_eq!(flushes(&t).await, ["on"; 4], "a flush called after them runs its own");
    store.close().await.unwrap();
}

/// A table created at schema version 4, before the crash marker, gets it from the next store
/// that takes the lease: migration 5 creates it UNLOGGED, and deferred writes and flushes
/// work on the migrated table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_of_version_4_is_migrated_to_have_its_crash_marker() {
    let t = table("defmigrate");
    common::open(&t).await.close().await.unwrap();
    let db = admin().await;
    db.batch_execute(&format!(
        "DROP TABLE \"{t}_crash_marker\"; DELETE FROM \"{t}_schema_version\" WHERE version >= 5"
    ))
    .await
    .unwrap();
    let store = common::open(&t).await;
    let version = format!("SELECT max(version) FROM \"{t}_schema_version\"");
    assert_eq!(db.query_one(&version, &[]).await.unwrap().get::<_, i32>(0), 6);
    let persistence: i8 = db
        .query_one(
            "SELECT relpersistence FROM pg_class WHERE relname = $1",
            &[&format!("{t}_crash_marker")],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(persistence as u8, b'u', "an UNLOGGED table");
    let tokens = format!("SELECT count(*) FROM \"{t}_crash_marker\"");
    assert_eq!(db.query_one(&tokens, &[]).await.unwrap().get::<_, i64>(0), 1, "the token");
    store.write_deferred("m", "s", "k", b"v".to_vec()).await.unwrap();
    store.flush().await.unwrap();
    store.write("m", "s", "l", b"w".to_vec()).await.unwrap();
    store.close().await.unwrap();
}

/// Kills one backend of `cluster` with SIGKILL. The postmaster then ends every session and
/// reinitializes, with crash recovery, as after any backend crash. Returns once the server
/// accepts connections again.
async fn crash_a_backend(cluster: &TestCluster) {
    let victim = cluster.connect().await.unwrap();
    let pid: i32 = victim.query_one("SELECT pg_backend_pid()", &[]).await.unwrap().get(0);
    let killed = std::process::Command::new("kill").args(["-9", &pid.to_string()]).status();
    assert!(killed.unwrap().success(), "kill -9 {pid}");
    within("the server reinitializes", async {
        // The victim's own connection breaks; a new one works once recovery is done.
        while victim.query_one("SELECT 1", &[]).await.is_ok() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        loop {
            if let Ok(client) = cluster.connect().await {
                if client.query_one("SELECT 1", &[]).await.is_ok() {
                    return;
                }
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
}

/// The crash marker in action. Deferred writes return `Ok`, the server crashes (an immediate
/// stop) and starts again. A durable write called then, with those deferred writes pending,
/// fails with `DeferredWritesLost` instead of vouching for them, and writes nothing. The
/// flush after it is `Ok`: the loss was reported, and nothing deferred is pending. Deferred
/// writes after that are covered again: after a backend crash (`kill -9`, and the postmaster
/// reinitializes) `flush()` reports them lost, and the next flush and durable write are `Ok`.
/// The lease stays held throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_after_deferred_writes_fails_the_next_flush_or_durable_write() {
    let cluster = Arc::new(TestCluster::start().expect("private cluster"));
    let admin = cluster.connect().await.unwrap();
    admin.batch_execute("ALTER SYSTEM SET wal_writer_delay = '10s'").await.unwrap();
    admin.batch_execute("SELECT pg_reload_conf()").await.unwrap();
    drop(admin);
    let t = table("defmarker");
    let store = PgKvStore::builder_from_config(cluster.config())
        .table(&t)
        .pool_size(2)
        .lease_ttl(Duration::from_secs(60))
        .connect_timeout(Duration::from_secs(2))
        .open()
        .await
        .unwrap();
    let (p, s) = ("m", "s");
    store.write_deferred(p, s, "a", b"1".to_vec()).await.unwrap();
    store.flush().await.unwrap();
    store.write_deferred(p, s, "b", b"2".to_vec()).await.unwrap();
    store.write_deferred(p, s, "c", b"3".to_vec()).await.unwrap();

    let crashing = Arc::clone(&cluster);
    tokio::task::spawn_blocking(move || crashing.crash().and_then(|()| crashing.start_again()))
        .await
        .unwrap()
        .expect("crash and start again");
    let durable = within("a durable write", store.write(p, s, "d", b"4".to_vec())).await;
    assert!(
        matches!(durable, Err(Error::DeferredWritesLost { writes: 2 })),
        "the two deferred writes since the flush: {durable:?}"
    );
    let admin = cluster.connect().await.unwrap();
    let d = format!("SELECT count(*) FROM \"{t}\" WHERE key = 'd'");
    assert_eq!(admin.query_one(&d, &[]).await.unwrap().get::<_, i64>(0), 0, "d did not run");
    within("a flush", store.flush()).await.expect("the loss was reported: nothing pending");
    store.write(p, s, "d", b"4".to_vec()).await.unwrap();
    assert_eq!(store.read(p, s, "a").await.unwrap(), b"1", "a was flushed before the crash");

    // Covered again: a deferred write after the report, then a backend crash.
    store.write_deferred(p, s, "e", b"5".to_vec()).await.unwrap();
    crash_a_backend(&cluster).await;
    let flushed = within("a flush", store.flush()).await;
    assert!(matches!(flushed, Err(Error::DeferredWritesLost { writes: 1 })), "{flushed:?}");
    assert!(flushed.unwrap_err().is_deferred_writes_lost());
    within("a flush", store.flush()).await.expect("a new token: the next flush vouches again");
    store.write_deferred(p, s, "f", b"6".to_vec()).await.unwrap();
    within("a durable write", store.write(p, s, "g", b"7".to_vec())).await.unwrap();
    store.flush().await.unwrap();
    assert!(matches!(*store.lease_state().borrow(), LeaseState::Held { epoch: 1 }));
    assert_eq!(store.read(p, s, "f").await.unwrap(), b"6");
    store.close().await.unwrap();
}
