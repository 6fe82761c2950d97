//! `Fleet`: many stores sharing one pool and one renewal thread. What they share costs a
//! handful of threads and connections; what each store owns (its lease, loss, close and
//! renewal failures) stays its own.

use crate::common;

use std::time::Duration;

use common::{admin, lease_table, server, steal_lease, table, within};
use pgfence::{Error, Fleet, LeaseLossPolicy, LeaseState, LossReason, PgKvStore};

// A fleet may be shared between threads (in an `Arc`), and moved to one.
const _: fn() = || {
    fn shareable<T: Send + Sync>() {}
    shareable::<Fleet>();
};

/// A fleet on the shared server with test timings: a local deadline (3 s of a 6 s TTL) that a
/// test can outwait, renewal every 500 ms. Its sessions carry `application_name(app)`.
fn fleet(app: &str, pool_size: usize) -> Fleet {
    PgKvStore::builder_from_config(server().config())
        .application_name(app)
        .pool_size(pool_size)
        .lease_ttl(Duration::from_secs(6))
        .local_deadline(Duration::from_secs(3))
        .renew_interval(Duration::from_millis(500))
        .fleet()
        .expect("fleet")
}

/// `n` stores opened on `fleet`, on tables named after `prefix`.
async fn open_stores(fleet: &Fleet, prefix: &str, n: usize) -> (Vec<String>, Vec<PgKvStore>) {
    let tables: Vec<String> = (0..n).map(|i| table(&format!("{prefix}{i}_"))).collect();
    let mut stores = Vec::new();
    for t in &tables {
        stores.push(within("open", fleet.builder(t).open()).await.expect("open in the fleet"));
    }
    (tables, stores)
}

