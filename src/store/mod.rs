//! `PgKvStore`, the public API: read, write, remove, list, paginate, close.
//!
//! Each method checks its input first. It then hands over to the write path ([`crate::write`])
//! or straight to the statement executor ([`crate::exec`]). The open sequence is in [`open`].
//!
//! The types that name the store and each other live here too: the [`Builder`] with its
//! openers, the [`Standby`] and the [`blocking`] store. Nothing below this module uses them.

pub mod blocking;
mod builder;
mod listener;
pub(crate) mod open;
mod standby;
mod stats;

pub use builder::{Builder, PoolMode};
pub(crate) use builder::{FleetShare, Source};
pub(crate) use listener::Listener;
pub use standby::{Standby, StandbyState};
pub use stats::Stats;

use std::future::Future;
use std::sync::Arc;
use std::time::Instant;

use deadpool_postgres::Pool;
use tokio::sync::watch;
use tracing::Instrument;
use uuid::Uuid;

use crate::error::{Error, Result};
use crate::exec::{Executor, admitted, value_or_not_found};
use crate::keys::{check_key, check_namespaces};
use crate::lease::LeaseState;
use crate::schema::{self, LeaseInfo};
use crate::stats::Op;
use crate::write::batch::Batch;
use crate::write::budget::bytes_of;
use crate::write::{Durability, Mutation, Writes};

/// A key-value store in PostgreSQL that only the holder of the table's lease may mutate.
///
/// # Guarantees
///
/// - **Fencing.** Every `write` and `remove` runs in one SQL statement. Under a `FOR KEY SHARE`
///   lock on the lease row, it checks that this store still owns an unexpired lease. It
///   mutates only if so. A takeover must change the lease row's owner, which waits for that
///   lock. So no write of this store can commit after another store acquired the lease.
/// - **Shared statements.** While [`Builder::write_concurrency`] statements are busy, waiting
///   mutations of other keys share the next such statement. Each call still gets its own
///   result.
/// - **Durability of `Ok`.** When `write`, `remove` or a batch's `commit` returns `Ok`, the
///   change is committed. Or it was superseded by a later call to the same key, and that one
///   is committed. The commit ran at read committed with at least `synchronous_commit = on`
///   (`remote_apply` is kept), whatever the role, the database, the session or a pooler's other
///   client set. A durable call superseded by a deferred one flushes first.
/// - **Deferred writes, when asked for.** `write_deferred`, `remove_deferred` and
///   [`Batch::commit_deferred`] return once committed, before the WAL flush. A server crash may
///   lose them until the next durable commit or [`PgKvStore::flush`]. What survives a crash
///   is always a prefix of the commits: never a later one without an earlier one. A flush, or
///   a durable call made with deferred calls pending, reports such a loss
///   ([`Error::DeferredWritesLost`]) instead of returning `Ok`.
/// - **Per-key order.** Calls to `write`/`remove` of the same key take effect in the order the
///   methods were *called*. The order their futures are polled or complete in does not matter.
///   A later call's value is never overwritten by an earlier one.
/// - **Fail closed.** The store fails closed once the lease is lost. It also does when renewal
///   could not confirm the lease before the local deadline, which comes before the database
///   expiry. From then on, every key operation returns [`Error::LeaseLost`], for good. That
///   covers reads, lists, writes, removes and batches. [`PgKvStore::lease_state`] reports
///   [`LeaseState::Lost`].
/// - **No waiting past the deadline.** An operation still waiting for the server's answer at
///   the local deadline returns then too, within about a second. It does not wait for a
///   server that may never answer.
/// - **After a loss**, [`PgKvStore::lease_info`] is the only call that still reads the
///   database. It shows who holds the lease now. The [`crate::LeaseLossPolicy`] decides
///   whether the loss also panics or aborts.
/// - **A mutation already at the fence.** A mutation may still commit if its statement had
///   locked the lease row when the loss came. A successor's takeover waits for it. It returns
///   `Ok` if its answer comes before the local deadline. Otherwise it returns `LeaseLost` with
///   its outcome unknown: read the key back.
/// - **No leaked ownership.** `close()` releases the lease. Dropping the last handle releases
///   it once the last outstanding `write`/`remove` future has finished. Those futures keep the
///   lease alive and renewed; an uncommitted [`Batch`] does not.
/// - **Release by owner id.** A store that lost its lease never releases its successor's. It
///   releases its own at once, and retries about every second while the database cannot be
///   reached. A crashed store's lease is taken over after it expires.
/// - **Reads** see committed data only. A read returns the latest committed value of the key
///   at the time its statement runs.
///
/// Cloning is cheap and shares one store (one lease).
#[derive(Debug, Clone)]
pub struct PgKvStore {
    /// The pool, the lease and the executor: kept alive by every handle and outstanding
    /// operation; the last one dropped releases the lease.
    pub(crate) exec: Arc<Executor>,
    /// The per-key order and the coalescing queue.
    pub(crate) writes: Arc<Writes>,
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

