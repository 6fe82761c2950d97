//! `PgKvStore`: open, read, write, remove, list, paginate, close.

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use deadpool_postgres::{Pool, PoolError, Runtime};
use tokio::sync::{OwnedRwLockReadGuard, RwLock, oneshot, watch};
use tokio_postgres::Row;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::ToSql;
use tracing::Instrument;
use uuid::Uuid;

use crate::coalesce::Coalescer;
use crate::config::{Builder, Source, host_name};
use crate::connect;
use crate::error::{Error, KeyPath, LossReason, Result};
use crate::keys::{TableName, check_key, check_namespaces};
use crate::lease::{Connector, Keeper, KeeperConfig, Lease, LeaseState};
use crate::ordering::{KeyOrder, Ticket};
use crate::schema::{self, Holder, LeaseInfo, SetupFailed};
use crate::sql::{self, Statements};

/// A key-value store in PostgreSQL that only the holder of the table's lease may mutate.
///
/// # Guarantees
///
/// - **Fencing.** Every `write` and `remove` runs in one SQL statement that checks, under a
///   `FOR KEY SHARE` lock on the lease row, that this store still owns an unexpired lease, and
///   mutates only if so. A takeover must change the lease row's owner, which waits for that
///   lock: no write of this store can commit after another store acquired the lease. (While
///   [`Builder::write_concurrency`] statements are busy, waiting mutations of other keys share
///   the next such statement; each call still gets its own result.)
/// - **Durability of `Ok`.** When `write` or `remove` returns `Ok`, the change is committed
///   (or was superseded by a later call to the same key that is committed).
/// - **Per-key order.** Calls to `write`/`remove` of the same key take effect in the order the
///   methods were *called*, whatever order their futures are polled or complete in: a later
///   call's value is never overwritten by an earlier one.
/// - **Fail closed.** Once the lease is lost, or renewal could not confirm it before the local
///   deadline (which comes before the database expiry), every key operation (reads, lists,
///   writes, removes, batches) returns [`Error::LeaseLost`], permanently, and
///   [`PgKvStore::lease_state`] reports [`LeaseState::Lost`]. An operation still waiting for
///   the server's answer when the local deadline passes returns then too (within about a
///   second), instead of waiting for a server that may never answer. Of the calls that read
///   the database, only [`PgKvStore::lease_info`] still answers, to show who holds the lease
///   now. The [`crate::LeaseLossPolicy`] decides whether it also panics or aborts. A mutation
///   whose statement had already locked the lease row when the loss came may still commit; a
///   successor's takeover waits for it. It returns `Ok` if its answer comes before the local
///   deadline, else `LeaseLost` with its outcome unknown (read the key back).
/// - **No leaked ownership.** `close()` releases the lease; dropping the last handle releases
///   it once the last outstanding `write`/`remove` future has finished (those futures keep the
///   lease alive and renewed). Release is by owner id, so a store that lost its lease never
///   releases its successor's; it releases its own at once, retrying about every second while
///   the database cannot be reached. A crashed store's lease is taken over after it expires.
/// - **Reads** see committed data only: a read returns the latest committed value of the key
///   at the time its statement runs.
///
/// Cloning is cheap and shares one store (one lease).
#[derive(Debug, Clone)]
pub struct PgKvStore {
    pub(crate) inner: Arc<Inner>,
}

/// The store's state, shared by every handle and every outstanding operation future.
#[derive(Debug)]
pub(crate) struct Inner {
    pub(crate) pool: Pool,
    /// False for a pool the application supplied: `close()` must not close it.
    pub(crate) owns_pool: bool,
    pub(crate) table: TableName,
    pub(crate) statements: Statements,
    pub(crate) lease: Arc<Lease>,
    pub(crate) order: Arc<KeyOrder>,
    pub(crate) closed: AtomicBool,
    /// Every operation holds a read guard while it runs ([`Inner::admit`]); `close()` takes the
    /// write guard to wait for them.
    pub(crate) gate: Arc<RwLock<()>>,
    pub(crate) keeper: tokio::sync::Mutex<Option<Keeper>>,
    pub(crate) max_value_size: usize,
    pub(crate) page_size: usize,
    pub(crate) drop_timeout: Duration,
    /// How long an operation retries a broken connection or an unavailable server.
    pub(crate) retry_for: Duration,
    /// The server process of each pooled connection, by pool object (see [`Inner::run`]).
    pub(crate) backends: Mutex<HashMap<deadpool::managed::ObjectId, Backend>>,
    /// Mutations waiting to share a statement (see [`crate::coalesce`]).
    pub(crate) coalescer: Coalescer,
}

/// An opaque position in a newest-first listing, from [`Page::next_page_token`].
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PageToken(String);

impl PageToken {
    /// Wraps a token previously taken from [`PageToken::as_str`].
    pub fn new(token: impl Into<String>) -> PageToken {
        PageToken(token.into())
    }

    /// The token as a string, to store or send elsewhere.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

/// One page of [`PgKvStore::list_paginated`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Page {
    /// Keys, newest-created first (an overwrite keeps a key's original position).
    pub keys: Vec<String>,
    /// Where the next page starts; `None` on the last page.
    pub next_page_token: Option<PageToken>,
}

/// The read/write/remove/list interface of a key-value store, as `PgKvStore` implements it.
///
/// `write` and `remove` are plain functions returning `'static + Send` futures: validation and
/// the key's place in the per-key order happen when they are called.
pub trait KvStore {
    /// Reads a value; [`Error::NotFound`] if the key does not exist.
    fn read(
        &self,
        primary_namespace: &str,
        secondary_namespace: &str,
        key: &str,
    ) -> impl Future<Output = Result<Vec<u8>>> + Send;

    /// Writes a value, creating or replacing the key.
    fn write(
        &self,
        primary_namespace: &str,
        secondary_namespace: &str,
        key: &str,
        value: Vec<u8>,
    ) -> impl Future<Output = Result<()>> + Send + 'static + use<Self>;

    /// Removes a key; removing a missing key is not an error. `lazy` removes may be executed
    /// eagerly (this store always does).
    fn remove(
        &self,
        primary_namespace: &str,
        secondary_namespace: &str,
        key: &str,
        lazy: bool,
    ) -> impl Future<Output = Result<()>> + Send + 'static + use<Self>;

    /// Lists the keys of a namespace pair (in byte order); empty for an unknown namespace.
    fn list(
        &self,
        primary_namespace: &str,
        secondary_namespace: &str,
    ) -> impl Future<Output = Result<Vec<String>>> + Send;
}

impl PgKvStore {
    /// Starts configuring a store from a connection string (`postgres://user:pass@host/db` or
    /// `host=... user=...`). An unparsable string is reported by [`Builder::open`].
    pub fn builder(connection_string: &str) -> Builder {
        match connection_string.parse::<tokio_postgres::Config>() {
            Ok(config) => Builder::new(Source::Config(Box::new(config))),
            // The parser's message never contains the string itself, so no password leaks.
            Err(e) => Builder::new(Source::Invalid(e.to_string())),
        }
    }

