//! `pgfence::ldk::LdkStore` through LDK's own traits: the conformance suite through the async
//! traits (`KVStore`, `PaginatedKVStore`, `MigratableKVStore`) and through the sync traits
//! (`KVStoreSync`, ...) from a plain thread, inside a multi-thread runtime and inside a
//! current-thread runtime (line.rs, shared with the 0.2 line); per-key call order of
//! async writes; error kinds; and a data migration round trip with `migrate_kv_store_data`
//! through LDK's `FilesystemStore`.
#![cfg(feature = "ldk")]

use crate::common;

use lightning::util::persist::{
    KVStore, KVStoreSync, KVStoreSyncWrapper, MigratableKVStore,
    MigratableKVStoreSync as MigratableSync, PageToken, PaginatedKVStore, PaginatedKVStoreSync,
    migrate_kv_store_data,
};
use lightning_persister::fs_store::v1::FilesystemStore;

crate::ldk_line_conformance!();

/// A page through 0.3's `PaginatedKVStore`.
fn page<'a>(
    store: &'a LdkStore,
    p: &'a str,
    s: &'a str,
    token: Option<String>,
) -> BoxFut<'a, PageOut> {
    let fut = PaginatedKVStore::list_paginated(store, p, s, token.map(PageToken::new));
    Box::pin(async move {
        let page = fut.await?;
        Ok((page.keys, page.next_page_token.map(|t| t.as_str().to_owned())))
    })
}

/// A page through 0.3's `PaginatedKVStoreSync`.
fn page_sync(store: &LdkStore, p: &str, s: &str, token: Option<String>) -> io::Result<PageOut> {
    let page = PaginatedKVStoreSync::list_paginated(store, p, s, token.map(PageToken::new))?;
    Ok((page.keys, page.next_page_token.map(|t| t.as_str().to_owned())))
}

/// Every key through 0.3's async `MigratableKVStore`.
fn all_keys(store: &LdkStore) -> BoxFut<'_, Vec<(String, String, String)>> {
    let fut = MigratableKVStore::list_all_keys(store);
    Box::pin(async move { Ok(fut.await?) })
}

fn all_keys_sync(store: &LdkStore) -> io::Result<Vec<(String, String, String)>> {
    Ok(MigratableSync::list_all_keys(store)?)
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
