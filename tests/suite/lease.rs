//! The lease: contention, setup rollback, renewal, starvation, the fence, stale owners and
//! fail-closed renewal.

use crate::common;

use std::time::{Duration, SystemTime};

use common::{
    HANG_GUARD, admin, builder, lease_row, lease_table, server, steal_lease, table, table_exists,
    within,
};
use pgfence::{Error, LeaseLossPolicy, LeaseState, LossReason, PgKvStore};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn second_open_gets_lease_held_with_holder_and_epoch() {
    let t = table("held");
    let a = builder(&t).application_name("store-a").open().await.unwrap();
    assert_eq!(a.fencing_token(), 1);
    let e = builder(&t).application_name("store-b").open().await.unwrap_err();
    match &e {
        Error::LeaseHeld { holder, epoch, expires_in, .. } => {
            assert!(holder.contains("store-a"), "holder names A: {holder}");
            assert!(holder.contains(&std::process::id().to_string()), "holder has the pid");
            assert_eq!(*epoch, 1);
            assert!(*expires_in > Duration::ZERO && *expires_in <= Duration::from_secs(15));
        }
        other => panic!("expected LeaseHeld, got {other:?}"),
    }
    assert!(e.is_lease_held());
    assert_eq!(std::io::Error::from(e).kind(), std::io::ErrorKind::AlreadyExists);
    a.close().await.unwrap();
    let b = builder(&t).open().await.unwrap();
    assert_eq!(b.fencing_token(), 2, "epoch is +1 per acquisition");
    b.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eight_concurrent_opens_on_a_fresh_database_one_wins() {
    // A database that does not exist yet: every opener races to create it too.
    let mut config = common::server().config();
    let db = table("freshdb");
    config.dbname(&db);
    let opens: Vec<_> = (0..8)
        .map(|_| {
            let b = PgKvStore::builder_from_config(config.clone())
                .table("kv")
                .pool_size(1)
                .lease_ttl(Duration::from_secs(15))
                .renew_interval(Duration::from_secs(3));
            tokio::spawn(b.open())
        })
        .collect();
    let mut winners = Vec::new();
    for open in opens {
        match within("open", open).await.unwrap() {
            Ok(store) => winners.push(store),
            Err(Error::LeaseHeld { epoch, .. }) => assert_eq!(epoch, 1),
            Err(other) => panic!("only LeaseHeld is acceptable for losers, got {other:?}"),
        }
    }
    assert_eq!(winners.len(), 1, "exactly one store wins");
    winners[0].write("a", "b", "c", b"x".to_vec()).await.unwrap();
    winners.pop().unwrap().close().await.unwrap();
}

/// A standby never migrates a table whose lease is held: take a store's schema back to
/// version 1 (as if written by an older release) while it holds the lease; a second open
/// (a newer release) finds the lease held before any DDL and leaves version 1 in place. Only
/// the store that takes the lease migrates.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standby_does_not_migrate_a_held_table() {
    let t = table("rollback");
    let a = builder(&t).open().await.unwrap();
    let db = admin().await;
    db.batch_execute(&format!(
        "DROP INDEX \"{t}_created_idx\"; ALTER TABLE \"{t}\" RESET (fillfactor);
         DELETE FROM \"{t}_schema_version\" WHERE version >= 2"
    ))
    .await
    .unwrap();
    let e = builder(&t).open().await.unwrap_err();
    assert!(e.is_lease_held(), "{e:?}");
    assert_eq!(schema_version(&db, &t).await, 1, "the loser recorded no migration");
    let index = db
        .query_opt("SELECT 1 FROM pg_class WHERE relname = $1", &[&format!("{t}_created_idx")])
        .await
        .unwrap();
    assert!(index.is_none(), "the loser created no index");
    // The next successful open migrates for real.
    a.close().await.unwrap();
    let b = builder(&t).open().await.unwrap();
    assert_eq!(schema_version(&db, &t).await, 6);
    let options: Option<Vec<String>> = db
        .query_one("SELECT reloptions FROM pg_class WHERE relname = $1", &[&t])
        .await
        .unwrap()
        .get(0);
    assert_eq!(options, Some(vec!["fillfactor=70".to_owned()]), "migration 3 ran");
    b.close().await.unwrap();
}

/// The highest schema version recorded for table `t`.
async fn schema_version(client: &tokio_postgres::Client, t: &str) -> i32 {
    client
        .query_one(&format!("SELECT max(version) FROM \"{t}_schema_version\""), &[])
        .await
        .unwrap()
        .get(0)
}

/// Setting the TTL alone scales renewal with it (every half local deadline: a third of the
/// TTL). A 9 s lease (for which the fixed 10 s renewal default this replaced was refused by
/// `open()`) stays held by renewal alone past its TTL and its local deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewal_follows_a_ttl_set_alone() {
    let t = table("ttl_alone");
    let store = PgKvStore::builder_from_config(server().config())
        .table(&t)
        .lease_ttl(Duration::from_secs(9))
        .open()
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_secs(10)).await;
    assert_eq!(*store.lease_state().borrow(), LeaseState::Held { epoch: 1 });
    store.write("ns", "sub", "k", b"v".to_vec()).await.unwrap();
    let (_, epoch, expires_in_ms) = lease_row(&admin().await, &t).await;
    assert_eq!(epoch, 1);
    assert!(expires_in_ms > 0, "renewed: {expires_in_ms} ms left");
    store.close().await.unwrap();
}