    /// Starts configuring a store from a `tokio_postgres::Config`.
    pub fn builder_from_config(config: tokio_postgres::Config) -> Builder {
        Builder::new(Source::Config(Box::new(config)))
    }

    /// Starts configuring a store on an existing pool. The renewal task takes one connection
    /// out of the pool for good (the pool then opens a replacement when needed, so the renewal
    /// connection comes on top of the pool's maximum); its I/O runs on the runtime that created
    /// it. Notifications cannot be received through a pooled connection, so a standby on a pool
    /// polls instead of listening. `close()` leaves the pool open. Dropping such a store inside a
    /// current-thread runtime cannot release the lease (the renewal connection's I/O needs the
    /// runtime the drop blocks); it then expires by TTL: prefer `close().await` there. For
    /// renewal fully independent of the application's runtime, use [`PgKvStore::builder`] or
    /// [`PgKvStore::builder_from_config`].
    ///
    /// The pool's connections must default to read committed. The store sets the connections
    /// it opens itself to read committed, whatever `default_transaction_isolation` the
    /// database, the role or the connection's options say, but it cannot set a pool's it did
    /// not build: under repeatable read or serializable a write that waited for a takeover would
    /// get a serialization failure (SQLSTATE 40001) instead of [`Error::LeaseLost`]. So
    /// [`Builder::open`] refuses a pool whose connections default to either
    /// ([`Error::InvalidConfig`], field `"pool"`). Where the database or role sets a stricter
    /// default, give the pool's connections `-c default_transaction_isolation=read\ committed`
    /// in their options (the backslash keeps the space in the value). A `post_create` hook that
    /// runs `SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL READ COMMITTED` passes
    /// the check too, but `RecyclingMethod::Clean` (`RESET ALL`) or a pooler's `DISCARD ALL`
    /// undoes it.
    pub fn builder_from_pool(pool: Pool) -> Builder {
        Builder::new(Source::Pool(pool))
    }

    /// Reads a value; [`Error::NotFound`] if the key does not exist.
    pub async fn read(
        &self,
        primary_namespace: &str,
        secondary_namespace: &str,
        key: &str,
    ) -> Result<Vec<u8>> {
        check_key(primary_namespace, secondary_namespace, key)?;
        let inner = &self.inner;
        let span = inner.span("read", primary_namespace, secondary_namespace, key);
        async {
            let rows = inner
                .query(
                    "read",
                    &inner.statements.read,
                    &[&primary_namespace, &secondary_namespace, &key],
                )
                .await?;
            value_or_not_found(&rows, primary_namespace, secondary_namespace, key)
        }
        .instrument(span)
        .await
    }

    /// Writes a value, creating or replacing the key. The key's place in the per-key order is
    /// taken now, in this call; the returned future does the work and may outlive this handle.
    /// `Ok` means committed under this store's lease (or superseded by a later call).
    pub fn write(
        &self,
        primary_namespace: &str,
        secondary_namespace: &str,
        key: &str,
        value: Vec<u8>,
    ) -> impl Future<Output = Result<()>> + Send + 'static + use<> {
        let inner = Arc::clone(&self.inner);
        let prepared = check_key(primary_namespace, secondary_namespace, key)
            .and_then(|()| inner.check_value(&value))
            .map(|()| inner.ticket(primary_namespace, secondary_namespace, key));
        let span = inner.span("write", primary_namespace, secondary_namespace, key);
        async move {
            let ticket = prepared?;
            let store = Arc::clone(&inner);
            let work = async move { store.mutate(ticket, Mutation::Write(value)).await };
            admitted(&inner, work.instrument(span)).await
        }
    }

    /// Removes a key; removing a missing key is `Ok`. Ordered with `write` calls to the same
    /// key like `write` itself. `lazy` is accepted for LDK's interface; removes are always
    /// executed eagerly.
    pub fn remove(
        &self,
        primary_namespace: &str,
        secondary_namespace: &str,
        key: &str,
        lazy: bool,
    ) -> impl Future<Output = Result<()>> + Send + 'static + use<> {
        let _ = lazy;
        let inner = Arc::clone(&self.inner);
        let prepared = check_key(primary_namespace, secondary_namespace, key)
            .map(|()| inner.ticket(primary_namespace, secondary_namespace, key));
        let span = inner.span("remove", primary_namespace, secondary_namespace, key);
        async move {
            let ticket = prepared?;
            let store = Arc::clone(&inner);
            let work = async move { store.mutate(ticket, Mutation::Remove).await };
            admitted(&inner, work.instrument(span)).await
        }
    }

    /// Lists the keys of a namespace pair, in byte order; empty for an unknown namespace.
    pub async fn list(
        &self,
        primary_namespace: &str,
        secondary_namespace: &str,
    ) -> Result<Vec<String>> {
        check_namespaces(primary_namespace, secondary_namespace)?;
        let inner = &self.inner;
        let span = inner.span("list", primary_namespace, secondary_namespace, "");
        async {
            let rows = inner
                .query("list", &inner.statements.list, &[&primary_namespace, &secondary_namespace])
                .await?;
            Ok(rows.iter().map(|row| row.get(0)).collect())
        }
        .instrument(span)
        .await
    }

    /// One page of a namespace pair's keys, newest-created first. Pass `None` for the first
    /// page and then each page's `next_page_token`. Keys deleted between pages never make a
    /// page repeat or skip a surviving key; keys created after the listing started are not
    /// included in later pages.
    pub async fn list_paginated(
        &self,
        primary_namespace: &str,
        secondary_namespace: &str,
        page_token: Option<PageToken>,
    ) -> Result<Page> {
        check_namespaces(primary_namespace, secondary_namespace)?;
        let before: i64 = match &page_token {
            None => i64::MAX,
            Some(token) => token.0.parse().map_err(|_| Error::InvalidKey {
                what: "page token",
                value: token.0.clone(),
                reason: "not a token returned by list_paginated",
            })?,
        };
        let inner = &self.inner;
        let span = inner.span("list_paginated", primary_namespace, secondary_namespace, "");
        async {
            let limit = inner.page_size as i64 + 1;
            let rows = inner
                .query(
                    "list_paginated",
                    &inner.statements.list_page,
                    &[&primary_namespace, &secondary_namespace, &before, &limit],
                )
                .await?;
            let more = rows.len() > inner.page_size;
            let rows = &rows[..rows.len().min(inner.page_size)];
            let next_page_token = match rows.last() {
                Some(last) if more => Some(PageToken(last.get::<_, i64>(1).to_string())),
                _ => None,
            };
            Ok(Page { keys: rows.iter().map(|row| row.get(0)).collect(), next_page_token })
        }
        .instrument(span)
        .await
    }

    /// Every key of the table as `(primary_namespace, secondary_namespace, key)`, in byte order.
    pub async fn list_all_keys(&self) -> Result<Vec<(String, String, String)>> {
        let inner = &self.inner;
        let span = inner.span("list_all_keys", "", "", "");
        async {
            let rows = inner.query("list_all_keys", &inner.statements.list_all, &[]).await?;
            Ok(rows.iter().map(|row| (row.get(0), row.get(1), row.get(2))).collect())
        }
        .instrument(span)
        .await
    }

    /// The lease epoch this store holds: the fencing token, strictly increasing with every
    /// acquisition of the table's lease. Every row records the epoch that last wrote it.
    pub fn fencing_token(&self) -> i64 {
        self.inner.lease.epoch
    }

    /// This store's owner id in the lease row (unique per acquisition).
    pub fn owner_id(&self) -> Uuid {
        self.inner.lease.owner_id
    }

    /// The table, as configured.
    pub fn table(&self) -> String {
        self.inner.table.display()
    }

    /// Watches the lease: `Held` until it is lost (`Lost { reason }`, permanent) or given up
    /// (`Released`; `Abandoned` when the store stopped but could not release it). Await `changed()` on it to learn of a loss the moment it is known.
    pub fn lease_state(&self) -> watch::Receiver<LeaseState> {
        self.inner.lease.subscribe()
    }

    /// The lease row as the database sees it now (holder, epoch, time left). It reads the
    /// database whatever this store's state: after a loss it shows the new holder. After
    /// `close()` it needs a pool that is still open (the store closes a pool it built itself).
    pub async fn lease_info(&self) -> Result<Option<LeaseInfo>> {
        let client = self.inner.pool.get().await.map_err(Error::pool("read lease"))?;
        schema::lease_info(&**client, &self.inner.statements).await
    }

    /// Closes the store: new operations get [`Error::Closed`] (including `write`/`remove`
    /// futures created earlier but not yet polled); operations already running finish
    /// (including mutations still waiting for their key's turn or for a shared statement),
    /// waiting at most `drop_timeout` for them; renewal stops and the lease is released by
    /// owner id (expired now; the epoch counter is kept), so another store can open at once.
    /// Returns the release's result, or [`Error::Timeout`] if operations were still running
    /// (those that need a connection after that get [`Error::Closed`]).
    /// Closing again returns `Ok` once nothing runs any more (while operations still hang, it
    /// waits `drop_timeout` for them too and returns `Timeout`).
    ///
    /// After a loss, the lost lease's row is released too, by owner id (a successor's lease is
    /// never touched), if the renewal thread's own attempts have not done it yet; the result is
    /// that release's: `Ok` when the row is released or was no longer this store's. The loss
    /// itself was reported by the operations and [`PgKvStore::lease_state`]. Except under
    /// [`crate::LeaseLossPolicy::Panic`] when renewal found the loss: the renewal thread ended
    /// with its panic after a single attempt to release, and nothing releases the lease any
    /// more (if that attempt failed, it expires by TTL), so `close()` returns
    /// [`Error::LeaseLost`].
    pub async fn close(&self) -> Result<()> {
        let inner = &self.inner;
        inner.closed.store(true, Ordering::SeqCst);
        // Releasing while an operation still runs is safe (a takeover still waits for its
        // FOR KEY SHARE lock), so a hung operation only delays close() by `drop_timeout`.
        let finished = tokio::time::timeout(inner.drop_timeout, inner.gate.write()).await;
        // Held across the release, so a concurrent close() returns only once it is done.
        let mut keeper = inner.keeper.lock().await;
        let result = match keeper.take() {
            Some(keeper) => keeper.shutdown().await,
            None => Ok(()),
        };
        drop(keeper);
        if inner.owns_pool {
            inner.pool.close();
        }
        match finished {
            Ok(_) => result,
            Err(_) => {
                tracing::warn!(after = ?inner.drop_timeout,
                    "pgfence closed while operations were still running");
                result.and(Err(Error::Timeout {
                    operation: "close: wait for running operations",
                    after: inner.drop_timeout,
                }))
            }
        }
    }
}

