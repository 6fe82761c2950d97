//! pgfence through a real PgBouncer (`pgfence_testing::PgBouncer`) in front of the shared test
//! server. Session mode is supported: the conformance suite, a standby handoff and a takeover
//! after expiry run through it. Transaction mode is supported with
//! `Builder::pool_mode(PoolMode::Transaction)`: the conformance suite, batches and coalesced
//! writes run through it, beside another client's prepared statements on the same server
//! sessions. A store in session mode behind a transaction pooler is refused at `open()`, before
//! it creates anything or could end a server session that is not its own.
//!
//! In transaction mode the standby handoff and the takeover after expiry run too, on a few
//! server sessions that all clients share. The standby polls there: it never LISTENs, alone or
//! in a fleet.

use crate::common;

use std::time::{Duration, Instant};

use common::conformance::{Native, SUITE_LIMIT, Setup, check_contract};
use common::{admin, lease_row, lease_table, table, table_exists, within};
use pgfence::tokio_postgres::NoTls;
use pgfence::{Error, LeaseState, PgKvStore, Standby, StandbyState};
use pgfence_testing::{PgBouncer, PoolMode};
use tokio::task::JoinHandle;

/// Long enough that an acquisition soon after a release proves the release, not an expiry.
const TTL: Duration = Duration::from_secs(30);

/// A PgBouncer in `mode` in front of the shared test server.
fn bouncer(mode: PoolMode) -> PgBouncer {
    let server = common::server();
    let addr = server.tcp_addr().expect("the test server's TCP address");
    let bouncer = PgBouncer::start(addr, mode).expect("start pgbouncer");
    assert_eq!(bouncer.mode(), mode);
    bouncer
}

/// A builder of a store on `t` that connects through `bouncer`.
fn via(bouncer: &PgBouncer, t: &str) -> pgfence::Builder {
    PgKvStore::builder_from_config(bouncer.config_via(&common::server().config()))
        .table(t)
        .pool_size(4)
        .lease_ttl(TTL)
        .renew_interval(Duration::from_secs(5))
}

/// [`via`], in the store's pool mode that matches the pooler's.
fn via_matching(bouncer: &PgBouncer, t: &str) -> pgfence::Builder {
    match bouncer.mode() {
        PoolMode::Session => via(bouncer, t),
        _ => via_transactions(bouncer, t),
    }
}

/// Starts `standby` and returns once it reports that another store holds the lease.
async fn waiting(standby: Standby) -> JoinHandle<pgfence::Result<PgKvStore>> {
    let mut progress = standby.progress();
    let waiting = tokio::spawn(standby.open());
    let reported = progress.wait_for(|s| matches!(s, StandbyState::Waiting { .. }));
    if within("standby waiting", reported).await.is_err() {
        // The standby is gone, and with it the sender of its progress.
        panic!("the standby ended instead of waiting: {:?}", waiting.await);
    }
    waiting
}

/// A holder of a fresh table `prefix_*` writes and `close()`s; a standby waiting through
/// `bouncer` takes over well before the TTL and reads the write. Returns the time from the
/// start of the release until the standby's `open()` returned.
async fn graceful_handoff(bouncer: &PgBouncer, prefix: &str) -> Duration {
    let t = table(prefix);
    let active = via_matching(bouncer, &t).application_name("active").open().await.unwrap();
    let waiting = waiting(via_matching(bouncer, &t).application_name("standby").standby()).await;
    active.write("p", "s", "k", b"first".to_vec()).await.unwrap();
    let released = Instant::now();
    active.close().await.unwrap();
    let store = within("standby acquires", waiting).await.unwrap().unwrap();
    let took = released.elapsed();
    println!("handoff through pgbouncer ({:?} mode): {took:?}", bouncer.mode());
    assert!(took < TTL / 2, "woken by the release or a poll, not by the expiry: {took:?}");
    assert_eq!(store.fencing_token(), 2);
    assert_eq!(store.read("p", "s", "k").await.unwrap(), b"first");
    store.write("p", "s", "k", b"second".to_vec()).await.unwrap();
    store.close().await.unwrap();
    took
}

