//! The renewal thread: renews the lease, publishes a passed deadline, and releases the lease
//! when the store stops or after a loss.
//!
//! Renewal runs on a thread of its own, with a current-thread tokio runtime and its own
//! connection. So a busy or blocked application runtime, or an exhausted pool, can never delay
//! it. And the release on drop never depends on the caller's runtime. Otherwise dropping a
//! store inside a current-thread runtime would deadlock on its own I/O.
//!
//! A fleet's stores run the same loop as tasks on one such thread, over one shared connection
//! (see [`super::fleet`]).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tokio_postgres::types::ToSql;

use super::Lease;
use super::fleet::Renewer;
use crate::clock::clock;
use crate::connect::{Tls, servers};
use crate::error::{Error, LossReason, Result};
use crate::session::{PoolMode, Prepared};
use crate::sql::{self, Statement};

/// The target of this module's log events: stable, whatever the module's path (see
/// docs/design.md, "Logging").
const LOG: &str = "pgfence::lease";

/// Where the renewal thread gets its connection.
#[derive(Debug, Clone)]
pub(crate) enum Connector {
    /// Connects on the renewal thread's own runtime: fully independent of the application.
    Config(Box<tokio_postgres::Config>, Tls, PoolMode),
    /// An application-supplied pool: a connection is taken out of it for good (the pool opens
    /// a replacement when it needs one). Its I/O task runs on the runtime that created it.
    Pool(crate::connect::Pool),
}

pub(super) enum Conn {
    Own(tokio_postgres::Client),
    Pooled(deadpool_postgres::ClientWrapper),
}

impl std::fmt::Debug for Conn {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Conn::Own(_) => "Conn::Own",
            Conn::Pooled(_) => "Conn::Pooled",
        })
    }
}

impl Conn {
    pub(super) fn client(&self) -> &tokio_postgres::Client {
        match self {
            Conn::Own(client) => client,
            Conn::Pooled(wrapper) => wrapper,
        }
    }
}

impl Connector {
    /// How statements run on the connections it makes.
    pub(super) fn mode(&self) -> PoolMode {
        match self {
            Connector::Config(_, _, mode) => *mode,
            Connector::Pool(pool) => pool.mode(),
        }
    }

