//! The builder: every option of a store, its checks, and the openers that turn it into a store,
//! a standby, an inspector or a blocking store.
//!
//! It lives with the store because the two name each other: [`PgKvStore::builder`] returns a
//! [`Builder`], and [`Builder::open`] returns a [`PgKvStore`]. The same holds for [`Standby`] and
//! the [`blocking`] store, so all of them share this module and nothing below depends on it.

use std::fmt;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::{Pool, Runtime};
use tokio_postgres::config::{Host, SslMode};

use super::blocking;
use super::listener::Listener;
use super::standby::Standby;
use super::{PgKvStore, open};
use crate::connect::{self, Tls};
use crate::error::{Error, Result};
use crate::inspect::Inspector;
use crate::keys::{MAX_BATCH_BYTES, TableName};
use crate::lease::LeaseLossPolicy;
pub use crate::session::PoolMode;

/// Where the store's connections come from.
#[derive(Clone)]
pub(crate) enum Source {
    Config(Box<tokio_postgres::Config>),
    Pool(deadpool_postgres::Pool),
    /// A connection string that did not parse; reported by `open()`.
    Invalid(String),
}

impl fmt::Debug for Source {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            // A host with an '@' is most likely the rest of a password with an unescaped '@'
            // in a URL: shown nowhere (`validate` refuses it).
            Source::Config(config) if has_at_sign_host(config) => {
                f.debug_tuple("Config").field(&"<hidden: a host contains '@'>").finish()
            }
            // tokio_postgres::Config's Debug redacts the password.
            Source::Config(config) => f.debug_tuple("Config").field(config).finish(),
            Source::Pool(pool) => f.debug_tuple("Pool").field(&pool.status()).finish(),
            Source::Invalid(reason) => f.debug_tuple("Invalid").field(reason).finish(),
        }
    }
}

/// Options for [`crate::PgKvStore`], set with chained `with`-style calls and checked by
/// [`Builder::open`]. Created by [`crate::PgKvStore::builder`] (connection string),
/// [`crate::PgKvStore::builder_from_config`] or [`crate::PgKvStore::builder_from_pool`].
///
/// `Debug` never shows a password, nor a host containing '@' (likely the rest of a password
/// with an unescaped '@' in a URL; `open()` refuses such a host).
#[derive(Debug, Clone)]
pub struct Builder {
    pub(crate) source: Source,
    pub(crate) table: String,
    pub(crate) lease_ttl: Duration,
    pub(crate) renew_interval: Option<Duration>,
    pub(crate) local_deadline: Option<Duration>,
    pub(crate) pool_size: usize,
    pub(crate) on_lease_lost: LeaseLossPolicy,
    pub(crate) max_value_size: usize,
    pub(crate) max_queued_bytes: usize,
    pub(crate) page_size: usize,
    pub(crate) drop_timeout: Duration,
    pub(crate) connect_timeout: Duration,
    pub(crate) application_name: String,
    pub(crate) write_concurrency: usize,
    pub(crate) tls: Tls,
    pub(crate) pool_mode: PoolMode,
    /// The fleet this builder opens stores in (see [`crate::Fleet::builder`]); `None` for a
    /// store with a pool and a renewal thread of its own.
    pub(crate) fleet: Option<FleetShare>,
    /// The LISTEN connection a standby shares with others; `None`: it makes its own.
    pub(crate) listener: Option<Arc<Listener>>,
}

/// What the stores of a fleet share: its pool and its renewal thread. Weak, so that a builder
/// kept around does not keep a closed fleet's thread running.
#[derive(Debug, Clone)]
pub(crate) struct FleetShare {
    pub(crate) pool: connect::Pool,
    pub(crate) renewer: std::sync::Weak<crate::lease::Renewer>,
}