/// A holder through `bouncer` whose renewal is not due before its lease expires, as the
/// database sees a holder that stopped renewing (paused, or cut off). Here the lease row is
/// made to expire in 2 s, long before the holder's first renewal (19 s). A standby takes over
/// right after that expiry, never before. The old holder's next write reaches the server and
/// is refused there, by the fence in its statement. Epochs strictly increase.
async fn takeover_after_expiry(bouncer: &PgBouncer, prefix: &str) {
    let t = table(prefix);
    let holder = via_matching(bouncer, &t)
        .application_name("holder")
        .renew_interval(Duration::from_secs(19))
        .open()
        .await
        .unwrap();
    holder.write("p", "s", "k", b"old".to_vec()).await.unwrap();
    let db = admin().await;
    let expire = format!(
        "UPDATE {} SET expires_at = clock_timestamp() + interval '2 seconds' WHERE id = 1",
        lease_table(&t)
    );
    db.execute(&expire, &[]).await.unwrap();
    let started = Instant::now();
    let store = within("takeover", via_matching(bouncer, &t).open_when_available()).await.unwrap();
    let took = started.elapsed();
    println!("takeover through pgbouncer ({:?} mode) after {took:?}", bouncer.mode());
    assert!(took >= Duration::from_millis(1500), "never before the expiry: {took:?}");
    assert!(store.fencing_token() > holder.fencing_token());
    assert_eq!((holder.fencing_token(), store.fencing_token()), (1, 2));
    assert_eq!(*holder.lease_state().borrow(), LeaseState::Held { epoch: 1 }, "not lost locally");

    let refused = holder.write("p", "s", "k", b"stale".to_vec()).await.unwrap_err();
    assert!(refused.is_lease_lost(), "{refused:?}");
    assert_eq!(store.read("p", "s", "k").await.unwrap(), b"old", "nothing of the stale write");
    holder.close().await.unwrap();
    let (owner, epoch, _) = lease_row(&db, &t).await;
    assert_eq!((owner, epoch), (store.owner_id(), 2), "the old holder's close left it alone");
    store.write("p", "s", "k", b"new".to_vec()).await.unwrap();
    store.close().await.unwrap();
    let next = via_matching(bouncer, &t).open().await.unwrap();
    assert_eq!(next.fencing_token(), 3);
    next.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_through_pgbouncer_in_session_mode() {
    let bouncer = bouncer(PoolMode::Session);
    let config = bouncer.config_via(&common::server().config());
    let setup = Setup {
        facade: Box::new(Native),
        builder: Box::new(move |table| {
            PgKvStore::builder_from_config(config.clone())
                .table(table)
                .pool_size(4)
                .lease_ttl(Duration::from_secs(15))
                .renew_interval(Duration::from_secs(3))
        }),
        schema: None,
        page_size: Some(7),
    };
    let run = tokio::time::timeout(SUITE_LIMIT, check_contract(&setup));
    run.await.unwrap_or_else(|_| panic!("the conformance suite hung for {SUITE_LIMIT:?}"));
}

/// A holder's `close()` wakes a standby through the pooler (LISTEN/NOTIFY on its own session)
/// at once, not after the TTL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standby_handoff_through_pgbouncer_in_session_mode() {
    let bouncer = bouncer(PoolMode::Session);
    graceful_handoff(&bouncer, "bouncer_handoff").await;
}

/// A holder that stopped renewing is taken over through the pooler right after its lease
/// expired, never before; its fencing token is then stale and its writes are refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn takeover_after_expiry_through_pgbouncer_in_session_mode() {
    let bouncer = bouncer(PoolMode::Session);
    takeover_after_expiry(&bouncer, "bouncer_crash").await;
}

