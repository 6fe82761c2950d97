//! The lease once held: its local deadline, loss, the renewal thread and the release.
//!
//! Renewal runs on a thread of its own with a current-thread tokio runtime and its own
//! connection, so a busy or blocked application runtime or an exhausted pool can never delay
//! it, and the release on drop never depends on the caller's runtime (dropping a store inside a
//! current-thread runtime would otherwise deadlock on its own I/O).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot, watch};
use uuid::Uuid;

use crate::config::LeaseLossPolicy;
use crate::connect::Tls;
use crate::error::{Error, LossReason, Result};

/// What a store knows of its lease, published on [`crate::PgKvStore::lease_state`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum LeaseState {
    /// The store holds the lease with this fencing token.
    Held {
        /// The fencing token: strictly increasing per acquisition.
        epoch: i64,
    },
    /// The lease is lost for good; every key operation returns [`Error::LeaseLost`].
    Lost {
        /// The epoch that was held.
        epoch: i64,
        /// Why.
        reason: LossReason,
    },
    /// The store gave the lease up (closed or dropped); the next store may take it at once.
    Released {
        /// The epoch that was held.
        epoch: i64,
    },
}

/// The held lease, shared by the store, its outstanding operations and the renewal thread.
#[derive(Debug)]
pub(crate) struct Lease {
    pub(crate) owner_id: Uuid,
    pub(crate) epoch: i64,
    pub(crate) table: String,
    /// How long after the start of a confirmed renewal the lease is still trusted locally.
    deadline_after: Duration,
    /// The local deadline, on [`clock`]: the start of the last confirmed renewal (or
    /// acquisition) plus `deadline_after`. The database's expiry is later than this, since the
    /// statement that set it started after that instant and added the full TTL.
    deadline: Mutex<Duration>,
    lost: OnceLock<LossReason>,
    /// Set once the lease was given up: nothing is lost any more, later failures are `Closed`.
    given_up: AtomicBool,
    state: watch::Sender<LeaseState>,
    policy: LeaseLossPolicy,
}

impl Lease {
    pub(crate) fn new(
        owner_id: Uuid,
        epoch: i64,
        table: String,
        acquire_started: Duration,
        deadline_after: Duration,
        policy: LeaseLossPolicy,
    ) -> Lease {
        Lease {
            owner_id,
            epoch,
            table,
            deadline_after,
            deadline: Mutex::new(acquire_started + deadline_after),
            lost: OnceLock::new(),
            given_up: AtomicBool::new(false),
            state: watch::Sender::new(LeaseState::Held { epoch }),
            policy,
        }
    }

    pub(crate) fn subscribe(&self) -> watch::Receiver<LeaseState> {
        self.state.subscribe()
    }

    /// Time left until the local deadline; zero once it has passed.
    fn remaining(&self) -> Duration {
        let deadline = *self.deadline.lock().unwrap_or_else(|e| e.into_inner());
        deadline.saturating_sub(clock())
    }

    /// Ok while the lease is neither lost nor past its local deadline. Every operation calls
    /// this first, so a store whose renewal stalled fails fast instead of trying the database.
    pub(crate) fn check(&self) -> Result<()> {
        if let Some(reason) = self.lost.get() {
            return Err(self.fail(reason.clone()));
        }
        if self.remaining().is_zero() {
            return Err(self.fail(LossReason::DeadlinePassed));
        }
        Ok(())
    }

    /// Completes once the local deadline has passed, unless the lease was given up by then
    /// (after a release there is no deadline to keep: an operation still running is left to
    /// finish). Renewal moves the deadline, so it is read again on every wake-up, at least once a
    /// second: tokio's timers stop while the machine is suspended, the deadline's clock does not.
    pub(crate) async fn deadline_passed(&self) {
        const MAX_NAP: Duration = Duration::from_secs(1);
        loop {
            let left = self.remaining();
            if left.is_zero() && !self.given_up.load(Ordering::SeqCst) {
                return;
            }
            let nap = if left.is_zero() { MAX_NAP } else { left.min(MAX_NAP) };
            tokio::time::sleep(nap).await;
        }
    }