/// Defaults, also documented on the setters.
pub(crate) const DEFAULT_TABLE: &str = "pgfence_kv";
const DEFAULT_TTL: Duration = Duration::from_secs(30);
const DEFAULT_POOL_SIZE: usize = 8;
const DEFAULT_WRITE_CONCURRENCY: usize = 4;
const DEFAULT_MAX_VALUE: usize = 64 * 1024 * 1024;
const DEFAULT_MAX_QUEUED_BYTES: usize = 256 * 1024 * 1024;
const DEFAULT_PAGE_SIZE: usize = 100;
const DEFAULT_DROP_TIMEOUT: Duration = Duration::from_secs(5);
/// The shortest `drop_timeout`. It also bounds the lease release, which cannot finish in no
/// time. With zero, `close()` never released and a standby waited out the TTL.
const MIN_DROP_TIMEOUT: Duration = Duration::from_millis(100);
const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);
/// tokio-postgres's keepalive idle time when none is configured: an idle time other than this
/// was set by the caller.
const TOKIO_POSTGRES_KEEPALIVES_IDLE: Duration = Duration::from_secs(2 * 60 * 60);
/// The longest keepalive idle time Linux accepts (`MAX_TCP_KEEPIDLE`); asked for more, the
/// socket option fails and so does every connection.
const MAX_KEEPALIVES_IDLE: Duration = Duration::from_secs(32_767);
/// The longest a standby's LISTEN connection stays silent before its keepalives probe it. It
/// bounds how late a standby learns that a silently dropped connection lost a release's
/// notification. Probes cost the server no statement: its kernel answers them.
const MAX_LISTEN_KEEPALIVES_IDLE: Duration = Duration::from_secs(5);

impl Builder {
    /// A builder for the server that libpq's environment names, as `psql` would connect.
    /// `url`'s parameters win, and the environment fills what it leaves out: `PGHOST`,
    /// `PGPORT`, `PGUSER`, `PGDATABASE`, `PGPASSWORD` (else `PGPASSFILE` or `~/.pgpass`),
    /// `PGAPPNAME`, `PGCONNECT_TIMEOUT` (as [`Builder::connect_timeout`]), and `PGSSLMODE`,
    /// `PGSSLROOTCERT`, `PGSSLCERT` and `PGSSLKEY` (as [`Builder::tls`]).
    ///
    /// Prefer the environment or a password file to a password in `url`: `ps` and shell
    /// history show command lines. TLS is always verified, so `PGSSLMODE=require` needs
    /// `PGSSLROOTCERT` (or `~/.postgresql/root.crt`). See [`crate::env`] for the details and
    /// the differences from libpq.
    ///
    /// Fails with [`Error::InvalidConfig`] when the string, a variable or a TLS file is not
    /// usable. Warnings (an ignored password file) are logged at warn level.
    pub fn from_env(url: Option<&str>) -> Result<Builder> {
        let var = |name: &str| std::env::var(name).ok();
        let resolved = crate::env::resolve(url, crate::env::TlsOptions::default(), &var)?;
        for warning in &resolved.warnings {
            tracing::warn!(target: "pgfence::env", "{warning}");
        }
        let mut builder = Builder::new(Source::Config(Box::new(resolved.config)));
        if let Some(timeout) = resolved.connect_timeout {
            builder = builder.connect_timeout(timeout);
        }
        if let Some(tls) = resolved.tls.client_config()? {
            builder = builder.tls(tls);
        }
        Ok(builder)
    }

    pub(crate) fn new(source: Source) -> Builder {
        Builder {
            source,
            table: DEFAULT_TABLE.to_owned(),
            lease_ttl: DEFAULT_TTL,
            renew_interval: None,
            local_deadline: None,
            pool_size: DEFAULT_POOL_SIZE,
            on_lease_lost: LeaseLossPolicy::default(),
            max_value_size: DEFAULT_MAX_VALUE,
            max_queued_bytes: DEFAULT_MAX_QUEUED_BYTES,
            page_size: DEFAULT_PAGE_SIZE,
            drop_timeout: DEFAULT_DROP_TIMEOUT,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            application_name: default_application_name(),
            write_concurrency: DEFAULT_WRITE_CONCURRENCY,
            tls: Tls::default(),
            pool_mode: PoolMode::Session,
            fleet: None,
            listener: None,
        }
    }