/// Behind a pooler in transaction mode a store in session mode (the default) fails at `open()`
/// with a typed error naming the mode and what to set instead, before the setup: no table is
/// created and no lease taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transaction_mode_is_refused_at_open() {
    let bouncer = bouncer(PoolMode::Transaction);
    for pool_size in [4, 1] {
        let t = table("bouncer_txn");
        let opened = within("open", via(&bouncer, &t).pool_size(pool_size).open()).await;
        let e = opened.expect_err("a transaction pooler is refused");
        assert!(
            matches!(e, Error::PoolerModeUnsupported { pool_mode: "transaction" }),
            "pool size {pool_size}: {e:?}"
        );
        let message = e.to_string();
        assert!(message.contains("transaction mode"), "{message}");
        assert!(message.contains("session mode"), "{message}");
        assert!(message.contains("pool_mode(PoolMode::Transaction)"), "{message}");
        assert_eq!(std::io::Error::from(e).kind(), std::io::ErrorKind::InvalidInput);
        let db = admin().await;
        assert!(!table_exists(&db, &t).await, "refused before the setup");
    }
    // A standby is refused the same way, instead of waiting.
    let t = table("bouncer_txn_standby");
    let opened = within("standby", via(&bouncer, &t).standby().open()).await;
    assert!(matches!(opened, Err(Error::PoolerModeUnsupported { .. })), "{opened:?}");
}

/// A transaction pooler can pass `open()`'s check: a lone client keeps getting the one idle
/// server session. Another client's prepared statements on that session then collide with the
/// store's. The store's statement fails with the typed error naming the mode, not with the
/// server's "prepared statement already exists".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_prepared_statement_taken_behind_a_transaction_pooler_names_the_mode() {
    use pgfence::deadpool_postgres::{Manager, Pool};
    let bouncer = bouncer(PoolMode::Transaction);
    let config = bouncer.config_via(&common::server().config());
    let (other, connection) = config.connect(NoTls).await.expect("connect through pgbouncer");
    let driver = tokio::spawn(connection);
    // The driver names statements s0, s1, ... per process. This client takes the next names
    // on the pooler's only server session, as another process's driver would.
    other.prepare("SELECT 1").await.expect("prepare");
    let numbered = "SELECT max(substr(name, 2)::int) FROM pg_prepared_statements \
                    WHERE name ~ '^s[0-9]+$'";
    let next: i32 = other.query_one(numbered, &[]).await.expect("the last name").get(0);
    let next = usize::try_from(next).expect("a statement number");
    let taken: String =
        (next + 1..next + 5_000).map(|n| format!("PREPARE s{n} AS SELECT 1;")).collect();
    other.batch_execute(&taken).await.expect("prepare the next names");

    // A pool of one: open()'s check has no second connection to compare with.
    let pool = Pool::builder(Manager::new(config, NoTls)).max_size(1).build().expect("pool");
    let t = table("bouncer_txn_taken");
    let opened =
        within("open", PgKvStore::builder_from_pool(pool).table(&t).lease_ttl(TTL).open()).await;
    let e = opened.expect_err("the store's prepared statement is taken");
    assert!(matches!(e, Error::PoolerModeUnsupported { pool_mode: "transaction" }), "{e:?}");
    assert!(e.to_string().contains("session mode"), "{e}");
    drop(other);
    driver.await.expect("the driver task").expect("the connection ended cleanly");
}

