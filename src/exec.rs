//! The statement executor: it admits operations and runs each statement.
//!
//! It retries a statement on a fresh connection, and fails closed when an outcome cannot be
//! known. Every key operation of [`crate::PgKvStore`] ends here. The SQL it runs comes from
//! [`crate::sql`].

use std::collections::HashMap;
use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use tokio::sync::{OwnedRwLockReadGuard, RwLock};
use tokio_postgres::Row;
use tokio_postgres::types::ToSql;

use crate::error::{Error, KeyPath, LossReason, Result};
use crate::keys::TableName;
use crate::lease::{Keeper, Lease};
use crate::session::PoolMode;
use crate::sql::{self, Statement, Statements};
use crate::stats::{Op, PoolStats};

/// The statement executor: the store's pool, lease and renewal thread, shared by every handle
/// and every outstanding operation future. The last one dropped releases the lease.
#[derive(Debug)]
pub(crate) struct Executor {
    pub(crate) pool: crate::connect::Pool,
    /// False for a pool the application supplied: `close()` must not close it.
    pub(crate) owns_pool: bool,
    pub(crate) table: TableName,
    pub(crate) statements: Statements,
    pub(crate) lease: Arc<Lease>,
    pub(crate) closed: AtomicBool,
    /// Every operation holds a read guard while it runs ([`Executor::admit`]); `close()` takes the
    /// write guard to wait for them.
    pub(crate) gate: Arc<RwLock<()>>,
    pub(crate) keeper: tokio::sync::Mutex<Option<Keeper>>,
    pub(crate) page_size: usize,
    pub(crate) drop_timeout: Duration,
    /// How long an operation retries a broken connection or an unavailable server.
    pub(crate) retry_for: Duration,
    /// The server process of each pooled connection, by pool object (see [`Executor::run`]).
    pub(crate) backends: Mutex<HashMap<deadpool::managed::ObjectId, Backend>>,
}

impl Executor {
    /// What the caller of a mutation gets if the task running it is dropped unfinished, when
    /// its runtime shut down, say.
    ///
    /// It is the lease's loss if a statement was left with an unknown outcome (see
    /// [`OutcomePending`]). After a release, that is `LeaseLost` with `WriteOutcomeUnknown` all
    /// the same. Otherwise it is `Closed`.
    pub(crate) fn abandoned(&self) -> impl FnOnce() -> Error + Send + 'static + use<> {
        let lease = Arc::clone(&self.lease);
        move || match lease.check() {
            Err(Error::Closed) | Ok(()) if lease.dropped_unknown() => lease.fail_outcome_unknown(),
            Err(e) => e,
            Ok(()) => Error::Closed,
        }
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

    /// Admits an operation at once, never waiting. It fails with [`Error::Closed`] once
    /// `close()` has begun. Otherwise it returns a guard, held until the operation ends, that
    /// makes `close()` wait for it.
    /// A mutation is admitted when its future is first polled, before it waits for its key's
    /// turn or a shared statement.
    pub(crate) fn admit(&self) -> Result<OwnedRwLockReadGuard<()>> {
        if self.closed.load(Ordering::SeqCst) {
            return Err(Error::Closed);
        }
        // Only close() takes the write lock (setting `closed` first). While it waits for it,
        // no read lock is granted. So a failure here means the store is closing.
        Arc::clone(&self.gate).try_read_owned().map_err(|_| Error::Closed)
    }

