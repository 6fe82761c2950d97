//! A synchronous facade over the async store, for applications without an async runtime, in
//! the way the `postgres` crate wraps `tokio-postgres`.
//!
//! [`PgKvStore`] owns a small multi-thread tokio runtime of its own ("pgfence-io" threads).
//! Every call spawns the async store's operation on that runtime. It waits for the result on a
//! plain `std` channel. So it works wherever it is called from:
//!
//! - a thread without any runtime;
//! - a task of a multi-thread runtime;
//! - the only thread of a current-thread runtime.
//!
//! It never calls `block_on` on the caller's runtime, and never needs that runtime to make
//! progress. The store is opened on the facade's runtime, so every pooled connection's I/O task
//! runs there. The lease renewal runs on a thread of its own. So a current-thread runtime never
//! blocks on its own I/O, the classic deadlock of sync-over-async facades. The exception is a
//! store built on a pool whose connections the caller's runtime created: see
//! [`PgKvStore::open`].
//!
//! A call blocks the calling thread until the operation finishes. Inside async code, that is
//! what a synchronous API means. Prefer the async store there when you can.
//!
//! The guarantees and errors are those of [`crate::PgKvStore`]: fencing, per-key call order,
//! durability of `Ok` (or, for the deferred calls, of the next `flush`), fail closed with [`Error::LeaseLost`], release on close or drop. Under
//! [`crate::LeaseLossPolicy::Panic`], the panic is raised in the thread that made the call.
//!
//! ```no_run
//! use pgfence::PgKvStore;
//!
//! let store = pgfence::blocking::PgKvStore::open(
//!     PgKvStore::builder("postgres://app@db.internal/node").table("node_state"),
//! )?;
//! store.write("monitors", "", "chan_1", b"state".to_vec())?;
//! assert_eq!(store.read("monitors", "", "chan_1")?, b"state");
//! store.close()?;
//! # Ok::<(), pgfence::Error>(())
//! ```

use std::any::Any;
use std::future::Future;
use std::panic::{self, AssertUnwindSafe};
use std::pin::Pin;
use std::sync::{Arc, mpsc};
use std::task::{Context, Poll, Wake, Waker};
use std::thread;
use std::time::{Duration, Instant};

use tokio::sync::watch;
use uuid::Uuid;

use crate::error::{Error, Result};
use crate::{Builder, LeaseInfo, LeaseState, Page, PageToken, Standby};

/// Worker threads of the facade's runtime. One would do for the I/O. A second keeps a
/// multi-MiB value's encoding from delaying every other operation of the store.
const WORKER_THREADS: usize = 2;

/// How long dropping the last handle, outside any async context, waits for the facade's runtime
/// threads to stop. Operations have all finished by then; this only bounds the thread exits.
const SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(5);

/// A blocking handle on a [`crate::PgKvStore`], with the same guarantees and errors.
///
/// Open it with [`PgKvStore::open`] (or [`Builder::open_blocking`]) from any thread, inside or
/// outside an async runtime. Cloning is cheap and shares one store (one lease) and one runtime.
///
/// Every method blocks the calling thread until the store's async operation has finished. That
/// operation runs on the facade's own runtime.
///
/// Writes and removes take their place in the key's order when they are called, like the async
/// store's. So calls made from several threads to the same key take effect in the order they
/// were made. `Ok` means committed under this store's lease.
///
/// Dropping the last handle releases the lease, waiting at most the builder's `drop_timeout`.
/// It then shuts the runtime down. It never panics, in any context.
#[derive(Debug, Clone)]
pub struct PgKvStore {
    /// The async store, opened on `io`. Dropped before `io` (declaration order), so the lease
    /// is released before the runtime stops.
    pub(crate) store: crate::PgKvStore,
    pub(crate) io: Arc<IoRuntime>,
}