impl KvStore for PgKvStore {
    fn read(
        &self,
        primary_namespace: &str,
        secondary_namespace: &str,
        key: &str,
    ) -> impl Future<Output = Result<Vec<u8>>> + Send {
        PgKvStore::read(self, primary_namespace, secondary_namespace, key)
    }

    fn write(
        &self,
        primary_namespace: &str,
        secondary_namespace: &str,
        key: &str,
        value: Vec<u8>,
    ) -> impl Future<Output = Result<()>> + Send + 'static + use<> {
        PgKvStore::write(self, primary_namespace, secondary_namespace, key, value)
    }

    fn remove(
        &self,
        primary_namespace: &str,
        secondary_namespace: &str,
        key: &str,
        lazy: bool,
    ) -> impl Future<Output = Result<()>> + Send + 'static + use<> {
        PgKvStore::remove(self, primary_namespace, secondary_namespace, key, lazy)
    }

    fn list(
        &self,
        primary_namespace: &str,
        secondary_namespace: &str,
    ) -> impl Future<Output = Result<Vec<String>>> + Send {
        PgKvStore::list(self, primary_namespace, secondary_namespace)
    }
}

/// A change of one key: by `write`, `remove`, or as part of a batch.
#[derive(Debug)]
pub(crate) enum Mutation {
    Write(Vec<u8>),
    Remove,
}

impl Inner {
    pub(crate) fn ticket(
        &self,
        primary_namespace: &str,
        secondary_namespace: &str,
        key: &str,
    ) -> Ticket {
        self.order.ticket(KeyPath::new(primary_namespace, secondary_namespace, key))
    }

