//! LDK persistence: the `lightning::util::persist` traits on a fenced PostgreSQL store.
//!
//! One [`LdkStore`] implements the store traits of two `lightning` lines, each behind its own
//! cargo feature; both features may be on at once.
//!
//! - Feature `ldk`: `lightning` `=0.3.0-rc3`, the first release with every trait below.
//!   `KVStore`, `KVStoreSync`, `PaginatedKVStore`, `PaginatedKVStoreSync`, `MigratableKVStore`
//!   and `MigratableKVStoreSync` (module `v0_3`).
//! - Feature `ldk-0_2`: `lightning` `=0.2.7`, the released line that ldk-node 0.7 uses.
//!   `KVStore`, `KVStoreSync` and `MigratableKVStore` of 0.2 (module `v0_2`); 0.2 has no
//!   paginated traits.
//!
//! Hand it to LDK wherever a `KVStore` of either flavor is expected (monitor persistence,
//! `ChannelManager` and graph persistence, the output sweeper, `migrate_kv_store_data`). The
//! semantics below hold for both lines: both adapters call the same code of this module.
//!
//! # Semantics, as the traits document them
//!
//! - **Async `write`/`remove` keep the order of the calls**, not of the futures. The call takes
//!   the key's place in its order, and the operation starts at once on the store's runtime.
//!   An earlier call's value never overwrites a later one's, however the futures are polled;
//!   a dropped future's operation still runs to the end.
//! - `remove` is `Ok` whether or not the key existed; a `lazy` remove is executed eagerly.
//! - `list` of an unknown namespace is empty; keys come in byte order (LDK allows any order).
//! - `list_paginated` (0.3 only) returns keys newest-created first. An overwrite keeps a key's
//!   place. Pages hold the builder's `page_size` keys, with an opaque token that survives
//!   deletions.
//! - `list_all_keys` returns every key of the table.
//! - Errors are `lightning::io::Error`s (convertible to and from `std::io::Error`, kind and
//!   cause kept) whose kinds LDK can act on. `NotFound`: a missing key. `InvalidInput`: an
//!   invalid key or namespace; LDK's alphabet and 120-character limit are the store's own.
//!   `PermissionDenied`: the lease was lost, and this process may never write again.
//!   `AlreadyExists`: at open, the lease is held by another live store. `NotConnected`: closed.
//!   The [`crate::Error`] is kept inside: downcast `e.get_ref()` to see it.
//!
//! # Sync and async, from anywhere
//!
//! An `LdkStore` owns the runtime of a [`blocking::PgKvStore`] and runs every operation there,
//! sync or async. The store is opened there too, so that every connection of its pool is driven
//! by that runtime. The sync traits therefore work from a plain thread, from a multi-thread
//! runtime and from a current-thread runtime. LDK often calls them from async code on the
//! latter. They work without deadlock and without panic, and block the calling thread for the
//! operation.
//!
//! # Lease loss
//!
//! LDK keeps running after a failed persist unless the application stops it. A lost lease
//! means another node instance now owns the channel state: this one must stop at once. Watch
//! [`LdkStore::lease_state`] (or wait on [`LdkStore::lease_watch`] in a thread) and shut the
//! node down when it leaves `Held`; [`crate::shutdown::Watchdog`] does that in a thread, within
//! a bound. Or open the store with [`crate::LeaseLossPolicy::Abort`],
//! or with `Panic` in a binary built with `panic = "abort"`.
//! See `examples/ldk.rs`, `examples/ldk-node/` (ldk-node 0.7) and docs/ldk.md.

use std::future::Future;
use std::time::Duration;

// Both lines' `io::Error` is `bitcoin_io::Error` (both depend on bitcoin 0.32): one conversion.
use bitcoin::io;
use tokio::sync::watch;
use uuid::Uuid;

use crate::error::Result;
use crate::store::blocking::{self, owned};
use crate::{Builder, LeaseState, Standby};
#[cfg(feature = "ldk")]
use crate::{Page, PageToken};

#[cfg(feature = "ldk-0_2")]
mod v0_2;
#[cfg(feature = "ldk")]
mod v0_3;

/// A [`crate::PgKvStore`] for LDK: implements the `lightning::util::persist` store traits of
/// each enabled `lightning` line (see the [module docs](self)).
///
/// Open it with [`LdkStore::open`] (blocking) or [`LdkStore::open_async`] from any context,
/// then hand it to LDK, usually in an `Arc`. Cloning is cheap and shares one store (one lease).
/// Dropping the last handle (and the last outstanding operation) releases the lease and stops
/// the store's runtime; it never panics, in any context. It is `RefUnwindSafe` and
/// `UnwindSafe`, as LDK's test helpers require: a caught panic leaves it consistent or fail-closed.
#[derive(Debug, Clone)]
pub struct LdkStore {
    inner: blocking::PgKvStore,
}

