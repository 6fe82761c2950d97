//! Write coalescing (`Builder::write_concurrency`): mutations that arrive while the allowed
//! statements are busy share one fenced statement, and each caller still gets its own result,
//! its own per-key order and the fence.

use crate::common;

use std::collections::BTreeMap;
use std::time::Duration;

use common::within;
use pgfence::{Error, PgKvStore};
use rand::seq::SliceRandom;

const NS: &str = "ns";
const SUB: &str = "sub";

/// A store that runs one single-key statement at a time: everything else queues and coalesces.
async fn open_serial(table: &str) -> PgKvStore {
    common::builder(table).write_concurrency(1).open().await.expect("open store")
}

/// A store whose only write statement is stuck: its write of the key `blocker` waits on an
/// administrator's row lock, so every other write queues behind it until [`Stall::release`].
pub(crate) struct Stall {
    first: tokio::task::JoinHandle<pgfence::Result<()>>,
    release: tokio::sync::oneshot::Sender<()>,
    locker: tokio::task::JoinHandle<()>,
}

/// Stalls `store` (opened with [`open_serial`] on `table`): writes the key `blocker`, has an
/// administrator transaction lock its row, starts a second write of it and waits until the
/// server shows that write waiting on the lock (asking the server, never a timing guess).
pub(crate) async fn stall(store: &PgKvStore, table: &str) -> Stall {
    store.write(NS, SUB, "blocker", b"0".to_vec()).await.unwrap();
    let (locked, is_locked) = tokio::sync::oneshot::channel();
    let (release, released) = tokio::sync::oneshot::channel::<()>();
    let sql = format!("SELECT 1 FROM \"{table}\" WHERE key = 'blocker' FOR UPDATE");
    let locker = tokio::spawn(async move {
        let mut admin = common::admin().await;
        let tx = admin.transaction().await.unwrap();
        assert_eq!(tx.query(&sql, &[]).await.unwrap().len(), 1, "the blocking row exists");
        locked.send(()).unwrap();
        let _ = released.await;
        tx.rollback().await.unwrap();
    });
    within("row lock", is_locked).await.unwrap();
    let first = tokio::spawn(store.write(NS, SUB, "blocker", b"1".to_vec()));
    common::wait_for_query_lock_wait(&format!("%\"{table}\"%")).await;
    Stall { first, release, locker }
}

impl Stall {
    /// Lets the spawned `queued` calls reach the store's queue ([`settle`]), rolls the
    /// administrator's transaction back (the stuck write then commits) and returns the queued
    /// calls' results, in order.
    pub(crate) async fn release(self, queued: Vec<Call>) -> Vec<pgfence::Result<()>> {
        settle().await;
        self.release.send(()).unwrap();
        within("administrator rollback", self.locker).await.unwrap();
        within("the stuck write", self.first).await.unwrap().unwrap();
        let mut results = Vec::new();
        for call in queued {
            results.push(within("queued call", call).await.unwrap());
        }
        results
    }
}

/// A spawned `write` or `remove`.
pub(crate) type Call = tokio::task::JoinHandle<pgfence::Result<()>>;

/// Lets tasks that were just spawned reach the store's queue. Only a settle time for the
/// scenario: every assertion below holds whether or not a write made it into the shared
/// statement, except the one that says they did.
async fn settle() {
    tokio::time::sleep(Duration::from_millis(500)).await;
}

