//! `pgfence::ldk::LdkStore` through LDK's own traits: the conformance suite through the async
//! traits (`KVStore`, `PaginatedKVStore`, `MigratableKVStore`) and through the sync traits
//! (`KVStoreSync`, ...) from a plain thread, inside a multi-thread runtime and inside a
//! current-thread runtime; per-key call order of async writes; error kinds; and a data
//! migration round trip with `migrate_kv_store_data` through LDK's `FilesystemStore`.
#![cfg(feature = "ldk")]

use crate::common;
use crate::sync_support;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use common::conformance::{BoxFut, Caps, Facade, Kv, PageOut, SUITE_LIMIT, Setup, check_contract};
use lightning::util::persist::{
    KVStore, KVStoreSync, KVStoreSyncWrapper, MigratableKVStore, MigratableKVStoreSync, PageToken,
    PaginatedKVStore, PaginatedKVStoreSync, migrate_kv_store_data,
};
use lightning_persister::fs_store::v1::FilesystemStore;
use pgfence::ldk::LdkStore;
use sync_support::{Where, guarded, run_in};

const PAGE: usize = 7;

fn std_io(e: lightning::io::Error) -> std::io::Error {
    std::io::Error::from(e)
}

/// The suite through LDK's async traits. Every call goes through the trait method, never the
/// inherent API.
struct LdkAsync;

struct LdkAsyncKv(LdkStore, usize);

impl Facade for LdkAsync {
    fn open(&self, builder: pgfence::Builder, page: usize) -> BoxFut<'static, Box<dyn Kv>> {
        Box::pin(async move {
            Ok(Box::new(LdkAsyncKv(LdkStore::open_async(builder).await?, page)) as _)
        })
    }
}

impl Kv for LdkAsyncKv {
    fn caps(&self) -> Caps {
        // Ordered at the call, but started at once on the store's runtime: not lazy.
        Caps { ordered_at_call: true, lazy: false, page_size: self.1 }
    }
    fn read<'a>(&'a self, p: &'a str, s: &'a str, k: &'a str) -> BoxFut<'a, Vec<u8>> {
        let fut = KVStore::read(&self.0, p, s, k);
        Box::pin(async move { fut.await.map_err(std_io) })
    }
    fn write(&self, p: &str, s: &str, k: &str, v: Vec<u8>) -> BoxFut<'static, ()> {
        let fut = KVStore::write(&self.0, p, s, k, v);
        Box::pin(async move { fut.await.map_err(std_io) })
    }
    fn remove(&self, p: &str, s: &str, k: &str) -> BoxFut<'static, ()> {
        let fut = KVStore::remove(&self.0, p, s, k, false);
        Box::pin(async move { fut.await.map_err(std_io) })
    }
    fn list<'a>(&'a self, p: &'a str, s: &'a str) -> BoxFut<'a, Vec<String>> {
        let fut = KVStore::list(&self.0, p, s);
        Box::pin(async move { fut.await.map_err(std_io) })
    }
    fn list_page<'a>(
        &'a self,
        p: &'a str,
        s: &'a str,
        token: Option<String>,
    ) -> BoxFut<'a, PageOut> {
        let fut = PaginatedKVStore::list_paginated(&self.0, p, s, token.map(PageToken::new));
        Box::pin(async move {
            let page = fut.await.map_err(std_io)?;
            Ok((page.keys, page.next_page_token.map(|t| t.as_str().to_owned())))
        })
    }
    fn list_all(&self) -> BoxFut<'_, Vec<(String, String, String)>> {
        let fut = MigratableKVStore::list_all_keys(&self.0);
        Box::pin(async move { fut.await.map_err(std_io) })
    }
    fn fencing_token(&self) -> i64 {
        self.0.fencing_token()
    }
    fn close(&self) -> BoxFut<'_, ()> {
        Box::pin(async move { Ok(self.0.close_async().await?) })
    }
}

/// The suite through LDK's sync traits: each call blocks inside the future, in whatever context
/// polls it. Opened with the blocking `open`.
struct LdkSync;

struct LdkSyncKv(LdkStore, usize);

impl Facade for LdkSync {
    fn open(&self, builder: pgfence::Builder, page: usize) -> BoxFut<'static, Box<dyn Kv>> {
        Box::pin(async move { Ok(Box::new(LdkSyncKv(LdkStore::open(builder)?, page)) as _) })
    }
}