impl PgKvStore {
    /// Opens a store from an async [`Builder`], on a new runtime of the facade's own.
    ///
    /// As in [`Builder::open`], the options are checked, and the schema is created or migrated
    /// and the lease taken in one transaction. It fails with [`Error::LeaseHeld`] while another
    /// live store holds the lease.
    ///
    /// With [`crate::PgKvStore::builder_from_pool`], hand over a pool nothing else uses. A
    /// connection is driven by the runtime that created it. The facade creates its own
    /// connections on its runtime. But connections your code created on your runtime would
    /// stall while a blocking call holds that runtime's thread. On a current-thread runtime
    /// that is a deadlock.
    pub fn open(builder: Builder) -> Result<PgKvStore> {
        PgKvStore::open_with(super::open::open(builder))
    }

    /// Waits as a standby until the lease can be taken, then opens the store (see
    /// [`Standby`]). It blocks the calling thread meanwhile. `builder.standby().timeout(..)`
    /// bounds the wait.
    pub fn open_standby(standby: Standby) -> Result<PgKvStore> {
        PgKvStore::open_with(standby.open())
    }

    /// Runs an opening future on a new facade runtime, so that everything the store creates
    /// (pooled connections and their I/O tasks) belongs to that runtime.
    fn open_with(
        open: impl Future<Output = Result<crate::PgKvStore>> + Send + 'static,
    ) -> Result<PgKvStore> {
        let io = IoRuntime::new()?;
        let store = io.block_on(open)?;
        Ok(PgKvStore { store, io })
    }

    /// Like [`PgKvStore::open_with`], without blocking the caller. The returned future may be
    /// awaited on any runtime.
    ///
    /// `open` gets a future that completes when the returned future is dropped: an
    /// `open_until`'s `stop`. So dropping it cancels the opening and stops a waiting standby.
    /// The opening runs to its end all the same. It keeps the facade's runtime alive until the
    /// cancellation is done. So a setup waiting on the server is cancelled there, not left
    /// waiting by a runtime shut down under it.
    #[cfg(any(feature = "ldk", feature = "ldk-0_2"))]
    pub(crate) async fn open_with_async<F>(
        open: impl FnOnce(Pin<Box<dyn Future<Output = ()> + Send>>) -> F,
    ) -> Result<PgKvStore>
    where
        F: Future<Output = Result<Option<crate::PgKvStore>>> + Send + 'static,
    {
        let io = IoRuntime::new()?;
        let (_caller, gone) = tokio::sync::oneshot::channel::<()>();
        let stop = Box::pin(async move {
            let _ = gone.await; // Err once `_caller` is dropped with this future.
        });
        let store = io.spawn(open(stop)).await?;
        // `None` only once stopped, i.e. when this future was dropped: nobody gets this error.
        let store = store.ok_or(Error::Closed)?;
        Ok(PgKvStore { store, io })
    }

    /// Reads a value; [`Error::NotFound`] if the key does not exist.
    pub fn read(
        &self,
        primary_namespace: &str,
        secondary_namespace: &str,
        key: &str,
    ) -> Result<Vec<u8>> {
        let store = self.store.clone();
        let (pn, sn, key) = owned(primary_namespace, secondary_namespace, key);
        self.io.block_on(async move { store.read(&pn, &sn, &key).await })
    }

    /// Writes a value, creating or replacing the key. `Ok` means committed under this store's
    /// lease (or superseded by a later call to the same key, which is committed).
    pub fn write(
        &self,
        primary_namespace: &str,
        secondary_namespace: &str,
        key: &str,
        value: Vec<u8>,
    ) -> Result<()> {
        // The key's place in its order is taken here, in the call.
        self.io.block_on(self.store.write(primary_namespace, secondary_namespace, key, value))
    }

    /// [`PgKvStore::write`], committed without waiting for its WAL flush, as
    /// [`crate::PgKvStore::write_deferred`] (which has the promise). `Ok` means committed, not
    /// yet durable: [`PgKvStore::flush`] makes it so.
    pub fn write_deferred(
        &self,
        primary_namespace: &str,
        secondary_namespace: &str,
        key: &str,
        value: Vec<u8>,
    ) -> Result<()> {
        let store = &self.store;
        self.io.block_on(store.write_deferred(primary_namespace, secondary_namespace, key, value))
    }

    /// [`PgKvStore::remove`], committed without waiting for its WAL flush, as
    /// [`crate::PgKvStore::remove_deferred`].
    pub fn remove_deferred(
        &self,
        primary_namespace: &str,
        secondary_namespace: &str,
        key: &str,
    ) -> Result<()> {
        self.io.block_on(self.store.remove_deferred(primary_namespace, secondary_namespace, key))
    }