    /// The KV table, `table` or `schema.table` (default `pgfence_kv`). Each part must match
    /// `[A-Za-z_][A-Za-z0-9_]*`, at most 48 characters; names are always quoted, so case is
    /// kept. The lease lives in `<table>_lease`, the schema version in `<table>_schema_version`,
    /// the crash marker of deferred writes in `<table>_crash_marker`. A name ending in one that
    /// another store derives (`t_lease` is store `t`'s lease table) is refused with
    /// [`Error::InvalidConfig`](crate::Error::InvalidConfig) before anything is sent.
    pub fn table(mut self, table: impl Into<String>) -> Self {
        self.table = table.into();
        self
    }

    /// How long an acquisition or renewal keeps the lease valid in the database (default 30 s).
    /// A crashed holder is taken over this long after its last renewal.
    pub fn lease_ttl(mut self, ttl: Duration) -> Self {
        self.lease_ttl = ttl;
        self
    }

    /// How often the background task renews the lease (default half the local deadline). With
    /// the default deadline, that is a third of the TTL: 10 s of 30 s. Must be shorter than
    /// the local deadline, so that a failed renewal can be retried before it.
    pub fn renew_interval(mut self, interval: Duration) -> Self {
        self.renew_interval = Some(interval);
        self
    }

    /// How long after the start of the last confirmed renewal the store still trusts its lease
    /// (default two thirds of the TTL). Past it the store fails closed, before the database
    /// expiry, leaving the process time to stop. Must be shorter than the TTL.
    pub fn local_deadline(mut self, deadline: Duration) -> Self {
        self.local_deadline = Some(deadline);
        self
    }

    /// Connections in the store's pool (default 8); ignored with
    /// [`crate::PgKvStore::builder_from_pool`]. The renewal task always has its own connection.
    /// For a [`crate::Fleet`], the size of the pool all its stores share; ignored on a
    /// builder from [`crate::Fleet::builder`].
    pub fn pool_size(mut self, size: usize) -> Self {
        self.pool_size = size;
        self
    }

    /// How many single-key write statements (`write`, `remove`) may run at once (default 4;
    /// 1 to 10,000, else `open()` fails with [`Error::InvalidConfig`]).
    /// A `write` or `remove` that arrives while that many run waits. The next statement to start
    /// applies the oldest waiting mutations in one fenced statement, like a [`crate::Batch`]. So
    /// all of them share one lease check and one commit. It takes up to 1,000 mutations and 16 MiB
    /// of values. They may be of different keys, and each key's order is kept. With many concurrent
    /// writers this keeps throughput at the level of unfenced writes; below this many writers
    /// nothing waits. Each call still gets its own result. If a shared statement fails, each of its
    /// mutations runs again alone, still within this many statements at once. Batches from
    /// [`crate::PgKvStore::batch`] are not counted. Set it to the pool size to let every mutation
    /// have a statement of its own while a connection is free.
    pub fn write_concurrency(mut self, statements: usize) -> Self {
        self.write_concurrency = statements;
        self
    }

    /// What to do, besides failing closed, when the lease is lost (default
    /// [`LeaseLossPolicy::FailClosed`]).
    pub fn on_lease_lost(mut self, policy: LeaseLossPolicy) -> Self {
        self.on_lease_lost = policy;
        self
    }

    /// Largest value accepted by `write` (default 64 MiB); larger ones get
    /// [`Error::ValueTooLarge`] before any statement runs. At most [`crate::MAX_BATCH_BYTES`]
    /// (512 MiB), well below PostgreSQL's 1 GiB limit on a protocol message and on a value.
    pub fn max_value_size(mut self, bytes: usize) -> Self {
        self.max_value_size = bytes;
        self
    }

