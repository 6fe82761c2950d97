//! Transient faults: killed backends and a restarted server. The store recovers without losing
//! its lease, and no acknowledged write is lost or reordered. A statement timeout, which
//! bounds a blocked operation without costing the lease. And retries that end in an error
//! after a write may have committed, where the store fails closed.

use crate::common;

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::{admin, builder, table, within};
use pgfence::{Error, LeaseState, LossReason, PgKvStore};

/// Writers that each write an increasing counter to their own key until stopped; returns the
/// last acknowledged counter per key. Any error fails the test.
fn spawn_writers(
    store: &PgKvStore,
    writers: usize,
    stop: &Arc<AtomicBool>,
) -> Vec<tokio::task::JoinHandle<(String, u64)>> {
    (0..writers)
        .map(|w| {
            let (store, stop) = (store.clone(), stop.clone());
            tokio::spawn(async move {
                let key = format!("w{w}");
                let mut acked = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let next = acked + 1;
                    store
                        .write("f", "s", &key, next.to_be_bytes().to_vec())
                        .await
                        .unwrap_or_else(|e| panic!("write {key}={next}: {e:?}"));
                    acked = next;
                }
                (key, acked)
            })
        })
        .collect()
}

async fn check_acknowledged(
    store: &PgKvStore,
    writers: Vec<tokio::task::JoinHandle<(String, u64)>>,
) {
    let mut acked = HashMap::new();
    for w in writers {
        let (key, n) = within("writer", w).await.unwrap();
        assert!(n > 0, "{key} made progress");
        acked.insert(key, n);
    }
    for (key, n) in acked {
        let value = store.read("f", "s", &key).await.unwrap();
        assert_eq!(value, n.to_be_bytes().to_vec(), "{key}: the last acknowledged write is there");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn terminated_backends_mid_workload_recover_without_loss() {
    let t = table("killed");
    // A unique application name marks exactly this store's connections (pool and renewal).
    let store = builder(&t).application_name(&t).pool_size(4).open().await.unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let writers = spawn_writers(&store, 6, &stop);
    let db = admin().await;
    let mut killed = 0i64;
    for _ in 0..5 {
        tokio::time::sleep(Duration::from_millis(300)).await;
        let n: i64 = db
            .query_one(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
                  WHERE application_name = $1 AND pid <> pg_backend_pid()",
                &[&format!("pgfence {t}")],
            )
            .await
            .unwrap()
            .get(0);
        killed += n;
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    stop.store(true, Ordering::Relaxed);
    assert!(killed >= 5, "connections were really terminated ({killed})");
    check_acknowledged(&store, writers).await;
    assert_eq!(*store.lease_state().borrow(), LeaseState::Held { epoch: 1 });
    store.close().await.unwrap();
}

/// A restart shorter than the local deadline: the store keeps its lease and goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_restart_shorter_than_the_deadline_keeps_the_lease() {
    let cluster = Arc::new(pgfence_testing::TestCluster::start().expect("private cluster"));
    let store = PgKvStore::builder_from_config(cluster.config())
        .table("kv")
        .pool_size(4)
        .lease_ttl(Duration::from_secs(60))
        .renew_interval(Duration::from_secs(1))
        .open()
        .await
        .unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let writers = spawn_writers(&store, 4, &stop);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let restarting = cluster.clone();
    tokio::task::spawn_blocking(move || restarting.restart()).await.unwrap().unwrap();
    // Renewal must succeed again after the restart, and writers go on.
    let mut state = store.lease_state();
    tokio::time::sleep(Duration::from_secs(3)).await;
    stop.store(true, Ordering::Relaxed);
    check_acknowledged(&store, writers).await;
    assert!(!state.has_changed().unwrap(), "lease state never changed");
    assert_eq!(*state.borrow_and_update(), LeaseState::Held { epoch: 1 });
    store.write("after", "s", "k", b"ok".to_vec()).await.unwrap();
    let client = cluster.connect().await.unwrap();
    let row = client
        .query_one(
            "SELECT owner_id, (extract(epoch FROM expires_at - clock_timestamp()) * 1000)::bigint
               FROM kv_lease",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, uuid::Uuid>(0), store.owner_id());
    assert!(row.get::<_, i64>(1) > 50_000, "renewed after the restart");
    store.close().await.unwrap();
}

/// A `statement_timeout` in the connection's options bounds how long an operation waits, here
/// a write blocked on a row lock that another session holds: PostgreSQL cancels the statement
/// (`query_canceled`, rolled back, so its outcome is known and it is not retried), the caller
/// gets that error, nothing is written, and the store keeps its lease and writes again once
/// the lock is gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn statement_timeout_in_the_options_bounds_a_blocked_write() {
    let t = table("stmt_timeout");
    let mut config = common::server().config();
    config.options("-c statement_timeout=1000");
    let store = PgKvStore::builder_from_config(config)
        .table(&t)
        .pool_size(2)
        .lease_ttl(Duration::from_secs(15))
        .open()
        .await
        .unwrap();
    store.write("ns", "sub", "k", b"before".to_vec()).await.unwrap();
    let mut locker = admin().await;
    let tx = common::lock_key_row(&mut locker, &t, "k").await;
    let e = within("the blocked write", store.write("ns", "sub", "k", b"blocked".to_vec()))
        .await
        .unwrap_err();
    let canceled = matches!(&e, pgfence::Error::Database { source, .. }
        if source.code() == Some(&tokio_postgres::error::SqlState::QUERY_CANCELED));
    assert!(canceled && !e.is_retryable(), "{e:?}");
    tx.rollback().await.unwrap();
    assert_eq!(store.read("ns", "sub", "k").await.unwrap(), b"before", "nothing written");
    store.write("ns", "sub", "k", b"after".to_vec()).await.unwrap();
    assert_eq!(*store.lease_state().borrow(), LeaseState::Held { epoch: 1 });
    store.close().await.unwrap();
}

/// A `statement_timeout` or `lock_timeout` in the connection's options bounds the application's
/// operations, not `open()`: an acquisition that waits at the fence longer than both (here for
/// a transaction holding the expired lease row FOR KEY SHARE, as an old holder's write does)
/// waits it out and takes the lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn statement_timeout_in_the_options_does_not_cut_the_setup() {
    let t = table("setup_timeout");
    builder(&t).open().await.unwrap().close().await.unwrap(); // The tables, the lease free.
    let mut locker = admin().await;
    let tx = common::lock_lease_row(&mut locker, &t, "FOR KEY SHARE").await;
    let mut config = common::server().config();
    config.options("-c statement_timeout=300 -c lock_timeout=300");
    let opening = tokio::spawn(PgKvStore::builder_from_config(config).table(&t).open());
    common::wait_for_query_lock_wait(&format!("%INSERT INTO {}%", common::lease_table(&t))).await;
    tokio::time::sleep(Duration::from_secs(1)).await; // Past both timeouts.
    assert!(!opening.is_finished(), "still waiting at the fence");
    tx.commit().await.unwrap();
    let store = within("the open", opening).await.unwrap().expect("opened after the wait");
    assert_eq!(store.fencing_token(), 2);
    store.close().await.unwrap();
}

/// A `lock_timeout` in the connection's options still bounds a migration's wait for its table
/// lock, as the application asked (the rest of the setup ignores it): with a reader holding the
/// KV table of a version-3 schema, `open()` fails with `lock_not_available` and changes
/// nothing; once the reader is gone, the same `open()` migrates.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lock_timeout_in_the_options_bounds_a_migration() {
    let t = table("migration_lock");
    builder(&t).open().await.unwrap().close().await.unwrap();
    let db = admin().await;
    let version = format!("SELECT max(version) FROM \"{t}_schema_version\"");
    // Back to version 3, whose migration to 4 rebuilds the key columns' indexes.
    db.batch_execute(&format!(
        "ALTER TABLE \"{t}\" ALTER COLUMN key TYPE TEXT COLLATE \"default\";
         DELETE FROM \"{t}_schema_version\" WHERE version >= 4"
    ))
    .await
    .unwrap();
    let mut reader = admin().await;
    let tx = reader.transaction().await.unwrap();
    tx.query(&format!("SELECT count(*) FROM \"{t}\""), &[]).await.unwrap(); // ACCESS SHARE.
    let mut config = common::server().config();
    config.options("-c lock_timeout=300");
    let open = || PgKvStore::builder_from_config(config.clone()).table(&t).open();

    let e = within("the open", open()).await.unwrap_err();
    let lock_not_available = matches!(&e, pgfence::Error::Database { source, .. }
        if source.code() == Some(&tokio_postgres::error::SqlState::LOCK_NOT_AVAILABLE));
    assert!(lock_not_available, "{e:?}");
    assert_eq!(db.query_one(&version, &[]).await.unwrap().get::<_, i32>(0), 3, "unchanged");

    tx.commit().await.unwrap();
    let store = within("the open", open()).await.expect("migrated once the reader is gone");
    assert_eq!(db.query_one(&version, &[]).await.unwrap().get::<_, i32>(0), 6);
    store.close().await.unwrap();
}