    pub(super) async fn connect(&self, timeout: Duration) -> Result<Conn> {
        let operation = "connect (lease renewal)";
        let connecting = async {
            match self {
                Connector::Config(config, tls, mode) => {
                    let (client, _) = tls
                        .connect_in(*mode, config, "renewal", None)
                        .await
                        .map_err(|e| Error::connect(operation, &servers(config), e))?;
                    Ok(Conn::Own(client))
                }
                Connector::Pool(pool) => {
                    let object = pool.get(operation).await?;
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
    pub(crate) renew_sql: Statement,
    pub(crate) release_sql: Statement,
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
    /// The store's own renewal thread; `None` for a task on a fleet's renewal thread.
    thread: Option<std::thread::JoinHandle<()>>,
    /// The fleet's renewal thread, kept running while this store lives.
    _fleet: Option<Arc<Renewer>>,
    /// To tell, if the thread ended without answering, what became of the lease.
    lease: Arc<Lease>,
}

impl Keeper {
    pub(crate) fn spawn(lease: Arc<Lease>, config: KeeperConfig) -> Result<Keeper> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|source| Error::Runtime { source })?;
        let (stop, stopped) = mpsc::unbounded_channel();
        let thread_lease = Arc::clone(&lease);
        let thread = std::thread::Builder::new()
            .name("pgfence-lease".to_owned())
            .spawn(move || runtime.block_on(run(thread_lease, config, Link::own(), stopped)))
            .map_err(|source| Error::Runtime { source })?;
        Ok(Keeper { stop, thread: Some(thread), _fleet: None, lease })
    }

    /// Renewal as a task on a fleet's renewal thread, over the fleet's shared connection
    /// (`config.connector` is not used). The task holds the fleet's thread until it ends, so a
    /// release that outlasts the drop's wait still runs to its end, as on a thread of its own.
    pub(crate) fn spawn_in(
        fleet: &Arc<Renewer>,
        lease: Arc<Lease>,
        config: KeeperConfig,
    ) -> Keeper {
        let (stop, stopped) = mpsc::unbounded_channel();
        let link = Link::shared(Arc::clone(fleet));
        fleet.spawn(run(Arc::clone(&lease), config, link, stopped));
        Keeper { stop, thread: None, _fleet: Some(Arc::clone(fleet)), lease }
    }

    /// Stops renewal and releases the lease; returns the release's result.
    ///
    /// The thread may have ended without answering. Under
    /// [`LeaseLossPolicy::Panic`](crate::LeaseLossPolicy::Panic), it panics after a loss that
    /// renewal found. That may happen before this request, or while the request waited for a
    /// release attempt to end. Then nothing released the lease on this request, and no attempt
    /// is retried any more. It returns [`Error::LeaseLost`] (see [`Keeper::ended`]).
    pub(crate) async fn shutdown(mut self) -> Result<()> {
        let (tx, rx) = oneshot::channel();
        let reply: Reply = Box::new(move |result| {
            let _ = tx.send(result); // The closer may have given up waiting; nothing to do.
        });
        // `None`: the thread dropped the request unanswered (its receiver, or the reply in it).
        let answer = match self.stop.send(reply) {
            Ok(()) => rx.await.ok(),
            Err(_) => None,
        };
        if let Some(thread) = self.thread.take() {
            // The reply is sent as the thread's last act. A thread that dropped the request is
            // unwinding out of its runtime. Either way this join is immediate.
            let _ = tokio::task::spawn_blocking(move || thread.join()).await;
        }
        answer.unwrap_or_else(|| Err(self.ended()))
    }

    /// Signals the thread to release and waits at most `timeout` for it. Never panics and never
    /// blocks longer, in or outside any runtime: the release runs on the thread's own runtime.
    pub(crate) fn shutdown_blocking(mut self, timeout: Duration) {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        let reply: Reply = Box::new(move |result| {
            let _ = tx.send(result); // The dropper may have given up waiting; nothing to do.
        });
        if self.stop.send(reply).is_err() {
            // Not joined: the drop waits for nothing it need not. Logged, as a close() says it.
            let error = self.ended();
            tracing::error!(
                target: LOG,
                %error, "pgfence renewal thread had ended before the drop");
            return;
        }
        match rx.recv_timeout(timeout) {
            Ok(Ok(())) => {
                // Detach: the thread is past its last await and exits on its own.
                drop(self.thread.take());
            }
            Ok(Err(e)) => tracing::error!(
                target: LOG,
                error = %e, "pgfence lease release failed on drop"),
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                let error = self.ended();
                tracing::error!(
                    target: LOG,
                    %error, "pgfence renewal thread ended without releasing on drop");
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => tracing::error!(target: LOG,
                ?timeout,
                "pgfence lease release did not finish in time on drop; the lease expires by TTL"
            ),
        }
    }

    /// What to report when the thread ended without answering a request to stop.
    ///
    /// Only a panic ends it so: `run` returns only after answering, and the channel stays open
    /// while `self` lives. Only [`LeaseLossPolicy::Panic`](crate::LeaseLossPolicy::Panic)
    /// panics there, after a loss: that is [`Error::LeaseLost`].
    ///
    /// Any other panic would be a bug of this crate. The lease was then not released and is no
    /// longer renewed, so it expires by TTL. It is published as `Abandoned` if it was still
    /// `Held`, and reported as [`Error::Runtime`].
    fn ended(&self) -> Error {
        let lease = &self.lease;
        // Atomic with the check for a loss: a loss found meanwhile is reported as that loss.
        match lease.abandoned().lost().cloned() {
            Some(reason) => Error::LeaseLost { epoch: lease.epoch, reason },
            None => {
                let message = "renewal thread panicked before releasing the lease (expires by TTL)";
                tracing::error!(
                    target: LOG,
                    table = %lease.table, epoch = lease.epoch, "pgfence {message}");
                Error::Runtime { source: std::io::Error::other(message) }
            }
        }
    }
}

/// The longest the renewal thread sleeps.
///
/// Its timers are tokio's, on the monotonic clock, which stops while the machine is suspended.
/// The local deadline is on [`clock`], which does not. The thread wakes at least this often,
/// only to read the clock, with no SQL. So a renewal that came due during a suspend is sent
/// within about this long after the resume. A deadline that passed is published as soon.
const MAX_NAP: Duration = Duration::from_secs(1);

/// What the renewal thread does when it wakes while the lease is held.
#[derive(Debug, PartialEq, Eq)]
enum Step {
    /// The local deadline has passed: the lease is lost (`DeadlinePassed`).
    Lose,
    /// A renewal is due.
    Renew,
    /// Nothing is due: sleep this long, then decide again.
    Sleep(Duration),
}

/// The decision, from the times alone (all on [`clock`]): `now`, the next renewal and the local
/// deadline. A sleep ends at the deadline or the renewal, whichever comes first. It never
/// lasts longer than [`MAX_NAP`], whatever a timer would say after a suspend.
fn step(now: Duration, next_renewal: Duration, deadline: Duration) -> Step {
    if now >= deadline {
        Step::Lose
    } else if now >= next_renewal {
        Step::Renew
    } else {
        Step::Sleep((next_renewal.min(deadline) - now).min(MAX_NAP))
    }
}

/// The renewal loop: one store's lease, on a thread of its own or as a task on a fleet's.
///
/// It renews every `renew_interval`, measured from the start of the previous confirmed
/// renewal. A failed attempt is retried about every second until the local deadline. There
/// the lease is declared lost. Missed renewals are skipped, never burst.
///
/// Every time is on [`clock`], and the thread wakes at least every [`MAX_NAP`]. So the deadline
/// is published (`DeadlinePassed`) within about a second of passing. That holds after a
/// suspend too, and while a renewal attempt still waits for the server.
///
/// # After a loss
///
/// Renewal or an operation may find the loss. Either way, no renewal is sent any more. One
/// that has started to connect is not sent either. The lease is released by owner id. That is
/// harmless if the lease is already someone else's. When it is not, a standby need not wait
/// out the TTL.
///
/// A release that fails, with the network still down say, is retried about every second. It
/// is retried until one succeeds, or until the database's expiry of the lease has certainly
/// passed. Then there is nothing left to release. So a holder that regains the network hands
/// over about a second later, not at the expiry.
///
/// A loss that renewal found applies the loss policy after the first release attempt. `Panic`
/// ends the thread (a fleet's task) there, unanswered (see [`Keeper::ended`]). Otherwise the
/// loop waits for the store to shut it down.
async fn run(
    lease: Arc<Lease>,
    config: KeeperConfig,
    mut session: Link,
    mut stop: mpsc::UnboundedReceiver<Reply>,
) {
    let retry_every = config.renew_interval.min(MAX_NAP);
    let quick = config.release_timeout.min(Duration::from_secs(2));
    let mut state = lease.subscribe();
    let mut next_renewal = clock() + config.renew_interval;
    // The first release attempt after a loss found by an operation goes at once.
    let mut next_release = Duration::ZERO;
    let mut released = false;
    // Until when a release can still matter. The database's expiry of our lease is one TTL
    // after the last renewal statement that ran. Before any renewal, it is the acquisition,
    // committed before this thread started. A renewal's statement runs before its attempt
    // ends: its answer arrives, or this thread gives up on it and drops its connection. So
    // this bound is one TTL after the last attempt ended, not after the last confirmed one
    // started. An attempt that timed out may still have extended the lease. A statement that
    // runs later still can outlast the bound. It may be held up in the network, or on the
    // server by a lock on the lease row. If every release fails until then, the lease expires
    // by TTL, as it did without these retries. Only how soon a standby gets in depends on
    // this, never fencing.
    let mut expiry_bound = clock() + config.ttl;
    let reply = loop {
        let now = clock();
        // The exported gauge of the time left (the thread wakes at least once a second).
        lease.stats.deadline_in(lease.deadline().saturating_sub(now));
        if lease.is_lost() {
            if released || now >= expiry_bound {
                if !released {
                    tracing::error!(target: LOG, table = %lease.table, epoch = lease.epoch,
                        "pgfence lease release kept failing until the lease's database expiry; \
                            stopped trying");
                }
                break stop.recv().await;
            }
            if now < next_release {
                let nap = (next_release - now).min(MAX_NAP);
                tokio::select! {
                    biased;
                    reply = stop.recv() => break reply,
                    () = tokio::time::sleep(nap) => continue,
                }
            }
            next_release = now + retry_every;
            let result = tokio::select! {
                biased;
                reply = stop.recv() => break reply,
                result = release_within(&config, &lease, &mut session, quick) => result,
            };
            released = result.is_ok();
            if let Err(error) = result {
                tracing::warn!(target: LOG, table = %lease.table, epoch = lease.epoch, %error,
                    "pgfence lease release failed; retrying about every second until the lease's \
                        database expiry");
            }
            continue;
        }
        let found = match step(now, next_renewal, lease.deadline()) {
            Step::Lose => LossReason::DeadlinePassed,
            Step::Sleep(nap) => {
                tokio::select! {
                    biased;
                    reply = stop.recv() => break reply,
                    changed = state.changed() => {
                        let _ = changed; // The sender lives in `lease`, held here: never closed.
                    }
                    () = tokio::time::sleep(nap) => {}
                }
                continue;
            }
            Step::Renew => {
                let started = clock();
                // Raced with the deadline rather than timed out at it: the deadline is on
                // `clock`, a timeout on tokio's timer, which a suspend stops.
                let outcome = tokio::select! {
                    biased;
                    reply = stop.recv() => break reply,
                    () = lease.deadline_passed() => None,
                    outcome = tokio::time::timeout(
                        config.renew_interval,
                        renew(&config, &lease, &mut session),
                    ) => Some(outcome),
                };
                expiry_bound = clock() + config.ttl;
                match outcome {
                    Some(Ok(Ok(Renewal::Extended))) => {
                        lease.stats.renewed(clock().saturating_sub(started));
                        lease.confirmed(started);
                        tracing::trace!(target: LOG, table = %lease.table, epoch = lease.epoch,
                            "pgfence lease renewed");
                        next_renewal = started + config.renew_interval;
                        continue;
                    }
                    Some(Ok(Ok(Renewal::NotSent))) => continue, // Lost meanwhile: release.
                    Some(Ok(Ok(Renewal::NotOurs))) => {
                        lease.stats.renewal_failed();
                        LossReason::TakenOver
                    }
                    Some(Ok(Err(error))) => {
                        lease.stats.renewal_failed();
                        // Reconnect next time if the connection broke; a server's error (its
                        // table gone, say) leaves a fleet's shared connection in use.
                        session.reset(false);
                        tracing::warn!(
                            target: LOG,
                            table = %lease.table, epoch = lease.epoch, %error,
                            "pgfence lease renewal failed; retrying until the local deadline");
                        next_renewal = clock() + retry_every;
                        continue;
                    }
                    Some(Err(_)) => {
                        lease.stats.renewal_failed();
                        session.reset(true);
                        tracing::warn!(target: LOG, table = %lease.table, epoch = lease.epoch,
                            timeout = ?config.renew_interval,
                            "pgfence lease renewal timed out; retrying until the local deadline");
                        next_renewal = clock() + retry_every;
                        continue;
                    }
                    None => {
                        lease.stats.renewal_failed();
                        session.reset(true); // Still waiting for the server: that connection is useless.
                        LossReason::DeadlinePassed
                    }
                }
            }
        };
        lease.lose(found);
        // Released before the policy applies: Panic ends this thread, Abort the process.
        let result = release_within(&config, &lease, &mut session, quick).await;
        released = result.is_ok();
        if let Err(error) = result {
            tracing::warn!(target: LOG, table = %lease.table, epoch = lease.epoch, %error,
                "pgfence lease release failed; retrying about every second until the lease's \
                    database expiry");
        }
        next_release = clock() + retry_every;
        let _ = lease.enforce_policy(); // Panic or Abort end here; FailClosed goes on.
    };
    // `None`: every handle is gone without asking; release all the same.
    let result = if released {
        Ok(())
    } else {
        release_within(&config, &lease, &mut session, config.release_timeout).await
    };
    match &result {
        Ok(()) => lease.released(),
        Err(error) => {
            tracing::error!(target: LOG, table = %lease.table, epoch = lease.epoch, %error,
                "pgfence lease release failed; the lease expires by TTL");
            lease.abandoned();
        }
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
    session: &mut Link,
    limit: Duration,
) -> Result<()> {
    match tokio::time::timeout(limit, release(config, lease, session)).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(error)) => {
            session.reset(false); // Broken: the next attempt connects anew.
            Err(error)
        }
        Err(_) => {
            // Not answering (silently dropped, say): the next attempt connects anew rather
            // than queue behind the unanswered release.
            session.reset(true);
            Err(Error::Timeout { operation: "release", after: limit })
        }
    }
}

/// A renewal connection, configured for renewal.
///
/// Its session is renewal's own (never returned to a pool), so session state is safe here.
/// Renewals commit synchronously, as writes do: a renewal that cannot be made durable must not
/// be confirmed (see `sql::RENEWAL_SESSION`). The price is a renewal latency that includes a
/// WAL flush, queued behind the writers' (measured before: renewal p99 5.6 ms asynchronous,
/// 12.9 ms synchronous, beside 16 writers), well below any local deadline. Read committed: a
/// renewal that waited for another update of the lease row must re-read it, not fail (see
/// `sql::READ_COMMITTED`). `extra` is more session settings (a fleet's).
///
/// Behind a transaction pooler ([`PoolMode::Transaction`]) the connection's session is shared,
/// so none of this is set: each renewal runs in `sql::BEGIN_READ_COMMITTED` instead.
pub(super) async fn renewal_connection(
    connector: &Connector,
    timeout: Duration,
    extra: &str,
) -> Result<Conn> {
    let conn = connector.connect(timeout).await?;
    let configure = format!("{}; {extra}", sql::RENEWAL_SESSION);
    let configure = if extra.is_empty() { sql::RENEWAL_SESSION } else { &configure };
    (connector.mode().set_session(conn.client(), configure).await)
        .map_err(Error::db("configure renewal session"))?;
    Ok(conn)
}

/// Where one lease's renewal gets its connection: its own, or its fleet's shared one.
struct Link {
    /// The fleet's renewal thread with its shared connection; `None`: a connection of its own.
    fleet: Option<Arc<Renewer>>,
    session: Option<Session>,
}

impl Link {
    fn own() -> Link {
        Link { fleet: None, session: None }
    }

