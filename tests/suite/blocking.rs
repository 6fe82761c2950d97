//! The blocking facade (`pgfence::blocking`): the conformance suite run through it from a plain
//! thread, from inside a multi-thread runtime and from inside a current-thread runtime, and its
//! own promises: same errors as the async store, lease loss observable without a runtime, the
//! `Panic` policy raised in the caller, and open/close/drop anywhere without panic or deadlock.

use crate::common;
use crate::sync_support;

use std::io;
use std::panic::{self, AssertUnwindSafe};
use std::time::Duration;

use common::conformance::{Blocking, BlockingStore, PageOut, Setup, check_contract};
use pgfence::blocking::PgKvStore;
use pgfence::{LeaseLossPolicy, LeaseState, PageToken};
use pgfence_testing::Proxy;
use sync_support::{Where, guarded, run_in};

const PAGE: usize = 7;

/// The facade in the conformance suite: each call goes to the inherent method of the same name.
impl BlockingStore for PgKvStore {
    fn read(&self, p: &str, s: &str, k: &str) -> io::Result<Vec<u8>> {
        Ok(PgKvStore::read(self, p, s, k)?)
    }
    fn write(&self, p: &str, s: &str, k: &str, v: Vec<u8>) -> io::Result<()> {
        Ok(PgKvStore::write(self, p, s, k, v)?)
    }
    fn remove(&self, p: &str, s: &str, k: &str) -> io::Result<()> {
        Ok(PgKvStore::remove(self, p, s, k, false)?)
    }
    fn list(&self, p: &str, s: &str) -> io::Result<Vec<String>> {
        Ok(PgKvStore::list(self, p, s)?)
    }
    fn list_page(&self, p: &str, s: &str, token: Option<String>) -> io::Result<PageOut> {
        let page = self.list_paginated(p, s, token.map(PageToken::new))?;
        Ok((page.keys, page.next_page_token.map(|t| t.as_str().to_owned())))
    }
    fn list_all(&self) -> io::Result<Vec<(String, String, String)>> {
        Ok(self.list_all_keys()?)
    }
    fn fencing_token(&self) -> i64 {
        PgKvStore::fencing_token(self)
    }
    fn close(&self) -> io::Result<()> {
        Ok(PgKvStore::close(self)?)
    }
}

/// Runs the whole suite in `place`: every store is opened, used, closed or dropped there.
fn conformance_in(place: Where) {
    run_in(place, "blocking conformance", || async {
        check_contract(&Setup::new(Blocking(PgKvStore::open), Some(PAGE), |b| b)).await;
    });
}

#[test]
fn conformance_from_a_plain_thread() {
    conformance_in(Where::PlainThread);
}

#[test]
fn conformance_inside_a_multi_thread_runtime() {
    conformance_in(Where::MultiThreadRuntime);
}

#[test]
fn conformance_inside_a_current_thread_runtime() {
    conformance_in(Where::CurrentThreadRuntime);
}

/// Takes the lease away from outside, as a successor would; returns the new epoch.
fn steal(table: &str) -> i64 {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    runtime.block_on(async {
        let admin = common::admin().await;
        common::steal_lease(&admin, table).await
    })
}

/// A loss is observable without a runtime: `wait_while_held` returns `Lost` with the lost
/// epoch and `lease_state` shows it. (That every operation then fails with `LeaseLost`,
/// permanently, is the suite's `check_fail_closed_after_loss`.)
#[test]
fn lease_loss_is_observable_without_a_runtime() {
    guarded("lease loss", || {
        let table = common::table("blklost");
        let store = PgKvStore::open(common::builder(&table)).unwrap();
        let epoch = store.fencing_token();
        store.write("p", "s", "k", b"before".to_vec()).unwrap();
        assert!(matches!(
            store.wait_while_held(Duration::from_millis(10)),
            LeaseState::Held { .. }
        ));
        let successor = steal(&table);
        assert!(successor > epoch);
        let e = store.write("p", "s", "k", b"after".to_vec()).unwrap_err();
        assert!(e.is_lease_lost(), "{e}");
        match store.wait_while_held(common::HANG_GUARD) {
            LeaseState::Lost { epoch: lost, .. } => assert_eq!(lost, epoch),
            other => panic!("expected Lost, got {other:?}"),
        }
        assert!(matches!(*store.lease_state().borrow(), LeaseState::Lost { .. }));
        drop(store); // Releasing by owner id can not touch the successor's lease.
    });
}