/// Keys are compared byte by byte, whatever the database's default collation (migration 4), so
/// an operating-system upgrade that changes a linguistic collation's order can never leave the
/// primary key out of order. In a database whose default is ICU's en-US (where `_x < -y < a <
/// B`): a new table lists keys in byte order, and a table of schema version 3, whose key
/// columns and indexes still use that default, is migrated when a store next takes the lease,
/// its rows intact.
///
/// A database's default collation can be ICU's since PostgreSQL 15 (`LOCALE_PROVIDER`); before,
/// it is a C library locale, and a test machine may have none but `C`. There the database keeps
/// the `C` default, and the version 3 table's key columns are given ICU's en-US collation
/// explicitly (`"en-US-x-icu"`, made by `initdb`): the migration is the same `ALTER`, from
/// whichever collation the columns had.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_compare_byte_by_byte_whatever_the_database_collation() {
    let db = table("icu_db");
    let superuser = admin().await;
    let icu_default = common::server_version_num(&superuser).await >= 15_00_00;
    let (create, linguistic_collation) = if icu_default {
        ("LOCALE_PROVIDER icu ICU_LOCALE 'en-US' LOCALE 'C'", "default")
    } else {
        ("LOCALE 'C'", "en-US-x-icu")
    };
    superuser
        .batch_execute(&format!("CREATE DATABASE {db} TEMPLATE template0 {create}"))
        .await
        .expect("create the database");
    drop(superuser);
    let mut config = server().config();
    config.dbname(&db);
    let (client, connection) = config.connect(tokio_postgres::NoTls).await.unwrap();
    tokio::spawn(connection);
    let linguistic: bool = client
        .query_one(
            &format!(
                "SELECT '_x' < '-y' COLLATE \"{linguistic_collation}\" \
                    AND '-y' < 'a' COLLATE \"{linguistic_collation}\" \
                    AND 'a' < 'B' COLLATE \"{linguistic_collation}\""
            ),
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert!(linguistic, "collation \"{linguistic_collation}\" is linguistic");

    let t = table("collation");
    let open = || {
        PgKvStore::builder_from_config(config.clone())
            .table(&t)
            .pool_size(2)
            .lease_ttl(Duration::from_secs(15))
            .open()
    };
    let keys = ["B", "a", "_x", "-y", "11", "1-1", "A"];
    let byte_order: Vec<String> = {
        let mut sorted: Vec<String> = keys.iter().map(|k| k.to_string()).collect();
        sorted.sort();
        sorted
    };
    assert_eq!(byte_order, ["-y", "1-1", "11", "A", "B", "_x", "a"]);
    let store = open().await.unwrap();
    for key in keys {
        store.write("ns", "sub", key, key.as_bytes().to_vec()).await.unwrap();
    }
    assert_eq!(store.list("ns", "sub").await.unwrap(), byte_order, "a new table");
    store.close().await.unwrap();
    let index_collations = format!(
        "SELECT array_agg(c.collname ORDER BY i.indexrelid::regclass::text, u.n)
           FROM pg_index i, unnest(i.indcollation) WITH ORDINALITY AS u (oid, n), pg_collation c
          WHERE i.indrelid = '\"{t}\"'::regclass AND c.oid = u.oid"
    );
    let collations: Vec<String> = client.query_one(&index_collations, &[]).await.unwrap().get(0);
    assert_eq!(collations, ["C"; 5], "both indexes' text columns");

    // Back to version 3: the key columns, and so both indexes, in the database's collation
    // (or, before PostgreSQL 15, in ICU's en-US).
    client
        .batch_execute(&format!(
            "ALTER TABLE \"{t}\"
                 ALTER COLUMN primary_namespace   TYPE TEXT COLLATE \"{linguistic_collation}\",
                 ALTER COLUMN secondary_namespace TYPE TEXT COLLATE \"{linguistic_collation}\",
                 ALTER COLUMN key                 TYPE TEXT COLLATE \"{linguistic_collation}\";
             DELETE FROM \"{t}_schema_version\" WHERE version >= 4"
        ))
        .await
        .unwrap();
    let ordered_by_index = format!("SELECT array_agg(key ORDER BY key) FROM \"{t}\"");
    let linguistic_order: Vec<String> =
        client.query_one(&ordered_by_index, &[]).await.unwrap().get(0);
    assert_eq!(linguistic_order, ["_x", "-y", "1-1", "11", "a", "A", "B"], "version 3");
    let collations: Vec<String> = client.query_one(&index_collations, &[]).await.unwrap().get(0);
    assert_eq!(collations, [linguistic_collation; 5], "version 3");

    // An inspector that spans the migration keeps working (its statements are not cached).
    let inspector = PgKvStore::builder_from_config(config.clone())
        .table(&t)
        .pool_size(1)
        .inspect()
        .await
        .unwrap();
    assert_eq!(inspector.list("ns", "sub").await.unwrap(), linguistic_order, "version 3");
    let store = open().await.unwrap();
    assert_eq!(inspector.list("ns", "sub").await.unwrap(), byte_order, "inspector, migrated");
    assert_eq!(schema_version(&client, &t).await, 6, "migrated");
    let collations: Vec<String> = client.query_one(&index_collations, &[]).await.unwrap().get(0);
    assert_eq!(collations, ["C"; 5], "both indexes rebuilt");
    assert_eq!(store.list("ns", "sub").await.unwrap(), byte_order, "a migrated table");
    for key in keys {
        assert_eq!(store.read("ns", "sub", key).await.unwrap(), key.as_bytes(), "{key}");
    }
    store.close().await.unwrap();
}

/// Setup is all or nothing: when a migration fails halfway (here, migration 2's index name is
/// taken), the tables migration 1 created, the version record and the lease are rolled back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_migration_rolls_back_the_whole_setup() {
    let t = table("halfway");
    let db = admin().await;
    db.batch_execute(&format!("CREATE TABLE \"{t}_created_idx\" (x int)")).await.unwrap();
    let e = builder(&t).open().await.unwrap_err();
    assert!(matches!(e, Error::Database { operation: "migrate schema", .. }), "{e:?}");
    for name in [t.clone(), format!("{t}_lease"), format!("{t}_schema_version")] {
        assert!(!table_exists(&db, &name).await, "{name} was rolled back");
    }
    db.batch_execute(&format!("DROP TABLE \"{t}_created_idx\"")).await.unwrap();
    builder(&t).open().await.expect("then setup succeeds").close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn newer_schema_is_refused_unchanged() {
    let t = table("toonew");
    builder(&t).open().await.unwrap().close().await.unwrap();
    let db = admin().await;
    db.execute(&format!("INSERT INTO \"{t}_schema_version\" (version) VALUES (99)"), &[])
        .await
        .unwrap();
    let e = builder(&t).open().await.unwrap_err();
    assert!(matches!(e, Error::SchemaTooNew { found: 99, supported: 6, .. }), "{e:?}");
    let (_, epoch, _) = lease_row(&db, &t).await;
    assert_eq!(epoch, 1, "no lease was taken");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_store_renews_across_intervals() {
    let t = table("idle");
    let store = builder(&t)
        .lease_ttl(Duration::from_secs(6))
        .renew_interval(Duration::from_millis(500))
        .open()
        .await
        .unwrap();
    let db = admin().await;
    let expiry = format!("SELECT expires_at::text FROM {}", lease_table(&t));
    let mut seen = vec![db.query_one(&expiry, &[]).await.unwrap().get::<_, String>(0)];
    within("two renewals", async {
        while seen.len() < 3 {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let now: String = db.query_one(&expiry, &[]).await.unwrap().get(0);
            if seen.last() != Some(&now) {
                seen.push(now);
            }
        }
    })
    .await;
    assert!(seen.windows(2).all(|w| w[0] < w[1]), "expires_at only advances: {seen:?}");
    assert_eq!(*store.lease_state().borrow(), LeaseState::Held { epoch: 1 });
    store.close().await.unwrap();
}

/// 16 concurrent writers for several seconds do not starve renewal: the writers' FOR KEY SHARE
/// does not conflict with renewal's FOR NO KEY UPDATE.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixteen_writers_do_not_starve_renewal() {
    let t = table("starve");
    let store = builder(&t)
        .pool_size(16)
        .lease_ttl(Duration::from_secs(6))
        .renew_interval(Duration::from_millis(500))
        .open()
        .await
        .unwrap();
    let db = admin().await;
    let expiry = format!("SELECT expires_at::text FROM {}", lease_table(&t));
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writers: Vec<_> = (0..16)
        .map(|w| {
            let (store, stop) = (store.clone(), stop.clone());
            tokio::spawn(async move {
                let mut n = 0u64;
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    store.write("w", "s", &format!("k{}", n % 4), vec![w; 64]).await.unwrap();
                    n += 1;
                }
                n
            })
        })
        .collect();
    let mut renewals = 0;
    let mut last: String = db.query_one(&expiry, &[]).await.unwrap().get(0);
    let started = tokio::time::Instant::now();
    while started.elapsed() < Duration::from_secs(4) {
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now: String = db.query_one(&expiry, &[]).await.unwrap().get(0);
        if now != last {
            renewals += 1;
            last = now;
        }
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut writes = 0;
    for w in writers {
        writes += within("writer", w).await.unwrap();
    }
    assert!(writes > 16, "writers made progress ({writes})");
    assert!(renewals >= 2, "renewal kept succeeding under write load ({renewals} renewals)");
    assert_eq!(*store.lease_state().borrow(), LeaseState::Held { epoch: 1 });
    store.close().await.unwrap();
}

