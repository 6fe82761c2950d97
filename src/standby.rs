//! Failover: a standby that waits for the lease, and read-only inspection for operators.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::sync::{mpsc, watch};
use tokio_postgres::error::SqlState;

use crate::config::Builder;
use crate::error::{Error, Result};
use crate::keys::{TableName, check_key, check_namespaces};
use crate::schema::{self, LeaseInfo};
use crate::sql::Statements;
use crate::store::{PgKvStore, value_or_not_found};

/// Longest a standby sleeps between two looks at the lease when nothing wakes it: bounds the
/// takeover delay when notifications are unavailable (LISTEN connection down, or a pool source).
const MAX_POLL: Duration = Duration::from_secs(1);

/// Margin added to the holder's remaining time before trying again, so the attempt lands just
/// after the expiry rather than just before it.
const EXPIRY_MARGIN: Duration = Duration::from_millis(25);

/// What a [`Standby`] is doing, published on [`Standby::progress`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum StandbyState {
    /// Connecting, or about to make the first attempt.
    Starting,
    /// Another store holds the lease.
    Waiting {
        /// Who holds it (`app pid@host`).
        holder: String,
        /// The holder's epoch.
        epoch: i64,
        /// Time left on the holder's lease, by the database clock, when last seen.
        expires_in: Duration,
    },
    /// The lease is ours; [`Standby::open`] returns the store.
    Acquired {
        /// The new epoch.
        epoch: i64,
    },
}

/// A standby: waits until the lease can be taken, then opens the store. Created by
/// [`Builder::standby`].
///
/// While waiting it `LISTEN`s on the table's channel on a connection of its own (never a pooled
/// one), so a graceful release (`close()` or drop of the holder, which `NOTIFY` in the same
/// transaction) wakes it at once. After a crash it sleeps until the holder's lease expires by
/// the database clock, and is woken early by any notification. If the LISTEN connection fails it
/// polls at least every second and reconnects; after every 5 s without a notification it checks
/// that the connection still answers, and replaces one that does not (silently dropped by a NAT
/// or firewall, say), so a lost notification costs seconds, not the holder's whole TTL. Cancel it by dropping the `open()` future (an
/// attempt in progress is then cancelled in the background), or with
/// [`Standby::open_until`], which returns once nothing of it is left running.
#[derive(Debug)]
pub struct Standby {
    builder: Builder,
    timeout: Option<Duration>,
    progress: watch::Sender<StandbyState>,
}

impl Builder {
    /// A standby for this configuration: see [`Standby`].
    pub fn standby(self) -> Standby {
        Standby {
            builder: self,
            timeout: None,
            progress: watch::Sender::new(StandbyState::Starting),
        }
    }

    /// Waits, without limit, until the lease can be taken, then opens the store. Shorthand for
    /// `self.standby().open()`; use [`Builder::standby`] for a timeout or progress reports.
    pub async fn open_when_available(self) -> Result<PgKvStore> {
        self.standby().open().await
    }

    /// Read-only access to the table without taking the lease, for operators and tools.
    pub async fn inspect(self) -> Result<Inspector> {
        let table = self.validate()?;
        let pool = self.pool()?;
        Ok(Inspector { pool, statements: Statements::new(&table), table })
    }
}

impl Standby {
    /// Gives up with [`Error::Timeout`] if the lease could not be taken within `timeout`. An
    /// attempt still in progress then is cancelled and never takes the lease later (see
    /// [`Builder::open`]).
    pub fn timeout(mut self, timeout: Duration) -> Self {
        self.timeout = Some(timeout);
        self
    }

    /// Watches the standby's progress, for showing standby status.
    pub fn progress(&self) -> watch::Receiver<StandbyState> {
        self.progress.subscribe()
    }

    /// Waits until the lease can be taken and opens the store. Errors other than
    /// [`Error::LeaseHeld`] and retryable connection errors end the wait.
    pub async fn open(self) -> Result<PgKvStore> {
        self.open_until(std::future::pending()).await?.ok_or(Error::Closed)
    }

    /// [`Standby::open`], given up when `stop` completes first: `Ok(None)`, returned once an
    /// attempt in progress is cancelled (see [`Builder::open_until`]), so nothing of the
    /// standby is left running and the runtime may shut down right after. The
    /// [`Standby::timeout`] gives up the same way, with [`Error::Timeout`].
    pub async fn open_until(self, stop: impl Future<Output = ()>) -> Result<Option<PgKvStore>> {
        let table = self.builder.validate()?;
        let timed_out = AtomicBool::new(false);
        let stop = async {
            let Some(after) = self.timeout else { return stop.await };
            tokio::select! {
                () = stop => {}
                () = tokio::time::sleep(after) => timed_out.store(true, Ordering::Relaxed),
            }
        };
        let opened = self.wait(&table, stop).await?;
        match self.timeout {
            Some(after) if opened.is_none() && timed_out.load(Ordering::Relaxed) => {
                Err(Error::Timeout { operation: "wait for lease", after })
            }
            _ => Ok(opened),
        }
    }