/// Every attempt of a write commits on the server and then loses its connection before the
/// reply (the server waits for a synchronous standby that does not exist, and that wait is
/// ended by terminating the session: PostgreSQL has committed locally by then), until the
/// store's retries are spent. The write's outcome is then unknown, and in fact committed; an
/// earlier call of the same key, still waiting for its turn, must not overwrite it. The store
/// fails closed for both calls, and the later call's value stays. Renewals commit
/// synchronously too, so they wait for the standby as well and are ended the same way: the
/// local deadline may end the retries first. The later call's loss is then `DeadlinePassed`,
/// the reason the lease was lost meanwhile, instead of `WriteOutcomeUnknown`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_ending_in_an_error_after_a_possible_commit_fail_closed() {
    let cluster = pgfence_testing::TestCluster::start().expect("private cluster");
    let store = PgKvStore::builder_from_config(cluster.config())
        .table("kv")
        .pool_size(4)
        .lease_ttl(Duration::from_secs(6))
        .open()
        .await
        .unwrap();
    store.write("o", "s", "k", b"initial".to_vec()).await.unwrap();
    let earlier = store.write("o", "s", "k", b"earlier call".to_vec()); // Not polled yet.
    let later = store.write("o", "s", "k", b"later call".to_vec());

    // From now on every commit of the store (writes, fences, renewals) waits for the absent
    // standby.
    let db = cluster.connect().await.unwrap();
    set_synchronous_standby_names(&cluster, "nobody").await;
    let stop = Arc::new(AtomicBool::new(false));
    let ending = {
        let (stop, db) = (Arc::clone(&stop), cluster.connect().await.unwrap());
        let sql =
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE wait_event = 'SyncRep'";
        tokio::spawn(async move {
            let mut ended = 0;
            while !stop.load(Ordering::Relaxed) {
                ended += db.query(sql, &[]).await.unwrap().len();
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            ended
        })
    };
    let e = within("the later call", later).await.unwrap_err();
    stop.store(true, Ordering::Relaxed);
    let ended = ending.await.unwrap();
    assert!(ended >= 2, "a first attempt and at least one retry committed locally: {ended}");
    let reasons = [LossReason::WriteOutcomeUnknown, LossReason::DeadlinePassed];
    assert!(matches!(&e, Error::LeaseLost { reason, .. } if reasons.contains(reason)), "{e:?}");
    set_synchronous_standby_names(&cluster, "").await;

    let e = within("the earlier call", earlier).await.unwrap_err();
    assert!(e.is_lease_lost(), "{e:?}");
    let value: Vec<u8> =
        db.query_one("SELECT value FROM kv WHERE key = 'k'", &[]).await.unwrap().get(0);
    assert_eq!(value, b"later call", "the later call's committed value stays");
    assert!(matches!(*store.lease_state().borrow(), LeaseState::Lost { .. }));
}