impl Kv for LdkSyncKv {
    fn caps(&self) -> Caps {
        Caps { ordered_at_call: false, lazy: false, page_size: self.1 }
    }
    fn read<'a>(&'a self, p: &'a str, s: &'a str, k: &'a str) -> BoxFut<'a, Vec<u8>> {
        Box::pin(async move { KVStoreSync::read(&self.0, p, s, k).map_err(std_io) })
    }
    fn write(&self, p: &str, s: &str, k: &str, v: Vec<u8>) -> BoxFut<'static, ()> {
        let (store, p, s, k) = (self.0.clone(), p.to_owned(), s.to_owned(), k.to_owned());
        Box::pin(async move { KVStoreSync::write(&store, &p, &s, &k, v).map_err(std_io) })
    }
    fn remove(&self, p: &str, s: &str, k: &str) -> BoxFut<'static, ()> {
        let (store, p, s, k) = (self.0.clone(), p.to_owned(), s.to_owned(), k.to_owned());
        Box::pin(async move { KVStoreSync::remove(&store, &p, &s, &k, false).map_err(std_io) })
    }
    fn list<'a>(&'a self, p: &'a str, s: &'a str) -> BoxFut<'a, Vec<String>> {
        Box::pin(async move { KVStoreSync::list(&self.0, p, s).map_err(std_io) })
    }
    fn list_page<'a>(
        &'a self,
        p: &'a str,
        s: &'a str,
        token: Option<String>,
    ) -> BoxFut<'a, PageOut> {
        Box::pin(async move {
            let page =
                PaginatedKVStoreSync::list_paginated(&self.0, p, s, token.map(PageToken::new))
                    .map_err(std_io)?;
            Ok((page.keys, page.next_page_token.map(|t| t.as_str().to_owned())))
        })
    }
    fn list_all(&self) -> BoxFut<'_, Vec<(String, String, String)>> {
        Box::pin(async move { MigratableKVStoreSync::list_all_keys(&self.0).map_err(std_io) })
    }
    fn fencing_token(&self) -> i64 {
        self.0.fencing_token()
    }
    fn close(&self) -> BoxFut<'_, ()> {
        Box::pin(async move { Ok(self.0.close()?) })
    }
}