    /// What the caller of a mutation gets if the task running it is dropped unfinished (its
    /// runtime shut down): the lease's loss if a statement was left with an unknown outcome
    /// (see [`OutcomePending`]; after a release, `LeaseLost` with `WriteOutcomeUnknown` all the
    /// same), `Closed` otherwise.
    pub(crate) fn abandoned(&self) -> impl FnOnce() -> Error + Send + 'static + use<> {
        let lease = Arc::clone(&self.lease);
        move || match lease.check() {
            Err(Error::Closed) | Ok(()) if lease.dropped_unknown() => lease.fail_outcome_unknown(),
            Err(e) => e,
            Ok(()) => Error::Closed,
        }
    }

    pub(crate) fn check_value(&self, value: &[u8]) -> Result<()> {
        if value.len() > self.max_value_size {
            return Err(Error::ValueTooLarge { len: value.len(), max: self.max_value_size });
        }
        Ok(())
    }

    pub(crate) fn span(
        &self,
        operation: &'static str,
        primary: &str,
        secondary: &str,
        key: &str,
    ) -> tracing::Span {
        tracing::debug_span!(
            "pgfence",
            operation,
            table = %self.table.display(),
            primary_namespace = primary,
            secondary_namespace = secondary,
            key,
            epoch = self.lease.epoch,
        )
    }

    /// Admits an operation, at once (never waiting): [`Error::Closed`] once `close()` has
    /// begun; otherwise the guard, held until the operation ends, makes `close()` wait for it.
    /// A mutation is admitted when its future is first polled, before it waits for its key's
    /// turn or a shared statement.
    pub(crate) fn admit(&self) -> Result<OwnedRwLockReadGuard<()>> {
        if self.closed.load(Ordering::SeqCst) {
            return Err(Error::Closed);
        }
        // Only close() takes the write lock (setting `closed` first), and while it waits for
        // it no read lock is granted: a failure here means the store is closing.
        Arc::clone(&self.gate).try_read_owned().map_err(|_| Error::Closed)
    }

    /// Runs one fenced mutation in its key's turn (see [`crate::coalesce`]).
    async fn mutate(&self, ticket: Ticket, mutation: Mutation) -> Result<()> {
        let Some(turn) = ticket.turn().await else {
            // A later call to this key is already committed: nothing to write. But a store
            // that has lost its lease still fails, as every key operation (and an all-superseded
            // batch) does: `Ok` would vouch for a key a successor may have overwritten since.
            return self.lease.check();
        };
        self.apply_coalesced(ticket.path(), mutation).await?;
        turn.applied();
        Ok(())
    }

    /// Runs one mutation in its own fenced statement, while the caller holds its key's turn.
    pub(crate) async fn apply_alone(&self, path: &KeyPath, mutation: &Mutation) -> Result<()> {
        let owner = self.lease.owner_id;
        let (pn, sn, key) = (&path.primary_namespace, &path.secondary_namespace, &path.key);
        match mutation {
            Mutation::Write(value) => {
                self.fenced("write", &self.statements.write, &[&owner, pn, sn, key, value]).await
            }
            Mutation::Remove => {
                self.fenced("remove", &self.statements.remove, &[&owner, pn, sn, key]).await
            }
        }
    }

    /// Runs a fenced mutation statement (one that returns whether the lease was held) while
    /// the caller holds the turns of every key it changes. `Ok` means committed.
    pub(crate) async fn fenced(
        &self,
        operation: &'static str,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<()> {
        self.run(operation, sql, params, true).await.map(drop)
    }

    /// Runs a read-only statement and returns its rows.
    pub(crate) async fn query(
        &self,
        operation: &'static str,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<Row>> {
        let _running = self.admit()?;
        self.run(operation, sql, params, false).await
    }

    /// Runs a prepared statement (prepared once per pooled connection) and returns its rows,
    /// for an operation already admitted ([`Inner::admit`]).
    ///
    /// Fails fast with `LeaseLost` before touching the database. A broken
    /// connection or an unavailable server is retried on a fresh connection, with backoff,
    /// while the lease is locally valid and for at most `retry_for`.
    ///
    /// For a mutation, a connection that broke after the statement was sent leaves its outcome
    /// unknown, and worse, its server process may still be running it: PostgreSQL notices a
    /// vanished client only when it next writes to the socket, so the statement can commit
    /// later, after a retry and after a later call of the same key. So before retrying, the
    /// old server process is terminated and awaited: once it is gone its transaction is
    /// decided, and the retry (which writes the same value, under the same key turns) lands
    /// after it. If that cannot be confirmed, the store fails closed rather than risk a later
    /// call being overwritten.
    ///
    /// An attempt still unanswered at the local deadline (as the renewal thread reports it,
    /// within about a second) is abandoned: the store fails closed
    /// (`DeadlinePassed`) and the caller learns that at once, whether the server is hung or
    /// the network holds the connection open without passing data (a mutation sent gets
    /// `LeaseLost` even if `close()` released the lease right after the deadline was seen);
    /// the connection is closed rather than handed back to the pool.
    ///
    /// A mutation that ends in an error after such an attempt may have committed all the same.
    /// Its callers' turns would then be released as not applied, and an earlier call of the
    /// same key could run and overwrite the committed value; so the store fails closed
    /// (`WriteOutcomeUnknown`) instead of returning that error. So it does if the mutation's
    /// task is dropped (its runtime shut down) after such an attempt and before a retry was
    /// answered, between attempts included. If the store was closed meanwhile (`close()` gave
    /// up waiting and released the lease), the caller gets `LeaseLost` (`WriteOutcomeUnknown`)
    /// too, not `Closed`, which would read as "not written".
    async fn run(
        &self,
        operation: &'static str,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
        mutation: bool,
    ) -> Result<Vec<Row>> {
        // Armed from the first attempt that broke after it was sent until this returns: the
        // old session being gone only means nothing of it can land *later*; it may have
        // committed already. Every return settles it: `Ok` is a committed retry, and every
        // error after such an attempt has failed the store closed already.
        let mut unresolved = None;
        let mut result = self.attempts(operation, sql, params, mutation, &mut unresolved).await;
        if mutation {
            // A fenced statement answers whether the lease was held; if not, it wrote nothing.
            result = result.and_then(|rows| match rows.first().is_some_and(|row| row.get(0)) {
                true => Ok(rows),
                false => Err(self.lease.fail(LossReason::Fenced)),
            });
        }
        if let Some(unresolved) = unresolved {
            unresolved.settled();
            if matches!(result, Err(Error::Closed)) {
                // Closed (the lease released) after an attempt that may have committed: the
                // caller must not take `Closed` for "not written". (Order is safe: after the
                // release no statement of this store can commit.)
                result = Err(self.lease.fail_outcome_unknown());
            }
        }
        result
    }

    /// The attempts of [`Inner::run`]; arms `unresolved` once one may have committed.
    async fn attempts<'a>(
        &'a self,
        operation: &'static str,
        sql: &str,
        params: &[&(dyn ToSql + Sync)],
        mutation: bool,
        unresolved: &mut Option<OutcomePending<'a>>,
    ) -> Result<Vec<Row>> {
        let started = tokio::time::Instant::now();
        let mut backoff = Duration::from_millis(50);
        loop {
            self.lease.check()?;
            let mut sent_to: Option<Backend> = None;
            let mut pending: Option<OutcomePending<'_>> = None;
            let attempt = async {
                let client = self.pool.get().await.map_err(|e| self.pool_error(operation, e))?;
                let client = Checkout(Some(client));
                let statements = async {
                    let backend = if mutation { Some(self.backend(&client).await?) } else { None };
                    let statement =
                        client.prepare_cached(sql).await.map_err(Error::db(operation))?;
                    pending = backend.is_some().then(|| OutcomePending { lease: &self.lease });
                    sent_to = backend;
                    client.query(&statement, params).await.map_err(Error::db(operation))
                };
                let rows = statements.await;
                client.answered(); // Each statement sent got its answer, an error included.
                rows
            };
            let answered = tokio::select! {
                biased;
                result = attempt => Some(result),
                () = self.lease.deadline_reported() => None,
            };
            let Some(result) = answered else {
                // No answer by the local deadline (a server or network that stopped answering
                // with the connection still up: renewal cannot confirm the lease either, or it
                // would have moved the deadline). The store fails closed now, as every later
                // operation would; a mutation sent may still commit, as one that locked the
                // lease row before a loss may, and its caller is told its outcome is unknown:
                // `LeaseLost`, also if a close() released the lease since the deadline was
                // seen (`deadline_reported` returns only while the lease is not given up, but
                // a release can land right after).
                tracing::error!(
                    operation,
                    "pgfence gave up waiting for the server at the local deadline"
                );
                let Some(pending) = pending else {
                    return Err(self.lease.fail(LossReason::DeadlinePassed)); // Nothing sent.
                };
                pending.settled(); // The loss is reported here, to the caller.
                return Err(self.lease.fail_sent(LossReason::DeadlinePassed));
            };
            let gone = match (&result, &sent_to) {
                (Err(e), Some(backend)) if e.is_retryable() => {
                    // Armed once, by the first attempt that broke, and built lazily: a guard
                    // built for a later one and dropped, armed, would fail the store closed at
                    // once (and abort the process under `Abort`) instead of letting the
                    // retries go on.
                    unresolved.get_or_insert_with(|| OutcomePending { lease: &self.lease });
                    self.await_backend_gone(backend).await
                }
                _ => Ok(()),
            };
            // The outcome is known, or the old session is gone, or (`gone` is Err) the store
            // has already failed closed.
            if let Some(pending) = pending {
                pending.settled();
            }
            gone?;
            match result {
                Err(e) if e.is_retryable() && started.elapsed() + backoff < self.retry_for => {
                    tracing::warn!(operation, error = %e, ?backoff, "pgfence retrying on a fresh connection");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(1));
                }
                Err(e) if unresolved.is_some() => {
                    tracing::error!(operation, error = %e,
                        "pgfence mutation failed after an attempt that may have committed");
                    return Err(self.lease.fail_outcome_unknown());
                }
                result => return result,
            }
        }
    }

    /// A pool's error, but `Closed` when the pool is closed because the store is: `close()`
    /// closes the store's own pool once it stops waiting for running operations, and one that
    /// needs a connection after that (a write still queued for a statement, say) was closed
    /// over, as the caller should read it, not failed by the pool.
    fn pool_error(&self, operation: &'static str, e: deadpool_postgres::PoolError) -> Error {
        match e {
            deadpool_postgres::PoolError::Closed if self.closed.load(Ordering::SeqCst) => {
                Error::Closed
            }
            e => Error::pool(operation)(e),
        }
    }

    /// The server process behind a pooled connection, asked once per connection.
    async fn backend(&self, client: &deadpool_postgres::Object) -> Result<Backend> {
        let id = deadpool_postgres::Object::id(client);
        let known = self.backends.lock().unwrap_or_else(|e| e.into_inner()).get(&id).cloned();
        if let Some(backend) = known {
            return Ok(backend);
        }
        let row = client
            .query_one(sql::BACKEND_IDENTITY, &[])
            .await
            .map_err(Error::db("identify connection"))?;
        let started: Option<SystemTime> = row.get(1);
        let Some(started) = started else {
            // open() checked this; a role change since (SET ROLE in a pool hook?) breaks it.
            return Err(Error::config("role", "the connection cannot see its own session"));
        };
        let backend = Backend { pid: row.get(0), started };
        let mut backends = self.backends.lock().unwrap_or_else(|e| e.into_inner());
        if backends.len() >= 4 * self.pool.status().max_size.max(16) {
            // Entries of connections long gone; the live ones are asked again on next use.
            backends.clear();
        }
        backends.insert(id, backend.clone());
        Ok(backend)
    }

    /// Terminates the server process of a connection that broke under a mutation and waits
    /// until it is gone (see [`Inner::run`]). Fails closed if that cannot be confirmed in time,
    /// that is within `retry_for` and before the local deadline.
    async fn await_backend_gone(&self, backend: &Backend) -> Result<()> {
        let started = tokio::time::Instant::now();
        let mut backoff = Duration::from_millis(20);
        loop {
            // A lost lease fails every later operation of this store, so no later call can be
            // overwritten; the old statement, if it commits, still commits before any takeover.
            self.lease.check()?;
            let attempt = async {
                let client = self.pool.get().await.map_err(Error::pool("end broken session"))?;
                let client = Checkout(Some(client));
                let params: [&(dyn ToSql + Sync); 2] = [&backend.pid, &backend.started];
                let ended = async {
                    client.query(sql::TERMINATE_BACKEND, &params).await?;
                    while client.query_opt(sql::BACKEND_ALIVE, &params).await?.is_some() {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                    Ok(())
                };
                let ended = ended.await.map_err(Error::db("end broken session"));
                client.answered(); // Each statement sent got its answer, an error included.
                ended
            };
            let left = self.retry_for.saturating_sub(started.elapsed());
            let outcome = tokio::select! {
                biased;
                outcome = tokio::time::timeout(left, attempt) => outcome,
                () = self.lease.deadline_reported() => {
                    return Err(self.lease.fail(LossReason::DeadlinePassed));
                }
            };
            match outcome {
                Ok(Ok(())) => {
                    tracing::debug!(pid = backend.pid, "pgfence broken session is gone");
                    return Ok(());
                }
                Ok(Err(e)) if e.is_retryable() && started.elapsed() + backoff < self.retry_for => {
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(1));
                }
                Ok(Err(e)) => {
                    tracing::error!(pid = backend.pid, error = %e,
                        "pgfence cannot end the session of a write with an unknown outcome");
                    return Err(self.lease.fail(LossReason::WriteOutcomeUnknown));
                }
                Err(_) => {
                    tracing::error!(
                        pid = backend.pid,
                        "pgfence session of a write with an unknown outcome did not end in time"
                    );
                    return Err(self.lease.fail(LossReason::WriteOutcomeUnknown));
                }
            }
        }
    }
}