    /// The standby's loop; `None` once `stop` completed.
    async fn wait(
        &self,
        table: &TableName,
        stop: impl Future<Output = ()>,
    ) -> Result<Option<PgKvStore>> {
        tokio::pin!(stop);
        let mut listener: Option<Listener> = None;
        loop {
            // Listen before trying, so a release between a failed attempt and the wait below
            // is not missed.
            if listener.as_ref().is_none_or(|l| l.is_closed()) {
                listener = tokio::select! {
                    listener = Listener::start(&self.builder, table) => listener,
                    () = &mut stop => return Ok(None),
                };
            }
            let wait = match self.builder.clone().open_until(&mut stop).await {
                Ok(None) => return Ok(None),
                Ok(Some(store)) => {
                    self.progress
                        .send_replace(StandbyState::Acquired { epoch: store.fencing_token() });
                    return Ok(Some(store));
                }
                Err(Error::LeaseHeld { holder, epoch, expires_in, .. }) => {
                    tracing::debug!(%holder, epoch, ?expires_in, "pgfence standby waiting");
                    self.progress.send_replace(StandbyState::Waiting { holder, epoch, expires_in });
                    expires_in + EXPIRY_MARGIN
                }
                Err(e) if e.is_retryable() => {
                    tracing::warn!(error = %e, "pgfence standby retrying");
                    MAX_POLL
                }
                Err(e) => return Err(e),
            };
            let wait = if listener.is_some() { wait } else { wait.min(MAX_POLL) };
            let woken = async {
                match &mut listener {
                    Some(l) => l.wait(wait, self.builder.connect_timeout).await,
                    None => tokio::time::sleep(wait).await,
                }
            };
            tokio::select! {
                () = woken => {}
                () = &mut stop => return Ok(None),
            }
        }
    }
}

/// How often a standby waiting on its LISTEN connection checks that the connection still
/// answers. One silently dropped on the way (a NAT or firewall idle timeout, a hung middlebox)
/// would miss the release's notification, and the standby would wait for the holder's expiry.
const LISTEN_CHECK_EVERY: Duration = Duration::from_secs(5);

/// A LISTEN on the table's channel, on a connection of its own. The task that drives the
/// connection is aborted when the listener is dropped.
struct Listener {
    notified: mpsc::UnboundedReceiver<()>,
    task: tokio::task::JoinHandle<()>,
    client: tokio_postgres::Client,
    /// Set when the connection stopped answering: closed, to be replaced.
    broken: bool,
}

impl Drop for Listener {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Listener {
    /// `None` when notifications are unavailable (pool source, or the connection failed): the
    /// standby then polls.
    async fn start(builder: &Builder, table: &TableName) -> Option<Listener> {
        let config = builder.connection_config()?;
        let connecting = async {
            let (tx, notified) = mpsc::unbounded_channel();
            let (client, task) = builder.tls.connect(&config, "standby LISTEN", Some(tx)).await?;
            let listener = Listener { notified, task, client, broken: false };
            let channel = schema::notify_channel(&listener.client, table).await?;
            listener.client.batch_execute(&format!("LISTEN \"{channel}\"")).await?;
            Ok::<_, tokio_postgres::Error>(listener)
        };
        match tokio::time::timeout(builder.connect_timeout, connecting).await {
            Ok(Ok(listener)) => Some(listener),
            Ok(Err(e)) => {
                tracing::warn!(error = %e, "pgfence standby cannot LISTEN; polling instead");
                None
            }
            Err(_) => {
                tracing::warn!("pgfence standby LISTEN connection timed out; polling instead");
                None
            }
        }
    }

    fn is_closed(&self) -> bool {
        self.broken || self.client.is_closed() || self.task.is_finished()
    }

