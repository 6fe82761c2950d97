//! `pgfence::shutdown::Watchdog`: the shutdown runs when the lease is lost, and the process
//! aborts when that shutdown hangs or panics.

use std::sync::mpsc;
use std::time::Duration;

use pgfence::LeaseState;
use pgfence::blocking::LeaseWatch;
use pgfence::shutdown::Watchdog;

use crate::common::{self, admin, builder, steal_lease, table};

/// A takeover (the lease row stolen under the store) makes renewal find the loss; the watchdog
/// then calls the shutdown once, with the lost state.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn takeover_runs_the_shutdown() {
    let t = table("wdtakeover");
    let store = builder(&t).renew_interval(Duration::from_millis(300)).open().await.unwrap();
    let (tx, rx) = mpsc::channel();
    let watchdog =
        Watchdog::spawn(LeaseWatch::from(store.lease_state()), Duration::from_secs(5), move |s| {
            tx.send(s).unwrap();
        })
        .unwrap();
    // Nothing happens while the lease is held.
    let quiet = tokio::task::spawn_blocking({
        let rx_timeout = Duration::from_secs(1);
        move || (rx.recv_timeout(rx_timeout), rx)
    });
    let (early, rx) = quiet.await.unwrap();
    assert!(early.is_err(), "no shutdown while held: {early:?}");

    steal_lease(&admin().await, &t).await;
    let state = tokio::task::spawn_blocking(move || rx.recv_timeout(common::HANG_GUARD))
        .await
        .unwrap()
        .expect("the shutdown ran");
    assert!(
        matches!(state, LeaseState::Lost { reason: pgfence::LossReason::TakenOver, .. }),
        "{state:?}"
    );
    watchdog.stop();
    drop(store);
}

/// A stopped watchdog calls nothing, also when the store closes afterwards; stopping returns
/// at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stopped_watchdog_calls_nothing() {
    let t = table("wdstop");
    let store = builder(&t).open().await.unwrap();
    let (tx, rx) = mpsc::channel::<LeaseState>();
    let watchdog =
        Watchdog::spawn(LeaseWatch::from(store.lease_state()), Duration::from_secs(60), move |s| {
            tx.send(s).unwrap();
        })
        .unwrap();
    let started = std::time::Instant::now();
    watchdog.stop();
    // Not the shutdown's bound (60 s): a margin a loaded machine cannot use up.
    assert!(started.elapsed() < Duration::from_secs(30), "stop took {:?}", started.elapsed());
    store.close().await.unwrap();
    // The shutdown (and its sender) were dropped with the thread, never called.
    assert_eq!(rx.recv_timeout(Duration::from_secs(1)), Err(mpsc::RecvTimeoutError::Disconnected));
}

/// A closed store's lease is `Released`: a watchdog still running calls the shutdown then too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_without_stopping_runs_the_shutdown() {
    let t = table("wdclose");
    let store = builder(&t).open().await.unwrap();
    let (tx, rx) = mpsc::channel();
    let _watchdog =
        Watchdog::spawn(LeaseWatch::from(store.lease_state()), Duration::from_secs(5), move |s| {
            tx.send(s).unwrap();
        })
        .unwrap();
    store.close().await.unwrap();
    let state = tokio::task::spawn_blocking(move || rx.recv_timeout(common::HANG_GUARD))
        .await
        .unwrap()
        .expect("the shutdown ran");
    assert!(matches!(state, LeaseState::Released { .. }), "{state:?}");
}

/// A shutdown that hangs past the bound, or panics, aborts the process. Runs the ignored tests
/// below in a child process each and checks how it died.
#[test]
fn hung_or_panicking_shutdown_aborts_the_process() {
    for child in ["watchdog_hang_child", "watchdog_panic_child"] {
        use std::os::unix::process::ExitStatusExt;
        let started = std::time::Instant::now();
        let output = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", &common::test_path(module_path!(), child)])
            .args(["--include-ignored", "--nocapture"])
            .env("PGFENCE_WATCHDOG_CHILD", "1")
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&output.stdout);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.signal(), Some(6), "{child} died of SIGABRT: {stdout}\n{stderr}");
        assert!(stdout.contains("shutdown started"), "{child} ran the shutdown: {stdout}");
        assert!(!stdout.contains("child survived"), "{child}: {stdout}");
        assert!(started.elapsed() < common::HANG_GUARD, "{child} took {:?}", started.elapsed());
    }
}

/// The child of `hung_or_panicking_shutdown_aborts_the_process` whose shutdown hangs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "run in a child process by hung_or_panicking_shutdown_aborts_the_process"]
async fn watchdog_hang_child() {
    watchdog_child(|| {
        loop {
            std::thread::sleep(Duration::from_secs(3600));
        }
    })
    .await;
}

/// The child of `hung_or_panicking_shutdown_aborts_the_process` whose shutdown panics.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "run in a child process by hung_or_panicking_shutdown_aborts_the_process"]
async fn watchdog_panic_child() {
    watchdog_child(|| panic!("the node would not stop")).await;
}

async fn watchdog_child(then: fn()) {
    assert!(std::env::var_os("PGFENCE_WATCHDOG_CHILD").is_some(), "only as a child process");
    let t = table("wdabort");
    let store = builder(&t).renew_interval(Duration::from_millis(300)).open().await.unwrap();
    let _watchdog = Watchdog::spawn(
        LeaseWatch::from(store.lease_state()),
        Duration::from_millis(500),
        move |_| {
            println!("shutdown started");
            then();
        },
    )
    .unwrap();
    steal_lease(&admin().await, &t).await;
    tokio::time::sleep(common::HANG_GUARD).await;
    println!("child survived");
}