/// docs/design.md, "A broken connection mid-write":
/// "Retries, and the wait for the old process, go on
/// while the lease is locally valid, for at most one TTL". Every attempt of a write loses its
/// connection mid-statement (a trigger ends its own session, before anything commits), while
/// renewal, on a connection of its own, keeps the lease valid. The trigger stamps each attempt
/// by the database clock in sequences (a rollback does not undo them): the attempts go on for
/// most of a TTL, and the last one starts no later than one TTL after the first (plus the time
/// the last one takes to connect and send its statement: a generous second here). Then the
/// store fails closed, since for all it knows an attempt committed: `WriteOutcomeUnknown`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_after_broken_connections_go_on_for_at_most_one_ttl() {
    const TTL: Duration = Duration::from_secs(6);
    let t = table("retry_ttl");
    let store = builder(&t).lease_ttl(TTL).renew_interval(Duration::from_secs(1)).open().await;
    let store = store.unwrap();
    store.write("r", "s", "k", b"before".to_vec()).await.unwrap();
    let db = admin().await;
    db.batch_execute(&format!(
        "CREATE SEQUENCE \"{t}_runs\";
         CREATE SEQUENCE \"{t}_first\";
         CREATE SEQUENCE \"{t}_last\";
         CREATE FUNCTION \"{t}_doomed\"() RETURNS trigger LANGUAGE plpgsql AS $$
         DECLARE
             now_ms bigint := (extract(epoch FROM clock_timestamp()) * 1000)::bigint;
         BEGIN
             IF NEW.value = 'doomed'::bytea THEN
                 IF nextval('\"{t}_runs\"') = 1 THEN
                     PERFORM setval('\"{t}_first\"', now_ms);
                 END IF;
                 PERFORM setval('\"{t}_last\"', now_ms);
                 PERFORM pg_terminate_backend(pg_backend_pid());
                 PERFORM pg_sleep(60); -- Ends at once, with the session.
             END IF;
             RETURN NEW;
         END $$;
         CREATE TRIGGER doomed BEFORE INSERT ON \"{t}\"
             FOR EACH ROW EXECUTE FUNCTION \"{t}_doomed\"();"
    ))
    .await
    .unwrap();

    let e = within("the doomed write", store.write("r", "s", "k", b"doomed".to_vec()))
        .await
        .unwrap_err();
    let reasons = [LossReason::WriteOutcomeUnknown, LossReason::DeadlinePassed];
    assert!(matches!(&e, Error::LeaseLost { reason, .. } if reasons.contains(reason)), "{e:?}");

    let stamps = format!(
        "SELECT (SELECT last_value FROM \"{t}_runs\"), (SELECT last_value FROM \"{t}_first\"),
                (SELECT last_value FROM \"{t}_last\")"
    );
    let row = db.query_one(&stamps, &[]).await.unwrap();
    let (runs, first, last): (i64, i64, i64) = (row.get(0), row.get(1), row.get(2));
    let span = Duration::from_millis(u64::try_from(last - first).unwrap());
    println!("{runs} attempts over {span:?} (TTL {TTL:?})");
    assert!(runs >= 3, "retried: {runs} attempts");
    assert!(span >= TTL / 2, "the retries go on for most of a TTL: {span:?}");
    assert!(span <= TTL + Duration::from_secs(1), "and stop within one TTL: {span:?}");
    let value: Vec<u8> = db
        .query_one(&format!("SELECT value FROM \"{t}\" WHERE key = 'k'"), &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(value, b"before", "no attempt committed");
    assert!(matches!(*store.lease_state().borrow(), LeaseState::Lost { .. }));
}

/// The setup's commit takes the lease on the server, but its answer is lost with the
/// connection (here the server waits for a synchronous standby that does not exist, and that
/// wait is ended by terminating the session: PostgreSQL has committed locally by then).
/// `open()` fails, and no store renews or releases that lease: it must not stay held by nobody
/// until its TTL runs out (a standby retrying after the error would find its own attempt's
/// lease and wait for it). The open releases it by owner id, so the next one opens at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_setup_commit_whose_answer_is_lost_leaves_no_lease_behind() {
    let cluster = pgfence_testing::TestCluster::start().expect("private cluster");
    let open = |app: &str| {
        PgKvStore::builder_from_config(cluster.config())
            .table("kv")
            .pool_size(2)
            .lease_ttl(Duration::from_secs(60))
            .application_name(app)
            .open()
    };
    open("first").await.unwrap().close().await.unwrap(); // Tables made, lease free (epoch 1).

    set_synchronous_standby_names(&cluster, "nobody").await;
    let opening = tokio::spawn(open("lost"));
    let db = cluster.connect().await.unwrap();
    let end_the_commit = "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
                           WHERE wait_event = 'SyncRep' AND application_name = 'pgfence lost'";
    within("the setup's commit waiting", async {
        while db.query(end_the_commit, &[]).await.unwrap().is_empty() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    set_synchronous_standby_names(&cluster, "").await;
    let e = within("the open", opening).await.unwrap().unwrap_err();
    assert!(matches!(e, Error::Database { operation: "commit setup", .. }), "{e:?}");
    let lease = "SELECT epoch, expires_at <= clock_timestamp() FROM kv_lease";
    let row = db.query_one(lease, &[]).await.unwrap();
    let (epoch, expired): (i64, bool) = (row.get(0), row.get(1));
    assert_eq!(epoch, 2, "the unanswered commit did take the lease on the server");
    assert!(expired, "and the failed open released it before it returned");

    let next = within("the next open", open("next")).await.expect("no lease left behind");
    assert_eq!(next.fencing_token(), 3);
    next.close().await.unwrap();
}

/// docs/design.md, `open()`:
/// "Dropping the `open()` future [...] cancels a setup still waiting [...];
/// one whose commit was already sent opens the store, which is then dropped and releases the
/// lease." The commit is held on the server (it waits for a synchronous standby that does not
/// exist, committed locally) while the caller drops the `open()` future; then the wait is lifted (`synchronous_standby_names` emptied, which
/// releases every waiting commit), the commit is answered, and the store that nobody waits for
/// is built and dropped: its lease is released (long before its TTL), its sessions end, and the
/// next store opens at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_dropped_after_its_commit_was_sent_releases_the_lease() {
    let cluster = pgfence_testing::TestCluster::start().expect("private cluster");
    let open = |app: &str| {
        PgKvStore::builder_from_config(cluster.config())
            .table("kv")
            .pool_size(2)
            .lease_ttl(Duration::from_secs(120)) // Beyond HANG_GUARD: no expiry in this test.
            .application_name(app)
            .open()
    };
    open("first").await.unwrap().close().await.unwrap(); // Tables made, lease free (epoch 1).

    set_synchronous_standby_names(&cluster, "nobody").await;
    let opening = tokio::spawn(open("dropped"));
    let db = cluster.connect().await.unwrap();
    let commit_waiting = "SELECT 1 FROM pg_stat_activity
                           WHERE wait_event = 'SyncRep' AND application_name = 'pgfence dropped'";
    within("the setup's commit waiting", async {
        while db.query(commit_waiting, &[]).await.unwrap().is_empty() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    opening.abort(); // The caller gives up, its commit sent.
    assert!(opening.await.unwrap_err().is_cancelled());

    set_synchronous_standby_names(&cluster, "").await;
    let lease = "SELECT epoch, expires_at <= clock_timestamp() FROM kv_lease";
    within("the dropped store's lease released", async {
        loop {
            let row = db.query_one(lease, &[]).await.unwrap();
            if (row.get::<_, i64>(0), row.get::<_, bool>(1)) == (2, true) {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    let sessions =
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = 'pgfence dropped'";
    within("the dropped store's sessions gone", async {
        while db.query_one(sessions, &[]).await.unwrap().get::<_, i64>(0) > 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;

    let next = within("the next open", open("next")).await.expect("the lease was released");
    assert_eq!(next.fencing_token(), 3);
    next.close().await.unwrap();
}

/// Sets `synchronous_standby_names` and returns once the server has reloaded it: a new session
/// sees it, so every existing one has been signalled and applies it before its next statement.
async fn set_synchronous_standby_names(cluster: &pgfence_testing::TestCluster, names: &str) {
    let db = cluster.connect().await.unwrap();
    let set = format!("ALTER SYSTEM SET synchronous_standby_names = '{names}'");
    db.batch_execute(&set).await.unwrap();
    db.batch_execute("SELECT pg_reload_conf()").await.unwrap();
    within("the reload", async {
        loop {
            let fresh = cluster.connect().await.unwrap();
            let shown = fresh.query_one("SHOW synchronous_standby_names", &[]).await.unwrap();
            if shown.get::<_, String>(0) == names {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
}

/// A statement that fails with a server error has its answer: its connection goes back to the
/// pool rather than being closed like one abandoned before its answer. Here the table is
/// dropped under the store, so preparing `list` fails; with a pool of one, the next call
/// (`lease_info`) runs on the same session.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_server_error_keeps_its_connection_in_the_pool() {
    let t = table("errkeep");
    let store = builder(&t).application_name(&t).pool_size(1).open().await.unwrap();
    store.write("e", "s", "k", b"v".to_vec()).await.unwrap();
    let db = admin().await;
    let sessions =
        "SELECT array_agg(pid ORDER BY pid) FROM pg_stat_activity WHERE application_name = $1";
    let app = format!("pgfence {t}");
    let before: Vec<i32> = db.query_one(sessions, &[&app]).await.unwrap().get(0);
    db.batch_execute(&format!("DROP TABLE \"{t}\"")).await.unwrap();
    let e = store.list("e", "s").await.unwrap_err();
    assert!(matches!(e, Error::Database { .. }), "{e:?}");
    store.lease_info().await.unwrap();
    let after: Vec<i32> = db.query_one(sessions, &[&app]).await.unwrap().get(0);
    assert_eq!(after, before, "the same sessions: the pool kept its connection");
    drop(store);
}

/// A server that answers the startup of a new connection and nothing after it (a session that
/// hangs right after it began): the pool's hook on the new connection, which sets it to read
/// committed, gets no answer. `open()` fails after `connect_timeout` with a retryable error,
/// so a standby tries again, instead of waiting for the answer for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_session_that_hangs_after_its_startup_fails_open_in_time() {
    let server = common::server();
    let proxy = pgfence_testing::Proxy::start(server.tcp_addr().unwrap()).await.unwrap();
    proxy.hang_after_client_chunks(1);
    let opening = PgKvStore::builder_from_config(server.config_via(proxy.addr()))
        .table(table("hookhang"))
        .connect_timeout(Duration::from_secs(1))
        .open();
    let e = within("open() on a hung session", opening).await.unwrap_err();
    // The new connection's setup timed out: the connect step, naming the proxy's address.
    let timed_out = |source: &(dyn std::error::Error + 'static)| {
        source.downcast_ref::<std::io::Error>().map(std::io::Error::kind)
            == Some(std::io::ErrorKind::TimedOut)
    };
    assert!(
        matches!(&e, Error::Connect { step: pgfence::ConnectStep::Connect, server, source, .. }
            if *server == proxy.addr().to_string() && timed_out(&**source)),
        "{e:?}"
    );
    assert!(e.is_retryable(), "{e:?}");
}