    /// Waits for a notification or `max`, whichever comes first. After every
    /// [`LISTEN_CHECK_EVERY`] without one, checks that the connection still answers (within
    /// `check_timeout`); if not, closes it and returns early, so the standby looks at the lease
    /// again and listens on a new connection.
    async fn wait(&mut self, max: Duration, check_timeout: Duration) {
        let until = tokio::time::Instant::now() + max;
        loop {
            let left = until.saturating_duration_since(tokio::time::Instant::now());
            let quiet = left.min(LISTEN_CHECK_EVERY);
            // Ok: a notification, or the connection ended (`None`).
            if left.is_zero() || tokio::time::timeout(quiet, self.notified.recv()).await.is_ok() {
                break;
            }
            if tokio::time::Instant::now() >= until {
                break;
            }
            let answered =
                tokio::time::timeout(check_timeout, self.client.simple_query("SELECT 1"));
            if !matches!(answered.await, Ok(Ok(_))) {
                tracing::warn!("pgfence standby LISTEN connection stopped answering; reconnecting");
                self.broken = true;
                self.task.abort();
                break;
            }
        }
        while self.notified.try_recv().is_ok() {} // One attempt covers every queued notice.
    }
}

/// Read-only access to a table without its lease: the lease row, reads and listings, and the
/// operator's break-glass release. Created by [`Builder::inspect`]. A table that does not exist
/// yet reads as empty.
#[derive(Debug)]
pub struct Inspector {
    pool: deadpool_postgres::Pool,
    table: TableName,
    statements: Statements,
}

impl Inspector {
    async fn query(
        &self,
        operation: &'static str,
        sql: &str,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    ) -> Result<Option<Vec<tokio_postgres::Row>>> {
        let client = self.pool.get().await.map_err(Error::pool(operation))?;
        match client.query(sql, params).await {
            Ok(rows) => Ok(Some(rows)),
            Err(e) if e.code() == Some(&SqlState::UNDEFINED_TABLE) => Ok(None),
            Err(source) => Err(Error::Database { operation, source }),
        }
    }

    /// The lease row: holder, epoch, time left. `None` if no store ever opened the table.
    pub async fn lease_info(&self) -> Result<Option<LeaseInfo>> {
        let client = self.pool.get().await.map_err(Error::pool("read lease"))?;
        match schema::lease_info(&**client, &self.statements).await {
            Err(Error::Database { source, .. })
                if source.code() == Some(&SqlState::UNDEFINED_TABLE) =>
            {
                Ok(None)
            }
            other => other,
        }
    }

    /// Reads a value; [`Error::NotFound`] if absent.
    pub async fn read(
        &self,
        primary_namespace: &str,
        secondary_namespace: &str,
        key: &str,
    ) -> Result<Vec<u8>> {
        check_key(primary_namespace, secondary_namespace, key)?;
        let rows = self
            .query("read", &self.statements.read, &[&primary_namespace, &secondary_namespace, &key])
            .await?
            .unwrap_or_default();
        value_or_not_found(&rows, primary_namespace, secondary_namespace, key)
    }

    /// Keys of a namespace pair, in byte order.
    pub async fn list(
        &self,
        primary_namespace: &str,
        secondary_namespace: &str,
    ) -> Result<Vec<String>> {
        check_namespaces(primary_namespace, secondary_namespace)?;
        let rows = self
            .query("list", &self.statements.list, &[&primary_namespace, &secondary_namespace])
            .await?;
        Ok(rows.unwrap_or_default().iter().map(|row| row.get(0)).collect())
    }

    /// Every key as `(primary_namespace, secondary_namespace, key)`, in byte order.
    pub async fn list_all_keys(&self) -> Result<Vec<(String, String, String)>> {
        let rows = self.query("list_all_keys", &self.statements.list_all, &[]).await?;
        Ok(rows
            .unwrap_or_default()
            .iter()
            .map(|row| (row.get(0), row.get(1), row.get(2)))
            .collect())
    }

    /// Break-glass: expires the lease whoever holds it, so another store can take it at once,
    /// and wakes waiting standbys. The holder, if still running, is fenced from its next write
    /// on and fails closed at its next renewal. Returns the holder it released, or `None` when
    /// it released nothing: nobody held the lease, or the lease it found expired or changed
    /// hands before its release ran (a new holder is then left alone: see
    /// [`Inspector::lease_info`] for who holds the lease now).
    pub async fn force_release(&self) -> Result<Option<LeaseInfo>> {
        let held = self.lease_info().await?.filter(|info| info.active);
        let Some(held) = held else { return Ok(None) };
        let client = self.pool.get().await.map_err(Error::pool("force release"))?;
        let channel = schema::notify_channel(&**client, &self.table)
            .await
            .map_err(Error::db("resolve table schema"))?;
        drop(client);
        let rows = self
            .query("force release", &self.statements.release, &[&held.owner_id, &channel])
            .await?
            .unwrap_or_default();
        // Empty: the lease expired or changed hands between the two statements. The release
        // is by owner id, so a new holder keeps its lease, and nothing was released.
        if rows.is_empty() {
            tracing::info!(table = %self.table.display(), epoch = held.epoch,
                "pgfence force release found the lease expired or taken over; released nothing");
            return Ok(None);
        }
        tracing::warn!(table = %self.table.display(), epoch = held.epoch, holder = %held.holder,
            "pgfence lease force-released by an operator");
        Ok(Some(held))
    }
}