    /// Runs a fenced mutation statement (one that returns whether the lease was held) while
    /// the caller holds the turns of every key it changes. `Ok` means committed.
    pub(crate) async fn fenced(
        &self,
        operation: &'static str,
        sql: &Statement,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<()> {
        self.run(operation, sql, params, true).await.map(drop)
    }

    /// Runs a read-only statement and returns its rows.
    pub(crate) async fn query(
        &self,
        operation: &'static str,
        sql: &Statement,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<Row>> {
        let _running = self.admit()?;
        self.run(operation, sql, params, false).await
    }

    /// Counts an operation of kind `op` that started at `started` and ended with `result`. A
    /// key not found is an answer, not an error.
    pub(crate) fn record<T>(&self, op: Op, started: std::time::Instant, result: &Result<T>) {
        let failed = matches!(result, Err(e) if !e.is_not_found());
        let stats = &self.lease.stats;
        stats.operation(op, started.elapsed(), failed);
        if cfg!(feature = "metrics") {
            stats.pool(&self.pool_stats()); // The pool's gauges: only the facade needs them now.
        }
    }

    /// The pool's state now.
    pub(crate) fn pool_stats(&self) -> PoolStats {
        let status = self.pool.status();
        PoolStats {
            max_size: status.max_size,
            size: status.size,
            in_use: status.size.saturating_sub(status.available),
            waiting: status.waiting,
        }
    }

    /// Runs a prepared statement (prepared once per pooled connection) and returns its rows,
    /// for an operation already admitted ([`Executor::admit`]).
    ///
    /// Fails fast with `LeaseLost` before touching the database. A broken
    /// connection or an unavailable server is retried on a fresh connection, with backoff.
    /// Retries go on while the lease is locally valid, and for at most `retry_for`.
    ///
    /// # A connection that broke after a mutation was sent
    ///
    /// The mutation's outcome is unknown. Worse, its server process may still be running it.
    /// PostgreSQL notices a vanished client only when it next writes to the socket. So the
    /// statement can commit later, after a retry and after a later call of the same
    /// key. So before retrying, the old server process is terminated and awaited. Once it is
    /// gone, its transaction is decided. The retry writes the same value under the same key
    /// turns, and lands after it. If that cannot be confirmed, the store fails closed rather
    /// than risk a later call being overwritten. See docs/design.md, section "A broken
    /// connection mid-write".
    ///
    /// # An attempt unanswered at the local deadline
    ///
    /// The renewal thread reports the deadline within about a second. The attempt is then
    /// abandoned, and its connection closed rather than handed back to the pool. The store
    /// fails closed (`DeadlinePassed`), and the caller learns that at once. That holds whether
    /// the server is hung or the network holds the connection open without passing data. See
    /// docs/design.md,
    /// section "A server that stops answering". A mutation already sent gets `LeaseLost`. It
    /// does even if `close()` released the lease right after the deadline was seen.
    ///
    /// # An error after an attempt that may have committed
    ///
    /// Its callers' turns would be released as not applied. An earlier call of the same key
    /// could then run and overwrite the committed value. So the store fails closed
    /// (`WriteOutcomeUnknown`) instead of returning that error. It does too if the mutation's
    /// task is dropped before a retry was answered, between attempts included. If `close()`
    /// gave up waiting and released the lease meanwhile, the caller still gets `LeaseLost`
    /// (`WriteOutcomeUnknown`). `Closed` would read as "not written".
    async fn run(
        &self,
        operation: &'static str,
        sql: &Statement,
        params: &[&(dyn ToSql + Sync)],
        mutation: bool,
    ) -> Result<Vec<Row>> {
        // Armed from the first attempt that broke after it was sent until this returns. The
        // old session being gone only means nothing of it can land *later*. It may have
        // committed already. Every return settles it: `Ok` is a committed retry. Every error
        // after such an attempt has failed the store closed already.
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
        result.map_err(|e| e.for_role(self.pool.role()))
    }

    /// The attempts of [`Executor::run`]; arms `unresolved` once one may have committed.
    async fn attempts<'a>(
        &'a self,
        operation: &'static str,
        sql: &Statement,
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
                let client =
                    self.pool.raw().get().await.map_err(|e| self.pool_error(operation, e))?;
                let client = Checkout(Some(client));
                let statements = async {
                    let backend = if mutation { Some(self.backend(&client).await?) } else { None };
                    let statement = self
                        .pool
                        .mode()
                        .prepare_cached(&client, sql)
                        .await
                        .map_err(Error::db(operation))?;
                    pending = backend.is_some().then(|| OutcomePending { lease: &self.lease });
                    sent_to = backend;
                    statement.query(&client, params).await.map_err(Error::db(operation))
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
                // No answer by the local deadline. A server or network stopped answering with
                // the connection still up. Renewal cannot confirm the lease either, or it would
                // have moved the deadline. The store fails closed now, as every later operation
                // would. A mutation sent may still commit, as one that locked the lease row
                // before a loss may. Its caller is told its outcome is unknown: `LeaseLost`.
                // That holds also if a close() released the lease since the deadline was seen.
                // (`deadline_reported` returns only while the lease is not given up, but a
                // release can land right after.)
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
                    // Armed once, by the first attempt that broke, and built lazily. A guard
                    // built for a later one and dropped, armed, would fail the store closed at
                    // once, and abort the process under `Abort`. The retries could not go on.
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
                    tracing::warn!(operation, error = %e, ?backoff, "pgfence retrying on a fresh \
                        connection");
                    self.lease.stats.retried();
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

    /// A pool's error, but `Closed` when the pool is closed because the store is.
    ///
    /// `close()` closes the store's own pool once it stops waiting for running operations. An
    /// operation that needs a connection after that was closed over, not failed by the pool. A
    /// write still queued for a statement is an example.
    fn pool_error(&self, operation: &'static str, e: deadpool_postgres::PoolError) -> Error {
        match e {
            deadpool_postgres::PoolError::Closed if self.closed.load(Ordering::SeqCst) => {
                Error::Closed
            }
            e => self.pool.error(operation, e),
        }
    }

    /// The server process behind a pooled connection, asked once per connection.
    async fn backend(&self, client: &deadpool_postgres::Object) -> Result<Backend> {
        let id = deadpool_postgres::Object::id(client);
        let known = self.backends.lock().unwrap_or_else(|e| e.into_inner()).get(&id).cloned();
        if let Some(backend) = known {
            return Ok(backend);
        }
        let row = (self.pool.mode().query_one(&***client, sql::BACKEND_IDENTITY, &[], &[]).await)
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
    /// until it is gone (see [`Executor::run`]). Fails closed if that cannot be confirmed in time,
    /// that is within `retry_for` and before the local deadline.
    async fn await_backend_gone(&self, backend: &Backend) -> Result<()> {
        let started = tokio::time::Instant::now();
        let mut backoff = Duration::from_millis(20);
        loop {
            // A lost lease fails every later operation of this store, so no later call can be
            // overwritten. The old statement, if it commits, still commits before any takeover.
            self.lease.check()?;
            let attempt = async {
                let client = self.pool.get("end broken session").await?;
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

    /// The close sequence of [`crate::PgKvStore::close`], which documents it.
    pub(crate) async fn close(&self) -> Result<()> {
        self.closed.store(true, Ordering::SeqCst);
        // Releasing while an operation still runs is safe: a takeover still waits for its
        // FOR KEY SHARE lock. So a hung operation only delays close() by `drop_timeout`.
        let finished = tokio::time::timeout(self.drop_timeout, self.gate.write()).await;
        // Held across the release, so a concurrent close() returns only once it is done.
        let mut keeper = self.keeper.lock().await;
        let result = match keeper.take() {
            Some(keeper) => keeper.shutdown().await,
            None => Ok(()),
        };
        drop(keeper);
        if self.owns_pool {
            self.pool.close();
        }
        match finished {
            Ok(_) => result,
            Err(_) => {
                tracing::warn!(after = ?self.drop_timeout,
                    "pgfence closed while operations were still running");
                result.and(Err(Error::Timeout {
                    operation: "close: wait for running operations",
                    after: self.drop_timeout,
                }))
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
    pub(crate) pid: i32,
    pub(crate) started: SystemTime,
}

/// Runs a mutation of kind `op` in a task of its own ([`detached`]), and counts it.
///
/// The mutation is admitted when its future is first polled ([`Executor::admit`]). It holds
/// its admission until it ends, so `close()` waits for it.
pub(crate) async fn admitted<T: Send + 'static>(
    exec: &Executor,
    op: Op,
    work: impl Future<Output = Result<T>> + Send + 'static,
) -> Result<T> {
    let started = std::time::Instant::now();
    let result = match exec.admit() {
        Ok(running) => {
            let abandoned = exec.abandoned();
            let work = async move {
                let _running = running;
                work.await
            };
            detached(work, abandoned).await
        }
        Err(e) => Err(e),
    };
    exec.record(op, started, &result);
    result
}

/// Runs work as a task of its own and waits for it.
///
/// Dropping the caller's future then cannot interrupt the work halfway:
///
/// - A mutation keeps its key's turn until its statement is over. Otherwise a later call of
///   the key could run first and be overwritten by the orphaned statement.
/// - An `open()` that has committed its lease still starts renewal. The store is then dropped,
///   which releases the lease.
///
/// A panic in the task (`LeaseLossPolicy::Panic`) is resumed in the caller. The task may be
/// dropped unfinished: its runtime shut down while the caller waits from elsewhere. The caller
/// then gets `abandoned()`.
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

/// A pooled connection in use by one attempt.
///
/// It goes back to the pool once its statements are answered, with a result or an error
/// ([`Checkout::answered`]). Dropped before, it is taken out of the pool. The next user would
/// otherwise queue behind the unanswered statement, on a hung server for good. It is dropped
/// before when the attempt was abandoned at the local deadline. It is also dropped before when a
/// read's caller dropped its future, or when its task was dropped. Dropping it closes the
/// connection at once: deadpool aborts the task of a connection taken out of its pool.
pub(crate) struct Checkout(Option<deadpool_postgres::Object>);

impl Checkout {
    pub(crate) fn new(object: deadpool_postgres::Object) -> Checkout {
        Checkout(Some(object))
    }

    pub(crate) fn answered(mut self) {
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
/// known yet.
///
/// It may be dropped armed: the task running the statement was dropped, or unwound by a
/// panic. It then marks the lease lost (`WriteOutcomeUnknown`). Nobody will learn that
/// outcome, and the key's turn is gone with the task. The statement may still commit after a
/// later call of the same key. [`OutcomePending::settled`] disarms it.
///
/// [`Executor::run`] also keeps one armed from an attempt that broke after it was sent, until a
/// retry is answered. That attempt may have committed. Its turn, handed on as not applied,
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

impl Drop for Executor {
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

/// Closes a connection of the pool instead of handing it back (see [`Checkout`]).
pub(crate) fn discard(client: deadpool_postgres::Object) {
    drop(deadpool_postgres::Object::take(client));
}

/// The server process of a connection: `None` when the role cannot see it (the setup then
/// refuses the role).
pub(crate) async fn identify(
    mode: PoolMode,
    client: &tokio_postgres::Client,
) -> Result<Option<Backend>> {
    let row = mode
        .query_one(client, sql::BACKEND_IDENTITY, &[], &[])
        .await
        .map_err(Error::db("identify connection"))?;
    let started: Option<SystemTime> = row.get(1);
    Ok(started.map(|started| Backend { pid: row.get(0), started }))
}
