//! `PgKvStore::stats()`: each figure moves when, and only when, what it counts happens.

use crate::common;

use std::time::Duration;

use common::{admin, builder, steal_lease, table, within};
use pgfence::{LeaseState, LossReason, PgKvStore, Stats};
use pgfence_testing::Proxy;

/// The operation counts of a snapshot: writes, removes, batches, reads, lists.
fn counts(stats: &Stats) -> [u64; 5] {
    [
        stats.writes.count,
        stats.removes.count,
        stats.batches.count,
        stats.reads.count,
        stats.lists.count,
    ]
}

/// Each kind of operation bumps its own count and latency histogram, and no other. A missing
/// key is an answer, not an error. A fresh store has renewed nothing and failed nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_operation_bumps_its_own_counters() {
    let t = table("stats_ops");
    let store = builder(&t).open().await.unwrap();
    let fresh = store.stats();
    assert_eq!(fresh.table, t);
    assert_eq!(fresh.lease, LeaseState::Held { epoch: store.fencing_token() });
    assert_eq!(fresh.epoch, store.fencing_token());
    assert!(fresh.deadline_in > Duration::ZERO, "{:?}", fresh.deadline_in);
    assert_eq!(counts(&fresh), [0; 5]);
    assert_eq!((fresh.retries, fresh.shared.statements), (0, 0));
    assert_eq!(fresh.fail_closed, Default::default());
    assert!(fresh.pool.max_size >= 1 && fresh.pool.size >= 1, "{:?}", fresh.pool);

    store.write("p", "s", "k", b"v".to_vec()).await.unwrap();
    assert_eq!(counts(&store.stats()), [1, 0, 0, 0, 0]);
    store.remove("p", "s", "k", false).await.unwrap();
    assert_eq!(counts(&store.stats()), [1, 1, 0, 0, 0]);
    store.batch().put("p", "s", "a", b"1".to_vec()).commit().await.unwrap();
    assert_eq!(counts(&store.stats()), [1, 1, 1, 0, 0]);
    store.read("p", "s", "a").await.unwrap();
    let e = store.read("p", "s", "missing").await.unwrap_err();
    assert!(e.is_not_found(), "{e}");
    store.list("p", "s").await.unwrap();
    store.list_paginated("p", "s", None).await.unwrap();
    store.list_all_keys().await.unwrap();
    let after = store.stats();
    assert_eq!(counts(&after), [1, 1, 1, 2, 3]);
    for ops in [&after.writes, &after.removes, &after.batches, &after.reads, &after.lists] {
        assert_eq!(ops.errors, 0, "{ops:?}");
        assert_eq!(ops.latency.count, ops.count, "every one timed: {ops:?}");
        assert!(ops.latency.sum > Duration::ZERO, "{ops:?}");
    }
    assert_eq!(after.fail_closed, Default::default());
    store.close().await.unwrap();
    assert_eq!(store.stats().lease, LeaseState::Released { epoch: store.fencing_token() });
    assert_eq!(store.stats().deadline_in, Duration::ZERO);
}

/// The renewal thread's confirmed renewals are counted and timed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewals_are_counted_and_timed() {
    let t = table("stats_renew");
    let store = builder(&t)
        .lease_ttl(Duration::from_secs(6))
        .renew_interval(Duration::from_millis(500))
        .open()
        .await
        .unwrap();
    assert_eq!(store.stats().renewals.last_latency, None);
    let renewed = async {
        while store.stats().renewals.ok < 3 {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    within("three renewals", renewed).await;
    let renewals = store.stats().renewals;
    assert!(renewals.last_latency.is_some_and(|l| l > Duration::ZERO), "{renewals:?}");
    assert!(renewals.latency.count >= 3, "{renewals:?}");
    assert!(renewals.latency.quantile(0.5).is_some(), "{renewals:?}");
    store.close().await.unwrap();
}

/// Writes beyond `write_concurrency` share statements: counted with their mutations.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_statements_count_their_mutations() {
    let t = table("stats_shared");
    let store = builder(&t).write_concurrency(1).open().await.unwrap();
    // A shared statement needs a statement busy when others arrive: repeat until one was.
    let shared = async {
        let mut round = 0;
        while store.stats().shared.statements == 0 {
            // Spawned: a write's future does nothing until polled.
            let writes: Vec<_> = (0..16)
                .map(|i| tokio::spawn(store.write("p", "s", &format!("k{round}-{i}"), vec![1; 64])))
                .collect();
            for write in writes {
                write.await.unwrap().unwrap();
            }
            round += 1;
        }
    };
    within("a shared statement", shared).await;
    let stats = store.stats();
    assert!(stats.shared.mutations >= 2 * stats.shared.statements, "{:?}", stats.shared);
    assert!(stats.shared.mutations_per_statement().is_some_and(|m| m >= 2.0));
    assert_eq!(stats.writes.errors, 0);
    store.close().await.unwrap();
}

