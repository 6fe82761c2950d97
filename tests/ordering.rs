//! Per-key order is fixed when `write`/`remove` are called, not when their futures run.

mod common;

use pgfence::Error;
use rand::seq::SliceRandom;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thousand_writes_awaited_in_random_order_last_issued_wins() {
    let store = common::open(&common::table("ord")).await;
    let mut futures: Vec<_> = (0..1000u32)
        .map(|i| (i, store.write("ord", "sub", "k", i.to_be_bytes().to_vec())))
        .collect();
    futures.shuffle(&mut rand::rng());
    // Await them in random order, some concurrently, some one by one.
    let mut joins = Vec::new();
    for (n, (_, fut)) in futures.into_iter().enumerate() {
        if n % 2 == 0 {
            joins.push(tokio::spawn(fut));
        } else {
            fut.await.unwrap();
        }
    }
    for j in joins {
        j.await.unwrap().unwrap();
    }
    let value = store.read("ord", "sub", "k").await.unwrap();
    assert_eq!(value, 999u32.to_be_bytes().to_vec(), "the last call's value wins");
    store.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn interleaved_writes_and_removes_end_in_the_last_calls_state() {
    let store = common::open(&common::table("ordrm")).await;
    for round in 0..20u32 {
        let key = format!("k{round}");
        // Alternate write/remove; the last call is a remove on even rounds, a write on odd.
        let calls = 10 + (round % 2);
        let mut futures = Vec::new();
        for c in 0..calls {
            futures.push(if c % 2 == 0 {
                futures_box(store.write("ordrm", "s", &key, vec![c as u8]))
            } else {
                futures_box(store.remove("ordrm", "s", &key, false))
            });
        }
        futures.reverse(); // Poll the latest call first: the worst case for ordering.
        let handles: Vec<_> = futures.into_iter().map(tokio::spawn).collect();
        for h in handles {
            h.await.unwrap().unwrap();
        }
        let last = calls - 1;
        let got = store.read("ordrm", "s", &key).await;
        if last % 2 == 0 {
            assert_eq!(got.unwrap(), vec![last as u8], "round {round}: last call was a write");
        } else {
            assert!(got.unwrap_err().is_not_found(), "round {round}: last call was a remove");
        }
    }
    store.close().await.unwrap();
}

fn futures_box(
    f: impl std::future::Future<Output = pgfence::Result<()>> + Send + 'static,
) -> std::pin::Pin<Box<dyn std::future::Future<Output = pgfence::Result<()>> + Send>> {
    Box::pin(f)
}

/// A call superseded by a later call of its key skips the database, but once the store has lost
/// its lease it must still fail (fail closed: every key operation returns `LeaseLost`,
/// permanently), as an all-superseded batch does. `Ok` would tell the caller that its change or
/// its own later one stands, when a successor may already have overwritten the key.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn superseded_calls_fail_closed_after_the_lease_is_lost() {
    let table = common::table("ordlost");
    let store = common::open(&table).await;
    // Calls, in this order; only the last one is awaited before the loss.
    let earlier_write = store.write("o", "s", "k", b"earlier".to_vec());
    let earlier_remove = store.remove("o", "s", "k", false);
    let earlier_batch = store.batch().put("o", "s", "k", b"batch".to_vec()).commit();
    store.write("o", "s", "k", b"later".to_vec()).await.unwrap();

    let admin = common::admin().await;
    common::steal_lease(&admin, &table).await;
    let found = store.write("o", "s", "other", vec![]).await.unwrap_err();
    assert!(found.is_lease_lost(), "the write after the takeover is fenced: {found:?}");

    let write = common::within("superseded write", earlier_write).await;
    assert!(matches!(write, Err(Error::LeaseLost { .. })), "superseded write: {write:?}");
    let remove = common::within("superseded remove", earlier_remove).await;
    assert!(matches!(remove, Err(Error::LeaseLost { .. })), "superseded remove: {remove:?}");
    let batch = common::within("superseded batch", earlier_batch).await;
    assert!(matches!(batch, Err(Error::LeaseLost { .. })), "superseded batch: {batch:?}");
}