/// A builder of a store in transaction mode on `t` through `bouncer`.
fn via_transactions(bouncer: &PgBouncer, t: &str) -> pgfence::Builder {
    via(bouncer, t).pool_mode(pgfence::PoolMode::Transaction)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_through_pgbouncer_in_transaction_mode() {
    let bouncer = bouncer(PoolMode::Transaction);
    let config = bouncer.config_via(&common::server().config());
    let setup = Setup {
        facade: Box::new(Native),
        builder: Box::new(move |table| {
            PgKvStore::builder_from_config(config.clone())
                .pool_mode(pgfence::PoolMode::Transaction)
                .table(table)
                .pool_size(4)
                .lease_ttl(Duration::from_secs(15))
                .renew_interval(Duration::from_secs(3))
        }),
        schema: None,
        page_size: Some(7),
    };
    let run = tokio::time::timeout(SUITE_LIMIT, check_contract(&setup));
    run.await.unwrap_or_else(|_| panic!("the conformance suite hung for {SUITE_LIMIT:?}"));
}

/// An atomic batch, and many writes at once (coalesced into batch statements), commit through
/// a transaction pooler and read back as written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batches_and_coalesced_writes_through_pgbouncer_in_transaction_mode() {
    let bouncer = bouncer(PoolMode::Transaction);
    let t = table("bouncer_txn_batch");
    let store = within("open", via_transactions(&bouncer, &t).open()).await.unwrap();
    store.write("p", "s", "old", b"old".to_vec()).await.unwrap();
    let batch = store
        .batch()
        .put("p", "s", "a", b"a".to_vec())
        .put("p", "s", "b", b"b".to_vec())
        .remove("p", "s", "old");
    within("batch", batch.commit()).await.unwrap();
    assert_eq!(store.list("p", "s").await.unwrap(), ["a", "b"]);

    // Many calls at once, several per key: each key ends with its last call's value.
    let writes: Vec<_> = (0..300)
        .map(|i| store.write("many", "s", &format!("k{}", i % 50), format!("v{i}").into_bytes()))
        .collect();
    for write in writes {
        within("write", write).await.unwrap();
    }
    for k in 0..50 {
        let value = store.read("many", "s", &format!("k{k}")).await.unwrap();
        assert_eq!(value, format!("v{}", 250 + k).into_bytes(), "k{k}");
    }
    store.close().await.unwrap();
}

/// A PgBouncer in transaction mode with one server connection: every client shares one server
/// session. Another client leaves prepared statements on it, named as the driver names its
/// own (`s0`, `s1`, ...): as the driver of another process would. The store's operations all
/// succeed, since it prepares no named statement.
///
/// The other client prepares with `PREPARE` rather than through the driver: the driver's
/// numbering is per process, so its names would never collide with this process's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_clients_prepared_statements_on_shared_sessions_in_transaction_mode() {
    use pgfence::tokio_postgres::NoTls;
    let server = common::server();
    let addr = server.tcp_addr().expect("the test server's TCP address");
    let bouncer = PgBouncer::start_sized(addr, PoolMode::Transaction, 1).expect("pgbouncer");
    let config = bouncer.config_via(&server.config());
    let (other, connection) = config.connect(NoTls).await.expect("connect through pgbouncer");
    let driver = tokio::spawn(connection);
    other.prepare("SELECT 1").await.expect("prepare");
    let numbered = "SELECT max(substr(name, 2)::int) FROM pg_prepared_statements \
                    WHERE name ~ '^s[0-9]+$'";
    let next: i32 = other.query_one(numbered, &[]).await.expect("the last name").get(0);
    let next = usize::try_from(next).expect("a statement number") + 1;
    let taken: String =
        (next..next + 2_000).map(|n| format!("PREPARE s{n} AS SELECT 1;")).collect();
    other.batch_execute(&taken).await.expect("prepare the next names");
    // And it goes on preparing, between the store's transactions, while the store works.
    let (stop, mut stopped) = tokio::sync::oneshot::channel::<()>();
    let preparing = tokio::spawn(async move {
        let mut n = next + 2_000;
        loop {
            let prepare = format!("PREPARE s{n} AS SELECT {n}");
            tokio::select! {
                _ = &mut stopped => return (other, n - next - 2_000),
                prepared = other.batch_execute(&prepare) => prepared.expect("prepare"),
            }
            n += 1;
        }
    });

    let t = table("bouncer_txn_shared");
    let store = within("open", via_transactions(&bouncer, &t).open()).await.unwrap();
    for i in 0..20 {
        store.write("p", "s", &format!("k{i}"), vec![i]).await.unwrap();
    }
    let batch = store.batch().put("p", "s", "b", b"b".to_vec()).remove("p", "s", "k0");
    within("batch", batch.commit()).await.unwrap();
    store.remove("p", "s", "k1", false).await.unwrap();
    assert_eq!(store.read("p", "s", "k2").await.unwrap(), [2]);
    assert_eq!(store.list("p", "s").await.unwrap().len(), 19);
    let page = store.list_paginated("p", "s", None).await.unwrap();
    assert!(!page.keys.is_empty());
    assert_eq!(store.lease_info().await.unwrap().unwrap().epoch, store.fencing_token());
    let inspector = via_transactions(&bouncer, &t).inspect().await.unwrap();
    inspector.check_session().await.unwrap();
    assert_eq!(inspector.read("p", "s", "b").await.unwrap(), b"b");
    assert_eq!(inspector.list_all_keys().await.unwrap().len(), 19);
    let mut entries = inspector.entries().await.unwrap();
    let mut count = 0;
    while let Some(entry) = entries.next().await {
        entry.unwrap();
        count += 1;
    }
    assert_eq!(count, 19);
    drop(entries);
    store.close().await.unwrap();
    // The lease was released by the close, not left to expire: a new store takes it at once.
    let again = within("reopen", via_transactions(&bouncer, &t).open()).await.unwrap();
    assert_eq!(again.fencing_token(), 2);
    again.close().await.unwrap();

    stop.send(()).expect("the preparing task runs");
    let (other, prepared) = preparing.await.expect("the preparing task");
    assert!(prepared > 0, "the other client prepared statements meanwhile");
    drop(other);
    driver.await.expect("the driver task").expect("the connection ended cleanly");
}

