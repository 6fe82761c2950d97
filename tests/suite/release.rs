//! Release: close, drop, outstanding futures, stale stores, and drop in every runtime context.

use crate::common;

use std::pin::Pin;
use std::task::Poll;
use std::time::{Duration, Instant};

use common::{admin, builder, lease_row, steal_lease, table, within};
use pgfence::{Error, LeaseState, PgKvStore};

/// Generous bound for a drop: the default drop timeout is 5 s; this only catches hangs.
const DROP_BOUND: Duration = Duration::from_secs(20);

/// A TTL far longer than any test: an open that succeeds soon after a release proves the
/// release, not an expiry.
fn long_lease(t: &str) -> pgfence::Builder {
    builder(t).lease_ttl(Duration::from_secs(600)).renew_interval(Duration::from_secs(60))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn after_drop_another_store_opens_at_once() {
    let t = table("dropopen");
    let a = long_lease(&t).open().await.unwrap();
    a.write("d", "s", "k", b"a".to_vec()).await.unwrap();
    drop(a);
    let b = long_lease(&t).open().await.expect("no TTL wait after drop");
    assert_eq!(b.fencing_token(), 2);
    assert_eq!(b.read("d", "s", "k").await.unwrap(), b"a");
    b.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_releases_and_later_calls_get_closed() {
    let t = table("close");
    let a = long_lease(&t).open().await.unwrap();
    let mut state = a.lease_state();
    // Created before close, polled after it: refused too, and nothing is written.
    let (unpolled_write, unpolled_remove) =
        (a.write("c", "s", "early", vec![]), a.remove("c", "s", "early", false));
    a.close().await.expect("close returns the release result");
    assert!(matches!(unpolled_write.await, Err(Error::Closed)));
    assert!(matches!(unpolled_remove.await, Err(Error::Closed)));
    let rows: i64 = admin()
        .await
        .query_one(&format!("SELECT count(*) FROM \"{t}\""), &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(rows, 0);
    assert_eq!(*state.borrow_and_update(), LeaseState::Released { epoch: 1 });
    let (_, epoch, expires_in_ms) = lease_row(&admin().await, &t).await;
    assert_eq!(epoch, 1, "the epoch counter is kept");
    assert!(expires_in_ms <= 0, "released: expired now");
    assert!(matches!(a.write("c", "s", "k", vec![]).await, Err(Error::Closed)));
    assert!(matches!(a.read("c", "s", "k").await, Err(Error::Closed)));
    a.close().await.expect("closing twice is Ok");
    let b = long_lease(&t).open().await.unwrap();
    assert_eq!(b.fencing_token(), 2);
    b.close().await.unwrap();
}

/// `close()` lets the operations that have started finish (within `drop_timeout`, 5 s by
/// default): a write whose statement is running, a write of another key queued for a shared
/// statement (one statement at a time here), and a later write of the same key waiting for its
/// turn. An operation first polled after `close()` began gets `Closed` at once. Then `close()`
/// releases and returns `Ok`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_waits_for_started_operations_then_releases() {
    let t = table("closewait");
    let store = long_lease(&t).write_concurrency(1).open().await.unwrap();
    let mut blocker = admin().await;
    let (tx, running) = common::write_waiting_for_a_row_lock(&store, &t, &mut blocker).await;
    // Polled once each: started (admitted), then waiting.
    let mut queued = Box::pin(store.write("f", "s", "k2", b"queued".to_vec()));
    let mut same_key = Box::pin(store.write("f", "s", "k", b"same key, later".to_vec()));
    assert!(
        poll_once(&mut queued).await.is_pending() && poll_once(&mut same_key).await.is_pending()
    );
    let (queued, same_key) = (tokio::spawn(queued), tokio::spawn(same_key));

    let mut closing = Box::pin(store.close());
    assert!(poll_once(&mut closing).await.is_pending(), "close waits for the running writes");
    let late = store.write("f", "s", "k3", b"late".to_vec());
    assert!(matches!(within("late write", late).await, Err(Error::Closed)));
    tx.rollback().await.unwrap();
    within("running write", running).await.unwrap().expect("the running write commits");
    within("queued write", queued).await.unwrap().expect("the queued write commits");
    within("same-key write", same_key).await.unwrap().expect("the later same-key write commits");
    within("close", closing).await.expect("then close releases and returns Ok");
    assert_eq!(*store.lease_state().borrow(), LeaseState::Released { epoch: 1 });
    let rows = common::all_rows(&t).await;
    let expected = [("k", &b"same key, later"[..]), ("k2", &b"queued"[..])];
    let expected: Vec<(String, Vec<u8>)> =
        expected.iter().map(|(k, v)| (k.to_string(), v.to_vec())).collect();
    assert_eq!(rows, expected);
}

/// When `close()` stops waiting (`drop_timeout`) with a write still queued for a statement,
/// that write gets `Closed` once it runs (nothing of it is written: the lease is released),
/// not an error of the connection pool that `close()` closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_still_queued_when_close_gives_up_gets_closed() {
    let t = table("closequeued");
    let store = long_lease(&t)
        .write_concurrency(1)
        .drop_timeout(Duration::from_millis(300))
        .open()
        .await
        .unwrap();
    let mut blocker = admin().await;
    let (tx, running) = common::write_waiting_for_a_row_lock(&store, &t, &mut blocker).await;
    let mut queued = Box::pin(store.write("f", "s", "k2", b"queued".to_vec()));
    assert!(poll_once(&mut queued).await.is_pending(), "admitted, and waiting for a statement");
    let queued = tokio::spawn(queued);

    let closed = within("close", store.close()).await;
    assert!(matches!(closed, Err(Error::Timeout { .. })), "{closed:?}");
    assert_eq!(*store.lease_state().borrow(), LeaseState::Released { epoch: 1 });
    tx.rollback().await.unwrap();
    // The running write had locked the lease row before the release: it may commit, and does.
    within("running write", running).await.unwrap().expect("the running write commits");
    let queued = within("queued write", queued).await.unwrap();
    assert!(matches!(queued, Err(Error::Closed)), "{queued:?}");
    let rows = common::all_rows(&t).await;
    assert_eq!(rows, [("k".to_owned(), b"in-flight".to_vec())]);
}

/// Polls `fut` once.
async fn poll_once<F: Future + Unpin>(fut: &mut F) -> Poll<F::Output> {
    std::future::poll_fn(|cx| Poll::Ready(Pin::new(&mut *fut).poll(cx))).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_a_taken_over_store_leaves_the_successors_lease_alone() {
    let t = table("dropstale");
    let a = long_lease(&t).open().await.unwrap();
    let db = admin().await;
    steal_lease(&db, &t).await;
    let (owner, epoch, expires_in_ms) = lease_row(&db, &t).await;
    drop(a);
    let after = lease_row(&db, &t).await;
    assert_eq!((after.0, after.1), (owner, epoch), "the successor still owns it");
    assert!(after.2 > 0 && expires_in_ms > 0, "and it is not expired");
}

/// A write future created before the drop completes after it, and the release comes after
/// the write: the future keeps the lease (and its renewal) alive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outstanding_write_completes_after_drop_and_release_follows_it() {
    let t = table("outlive");
    let a = long_lease(&t).open().await.unwrap();
    let owner = a.owner_id();
    let write = a.write("o", "s", "k", b"after-drop".to_vec());
    let remove = a.remove("o", "s", "gone", false);
    drop(a);
    let db = admin().await;
    let (held_by, _, expires_in_ms) = lease_row(&db, &t).await;
    assert_eq!(held_by, owner);
    assert!(expires_in_ms > 0, "not released while a future is outstanding");
    within("write after drop", write).await.expect("write after drop");
    // The remove future still holds the store: still not released.
    assert!(lease_row(&db, &t).await.2 > 0, "not released while the remove is outstanding");
    within("remove after drop", remove).await.expect("remove after drop");
    // The last future finished: the release has happened (bounded wait inside its drop).
    let (_, _, expires_in_ms) = lease_row(&db, &t).await;
    assert!(expires_in_ms <= 0, "released after the last outstanding future");
    let value: Vec<u8> = db
        .query_one(&format!("SELECT value FROM \"{t}\" WHERE key = 'k'"), &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(value, b"after-drop");
}

async fn assert_released(t: &str) {
    let (_, _, expires_in_ms) = lease_row(&admin().await, t).await;
    assert!(expires_in_ms <= 0, "dropped store released its lease");
}

/// An outstanding write keeps the lease renewed after the last handle is dropped, not only
/// held: one that waits (for a row lock) from the drop until well past the local deadline is
/// renewed meanwhile (seen in the database), commits and returns `Ok`; the release follows it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn outstanding_write_keeps_the_lease_renewed_past_the_local_deadline() {
    let t = table("outlivedl");
    let store = builder(&t)
        .lease_ttl(Duration::from_secs(60))
        .local_deadline(Duration::from_secs(2))
        .renew_interval(Duration::from_millis(500))
        .open()
        .await
        .unwrap();
    let mut blocker = admin().await;
    let (tx, write) = common::write_waiting_for_a_row_lock(&store, &t, &mut blocker).await;
    drop(store);

    let db = admin().await;
    let expiry =
        format!("SELECT extract(epoch FROM expires_at)::float8 FROM {}", common::lease_table(&t));
    let at_drop: f64 = db.query_one(&expiry, &[]).await.unwrap().get(0);
    within("renewals for twice the local deadline after the drop", async {
        while db.query_one(&expiry, &[]).await.unwrap().get::<_, f64>(0) < at_drop + 4.0 {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    assert!(!write.is_finished(), "the write still waits for the row lock");
    tx.rollback().await.unwrap();
    within("the outstanding write", write).await.unwrap().expect("committed under the lease");
    let sql = format!("SELECT value FROM \"{t}\" WHERE key = 'k'");
    assert_eq!(db.query_one(&sql, &[]).await.unwrap().get::<_, Vec<u8>>(0), b"in-flight");
    within("the release after the last future", async {
        while lease_row(&db, &t).await.2 > 0 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drop_inside_multi_thread_runtime_is_bounded() {
    let t = table("dropmt");
    let a = long_lease(&t).open().await.unwrap();
    a.write("d", "s", "k", vec![1]).await.unwrap();
    let started = Instant::now();
    drop(a);
    assert!(started.elapsed() < DROP_BOUND);
    assert_released(&t).await;
}

#[tokio::test(flavor = "current_thread")]
async fn drop_inside_current_thread_runtime_is_bounded() {
    let t = table("dropct");
    let a = long_lease(&t).open().await.unwrap();
    a.write("d", "s", "k", vec![1]).await.unwrap();
    let started = Instant::now();
    drop(a); // Must not wait on this (blocked) runtime's own I/O.
    assert!(started.elapsed() < DROP_BOUND);
    assert_released(&t).await;
}

#[test]
fn drop_outside_any_runtime_is_bounded() {
    let t = table("dropnort");
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let a: PgKvStore = runtime.block_on(async {
        let a = long_lease(&t).open().await.unwrap();
        a.write("d", "s", "k", vec![1]).await.unwrap();
        a
    });
    // The runtime the store was opened on is gone; the drop happens on a plain thread.
    drop(runtime);
    let started = Instant::now();
    drop(a);
    assert!(started.elapsed() < DROP_BOUND);
    tokio::runtime::Runtime::new().unwrap().block_on(assert_released(&t));
}

/// With the database gone, a drop still returns within its timeout (and never panics).
#[test]
fn drop_with_the_database_unreachable_is_bounded() {
    let cluster = pgfence_testing::TestCluster::start().expect("private cluster");
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let a = runtime.block_on(async {
        PgKvStore::builder_from_config(cluster.config())
            .table("kv")
            .pool_size(1)
            .lease_ttl(Duration::from_secs(600))
            .renew_interval(Duration::from_secs(60))
            .drop_timeout(Duration::from_secs(2))
            .open()
            .await
            .unwrap()
    });
    cluster.stop().unwrap();
    let started = Instant::now();
    runtime.block_on(async move { drop(a) });
    assert!(started.elapsed() < DROP_BOUND, "{:?}", started.elapsed());
}

/// A `drop_timeout` too short for any release (below 100 ms) is refused by `open()`
/// (`InvalidConfig`), before any statement runs: `close()` could never release the lease and
/// a standby would wait out the TTL. 100 ms opens, and closing it releases the lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drop_timeout_below_100_ms_is_refused() {
    let t = table("droptime");
    for timeout in [Duration::ZERO, Duration::from_nanos(1), Duration::from_millis(99)] {
        let e = long_lease(&t).drop_timeout(timeout).open().await.unwrap_err();
        assert!(matches!(e, Error::InvalidConfig { field: "drop_timeout", .. }), "{e:?}");
    }
    assert!(!common::table_exists(&admin().await, &t).await, "no statement ran");
    let store = long_lease(&t).drop_timeout(Duration::from_millis(100)).open().await.unwrap();
    // Whether the release fits in 100 ms depends on the machine's load, so either outcome
    // passes, as long as close() says which one it was.
    let closed = store.close().await;
    let (_, _, ms_left) = lease_row(&admin().await, &t).await;
    match closed {
        Ok(()) => assert!(ms_left <= 0, "close() said released, yet {ms_left} ms are left"),
        Err(Error::Timeout { .. }) => {}
        Err(e) => panic!("close() failed otherwise than by its 100 ms bound: {e:?}"),
    }
}