/// Waits until each store has `more` confirmed renewals beyond `since`, its renewal count then.
async fn renew_more(stores: &[&PgKvStore], since: &[u64], more: u64) {
    within("the stores renew", async {
        loop {
            let behind = stores.iter().zip(since).any(|(s, n)| s.stats().renewals.ok < n + more);
            if !behind {
                return;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
}

/// Every store in `stores` still holds its lease, at its own epoch, and writes.
async fn still_held(stores: &[&PgKvStore], epochs: &[i64]) {
    for (store, epoch) in stores.iter().zip(epochs) {
        assert_eq!(*store.lease_state().borrow(), LeaseState::Held { epoch: *epoch });
        assert_eq!(store.fencing_token(), *epoch);
        store.write("p", "s", "k", b"still mine".to_vec()).await.expect("still writes");
    }
}

fn renewals(stores: &[&PgKvStore]) -> Vec<u64> {
    stores.iter().map(|s| s.stats().renewals.ok).collect()
}

fn epochs(stores: &[&PgKvStore]) -> Vec<i64> {
    stores.iter().map(|s| s.fencing_token()).collect()
}

/// The number of threads of this process.
fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").expect("/proc/self/task").count()
}

/// 50 stores on one fleet (a pool of 8) hold about pool-size server connections and add one
/// thread, where 50 stores alone would add 50 threads and 100 connections or more. Each still
/// renews and writes. Once the stores and the fleet are closed, no session and no thread of
/// theirs is left. Threads are counted in a child process of its own, where no other test runs.
#[test]
fn fifty_stores_share_one_pool_and_one_renewal_thread() {
    let child = "fifty_stores_child";
    let output = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", &common::test_path(module_path!(), child)])
        .args(["--include-ignored", "--nocapture", "--test-threads", "1"])
        .env("PGFENCE_FLEET_CHILD", "1")
        .env("DATABASE_URL", server().url())
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{child}: {:?}\n{stdout}\n{stderr}", output.status);
    assert!(stdout.contains("fleet child done"), "{child} ran to its end: {stdout}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "run in a child process by fifty_stores_share_one_pool_and_one_renewal_thread"]
async fn fifty_stores_child() {
    assert!(std::env::var_os("PGFENCE_FLEET_CHILD").is_some(), "only as a child process");
    const POOL: usize = 8;
    let app = table("fleet50");
    drop(admin().await); // Whatever the harness starts, before counting.
    let before = threads();
    let fleet = fleet(&app, POOL);
    let (_tables, stores) = open_stores(&fleet, "fleet50", 50).await;
    let all: Vec<&PgKvStore> = stores.iter().collect();
    for store in &all {
        store.write("p", "s", "k", b"v".to_vec()).await.unwrap();
    }
    renew_more(&all, &vec![0; all.len()], 2).await;
    let (grown, sessions) = (threads() - before, common::sessions_of(&app).await);
    println!("threads grew by {grown}; server sessions {sessions}");
    // The fleet's renewal thread, and a tokio blocking thread or two (address lookups).
    assert!(grown <= 4, "threads grew by {grown} for 50 stores");
    // The pool, the renewal connection, and one spare for an opening's pooler check.
    assert!(sessions <= POOL as i64 + 2, "{sessions} server sessions for 50 stores");
    still_held(&all, &epochs(&all)).await;
    for store in &stores {
        within("close", store.close()).await.unwrap();
    }
    within("fleet close", fleet.close()).await;
    common::wait_until_no_sessions(&app).await;
    let left = threads().saturating_sub(before);
    assert!(left <= 3, "{left} threads left: at most tokio's idle blocking threads");
    println!("fleet child done");
}

/// A lease taken from one store of a fleet fails that store alone. The others keep renewing
/// and writing, at their own epochs. The taken store fails closed, and its close releases
/// nothing of its successor's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stolen_lease_fails_only_its_store() {
    let app = table("fleetsteal");
    let fleet = fleet(&app, 4);
    let (tables, stores) = open_stores(&fleet, "fleetsteal", 5).await;
    let others: Vec<&PgKvStore> = stores[1..].iter().collect();
    let (epochs, since) = (epochs(&others), renewals(&others));
    let taken = steal_lease(&admin().await, &tables[0]).await;
    common::wait_until_lost(&stores[0]).await;
    let lost = LeaseState::Lost { epoch: 1, reason: LossReason::TakenOver };
    assert_eq!(*stores[0].lease_state().borrow(), lost);
    let e = stores[0].write("p", "s", "k", vec![]).await.unwrap_err();
    assert!(matches!(e, Error::LeaseLost { .. }), "{e:?}");
    renew_more(&others, &since, 3).await;
    still_held(&others, &epochs).await;
    for store in &stores {
        within("close", store.close()).await.unwrap();
    }
    assert_eq!(common::lease_row(&admin().await, &tables[0]).await.1, taken, "not released");
    within("fleet close", fleet.close()).await;
}

/// Closing one store of a fleet, or dropping another, releases their leases and leaves the
/// others renewing and writing. Builders of a closed fleet open nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closing_or_dropping_one_store_leaves_the_others() {
    let app = table("fleetclose");
    let fleet = fleet(&app, 4);
    let (tables, mut stores) = open_stores(&fleet, "fleetclose", 4).await;
    within("close", stores[0].close()).await.unwrap();
    assert_eq!(*stores[0].lease_state().borrow(), LeaseState::Released { epoch: 1 });
    let dropped = stores.remove(1);
    let mut state = dropped.lease_state();
    drop(dropped);
    assert_eq!(*state.borrow_and_update(), LeaseState::Released { epoch: 1 });
    for t in &tables[..2] {
        let again = within("reopen", fleet.builder(t).open()).await.expect("released: reopens");
        assert_eq!(again.fencing_token(), 2);
        again.close().await.unwrap();
    }
    let others: Vec<&PgKvStore> = stores[1..].iter().collect();
    let (epochs, since) = (epochs(&others), renewals(&others));
    renew_more(&others, &since, 3).await;
    still_held(&others, &epochs).await;
    let late = fleet.builder(table("fleetlate"));
    for store in &stores {
        within("close", store.close()).await.unwrap();
    }
    within("fleet close", fleet.close()).await;
    let e = within("open after close", late.open()).await.unwrap_err();
    assert!(matches!(e, Error::Closed), "{e:?}");
    common::wait_until_no_sessions(&app).await;
}

/// One store whose renewal fails (its lease table renamed away under it) fails closed at its
/// own local deadline. The others renew on the same connection without a single failure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_renewal_failure_of_one_leaves_the_others() {
    let app = table("fleetfail");
    let fleet = fleet(&app, 4);
    let (tables, stores) = open_stores(&fleet, "fleetfail", 4).await;
    let others: Vec<&PgKvStore> = stores[1..].iter().collect();
    let (epochs, since) = (epochs(&others), renewals(&others));
    let db = admin().await;
    let (lease, renamed) = (lease_table(&tables[0]), format!("\"{}_gone\"", tables[0]));
    db.batch_execute(&format!("ALTER TABLE {lease} RENAME TO {renamed}")).await.unwrap();
    common::wait_until_lost(&stores[0]).await;
    let lost = LeaseState::Lost { epoch: 1, reason: LossReason::DeadlinePassed };
    assert_eq!(*stores[0].lease_state().borrow(), lost);
    assert!(stores[0].stats().renewals.failed >= 1, "{:?}", stores[0].stats().renewals);
    renew_more(&others, &since, 2).await;
    for store in &others {
        assert_eq!(store.stats().renewals.failed, 0, "{:?}", store.stats().renewals);
    }
    still_held(&others, &epochs).await;
    db.batch_execute(&format!("ALTER TABLE {renamed} RENAME TO {lease}")).await.unwrap();
    for store in &stores {
        let _ = within("close", store.close()).await; // The lost one's release may fail.
    }
    within("fleet close", fleet.close()).await;
}

/// `LeaseLossPolicy::Panic` in a fleet panics that store's renewal task only. The runtime
/// catches it: the other leases renew on, their stores write, and the fleet closes. The
/// store whose task panicked reports the loss on close, as a store alone does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn panic_policy_panics_only_that_stores_renewal_task() {
    let app = table("fleetpanic");
    let fleet = fleet(&app, 4);
    let t = table("fleetpanic_p");
    let panicky = within("open", fleet.builder(&t).on_lease_lost(LeaseLossPolicy::Panic).open())
        .await
        .unwrap();
    let (_tables, stores) = open_stores(&fleet, "fleetpanic", 3).await;
    let others: Vec<&PgKvStore> = stores.iter().collect();
    let epochs = epochs(&others);
    steal_lease(&admin().await, &t).await;
    common::wait_until_lost(&panicky).await;
    // Renewals confirmed after the panic: the fleet's thread runs on.
    let since = renewals(&others);
    renew_more(&others, &since, 3).await;
    still_held(&others, &epochs).await;
    let e = within("close", panicky.close()).await.unwrap_err();
    assert!(matches!(e, Error::LeaseLost { epoch: 1, reason: LossReason::TakenOver }), "{e:?}");
    for store in &stores {
        within("close", store.close()).await.unwrap();
    }
    within("fleet close", fleet.close()).await;
    common::wait_until_no_sessions(&app).await;
}

/// The shared renewal connection ended by the server (with every other session of the fleet):
/// each lease renews again on a new one, at the same epoch.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_renewal_connection_is_made_again_for_every_lease() {
    let app = table("fleetbroken");
    let fleet = fleet(&app, 4);
    let (_tables, stores) = open_stores(&fleet, "fleetbroken", 4).await;
    let all: Vec<&PgKvStore> = stores.iter().collect();
    let (epochs, since) = (epochs(&all), renewals(&all));
    renew_more(&all, &since, 1).await;
    let terminate = "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
                      WHERE application_name = $1";
    let ended = admin().await.query(terminate, &[&format!("pgfence {app}")]).await.unwrap();
    assert!(!ended.is_empty(), "the fleet's sessions were found");
    let since = renewals(&all);
    renew_more(&all, &since, 3).await;
    still_held(&all, &epochs).await;
    for store in &stores {
        within("close", store.close()).await.unwrap();
    }
    within("fleet close", fleet.close()).await;
}