/// The value of a `READ` result, or [`Error::NotFound`] naming the key.
pub(crate) fn value_or_not_found(
    rows: &[Row],
    primary_namespace: &str,
    secondary_namespace: &str,
    key: &str,
) -> Result<Vec<u8>> {
    match rows.first() {
        Some(row) => Ok(row.get(0)),
        None => Err(Error::NotFound(Box::new(KeyPath::new(
            primary_namespace,
            secondary_namespace,
            key,
        )))),
    }
}

/// A PostgreSQL server process: its pid and start time (a pid alone may be reused).
#[derive(Debug, Clone)]
pub(crate) struct Backend {
    pid: i32,
    started: SystemTime,
}

/// Runs a mutation admitted when its future is first polled ([`Inner::admit`]) in a task of
/// its own ([`detached`]), holding its admission until it ends, so `close()` waits for it.
pub(crate) async fn admitted<T: Send + 'static>(
    inner: &Inner,
    work: impl Future<Output = Result<T>> + Send + 'static,
) -> Result<T> {
    let running = inner.admit()?;
    let abandoned = inner.abandoned();
    detached(
        async move {
            let _running = running;
            work.await
        },
        abandoned,
    )
    .await
}

/// Runs work as a task of its own and waits for it. Dropping the caller's future then cannot
/// interrupt the work halfway: a mutation keeps its key's turn until its statement is over
/// (otherwise a later call of the key could run first and be overwritten by the orphaned
/// statement), and an `open()` that has committed its lease still starts renewal (the store is
/// then dropped, which releases the lease). A panic in the task (`LeaseLossPolicy::Panic`) is
/// resumed in the caller. If the task is dropped unfinished (its runtime shut down while the
/// caller waits from elsewhere), the caller gets `abandoned()`.
pub(crate) async fn detached<T: Send + 'static>(
    work: impl Future<Output = Result<T>> + Send + 'static,
    abandoned: impl FnOnce() -> Error,
) -> Result<T> {
    match tokio::spawn(work).await {
        Ok(result) => result,
        Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
        // The task was dropped unfinished: only when its runtime shuts down.
        Err(_) => Err(abandoned()),
    }
}