/// The lock semantics the fence relies on, checked directly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_row_locks_fence_owner_changes_but_not_writes() {
    let t = table("locks");
    let store = builder(&t).open().await.unwrap();

    // FOR NO KEY UPDATE (what renewal takes) does not block writes.
    let mut holder = admin().await;
    let tx = common::lock_lease_row(&mut holder, &t, "FOR NO KEY UPDATE").await;
    within("write beside FOR NO KEY UPDATE", store.write("l", "s", "k", b"1".to_vec()))
        .await
        .unwrap();
    tx.rollback().await.unwrap();

    // FOR KEY SHARE (what every write takes) makes an owner change wait until it commits.
    let tx = common::lock_lease_row(&mut holder, &t, "FOR KEY SHARE").await;
    let taker = admin().await;
    let taker_pid: i32 = taker.query_one("SELECT pg_backend_pid()", &[]).await.unwrap().get(0);
    let sql = format!("UPDATE {} SET owner_id = gen_random_uuid() WHERE id = 1", lease_table(&t));
    let take = tokio::spawn(async move { taker.execute(&sql, &[]).await });
    wait_for_lock_wait(taker_pid).await;
    assert!(!take.is_finished(), "owner change waits for FOR KEY SHARE");
    tx.commit().await.unwrap();
    assert_eq!(within("owner change", take).await.unwrap().unwrap(), 1);
    drop(store); // Its lease was taken: the drop must not touch the new owner's row.
}

/// Waits until backend `pid` is blocked on a lock.
async fn wait_for_lock_wait(pid: i32) {
    let sql = "SELECT 1 FROM pg_stat_activity WHERE pid = $1 AND wait_event_type = 'Lock'";
    common::wait_for_row("lock wait", sql, &[&pid]).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_owner_is_fenced_and_fails_closed() {
    let t = table("stale");
    let store = builder(&t).open().await.unwrap();
    store.write("s", "s", "k", b"before".to_vec()).await.unwrap();
    let db = admin().await;
    let new_epoch = steal_lease(&db, &t).await;
    assert_eq!(new_epoch, 2);

    let e = store.write("s", "s", "k", b"stale".to_vec()).await.unwrap_err();
    assert!(matches!(e, Error::LeaseLost { epoch: 1, reason: LossReason::Fenced }), "{e:?}");
    assert_eq!(std::io::Error::from(e).kind(), std::io::ErrorKind::PermissionDenied);
    let e = store.remove("s", "s", "k", false).await.unwrap_err();
    assert!(e.is_lease_lost(), "{e:?}");
    let e = store.write("s", "s", "new-key", b"stale".to_vec()).await.unwrap_err();
    assert!(e.is_lease_lost(), "{e:?}");

    let rows = db
        .query(&format!("SELECT key, value, epoch FROM \"{t}\" ORDER BY key"), &[])
        .await
        .unwrap();
    assert_eq!(rows.len(), 1, "nothing new was written");
    assert_eq!(rows[0].get::<_, Vec<u8>>(1), b"before", "the row is unchanged");
    assert_eq!(rows[0].get::<_, i64>(2), 1);

    // Every later operation fails the same way, reads included, and the state says so.
    assert!(store.read("s", "s", "k").await.unwrap_err().is_lease_lost());
    assert!(store.list("s", "s").await.unwrap_err().is_lease_lost());
    assert!(store.list_all_keys().await.unwrap_err().is_lease_lost());
    assert_eq!(
        *store.lease_state().borrow(),
        LeaseState::Lost { epoch: 1, reason: LossReason::Fenced }
    );
    // The lease row can still be read, to see who took over.
    let info = store.lease_info().await.unwrap().expect("a lease row");
    assert_eq!((info.epoch, info.active), (2, true));
    let (owner, epoch, _) = lease_row(&db, &t).await;
    assert_eq!(info.owner_id, owner);
    store.close().await.unwrap();
    assert_eq!(lease_row(&db, &t).await.0, owner, "closing a stale store leaves the lease alone");
    assert_eq!(epoch, 2);
}

/// The database itself refuses every kind of mutation of a stale owner, each the first
/// operation after the takeover (so the store has not failed closed on its own yet): a remove
/// must not delete, a batch must change nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_owner_is_fenced_by_the_database_in_every_mutation() {
    for fenced in common::Fenced::ALL {
        let t = table("stale_each");
        let store = builder(&t).open().await.unwrap();
        store.write("s", "s", "gone", b"kept".to_vec()).await.unwrap();
        let before = common::all_rows(&t).await;
        steal_lease(&admin().await, &t).await;
        let e = fenced.run(&store).await.unwrap_err();
        assert!(
            matches!(e, Error::LeaseLost { epoch: 1, reason: LossReason::Fenced }),
            "{fenced:?}: {e:?}"
        );
        assert_eq!(common::all_rows(&t).await, before, "{fenced:?} changed nothing");
        store.close().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewal_finding_the_lease_taken_fails_closed() {
    let t = table("taken");
    let store = builder(&t)
        .lease_ttl(Duration::from_secs(6))
        .renew_interval(Duration::from_millis(300))
        .open()
        .await
        .unwrap();
    steal_lease(&admin().await, &t).await;
    common::wait_until_lost(&store).await;
    assert_eq!(
        *store.lease_state().borrow(),
        LeaseState::Lost { epoch: 1, reason: LossReason::TakenOver }
    );
    assert!(store.read("a", "b", "c").await.unwrap_err().is_lease_lost());
}

/// A write blocked on a row lock holds its FOR KEY SHARE on the lease row; the lease expires
/// meanwhile and a contender tries to take over. The takeover must wait for the write to
/// commit, so the write's value and epoch are in place before the new epoch begins.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_flight_write_fences_the_takeover() {
    let t = table("inflight");
    let store = builder(&t).application_name("first").open().await.unwrap();
    // The next write blocks inside its statement, after the lease check; the lease expires.
    let mut blocker = admin().await;
    let (tx, write) = common::write_in_flight_on_an_expired_lease(&store, &t, &mut blocker).await;
    let db = admin().await;
    // A contender opens: its acquisition must wait on the writer's FOR KEY SHARE.
    let contender = tokio::spawn(builder(&t).application_name("second").open());
    common::wait_for_query_lock_wait(&format!("%INSERT INTO {}%", lease_table(&t))).await;
    assert!(!contender.is_finished() && !write.is_finished());

    tx.commit().await.unwrap(); // Let the write go on.
    within("in-flight write", write).await.unwrap().expect("the fenced write commits");
    let second = within("contender", contender).await.unwrap().expect("then the takeover");
    assert_eq!(second.fencing_token(), 2);
    let row = db
        .query_one(&format!("SELECT value, epoch FROM \"{t}\" WHERE key = 'k'"), &[])
        .await
        .unwrap();
    assert_eq!(row.get::<_, Vec<u8>>(0), b"in-flight");
    assert_eq!(row.get::<_, i64>(1), 1, "written under the old epoch, before the new one began");
    // The old store is now fenced; the new one writes under epoch 2.
    assert!(store.write("f", "s", "k", b"late".to_vec()).await.unwrap_err().is_lease_lost());
    second.write("f", "s", "k", b"new".to_vec()).await.unwrap();
    second.close().await.unwrap();
}

/// A takeover that waited at the fence gets a whole TTL counted from after the wait, in the
/// database and locally: its expiry is at least one TTL after the moment the old owner's write
/// could go on, and it keeps its lease by renewal although the wait (3 s) ate most of its local
/// deadline (4 s) counted from before the wait.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn takeover_after_a_wait_at_the_fence_gets_a_whole_ttl() {
    const TTL: Duration = Duration::from_secs(6); // local deadline 4 s, renewal every 2 s
    const WAIT: Duration = Duration::from_secs(3);
    let t = table("fence_wait");
    // The old holder keeps the default TTL: its in-flight write must outlast the wait, and it
    // would be abandoned at its own local deadline.
    let store = builder(&t).open().await.unwrap();
    let mut blocker = admin().await;
    let (tx, write) = common::write_in_flight_on_an_expired_lease(&store, &t, &mut blocker).await;
    let db = admin().await;
    let contender = tokio::spawn(builder(&t).lease_ttl(TTL).open());
    common::wait_for_query_lock_wait(&format!("%INSERT INTO {}%", lease_table(&t))).await;

    tokio::time::sleep(WAIT).await;
    let let_go: SystemTime = tx.query_one("SELECT clock_timestamp()", &[]).await.unwrap().get(0);
    tx.commit().await.unwrap();
    within("in-flight write", write).await.unwrap().expect("the fenced write commits");
    let second = within("contender", contender).await.unwrap().expect("then the takeover");
    let sql = format!("SELECT expires_at FROM {} WHERE id = 1", lease_table(&t));
    let expires_at: SystemTime = db.query_one(&sql, &[]).await.unwrap().get(0);
    assert!(
        expires_at >= let_go + TTL,
        "the expiry was counted from before the wait: {:?} short of a whole TTL",
        (let_go + TTL).duration_since(expires_at).unwrap_or_default()
    );
    // Past the first renewal and past the local deadline counted from before the wait.
    tokio::time::sleep(TTL / 3 + Duration::from_millis(500)).await;
    second.write("f", "s", "k", b"new".to_vec()).await.expect("the new holder keeps its lease");
    assert_eq!(*second.lease_state().borrow(), LeaseState::Held { epoch: 2 });
    second.close().await.unwrap();
}