    /// The most bytes of `write`, `remove` and batch `commit` calls in flight at once (default
    /// 256 MiB; 1 to `u32::MAX`, else `open()` fails with [`Error::InvalidConfig`]).
    ///
    /// A call counts its keys and values from when its future is first polled until it ends.
    /// A call that does not fit waits (backpressure); calls wait in the order they are polled.
    /// None fails for it, and per-key order holds as always. A call larger than the bound is
    /// not refused: it waits until no other call is in flight and then runs alone. The bytes
    /// of a future not yet polled, or waiting here, are the caller's. See
    /// [`crate::PgKvStore::queued_bytes`].
    pub fn max_queued_bytes(mut self, bytes: usize) -> Self {
        self.max_queued_bytes = bytes;
        self
    }

    /// Keys per page of [`crate::PgKvStore::list_paginated`] (default 100).
    pub fn page_size(mut self, keys: usize) -> Self {
        self.page_size = keys;
        self
    }

    /// How long dropping the last handle (and outstanding operation) of a store waits for the
    /// lease release (default 5 s). Also how long [`crate::PgKvStore::close`] waits for running
    /// operations before releasing anyway. Dropping never waits longer and never panics.
    /// It also bounds the release itself, which may need a new connection and a round trip.
    /// So it must be at least 100 ms, else `open()` fails with [`Error::InvalidConfig`].
    /// Leave it well above a few round trips to the server.
    pub fn drop_timeout(mut self, timeout: Duration) -> Self {
        self.drop_timeout = timeout;
        self
    }

    /// Time limit for making a connection (default 10 s). It bounds the TCP connect with the
    /// server's startup and authentication. Timed again, it bounds the statement that then sets
    /// the new session to read committed. So a pooled connection may take up to about twice
    /// this. It also limits the quick checks on a connection before `open()`'s setup, and a
    /// cancel request. It limits the connection that creates a missing database, but not its
    /// `CREATE DATABASE`. And it limits releasing the lease of a setup whose commit went
    /// unanswered or whose renewal thread could not start. Each bounds a wait for an answer
    /// that a server that stopped answering would never give. (A `connect_timeout` in the
    /// connection string bounds only the TCP connect, within this.)
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// Encrypts every connection the store opens with TLS (rustls), and verifies the server as
    /// `config` says. Give `config` the roots to trust: the `webpki-roots` crate's for a public
    /// certificate authority, or your own CA's. The server's certificate must match the host
    /// name (or IP address) connected to. Every connection then *requires* TLS: the pool's,
    /// the lease renewal's and a standby's own. A server that does not offer it is an error,
    /// never a silent fall-back to plain text. TCP hosts only: PostgreSQL offers no TLS on a Unix
    /// socket, so a Unix socket host is refused by `open()` too.
    ///
    /// Without it the store connects without TLS. A connection string asking for
    /// `sslmode=require` is then refused by `open()` (`InvalidConfig { field: "tls" }`), rather
    /// than sent in plain text. With it, `sslmode=disable` is refused too. For a store built on
    /// a pool ([`crate::PgKvStore::builder_from_pool`]) the pool's own connector decides;
    /// setting this too is refused.
    pub fn tls(mut self, config: rustls::ClientConfig) -> Self {
        self.tls = Tls::rustls(config);
        self
    }

    /// How the server sessions behind the connection string are shared (default
    /// [`PoolMode::Session`]: a direct connection, or a pooler in session mode).
    ///
    /// Set [`PoolMode::Transaction`] for PgBouncer (or another pooler) in transaction mode. See
    /// [`PoolMode`] for what changes.
    pub fn pool_mode(mut self, mode: PoolMode) -> Self {
        self.pool_mode = mode;
        self
    }

    /// How the holder names itself in the lease row, for operators (default: the executable's
    /// name). Host and process id are recorded too. A NUL byte in it is refused by `open()`
    /// ([`Error::InvalidConfig`]).
    pub fn application_name(mut self, name: impl Into<String>) -> Self {
        self.application_name = name.into();
        self
    }

