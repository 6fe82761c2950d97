//! The statement executor: it admits operations and runs each statement.
//!
//! It retries a statement on a fresh connection, and fails closed when an outcome cannot be
//! known. Every key operation of [`crate::PgKvStore`] ends here. The SQL it runs comes from
//! [`crate::sql`].

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::time::Duration;

use tokio::sync::{OwnedRwLockReadGuard, RwLock};
use tokio_postgres::Row;
use tokio_postgres::types::ToSql;
use uuid::Uuid;

use crate::error::{Error, KeyPath, LossReason, Result};
use crate::keys::TableName;
use crate::lease::{Keeper, Lease};
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
    /// Held while the store changes its owner id to fence off a statement of its own
    /// ([`Executor::fence_own`]): one change at a time, a fence check waits for it, and no
    /// mutation is sent meanwhile.
    pub(crate) fencing: tokio::sync::Mutex<()>,
    /// Set while [`Executor::fence_own`] changes the owner id (under `fencing`): mutations wait
    /// for it before they send anything. A flag, so that the write path takes no lock.
    pub(crate) fence_under_way: AtomicBool,
    /// How many more mutations run in the pipeline of [`sql::BEGIN_READ_COMMITTED`] without
    /// trying their function first ([`Executor::unowned_session`]). Set after a function found
    /// its transaction at another isolation level than read committed.
    pub(crate) skip_functions: AtomicU32,
}

