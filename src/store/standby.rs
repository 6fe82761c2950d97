//! Failover: a standby that waits for the lease, then opens the store.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use tokio::sync::watch;

use crate::error::{Error, Result};
use crate::keys::TableName;

use super::builder::{Builder, PoolMode};
use super::listener::Listener;
use super::{PgKvStore, open};

/// The target of this module's log events: stable, whatever the module's path (see
/// docs/design.md, "Logging").
const LOG: &str = "pgfence::standby";

/// Longest a standby sleeps between two looks at the lease when nothing wakes it. It bounds the
/// takeover delay when notifications are unavailable: LISTEN connection down, a pool source, or
/// [`PoolMode::Transaction`]. Each look is one short transaction, a read of the lease row while
/// the holder's lease is live: a second keeps a graceful handoff short at little cost.
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
/// holder's lease expires by the database clock. Any notification wakes it early. While it
/// waits it runs no statement: it makes one attempt when the holder's lease would expire.
///
/// In [`PoolMode::Transaction`] it never `LISTEN`s, alone or in a [`crate::Fleet`]. Behind a
/// transaction pooler a `LISTEN` registers on whichever server session ran it. That session
/// then serves other clients, and the notifications do not reliably reach the standby. So it
/// polls instead: it looks at the lease every second, and when the holder's lease expires. A
/// graceful handoff then takes up to about a second, half a second on average, instead of
/// tens of milliseconds. Each look is one short transaction. Between looks its idle
/// connection holds no server session of the pooler.
///
/// # Connections
///
/// A standby keeps its LISTEN connection, unless it shares one (a `Fleet`'s). It also keeps
/// the connection of its last attempt, idle in the pool the store will use. The next attempt
/// then needs no new connection. The check for a transaction pooler runs on its first attempt
/// only. A graceful handoff thus waits for the setup transaction alone.
///
/// # A failed or silent LISTEN connection
///
/// If the LISTEN connection fails, the standby polls at least every second and reconnects.
/// TCP keepalives find a connection silently dropped on the way, by a NAT or firewall, say.
/// They probe after a quarter of the TTL of silence (1 to 5 s); the connection ends 2 s after
/// an unanswered probe. The standby then looks at the lease again and reconnects. So a lost
/// notification costs seconds, not the holder's whole TTL. A middlebox that still answers
/// the probes but holds back the data is not found: the attempt at the holder's expiry covers
/// it.
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
        let builder = &self.builder;
        // The listener shared with other standbys, else one of its own. None for a pool
        // source, which has no configuration to connect with, and behind a transaction pooler,
        // where a LISTEN stays on a server session that other clients share: the standby then
        // polls.
        let listener = match builder.pool_mode {
            PoolMode::Transaction => None,
            PoolMode::Session => builder.listener.clone().or_else(|| {
                let config = builder.listen_config()?;
                Some(Arc::new(Listener::new(config, builder.tls.clone(), builder.connect_timeout)))
            }),
        };
        let mut subscription = listener.as_ref().map(|listener| listener.subscribe(table));
        // One pool for all attempts: the connection an attempt leaves idle in it is the next
        // one's, so a handoff does not wait for a new connection.
        let reuse = open::Reuse { pool: Some(builder.pool()?), ..open::Reuse::default() };
        loop {
            // Listen before trying, so a release between a failed attempt and the wait below
            // is not missed. A listener not (yet) connected is waited for until it connects or
            // fails, at most `connect_timeout`.
            let listening = match &mut subscription {
                Some(subscription) => {
                    if !subscription.listening() {
                        let connected =
                            tokio::time::timeout(builder.connect_timeout, subscription.changed());
                        tokio::select! {
                            _ = connected => {}
                            () = &mut stop => return Ok(None),
                        }
                    }
                    subscription.listening()
                }
                None => false,
            };
            let wait = match open::attempt(builder.clone(), reuse.clone(), &mut stop).await {
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
            let wait = if listening { wait } else { wait.min(MAX_POLL) };
            // Woken by a notification, or by the listener's connection going or coming back.
            let woken = async {
                match &mut subscription {
                    Some(subscription) => {
                        let _ = tokio::time::timeout(wait, subscription.changed()).await;
                    }
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