// LDK's test helpers want `K: KVStoreSync + RefUnwindSafe`. The auto traits do not hold. The
// store's state sits behind tokio's `Mutex`, `RwLock`, `Semaphore` and `watch`. Deadpool's
// pool holds `dyn Fn` hooks. None of these implement them. The promise holds all the same:
// after a caught panic, no caller sees a broken invariant.
// - Every shared value changes in one step under its lock. The lease state is replaced whole.
//   The renewal thread's handle is only ever taken out. A key's applied version is set only
//   after its statement committed; a turn dropped while unwinding records nothing. The
//   key-order and queue maps are behind `std::sync::Mutex`es used whatever their poison.
// - The gate (`RwLock<()>`) and the statement `Semaphore` guard no data; their guards and
//   permits are given back by `Drop` while unwinding. So are pooled connections.
// - A panic in the middle of an operation is a case the store is built for:
//   `LeaseLossPolicy::Panic` raises one. The guards dropped while unwinding (a mutation whose
//   statement may have been sent) make the store fail closed. So a caller who catches the
//   panic gets `LeaseLost` from then on, never a write out of order.
// - The hooks and the connector are set at open and never change.
impl std::panic::RefUnwindSafe for LdkStore {}
impl std::panic::UnwindSafe for LdkStore {}

impl LdkStore {
    /// Opens the store, blocking the calling thread (any thread, inside a runtime or not). See
    /// [`crate::Builder::open`]; fails with [`crate::Error::LeaseHeld`] while another live
    /// store holds the lease.
    pub fn open(builder: Builder) -> Result<LdkStore> {
        Ok(LdkStore { inner: blocking::PgKvStore::open(builder)? })
    }

    /// Opens the store without blocking; the future may be awaited on any runtime. The store
    /// itself still runs on a runtime of its own (see the [module docs](self)).
    pub async fn open_async(builder: Builder) -> Result<LdkStore> {
        Ok(LdkStore {
            inner: blocking::PgKvStore::open_with_async(|stop| builder.open_until(stop)).await?,
        })
    }

    /// A standby node: waits until the lease can be taken, then opens the store (see
    /// [`Standby`]), blocking the calling thread meanwhile.
    pub fn open_standby(standby: Standby) -> Result<LdkStore> {
        Ok(LdkStore { inner: blocking::PgKvStore::open_standby(standby)? })
    }

    /// A standby node, without blocking: waits until the lease can be taken, then opens the
    /// store. Start LDK only once this returns. Dropping the future stops the standby and
    /// leaves nothing running.
    pub async fn open_standby_async(standby: Standby) -> Result<LdkStore> {
        Ok(LdkStore {
            inner: blocking::PgKvStore::open_with_async(|stop| standby.open_until(stop)).await?,
        })
    }

    /// The blocking facade this store is built on, for the store's own API (`lease_info`,
    /// `list_paginated` with pgfence's types, ...).
    pub fn blocking(&self) -> &blocking::PgKvStore {
        &self.inner
    }

    /// Watches the lease; see [`crate::PgKvStore::lease_state`]. Stop the node when it leaves
    /// [`LeaseState::Held`].
    pub fn lease_state(&self) -> watch::Receiver<LeaseState> {
        self.inner.lease_state()
    }

    /// Blocks while the lease is held, at most `timeout`; see
    /// [`blocking::PgKvStore::wait_while_held`].
    pub fn wait_while_held(&self, timeout: Duration) -> LeaseState {
        self.inner.wait_while_held(timeout)
    }

    /// A watcher of the lease that holds no store, for a watchdog thread; see
    /// [`blocking::PgKvStore::lease_watch`].
    pub fn lease_watch(&self) -> blocking::LeaseWatch {
        self.inner.lease_watch()
    }

    /// The lease epoch this store holds (the fencing token).
    pub fn fencing_token(&self) -> i64 {
        self.inner.fencing_token()
    }

    /// This store's owner id in the lease row.
    pub fn owner_id(&self) -> Uuid {
        self.inner.owner_id()
    }

    /// Closes the store, blocking: new operations fail, started ones get up to `drop_timeout`
    /// to finish, the lease is released. Returns the release's result, or `Error::Timeout` if
    /// operations were still running. See [`crate::PgKvStore::close`].
    pub fn close(&self) -> Result<()> {
        self.inner.close()
    }

