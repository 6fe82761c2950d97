//! Failover: a standby that waits for the lease, then opens the store.

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::sync::{mpsc, watch};

use crate::error::{Error, Result};
use crate::keys::TableName;
use crate::schema;

use super::builder::Builder;
use super::{PgKvStore, open};

/// The target of this module's log events: stable, whatever the module's path (see
/// docs/design.md, "Logging").
const LOG: &str = "pgfence::standby";

/// Longest a standby sleeps between two looks at the lease when nothing wakes it. It bounds the
/// takeover delay when notifications are unavailable: LISTEN connection down, or a pool source.
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
/// # Waking
///
/// While waiting, it `LISTEN`s on the table's channel on a connection of its own, never a
/// pooled one. A graceful release is `close()` or drop of the holder, which `NOTIFY` in the same
/// transaction. So a graceful release wakes it at once. After a crash, it sleeps until the
/// holder's lease expires by the database clock. Any notification wakes it early.
///
/// # A failed or silent LISTEN connection
///
/// If the LISTEN connection fails, the standby polls at least every second and reconnects.
/// After every 5 s without a notification, it checks that the connection still answers. It
/// replaces one that does not, silently dropped by a NAT or firewall, say. So a lost
/// notification costs seconds, not the holder's whole TTL.
///
/// # Cancelling
///
/// Cancel it by dropping the `open()` future; an attempt in progress is then cancelled in the
/// background. Or use [`Standby::open_until`], which returns once nothing of it is left running.
#[derive(Debug)]
pub struct Standby {
    builder: Builder,
    timeout: Option<Duration>,
    progress: watch::Sender<StandbyState>,
}

impl Standby {
    /// A standby for `builder`'s configuration (see [`Builder::standby`]).
    pub(crate) fn new(builder: Builder) -> Standby {
        Standby { builder, timeout: None, progress: watch::Sender::new(StandbyState::Starting) }
    }

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

    /// [`Standby::open`], given up when `stop` completes first.
    ///
    /// It then returns `Ok(None)`, once an attempt in progress is cancelled (see
    /// [`Builder::open_until`]). So nothing of the standby is left running, and the runtime may
    /// shut down right after. The [`Standby::timeout`] gives up the same way, with
    /// [`Error::Timeout`].
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
            let wait = match open::open_until(self.builder.clone(), &mut stop).await {
                Ok(None) => return Ok(None),
                Ok(Some(store)) => {
                    self.progress
                        .send_replace(StandbyState::Acquired { epoch: store.fencing_token() });
                    return Ok(Some(store));
                }
                Err(Error::LeaseHeld { holder, epoch, expires_in, .. }) => {
                    tracing::debug!(
                        target: LOG,
                        %holder, epoch, ?expires_in, "pgfence standby waiting");
                    self.progress.send_replace(StandbyState::Waiting { holder, epoch, expires_in });
                    expires_in + EXPIRY_MARGIN
                }
                Err(e) if e.is_retryable() => {
                    tracing::warn!(target: LOG, error = %e, "pgfence standby retrying");
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
/// answers. A connection may be silently dropped on the way: a NAT or firewall idle timeout, a
/// hung middlebox. It would miss the release's notification. The standby would then wait for
/// the holder's expiry.
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
                tracing::warn!(
                    target: LOG,
                    error = %e, "pgfence standby cannot LISTEN; polling instead");
                None
            }
            Err(_) => {
                tracing::warn!(
                    target: LOG,
                    "pgfence standby LISTEN connection timed out; polling instead");
                None
            }
        }
    }

    fn is_closed(&self) -> bool {
        self.broken || self.client.is_closed() || self.task.is_finished()
    }

    /// Waits for a notification or `max`, whichever comes first.
    ///
    /// After every [`LISTEN_CHECK_EVERY`] without one, it checks that the connection still
    /// answers within `check_timeout`. If not, it closes the connection and returns early. The
    /// standby then looks at the lease again and listens on a new connection.
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
                tracing::warn!(
                    target: LOG,
                    "pgfence standby LISTEN connection stopped answering; reconnecting");
                self.broken = true;
                self.task.abort();
                break;
            }
        }
        while self.notified.try_recv().is_ok() {} // One attempt covers every queued notice.
    }
}