    /// Returns once every deferred mutation of this store that returned `Ok` before this call
    /// is durable, as [`crate::PgKvStore::flush`] (which has the details). After a server crash
    /// since they returned, it fails with [`Error::DeferredWritesLost`] instead.
    pub fn flush(&self) -> Result<()> {
        self.io.block_on(self.store.flush())
    }

    /// Removes a key; removing a missing key is `Ok`. `lazy` removes are executed eagerly.
    pub fn remove(
        &self,
        primary_namespace: &str,
        secondary_namespace: &str,
        key: &str,
        lazy: bool,
    ) -> Result<()> {
        self.io.block_on(self.store.remove(primary_namespace, secondary_namespace, key, lazy))
    }

    /// Starts an empty atomic batch of puts and removes (see [`crate::Batch`]); apply it with
    /// [`PgKvStore::commit`].
    pub fn batch(&self) -> crate::Batch {
        self.store.batch()
    }

    /// Applies an atomic batch built with [`PgKvStore::batch`]: all or nothing, one fence
    /// check, one statement. Every key's place in its order is taken in this call, as in
    /// [`crate::Batch::commit`]. `Ok` means committed under this store's lease.
    pub fn commit(&self, batch: crate::Batch) -> Result<()> {
        self.io.block_on(batch.commit())
    }

    /// [`PgKvStore::commit`], without waiting for the WAL flush, as
    /// [`crate::Batch::commit_deferred`].
    pub fn commit_deferred(&self, batch: crate::Batch) -> Result<()> {
        self.io.block_on(batch.commit_deferred())
    }

    /// Lists the keys of a namespace pair, sorted; empty for an unknown namespace.
    pub fn list(&self, primary_namespace: &str, secondary_namespace: &str) -> Result<Vec<String>> {
        let store = self.store.clone();
        let (pn, sn, _) = owned(primary_namespace, secondary_namespace, "");
        self.io.block_on(async move { store.list(&pn, &sn).await })
    }

    /// One page of a namespace pair's keys, newest-created first; see
    /// [`crate::PgKvStore::list_paginated`].
    pub fn list_paginated(
        &self,
        primary_namespace: &str,
        secondary_namespace: &str,
        page_token: Option<PageToken>,
    ) -> Result<Page> {
        let store = self.store.clone();
        let (pn, sn, _) = owned(primary_namespace, secondary_namespace, "");
        self.io.block_on(async move { store.list_paginated(&pn, &sn, page_token).await })
    }

    /// Every key of the table as `(primary_namespace, secondary_namespace, key)`, sorted.
    pub fn list_all_keys(&self) -> Result<Vec<(String, String, String)>> {
        let store = self.store.clone();
        self.io.block_on(async move { store.list_all_keys().await })
    }

    /// A snapshot of the store's counters, latencies, lease and pool, as
    /// [`crate::PgKvStore::stats`]. It never blocks on the database.
    pub fn stats(&self) -> crate::Stats {
        self.store.stats()
    }

    /// The lease epoch this store holds (the fencing token).
    pub fn fencing_token(&self) -> i64 {
        self.store.fencing_token()
    }

    /// This store's owner id in the lease row.
    pub fn owner_id(&self) -> Uuid {
        self.store.owner_id()
    }

    /// The table, as configured.
    pub fn table(&self) -> String {
        self.store.table()
    }

    /// Watches the lease, as [`crate::PgKvStore::lease_state`]. `borrow()` works from any
    /// thread; `changed()` may be awaited on any runtime. Without a runtime, use
    /// [`PgKvStore::wait_while_held`].
    pub fn lease_state(&self) -> watch::Receiver<LeaseState> {
        self.store.lease_state()
    }

    /// Blocks while the lease is held, at most `timeout` (`Duration::MAX`: no limit). It
    /// returns the lease state then:
    ///
    /// - [`LeaseState::Lost`], [`LeaseState::Released`] or [`LeaseState::Abandoned`] if the
    ///   lease ended;
    /// - [`LeaseState::Held`] on timeout.
    ///
    /// For a watchdog thread, take a [`PgKvStore::lease_watch`] instead. A store handle kept by
    /// the watchdog would keep the lease alive after the application dropped its own.
    pub fn wait_while_held(&self, timeout: Duration) -> LeaseState {
        self.lease_watch().wait_while_held(timeout)
    }