    /// Closes the store without blocking; the future may be awaited on any runtime.
    pub async fn close_async(&self) -> Result<()> {
        let store = self.inner.store.clone();
        self.inner.io.spawn(async move { store.close().await }).await
    }

    /// Runs `operation` on the store's runtime; the returned future awaits it from anywhere.
    fn spawn<T: Send + 'static>(
        &self,
        operation: impl Future<Output = Result<T>> + Send + 'static,
    ) -> impl Future<Output = io::Result<T>> + Send + 'static {
        let task = self.inner.io.spawn(operation);
        async move { task.await.map_err(to_io) }
    }
}

impl From<blocking::PgKvStore> for LdkStore {
    fn from(store: blocking::PgKvStore) -> LdkStore {
        LdkStore { inner: store }
    }
}

/// `lightning::io::Error` is `bitcoin_io::Error`, not `std::io::Error`: go through the std error,
/// whose conversion keeps the kind and keeps the [`crate::Error`] as the inner error.
fn to_io(e: crate::Error) -> io::Error {
    io::Error::from(std::io::Error::from(e))
}

/// The operations both lines' traits share, written once. Each async one takes the key's place
/// in its order in the call, and starts at once on the store's runtime. The adapters only wrap
/// the returned future in their line's type.
impl LdkStore {
    fn read_sync(&self, primary: &str, secondary: &str, key: &str) -> io::Result<Vec<u8>> {
        self.inner.read(primary, secondary, key).map_err(to_io)
    }

    fn write_sync(
        &self,
        primary: &str,
        secondary: &str,
        key: &str,
        buf: Vec<u8>,
    ) -> io::Result<()> {
        self.inner.write(primary, secondary, key, buf).map_err(to_io)
    }

    fn remove_sync(&self, primary: &str, secondary: &str, key: &str, lazy: bool) -> io::Result<()> {
        self.inner.remove(primary, secondary, key, lazy).map_err(to_io)
    }

    fn list_sync(&self, primary: &str, secondary: &str) -> io::Result<Vec<String>> {
        self.inner.list(primary, secondary).map_err(to_io)
    }

    fn list_all_keys_sync(&self) -> io::Result<Vec<(String, String, String)>> {
        self.inner.list_all_keys().map_err(to_io)
    }

    fn read_async(
        &self,
        primary: &str,
        secondary: &str,
        key: &str,
    ) -> impl Future<Output = io::Result<Vec<u8>>> + 'static + Send {
        let store = self.inner.store.clone();
        let (pn, sn, key) = owned(primary, secondary, key);
        self.spawn(async move { store.read(&pn, &sn, &key).await })
    }

    fn write_async(
        &self,
        primary: &str,
        secondary: &str,
        key: &str,
        buf: Vec<u8>,
    ) -> impl Future<Output = io::Result<()>> + 'static + Send {
        // The async store takes the key's place in its order here, in the call. Spawning it now
        // starts the write whether or not the caller ever polls the returned future.
        self.spawn(self.inner.store.write(primary, secondary, key, buf))
    }

    fn remove_async(
        &self,
        primary: &str,
        secondary: &str,
        key: &str,
        lazy: bool,
    ) -> impl Future<Output = io::Result<()>> + 'static + Send {
        self.spawn(self.inner.store.remove(primary, secondary, key, lazy))
    }

    fn list_async(
        &self,
        primary: &str,
        secondary: &str,
    ) -> impl Future<Output = io::Result<Vec<String>>> + 'static + Send {
        let store = self.inner.store.clone();
        let (pn, sn, _) = owned(primary, secondary, "");
        self.spawn(async move { store.list(&pn, &sn).await })
    }

    #[cfg(feature = "ldk")]
    fn list_all_keys_async(
        &self,
    ) -> impl Future<Output = io::Result<Vec<(String, String, String)>>> + 'static + Send {
        let store = self.inner.store.clone();
        self.spawn(async move { store.list_all_keys().await })
    }

    #[cfg(feature = "ldk")]
    fn list_page_sync(
        &self,
        primary: &str,
        secondary: &str,
        token: Option<PageToken>,
    ) -> io::Result<Page> {
        self.inner.list_paginated(primary, secondary, token).map_err(to_io)
    }

    #[cfg(feature = "ldk")]
    fn list_page_async(
        &self,
        primary: &str,
        secondary: &str,
        token: Option<PageToken>,
    ) -> impl Future<Output = io::Result<Page>> + 'static + Send {
        let store = self.inner.store.clone();
        let (pn, sn, _) = owned(primary, secondary, "");
        self.spawn(async move { store.list_paginated(&pn, &sn, token).await })
    }
}