    pub(crate) fn is_lost(&self) -> bool {
        self.lost.get().is_some()
    }

    /// Marks the lease lost: the first reason wins, and is logged and published once. Only a
    /// held lease is published as lost: a release that got in first (callers check `given_up`
    /// before calling this, but a release can land in between) keeps `Released`.
    fn lose(&self, reason: LossReason) {
        if self.lost.set(reason).is_ok() {
            let reason = self.reason();
            let lost = LeaseState::Lost { epoch: self.epoch, reason: reason.clone() };
            if self.publish_if_held(lost) {
                tracing::error!(table = %self.table, epoch = self.epoch, %reason, "pgfence lease lost");
            }
        }
    }

    /// Replaces the published state if it is still `Held`, atomically (under the channel's
    /// lock), so that `Lost` and `Released` never overwrite each other. Whether it did.
    fn publish_if_held(&self, next: LeaseState) -> bool {
        self.state.send_if_modified(|state| {
            let held = matches!(state, LeaseState::Held { .. });
            if held {
                *state = next;
            }
            held
        })
    }

    /// Marks the lease lost where there is no caller to tell (a destructor). `Abort` aborts
    /// here (safe in a destructor, even while unwinding); a panic is not, so under `Panic` the
    /// next operation's [`Lease::check`] raises it. Nothing to lose after the lease was given
    /// up.
    pub(crate) fn lose_unreported(&self, reason: LossReason) {
        if self.given_up.load(Ordering::SeqCst) {
            return;
        }
        self.lose(reason);
        if self.policy == LeaseLossPolicy::Abort {
            self.abort_process(&Error::LeaseLost { epoch: self.epoch, reason: self.reason() });
        }
    }

    /// Marks the lease lost, applies the loss policy and returns the error to hand to the
    /// caller. After the lease was given up (close, drop) there is nothing to lose: an
    /// operation still running then gets `Closed`, and the state stays `Released`.
    pub(crate) fn fail(&self, reason: LossReason) -> Error {
        if self.given_up.load(Ordering::SeqCst) {
            return Error::Closed;
        }
        self.lose(reason);
        self.enforce_policy()
    }

    /// The `LeaseLost` error, after the policy's panic or abort if it has one.
    fn enforce_policy(&self) -> Error {
        let error = Error::LeaseLost { epoch: self.epoch, reason: self.reason() };
        match self.policy {
            LeaseLossPolicy::FailClosed => error,
            LeaseLossPolicy::Panic => panic!("pgfence: {error} (table {})", self.table),
            LeaseLossPolicy::Abort => self.abort_process(&error),
        }
    }

    /// Why the lease was lost (`Fenced` if called before it was).
    fn reason(&self) -> LossReason {
        self.lost.get().cloned().unwrap_or(LossReason::Fenced)
    }

    fn abort_process(&self, error: &Error) -> ! {
        tracing::error!(table = %self.table, %error, "pgfence aborting the process");
        eprintln!("pgfence: {error} (table {}); aborting the process", self.table);
        std::process::abort()
    }

    /// A renewal that started at `started` (on [`clock`]) was confirmed by the database.
    fn confirmed(&self, started: Duration) {
        // Never revive a lost lease: loss is permanent even if a late renewal succeeds.
        if !self.is_lost() {
            *self.deadline.lock().unwrap_or_else(|e| e.into_inner()) =
                started + self.deadline_after;
        }
    }