    fn shared(fleet: Arc<Renewer>) -> Link {
        Link { fleet: Some(fleet), session: None }
    }

    /// After a failure: the next attempt prepares the statement again, on a new connection if
    /// this one broke. A connection of its own is always replaced, as before fleets. A fleet's
    /// shared one is replaced for all its leases only if it broke or `stuck` (no answer in
    /// time). A server's error for one lease (its table dropped, say) leaves the others' be.
    fn reset(&mut self, stuck: bool) {
        if let (Some(session), Some(fleet)) = (self.session.take(), &self.fleet) {
            if stuck {
                fleet.connection().replace(session.generation);
            }
        }
    }
}

/// A renewal connection, with this lease's renewal statement prepared on it.
struct Session {
    conn: Arc<Conn>,
    /// Which of the fleet's shared connections this is (0 for a connection of its own).
    generation: u64,
    renew: Prepared<'static>,
}

async fn connected<'a>(config: &KeeperConfig, link: &'a mut Link) -> Result<&'a Session> {
    let usable = link.session.as_ref().is_some_and(|s| {
        !s.conn.client().is_closed()
            && link.fleet.as_ref().is_none_or(|f| f.connection().is_current(s.generation))
    });
    if !usable {
        link.session = None;
        let (conn, generation) = match &link.fleet {
            None => {
                let timeout = config.connect_timeout;
                (Arc::new(renewal_connection(&config.connector, timeout, "").await?), 0)
            }
            Some(fleet) => fleet.connection().get().await?,
        };
        let mode = config.connector.mode();
        let renew = (mode.prepare(conn.client(), &config.renew_sql).await)
            .map_err(Error::db("prepare renewal"))?
            .into_owned();
        link.session = Some(Session { conn, generation, renew });
    }
    Ok(link.session.as_ref().expect("connected above"))
}

