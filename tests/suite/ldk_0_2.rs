//! `pgfence::ldk::LdkStore` through the traits of the released `lightning` 0.2 line (feature
//! `ldk-0_2`, the line ldk-node 0.7 uses): the same conformance suite as tests/suite/ldk.rs, through
//! the async `KVStore` and through `KVStoreSync` from a plain thread and inside either kind of
//! runtime; and a migration round trip with 0.2's `migrate_kv_store_data` through 0.2's
//! `FilesystemStore`. With both LDK features on, one store serves both lines at once.
#![cfg(feature = "ldk-0_2")]

use crate::common;
use crate::sync_support;

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use common::conformance::{BoxFut, Caps, Facade, Kv, PageOut, SUITE_LIMIT, Setup, check_contract};
use lightning_0_2::util::persist::{
    KVStore, KVStoreSync, KVStoreSyncWrapper, MigratableKVStore, migrate_kv_store_data,
};
use lightning_persister_0_2::fs_store::FilesystemStore;
use pgfence::ldk::LdkStore;
use sync_support::{Where, guarded, run_in};

const PAGE: usize = 7;

fn std_io(e: lightning_0_2::io::Error) -> std::io::Error {
    std::io::Error::from(e)
}

/// 0.2 has no paginated trait: the suite's paging checks go through the store's own listing,
/// which is what a 0.2 node never calls. Everything else goes through 0.2's traits.
fn own_page(store: &LdkStore, p: &str, s: &str, token: Option<String>) -> std::io::Result<PageOut> {
    let page = store.blocking().list_paginated(p, s, token.map(|t| pgfence::PageToken::new(&t)))?;
    Ok((page.keys, page.next_page_token.map(|t| t.as_str().to_owned())))
}

/// The suite through 0.2's async `KVStore`. `list_all_keys` is sync in 0.2.
struct Ldk02Async;

struct Ldk02AsyncKv(LdkStore, usize);

impl Facade for Ldk02Async {
    fn open(&self, builder: pgfence::Builder, page: usize) -> BoxFut<'static, Box<dyn Kv>> {
        Box::pin(async move {
            Ok(Box::new(Ldk02AsyncKv(LdkStore::open_async(builder).await?, page)) as _)
        })
    }
}

impl Kv for Ldk02AsyncKv {
    fn caps(&self) -> Caps {
        // Ordered at the call and started at once on the store's runtime, as with 0.3.
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
        Box::pin(async move { own_page(&self.0, p, s, token) })
    }
    fn list_all(&self) -> BoxFut<'_, Vec<(String, String, String)>> {
        Box::pin(async move { MigratableKVStore::list_all_keys(&self.0).map_err(std_io) })
    }
    fn fencing_token(&self) -> i64 {
        self.0.fencing_token()
    }
    fn close(&self) -> BoxFut<'_, ()> {
        Box::pin(async move { Ok(self.0.close_async().await?) })
    }
}

/// The suite through 0.2's `KVStoreSync`: each call blocks inside the future, in whatever
/// context polls it. Opened with the blocking `open`.
struct Ldk02Sync;

struct Ldk02SyncKv(LdkStore, usize);

impl Facade for Ldk02Sync {
    fn open(&self, builder: pgfence::Builder, page: usize) -> BoxFut<'static, Box<dyn Kv>> {
        Box::pin(async move { Ok(Box::new(Ldk02SyncKv(LdkStore::open(builder)?, page)) as _) })
    }
}

impl Kv for Ldk02SyncKv {
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
        Box::pin(async move { own_page(&self.0, p, s, token) })
    }
    fn list_all(&self) -> BoxFut<'_, Vec<(String, String, String)>> {
        Box::pin(async move { MigratableKVStore::list_all_keys(&self.0).map_err(std_io) })
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
async fn conformance_0_2_async_traits_multi_thread_runtime() {
    run_async(Setup::new(Ldk02Async, Some(PAGE), |b| b)).await;
}

#[tokio::test(flavor = "current_thread")]
async fn conformance_0_2_async_traits_current_thread_runtime_pool_of_one() {
    run_async(Setup::new(Ldk02Async, None, |b| b.pool_size(1))).await;
}

fn sync_conformance_in(place: Where) {
    run_in(place, "LDK 0.2 sync conformance", || async {
        check_contract(&Setup::new(Ldk02Sync, Some(PAGE), |b| b)).await;
    });
}

#[test]
fn conformance_0_2_sync_traits_plain_thread() {
    sync_conformance_in(Where::PlainThread);
}

#[test]
fn conformance_0_2_sync_traits_inside_multi_thread_runtime() {
    sync_conformance_in(Where::MultiThreadRuntime);
}

#[test]
fn conformance_0_2_sync_traits_inside_current_thread_runtime() {
    sync_conformance_in(Where::CurrentThreadRuntime);
}