/// `(key, xmin)` of every row of `(NS, SUB)`: rows with one `xmin` were written by one
/// transaction.
async fn writers_of(table: &str) -> BTreeMap<String, String> {
    let sql = format!(
        "SELECT key, xmin::text FROM \"{table}\" WHERE primary_namespace = $1 AND secondary_namespace = $2"
    );
    common::pairs(&common::admin().await, &sql, &[&NS, &SUB]).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_queued_behind_a_busy_statement_commit_in_one_transaction() {
    let table = common::table("coal_one");
    let store = open_serial(&table).await;
    store.write(NS, SUB, "old", b"old".to_vec()).await.unwrap();
    let stall = stall(&store, &table).await;
    let queued: Vec<_> = (0..5)
        .map(|i| tokio::spawn(store.write(NS, SUB, &format!("k{i}"), vec![i])))
        .chain([tokio::spawn(store.remove(NS, SUB, "old", false))])
        .collect();
    for result in stall.release(queued).await {
        result.unwrap();
    }
    let rows = writers_of(&table).await;
    assert!(!rows.contains_key("old"), "the queued remove committed");
    let xmins: Vec<&String> = (0..5).map(|i| &rows[&format!("k{i}")]).collect();
    assert!(xmins.iter().all(|x| *x == xmins[0]), "one transaction wrote all five: {xmins:?}");
    assert_ne!(xmins[0], &rows["blocker"], "the blocked write ran in a statement of its own");
    for i in 0..5u8 {
        assert_eq!(store.read(NS, SUB, &format!("k{i}")).await.unwrap(), vec![i]);
    }
    store.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_queue_is_split_into_groups_and_every_write_commits() {
    let per_transaction = queue_and_count("coal_long", 2500, 4).await;
    let largest = per_transaction.iter().max().copied().unwrap_or(0);
    assert!(largest <= 1000, "no statement carries more than 1,000 writes: {largest}");
    assert!(largest > 1, "queued writes shared statements: {per_transaction:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_of_large_values_is_split_at_16_mib() {
    let per_transaction = queue_and_count("coal_big", 24, 1 << 20).await;
    let largest = per_transaction.iter().max().copied().unwrap_or(0);
    assert!(largest <= 16, "no statement carries more than 16 MiB of values: {largest} MiB");
    assert!(largest > 1, "queued writes shared statements: {per_transaction:?}");
}

/// Queues `count` writes of `value_size` bytes each behind a stalled statement, releases them,
/// checks that every one committed, and returns how many rows each transaction wrote.
async fn queue_and_count(prefix: &str, count: u32, value_size: usize) -> Vec<usize> {
    let table = common::table(prefix);
    let store = open_serial(&table).await;
    let stall = stall(&store, &table).await;
    let queued: Vec<_> = (0..count)
        .map(|i| {
            let value = i.to_be_bytes().repeat(value_size / 4);
            tokio::spawn(store.write(NS, SUB, &format!("k{i}"), value))
        })
        .collect();
    for result in stall.release(queued).await {
        result.unwrap();
    }
    let rows = writers_of(&table).await;
    assert_eq!(rows.len(), count as usize + 1, "every queued write committed");
    let mut per_transaction: BTreeMap<&String, usize> = BTreeMap::new();
    for xmin in rows.values() {
        *per_transaction.entry(xmin).or_default() += 1;
    }
    store.close().await.unwrap();
    per_transaction.into_values().collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_write_fails_alone_and_its_group_commits() {
    let table = common::table("coal_err");
    let store = open_serial(&table).await;
    common::refuse_key(&table, "poison").await;

    let stall = stall(&store, &table).await;
    let queued = ["good_a", "poison", "good_b"]
        .map(|key| tokio::spawn(store.write(NS, SUB, key, key.as_bytes().to_vec())));
    let [good_a, poison, good_b] =
        <[_; 3]>::try_from(stall.release(queued.into()).await).expect("three results");
    good_a.unwrap();
    good_b.unwrap();
    let err = poison.unwrap_err();
    assert!(matches!(err, Error::Database { .. }), "the refused write's own error: {err:?}");
    let message = format!("{:?}", err);
    assert!(message.contains("poison refused"), "carries the trigger's message: {message}");

    assert_eq!(store.read(NS, SUB, "good_a").await.unwrap(), b"good_a");
    assert_eq!(store.read(NS, SUB, "good_b").await.unwrap(), b"good_b");
    assert!(store.read(NS, SUB, "poison").await.unwrap_err().is_not_found());
    assert!(matches!(*store.lease_state().borrow(), pgfence::LeaseState::Held { .. }));
    store.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_writes_fail_closed_when_the_lease_expires_meanwhile() {
    let table = common::table("coal_lost");
    let store = open_serial(&table).await;
    let stall = stall(&store, &table).await;
    let queued: Vec<_> =
        (0..3).map(|i| tokio::spawn(store.write(NS, SUB, &format!("q{i}"), vec![i]))).collect();
    // Expire the lease in the database. Changing only expires_at does not wait for the blocked
    // statement, which checked the lease before it blocked and so still commits.
    common::admin()
        .await
        .execute(
            &format!(
                "UPDATE {} SET expires_at = clock_timestamp() - interval '1 second'",
                common::lease_table(&table)
            ),
            &[],
        )
        .await
        .unwrap();
    for result in stall.release(queued).await {
        let err = result.unwrap_err();
        assert!(matches!(err, Error::LeaseLost { .. }), "fenced: {err:?}");
    }
    let rows = writers_of(&table).await;
    assert_eq!(rows.keys().collect::<Vec<_>>(), ["blocker"], "nothing queued was written");
    assert!(matches!(
        store.write(NS, SUB, "later", vec![]).await.unwrap_err(),
        Error::LeaseLost { .. }
    ));
}

/// Atomic batches do not queue for a statement: with the only single-key statement allowed
/// stuck, a batch still commits at once, on its own connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn atomic_batches_do_not_queue_behind_busy_statements() {
    let table = common::table("coal_batch");
    let store = open_serial(&table).await;
    let stall = stall(&store, &table).await;
    let batch = store.batch().put(NS, SUB, "b1", b"1".to_vec()).put(NS, SUB, "b2", b"2".to_vec());
    within("the batch, beside the stuck statement", batch.commit()).await.unwrap();
    assert!(!stall.first.is_finished(), "the single-key statement was still stuck");
    assert_eq!(store.read(NS, SUB, "b2").await.unwrap(), b"2");
    assert!(stall.release(Vec::new()).await.is_empty());
    store.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn coalesced_calls_keep_per_key_call_order() {
    let table = common::table("coal_ord");
    let store = common::builder(&table).write_concurrency(2).open().await.unwrap();
    for round in 0..5u32 {
        // 400 calls over 8 keys, every fifth a remove, polled in random order, all at once:
        // most of them queue and share statements.
        let mut expected: BTreeMap<String, Option<Vec<u8>>> = BTreeMap::new();
        let mut calls = Vec::new();
        for i in 0..400u32 {
            let key = format!("k{}", i % 8);
            let value = (round * 1000 + i).to_be_bytes().to_vec();
            if i % 5 == 4 {
                calls.push(boxed(store.remove(NS, SUB, &key, false)));
                expected.insert(key, None);
            } else {
                calls.push(boxed(store.write(NS, SUB, &key, value.clone())));
                expected.insert(key, Some(value));
            }
        }
        calls.shuffle(&mut rand::rng());
        let handles: Vec<_> = calls.into_iter().map(tokio::spawn).collect();
        for h in handles {
            within("call", h).await.unwrap().unwrap();
        }
        for (key, want) in &expected {
            let got = match store.read(NS, SUB, key).await {
                Ok(v) => Some(v),
                Err(e) if e.is_not_found() => None,
                Err(e) => panic!("read {key}: {e}"),
            };
            assert_eq!(&got, want, "round {round}, {key}: the last call's state");
        }
    }
    store.close().await.unwrap();
}

/// docs/design.md, "Many concurrent writes": "the next statement to start takes the oldest queued
/// [...], sorted by key, as one fenced batch statement". Observable in the rows it creates:
/// the batch statement inserts its rows in the order of its arrays, and each new row takes the
/// next value of the table's creation sequence (`created_seq`, which orders
/// `list_paginated`). Five new keys called in descending order share one statement, and their
/// creation order is the keys' order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shared_statement_writes_its_mutations_in_key_order() {
    let table = common::table("coal_sort");
    let store = open_serial(&table).await;
    let stall = stall(&store, &table).await;
    let called = ["k4", "k3", "k2", "k1", "k0"];
    let queued = called.map(|key| tokio::spawn(store.write(NS, SUB, key, key.as_bytes().to_vec())));
    for result in stall.release(queued.into()).await {
        result.unwrap();
    }
    let rows = writers_of(&table).await;
    let xmins: Vec<&String> = called.iter().map(|key| &rows[*key]).collect();
    assert!(xmins.iter().all(|x| *x == xmins[0]), "one statement wrote all five: {xmins:?}");
    let sql = format!("SELECT key FROM \"{table}\" WHERE key <> 'blocker' ORDER BY created_seq");
    let created: Vec<String> = common::admin()
        .await
        .query(&sql, &[])
        .await
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect();
    assert_eq!(created, ["k0", "k1", "k2", "k3", "k4"], "created in key order, not call order");
    store.close().await.unwrap();
}

/// docs/design.md, "Statement timeouts":
/// "A write whose shared statement (see "Many concurrent writes") is
/// cancelled this way runs again on its own, so it can be cancelled twice before its caller
/// gets the error." With `statement_timeout` in the connection's options, a write whose
/// statement sleeps (a trigger, for the key `slow` only) shares a statement with two others;
/// PostgreSQL cancels that statement, each of the three runs again on its own, the two others
/// commit, and `slow` is cancelled a second time, alone, before its caller gets the
/// cancellation. The trigger counts its runs in sequences (which a rollback does not undo),
/// one for the shared statement (the batch, with `unnest`) and one for the write's own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_in_a_cancelled_shared_statement_is_cancelled_again_alone() {
    let table = common::table("coal_cancel");
    let mut config = common::server().config();
    // Longer than the stall below needs to queue its writes; short enough to wait out twice.
    config.options("-c statement_timeout=3000");
    let store = PgKvStore::builder_from_config(config)
        .table(&table)
        .pool_size(2)
        .lease_ttl(Duration::from_secs(15))
        .renew_interval(Duration::from_secs(3))
        .write_concurrency(1)
        .open()
        .await
        .unwrap();
    common::admin()
        .await
        .batch_execute(&format!(
            "CREATE SEQUENCE \"{table}_shared\"; CREATE SEQUENCE \"{table}_alone\";
             CREATE FUNCTION \"{table}_slow\"() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN
                 IF NEW.key = 'slow' THEN
                     IF current_query() LIKE '%unnest%' THEN
                         PERFORM nextval('\"{table}_shared\"');
                     ELSE
                         PERFORM nextval('\"{table}_alone\"');
                     END IF;
                     PERFORM pg_sleep(60);
                 END IF;
                 RETURN NEW;
             END $$;
             CREATE TRIGGER slow BEFORE INSERT ON \"{table}\"
                 FOR EACH ROW EXECUTE FUNCTION \"{table}_slow\"();"
        ))
        .await
        .unwrap();

    let stall = stall(&store, &table).await;
    let queued = ["a", "slow", "z"]
        .map(|key| tokio::spawn(store.write(NS, SUB, key, key.as_bytes().to_vec())));
    let [a, slow, z] =
        <[_; 3]>::try_from(stall.release(queued.into()).await).expect("three results");
    a.unwrap();
    z.unwrap();
    let e = slow.unwrap_err();
    let canceled = matches!(&e, Error::Database { source, .. }
        if source.code() == Some(&tokio_postgres::error::SqlState::QUERY_CANCELED));
    assert!(canceled, "the caller gets the cancellation: {e:?}");

    let runs = format!(
        "SELECT (SELECT last_value FROM \"{table}_shared\" WHERE is_called),
                (SELECT last_value FROM \"{table}_alone\" WHERE is_called)"
    );
    let row = common::admin().await.query_one(&runs, &[]).await.unwrap();
    let (shared, alone): (Option<i64>, Option<i64>) = (row.get(0), row.get(1));
    assert_eq!((shared, alone), (Some(1), Some(1)), "cancelled once shared, once alone");
    assert_eq!(store.read(NS, SUB, "a").await.unwrap(), b"a");
    assert!(store.read(NS, SUB, "slow").await.unwrap_err().is_not_found());
    assert!(matches!(*store.lease_state().borrow(), pgfence::LeaseState::Held { .. }));
    store.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn zero_write_concurrency_is_refused() {
    let err = common::builder(&common::table("coal_cfg")).write_concurrency(0).open().await;
    assert!(matches!(err, Err(Error::InvalidConfig { field: "write_concurrency", .. })), "{err:?}");
}

fn boxed(
    f: impl std::future::Future<Output = pgfence::Result<()>> + Send + 'static,
) -> std::pin::Pin<Box<dyn std::future::Future<Output = pgfence::Result<()>> + Send>> {
    Box::pin(f)
}

/// `write_concurrency` bounds the single-key write statements that run at once, also when a
/// shared statement fails and each of its mutations runs again alone (the re-runs take a
/// statement too). Every statement here blocks on an administrator's row locks until the
/// server cancels it (`statement_timeout`), and the test counts the store's statements that
/// the server shows running, throughout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn re_runs_of_a_failed_shared_statement_stay_within_write_concurrency() {
    let table = common::table("coal_bound");
    let app = table.clone();
    let mut config = common::server().config();
    // Long enough for the queue to form behind the first statement; each statement waits it out.
    config.options("-c statement_timeout=1000");
    let store = PgKvStore::builder_from_config(config)
        .table(&table)
        .application_name(&app)
        .pool_size(8)
        .lease_ttl(Duration::from_secs(30))
        .renew_interval(Duration::from_secs(5))
        .write_concurrency(1)
        .open()
        .await
        .unwrap();
    let keys: Vec<String> = (0..8).map(|i| format!("k{i}")).collect();
    for key in &keys {
        store.write(NS, SUB, key, b"0".to_vec()).await.unwrap();
    }
    let mut locker = common::admin().await;
    let tx = locker.transaction().await.unwrap();
    let lock = format!("SELECT key FROM \"{table}\" WHERE key = ANY($1) FOR UPDATE");
    assert_eq!(tx.query(&lock, &[&keys]).await.unwrap().len(), keys.len(), "every row locked");

    let (stop, mut stopped) = tokio::sync::oneshot::channel::<()>();
    let pattern = format!("%\"{table}\"%");
    let monitor = tokio::spawn(async move {
        let db = common::admin().await;
        let sql = "SELECT count(*) FROM pg_stat_activity
                    WHERE application_name = $1 AND state = 'active' AND query LIKE $2";
        let app = format!("pgfence {app}");
        let mut most = 0;
        loop {
            let running: i64 = db.query_one(sql, &[&app, &pattern]).await.unwrap().get(0);
            most = most.max(running);
            tokio::select! {
                _ = &mut stopped => return most,
                () = tokio::time::sleep(Duration::from_millis(10)) => {}
            }
        }
    });

    // The first write takes the one statement and blocks; the others queue behind it, share
    // the next statement, which blocks and is cancelled too, and then run again alone.
    let first = tokio::spawn(store.write(NS, SUB, &keys[0], b"1".to_vec()));
    common::wait_for_query_lock_wait(&format!("%\"{table}\"%")).await;
    let queued: Vec<Call> = keys[1..]
        .iter()
        .map(|key| tokio::spawn(store.write(NS, SUB, key, b"1".to_vec())))
        .collect();
    for call in std::iter::once(first).chain(queued) {
        let e = within("a blocked write", call).await.unwrap().unwrap_err();
        let canceled = matches!(&e, Error::Database { source, .. }
            if source.code() == Some(&tokio_postgres::error::SqlState::QUERY_CANCELED));
        assert!(canceled, "each write gets its own cancellation: {e:?}");
    }
    stop.send(()).unwrap();
    let most = within("the monitor", monitor).await.unwrap();
    tx.rollback().await.unwrap();
    assert!(most >= 1, "the monitor saw the store's statements run");
    assert_eq!(most, 1, "at most write_concurrency (1) write statements ran at once");
    assert!(matches!(*store.lease_state().borrow(), pgfence::LeaseState::Held { .. }));
    store.close().await.unwrap();
}

/// A queued write holds little more than its value: the state of a running statement (pool,
/// driver, retries) is boxed when the statement runs. Before, each `write` future embedded it,
/// about 11.5 KB in a release build. 100,000 queued writes held one each, and as much again in
/// the store's task for each (see BENCHMARKS.md, "Memory of queued writes").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_future_is_small() {
    let table = common::table("coal_size");
    let store = common::builder(&table).open().await.expect("open store");
    let write = store.write(NS, SUB, "k", vec![1]);
    let remove = store.remove(NS, SUB, "k", false);
    let sizes = (std::mem::size_of_val(&write), std::mem::size_of_val(&remove));
    assert!(sizes.0 <= 4096 && sizes.1 <= 4096, "write and remove futures: {sizes:?} bytes");
    write.await.unwrap();
    remove.await.unwrap();
    store.close().await.unwrap();
}