/// What one renewal attempt found.
enum Renewal {
    /// The database extended our lease.
    Extended,
    /// No row: the lease is no longer ours (or already expired).
    NotOurs,
    /// Not sent: the lease was found lost (by an operation) while connecting.
    NotSent,
}

async fn renew(config: &KeeperConfig, lease: &Lease, session: &mut Link) -> Result<Renewal> {
    let session = connected(config, session).await?;
    // Checked after connecting (several round trips), right before sending. A renewal of a
    // lease already lost would extend it in the database by a whole TTL, for nothing. A
    // release that then fails would leave a standby waiting that much longer.
    if lease.is_lost() {
        return Ok(Renewal::NotSent);
    }
    let ttl_ms = config.ttl.as_millis() as i64;
    loop {
        let ids = lease.owner_ids();
        let (client, params): (_, [&(dyn ToSql + Sync); 2]) =
            (session.conn.client(), [&ids, &ttl_ms]);
        // Behind a transaction pooler the session's isolation may be another client's.
        let rows = match config.connector.mode().keeps_session() {
            true => session.renew.query(client, &params).await,
            false => session.renew.query_read_committed(client, &params).await,
        };
        let rows = rows.map_err(Error::db("renew lease"))?;
        if !rows.is_empty() {
            return Ok(Renewal::Extended);
        }
        // No row had one of `ids`. The store's own change of owner id may have committed
        // while this was in transit, to an id not among them: that is no loss. Such a change
        // adds its id before it is sent. So if none was added, the row is not ours.
        if !lease.owner_ids_added_since(&ids) {
            return Ok(Renewal::NotOurs);
        }
    }
}

