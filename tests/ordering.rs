//! Per-key order is fixed when `write`/`remove` are called, not when their futures run.

mod common;

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
