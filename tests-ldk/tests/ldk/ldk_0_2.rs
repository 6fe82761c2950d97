//! `pgfence::ldk::LdkStore` through the traits of the released `lightning` 0.2 line (feature
//! `ldk-0_2`, the line ldk-node 0.7 uses): the same conformance suite as ldk.rs
//! (line.rs), through the async `KVStore` and through `KVStoreSync` from a plain
//! thread and inside either kind of runtime; and a migration round trip with 0.2's
//! `migrate_kv_store_data` through 0.2's `FilesystemStore`. With both LDK features on, one store
//! serves both lines at once.
#![cfg(feature = "ldk-0_2")]

use crate::common;

use lightning_0_2::util::persist::{
    KVStore, KVStoreSync, KVStoreSyncWrapper, MigratableKVStore as MigratableSync,
    migrate_kv_store_data,
};
use lightning_persister_0_2::fs_store::FilesystemStore;

crate::ldk_line_conformance!();

/// 0.2 has no paginated trait: the suite's paging checks go through the store's own listing,
/// which a 0.2 node never calls.
fn page_sync(store: &LdkStore, p: &str, s: &str, token: Option<String>) -> io::Result<PageOut> {
    let page = store.blocking().list_paginated(p, s, token.map(|t| pgfence::PageToken::new(&t)))?;
    Ok((page.keys, page.next_page_token.map(|t| t.as_str().to_owned())))
}

fn page<'a>(
    store: &'a LdkStore,
    p: &'a str,
    s: &'a str,
    token: Option<String>,
) -> BoxFut<'a, PageOut> {
    Box::pin(async move { page_sync(store, p, s, token) })
}

/// `list_all_keys` is sync in 0.2, for the async facade too.
fn all_keys_sync(store: &LdkStore) -> io::Result<Vec<(String, String, String)>> {
    Ok(MigratableSync::list_all_keys(store)?)
}

fn all_keys(store: &LdkStore) -> BoxFut<'_, Vec<(String, String, String)>> {
    Box::pin(async move { all_keys_sync(store) })
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