async fn release(config: &KeeperConfig, lease: &Lease, session: &mut Link) -> Result<()> {
    let session = connected(config, session).await?;
    let release = &config.release_sql;
    loop {
        let ids = lease.owner_ids();
        let params: [&(dyn ToSql + Sync); 2] = [&ids, &config.notify_channel];
        // Behind a transaction pooler pinned, as `renew` is: the session may be another
        // client's, at serializable or with `synchronous_commit = off`.
        let mode = config.connector.mode();
        let rows =
            (mode.query_pinned(session.conn.client(), release, &params, mode.keeps_session()))
                .await
                .map_err(Error::db("release lease"))?;
        if !rows.is_empty() {
            return Ok(());
        }
        // As in `renew`: released nothing, maybe because the store's own change of owner id
        // committed meanwhile. Then the row is still ours, under the new id: release again.
        if !lease.owner_ids_added_since(&ids) {
            tracing::debug!(target: LOG, table = %lease.table, epoch = lease.epoch,
                "pgfence lease was no longer ours or already expired at release");
            return Ok(());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use uuid::Uuid;

    use crate::lease::LeaseLossPolicy;
    use crate::lease::LeaseState;
    use crate::lease::tests::{lease, published};

    /// The renewal thread never sleeps longer than `MAX_NAP`, however far away its next
    /// renewal is. It decides from the times alone. A suspend may outlast the deadline: the
    /// clock jumped past it, and the thread loses the lease. A shorter suspend may outlast the
    /// renewal interval: the thread renews at once.
    #[test]
    fn renewal_thread_wakes_at_least_every_second_and_decides_from_the_clock() {
        let s = Duration::from_secs;
        let (next_renewal, deadline) = (s(110), s(120));
        assert_eq!(step(s(100), next_renewal, deadline), Step::Sleep(MAX_NAP));
        assert_eq!(step(s(109) + MAX_NAP / 2, next_renewal, deadline), Step::Sleep(MAX_NAP / 2));
        assert_eq!(step(s(115), next_renewal, deadline), Step::Renew);
        assert_eq!(step(s(120), next_renewal, deadline), Step::Lose);
        assert_eq!(step(s(500), next_renewal, deadline), Step::Lose);
        // A renewal due after the deadline (a suspend in between): the sleep ends at the deadline.
        let ms = Duration::from_millis;
        assert_eq!(step(s(120) - ms(300), s(130), deadline), Step::Sleep(ms(300)));
    }

    /// A keeper whose thread panicked at once, without taking any request: what a request to
    /// stop finds after the renewal thread's panic under `LeaseLossPolicy::Panic`.
    fn keeper_whose_thread_panicked(lease: &Arc<Lease>) -> Keeper {
        let (stop, stopped) = mpsc::unbounded_channel::<Reply>();
        let thread = std::thread::spawn(move || {
            let _stopped = stopped; // Dropped while unwinding, as `run`'s receiver is.
            panic!("renewal thread panics (on purpose, in a test)");
        });
        while !thread.is_finished() {
            std::thread::sleep(Duration::from_millis(10));
        }
        Keeper { stop, thread: Some(thread), _fleet: None, lease: Arc::clone(lease) }
    }

    /// A renewal thread that ended without answering is reported, never taken for a release.
    /// After a loss (the panic of `LeaseLossPolicy::Panic`), it is reported as that loss.
    /// Otherwise it is a bug, reported as `Runtime`, with the lease published `Abandoned`. The
    /// drop path only logs it, at once.
    #[tokio::test]
    async fn shutdown_reports_a_thread_that_ended_unanswered() {
        let lost = Arc::new(lease());
        lost.lose(LossReason::TakenOver);
        let e = keeper_whose_thread_panicked(&lost).shutdown().await.unwrap_err();
        assert!(matches!(e, Error::LeaseLost { epoch: 7, reason: LossReason::TakenOver }), "{e}");

        let held = Arc::new(lease());
        let e = keeper_whose_thread_panicked(&held).shutdown().await.unwrap_err();
        assert!(matches!(e, Error::Runtime { .. }), "{e:?}");
        assert_eq!(published(&held), LeaseState::Abandoned { epoch: 7 });

        for lease in [&lost, &Arc::new(lease())] {
            keeper_whose_thread_panicked(lease).shutdown_blocking(Duration::from_secs(3600));
        }
    }

    /// A renewal thread whose database cannot be reached (nothing listens on port 1).
    fn unreachable(renew_interval: Duration) -> KeeperConfig {
        let mut config = tokio_postgres::Config::new();
        config.host("127.0.0.1").port(1).user("nobody");
        KeeperConfig {
            connector: Connector::Config(Box::new(config), Tls::default(), PoolMode::Session),
            renew_sql: Statement { sql: "SELECT 1".into(), types: &[] },
            release_sql: Statement { sql: "SELECT 1".into(), types: &[] },
            notify_channel: "c".into(),
            ttl: renew_interval * 3,
            renew_interval,
            connect_timeout: Duration::from_secs(1),
            release_timeout: Duration::from_secs(1),
        }
    }

    /// The renewal thread publishes a passed deadline about when it passes. It does not wait
    /// for its timer for the next renewal to fire. Here that renewal is a minute after a
    /// deadline 1.5 s away.
    ///
    /// That is in effect what a suspend that outlasts the deadline does: it stops tokio's
    /// timers, not [`clock`]. A suspend itself cannot be made here; this is its effect on the
    /// loop. Nothing is sent before the loss. There is no server: only the release after the
    /// loss tries one, and fails.
    #[tokio::test]
    async fn passed_deadline_is_published_without_waiting_for_the_renewal_timer() {
        let deadline_after = Duration::from_millis(1500);
        let policy = LeaseLossPolicy::FailClosed;
        let lease =
            Arc::new(Lease::new(Uuid::nil(), 7, "t".into(), clock(), deadline_after, policy));
        let keeper =
            Keeper::spawn(Arc::clone(&lease), unreachable(Duration::from_secs(60))).unwrap();
        let lost = LeaseState::Lost { epoch: 7, reason: LossReason::DeadlinePassed };
        let mut state = lease.subscribe();
        tokio::time::timeout(Duration::from_secs(30), state.wait_for(|s| *s == lost))
            .await
            .expect("published long before the renewal timer (60 s)")
            .unwrap();
        let late = clock().saturating_sub(lease.deadline());
        assert!(late < Duration::from_secs(3), "published {late:?} after the deadline");
        assert!(keeper.shutdown().await.is_err(), "nothing to release to");
        assert_eq!(published(&lease), lost);
    }
}