/// A connection cut under a write in flight: the write is retried on a fresh connection and
/// succeeds, and the retry is counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_connection_counts_a_retry() {
    let server = common::server();
    let proxy = Proxy::start(server.tcp_addr().unwrap()).await.unwrap();
    let t = table("stats_retry");
    let store = PgKvStore::builder_from_config(server.config_via(proxy.addr()))
        .table(&t)
        .pool_size(2)
        .lease_ttl(Duration::from_secs(30))
        .renew_interval(Duration::from_secs(10))
        .open()
        .await
        .unwrap();
    store.write("p", "s", "k", b"0".to_vec()).await.unwrap();
    assert_eq!(store.stats().retries, 0);
    // Each round trip takes 400 ms: the cut comes while the write waits for its answer.
    proxy.set_delay(Duration::from_millis(200));
    let write = tokio::spawn(store.write("p", "s", "k", b"1".to_vec()));
    tokio::time::sleep(Duration::from_millis(150)).await;
    proxy.cut_all();
    proxy.set_delay(Duration::ZERO);
    within("the retried write", write).await.unwrap().unwrap();
    let stats = store.stats();
    assert!(stats.retries >= 1, "retries {}", stats.retries);
    assert_eq!((stats.writes.count, stats.writes.errors), (2, 0));
    assert_eq!(stats.lease, LeaseState::Held { epoch: store.fencing_token() });
    assert_eq!(store.read("p", "s", "k").await.unwrap(), b"1");
    store.close().await.unwrap();
}

/// A lease taken over from outside: the next write is fenced. The store records one
/// fail-closed event with that reason and the failed write; later failures add no event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_lease_records_its_reason_once() {
    let t = table("stats_lost");
    // Renewal far off, so the write, not renewal, finds the loss.
    let store = builder(&t)
        .lease_ttl(Duration::from_secs(60))
        .renew_interval(Duration::from_secs(20))
        .open()
        .await
        .unwrap();
    store.write("p", "s", "k", b"v".to_vec()).await.unwrap();
    steal_lease(&admin().await, &t).await;
    let e = store.write("p", "s", "k", b"w".to_vec()).await.unwrap_err();
    assert!(matches!(e, pgfence::Error::LeaseLost { reason: LossReason::Fenced, .. }), "{e}");
    assert!(store.read("p", "s", "k").await.unwrap_err().is_lease_lost());
    let stats = store.stats();
    assert_eq!(stats.fail_closed.fenced, 1);
    assert_eq!(stats.fail_closed.of(&LossReason::TakenOver), 0);
    assert_eq!((stats.writes.count, stats.writes.errors), (2, 1));
    assert_eq!((stats.reads.count, stats.reads.errors), (1, 1));
    assert!(matches!(stats.lease, LeaseState::Lost { reason: LossReason::Fenced, .. }));
    assert_eq!(stats.deadline_in, Duration::ZERO);
    let _ = store.close().await;
}

/// The blocking facade gives the same snapshot.
#[test]
fn the_blocking_store_has_stats_too() {
    let t = table("stats_blocking");
    let store = pgfence::blocking::PgKvStore::open(builder(&t)).unwrap();
    store.write("p", "s", "k", b"v".to_vec()).unwrap();
    let stats = store.stats();
    assert_eq!((stats.writes.count, stats.writes.errors), (1, 0));
    store.close().unwrap();
}