    /// Checks the options, connects, creates or migrates the schema and takes the lease, all in
    /// one transaction. Fails with [`Error::LeaseHeld`](crate::Error::LeaseHeld) (and changes
    /// nothing) while another live store holds the lease. Creates the database if it does not
    /// exist and the role may.
    ///
    /// As its last step, `open()` gathers planner statistics (`ANALYZE`) for a table that never
    /// had them. This is best effort. If a lock or a silent server holds it up for more than
    /// one TTL, the store is returned without them.
    ///
    /// # Cancellation
    ///
    /// Dropping the returned future cancels a setup that is still waiting. It may wait for the
    /// setup lock of a concurrent `open()`, at the fence for the old holder's in-flight writes,
    /// or for a silent server. Nothing is committed then, and the lease is never taken later.
    ///
    /// - If the commit was sent and not yet answered, the lease is released by its owner id,
    ///   in case the commit took it, once that setup's transaction has ended.
    /// - That release is given up after `connect_timeout`; the lease then expires by its TTL.
    /// - A store already opened (gathering statistics) is closed, which releases the lease.
    /// - A connection left waiting for an answer is closed, never handed back to a pool.
    ///
    /// That cancellation runs on in the background, on the current runtime. To give up and
    /// know it is done, before the runtime shuts down say, use [`Builder::open_until`].
    ///
    /// A silent server is one that stopped answering with its connection still up. See
    /// [A server that stops answering](https://github.com/pgfence/pgfence/blob/main/docs/design.md#a-server-that-stops-answering)
    /// in docs/design.md.
    pub async fn open(self) -> Result<PgKvStore> {
        open::open(self).await
    }

    /// [`Builder::open`], given up when `stop` completes first.
    ///
    /// `stop` is, for example, a signal, a shutdown channel or a timer. Giving up does what
    /// dropping the `open()` future does (see [`Builder::open`], "Cancellation"):
    ///
    /// - A setup still waiting is cancelled: nothing is committed, and the lease is never
    ///   taken later.
    /// - A commit sent and unanswered is ended, and its lease released.
    /// - A store already opened is closed.
    ///
    /// It returns `Ok(None)` only once all that is done, and the server has received the cancel
    /// request. The server acts on that request at once. Nothing of this opening is left
    /// running on the runtime or waiting on the server. So the runtime may shut down right
    /// after, at process exit say.
    ///
    /// It returns as promptly from a server that stopped answering:
    ///
    /// - The connection waiting for it is closed and its task aborted. If the server ever
    ///   answers again, it rolls back what was not committed.
    /// - A cancel request that cannot be delivered is given up after `connect_timeout`. Over
    ///   TLS, delivering it needs the server's answer.
    /// - So is the release of a commit that gets no answer. If that commit took the lease, the
    ///   lease then expires by its TTL.
    /// - Closing a store already opened waits up to `drop_timeout` for its release, as
    ///   [`PgKvStore::close`] does.
    pub async fn open_until(self, stop: impl Future<Output = ()>) -> Result<Option<PgKvStore>> {
        open::open_until(self, stop).await
    }

    /// A standby for this configuration: see [`Standby`].
    pub fn standby(self) -> Standby {
        Standby::new(self)
    }

    /// Waits, without limit, until the lease can be taken, then opens the store. Shorthand for
    /// `self.standby().open()`; use [`Builder::standby`] for a timeout or progress reports.
    pub async fn open_when_available(self) -> Result<PgKvStore> {
        self.standby().open().await
    }

    /// Read-only access to the table without taking the lease, for operators and tools.
    pub async fn inspect(self) -> Result<Inspector> {
        let table = self.validate()?;
        Ok(Inspector::new(table, self.pool()?, self.connection_config(), self.tls.clone()))
    }

    /// Opens a [`blocking::PgKvStore`]: the same as [`blocking::PgKvStore::open`] with this
    /// builder.
    pub fn open_blocking(self) -> Result<blocking::PgKvStore> {
        blocking::PgKvStore::open(self)
    }