async fn run_async(setup: Setup) {
    let run = tokio::time::timeout(SUITE_LIMIT, check_contract(&setup));
    run.await.unwrap_or_else(|_| panic!("the conformance suite hung for {SUITE_LIMIT:?}"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_async_traits_multi_thread_runtime() {
    run_async(Setup::new(LdkAsync, Some(PAGE), |b| b)).await;
}

/// LDK's default page size (100) and a pool of one: pages of 100 keys.
#[tokio::test(flavor = "current_thread")]
async fn conformance_async_traits_current_thread_runtime_default_page_size() {
    run_async(Setup::new(LdkAsync, None, |b| b.pool_size(1))).await;
}

/// Runs the whole suite through the sync traits in `place`: every store is opened with the
/// blocking `open`, used, closed or dropped there.
fn sync_conformance_in(place: Where) {
    run_in(place, "LDK sync conformance", || async {
        check_contract(&Setup::new(LdkSync, Some(PAGE), |b| b)).await;
    });
}

#[test]
fn conformance_sync_traits_plain_thread() {
    sync_conformance_in(Where::PlainThread);
}

#[test]
fn conformance_sync_traits_inside_multi_thread_runtime() {
    sync_conformance_in(Where::MultiThreadRuntime);
}

#[test]
fn conformance_sync_traits_inside_current_thread_runtime() {
    sync_conformance_in(Where::CurrentThreadRuntime);
}

/// The common shape of an LDK node: async start-up in a current-thread runtime, then LDK calls
/// the sync traits from code running on that same runtime's only thread. Every connection of
/// the store must belong to the store's own runtime, or this deadlocks.
#[test]
fn opened_async_then_used_sync_on_the_same_current_thread_runtime() {
    run_in(Where::CurrentThreadRuntime, "async open, sync use", || async {
        let builder = common::builder(&common::table("ldkmixed")).pool_size(2);
        let store = LdkStore::open_async(builder).await.unwrap();
        for i in 0..10u8 {
            KVStoreSync::write(&store, "mixed", "", &format!("k{i}"), vec![i]).unwrap();
            assert_eq!(KVStoreSync::read(&store, "mixed", "", &format!("k{i}")).unwrap(), vec![i]);
            let async_read = KVStore::read(&store, "mixed", "", &format!("k{i}"));
            assert_eq!(async_read.await.unwrap(), vec![i]);
        }
        assert_eq!(KVStoreSync::list(&store, "mixed", "").unwrap().len(), 10);
        store.close_async().await.unwrap();
    });
}

/// LDK's `KVStoreSyncWrapper` turns our sync impl into an async store that blocks inside
/// `poll`: the way LDK itself calls sync persistence from async code. Interleaved with a task
/// of the same current-thread runtime that must keep running between the calls.
#[test]
fn sync_store_wrapped_for_async_ldk_code_in_a_current_thread_runtime() {
    run_in(Where::CurrentThreadRuntime, "wrapper", || async {
        let store = Arc::new(LdkStore::open(common::builder(&common::table("ldkwrap"))).unwrap());
        let wrapped = KVStoreSyncWrapper(Arc::clone(&store));
        let ticker = tokio::spawn(async {
            for _ in 0..20 {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        });
        for i in 0..20u8 {
            KVStore::write(&wrapped, "wrap", "", &format!("k{i}"), vec![i]).await.unwrap();
            tokio::task::yield_now().await;
        }
        assert_eq!(KVStore::list(&wrapped, "wrap", "").await.unwrap().len(), 20);
        assert_eq!(KVStore::read(&wrapped, "wrap", "", "k7").await.unwrap(), vec![7]);
        common::within("ticker", ticker).await.unwrap();
        store.close().unwrap();
    });
}

/// A write whose future is dropped unpolled still runs, and keeps the store's runtime alive
/// after the last handle is gone; dropping everything inside a runtime never panics.
#[tokio::test(flavor = "current_thread")]
async fn dropped_async_write_still_lands() {
    let table = common::table("ldkdetach");
    let store = LdkStore::open_async(common::builder(&table)).await.unwrap();
    drop(KVStore::write(&store, "det", "", "k", b"detached".to_vec()));
    let later = KVStore::write(&store, "det", "", "other", b"x".to_vec());
    drop(store); // Last handle gone while the detached write may still be running.
    common::within("later", later).await.unwrap();
    // The lease is released once the outstanding operations finish; then a successor opens.
    let next = common::within("reopen", async {
        loop {
            match LdkStore::open_async(common::builder(&table)).await {
                Ok(next) => break next,
                Err(e) if e.is_lease_held() => tokio::time::sleep(Duration::from_millis(50)).await,
                Err(e) => panic!("{e}"),
            }
        }
    })
    .await;
    assert_eq!(KVStore::read(&next, "det", "", "k").await.unwrap(), b"detached");
    next.close_async().await.unwrap();
}

/// Removes a directory tree when dropped, also when the test panics.
struct TempDir(PathBuf);

impl TempDir {
    fn new(prefix: &str) -> TempDir {
        let path = std::env::temp_dir().join(pgfence_testing::unique_name(prefix));
        std::fs::create_dir_all(&path).unwrap();
        TempDir(path)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Everything in a store, read through `MigratableKVStoreSync` and `KVStoreSync`.
fn contents<S: MigratableKVStoreSync>(store: &S) -> BTreeMap<(String, String, String), Vec<u8>> {
    let keys = store.list_all_keys().unwrap();
    let n = keys.len();
    let map: BTreeMap<_, _> = keys
        .into_iter()
        .map(|(p, s, k)| {
            let value = store.read(&p, &s, &k).unwrap();
            ((p, s, k), value)
        })
        .collect();
    assert_eq!(map.len(), n, "list_all_keys returned no duplicates");
    map
}

/// LDK's own migration helper, FilesystemStore → PgKvStore → fresh FilesystemStore, with a few
/// thousand keys across the namespaces an LDK node uses; every key and value compared.
#[test]
fn migration_round_trip_through_filesystem_stores() {
    guarded("migration", || {
        let (dir_a, dir_b) = (TempDir::new("ldkfs-a"), TempDir::new("ldkfs-b"));
        let mut source = FilesystemStore::new(dir_a.0.clone());
        let mut value_seed: u32 = 7;
        let mut value = |len: usize| -> Vec<u8> {
            (0..len)
                .map(|_| {
                    value_seed = value_seed.wrapping_mul(1_103_515_245).wrapping_add(12_345);
                    (value_seed >> 16) as u8
                })
                .collect()
        };
        let mut written = 0;
        KVStoreSync::write(&source, "", "", "manager", value(40_000)).unwrap();
        KVStoreSync::write(&source, "", "", "network_graph", value(100_000)).unwrap();
        KVStoreSync::write(&source, "", "", "scorer", Vec::new()).unwrap();
        written += 3;
        for i in 0..600 {
            KVStoreSync::write(
                &source,
                "monitors",
                "",
                &format!("{i:064x}_{}", i % 3),
                value(i % 900),
            )
            .unwrap();
            written += 1;
        }
        for chan in 0..24 {
            for update in 0..100 {
                let ns = format!("{chan:064x}_0");
                KVStoreSync::write(&source, "monitor_updates", &ns, &update.to_string(), value(64))
                    .unwrap();
                written += 1;
            }
        }
        for i in 0..200 {
            KVStoreSync::write(&source, "archived_monitors", "", &format!("arch-{i}"), value(300))
                .unwrap();
            KVStoreSync::write(&source, "payments", "outbound", &format!("p_{i}"), value(i))
                .unwrap();
            written += 2;
        }
        assert!(written >= 3000, "{written}");
        let original = contents(&source);
        assert_eq!(original.len(), written, "the filesystem store holds every key");

        let table = common::table("ldkmig");
        let mut pg = LdkStore::open(common::builder(&table)).unwrap();
        migrate_kv_store_data(&mut source, &mut pg).expect("filesystem -> pgfence");
        assert_eq!(contents(&pg), original, "pgfence holds every key and value");

        let mut target = FilesystemStore::new(dir_b.0.clone());
        migrate_kv_store_data(&mut pg, &mut target).expect("pgfence -> filesystem");
        let round_tripped = contents(&target);
        assert_eq!(round_tripped.len(), original.len());
        for (key, value) in &original {
            assert!(round_tripped.get(key) == Some(value), "{key:?} survives the round trip");
        }
        pg.close().unwrap();
    });
}

/// A standby LDK node, waiting in `open_standby_async`, takes over when the active node drops
/// its store, and reads what the active node persisted.
#[tokio::test(flavor = "current_thread")]
async fn standby_node_takes_over_when_the_active_node_stops() {
    let table = common::table("ldkstandby");
    let active = LdkStore::open_async(common::builder(&table)).await.unwrap();
    KVStore::write(&active, "", "", "manager", b"state".to_vec()).await.unwrap();
    let standby = tokio::spawn(LdkStore::open_standby_async(
        common::builder(&table).standby().timeout(common::HANG_GUARD),
    ));
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!standby.is_finished(), "the standby waits while the lease is held");
    let epoch = active.fencing_token();
    drop(active); // The active node stops; dropping releases the lease.
    let successor = common::within("standby", standby).await.unwrap().unwrap();
    assert!(successor.fencing_token() > epoch);
    assert_eq!(KVStore::read(&successor, "", "", "manager").await.unwrap(), b"state");
    successor.close_async().await.unwrap();
}

/// A standby whose future is dropped stops waiting: it does not take the lease later.
#[tokio::test(flavor = "current_thread")]
async fn dropped_standby_leaves_nothing_waiting() {
    let table = common::table("ldkstandbydrop");
    let active = LdkStore::open_async(common::builder(&table)).await.unwrap();
    let epoch = active.fencing_token();
    let gave_up = tokio::time::timeout(
        Duration::from_millis(300),
        LdkStore::open_standby_async(common::builder(&table).standby()),
    )
    .await;
    assert!(gave_up.is_err(), "the standby waits while the lease is held");
    active.close_async().await.unwrap();
    // A standby still waiting would be woken by the release and take the lease now.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let next = LdkStore::open_async(common::builder(&table)).await.expect("no one holds the lease");
    // Epochs count acquisitions: a standby that took the lease (and dropped it) would show here.
    assert_eq!(next.fencing_token(), epoch + 1, "nobody acquired the lease in between");
    next.close_async().await.unwrap();
}

/// Giving up on `open_async` or `open_standby_async` (here by aborting the task awaiting it)
/// while the setup waits at the fence shuts the facade's runtime down with it, yet leaves
/// nothing waiting on the server: the setup is cancelled there first. Nobody takes the lease
/// later.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abandoned_async_open_at_the_fence_leaves_nothing_running() {
    let t = common::table("ldkfence");
    let mut blocker = common::admin().await;
    let tx = common::fence_closed(&mut blocker, &t).await;
    for standby in [false, true] {
        let app = format!("ldkfence-{standby}-{t}");
        let builder = common::builder(&t).application_name(&app);
        let opening = if standby {
            tokio::spawn(LdkStore::open_standby_async(builder.standby()))
        } else {
            tokio::spawn(LdkStore::open_async(builder))
        };
        common::wait_for_app_lock_wait(&app).await;
        opening.abort();
        assert!(opening.await.unwrap_err().is_cancelled());
        common::wait_until_no_sessions(&app).await;
    }
    tx.commit().await.unwrap();
    let (_, epoch, ms_left) = common::lease_row(&common::admin().await, &t).await;
    assert_eq!((epoch, ms_left <= 0), (1, true), "nobody took the lease");
}

/// `LdkStore` can go where LDK's own test helpers want a store (`K: KVStoreSync +
/// RefUnwindSafe`): it holds no interior mutability that a caught panic could leave half-done
/// without a lock noticing. A compile-time check: this file does not build otherwise.
#[test]
fn ldk_store_is_unwind_safe() {
    fn unwind_safe<T: std::panic::RefUnwindSafe + std::panic::UnwindSafe>() {}
    unwind_safe::<LdkStore>();
    unwind_safe::<Arc<LdkStore>>();
}