/// With the `metrics` feature, the same recordings reach the application's `metrics` recorder,
/// labelled with the table, and the epoch is a gauge's value, never a label.
#[cfg(feature = "metrics")]
#[test]
fn the_metrics_feature_records_through_the_facade() {
    use std::collections::BTreeMap;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::{Arc, Mutex};

    use metrics::{Counter, Gauge, Key, KeyName, Metadata, SharedString, Unit};

    /// Every sample recorded into a histogram.
    #[derive(Default)]
    struct Samples(Mutex<Vec<f64>>);

    impl metrics::HistogramFn for Samples {
        fn record(&self, value: f64) {
            self.0.lock().unwrap().push(value);
        }
    }

    /// A recorder that keeps every series by its name and labels, for the test to read.
    #[derive(Default)]
    struct Kept {
        counters: Mutex<BTreeMap<String, Arc<AtomicU64>>>,
        gauges: Mutex<BTreeMap<String, Arc<AtomicU64>>>,
        histograms: Mutex<BTreeMap<String, Arc<Samples>>>,
    }

    fn series(key: &Key) -> String {
        let labels: Vec<String> =
            key.labels().map(|l| format!("{}={}", l.key(), l.value())).collect();
        format!("{}{{{}}}", key.name(), labels.join(","))
    }

    impl metrics::Recorder for Kept {
        fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn describe_histogram(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
            let mut counters = self.counters.lock().unwrap();
            Counter::from_arc(Arc::clone(counters.entry(series(key)).or_default()))
        }
        fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
            let mut gauges = self.gauges.lock().unwrap();
            Gauge::from_arc(Arc::clone(gauges.entry(series(key)).or_default()))
        }
        fn register_histogram(&self, key: &Key, _: &Metadata<'_>) -> metrics::Histogram {
            let mut histograms = self.histograms.lock().unwrap();
            metrics::Histogram::from_arc(Arc::clone(histograms.entry(series(key)).or_default()))
        }
    }

    let kept = Kept::default();
    let t = table("stats_metrics");
    // A current-thread runtime: the store registers its series while opening, on this thread,
    // where the local recorder is installed.
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    let store = metrics::with_local_recorder(&kept, || runtime.block_on(builder(&t).open()));
    let store = store.unwrap();
    runtime.block_on(async {
        store.write("p", "s", "k", b"v".to_vec()).await.unwrap();
        store.write("p", "s", "k", b"w".to_vec()).await.unwrap();
        store.read("p", "s", "k").await.unwrap();
    });
    let counter = |name: &str| kept.counters.lock().unwrap()[name].load(Ordering::Relaxed);
    let gauge =
        |name: &str| f64::from_bits(kept.gauges.lock().unwrap()[name].load(Ordering::Relaxed));
    assert_eq!(counter(&format!("pgfence_operations_total{{table={t},op=write}}")), 2);
    assert_eq!(counter(&format!("pgfence_operations_total{{table={t},op=read}}")), 1);
    assert_eq!(counter(&format!("pgfence_operation_errors_total{{table={t},op=write}}")), 0);
    let timed = &kept.histograms.lock().unwrap()
        [&format!("pgfence_operation_duration_seconds{{table={t},op=write}}")];
    assert_eq!(timed.0.lock().unwrap().len(), 2);
    assert_eq!(gauge(&format!("pgfence_lease_held{{table={t}}}")), 1.0);
    assert_eq!(gauge(&format!("pgfence_lease_epoch{{table={t}}}")), store.fencing_token() as f64);
    let all: Vec<String> = kept.counters.lock().unwrap().keys().cloned().collect();
    assert!(all.iter().all(|s| !s.contains("epoch")), "{all:?}");
    runtime.block_on(store.close()).unwrap();
    assert_eq!(gauge(&format!("pgfence_lease_held{{table={t}}}")), 0.0);
}