    /// The connection configuration every connection of the store uses. Where the caller set
    /// nothing, it has pgfence's defaults:
    /// - The connect timeout.
    /// - A TCP user timeout of one TTL. A statement on a connection whose peer vanished (a
    ///   partition: no reset ever arrives) then fails after a TTL. It does not hang for the
    ///   kernel's retransmission timeout of many minutes.
    /// - TCP keepalives after one TTL without a word from the server, then every second. The
    ///   idle time is at least a second, at most the 32,767 s Linux accepts. A connection may
    ///   wait for an answer that was lost on the way. Nothing of ours is then unacknowledged,
    ///   so the user timeout alone never fires. The keepalives make that same user timeout end
    ///   the connection about a second later. Otherwise it would wait the kernel's two hours
    ///   of keepalive idle time. A caller who configured keepalives keeps them.
    /// - An `application_name` of `pgfence <app>`, so operators can find the store's sessions.
    /// - With [`Builder::tls`], `sslmode=require`.
    ///
    /// `None` for a pool source.
    pub(crate) fn connection_config(&self) -> Option<tokio_postgres::Config> {
        let idle = self.lease_ttl.clamp(Duration::from_secs(1), MAX_KEEPALIVES_IDLE);
        self.config_probing(idle, self.lease_ttl)
    }

    /// [`Builder::connection_config`] for a standby's LISTEN connection, with shorter
    /// keepalives where the caller set none. They probe after a quarter of the TTL of silence,
    /// 1 to 5 s, then every second. The user timeout ends the connection 2 s after the first
    /// unanswered probe. A release's notification lost on a silently dropped connection then
    /// costs the standby seconds, not the holder's TTL. The connection runs no statement to
    /// find out.
    pub(crate) fn listen_config(&self) -> Option<tokio_postgres::Config> {
        let idle = (self.lease_ttl / 4).clamp(Duration::from_secs(1), MAX_LISTEN_KEEPALIVES_IDLE);
        // Whole seconds: the kernel counts keepalive idle time in them.
        let idle = Duration::from_secs(idle.as_secs());
        self.config_probing(idle, idle + Duration::from_secs(2))
    }

    /// The connection configuration with keepalives after `idle` and a TCP user timeout of
    /// `user_timeout`, each unless the caller set one.
    fn config_probing(
        &self,
        idle: Duration,
        user_timeout: Duration,
    ) -> Option<tokio_postgres::Config> {
        let Source::Config(config) = &self.source else { return None };
        let mut config = (**config).clone();
        if self.tls.is_on() {
            config.ssl_mode(SslMode::Require);
        }
        if config.get_connect_timeout().is_none() {
            config.connect_timeout(self.connect_timeout);
        }
        if config.get_tcp_user_timeout().is_none() {
            config.tcp_user_timeout(user_timeout);
        }
        let keepalives_untouched = config.get_keepalives()
            && config.get_keepalives_idle() == TOKIO_POSTGRES_KEEPALIVES_IDLE
            && config.get_keepalives_interval().is_none()
            && config.get_keepalives_retries().is_none();
        if keepalives_untouched {
            // Whole seconds: the kernel takes nothing shorter, nor longer than its maximum. A
            // TTL of hours is clamped to it. The user timeout of one TTL still ends a connection
            // that stopped answering, only not before the TTL.
            config.keepalives_idle(idle);
            config.keepalives_interval(Duration::from_secs(1));
        }
        if config.get_application_name().is_none() {
            config.application_name(format!("pgfence {}", self.application_name));
        }
        Some(config)
    }

    /// The effective local deadline.
    pub(crate) fn deadline(&self) -> Duration {
        self.local_deadline.unwrap_or(self.lease_ttl * 2 / 3)
    }

    /// The effective renewal interval.
    pub(crate) fn renew_every(&self) -> Duration {
        self.renew_interval.unwrap_or(self.deadline() / 2)
    }