/// In transaction mode the store leaves no prepared statement on its connections: checked on
/// the one connection of the application's pool the store runs its statements on, directly
/// against PostgreSQL. In session mode the same operations leave theirs, so the count sees them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn transaction_mode_leaves_no_prepared_statement() {
    use pgfence::deadpool_postgres::{Manager, Pool};
    use pgfence::tokio_postgres::{NoTls, SimpleQueryMessage};
    for (mode, leaves) in
        [(pgfence::PoolMode::Transaction, false), (pgfence::PoolMode::Session, true)]
    {
        let pool = Pool::builder(Manager::new(common::server().config(), NoTls))
            .max_size(1)
            .build()
            .expect("pool");
        let t = table("txn_unnamed");
        let store = PgKvStore::builder_from_pool(pool.clone())
            .pool_mode(mode)
            .table(&t)
            .lease_ttl(TTL)
            .open()
            .await
            .unwrap();
        store.write("p", "s", "k", b"v".to_vec()).await.unwrap();
        store.batch().put("p", "s", "b", vec![1]).remove("p", "s", "k").commit().await.unwrap();
        assert_eq!(store.read("p", "s", "b").await.unwrap(), [1]);
        assert_eq!(store.list("p", "s").await.unwrap(), ["b"]);
        store.list_paginated("p", "s", None).await.unwrap();
        store.lease_info().await.unwrap();
        // The simple protocol: this count prepares nothing itself.
        let client = pool.get().await.expect("the store's connection");
        let messages =
            client.simple_query("SELECT count(*) FROM pg_prepared_statements").await.unwrap();
        let count: i64 = messages
            .iter()
            .find_map(|m| match m {
                SimpleQueryMessage::Row(row) => row.get(0).map(|n| n.parse().unwrap()),
                _ => None,
            })
            .expect("a count");
        assert_eq!(count > 0, leaves, "{mode:?}: {count} prepared statements");
        drop(client);
        store.close().await.unwrap();
    }
}

/// Through a transaction pooler, a polling standby takes over within about a poll interval
/// (1 s) of the holder's `close()`, not after the TTL.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standby_handoff_through_pgbouncer_in_transaction_mode() {
    let bouncer = small_transaction_bouncer(3);
    graceful_handoff(&bouncer, "bouncer_txn_handoff").await;
}

/// Through a transaction pooler, a holder that stopped renewing is taken over right after its
/// lease expired, never before, and its writes are refused by the fence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn takeover_after_expiry_through_pgbouncer_in_transaction_mode() {
    let bouncer = small_transaction_bouncer(3);
    takeover_after_expiry(&bouncer, "bouncer_txn_crash").await;
}