#[test]
fn panic_policy_panics_in_the_calling_thread() {
    guarded("panic policy", || {
        let table = common::table("blkpanic");
        let store =
            PgKvStore::open(common::builder(&table).on_lease_lost(LeaseLossPolicy::Panic)).unwrap();
        steal(&table);
        let outcome =
            panic::catch_unwind(AssertUnwindSafe(|| store.write("p", "s", "k", b"x".to_vec())));
        let payload = outcome.expect_err("the Panic policy panics in the caller");
        let message = payload
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_default();
        assert!(message.contains("lease lost"), "{message}");
        drop(store); // Still never panics on drop.
    });
}

/// A close is observable without a runtime, by every handle: `lease_state` and
/// `wait_while_held` of a clone show `Released`. (That every operation then fails with
/// `Closed` and a successor opens at once is the suite's `check_close_releases`.)
#[test]
fn close_is_observable_by_every_handle() {
    guarded("close", || {
        let table = common::table("blkclose");
        let store = PgKvStore::open(common::builder(&table)).unwrap();
        let clone = store.clone();
        store.close().unwrap();
        assert!(matches!(*store.lease_state().borrow(), LeaseState::Released { .. }));
        assert!(matches!(clone.wait_while_held(common::HANG_GUARD), LeaseState::Released { .. }));
        let e = clone.write("p", "s", "k", b"w".to_vec()).unwrap_err();
        assert!(matches!(e, pgfence::Error::Closed), "{e}");
    });
}

/// Atomic batches through the facade, from every kind of context: all or nothing, and ordered
/// with single writes by call.
#[test]
fn batches_commit_atomically_and_in_call_order() {
    for place in Where::ALL {
        run_in(place, "batch", || async {
            let table = common::table("blkbatch");
            let store = PgKvStore::open(common::builder(&table)).unwrap();
            store.write("b", "s", "gone", b"x".to_vec()).unwrap();
            let batch = store
                .batch()
                .put("b", "s", "a", b"a".to_vec())
                .put("b", "s", "c", b"c".to_vec())
                .remove("b", "s", "gone");
            store.commit(batch).unwrap();
            assert_eq!(store.list("b", "s").unwrap(), ["a", "c"]);
            // A batch with an invalid key writes nothing.
            let bad = store.batch().put("b", "s", "d", b"d".to_vec()).put("b", "s", "", vec![]);
            assert!(matches!(store.commit(bad), Err(pgfence::Error::InvalidKey { .. })));
            assert_eq!(store.list("b", "s").unwrap(), ["a", "c"]);
            // Batches and single writes of one key take effect in call order (sequential calls
            // here; concurrent calls are covered by tests/batch.rs on the async store).
            store.commit(store.batch().put("b", "s", "a", b"batch".to_vec())).unwrap();
            assert_eq!(store.read("b", "s", "a").unwrap(), b"batch");
            store.write("b", "s", "a", b"single".to_vec()).unwrap();
            assert_eq!(store.read("b", "s", "a").unwrap(), b"single");
            store.close().unwrap();
        });
    }
}

/// Many threads at once, one shared key among them: no deadlock, and the key ends with the
/// value of a write that returned `Ok` last in a sequence made by one thread.
#[test]
fn concurrent_threads() {
    guarded("threads", || {
        let table = common::table("blkthreads");
        let store = PgKvStore::open(common::builder(&table)).unwrap();
        std::thread::scope(|scope| {
            for t in 0..6 {
                let store = &store;
                scope.spawn(move || {
                    for i in 0..20 {
                        store.write("thr", &format!("t{t}"), &format!("k{i}"), vec![t, i]).unwrap();
                        store.write("thr", "shared", "k", vec![t, i]).unwrap();
                    }
                });
            }
        });
        for t in 0..6u8 {
            let keys = store.list("thr", &format!("t{t}")).unwrap();
            assert_eq!(keys.len(), 20);
            assert_eq!(store.read("thr", &format!("t{t}"), "k19").unwrap(), vec![t, 19]);
        }
        let shared = store.read("thr", "shared", "k").unwrap();
        assert_eq!(shared[1], 19, "some thread's last write: {shared:?}");
        store.close().unwrap();
    });
}