    /// The pool the store's operations use: built from the configuration (fast recycling:
    /// a broken connection is noticed on use and retried), or the one supplied.
    pub(crate) fn pool(&self) -> Result<connect::Pool> {
        if let Some(fleet) = &self.fleet {
            return Ok(fleet.pool.clone());
        }
        let config = match &self.source {
            Source::Config(_) => self.connection_config().expect("a config source"),
            Source::Pool(pool) => {
                return Ok(connect::Pool::new(pool.clone(), None, self.pool_mode));
            }
            Source::Invalid(reason) => {
                return Err(Error::config("connection string", reason.clone()));
            }
        };
        let manager = self.tls.manager(config.clone());
        let pool = Pool::builder(manager)
            .post_create(connect::read_committed(self.connect_timeout, self.pool_mode))
            .max_size(self.pool_size)
            .runtime(Runtime::Tokio1)
            .create_timeout(Some(self.connect_timeout))
            .recycle_timeout(Some(self.connect_timeout))
            .build()
            .map_err(|e| Error::config("pool", e.to_string()))?;
        Ok(connect::Pool::new(pool, Some(&config), self.pool_mode))
    }

    /// Checks every option; returns the parsed table name.
    pub(crate) fn validate(&self) -> Result<TableName> {
        if let Source::Invalid(reason) = &self.source {
            return Err(Error::config("connection string", reason.clone()));
        }
        let table = TableName::parse(&self.table)?;
        let ms = |d: Duration| d.as_millis();
        if self.lease_ttl < Duration::from_millis(100)
            || self.lease_ttl > Duration::from_secs(86_400)
        {
            return Err(Error::config("lease_ttl", "must be between 100 ms and 24 h"));
        }
        let deadline = self.deadline();
        if deadline.is_zero() || deadline >= self.lease_ttl {
            return Err(Error::config(
                "local_deadline",
                format!(
                    "{} ms must be above zero and below the TTL of {} ms",
                    ms(deadline),
                    ms(self.lease_ttl)
                ),
            ));
        }
        let renew_every = self.renew_every();
        if renew_every.is_zero() || renew_every >= deadline {
            return Err(Error::config(
                "renew_interval",
                format!(
                    "{} ms must be above zero and below the local deadline of {} ms (TTL {} ms)",
                    ms(renew_every),
                    ms(deadline),
                    ms(self.lease_ttl)
                ),
            ));
        }
        if self.pool_size == 0 {
            return Err(Error::config("pool_size", "must be at least 1"));
        }
        if self.write_concurrency == 0 || self.write_concurrency > 10_000 {
            return Err(Error::config("write_concurrency", "must be between 1 and 10000"));
        }
        if self.max_value_size > MAX_BATCH_BYTES {
            return Err(Error::config(
                "max_value_size",
                format!(
                    "at most {MAX_BATCH_BYTES} bytes (512 MiB): a statement must stay well below \
                     PostgreSQL's 1 GiB limit on a message and on a value"
                ),
            ));
        }
        if self.max_queued_bytes == 0 || self.max_queued_bytes > u32::MAX as usize {
            return Err(Error::config("max_queued_bytes", "must be between 1 and 4294967295"));
        }
        if self.page_size == 0 || self.page_size > 100_000 {
            return Err(Error::config("page_size", "must be between 1 and 100000"));
        }
        // PostgreSQL takes no NUL in a connection's startup parameters or a text value. The
        // connection would fail to encode it. That error looks like a connection failure, and
        // a standby would wait on it forever.
        if self.application_name.contains('\0') {
            return Err(Error::config("application_name", "must not contain a NUL byte"));
        }
        if self.drop_timeout < MIN_DROP_TIMEOUT {
            return Err(Error::config(
                "drop_timeout",
                format!(
                    "{} ms is below the minimum of {} ms: the lease release would always time out",
                    ms(self.drop_timeout),
                    ms(MIN_DROP_TIMEOUT)
                ),
            ));
        }
        if self.connect_timeout.is_zero() {
            return Err(Error::config("connect_timeout", "must be above zero"));
        }
        if matches!(&self.source, Source::Config(config) if has_at_sign_host(config)) {
            // Not echoed: it is probably part of a password.
            return Err(Error::config(
                "connection string",
                "a host contains '@': percent-encode an '@' in the user name or password as %40",
            ));
        }
        match &self.source {
            Source::Pool(_) if self.tls.is_on() => {
                return Err(Error::config(
                    "tls",
                    "a store on a pool connects with the pool's own connector: configure TLS there",
                ));
            }
            Source::Config(config) => match (config.get_ssl_mode(), self.tls.is_on()) {
                (SslMode::Require, false) => {
                    return Err(Error::config(
                        "tls",
                        "sslmode=require needs Builder::tls (the TLS client configuration)",
                    ));
                }
                (SslMode::Disable, true) => {
                    return Err(Error::config("tls", "sslmode=disable contradicts Builder::tls"));
                }
                (_, true) if config.get_hosts().iter().any(|h| matches!(h, Host::Unix(_))) => {
                    return Err(Error::config(
                        "tls",
                        "PostgreSQL offers no TLS on a Unix socket: connect to a TCP host",
                    ));
                }
                _ => {}
            },
            _ => {}
        }
        Ok(table)
    }
}