    /// A watcher of the lease that holds no store. A watchdog thread takes one and waits in
    /// [`LeaseWatch::wait_while_held`]. It stops the application when the lease leaves `Held`.
    /// Unlike a store handle, it does not keep the lease alive. When the application drops its
    /// last handle, the lease is released. The watchdog then sees `Released`, or `Abandoned` if
    /// the release failed.
    pub fn lease_watch(&self) -> LeaseWatch {
        LeaseWatch(self.store.lease_state())
    }

    /// The lease row as the database sees it now (holder, epoch, time left).
    pub fn lease_info(&self) -> Result<Option<LeaseInfo>> {
        let store = self.store.clone();
        self.io.block_on(async move { store.lease_info().await })
    }

    /// Closes the store, as [`crate::PgKvStore::close`] does. New operations get
    /// [`Error::Closed`]. Started ones get up to `drop_timeout` to finish. Then the lease is
    /// released. It returns the release's result, or [`Error::Timeout`] if operations were still
    /// running.
    pub fn close(&self) -> Result<()> {
        let store = self.store.clone();
        self.io.block_on(async move { store.close().await })
    }
}

/// The state of a store's lease, watched without holding the store (see
/// [`PgKvStore::lease_watch`]). Cheap to clone; `Send`, for a watchdog thread.
#[derive(Debug, Clone)]
pub struct LeaseWatch(pub(crate) watch::Receiver<LeaseState>);

/// Watches an async store's lease: `LeaseWatch::from(store.lease_state())`, for a watchdog
/// thread (the `Watchdog` of the `shutdown` module waits on one).
impl From<watch::Receiver<LeaseState>> for LeaseWatch {
    fn from(receiver: watch::Receiver<LeaseState>) -> LeaseWatch {
        LeaseWatch(receiver)
    }
}

impl LeaseWatch {
    /// The state now.
    pub fn state(&self) -> LeaseState {
        self.0.borrow().clone()
    }

    /// Blocks the calling thread while the lease is held, at most `timeout` (`Duration::MAX`:
    /// no limit). It returns the state then:
    ///
    /// - [`LeaseState::Lost`], [`LeaseState::Released`] or [`LeaseState::Abandoned`] if the
    ///   lease ended; a store that is gone published one of them;
    /// - [`LeaseState::Held`] on timeout.
    ///
    /// It needs no runtime: the thread parks until the state changes.
    pub fn wait_while_held(&mut self, timeout: Duration) -> LeaseState {
        let until = Instant::now().checked_add(timeout);
        let waker = Waker::from(Arc::new(Unpark(thread::current())));
        let mut cx = Context::from_waker(&waker);
        {
            let mut ended =
                std::pin::pin!(self.0.wait_for(|s| !matches!(s, LeaseState::Held { .. })));
            // An error only once the store is gone; its last state is kept all the same.
            while ended.as_mut().poll(&mut cx).is_pending() {
                match until {
                    None => thread::park(),
                    Some(until) => match until.checked_duration_since(Instant::now()) {
                        Some(left) if !left.is_zero() => thread::park_timeout(left),
                        _ => break,
                    },
                }
            }
        }
        self.state()
    }
}

/// Wakes a thread parked in [`LeaseWatch::wait_while_held`].
pub(crate) struct Unpark(pub(crate) thread::Thread);

impl Wake for Unpark {
    fn wake(self: Arc<Self>) {
        self.0.unpark();
    }
}

/// The three names of a key, owned, to move into a task on the facade's runtime.
pub(crate) fn owned(primary: &str, secondary: &str, key: &str) -> (String, String, String) {
    (primary.to_owned(), secondary.to_owned(), key.to_owned())
}

/// The facade's own runtime, shared by every handle of one store and by every task it runs.
#[derive(Debug)]
pub(crate) struct IoRuntime {
    /// `Some` until dropped.
    runtime: Option<tokio::runtime::Runtime>,
}