/// Opened in one context, dropped (the last handle) in each: the lease is released, nothing
/// panics or hangs.
#[test]
fn open_in_one_context_drop_in_another() {
    for place in Where::ALL {
        let table = common::table("blkdrop");
        let store = guarded("open", {
            let table = table.clone();
            move || PgKvStore::open(common::builder(&table)).unwrap()
        });
        run_in(place, "drop", move || async move {
            store.write("p", "s", "k", b"v".to_vec()).unwrap();
            drop(store);
        });
        guarded("reopen", move || {
            let next = PgKvStore::open(common::builder(&table)).expect("lease released on drop");
            assert_eq!(next.read("p", "s", "k").unwrap(), b"v");
            next.close().unwrap();
        });
    }
}

/// A thread blocked in `wait_while_held` is woken by a `close` from another thread.
#[test]
fn wait_while_held_wakes_on_close() {
    guarded("wait", || {
        let store = PgKvStore::open(common::builder(&common::table("blkwait"))).unwrap();
        let watcher = store.clone();
        let watching = std::thread::spawn(move || watcher.wait_while_held(Duration::MAX));
        std::thread::sleep(Duration::from_millis(200));
        store.close().unwrap();
        assert!(matches!(watching.join().unwrap(), LeaseState::Released { .. }));
    });
}

/// A watchdog thread waiting on a `lease_watch` does not keep the lease alive, as a store
/// handle in its place would: when the application drops its last handle, the lease is
/// released (a successor opens at once) and the watchdog sees `Released`.
#[test]
fn lease_watch_does_not_keep_the_lease_alive() {
    guarded("watch", || {
        let table = common::table("blkwatch");
        let store = PgKvStore::open(common::builder(&table)).unwrap();
        let mut watch = store.lease_watch();
        let held = watch.wait_while_held(Duration::from_millis(50));
        assert_eq!(held, LeaseState::Held { epoch: 1 }, "a wait that times out");
        let watchdog = std::thread::spawn(move || watch.wait_while_held(Duration::MAX));
        drop(store);
        assert_eq!(watchdog.join().unwrap(), LeaseState::Released { epoch: 1 });
        let next = PgKvStore::open(common::builder(&table)).expect("released with the last handle");
        assert_eq!(next.fencing_token(), 2);
        next.close().unwrap();
    });
}

/// A store dropped while the database is out of reach cannot release its lease: a watchdog
/// waiting on its `lease_watch` sees `Abandoned` (the store is done; the lease expires by its
/// TTL), not `Held` returned at once over and over by a watch whose store is gone.
#[test]
fn lease_watch_sees_a_store_that_could_not_release_as_abandoned() {
    guarded("abandoned", || {
        let runtime = tokio::runtime::Runtime::new().unwrap();
        let server = common::server();
        let proxy = runtime.block_on(Proxy::start(server.tcp_addr().unwrap())).unwrap();
        let builder = pgfence::PgKvStore::builder_from_config(server.config_via(proxy.addr()))
            .table(common::table("blkabandon"))
            .connect_timeout(Duration::from_secs(1))
            .drop_timeout(Duration::from_secs(1));
        let store = PgKvStore::open(builder).unwrap();
        let mut watch = store.lease_watch();
        proxy.set_refuse(true);
        proxy.cut_all();
        drop(store); // Its release cannot get through.
        assert_eq!(watch.wait_while_held(common::HANG_GUARD), LeaseState::Abandoned { epoch: 1 });
    });
}

/// A standby blocked in `open_standby` takes over as soon as the active store closes.
#[test]
fn standby_takes_over_when_the_active_store_closes() {
    guarded("standby", || {
        let table = common::table("blkstandby");
        let active = PgKvStore::open(common::builder(&table)).unwrap();
        active.write("p", "s", "k", b"from active".to_vec()).unwrap();
        let waiting = std::thread::spawn({
            let table = table.clone();
            move || {
                let standby = common::builder(&table).standby().timeout(common::HANG_GUARD);
                PgKvStore::open_standby(standby)
            }
        });
        std::thread::sleep(Duration::from_millis(300));
        assert!(!waiting.is_finished(), "the standby waits while the lease is held");
        active.close().unwrap();
        let successor = waiting.join().unwrap().expect("standby acquired the lease");
        assert!(successor.fencing_token() > active.fencing_token());
        assert_eq!(successor.read("p", "s", "k").unwrap(), b"from active");
        successor.close().unwrap();
    });
}