/// ldk-node 0.7 takes its store as `Arc<dyn KVStore + KVStoreSync + Send + Sync>` (its
/// `DynStore`): `LdkStore` must fit behind that trait object, and work through it.
#[test]
fn usable_as_ldk_node_dyn_store() {
    trait DynStoreLike: KVStore + KVStoreSync + Send + Sync {}
    impl<T: KVStore + KVStoreSync + Send + Sync> DynStoreLike for T {}
    run_in(Where::CurrentThreadRuntime, "dyn store", || async {
        let store: Arc<dyn DynStoreLike> = Arc::new(
            LdkStore::open_async(common::builder(&common::table("ldk02dyn"))).await.unwrap(),
        );
        KVStoreSync::write(&*store, "dyn", "", "sync", b"s".to_vec()).unwrap();
        KVStore::write(&*store, "dyn", "", "async", b"a".to_vec()).await.unwrap();
        assert_eq!(KVStore::read(&*store, "dyn", "", "sync").await.unwrap(), b"s");
        assert_eq!(KVStoreSync::read(&*store, "dyn", "", "async").unwrap(), b"a");
        assert_eq!(KVStoreSync::list(&*store, "dyn", "").unwrap(), ["async", "sync"]);
    });
}

/// 0.2's `KVStoreSyncWrapper` (how 0.2 code calls a sync store from async code) on a
/// current-thread runtime, interleaved with a task that must keep running between the calls.
#[test]
fn sync_store_wrapped_for_async_ldk_0_2_code_in_a_current_thread_runtime() {
    run_in(Where::CurrentThreadRuntime, "wrapper", || async {
        let store = Arc::new(LdkStore::open(common::builder(&common::table("ldk02wrap"))).unwrap());
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
        common::within("ticker", ticker).await.unwrap();
        store.close().unwrap();
    });
}

/// With both LDK features on, one store is both lines' store at once: what one line wrote,
/// the other reads, and the lease is one.
#[cfg(feature = "ldk")]
#[tokio::test(flavor = "current_thread")]
async fn one_store_serves_both_lines() {
    use lightning::util::persist::{KVStore as KVStore03, KVStoreSync as KVStoreSync03};
    let store = LdkStore::open_async(common::builder(&common::table("ldkboth"))).await.unwrap();
    KVStore::write(&store, "both", "", "from02", b"two".to_vec()).await.unwrap();
    KVStore03::write(&store, "both", "", "from03", b"three".to_vec()).await.unwrap();
    assert_eq!(KVStoreSync03::read(&store, "both", "", "from02").unwrap(), b"two");
    assert_eq!(KVStoreSync::read(&store, "both", "", "from03").unwrap(), b"three");
    store.close_async().await.unwrap();
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

fn contents<S: MigratableKVStore>(store: &S) -> BTreeMap<(String, String, String), Vec<u8>> {
    let keys = store.list_all_keys().unwrap();
    let n = keys.len();
    let map: BTreeMap<_, _> = keys
        .into_iter()
        .map(|(p, s, k)| {
            let value = KVStoreSync::read(store, &p, &s, &k).unwrap();
            ((p, s, k), value)
        })
        .collect();
    assert_eq!(map.len(), n, "list_all_keys returned no duplicates");
    map
}

/// 0.2's migration helper, FilesystemStore → pgfence → fresh FilesystemStore, in the namespaces
/// an LDK node uses; every key and value compared.
#[test]
fn migration_round_trip_through_0_2_filesystem_stores() {
    guarded("migration 0.2", || {
        let (dir_a, dir_b) = (TempDir::new("ldk02fs-a"), TempDir::new("ldk02fs-b"));
        let mut source = FilesystemStore::new(dir_a.0.clone());
        let mut n: u32 = 11;
        let mut value = |len: usize| -> Vec<u8> {
            (0..len)
                .map(|_| {
                    n = n.wrapping_mul(1_103_515_245).wrapping_add(12_345);
                    (n >> 16) as u8
                })
                .collect()
        };
        KVStoreSync::write(&source, "", "", "manager", value(40_000)).unwrap();
        KVStoreSync::write(&source, "", "", "scorer", Vec::new()).unwrap();
        for i in 0..200 {
            let key = format!("{i:064x}_{}", i % 3);
            KVStoreSync::write(&source, "monitors", "", &key, value(i % 900)).unwrap();
        }
        for chan in 0..8 {
            for update in 0..50 {
                let ns = format!("{chan:064x}_0");
                KVStoreSync::write(&source, "monitor_updates", &ns, &update.to_string(), value(64))
                    .unwrap();
            }
        }
        let original = contents(&source);
        assert_eq!(original.len(), 2 + 200 + 400, "the filesystem store holds every key");

        let mut pg = LdkStore::open(common::builder(&common::table("ldk02mig"))).unwrap();
        migrate_kv_store_data(&mut source, &mut pg).expect("filesystem -> pgfence");
        assert_eq!(contents(&pg), original, "pgfence holds every key and value");

        let mut target = FilesystemStore::new(dir_b.0.clone());
        migrate_kv_store_data(&mut pg, &mut target).expect("pgfence -> filesystem");
        assert_eq!(contents(&target), original, "every key and value survives the round trip");
        pg.close().unwrap();
    });
}