/// A fleet's builder opens a standby, a blocking store and an inspector as a builder alone
/// does. The standby waits while another store of the fleet holds the table, and takes over
/// when that store closes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standby_blocking_and_inspect_work_on_a_fleet() {
    let app = table("fleetkinds");
    let fleet = fleet(&app, 4);
    let t = table("fleetkinds_s");
    let holder = within("open", fleet.builder(&t).open()).await.unwrap();
    holder.write("p", "s", "k", b"v".to_vec()).await.unwrap();
    let standby = tokio::spawn(fleet.builder(&t).open_when_available());
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert!(!standby.is_finished(), "the standby waits while the lease is held");
    let inspector = within("inspect", fleet.builder(&t).inspect()).await.unwrap();
    assert_eq!(inspector.lease_info().await.unwrap().expect("a lease row").epoch, 1);
    holder.close().await.unwrap();
    let successor = within("takeover", standby).await.unwrap().expect("the standby opens");
    assert_eq!(successor.fencing_token(), 2);
    assert_eq!(successor.read("p", "s", "k").await.unwrap(), b"v");

    let b = table("fleetkinds_b");
    let builder = fleet.builder(&b);
    let blocking = tokio::task::spawn_blocking(move || {
        let store = builder.open_blocking()?;
        store.write("p", "s", "k", b"sync".to_vec())?;
        store.close()
    });
    within("blocking store", blocking).await.unwrap().expect("a blocking store in the fleet");
    successor.write("p", "s", "k2", b"on".to_vec()).await.expect("the other store goes on");
    successor.close().await.unwrap();
    within("fleet close", fleet.close()).await;
    common::wait_until_no_sessions(&app).await;
}

/// A lock held on one store's lease row (an operator's open transaction) holds up that store's
/// renewals on the shared connection. Each waits at most the connection's lock timeout, so the
/// renewals pipelined behind it still answer well within their own timeout: the other stores
/// renew without a single failure. The locked store fails closed at its local deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lock_on_one_lease_row_does_not_hold_up_the_others() {
    let app = table("fleetlock");
    let fleet = fleet(&app, 4);
    let (tables, stores) = open_stores(&fleet, "fleetlock", 4).await;
    let others: Vec<&PgKvStore> = stores[1..].iter().collect();
    let (epochs, since) = (epochs(&others), renewals(&others));
    let mut blocker = admin().await;
    let tx = common::lock_lease_row(&mut blocker, &tables[0], "FOR NO KEY UPDATE").await;
    common::wait_until_lost(&stores[0]).await;
    renew_more(&others, &since, 4).await;
    for store in &others {
        assert_eq!(store.stats().renewals.failed, 0, "{:?}", store.stats().renewals);
    }
    still_held(&others, &epochs).await;
    tx.rollback().await.unwrap();
    for store in &stores {
        within("close", store.close()).await.unwrap();
    }
    within("fleet close", fleet.close()).await;
}