/// A pooled connection in use by one attempt. It goes back to the pool once its statements
/// are answered, with a result or an error ([`Checkout::answered`]); dropped before, because
/// the attempt was abandoned at the local deadline, or a read's caller dropped its future, or
/// its task was dropped, it is taken out of the pool: the next user would otherwise queue
/// behind the unanswered statement, on a hung server for good. (Dropping it closes the
/// connection at once: deadpool aborts the task of a connection taken out of its pool.)
struct Checkout(Option<deadpool_postgres::Object>);

impl Checkout {
    fn answered(mut self) {
        drop(self.0.take()); // Back to the pool.
    }
}

impl std::ops::Deref for Checkout {
    type Target = deadpool_postgres::Object;

    fn deref(&self) -> &deadpool_postgres::Object {
        self.0.as_ref().expect("a checkout holds its connection until answered or dropped")
    }
}

impl Drop for Checkout {
    fn drop(&mut self) {
        if let Some(object) = self.0.take() {
            discard(object);
        }
    }
}

/// Armed while a mutation's statement may be running on the server and its outcome is not
/// known yet. Dropped armed, because the task running the statement was dropped (its runtime
/// shut down) or unwound by a panic, it marks the lease lost (`WriteOutcomeUnknown`): nobody
/// will learn that outcome, the key's turn is gone with the task, and the statement may still
/// commit after a later call of the same key. [`OutcomePending::settled`] disarms it.
/// [`Inner::run`] also keeps one armed from an attempt that broke after it was sent until a
/// retry is answered: that attempt may have committed, and the turn, handed on as not applied,
/// would let an earlier call of the key overwrite it.
struct OutcomePending<'a> {
    lease: &'a Lease,
}

impl OutcomePending<'_> {
    /// The statement's outcome is known (or, after a broken connection, its server process is
    /// confirmed gone): nothing of it can land later.
    fn settled(self) {
        std::mem::forget(self); // Holds only a reference: nothing leaks.
    }
}

impl Drop for OutcomePending<'_> {
    fn drop(&mut self) {
        tracing::error!(
            "pgfence mutation dropped while its statement may still be running on the server"
        );
        self.lease.lose_unreported(LossReason::WriteOutcomeUnknown);
    }
}

impl Drop for Inner {
    /// The last handle and the last outstanding operation are gone: stop renewal and release
    /// the lease, waiting at most `drop_timeout`. The release runs on the renewal thread's own
    /// runtime, so this works in any runtime flavor or none.
    fn drop(&mut self) {
        let keeper = self.keeper.get_mut().take();
        if let Some(keeper) = keeper {
            keeper.shutdown_blocking(self.drop_timeout);
        }
    }
}

impl Builder {
    /// The pool the store's operations use: built from the configuration (fast recycling:
    /// a broken connection is noticed on use and retried), or the one supplied.
    pub(crate) fn pool(&self) -> Result<Pool> {
        let config = match &self.source {
            Source::Config(_) => self.connection_config().expect("a config source"),
            Source::Pool(pool) => return Ok(pool.clone()),
            Source::Invalid(reason) => {
                return Err(Error::config("connection string", reason.clone()));
            }
        };
        let manager = self.tls.manager(config);
        Pool::builder(manager)
            .post_create(connect::read_committed(self.connect_timeout))
            .max_size(self.pool_size)
            .runtime(Runtime::Tokio1)
            .create_timeout(Some(self.connect_timeout))
            .recycle_timeout(Some(self.connect_timeout))
            .build()
            .map_err(|e| Error::config("pool", e.to_string()))
    }

    /// Checks the options, connects, creates or migrates the schema and takes the lease, all in
    /// one transaction. Fails with [`Error::LeaseHeld`] (and changes nothing) while another
    /// live store holds the lease. Creates the database if it does not exist and the role may.
    ///
    /// A table that never had planner statistics gets them (`ANALYZE`) once the lease is
    /// taken, as the last step; best effort: held up for longer than one TTL (by a lock, or a
    /// server that stopped answering), it is given up and the store returned without them.
    ///
    /// Dropping the returned future cancels the setup if it is still waiting (for the setup
    /// lock of a concurrent `open()`, at the fence for the old holder's in-flight writes, or for
    /// a server that stopped answering): nothing is committed and the lease is never taken
    /// later. If the commit was sent and not yet answered, that setup's server process is
    /// ended and the lease released by its owner id, in case the commit took it (within
    /// `connect_timeout`; otherwise it expires by its TTL). A store already opened (gathering
    /// statistics) is closed, which releases the lease. A connection left waiting for an
    /// answer is closed, never handed back to a pool. That cancellation runs on in the
    /// background, on the current runtime; to give up and know it is done (before the runtime
    /// shuts down, say), use [`Builder::open_until`].
    pub async fn open(self) -> Result<PgKvStore> {
        self.open_until(std::future::pending()).await?.ok_or(Error::Closed)
    }

    /// [`Builder::open`], given up when `stop` completes first, as when its future is dropped:
    /// a setup still waiting is cancelled (nothing committed, the lease never taken later), a
    /// commit sent and unanswered is ended and its lease released, a store already opened is
    /// closed. `Ok(None)` then, returned only once all that is done (the server has received
    /// the cancel request, and acts on it at once): nothing of this opening is left running on
    /// the runtime, nor waiting on the server, so the runtime may shut down right after (at
    /// process exit, say). Against a server that stopped answering, it returns as promptly:
    /// the connection waiting for it is closed (its task aborted; the server, if it ever
    /// answers again, rolls back what was not committed), a cancel request that cannot be
    /// delivered (over TLS it needs the server's answer) is given up after `connect_timeout`,
    /// and so is the release of a commit that gets no answer (the lease, if the commit took
    /// it, then expires by its TTL); closing a store already opened waits up to
    /// `drop_timeout` for its release, as [`PgKvStore::close`] does. `stop` is, for example, a
    /// signal, a shutdown channel or a timer.
    pub async fn open_until(self, stop: impl Future<Output = ()>) -> Result<Option<PgKvStore>> {
        let table = self.validate()?;
        // Dropped when the caller gives up: tells the task that nobody waits for the store.
        let (caller, gone) = oneshot::channel::<()>();
        let opening = self.open_here(table, gone).instrument(tracing::Span::current());
        let opening = detached(opening, || Error::Closed);
        tokio::pin!(opening);
        tokio::select! {
            biased;
            opened = &mut opening => opened.map(Some),
            () = stop => {
                drop(caller);
                match opening.await {
                    Ok(store) => {
                        if let Err(e) = store.close().await {
                            tracing::warn!(error = %e, "pgfence open stopped after its commit; releasing failed");
                        }
                    }
                    Err(e) => tracing::debug!(error = %e, "pgfence open stopped"),
                }
                Ok(None)
            }
        }
    }