/// How many mutations skip their function after one found another isolation level than read
/// committed. A pool passed in whose sessions all default to serializable then costs a second
/// round trip once in this many writes, not on every write. Behind a transaction pooler, a
/// neighbour's `SET` on one server session makes at most this many writes take the pipeline.
/// Both ways are correct; this only picks the cheaper one.
const SKIP_FUNCTIONS_AFTER_FALLBACK: u32 = 64;

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
    /// the caller holds the turns of every key it changes. `Ok` means committed. The owner id
    /// is its first parameter, which this adds in front of `params`.
    ///
    /// Where the store does not own its sessions, it runs `unowned` instead: the same mutation
    /// as one call of its function, with the same parameters ([`sql::WRITE_CALL`]), if it has
    /// one; else the mutation as a statement that pins its commit itself ([`sql::pinned`], or
    /// a deferred one), in a transaction of its own (see [`Executor::unowned_session`]).
    pub(crate) async fn fenced(
        &self,
        operation: &'static str,
        sql: &Statement,
        unowned: Unowned<'_>,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<()> {
        self.run(operation, (sql, Some(unowned)), params, Kind::Mutation).await.map(drop)
    }

    /// Makes every deferred mutation of this store that committed before this call durable
    /// ([`sql::FLUSH`](crate::sql::FLUSH)): a no-op update of the lease row by owner id,
    /// committed durably. In the same transaction it checks that the crash marker still holds
    /// `token`, and writes `next` there if not. It returns whether `token` was kept: false means
    /// the server crashed or failed over since `token` was written. The caller keeps the state
    /// of tokens (`write::marker`, above this module).
    ///
    /// The store's own sessions commit so; elsewhere it runs pinned like a mutation, so the
    /// check and the commit are one transaction there too. It retries a broken connection as
    /// any statement does: every attempt that commits is a durable commit after those
    /// mutations, so one more is harmless. A retry still looks for `token`, so an attempt that
    /// wrote `next` and went unanswered does not hide the loss.
    ///
    /// No row held means the lease is no longer ours: the store fails closed (`Fenced`), or
    /// `Closed` after its own release. The store's own change of owner id may have committed
    /// while the statement was in transit, to an id it did not carry. That is no loss: it goes
    /// again with every id, as renewal does.
    pub(crate) async fn flush(&self, token: Uuid, next: Uuid) -> Result<bool> {
        loop {
            let ids = self.lease.owner_ids();
            let params: [&(dyn ToSql + Sync); 3] = [&ids, &token, &next];
            let rows =
                self.run("flush", (&self.statements.flush, None), &params, Kind::Flush).await?;
            let (held, kept) = rows.first().map_or((false, true), |row| (row.get(0), row.get(1)));
            if held {
                return Ok(kept);
            }
            if !self.lease.owner_ids_added_since(&ids) {
                return Err(self.refused());
            }
        }
    }

    /// Runs a read-only statement and returns its rows.
    pub(crate) async fn query(
        &self,
        operation: &'static str,
        sql: &Statement,
        params: &[&(dyn ToSql + Sync)],
    ) -> Result<Vec<Row>> {
        let _running = self.admit()?;
        self.run(operation, (sql, None), params, Kind::Read).await
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
    /// The mutation's outcome is unknown. Worse, it may still be running on the server, or be
    /// on its way there. PostgreSQL notices a vanished client only when it next writes to the
    /// socket. So the statement can commit later, after a retry and after a later call of the
    /// same key. So before retrying, the store changes its owner id in the lease row
    /// ([`Executor::fence_own`]). Once that commits, nothing sent with the old id can land.
    /// The retry writes the same value under the same key turns, and lands after it. If the
    /// change cannot be confirmed, the store fails closed rather than risk a later call being
    /// overwritten. See docs/design.md, section "A broken connection mid-write".
    ///
    /// A mutation that finds the lease not held by the id it sent, because the store changed
    /// its id meanwhile, wrote nothing. It is sent again with the new id.
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
        sql: (&Statement, Option<Unowned<'_>>),
        params: &[&(dyn ToSql + Sync)],
        kind: Kind,
    ) -> Result<Vec<Row>> {
        // Armed from the first attempt that broke after it was sent until this returns. Its
        // being fenced off only means nothing of it can land *later*. It may have committed
        // already. Every return settles it: `Ok` is a committed retry. Every error
        // after such an attempt has failed the store closed already.
        let mut unresolved = None;
        let mut result = self.attempts(operation, sql, params, kind, &mut unresolved).await;
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
        (sql, unowned_sql): (&Statement, Option<Unowned<'_>>),
        params: &[&(dyn ToSql + Sync)],
        kind: Kind,
        unresolved: &mut Option<OutcomePending<'a>>,
    ) -> Result<Vec<Row>> {
        let mutation = kind == Kind::Mutation;
        // The flush, too, waits for a fence under way: it updates the lease row, and the ids
        // it carries are then the new ones.
        let writes_lease_row = kind != Kind::Read;
        let started = tokio::time::Instant::now();
        let mut backoff = Duration::from_millis(50);
        loop {
            self.lease.check()?;
            // The generation of the owner id a mutation sent, set right before it is sent.
            let mut sent: Option<u32> = None;
            let mut pending: Option<OutcomePending<'_>> = None;
            let attempt = async {
                let client = loop {
                    // A mutation sends nothing while the store fences off a statement of its own.
                    // Its FOR KEY SHARE lock would be granted ahead of the fence's waiting FOR
                    // UPDATE, and overlapping writes could keep the fence waiting for good.
                    if writes_lease_row {
                        self.fence_finished().await;
                    }
                    let client =
                        self.pool.raw().get().await.map_err(|e| self.pool_error(operation, e))?;
                    let client = Checkout(Some(client));
                    if !writes_lease_row || !self.fence_pending() {
                        break client;
                    }
                    // A fence began while this waited for a connection: the fence may need
                    // this very connection, so hand it back and wait.
                    client.answered();
                };
                let statements = async {
                    let unowned = writes_lease_row && !self.pool.own_sessions();
                    let unowned_sql = unowned_sql.filter(|_| unowned);
                    let call = unowned_sql.and_then(|u| u.call).filter(|_| self.tries_functions());
                    // Where the session is not the store's own, in a transaction of its own at
                    // read committed with a durable commit: `begin` (see `in_own_transaction`).
                    let (run, begin) = match (unowned, call) {
                        (false, _) => (sql, None),
                        (true, Some(call)) => (call, None),
                        (true, None) => {
                            let (pinned, begin) = in_own_transaction(sql, unowned_sql);
                            (pinned, Some(begin))
                        }
                    };
                    let mode = self.pool.mode();
                    let statement =
                        (mode.prepare_cached(&client, run).await).map_err(Error::db(operation))?;
                    // Read after every wait, so a fence that began meanwhile is over and its
                    // id is the one sent. Only a fence that begins from here on still finds
                    // this statement in flight: at most one statement per pooled connection.
                    let (owner, generation) = self.lease.owner();
                    let mut all: Vec<&(dyn ToSql + Sync)> = Vec::with_capacity(params.len() + 1);
                    if mutation {
                        all.push(&owner);
                        sent = Some(generation);
                        pending = Some(OutcomePending { lease: &self.lease });
                    }
                    all.extend_from_slice(params);
                    // A mutation's and the flush's commit must be durable (a deferred mutation's
                    // SQL sets it off after this) at read committed: pinned per transaction
                    // where the session is not the store's own, or by the mutation's function.
                    match (call, begin) {
                        (Some(_), _) => {
                            let called = statement.query(&client, &all).await;
                            let fallback = in_own_transaction(sql, unowned_sql);
                            self.unowned_session(&client, fallback, called, &all).await
                        }
                        (None, Some(begin)) => statement.query_in(begin, &client, &all).await,
                        (None, None) => statement.query(&client, &all).await,
                    }
                    .map_err(Error::db(operation))
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
            let fenced = match &result {
                Err(e) if e.is_retryable() && pending.is_some() => {
                    let generation = sent.expect("set when the statement was sent");
                    // Armed once, by the first attempt that broke, and built lazily. A guard
                    // built for a later one and dropped, armed, would fail the store closed at
                    // once, and abort the process under `Abort`. The retries could not go on.
                    unresolved.get_or_insert_with(|| OutcomePending { lease: &self.lease });
                    self.fence_own(generation).await
                }
                _ => Ok(()),
            };
            // The outcome is known, or the attempt is fenced off, or (`fenced` is Err) the
            // store has already failed closed.
            if let Some(pending) = pending {
                pending.settled();
            }
            fenced?;
            match result {
                // A fenced statement answers whether the lease was held; if not, it wrote
                // nothing. The store's own change of owner id may be why: then it goes again.
                Ok(rows) if mutation && !rows.first().is_some_and(|row| row.get::<_, bool>(0)) => {
                    let generation = sent.expect("set when the statement was sent");
                    if !self.owner_changed_since(generation).await {
                        return Err(self.refused());
                    }
                }
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

    /// Whether a mutation on a session the store does not own calls its function first
    /// ([`Executor::unowned_session`]).
    fn tries_functions(&self) -> bool {
        let skip = |left: u32| left.checked_sub(1);
        self.skip_functions.fetch_update(Ordering::Relaxed, Ordering::Relaxed, skip).is_err()
    }

    /// The answer to a mutation's function (`called`) on a session the store does not own:
    /// behind a transaction pooler, or on a pool passed in.
    ///
    /// The function runs at the level of its implicit transaction, which the session's
    /// `default_transaction_isolation` sets. It is not the store's to set there: a pooler's
    /// other client, or the application, may have asked for serializable. Only read committed
    /// keeps a fenced mutation from failing with a serialization error after a renewal (see
    /// [`sql::WRITE`]). So at any other level the function changes nothing and raises
    /// [`sql::NOT_READ_COMMITTED`]. The mutation then runs as a statement, `fallback`
    /// ([`in_own_transaction`]), in a pipelined `BEGIN ISOLATION LEVEL READ COMMITTED` ...
    /// `COMMIT` on the same connection: one round trip more. The next
    /// [`SKIP_FUNCTIONS_AFTER_FALLBACK`] mutations go there directly.
    async fn unowned_session(
        &self,
        client: &deadpool_postgres::ClientWrapper,
        (fallback, begin): (&Statement, &str),
        called: std::result::Result<Vec<Row>, tokio_postgres::Error>,
        params: &[&(dyn ToSql + Sync)],
    ) -> std::result::Result<Vec<Row>, tokio_postgres::Error> {
        match called {
            Err(e) if e.code().map(|code| code.code()) == Some(sql::NOT_READ_COMMITTED) => {
                tracing::debug!(error = %e, "pgfence runs a mutation in its own transaction at \
                    read committed: its session's transactions default to another level");
                self.skip_functions.store(SKIP_FUNCTIONS_AFTER_FALLBACK, Ordering::Relaxed);
                let statement = self.pool.mode().prepare_cached(client, fallback).await?;
                statement.query_in(begin, client, params).await
            }
            called => called,
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

    /// The error of a mutation the database refused, with no change of owner id of the store's
    /// own to explain it. Once `close()` has begun, its release may be why: the store's own,
    /// not a successor's, so `Closed` (nothing was written). A `close()` that gave up waiting
    /// releases while operations still run. Otherwise the lease was taken: `Fenced`.
    fn refused(&self) -> Error {
        if self.closed.load(Ordering::SeqCst) {
            return Error::Closed;
        }
        self.lease.fail(LossReason::Fenced)
    }

    /// Waits until no fence of the store's own is under way ([`Executor::fence_own`]).
    async fn fence_finished(&self) {
        if self.fence_pending() {
            drop(self.fencing.lock().await);
        }
    }

    /// Whether a fence of the store's own is under way now.
    fn fence_pending(&self) -> bool {
        self.fence_under_way.load(Ordering::SeqCst)
    }

    /// Whether the store changed its owner id since `generation`, waiting for a change under
    /// way to be decided first.
    async fn owner_changed_since(&self, generation: u32) -> bool {
        let _fencing = self.fencing.lock().await;
        self.lease.owner().1 > generation
    }

    /// Fences off every statement this store sent with the owner id of `generation`: changes
    /// the id in the lease row ([`sql::CHANGE_OWNER`]), unless a change since did so already.
    /// See [`Executor::run`]. Fails closed if that cannot be confirmed in time, that is within
    /// `retry_for` and before the local deadline, or if the lease is no longer ours. A
    /// `lock_timeout` or `statement_timeout` in the connection's options only makes it try
    /// again.
    ///
    /// It waits for the store's statements that hold the lease row, the one that broke among
    /// them if it is still running. PostgreSQL grants a new FOR KEY SHARE lock while a FOR
    /// UPDATE waits for the current holders. So meanwhile the store sends no new mutation
    /// ([`Executor::fence_finished`]): overlapping writes could otherwise starve the change.
    /// It then waits for at most the statements already in flight, one per pooled connection.
    /// A write sent before the change that finds the new id in the row is sent again
    /// ([`Executor::owner_changed_since`]).
    async fn fence_own(&self, generation: u32) -> Result<()> {
        let operation = "fence own statements";
        let _fencing = self.fencing.lock().await;
        if self.lease.owner().1 > generation {
            return Ok(()); // Changed after that statement was sent: it is fenced off already.
        }
        // Cleared on every return, and if this future is dropped.
        let _under_way = UnderWay::set(&self.fence_under_way);
        let started = tokio::time::Instant::now();
        let mut backoff = Duration::from_millis(20);
        loop {
            // A lost lease fails every later operation of this store, so no later call can be
            // overwritten. The old statement, if it commits, still commits before any takeover.
            self.lease.check()?;
            // A new id each attempt: one whose change went unanswered may commit later, and
            // renewal and release match it from now on.
            let (ids, next) = self.lease.next_owner();
            let attempt = async {
                let client = Checkout::new(self.pool.get(operation).await?);
                let params: [&(dyn ToSql + Sync); 2] = [&ids, &next];
                let statement = &self.statements.change_owner;
                // Pinned like a mutation where the session is not the store's own: a
                // neighbour's serializable would fail it (40001) when a renewal changed the row
                // while it waited, and its `synchronous_commit = off` could lose it in a crash.
                let own = self.pool.own_sessions();
                let changed = self.pool.mode().query_pinned(&client, statement, &params, own).await;
                client.answered(); // Answered, an error included.
                changed.map_err(Error::db(operation))
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
                Ok(Ok(rows)) if rows.is_empty() => return Err(self.refused()),
                Ok(Ok(_)) => {
                    self.lease.owner_changed(next);
                    tracing::info!(owner_id = %next, "pgfence changed its owner id to fence off \
                        a write whose connection broke");
                    return Ok(());
                }
                Ok(Err(e))
                    if (e.is_retryable() || gave_up_waiting(&e))
                        && started.elapsed() + backoff < self.retry_for =>
                {
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(1));
                }
                Ok(Err(e)) => {
                    tracing::error!(error = %e,
                        "pgfence cannot fence off a write with an unknown outcome");
                    return Err(self.lease.fail(LossReason::WriteOutcomeUnknown));
                }
                Err(_) => {
                    tracing::error!(
                        "pgfence could not fence off a write with an unknown outcome in time"
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

/// What a fenced mutation runs where the store does not own its sessions
/// ([`Executor::fenced`]).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Unowned<'a> {
    /// The mutation as a statement that sets `synchronous_commit` for its transaction itself:
    /// [`sql::pinned`] (at least `on`), or a deferred one (`off`).
    pub(crate) pinned: &'a Statement,
    /// The same as one call of its function, tried first, if it has one.
    pub(crate) call: Option<&'a Statement>,
}

/// How a statement that writes the lease row runs in a transaction of its own where the session
/// is not the store's own: a fenced mutation's `pinned` form after
/// [`sql::BEGIN_READ_COMMITTED_ONLY`]; anything else (the flush) after
/// [`sql::BEGIN_READ_COMMITTED`], which pins the commit. A `SELECT` of its own in the `BEGIN`
/// message is planned every time; inside the mutation the pin costs next to nothing.
fn in_own_transaction<'a>(
    sql: &'a Statement,
    unowned: Option<Unowned<'a>>,
) -> (&'a Statement, &'static str) {
    match unowned {
        Some(Unowned { pinned, .. }) => (pinned, sql::BEGIN_READ_COMMITTED_ONLY),
        None => (sql, sql::BEGIN_READ_COMMITTED),
    }
}

/// What a statement run by [`Executor::run`] is, which decides how it is sent.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// A read: sent as it is.
    Read,
    /// A fenced mutation: the owner id goes in front of its parameters, it answers whether the
    /// lease was held, and it commits pinned (see [`crate::session::Prepared::query_read_committed`]).
    Mutation,
    /// The flush ([`Executor::flush`]): it carries its own owner ids, and commits pinned like a
    /// mutation.
    Flush,
}

/// Sets a flag while it lives.
struct UnderWay<'a>(&'a AtomicBool);

impl<'a> UnderWay<'a> {
    fn set(flag: &'a AtomicBool) -> UnderWay<'a> {
        flag.store(true, Ordering::SeqCst);
        UnderWay(flag)
    }
}

impl Drop for UnderWay<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::SeqCst);
    }
}

/// Whether a statement failed because a `lock_timeout` or `statement_timeout` of the connection's
/// options ended its wait: the fence then waits again, for the rest of its time.
fn gave_up_waiting(e: &Error) -> bool {
    use tokio_postgres::error::SqlState;
    let Error::Database { source, .. } = e else { return false };
    matches!(source.code(), Some(&SqlState::LOCK_NOT_AVAILABLE | &SqlState::QUERY_CANCELED))
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

impl std::ops::DerefMut for Checkout {
    fn deref_mut(&mut self) -> &mut deadpool_postgres::Object {
        self.0.as_mut().expect("a checkout holds its connection until answered or dropped")
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
    /// The statement's outcome is known (or, after a broken connection, it is fenced off):
    /// nothing of it can land later.
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