/// A PgBouncer in transaction mode with at most `pool_size` server sessions, shared by all
/// its clients.
fn small_transaction_bouncer(pool_size: u32) -> PgBouncer {
    let addr = common::server().tcp_addr().expect("the test server's TCP address");
    let bouncer =
        PgBouncer::start_sized(addr, PoolMode::Transaction, pool_size).expect("start pgbouncer");
    assert_eq!(bouncer.mode(), PoolMode::Transaction);
    bouncer
}

/// In transaction mode a standby never LISTENs, alone or in a fleet: the fleet makes no LISTEN
/// connection. Checked on a pooler with one server session: every client's transactions run
/// there, so a LISTEN through the pooler would have stayed on it. That session listens on no
/// channel while the two standbys wait. Both still take over once their holders release.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standbys_in_transaction_mode_open_no_listen_connection() {
    let bouncer = small_transaction_bouncer(1);
    let config = bouncer.config_via(&common::server().config());
    let (a, b) = (table("bouncer_txn_fleet"), table("bouncer_txn_alone"));
    // The holders connect directly: only the standbys go through the pooler.
    let holders = [common::open(&a).await, common::open(&b).await];
    let fleet = via_transactions(&bouncer, "unused").pool_size(1).fleet().unwrap();
    let in_fleet = waiting(fleet.builder(&a).application_name("fleet standby").standby()).await;
    let alone =
        waiting(via_transactions(&bouncer, &b).application_name("lone standby").standby()).await;
    // A listener connects and LISTENs within a few round trips; give it more than enough.
    tokio::time::sleep(Duration::from_secs(2)).await;

    let (client, connection) = config.connect(NoTls).await.expect("connect through pgbouncer");
    let driver = tokio::spawn(connection);
    let (other, connection) = config.connect(NoTls).await.expect("connect through pgbouncer");
    let other_driver = tokio::spawn(connection);
    let pid = "SELECT pg_backend_pid()";
    assert_eq!(
        single_value(&client, pid).await,
        single_value(&other, pid).await,
        "one server session for all clients"
    );
    let channels = "SELECT count(*) FROM pg_listening_channels()";
    assert_eq!(single_value(&client, channels).await, "0", "no LISTEN through the pooler");
    drop((client, other));
    driver.await.unwrap().unwrap();
    other_driver.await.unwrap().unwrap();

    for (holder, standby) in holders.into_iter().zip([in_fleet, alone]) {
        holder.close().await.unwrap();
        let store = within("standby acquires", standby).await.unwrap().unwrap();
        assert_eq!(store.fencing_token(), 2);
        store.close().await.unwrap();
    }
    fleet.close().await;
}

/// A fleet in transaction mode holds its leases through a pooler of two server sessions: its
/// one renewal connection sends every lease's renewal (pipelined, each its own transaction),
/// and each store keeps renewing and writing over several renewal intervals.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fleet_renews_every_lease_through_a_transaction_pooler() {
    const STORES: usize = 5;
    let bouncer = small_transaction_bouncer(2);
    let fleet = via_transactions(&bouncer, "unused")
        .pool_size(2)
        .lease_ttl(Duration::from_secs(3))
        .renew_interval(Duration::from_millis(500))
        .fleet()
        .unwrap();
    let tables: Vec<String> =
        (0..STORES).map(|i| table(&format!("bouncer_txn_renew{i}"))).collect();
    let mut stores = Vec::new();
    for t in &tables {
        stores.push(within("open in the fleet", fleet.builder(t).open()).await.unwrap());
    }
    let renewed = |store: &PgKvStore| store.stats().renewals.ok;
    let before: Vec<u64> = stores.iter().map(renewed).collect();
    for round in 0..8u8 {
        for store in &stores {
            store.write("r", "s", "k", vec![round]).await.expect("still the holder");
        }
        tokio::time::sleep(Duration::from_millis(500)).await; // 4 s in all: beyond the TTL.
    }
    for (store, before) in stores.iter().zip(before) {
        assert!(matches!(*store.lease_state().borrow(), LeaseState::Held { epoch: 1 }));
        assert!(renewed(store) >= before + 3, "renewed through the pooler: {}", renewed(store));
        assert_eq!(store.read("r", "s", "k").await.unwrap(), vec![7]);
    }
    for store in stores {
        store.close().await.unwrap();
    }
    fleet.close().await;
}