    async fn open_here(
        self,
        table: TableName,
        mut caller: oneshot::Receiver<()>,
    ) -> Result<PgKvStore> {
        let statements = Statements::new(&table);
        let deadline_after = self.deadline();
        let pool = self.pool()?;
        let (connector, config) = match &self.source {
            Source::Config(_) => {
                let config = self.connection_config().expect("a config source");
                (Connector::Config(Box::new(config.clone()), self.tls.clone()), Some(config))
            }
            Source::Pool(pool) => (Connector::Pool(pool.clone()), None),
            Source::Invalid(_) => unreachable!("validate() rejects an invalid source"),
        };

        // Every wait for the server below ends when the caller is gone (`Error::Closed`), so
        // that `open_until` returns at its stop even from a server that stopped answering. A
        // connection left with a statement unanswered then is closed, never handed back to a
        // pool (the application's own, with `builder_from_pool`): its next user would queue
        // behind that statement, and a cancel request may land late.
        let connecting = connect(&pool, config.as_ref(), &self.tls, self.connect_timeout);
        let mut client = unless_abandoned(&mut caller, connecting).await?;
        let holder = Holder {
            owner_id: Uuid::new_v4(),
            host: host_name(),
            pid: std::process::id() as i32,
            app: self.application_name.clone(),
        };
        // Quick statements (they wait for no lock), so given up after `connect_timeout`: a
        // pooled connection that went silent while idle (a middlebox that hung) then costs this
        // attempt, which a standby retries, instead of holding it up for good.
        let checks = async {
            if let Source::Pool(_) = &self.source {
                check_pool_isolation(&client).await?;
            }
            // Known before the setup, so that a setup whose commit goes unanswered can be ended.
            identify(&client).await
        };
        let backend = match answered_in_time(&mut caller, self.connect_timeout, checks).await {
            Some(checked) => checked?,
            None => {
                discard(client);
                return Err(match is_abandoned(&mut caller) {
                    true => Error::Closed,
                    false => Error::Timeout {
                        operation: "check connection",
                        after: self.connect_timeout,
                    },
                });
            }
        };
        let acquired = schema::setup_and_acquire(
            &mut client,
            (&self.tls, self.connect_timeout),
            &mut caller,
            &table,
            &statements,
            self.lease_ttl,
            &holder,
        )
        .await;
        let acquired = match acquired {
            Ok(acquired) => acquired,
            Err(SetupFailed { error, commit_unanswered }) => {
                if is_abandoned(&mut caller) || commit_unanswered {
                    // Closed before the release below needs a connection of the same pool.
                    discard(client);
                }
                if let Some(backend) = backend.filter(|_| commit_unanswered) {
                    let owner_id = holder.owner_id;
                    let release =
                        release_unanswered_setup(&pool, &table, &statements, &backend, owner_id);
                    if tokio::time::timeout(self.connect_timeout, release).await.is_err() {
                        tracing::warn!(table = %table.display(),
                            "pgfence could not release a lease whose setup commit went unanswered in time; it expires by its TTL");
                    }
                }
                return Err(error);
            }
        };
        tracing::info!(table = %table.display(), epoch = acquired.epoch,
            owner_id = %acquired.owner_id, "pgfence lease acquired");

        let lease = Arc::new(Lease::new(
            acquired.owner_id,
            acquired.epoch,
            table.display(),
            acquired.started,
            deadline_after,
            self.on_lease_lost,
        ));
        let keeper_config = KeeperConfig {
            connector,
            renew_sql: statements.renew.clone(),
            release_sql: statements.release.clone(),
            notify_channel: acquired.channel.clone(),
            ttl: self.lease_ttl,
            renew_interval: self.renew_every(),
            connect_timeout: self.connect_timeout,
            release_timeout: self.drop_timeout,
        };
        let keeper = match Keeper::spawn(Arc::clone(&lease), keeper_config) {
            Ok(keeper) => keeper,
            Err(e) => {
                // No renewal means no lease: give it back now rather than by TTL, whether or not
                // the caller is still there. Not waited for beyond `connect_timeout` (a server
                // that stopped answering would hold the opening up for good); the lease then
                // expires by its TTL, and the connection, left with the release unanswered, is
                // closed rather than handed back to the pool.
                let params: [&(dyn ToSql + Sync); 2] = [&acquired.owner_id, &acquired.channel];
                let release = client.query(&statements.release, &params);
                match tokio::time::timeout(self.connect_timeout, release).await.ok() {
                    Some(Ok(_)) => drop(client),
                    Some(Err(release)) => {
                        tracing::error!(error = %release, "pgfence could not release after a failed start");
                    }
                    None => {
                        tracing::error!(table = %table.display(),
                            "pgfence gave up releasing after a failed start; the lease expires by its TTL");
                        discard(client);
                    }
                }
                return Err(e);
            }
        };
        // A table that never had statistics gets them now, so point reads and removes use the
        // primary key rather than the pagination index (without any, the planner may scan a
        // whole namespace through the latter: measured 1-2.5 ms instead of 0.2 ms per read on
        // 4,096 keys). Autovacuum keeps them fresh later; an analyzed table is not delayed.
        // Best effort: ANALYZE locks nothing writers need. After the renewal thread started, so
        // that a cancelled open() cannot leave a committed lease without renewal and release.
        // Not waited for beyond one TTL, nor once the caller is gone: a lock held by someone
        // else, or a server that stopped answering, would otherwise hold up the opened store
        // (its lease taken) for as long.
        let analyzing = async {
            match client.query_one(sql::NEVER_ANALYZED, &[&table.quoted("")]).await {
                Ok(row) if row.get::<_, bool>(0) => client.batch_execute(&statements.analyze).await,
                other => other.map(drop),
            }
        };
        match answered_in_time(&mut caller, self.lease_ttl, analyzing).await {
            Some(Ok(())) => drop(client), // Back to the pool.
            Some(Err(e)) => {
                tracing::warn!(error = %e, "pgfence could not check or gather table statistics");
            }
            None => {
                tracing::warn!(table = %table.display(),
                    "pgfence gave up gathering table statistics (held up, or open() abandoned)");
                if let Err(e) = self.tls.cancel(&client.cancel_token(), self.connect_timeout).await
                {
                    tracing::warn!(error = %e, "pgfence could not cancel gathering statistics");
                }
                discard(client);
            }
        }
        Ok(PgKvStore {
            inner: Arc::new(Inner {
                pool,
                owns_pool: !matches!(self.source, Source::Pool(_)),
                table,
                statements,
                lease,
                order: Arc::new(KeyOrder::default()),
                closed: AtomicBool::new(false),
                gate: Arc::new(RwLock::new(())),
                keeper: tokio::sync::Mutex::new(Some(keeper)),
                max_value_size: self.max_value_size,
                page_size: self.page_size,
                drop_timeout: self.drop_timeout,
                retry_for: self.lease_ttl,
                backends: Mutex::new(HashMap::new()),
                coalescer: Coalescer::new(self.write_concurrency),
            }),
        })
    }
}