impl IoRuntime {
    pub(crate) fn new() -> Result<Arc<IoRuntime>> {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(WORKER_THREADS)
            .thread_name("pgfence-io")
            .enable_all()
            .build()
            .map_err(|source| Error::Runtime { source })?;
        Ok(Arc::new(IoRuntime { runtime: Some(runtime) }))
    }

    fn handle(&self) -> &tokio::runtime::Handle {
        self.runtime.as_ref().expect("the runtime is only taken by drop").handle()
    }

    /// Runs `future` on this runtime and blocks the calling thread until it has finished.
    ///
    /// The wait is a `std` channel receive: legal on any thread, including a runtime's worker
    /// (where `Runtime::block_on` or `oneshot::blocking_recv` would panic). A panic of the
    /// operation (the `Panic` loss policy) is resumed in the caller.
    pub(crate) fn block_on<T: Send + 'static>(
        &self,
        future: impl Future<Output = Result<T>> + Send + 'static,
    ) -> Result<T> {
        let (done, result) = mpsc::sync_channel(1);
        self.handle().spawn(async move {
            let outcome = CatchUnwind(Box::pin(future)).await;
            let _ = done.send(outcome); // The caller waits for it; it cannot have gone.
        });
        match result.recv() {
            Ok(Ok(output)) => output,
            Ok(Err(panic)) => panic::resume_unwind(panic),
            // The task was dropped unfinished: only a runtime shutdown does that, and the
            // caller's handle keeps the runtime up. Report it as the store being closed.
            Err(mpsc::RecvError) => Err(Error::Closed),
        }
    }

    /// Spawns `future` on this runtime now. It returns a future of its output that may be
    /// awaited on any runtime or executor. The work runs to the end even if the returned future
    /// is dropped. It keeps the runtime alive until then, as the async store's mutation futures
    /// keep the lease alive. A panic of the operation is resumed in the awaiting task.
    #[cfg(any(feature = "ldk", feature = "ldk-0_2"))]
    pub(crate) fn spawn<T: Send + 'static>(
        self: &Arc<Self>,
        future: impl Future<Output = Result<T>> + Send + 'static,
    ) -> impl Future<Output = Result<T>> + Send + 'static {
        let keep_alive = Arc::clone(self);
        let task = self.handle().spawn(async move {
            let output = future.await;
            drop(keep_alive);
            output
        });
        let keep_alive = Arc::clone(self);
        async move {
            let joined = task.await;
            drop(keep_alive);
            match joined {
                Ok(output) => output,
                Err(e) if e.is_panic() => panic::resume_unwind(e.into_panic()),
                Err(_) => Err(Error::Closed), // Cancelled: only at runtime shutdown, see block_on.
            }
        }
    }
}

impl Drop for IoRuntime {
    /// Dropping a tokio runtime inside an async context panics. Waiting for its threads there
    /// would block a runtime thread. That may be a thread of this very runtime, when the last
    /// reference goes with a finished task. So inside any runtime, it shuts down in the
    /// background. Elsewhere, it waits a bounded time for the threads to exit.
    fn drop(&mut self) {
        if let Some(runtime) = self.runtime.take() {
            if tokio::runtime::Handle::try_current().is_ok() {
                runtime.shutdown_background();
            } else {
                runtime.shutdown_timeout(SHUTDOWN_TIMEOUT);
            }
        }
    }
}

/// Catches a panic of the wrapped future, so `block_on` can hand it to the waiting caller.
/// Otherwise the caller would be left with a closed channel and no explanation.
struct CatchUnwind<F>(Pin<Box<F>>);

impl<F: Future> Future for CatchUnwind<F> {
    type Output = std::result::Result<F::Output, Box<dyn Any + Send>>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        // Unwind safety: a panicking future is never polled again, and the caller re-raises the
        // panic, exactly as tokio's own JoinHandle would.
        match panic::catch_unwind(AssertUnwindSafe(|| self.0.as_mut().poll(cx))) {
            Ok(Poll::Pending) => Poll::Pending,
            Ok(Poll::Ready(output)) => Poll::Ready(Ok(output)),
            Err(panic) => Poll::Ready(Err(panic)),
        }
    }
}