    /// Starts configuring a store on an existing pool.
    ///
    /// - The renewal task takes one connection out of the pool for good. The pool opens a
    ///   replacement when needed, so the renewal connection comes on top of the pool's maximum.
    /// - The renewal connection's I/O runs on the runtime that created it.
    /// - Notifications cannot be received through a pooled connection. So a standby on a pool
    ///   polls instead of listening.
    /// - `close()` leaves the pool open.
    /// - Dropping such a store inside a current-thread runtime cannot release the lease. The
    ///   renewal connection's I/O needs the runtime that the drop blocks. The lease then
    ///   expires by TTL, so prefer `close().await` there.
    ///
    /// For renewal fully independent of the application's runtime, use [`PgKvStore::builder`]
    /// or [`PgKvStore::builder_from_config`].
    ///
    /// # Isolation and durability
    ///
    /// The store does not own the pool's sessions, whose defaults may say repeatable read,
    /// serializable or `synchronous_commit = off`. None of that weakens a write: each fenced
    /// mutation runs in a transaction of its own at read committed, and commits with at least
    /// `synchronous_commit = on`. See
    /// [Isolation](https://github.com/pgfence/pgfence/blob/main/docs/design.md#isolation)
    /// in docs/design.md.
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
        let exec = &self.exec;
        let span = exec.span("read", primary_namespace, secondary_namespace, key);
        let started = Instant::now();
        let result = async {
            let rows = exec
                .query(
                    "read",
                    &exec.statements.read,
                    &[&primary_namespace, &secondary_namespace, &key],
                )
                .await?;
            value_or_not_found(&rows, primary_namespace, secondary_namespace, key)
        }
        .instrument(span)
        .await;
        exec.record(Op::Read, started, &result);
        result
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
        let mutation = Mutation::Write(value);
        let key = (primary_namespace, secondary_namespace, key);
        self.mutate("write", Op::Write, key, mutation, Durability::Durable)
    }

    /// [`PgKvStore::write`], committed without waiting for its WAL flush: for values the caller
    /// can afford to lose in a server crash, or makes durable later with [`PgKvStore::flush`].
    ///
    /// Its transaction alone commits with `synchronous_commit = off`. The session's next
    /// statement commits as before. Fencing and per-key order are those of `write`: a deferred
    /// and a durable call of one key take effect in the order they were called.
    ///
    /// `Ok` means committed under this store's lease, not yet durable:
    ///
    /// - A server crash may lose it. Then it loses every commit after it too, of any key and
    ///   any session: PostgreSQL replays its WAL in order, so what survives is a prefix.
    /// - It is durable once a later durable commit of the server is: a `write`, `remove` or
    ///   `commit` of this store, or [`PgKvStore::flush`]. Usually sooner: the server's WAL
    ///   writer flushes it within about three times `wal_writer_delay` (200 ms by default).
    /// - A crash is never hidden. The next `flush`, or durable call of this store, that would
    ///   vouch for it returns [`Error::DeferredWritesLost`] if the server crashed or failed over
    ///   since. So does this call, if that loss was found while it was in flight.
    /// - A standby under synchronous replication may not have it before that either. A
    ///   failover to it loses it then.
    pub fn write_deferred(
        &self,
        primary_namespace: &str,
        secondary_namespace: &str,
        key: &str,
        value: Vec<u8>,
    ) -> impl Future<Output = Result<()>> + Send + 'static + use<> {
        let mutation = Mutation::Write(value);
        let key = (primary_namespace, secondary_namespace, key);
        self.mutate("write_deferred", Op::Write, key, mutation, Durability::Deferred)
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
        let key = (primary_namespace, secondary_namespace, key);
        self.mutate("remove", Op::Remove, key, Mutation::Remove, Durability::Durable)
    }

    /// [`PgKvStore::remove`], committed without waiting for its WAL flush, as
    /// [`PgKvStore::write_deferred`] is (and with the same promise).
    pub fn remove_deferred(
        &self,
        primary_namespace: &str,
        secondary_namespace: &str,
        key: &str,
    ) -> impl Future<Output = Result<()>> + Send + 'static + use<> {
        let key = (primary_namespace, secondary_namespace, key);
        self.mutate("remove_deferred", Op::Remove, key, Mutation::Remove, Durability::Deferred)
    }

    /// Returns once every deferred mutation of this store that returned `Ok` before this call
    /// is durable. That is as durable as a `write`: flushed to the server's WAL with at least
    /// `synchronous_commit = on`, and on a synchronous standby if the deployment has one
    /// (`remote_apply` is kept).
    ///
    /// It commits one durable transaction after them: a no-op update of the lease row by this
    /// store's owner id (`FLUSH` in src/sql.rs). Its commit record follows theirs in the WAL,
    /// and flushing it flushes them. It writes a little WAL even when nothing is deferred.
    /// Flushes run one at a time; calls made while one runs share the next: a flush that began
    /// after this call, and found the marker kept, vouches for it.
    ///
    /// - In the same transaction it checks the crash marker, an UNLOGGED table that every
    ///   crash recovery empties. If the server crashed, crash-reinitialized or failed over
    ///   since deferred calls returned `Ok` unflushed, it returns
    ///   [`Error::DeferredWritesLost`]: they may be lost. Read those keys back and write again
    ///   what must be there. The report resets the marker: deferred calls after it are covered
    ///   again, and the next flush vouches for them.
    /// - It is an operation like a write: it fails closed once the lease is lost, with
    ///   [`Error::Closed`] once `close()` has begun, and `close()` waits for it.
    /// - If the lease row is no longer this store's, it returns [`Error::LeaseLost`] and the
    ///   store fails closed. Deferred writes not yet flushed may then be lost: a successor's
    ///   takeover commit usually flushed them, but nothing vouches for that.
    /// - A broken connection is retried, as for any statement. An error other than
    ///   `DeferredWritesLost` means that durability was not confirmed, not that anything was
    ///   lost.
    /// - A durable `write`, `remove` or `commit` called while deferred calls are pending flushes
    ///   first, the same way, and fails with `DeferredWritesLost` too. With none pending it
    ///   runs no flush. See docs/design.md, section "Deferred writes and flush".
    pub fn flush(&self) -> impl Future<Output = Result<()>> + Send + 'static + use<> {
        let (exec, writes) = (Arc::clone(&self.exec), Arc::clone(&self.writes));
        let since = writes.marker.since();
        let span = exec.span("flush", "", "", "");
        async move {
            let store = Arc::clone(&exec);
            let work = async move { writes.flush(&store, since).await };
            admitted(&exec, Op::Flush, work.instrument(span)).await
        }
    }

    /// The common path of `write`, `remove` and their deferred forms: checks the input and
    /// takes the key's place in its order now, in the call. The returned future reserves the
    /// bytes, is admitted, and runs the mutation in its key's turn.
    fn mutate(
        &self,
        operation: &'static str,
        op: Op,
        (primary_namespace, secondary_namespace, key): (&str, &str, &str),
        mutation: Mutation,
        durability: Durability,
    ) -> impl Future<Output = Result<()>> + Send + 'static + use<> {
        let (exec, writes) = (Arc::clone(&self.exec), Arc::clone(&self.writes));
        let prepared = check_key(primary_namespace, secondary_namespace, key)
            .and_then(|()| match &mutation {
                Mutation::Write(value) => writes.check_value(value),
                Mutation::Remove => Ok(()),
            })
            .map(|()| writes.ticket(primary_namespace, secondary_namespace, key));
        // Taken in the call, as the ticket is: a durable call covers the deferred calls that
        // returned `Ok` before it was made.
        let since = writes.marker.since();
        let span = exec.span(operation, primary_namespace, secondary_namespace, key);
        async move {
            let ticket = prepared?;
            let reserved = writes.reserve(bytes_of(ticket.path(), &mutation)).await;
            let store = Arc::clone(&exec);
            let work = async move {
                let _reserved = reserved;
                writes.mutate(&store, ticket, mutation, (durability, since)).await
            };
            if durability == Durability::Deferred {
                exec.lease.stats.deferred();
            }
            admitted(&exec, op, work.instrument(span)).await
        }
    }

    /// Lists the keys of a namespace pair, in byte order; empty for an unknown namespace.
    pub async fn list(
        &self,
        primary_namespace: &str,
        secondary_namespace: &str,
    ) -> Result<Vec<String>> {
        check_namespaces(primary_namespace, secondary_namespace)?;
        let exec = &self.exec;
        let span = exec.span("list", primary_namespace, secondary_namespace, "");
        let started = Instant::now();
        let result = async {
            let rows = exec
                .query("list", &exec.statements.list, &[&primary_namespace, &secondary_namespace])
                .await?;
            Ok(rows.iter().map(|row| row.get(0)).collect())
        }
        .instrument(span)
        .await;
        exec.record(Op::List, started, &result);
        result
    }

    /// One page of a namespace pair's keys, newest-created first. Pass `None` for the first
    /// page and then each page's `next_page_token`. Keys deleted between pages never make a
    /// page repeat or skip a surviving key. Keys created after the listing started are not
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
        let exec = &self.exec;
        let span = exec.span("list_paginated", primary_namespace, secondary_namespace, "");
        let started = Instant::now();
        let result = async {
            let limit = exec.page_size as i64 + 1;
            let rows = exec
                .query(
                    "list a page",
                    &exec.statements.list_page,
                    &[&primary_namespace, &secondary_namespace, &before, &limit],
                )
                .await?;
            let more = rows.len() > exec.page_size;
            let rows = &rows[..rows.len().min(exec.page_size)];
            let next_page_token = match rows.last() {
                Some(last) if more => Some(PageToken(last.get::<_, i64>(1).to_string())),
                _ => None,
            };
            Ok(Page { keys: rows.iter().map(|row| row.get(0)).collect(), next_page_token })
        }
        .instrument(span)
        .await;
        exec.record(Op::List, started, &result);
        result
    }

    /// Every key of the table as `(primary_namespace, secondary_namespace, key)`, in byte order.
    pub async fn list_all_keys(&self) -> Result<Vec<(String, String, String)>> {
        let exec = &self.exec;
        let span = exec.span("list_all_keys", "", "", "");
        let started = Instant::now();
        let result = async {
            let rows = exec.query("list all keys", &exec.statements.list_all, &[]).await?;
            Ok(rows.iter().map(|row| (row.get(0), row.get(1), row.get(2))).collect())
        }
        .instrument(span)
        .await;
        exec.record(Op::List, started, &result);
        result
    }

    /// The lease epoch this store holds: the fencing token, strictly increasing with every
    /// acquisition of the table's lease. Every row records the epoch that last wrote it.
    pub fn fencing_token(&self) -> i64 {
        self.exec.lease.epoch
    }

    /// This store's owner id in the lease row now. Every id is this store's alone. It changes,
    /// with the same fencing token, when the store fences off a write of its own whose
    /// connection broke (see docs/design.md, section "A broken connection mid-write").
    pub fn owner_id(&self) -> Uuid {
        self.exec.lease.owner().0
    }

    /// The table, as configured.
    pub fn table(&self) -> String {
        self.exec.table.display()
    }

    /// Watches the lease. It is `Held` until it is lost (`Lost { reason }`, for good) or given
    /// up. A lease given up is `Released`, or `Abandoned` when the store stopped but could not
    /// release it. Await `changed()` on it to learn of a loss the moment it is known.
    pub fn lease_state(&self) -> watch::Receiver<LeaseState> {
        self.exec.lease.subscribe()
    }

    /// A snapshot of this store's counters and latencies, its lease and its pool (see
    /// [`Stats`]). It runs no SQL and takes no lock an operation waits for.
    pub fn stats(&self) -> Stats {
        Stats::of(&self.exec)
    }

    /// The lease row as the database sees it now: holder, epoch, time left. It reads the
    /// database whatever this store's state, so after a loss it shows the new holder. After
    /// `close()` it needs a pool that is still open. The store closes a pool it built itself.
    pub async fn lease_info(&self) -> Result<Option<LeaseInfo>> {
        let client = self.exec.pool.get("read lease").await?;
        schema::lease_info(self.exec.pool.mode(), &**client, &self.exec.statements).await
    }

    /// Closes the store, in this order:
    ///
    /// 1. New operations get [`Error::Closed`]. That includes `write`/`remove` futures created
    ///    earlier but not yet polled.
    /// 2. Operations already running finish, waited for at most `drop_timeout`. That includes
    ///    mutations still waiting for their key's turn or for a shared statement.
    /// 3. Renewal stops.
    /// 4. The lease is released by owner id: expired now, with the epoch counter kept. So
    ///    another store can open at once.
    ///
    /// It returns the release's result. It returns [`Error::Timeout`] if operations were still
    /// running; those that need a connection after that get [`Error::Closed`]. Closing again
    /// returns `Ok` once nothing runs any more. While operations still hang, it waits
    /// `drop_timeout` for them too and returns `Timeout`.
    ///
    /// # After a loss
    ///
    /// The lost lease's row is released too, by owner id, if the renewal thread has not done
    /// it yet. A successor's lease is never touched. The result is that release's: `Ok` when
    /// the row is released or was no longer this store's. The loss itself was reported by the
    /// operations and by [`PgKvStore::lease_state`].
    ///
    /// One exception: under [`crate::LeaseLossPolicy::Panic`], when renewal found the loss.
    /// The renewal thread then ended with its panic after a single attempt to release. Nothing
    /// releases the lease any more; if that attempt failed, it expires by TTL. So `close()`
    /// returns [`Error::LeaseLost`].
    pub async fn close(&self) -> Result<()> {
        self.exec.close().await
    }

    /// The bytes of `write`, `remove` and batch `commit` calls in flight now: polled and not
    /// yet finished. It counts each one's keys and values. It stays within
    /// [`Builder::max_queued_bytes`], except while a single larger mutation runs alone.
    pub fn queued_bytes(&self) -> usize {
        self.writes.queued_bytes()
    }

    /// Starts an empty atomic batch of puts and removes; see [`Batch`].
    pub fn batch(&self) -> Batch {
        Batch::new(&self.exec, Arc::clone(&self.writes))
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

/// Tests that need the store's internals and a database.
#[cfg(test)]
mod db_tests {
    use super::*;
    use std::time::Duration;

    use crate::error::LossReason;
    use pgfence_testing::{Proxy, TestServer, unique_name};

    /// After a loss found by an operation, the release is retried on a new connection when the
    /// renewal thread's own one went silent. Here a proxy holds back all its traffic, while new
    /// connections get through. The lease is released within seconds, not at its expiry.
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
                        WHERE state = 'idle'
                          AND query LIKE '%SET expires_at = clock_timestamp() + $2%'";
        let port: i32 = loop {
            if let Some(row) = admin.query_opt(renewal, &[]).await.unwrap() {
                break row.get(0);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        proxy.stall(u16::try_from(port).unwrap());
        let lost = store.exec.lease.fail(LossReason::WriteOutcomeUnknown);
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