/// The one value of the one row that the simple query `sql` returns.
async fn single_value(client: &pgfence::tokio_postgres::Client, sql: &str) -> String {
    use pgfence::tokio_postgres::SimpleQueryMessage;
    let messages = client.simple_query(sql).await.expect(sql);
    let rows: Vec<String> = messages
        .iter()
        .filter_map(|m| match m {
            SimpleQueryMessage::Row(row) => Some(row.get(0).expect("a value").to_owned()),
            _ => None,
        })
        .collect();
    assert_eq!(rows.len(), 1, "{sql}: {rows:?}");
    rows.into_iter().next().expect("one row")
}

/// A store of schema version 5, before the fenced functions, opened through a transaction
/// pooler: its `open()` migrates it to version 6, which creates the table's two functions.
/// Its writes and removes then go through them: a trigger on the KV table records the
/// statement the client sent (`current_query()`), the function's call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_of_version_5_migrates_and_writes_through_its_functions() {
    let bouncer = small_transaction_bouncer(2);
    let t = table("bouncer_txn_v5");
    let store = via_transactions(&bouncer, &t).open().await.unwrap();
    store.write("p", "s", "old", b"from version 6".to_vec()).await.unwrap();
    store.close().await.unwrap();
    let db = admin().await;
    // Back to version 5: as a store created by the previous release left it.
    db.batch_execute(&format!(
        "DROP FUNCTION \"{t}_fenced_write\", \"{t}_fenced_remove\";
         DELETE FROM \"{t}_schema_version\" WHERE version = 6;
         CREATE TABLE \"{t}_sent\" (op TEXT, query TEXT);
         CREATE FUNCTION \"{t}_record\"() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             INSERT INTO \"{t}_sent\" VALUES (TG_OP, current_query());
             RETURN NULL;
         END $$;
         CREATE TRIGGER record AFTER INSERT OR UPDATE OR DELETE ON \"{t}\"
             FOR EACH ROW EXECUTE FUNCTION \"{t}_record\"();"
    ))
    .await
    .unwrap();
    let functions = format!(
        "SELECT count(*) FROM pg_proc WHERE proname IN ('{t}_fenced_write', '{t}_fenced_remove')"
    );
    assert_eq!(db.query_one(&functions, &[]).await.unwrap().get::<_, i64>(0), 0);

    let store = via_transactions(&bouncer, &t).open().await.unwrap();
    let version = format!("SELECT max(version) FROM \"{t}_schema_version\"");
    assert_eq!(db.query_one(&version, &[]).await.unwrap().get::<_, i32>(0), 6, "migrated");
    assert_eq!(db.query_one(&functions, &[]).await.unwrap().get::<_, i64>(0), 2);
    store.write("p", "s", "k", b"1".to_vec()).await.unwrap();
    store.write("p", "s", "k", b"2".to_vec()).await.unwrap();
    store.remove("p", "s", "old", false).await.unwrap();
    assert_eq!(store.read("p", "s", "k").await.unwrap(), b"2");
    assert!(store.read("p", "s", "old").await.unwrap_err().is_not_found());
    let sent = format!("SELECT op, query FROM \"{t}_sent\" ORDER BY op");
    let sent: Vec<(String, String)> =
        db.query(&sent, &[]).await.unwrap().iter().map(|r| (r.get(0), r.get(1))).collect();
    let ops: Vec<&str> = sent.iter().map(|(op, _)| op.as_str()).collect();
    assert_eq!(ops, ["DELETE", "INSERT", "UPDATE"], "{sent:?}");
    for (op, query) in &sent {
        let function = if op == "DELETE" { "_fenced_remove" } else { "_fenced_write" };
        assert!(query.starts_with(&format!("SELECT \"{t}{function}\"(")), "{op}: {query}");
    }
    store.close().await.unwrap();
}