/// "Fail closed", for each way a loss is found (a mutation refused by the database, renewal
/// finding the lease taken, renewal not confirmed before the local deadline): every key
/// operation (read, list, paginated list, list of all keys, write, remove, atomic batch)
/// returns `LeaseLost` with that reason, `lease_state` reports it, and `lease_info` still
/// answers. Permanently: not even a lease row handed back to this store (its owner id, a long
/// expiry) lets anything through, and nothing is written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_key_operation_fails_closed_after_each_kind_of_loss() {
    let checks = [LossReason::Fenced, LossReason::TakenOver, LossReason::DeadlinePassed]
        .map(|reason| tokio::spawn(every_key_operation_fails_closed_after(reason)));
    for check in checks {
        check.await.unwrap();
    }
}

async fn every_key_operation_fails_closed_after(reason: LossReason) {
    let t = table("allops");
    let builder = match reason {
        // Renewal must not find the takeover before the write does: not due in the test's time.
        LossReason::Fenced => {
            builder(&t).lease_ttl(Duration::from_secs(90)).renew_interval(Duration::from_secs(45))
        }
        _ => builder(&t)
            .lease_ttl(Duration::from_secs(60))
            .local_deadline(Duration::from_secs(3))
            .renew_interval(Duration::from_millis(500)),
    };
    let store = builder.open().await.unwrap();
    store.write("a", "s", "k", b"v".to_vec()).await.unwrap();
    let db = admin().await;
    match reason {
        LossReason::Fenced => {
            steal_lease(&db, &t).await;
            let e = store.write("a", "s", "k", b"stale".to_vec()).await.unwrap_err();
            assert!(matches!(e, Error::LeaseLost { reason: LossReason::Fenced, .. }), "{e:?}");
        }
        LossReason::TakenOver => {
            steal_lease(&db, &t).await;
            common::wait_until_lost(&store).await;
        }
        _ => {
            let mut blocker = admin().await;
            let tx = common::lock_lease_row(&mut blocker, &t, "FOR NO KEY UPDATE").await;
            common::wait_until_lost(&store).await;
            tx.rollback().await.unwrap();
        }
    }
    let lost = LeaseState::Lost { epoch: 1, reason: reason.clone() };
    assert_eq!(*store.lease_state().borrow(), lost, "{reason:?}");

    for round in ["after the loss", "with the lease row handed back"] {
        let is_lost = |what: &str, e: Error| {
            let expected = matches!(&e, Error::LeaseLost { epoch: 1, reason: r } if *r == reason);
            assert!(expected, "{reason:?}, {round}: {what}: {e:?}");
        };
        is_lost("read", store.read("a", "s", "k").await.unwrap_err());
        is_lost("list", store.list("a", "s").await.unwrap_err());
        is_lost("list_paginated", store.list_paginated("a", "s", None).await.unwrap_err());
        is_lost("list_all_keys", store.list_all_keys().await.unwrap_err());
        is_lost("write", store.write("a", "s", "k", b"w".to_vec()).await.unwrap_err());
        is_lost("write new", store.write("a", "s", "new", b"w".to_vec()).await.unwrap_err());
        is_lost("remove", store.remove("a", "s", "k", false).await.unwrap_err());
        let batch = store.batch().put("a", "s", "b", b"w".to_vec()).remove("a", "s", "k");
        is_lost("batch", batch.commit().await.unwrap_err());
        let info = store.lease_info().await.unwrap().expect("lease_info still answers");
        assert_eq!(info.owner_id, lease_row(&db, &t).await.0, "{reason:?}, {round}");
        // Hand the lease row back, as if this store held it: it must not recover.
        let sql = format!(
            "UPDATE {} SET owner_id = $1, epoch = 1,
                    expires_at = clock_timestamp() + interval '1 hour'",
            lease_table(&t)
        );
        db.execute(&sql, &[&store.owner_id()]).await.unwrap();
    }
    let rows = common::all_rows(&t).await;
    assert_eq!(rows, [("k".to_owned(), b"v".to_vec())], "{reason:?}: nothing written");
    assert_eq!(*store.lease_state().borrow(), lost);
    store.close().await.unwrap();
}

/// Renewal blocked past the local deadline: the store fails closed while the database still
/// shows the lease unexpired (the deadline comes first, by design).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocked_renewal_fails_closed_before_database_expiry() {
    let t = table("deadline");
    let store = builder(&t)
        .lease_ttl(Duration::from_secs(20))
        .local_deadline(Duration::from_secs(3))
        .renew_interval(Duration::from_millis(500))
        .open()
        .await
        .unwrap();
    // FOR NO KEY UPDATE conflicts with renewal's UPDATE but not with writes.
    let mut blocker = admin().await;
    let tx = common::lock_lease_row(&mut blocker, &t, "FOR NO KEY UPDATE").await;
    common::wait_until_lost(&store).await;
    assert_eq!(
        *store.lease_state().borrow(),
        LeaseState::Lost { epoch: 1, reason: LossReason::DeadlinePassed }
    );
    let (owner, _, expires_in_ms) = lease_row(&admin().await, &t).await;
    assert_eq!(owner, store.owner_id());
    assert!(expires_in_ms > 0, "the database still shows the lease valid ({expires_in_ms} ms)");
    let e = store.write("d", "s", "k", vec![]).await.unwrap_err();
    assert!(matches!(e, Error::LeaseLost { reason: LossReason::DeadlinePassed, .. }), "{e:?}");
    tx.rollback().await.unwrap();
    // Even once renewal could go on, the loss is permanent.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert!(store.read("d", "s", "k").await.unwrap_err().is_lease_lost());
}