/// Whether a TCP host contains '@', which no host name or address does. A URL such as
/// `postgres://app:hunter2@s3cr3t@host/db` (an unescaped '@' in the password) parses with the
/// rest of the password in the host.
fn has_at_sign_host(config: &tokio_postgres::Config) -> bool {
    config.get_hosts().iter().any(|host| matches!(host, Host::Tcp(name) if name.contains('@')))
}

fn default_application_name() -> String {
    std::env::args_os()
        .next()
        .and_then(|arg0| {
            std::path::Path::new(&arg0).file_name().map(|n| n.to_string_lossy().into_owned())
        })
        .unwrap_or_else(|| "pgfence".to_owned())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::PgKvStore;

    fn effective(config: tokio_postgres::Config, ttl: Duration) -> tokio_postgres::Config {
        let builder = PgKvStore::builder_from_config(config).lease_ttl(ttl);
        builder.connection_config().expect("a config source")
    }

    #[test]
    fn connections_probe_after_one_ttl_of_silence_unless_keepalives_are_configured() {
        let ttl = Duration::from_secs(20);
        let config = effective(tokio_postgres::Config::new(), ttl);
        assert!(config.get_keepalives());
        assert_eq!(config.get_keepalives_idle(), ttl);
        assert_eq!(config.get_keepalives_interval(), Some(Duration::from_secs(1)));
        assert_eq!(config.get_tcp_user_timeout(), Some(&ttl));

        // The kernel counts keepalive idle time in whole seconds.
        let config = effective(tokio_postgres::Config::new(), Duration::from_millis(500));
        assert_eq!(config.get_keepalives_idle(), Duration::from_secs(1));
        // Nor more than the kernel's maximum.
        let config = effective(tokio_postgres::Config::new(), Duration::from_secs(86_400));
        assert_eq!(config.get_keepalives_idle(), Duration::from_secs(32_767));

        let mut own = tokio_postgres::Config::new();
        own.keepalives_idle(Duration::from_secs(300));
        let config = effective(own, ttl);
        assert_eq!(config.get_keepalives_idle(), Duration::from_secs(300));
        assert_eq!(config.get_keepalives_interval(), None);

        let mut own = tokio_postgres::Config::new();
        own.keepalives_retries(3);
        let config = effective(own, ttl);
        assert_eq!(config.get_keepalives_idle(), TOKIO_POSTGRES_KEEPALIVES_IDLE);

        let mut off = tokio_postgres::Config::new();
        off.keepalives(false);
        assert!(!effective(off, ttl).get_keepalives());
    }
}
