//! The bound on queued bytes (`Builder::max_queued_bytes`): behind a slow server, further
//! writes wait for room instead of piling up, and every key still ends at its last call.

use crate::common;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use common::within;
use pgfence::{Error, PgKvStore};
use pgfence_testing::Proxy;
use rand::seq::SliceRandom;

const NS: &str = "ns";
const SUB: &str = "sub";

/// A store on `table` whose every round trip is delayed by the returned proxy.
async fn open_slow(table: &str, bound: usize) -> (PgKvStore, Proxy) {
    let server = common::server();
    let proxy = Proxy::start(server.tcp_addr().expect("server address")).await.expect("proxy");
    let store = PgKvStore::builder_from_config(server.config_via(proxy.addr()))
        .table(table)
        .pool_size(4)
        .lease_ttl(Duration::from_secs(15))
        .renew_interval(Duration::from_secs(3))
        .max_queued_bytes(bound)
        .open()
        .await
        .expect("open store");
    proxy.set_delay(Duration::from_millis(10));
    (store, proxy)
}

/// Samples `store.queued_bytes()` every millisecond until stopped; returns the largest seen.
fn sample_peak(store: &PgKvStore) -> (Arc<AtomicBool>, tokio::task::JoinHandle<usize>) {
    let (store, stop) = (store.clone(), Arc::new(AtomicBool::new(false)));
    let stopped = Arc::clone(&stop);
    let sampler = tokio::spawn(async move {
        let peak = AtomicUsize::new(0);
        while !stopped.load(Ordering::SeqCst) {
            peak.fetch_max(store.queued_bytes(), Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        peak.into_inner()
    });
    (stop, sampler)
}

/// 400 writes of 4 KiB (16 times the bound in all), ten calls per key, polled in a random
/// order. The bytes in flight never exceed the bound but do fill it. Every call succeeds, and
/// every key holds its last call's value: waiting for room reorders no key's writes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_bytes_stay_within_the_bound_and_keys_keep_their_order() {
    const BOUND: usize = 100 * 1024;
    let t = common::table("bpres");
    let (store, _proxy) = open_slow(&t, BOUND).await;
    let mut calls = Vec::new();
    let mut last = BTreeMap::new();
    for version in 0..10u8 {
        for key in 0..40 {
            let key = format!("k{key:02}");
            let value = vec![version; 4096];
            calls.push(store.write(NS, SUB, &key, value.clone()));
            last.insert(key, value);
        }
    }
    let written: usize = calls.len() * (4096 + NS.len() + SUB.len() + 3);
    assert!(written > 16 * BOUND, "the writes must not fit under the bound at once");
    calls.shuffle(&mut rand::rng());
    let (stop, sampler) = sample_peak(&store);
    let tasks: Vec<_> = calls.into_iter().map(tokio::spawn).collect();
    for task in tasks {
        within("a queued write", task).await.unwrap().expect("every write succeeds");
    }
    stop.store(true, Ordering::SeqCst);
    let peak = sampler.await.unwrap();
    assert_eq!(store.queued_bytes(), 0, "nothing stays reserved");
    assert!(peak <= BOUND, "queued bytes peaked at {peak}, above the bound {BOUND}");
    assert!(peak > BOUND / 2, "queued bytes peaked at {peak}: the bound {BOUND} was never filled");
    let rows: BTreeMap<String, Vec<u8>> = common::all_rows(&t).await.into_iter().collect();
    assert_eq!(rows, last, "every key holds the value of its last call");
    store.close().await.unwrap();
}

/// A write larger than the whole bound is not refused: it waits for the calls before it,
/// runs alone, and the calls after it wait for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_larger_than_the_bound_runs_alone() {
    const BOUND: usize = 8 * 1024;
    let t = common::table("bpbig");
    let (store, _proxy) = open_slow(&t, BOUND).await;
    let big = vec![7u8; 20 * BOUND];
    let before: Vec<_> = (0..8)
        .map(|i| tokio::spawn(store.write(NS, SUB, &format!("a{i}"), vec![1; 1024])))
        .collect();
    let large = tokio::spawn(store.write(NS, SUB, "big", big.clone()));
    let (stop, sampler) = sample_peak(&store);
    let after: Vec<_> = (0..8)
        .map(|i| tokio::spawn(store.write(NS, SUB, &format!("b{i}"), vec![2; 1024])))
        .collect();
    for task in before.into_iter().chain([large]).chain(after) {
        within("a write", task).await.unwrap().expect("every write succeeds");
    }
    stop.store(true, Ordering::SeqCst);
    let peak = sampler.await.unwrap();
    let alone = big.len() + NS.len() + SUB.len() + 3;
    assert!(peak <= alone, "queued bytes peaked at {peak}: the large write did not run alone");
    assert_eq!(store.read(NS, SUB, "big").await.unwrap(), big);
    assert_eq!(common::all_rows(&t).await.len(), 17);
    store.close().await.unwrap();
}

#[tokio::test]
async fn a_bound_of_zero_is_refused() {
    let t = common::table("bpzero");
    let err = common::builder(&t).max_queued_bytes(0).open().await.unwrap_err();
    assert!(
        matches!(&err, Error::InvalidConfig { field: "max_queued_bytes", .. }),
        "unexpected error: {err:?}"
    );
}