/// A holder of `t` (also its application name) that connects through a proxy (TTL and local
/// deadline in seconds), then
/// is cut off from the database (every connection cut, new ones refused) until it has lost its
/// lease at the local deadline. The proxy, the holder and its state then.
async fn cut_off_until_lost(
    t: &str,
    ttl: u64,
    local_deadline: u64,
    renew_interval: Duration,
) -> (pgfence_testing::Proxy, PgKvStore, LeaseState) {
    let proxy = pgfence_testing::Proxy::start(server().tcp_addr().unwrap()).await.unwrap();
    let holder = PgKvStore::builder_from_config(server().config_via(proxy.addr()))
        .table(t)
        .application_name(t)
        .pool_size(2)
        .lease_ttl(Duration::from_secs(ttl))
        .local_deadline(Duration::from_secs(local_deadline))
        .renew_interval(renew_interval)
        .open()
        .await
        .unwrap();
    proxy.set_refuse(true);
    proxy.cut_all();
    common::wait_until_lost(&holder).await;
    let lost = LeaseState::Lost { epoch: 1, reason: LossReason::DeadlinePassed };
    assert_eq!(*holder.lease_state().borrow(), lost);
    (proxy, holder, lost)
}

/// A holder cut off from the database loses its lease at the local deadline, and keeps
/// trying to release it (by owner id, about every second) while the network is down: once it
/// is back, a standby takes over within about a second, long before the lost lease's expiry in
/// the database (read from the lease row), instead of waiting for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_lease_is_released_once_the_network_returns() {
    let t = table("lostrelease");
    // A local deadline far ahead of the database expiry (5 s of 30 s), so that a takeover at
    // the expiry and one right after the network returns are far apart.
    let (proxy, holder, lost) = cut_off_until_lost(&t, 30, 5, Duration::from_secs(2)).await;
    tokio::time::sleep(Duration::from_secs(3)).await; // Several release attempts, all refused.

    let (owner, _, expires_in_ms) = lease_row(&admin().await, &t).await;
    assert_eq!(owner, holder.owner_id(), "not released while the network is down");
    let expiry = Duration::from_millis(u64::try_from(expires_in_ms).unwrap_or(0));
    assert!(
        expiry > Duration::from_secs(10),
        "the lost lease is valid in the database: {expiry:?}"
    );
    let back = std::time::Instant::now();
    proxy.set_refuse(false);
    let standby =
        within("takeover", builder(&t).lease_ttl(Duration::from_secs(30)).standby().open())
            .await
            .unwrap();
    let took = back.elapsed();
    println!("takeover {took:?} after the network returned; the lost lease had {expiry:?} left");
    assert!(took < expiry / 2, "released by the holder, not expired: {took:?} of {expiry:?}");
    assert_eq!(standby.fencing_token(), 2);
    assert_eq!(*holder.lease_state().borrow(), lost, "the loss stays published");
    standby.close().await.unwrap();
}