    fn released(&self) {
        self.given_up.store(true, Ordering::SeqCst);
        if self.publish_if_held(LeaseState::Released { epoch: self.epoch }) {
            tracing::info!(table = %self.table, epoch = self.epoch, "pgfence lease released");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lease() -> Lease {
        let ttl = Duration::from_secs(30);
        Lease::new(Uuid::nil(), 7, "t".into(), clock(), ttl, LeaseLossPolicy::FailClosed)
    }

    fn published(lease: &Lease) -> LeaseState {
        lease.subscribe().borrow().clone()
    }

    /// A loss that lands after a release (a release can get in between a caller's check of
    /// `given_up` and its `lose`) leaves the state `Released`, and the other way round.
    #[test]
    fn released_and_lost_never_overwrite_each_other() {
        let released_first = lease();
        released_first.released();
        released_first.lose(LossReason::Fenced);
        assert_eq!(published(&released_first), LeaseState::Released { epoch: 7 });

        let lost_first = lease();
        lost_first.lose(LossReason::TakenOver);
        lost_first.released();
        let lost = LeaseState::Lost { epoch: 7, reason: LossReason::TakenOver };
        assert_eq!(published(&lost_first), lost);
    }
}

/// The clock of the local deadline: time since boot, counting time the machine spent suspended
/// (Linux `CLOCK_BOOTTIME`). std's monotonic clock stops during a suspend, so a resumed laptop
/// or VM would trust a lease that expired long ago; the wall clock counts the suspend but can
/// be stepped (NTP), which would fail a healthy lease or extend a lost one. Elsewhere than
/// Linux, the monotonic clock.
pub(crate) fn clock() -> Duration {
    #[cfg(any(target_os = "linux", target_os = "android"))]
    {
        let now = rustix::time::clock_gettime(rustix::time::ClockId::Boottime);
        Duration::new(now.tv_sec as u64, now.tv_nsec as u32)
    }
    #[cfg(not(any(target_os = "linux", target_os = "android")))]
    {
        static BASE: OnceLock<Instant> = OnceLock::new();
        BASE.get_or_init(Instant::now).elapsed()
    }
}

/// Where the renewal thread gets its connection.
#[derive(Debug, Clone)]
pub(crate) enum Connector {
    /// Connects on the renewal thread's own runtime: fully independent of the application.
    Config(Box<tokio_postgres::Config>, Tls),
    /// An application-supplied pool: a connection is taken out of it for good (the pool opens
    /// a replacement when it needs one). Its I/O task runs on the runtime that created it.
    Pool(deadpool_postgres::Pool),
}

enum Conn {
    Own(tokio_postgres::Client),
    Pooled(deadpool_postgres::ClientWrapper),
}

impl Conn {
    fn client(&self) -> &tokio_postgres::Client {
        match self {
            Conn::Own(client) => client,
            Conn::Pooled(wrapper) => wrapper,
        }
    }
}

impl Connector {
    async fn connect(&self, timeout: Duration) -> Result<Conn> {
        let operation = "connect (lease renewal)";
        let connecting = async {
            match self {
                Connector::Config(config, tls) => {
                    let (client, _) =
                        tls.connect(config, "renewal", None).await.map_err(Error::db(operation))?;
                    Ok(Conn::Own(client))
                }
                Connector::Pool(pool) => {
                    let object = pool.get().await.map_err(Error::pool(operation))?;
                    Ok(Conn::Pooled(deadpool_postgres::Object::take(object)))
                }
            }
        };
        tokio::time::timeout(timeout, connecting)
            .await
            .map_err(|_| Error::Timeout { operation, after: timeout })?
    }
}

/// Timings and statements the renewal thread needs.
#[derive(Debug, Clone)]
pub(crate) struct KeeperConfig {
    pub(crate) connector: Connector,
    pub(crate) renew_sql: String,
    pub(crate) release_sql: String,
    pub(crate) notify_channel: String,
    pub(crate) ttl: Duration,
    pub(crate) renew_interval: Duration,
    pub(crate) connect_timeout: Duration,
    pub(crate) release_timeout: Duration,
}

type Reply = Box<dyn FnOnce(Result<()>) + Send>;

/// The renewal thread, owned by the store. Stopped by [`Keeper::shutdown`] (close) or
/// [`Keeper::shutdown_blocking`] (drop); both release the lease by owner id.
#[derive(Debug)]
pub(crate) struct Keeper {
    stop: mpsc::UnboundedSender<Reply>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Keeper {
    pub(crate) fn spawn(lease: Arc<Lease>, config: KeeperConfig) -> Result<Keeper> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|source| Error::Runtime { source })?;
        let (stop, stopped) = mpsc::unbounded_channel();
        let thread = std::thread::Builder::new()
            .name("pgfence-lease".to_owned())
            .spawn(move || runtime.block_on(run(lease, config, stopped)))
            .map_err(|source| Error::Runtime { source })?;
        Ok(Keeper { stop, thread: Some(thread) })
    }

    /// Stops renewal and releases the lease; returns the release's result.
    pub(crate) async fn shutdown(mut self) -> Result<()> {
        let (tx, rx) = oneshot::channel();
        let reply: Reply = Box::new(move |result| {
            let _ = tx.send(result); // The closer may have given up waiting; nothing to do.
        });
        if self.stop.send(reply).is_err() {
            return Ok(()); // The thread already ended (it panicked under LeaseLossPolicy::Panic).
        }
        let result = rx.await.unwrap_or(Ok(()));
        if let Some(thread) = self.thread.take() {
            // The reply is sent as the thread's last act, so this join is immediate.
            let _ = tokio::task::spawn_blocking(move || thread.join()).await;
        }
        result
    }

    /// Signals the thread to release and waits at most `timeout` for it. Never panics and never
    /// blocks longer, in or outside any runtime: the release runs on the thread's own runtime.
    pub(crate) fn shutdown_blocking(mut self, timeout: Duration) {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let reply: Reply = Box::new(move |result| {
            let _ = tx.send(result); // The dropper may have given up waiting; nothing to do.
        });
        if self.stop.send(reply).is_err() {
            return;
        }
        match rx.recv_timeout(timeout) {
            Ok(Ok(())) => {
                // Detach: the thread is past its last await and exits on its own.
                drop(self.thread.take());
            }
            Ok(Err(e)) => tracing::error!(error = %e, "pgfence lease release failed on drop"),
            Err(_) => tracing::error!(
                ?timeout,
                "pgfence lease release did not finish in time on drop; the lease expires by TTL"
            ),
        }
    }
}

/// The renewal loop. Renews every `renew_interval` measured from the start of the previous
/// confirmed renewal; a failed attempt is retried about every second until the local deadline,
/// where the lease is declared lost. Missed ticks are skipped, never burst (sleeping until a
/// computed instant, rather than a default tokio `interval`, gives exactly that).
///
/// When renewal finds the lease lost it releases at once (by owner id: harmless if the lease
/// is already someone else's, and a standby need not wait out the TTL when it is not), then
/// applies the loss policy, then waits for the store to shut it down.
async fn run(lease: Arc<Lease>, config: KeeperConfig, mut stop: mpsc::UnboundedReceiver<Reply>) {
    let retry_every = config.renew_interval.min(Duration::from_secs(1));
    let mut state = lease.subscribe();
    let mut session: Option<Session> = None;
    let mut released = false;
    let mut next = Instant::now() + config.renew_interval;
    let reply = loop {
        if lease.is_lost() && !released {
            // Lost, whoever found it (an operation or renewal): give the row up now, by owner
            // id, so a standby need not wait out the TTL. Never renew again.
            let quick = config.release_timeout.min(Duration::from_secs(2));
            released = release_within(&config, &lease, &mut session, quick).await.is_ok();
        }
        let wake = if lease.is_lost() { None } else { Some(next) };
        tokio::select! {
            biased;
            reply = stop.recv() => break reply,
            changed = state.changed(), if !lease.is_lost() => {
                let _ = changed; // The sender lives in `lease`, held here: never closed.
                continue;
            }
            _ = sleep_until(wake) => {}
        }
        let started = (Instant::now(), clock());
        let left = lease.remaining();
        let lost = if left.is_zero() {
            Some(LossReason::DeadlinePassed)
        } else {
            let attempt = config.renew_interval.min(left);
            let outcome = tokio::select! {
                biased;
                reply = stop.recv() => break reply,
                outcome = tokio::time::timeout(attempt, renew(&config, &lease, &mut session)) => outcome,
            };
            match outcome {
                Ok(Ok(true)) => {
                    lease.confirmed(started.1);
                    tracing::trace!(table = %lease.table, epoch = lease.epoch, "pgfence lease renewed");
                    next = started.0 + config.renew_interval;
                    None
                }
                Ok(Ok(false)) => Some(LossReason::TakenOver),
                Ok(Err(error)) => {
                    session = None; // Reconnect next time; the old connection may be broken.
                    tracing::warn!(table = %lease.table, epoch = lease.epoch, %error,
                        "pgfence lease renewal failed; retrying until the local deadline");
                    next = Instant::now() + retry_every;
                    None
                }
                Err(_) => {
                    session = None;
                    tracing::warn!(table = %lease.table, epoch = lease.epoch, ?attempt,
                        "pgfence lease renewal timed out; retrying until the local deadline");
                    next = Instant::now() + retry_every;
                    None
                }
            }
        };
        if let Some(reason) = lost {
            lease.lose(reason);
            let quick = config.release_timeout.min(Duration::from_secs(2));
            released = release_within(&config, &lease, &mut session, quick).await.is_ok();
            let _ = lease.enforce_policy(); // Panic or Abort end here; FailClosed goes on.
        }
    };
    // `None`: every handle is gone without asking; release all the same.
    let result = if released {
        Ok(())
    } else {
        release_within(&config, &lease, &mut session, config.release_timeout).await
    };
    if result.is_ok() {
        lease.released();
    }
    if let Some(reply) = reply {
        reply(result);
    }
}

/// Releases by owner id, so this is safe even after a loss: it can only ever expire our own
/// row, never a successor's.
async fn release_within(
    config: &KeeperConfig,
    lease: &Lease,
    session: &mut Option<Session>,
    limit: Duration,
) -> Result<()> {
    let result = tokio::time::timeout(limit, release(config, lease, session))
        .await
        .unwrap_or(Err(Error::Timeout { operation: "release", after: limit }));
    if let Err(e) = &result {
        tracing::error!(table = %lease.table, epoch = lease.epoch, error = %e,
            "pgfence lease release failed; the lease expires by TTL");
    }
    result
}

async fn sleep_until(when: Option<Instant>) {
    match when {
        Some(when) => tokio::time::sleep_until(when.into()).await,
        None => std::future::pending().await,
    }
}

/// The renewal thread's connection, with the renewal statement prepared once.
struct Session {
    conn: Conn,
    renew: tokio_postgres::Statement,
}

async fn connected<'a>(
    config: &KeeperConfig,
    session: &'a mut Option<Session>,
) -> Result<&'a Session> {
    if session.as_ref().is_none_or(|s| s.conn.client().is_closed()) {
        *session = None;
        let conn = config.connector.connect(config.connect_timeout).await?;
        // The renewal thread's session is its own (never returned to a pool), so session state
        // is safe here. An asynchronous commit makes renewal independent of the writers' WAL
        // flushes (measured: renewal p99 12.9 ms -> 5.6 ms beside 16 writers). It is safe: a
        // renewal lost in a database crash only makes the database's expiry earlier than we
        // think, and every write is checked against the database's row, so a successor can
        // only fence us sooner, never share the lease.
        conn.client()
            .batch_execute("SET synchronous_commit = off")
            .await
            .map_err(Error::db("configure renewal session"))?;
        let renew =
            conn.client().prepare(&config.renew_sql).await.map_err(Error::db("prepare renewal"))?;
        *session = Some(Session { conn, renew });
    }
    Ok(session.as_ref().expect("connected above"))
}

/// One renewal attempt: true when the database extended our lease.
async fn renew(
    config: &KeeperConfig,
    lease: &Lease,
    session: &mut Option<Session>,
) -> Result<bool> {
    let session = connected(config, session).await?;
    let ttl_ms = config.ttl.as_millis() as i64;
    let rows = session
        .conn
        .client()
        .query(&session.renew, &[&lease.owner_id, &ttl_ms])
        .await
        .map_err(Error::db("renew lease"))?;
    Ok(!rows.is_empty())
}

async fn release(
    config: &KeeperConfig,
    lease: &Lease,
    session: &mut Option<Session>,
) -> Result<()> {
    let session = connected(config, session).await?;
    let rows = session
        .conn
        .client()
        .query(&config.release_sql, &[&lease.owner_id, &config.notify_channel])
        .await
        .map_err(Error::db("release lease"))?;
    if rows.is_empty() {
        tracing::debug!(table = %lease.table, epoch = lease.epoch,
            "pgfence lease was no longer ours or already expired at release");
    }
    Ok(())
}