/// A store on a pool passed in runs its mutations on connections it did not open, so it cannot
/// set them to read committed as it does its own (see `sql::READ_COMMITTED`; the renewal
/// thread sets its own connection of the pool). It refuses a pool whose connections default to
/// repeatable read or serializable, rather than meet a serialization failure where a write
/// should report the takeover it waited for as a lost lease. Read uncommitted is read committed
/// in PostgreSQL.
async fn check_pool_isolation(client: &tokio_postgres::Client) -> Result<()> {
    let level: String = client
        .query_one(sql::DEFAULT_ISOLATION, &[])
        .await
        .map_err(Error::db("check default isolation"))?
        .get(0);
    if matches!(level.as_str(), "read committed" | "read uncommitted") {
        return Ok(());
    }
    Err(Error::config(
        "pool",
        format!(
            "its connections default to {level} isolation (default_transaction_isolation); \
             pgfence needs read committed: set it on the pool's connections with the \
             connection option `-c default_transaction_isolation=read\\ committed`"
        ),
    ))
}

/// A connection of the pool, creating the database first if it does not exist (and the role
/// may; only with a connection config, `config`).
async fn connect(
    pool: &Pool,
    config: Option<&tokio_postgres::Config>,
    tls: &connect::Tls,
    connect_timeout: Duration,
) -> Result<deadpool_postgres::Object> {
    match pool.get().await {
        Err(PoolError::Backend(e)) if e.code() == Some(&SqlState::INVALID_CATALOG_NAME) => {
            let Some(config) = config else {
                let source = Box::new(PoolError::Backend(e));
                return Err(Error::Pool { operation: "connect", source });
            };
            schema::create_database(config, tls, connect_timeout).await?;
            pool.get().await.map_err(Error::pool("connect"))
        }
        other => other.map_err(Error::pool("connect")),
    }
}

/// `work`, unless the caller of `open()` is gone first (`caller` closed): `Error::Closed` then,
/// and `work` is dropped.
async fn unless_abandoned<T>(
    caller: &mut oneshot::Receiver<()>,
    work: impl Future<Output = Result<T>>,
) -> Result<T> {
    tokio::select! {
        biased;
        _ = caller => Err(Error::Closed),
        done = work => done,
    }
}

/// `work`, unless the caller of `open()` is gone first or `limit` passes: `None` then, and
/// `work` is dropped (a connection it left with a statement unanswered must be discarded).
async fn answered_in_time<T>(
    caller: &mut oneshot::Receiver<()>,
    limit: Duration,
    work: impl Future<Output = T>,
) -> Option<T> {
    tokio::select! {
        biased;
        _ = caller => None,
        done = tokio::time::timeout(limit, work) => done.ok(),
    }
}

/// Whether the caller of `open()` is gone.
fn is_abandoned(caller: &mut oneshot::Receiver<()>) -> bool {
    caller.try_recv() != Err(oneshot::error::TryRecvError::Empty)
}

/// Closes a connection of the pool instead of handing it back (see [`Checkout`]).
fn discard(client: deadpool_postgres::Object) {
    drop(deadpool_postgres::Object::take(client));
}

/// The server process of a connection: `None` when the role cannot see it (the setup then
/// refuses the role).
async fn identify(client: &tokio_postgres::Client) -> Result<Option<Backend>> {
    let row = client
        .query_one(sql::BACKEND_IDENTITY, &[])
        .await
        .map_err(Error::db("identify connection"))?;
    let started: Option<SystemTime> = row.get(1);
    Ok(started.map(|started| Backend { pid: row.get(0), started }))
}

/// After a setup whose commit went unanswered (its connection broke): that commit may have
/// taken the lease, and no store would renew or release it, so it would stay held by nobody
/// until it expires (a standby retrying would wait for it). Ends the setup's server process,
/// waits until it is gone (its transaction is decided then: a release before that could miss
/// a commit still on its way), and releases the lease by the setup's owner id, which matches
/// nothing if the commit did not happen. Best effort: the lease expires by its TTL otherwise.
async fn release_unanswered_setup(
    pool: &Pool,
    table: &TableName,
    statements: &Statements,
    backend: &Backend,
    owner_id: Uuid,
) {
    let operation = "release after an unanswered setup commit";
    let attempt = async {
        // Closed, not handed back, if this attempt is given up with a statement unanswered
        // (the caller's timeout): the pool may be the application's own.
        let client = Checkout(Some(pool.get().await.map_err(Error::pool(operation))?));
        let params: [&(dyn ToSql + Sync); 2] = [&backend.pid, &backend.started];
        let released = async {
            client.query(sql::TERMINATE_BACKEND, &params).await?;
            while client.query_opt(sql::BACKEND_ALIVE, &params).await?.is_some() {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            let channel = schema::notify_channel(&***client, table).await?;
            client.query(&statements.release, &[&owner_id, &channel]).await
        };
        let released = released.await;
        client.answered();
        released.map_err(Error::db(operation))
    };
    match attempt.await {
        Ok(rows) if rows.is_empty() => {
            tracing::debug!(table = %table.display(), "pgfence unanswered setup commit took no lease");
        }
        Ok(_) => tracing::warn!(table = %table.display(), %owner_id,
            "pgfence released the lease of a setup whose commit went unanswered"),
        Err(e) => tracing::warn!(table = %table.display(), error = %e,
            "pgfence could not release the lease of a setup whose commit went unanswered; it expires by its TTL"),
    }
}

/// Tests that need the store's internals and a database.
#[cfg(test)]
mod db_tests {
    use super::*;
    use pgfence_testing::{Proxy, TestServer, unique_name};

    /// After a loss found by an operation, the release is retried on a new connection when the
    /// renewal thread's own one went silent (a proxy holds back all its traffic; new
    /// connections get through): the lease is released within seconds, not at its expiry.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn release_after_a_loss_does_not_wait_on_a_silent_connection() {
        let server = TestServer::shared().unwrap();
        let proxy = Proxy::start(server.tcp_addr().unwrap()).await.unwrap();
        let t = unique_name("silentrelease");
        let store = PgKvStore::builder_from_config(server.config_via(proxy.addr()))
            .table(&t)
            .lease_ttl(Duration::from_secs(30))
            .renew_interval(Duration::from_secs(2))
            .connect_timeout(Duration::from_secs(2))
            .drop_timeout(Duration::from_secs(2))
            .open()
            .await
            .unwrap();
        let admin = server.connect().await.unwrap();
        let renewal = "SELECT client_port FROM pg_stat_activity
                        WHERE state = 'idle' AND query LIKE '%SET expires_at = clock_timestamp() + $2%'";
        let port: i32 = loop {
            if let Some(row) = admin.query_opt(renewal, &[]).await.unwrap() {
                break row.get(0);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        proxy.stall(u16::try_from(port).unwrap());
        let lost = store.inner.lease.fail(LossReason::WriteOutcomeUnknown);
        assert!(lost.is_lease_lost(), "{lost:?}");
        let held = format!("SELECT expires_at > clock_timestamp() FROM \"{t}_lease\"");
        let started = std::time::Instant::now();
        while admin.query_one(&held, &[]).await.unwrap().get::<_, bool>(0) {
            let waited = started.elapsed();
            assert!(waited < Duration::from_secs(15), "still held {waited:?} after the loss");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        println!("released {:?} after the loss", started.elapsed());
    }
}