/// A lost lease is never renewed: after the loss the renewal thread only ever sends the release
/// (by owner id), never the renewal, which would extend in the database, by a whole TTL, a
/// lease the application already treats as lost. Here the lease is lost at the local deadline
/// while the network is down; then the network returns while a transaction holds the lease row
/// (`FOR UPDATE`, which both statements wait for). So every statement the thread sends from
/// then on waits on the server, and stays visible in `pg_stat_activity` until the lock goes
/// (PostgreSQL does not notice a client gone while its statement waits for a lock): none can
/// slip by between two looks. The thread gives each release attempt 2 s, then tries again on a
/// new connection; the test looks until three releases wait, and fails at the first renewal.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_lease_is_only_released_never_renewed() {
    let t = table("neverrenew");
    // A TTL far beyond the test, so that the thread's release attempts (which go on until the
    // database expiry of the lease, one TTL after the last renewal attempt) cannot stop on
    // their own while the test looks.
    let (proxy, holder, lost) = cut_off_until_lost(&t, 120, 3, Duration::from_secs(1)).await;
    // Nothing of the holder is on the server now (its connections were cut, and no statement
    // of it waited for anything): from here on, all it sends waits for this lock.
    let mut blocker = admin().await;
    let tx = common::lock_lease_row(&mut blocker, &t, "FOR UPDATE").await;
    proxy.set_refuse(false);

    // The release also notifies standbys (`pg_notify`); the renewal does not.
    let waiting = "SELECT count(*) FILTER (WHERE query LIKE '%pg_notify%'),
                          coalesce(string_agg(query, ' | ')
                                   FILTER (WHERE query NOT LIKE '%pg_notify%'), '')
                     FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE $1";
    let statement = format!("%UPDATE {}%", lease_table(&t));
    let db = admin().await;
    within("three release attempts waiting for the lease row", async {
        loop {
            let row = db.query_one(waiting, &[&statement]).await.unwrap();
            let (releases, others): (i64, String) = (row.get(0), row.get(1));
            assert!(others.is_empty(), "the lost lease's thread sent something else: {others}");
            if releases >= 3 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    let (owner, epoch, _) = lease_row(&db, &t).await;
    assert_eq!((owner, epoch), (holder.owner_id(), 1), "unchanged while the row is locked");

    // Once the lock goes, the waiting releases run: the lost lease is released.
    tx.rollback().await.unwrap();
    within("release after the lock", async {
        while lease_row(&db, &t).await.2 > 0 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    assert_eq!(*holder.lease_state().borrow(), lost, "the loss stays published");
    holder.close().await.expect("the lost lease was released");
}

/// What the renewal thread logs when it stops retrying the release of a lost lease.
const RELEASE_STOPPED: &str =
    "pgfence lease release kept failing until the lease's database expiry; stopped trying";

/// docs/design.md, "Renewal":
/// "A release that fails (the database still unreachable) is retried about
/// every second until one succeeds or the lease's database expiry has passed". A holder cut
/// off from the database loses its lease at the local deadline and keeps trying to release it
/// while the network stays down. When it stops trying (it logs so), the database shows the
/// lease expired: not before. Once the network is back, no release comes any more: for three
/// retry intervals nothing of the holder connects (a release would keep its connection, seen
/// by the proxy and by the server).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_lease_release_retries_stop_once_its_database_expiry_has_passed() {
    record_error_events();
    let t = table("releasestop");
    let (proxy, holder, lost) = cut_off_until_lost(&t, 6, 3, Duration::from_secs(1)).await;
    within("the release retries stopped", async {
        while !logged(&t, RELEASE_STOPPED) {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    let (owner, _, expires_in_ms) = lease_row(&admin().await, &t).await;
    assert_eq!(owner, holder.owner_id(), "never released while the network was down");
    assert!(expires_in_ms <= 0, "stopped only after the database expiry: {expires_in_ms} ms left");

    proxy.set_refuse(false);
    for _ in 0..30 {
        assert_eq!(proxy.connection_count(), 0, "no release attempt after stopping");
        assert_eq!(common::sessions_of(&t).await, 0, "no release attempt after stopping");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(*holder.lease_state().borrow(), lost, "the loss stays published");
    drop(holder);
}

/// The store's error events in this test binary, as `(table field, message)`, from
/// [`record_error_events`] on.
static ERROR_EVENTS: std::sync::Mutex<Vec<(String, String)>> = std::sync::Mutex::new(Vec::new());

fn record_error_events() {
    common::errors::observe("lease: record error events", |event| {
        let mut events = ERROR_EVENTS.lock().unwrap_or_else(|e| e.into_inner());
        events.push((event.table.clone(), event.message.clone()));
    });
}

/// Whether the store of `table` has logged `message`.
fn logged(table: &str, message: &str) -> bool {
    let events = ERROR_EVENTS.lock().unwrap_or_else(|e| e.into_inner());
    events.iter().any(|(t, m)| t.contains(table) && m == message)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn panic_policy_panics_in_the_calling_task() {
    let t = table("panic");
    let store = builder(&t).on_lease_lost(LeaseLossPolicy::Panic).open().await.unwrap();
    steal_lease(&admin().await, &t).await;
    let write = tokio::spawn(store.write("p", "s", "k", vec![]));
    let joined = tokio::time::timeout(HANG_GUARD, write).await.expect("no hang");
    assert!(joined.unwrap_err().is_panic(), "the write panicked");
    assert!(matches!(*store.lease_state().borrow(), LeaseState::Lost { .. }));
}

/// Under `LeaseLossPolicy::Panic`, a loss that renewal finds ends the renewal thread with a
/// panic, after one attempt to release the lease and without the retries that `FailClosed`
/// goes on with. `close()` then says that the lease was lost, not `Ok` as if it had released
/// it: here the thread has ended before `close()` (its connection is gone).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_after_renewal_panicked_returns_lease_lost() {
    let t = table("panicclose");
    let store = builder(&t)
        .application_name(&t)
        .renew_interval(Duration::from_millis(300))
        .on_lease_lost(LeaseLossPolicy::Panic)
        .open()
        .await
        .unwrap();
    steal_lease(&admin().await, &t).await;
    common::wait_until_lost(&store).await;
    // The renewal thread's session (the only one that ran the renewal or the release) closes
    // when the thread ends.
    let renewal = "SELECT 1 FROM pg_stat_activity WHERE application_name = $1 AND query LIKE $2";
    let (app, statement) = (format!("pgfence {t}"), format!("%UPDATE {}%", lease_table(&t)));
    let db = admin().await;
    within("the renewal thread ends", async {
        while !db.query(renewal, &[&app, &statement]).await.unwrap().is_empty() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    let e = within("close", store.close()).await.unwrap_err();
    assert!(matches!(e, Error::LeaseLost { epoch: 1, reason: LossReason::TakenOver }), "{e:?}");
    let lost = LeaseState::Lost { epoch: 1, reason: LossReason::TakenOver };
    assert_eq!(*store.lease_state().borrow(), lost);
    store.close().await.expect("closing again: nothing runs any more");
}

/// The same when `close()` comes while the renewal thread still tries to release the lost
/// lease (held up by a lock on the lease row), before its panic: the thread takes the request
/// only after the attempt, and ends with the panic instead of answering.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_during_the_release_before_the_renewal_panic_returns_lease_lost() {
    let t = table("panicclose2");
    let store = builder(&t)
        .lease_ttl(Duration::from_secs(20))
        .local_deadline(Duration::from_secs(3))
        .renew_interval(Duration::from_millis(500))
        .on_lease_lost(LeaseLossPolicy::Panic)
        .open()
        .await
        .unwrap();
    // FOR NO KEY UPDATE holds up the renewal (lost at the local deadline), then the release.
    let mut blocker = admin().await;
    let tx = common::lock_lease_row(&mut blocker, &t, "FOR NO KEY UPDATE").await;
    common::wait_until_lost(&store).await;
    // The release also notifies standbys (`pg_notify`); the renewal does not.
    common::wait_for_query_lock_wait(&format!("%UPDATE {}%pg_notify%", lease_table(&t))).await;
    let e = within("close", store.close()).await.unwrap_err();
    let lost =
        |e: &Error| matches!(e, Error::LeaseLost { epoch: 1, reason: LossReason::DeadlinePassed });
    assert!(lost(&e), "{e:?}");
    tx.rollback().await.unwrap();
}

/// A store whose local deadline (3 s, TTL 6 s) a test can outwait, renewing every 500 ms: if
/// renewal stalled, the lease would be lost within the test.
fn short_deadline(t: &str) -> pgfence::Builder {
    builder(t)
        .lease_ttl(Duration::from_secs(6))
        .local_deadline(Duration::from_secs(3))
        .renew_interval(Duration::from_millis(500))
}

/// Renewal runs on its own thread and connection: a caller's runtime blocked for longer than
/// the local deadline does not cost the lease.
#[tokio::test(flavor = "current_thread")]
async fn blocked_caller_runtime_does_not_stop_renewal() {
    let t = table("blockedrt");
    let store = short_deadline(&t).open().await.unwrap();
    // Block this (only) runtime thread well past the local deadline.
    std::thread::sleep(Duration::from_secs(5));
    assert_eq!(*store.lease_state().borrow(), LeaseState::Held { epoch: 1 });
    store.write("b", "s", "k", b"still mine".to_vec()).await.expect("lease kept");
    store.close().await.unwrap();
}

/// Renewal has a connection of its own: a pool whose every connection is stuck (here its only
/// one, in a write waiting for a row lock) past the local deadline does not cost the lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exhausted_pool_does_not_stop_renewal() {
    let t = table("poolstuck");
    let store = short_deadline(&t).pool_size(1).open().await.unwrap();
    let mut blocker = admin().await;
    let (tx, stuck) = common::write_waiting_for_a_row_lock(&store, &t, &mut blocker).await;
    tokio::time::sleep(Duration::from_secs(4)).await; // Past the local deadline.
    assert_eq!(*store.lease_state().borrow(), LeaseState::Held { epoch: 1 });
    tx.rollback().await.unwrap();
    within("stuck write", stuck).await.unwrap().expect("the write goes on under the lease");
    store.close().await.unwrap();
}

/// `LeaseLossPolicy::Abort` ends the process, whether an operation finds the loss or renewal
/// does (an idle standby-ready node makes no calls). Runs the ignored tests below in a child
/// process each and checks how it died.
#[test]
fn abort_policy_aborts_the_process() {
    for child in ["abort_policy_child", "abort_policy_renewal_child"] {
        use std::os::unix::process::ExitStatusExt;
        let output = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", &common::test_path(module_path!(), child)])
            .args(["--include-ignored", "--nocapture"])
            .env("PGFENCE_ABORT_CHILD", "1")
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        let died = output.status.signal();
        assert_eq!(died, Some(6), "{child} died of SIGABRT: {:?}\n{stderr}", output.status);
        assert!(stderr.contains("aborting the process"), "{child} says why: {stderr}");
        assert!(!String::from_utf8_lossy(&output.stdout).contains("child survived"), "{child}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "run in a child process by abort_policy_aborts_the_process"]
async fn abort_policy_renewal_child() {
    assert!(std::env::var_os("PGFENCE_ABORT_CHILD").is_some(), "only as a child process");
    let t = table("abortrenew");
    let store = builder(&t)
        .renew_interval(Duration::from_millis(300))
        .on_lease_lost(LeaseLossPolicy::Abort)
        .open()
        .await
        .unwrap();
    steal_lease(&admin().await, &t).await;
    // No operation: renewal finds the lease taken and must abort on its own.
    tokio::time::sleep(HANG_GUARD).await;
    drop(store);
    println!("child survived");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "run in a child process by abort_policy_aborts_the_process"]
async fn abort_policy_child() {
    assert!(std::env::var_os("PGFENCE_ABORT_CHILD").is_some(), "only as a child process");
    let t = table("abort");
    let store = builder(&t).on_lease_lost(LeaseLossPolicy::Abort).open().await.unwrap();
    steal_lease(&admin().await, &t).await;
    let _ = store.write("a", "s", "k", vec![]).await;
    println!("child survived");
}

/// The usual least-privilege setup: an administrator creates the schema and grants it to the
/// application's role, which may not create schemas in the database (only a database's owner
/// may, unless granted). That role opens a table in the schema: the setup creates the schema
/// only when it is missing (PostgreSQL checks the privilege of `CREATE SCHEMA IF NOT EXISTS`
/// before it looks whether the schema exists).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn role_that_may_not_create_schemas_opens_a_table_in_a_granted_schema() {
    let schema = table("granted");
    let role = table("nocreatedb");
    admin()
        .await
        .batch_execute(&format!(
            "CREATE ROLE {role} LOGIN; CREATE SCHEMA {schema};
             GRANT USAGE, CREATE ON SCHEMA {schema} TO {role};"
        ))
        .await
        .unwrap();
    let mut config = server().config();
    config.user(&role);
    let store = PgKvStore::builder_from_config(config)
        .table(format!("{schema}.kv"))
        .pool_size(1)
        .lease_ttl(Duration::from_secs(15))
        .open()
        .await
        .unwrap();
    store.write("a", "b", "c", b"x".to_vec()).await.unwrap();
    store.close().await.unwrap();
}

/// Stores of two tables in one new schema, opened at once on a fresh database, both create
/// the schema: their setups do not serialize each other (different tables), so one waits in
/// `CREATE SCHEMA` for the other's uncommitted one. Once that commits, the waiting setup finds
/// the schema there and opens, instead of failing with PostgreSQL's unique violation. The
/// other setup is played here by an open transaction that created the schema.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_creation_of_the_tables_schema_is_not_an_error() {
    let schema = table("racing");
    let app = table("schemarace");
    let mut db = admin().await;
    let other_setup = db.transaction().await.unwrap();
    other_setup.batch_execute(&format!("CREATE SCHEMA {schema}")).await.unwrap();
    let opening = tokio::spawn(builder(&format!("{schema}.kv")).application_name(&app).open());
    common::wait_for_app_lock_wait(&app).await;
    other_setup.commit().await.unwrap();
    let store = within("open", opening).await.unwrap().unwrap();
    store.write("a", "b", "c", b"x".to_vec()).await.unwrap();
    store.close().await.unwrap();
}

/// With `default_transaction_isolation` set to `serializable` (or `repeatable read`) for the
/// database, the role or the connection, a setup that waited for the setup lock still sees
/// what the setup before it committed: it finds the lease held (`LeaseHeld`, on which a
/// standby keeps waiting), not a serialization failure from a snapshot taken before the wait
/// (on which a standby would stop). The setup before it is played here by a transaction that
/// takes the setup lock and the lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn setup_after_a_concurrent_one_gets_lease_held_whatever_the_default_isolation() {
    let t = table("isolation");
    let app = table("serializable");
    common::open(&t).await.close().await.unwrap(); // The tables exist, the lease is free.
    let mut db = admin().await;
    let other_setup = db.transaction().await.unwrap();
    other_setup
        .execute(
            "SELECT pg_advisory_xact_lock($1, hashtext(current_schema() || '.' || $2))",
            &[&0x7067_6665_i32, &t],
        )
        .await
        .unwrap();
    let take = format!(
        "UPDATE {} SET owner_id = gen_random_uuid(), epoch = epoch + 1,
                expires_at = clock_timestamp() + interval '1 hour' WHERE id = 1",
        lease_table(&t)
    );
    other_setup.execute(&take, &[]).await.unwrap();
    let mut config = server().config();
    let options = config.get_options().unwrap_or_default().to_owned();
    config.options(format!("{options} -c default_transaction_isolation=serializable"));
    let opening = tokio::spawn(
        PgKvStore::builder_from_config(config)
            .table(&t)
            .pool_size(1)
            .lease_ttl(Duration::from_secs(15))
            .application_name(&app)
            .open(),
    );
    common::wait_for_app_lock_wait(&app).await;
    other_setup.commit().await.unwrap();
    let e = within("open", opening).await.unwrap().unwrap_err();
    assert!(matches!(e, Error::LeaseHeld { epoch: 2, .. }), "{e:?}");
}

/// The isolation levels other than read committed that a database, a role or a connection may
/// make the default, as `-c` settings of a connection's options (a space escaped: libpq splits
/// the options at unescaped spaces).
const STRICTER_ISOLATIONS: [&str; 2] = ["repeatable\\ read", "serializable"];

/// A store whose connections get `default_transaction_isolation` = `isolation` from their
/// options, as they would from `ALTER DATABASE`/`ALTER ROLE ... SET`.
fn builder_with_default_isolation(t: &str, app: &str, isolation: &str) -> pgfence::Builder {
    let mut config = server().config();
    let options = config.get_options().unwrap_or_default().to_owned();
    config.options(format!("{options} -c default_transaction_isolation={isolation}"));
    PgKvStore::builder_from_config(config)
        .table(t)
        .pool_size(1)
        .lease_ttl(Duration::from_secs(15))
        .renew_interval(Duration::from_secs(3))
        .application_name(app)
}

/// Waits until the store configured with `application_name(app)` has a fenced mutation (a
/// statement that locks the lease row FOR KEY SHARE) waiting for a lock; returns its pid.
async fn fenced_statement_waiting(app: &str) -> i32 {
    let sql = "SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock'
                AND application_name = $1 AND query LIKE '%FOR KEY SHARE%'";
    let app = format!("pgfence {app}");
    common::wait_for_row("a fenced statement waiting", sql, &[&app]).await;
    admin().await.query_one(sql, &[&app]).await.unwrap().get(0)
}

/// Whatever `default_transaction_isolation` says, a write, remove or batch that waits for a
/// takeover in flight (a transaction that changed the lease row's owner and has not committed
/// yet) is fenced once it commits, as under read committed: the caller gets `LeaseLost`
/// (`Fenced`), and nothing is written. Under repeatable read or serializable the statement's
/// snapshot would predate the takeover, and PostgreSQL would answer its lock with a
/// serialization failure (SQLSTATE 40001) instead: an error the store does not know as a lost
/// lease, so it would not fail closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mutation_waiting_for_a_takeover_is_fenced_whatever_the_default_isolation() {
    for isolation in STRICTER_ISOLATIONS {
        for fenced in common::Fenced::ALL {
            let t = table("isotakeover");
            let app = table("isotakeover");
            let store = builder_with_default_isolation(&t, &app, isolation).open().await.unwrap();
            let mut db = admin().await;
            let takeover = db.transaction().await.unwrap();
            let take = format!(
                "UPDATE {} SET owner_id = gen_random_uuid(), epoch = epoch + 1,
                        expires_at = clock_timestamp() + interval '1 hour' WHERE id = 1",
                lease_table(&t)
            );
            takeover.execute(&take, &[]).await.unwrap();
            let mutation = tokio::spawn(fenced.run(&store));
            fenced_statement_waiting(&app).await;
            takeover.commit().await.unwrap();
            let e = within("mutation", mutation).await.unwrap().unwrap_err();
            assert!(
                matches!(e, Error::LeaseLost { reason: LossReason::Fenced, .. }),
                "{isolation}, {fenced:?}: {e:?}"
            );
            assert_eq!(common::all_rows(&t).await, vec![], "{isolation}, {fenced:?}");
            drop(store);
        }
    }
}

/// A renewal that commits after a fenced mutation's statement began (after its snapshot) and
/// before the statement locks the lease row does not fail the mutation, whatever
/// `default_transaction_isolation` says: a renewal changes no key column, and PostgreSQL grants
/// FOR KEY SHARE on a row whose newer version changed none, even to a snapshot that predates
/// it. The mutation is held between its snapshot and its lock by a lock on the KV table: a
/// prepared statement's snapshot is taken (under repeatable read and serializable, for the
/// whole transaction) before the locks of its tables.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewal_between_a_mutations_snapshot_and_its_lock_is_harmless_whatever_the_isolation() {
    for isolation in STRICTER_ISOLATIONS {
        let t = table("isorenewal");
        let app = table("isorenewal");
        let store = builder_with_default_isolation(&t, &app, isolation).open().await.unwrap();
        for fenced in common::Fenced::ALL {
            // Prepares the statement on the store's one pooled connection.
            fenced.run(&store).await.unwrap();
            let mut db = admin().await;
            let blocker = db.transaction().await.unwrap();
            blocker.batch_execute(&format!("LOCK TABLE \"{t}\" IN SHARE MODE")).await.unwrap();
            let mutation = tokio::spawn(fenced.run(&store));
            fenced_statement_waiting(&app).await;
            let renew = format!(
                "UPDATE {} SET expires_at = clock_timestamp() + interval '15 seconds' WHERE id = 1",
                lease_table(&t)
            );
            admin().await.execute(&renew, &[]).await.unwrap();
            blocker.rollback().await.unwrap();
            within("mutation", mutation).await.unwrap().unwrap_or_else(|e| {
                panic!("{isolation}, {fenced:?}: {e:?}");
            });
        }
        store.close().await.unwrap();
    }
}

/// Whatever `default_transaction_isolation` says, a renewal that waits for another transaction
/// that updated the lease row (here an operator extending the expiry) renews as soon as that
/// transaction commits, as under read committed: it re-reads the committed row. Under
/// repeatable read or serializable it would fail with a serialization failure (SQLSTATE
/// 40001) and renew only on its retry about a second later; the lease row shows which: the
/// store's TTL from now (renewed) or the operator's hour (not yet).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewal_waiting_for_an_update_of_the_lease_renews_whatever_the_default_isolation() {
    for isolation in STRICTER_ISOLATIONS {
        let t = table("isorenew");
        let app = table("isorenew");
        // A renewal attempt gives up after the renewal interval (3 s): time to see it waiting.
        let store = builder_with_default_isolation(&t, &app, isolation).open().await.unwrap();
        let mut db = admin().await;
        let operator = db.transaction().await.unwrap();
        let extend = format!(
            "UPDATE {} SET expires_at = clock_timestamp() + interval '1 hour' WHERE id = 1",
            lease_table(&t)
        );
        operator.execute(&extend, &[]).await.unwrap();
        let renewal = "SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock'
                        AND application_name = $1 AND query LIKE '%SET expires_at%'";
        let app_name = format!("pgfence {app}");
        common::wait_for_row("the renewal waiting", renewal, &[&app_name]).await;
        let probe = admin().await;
        let pid: i32 = probe.query_one(renewal, &[&app_name]).await.unwrap().get(0);
        operator.commit().await.unwrap();
        let done = "SELECT 1 WHERE NOT EXISTS
                        (SELECT 1 FROM pg_stat_activity WHERE pid = $1 AND state = 'active')";
        common::wait_for_row("the renewal done", done, &[&pid]).await;
        let (_, _, expires_in_ms) = lease_row(&probe, &t).await;
        assert!(
            expires_in_ms <= 15_000,
            "{isolation}: the renewal failed, the operator's expiry is still there \
             ({expires_in_ms} ms left)"
        );
        assert!(matches!(*store.lease_state().borrow(), LeaseState::Held { .. }));
        store.close().await.unwrap();
    }
}

/// A store on a pool passed in does not own its connections' sessions, which may default to
/// repeatable read or serializable. It opens all the same, and each fenced mutation runs at
/// read committed in a transaction of its own. So a write that waited for a takeover reports
/// the lost lease, not a serialization failure. (See also durability.rs.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_on_a_pool_with_stricter_sessions_writes_at_read_committed() {
    use pgfence::deadpool_postgres::{Manager, Pool};
    let pool_with = |isolation: &str| {
        let mut config = server().config();
        let options = config.get_options().unwrap_or_default().to_owned();
        config.options(format!("{options} -c default_transaction_isolation={isolation}"));
        let manager = Manager::new(config, pgfence::tokio_postgres::NoTls);
        Pool::builder(manager).max_size(2).build().unwrap()
    };
    for isolation in STRICTER_ISOLATIONS {
        let t = table("isopool");
        let store = PgKvStore::builder_from_pool(pool_with(isolation))
            .table(&t)
            .lease_ttl(Duration::from_secs(15))
            .renew_interval(Duration::from_secs(3))
            .open()
            .await
            .unwrap();
        store.write("p", "s", "k", b"v".to_vec()).await.unwrap();
        // A takeover holds the lease row; the write waits for it, then finds it gone.
        let mut taker = admin().await;
        let tx = common::lock_lease_row(&mut taker, &t, "FOR UPDATE").await;
        let write = tokio::spawn(store.write("p", "s", "k", b"w".to_vec()));
        let waiting = "SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock' \
                       AND query LIKE $1";
        let pattern = format!("%INSERT INTO \"{t}\"%");
        common::wait_for_row("the write waits for the lease row", waiting, &[&pattern]).await;
        let sql = format!("UPDATE {} SET owner_id = gen_random_uuid()", common::lease_table(&t));
        tx.execute(&sql, &[]).await.unwrap();
        tx.commit().await.unwrap();
        let e = within("write behind a takeover", write).await.unwrap().unwrap_err();
        assert!(e.is_lease_lost(), "{isolation}: {e:?}");
    }
}

/// The longest lease TTL the builder accepts (24 h) opens a store over TCP. Its connections'
/// keepalive idle time defaults to the TTL, but Linux accepts at most 32,767 s for it
/// (`TCP_KEEPIDLE`): asked for more, every connection would fail, with an I/O error a standby
/// takes for a passing network fault and retries for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_longest_lease_ttl_opens_over_tcp() {
    let t = table("longttl");
    let config = server().config();
    assert!(
        config.get_hosts().iter().all(|h| matches!(h, tokio_postgres::config::Host::Tcp(_))),
        "the test server is reached over TCP"
    );
    let store = within(
        "open",
        PgKvStore::builder_from_config(config)
            .table(&t)
            .pool_size(1)
            .lease_ttl(Duration::from_secs(24 * 60 * 60))
            .open(),
    )
    .await
    .unwrap();
    store.write("ns", "sub", "k", b"v".to_vec()).await.unwrap();
    store.close().await.unwrap();
}
