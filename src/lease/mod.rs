//! The lease once held: one state machine ([`Lease`]) for its local deadline, loss and
//! release.
//!
//! Its state is published on [`crate::PgKvStore::lease_state`]. The renewal thread that keeps
//! the lease and releases it is in [`keeper`]; a fleet's shared renewal thread in [`fleet`].

mod fleet;
mod keeper;
mod policy;

pub(crate) use fleet::Renewer;
pub(crate) use keeper::{Connector, Keeper, KeeperConfig};
pub use policy::LeaseLossPolicy;

use std::sync::Mutex;
use std::time::Duration;

use tokio::sync::watch;
use uuid::Uuid;

use crate::clock::clock;
use crate::error::{Error, LossReason, Result};
use crate::stats::Recorder;

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
    /// The store stopped (closed or dropped) but could not release the lease: the database was
    /// out of reach. It no longer renews the lease. The next store takes it once it expires,
    /// within one TTL. It is published so that a watcher learns this store is done.
    Abandoned {
        /// The epoch that was held.
        epoch: i64,
    },
}

/// The held lease, shared by the store, its outstanding operations and the renewal thread.
#[derive(Debug)]
pub(crate) struct Lease {
    /// The owner ids this store has written to the lease row (see [`Owners`]).
    owners: Mutex<Owners>,
    pub(crate) epoch: i64,
    pub(crate) table: String,
    /// How long after the start of a confirmed renewal the lease is still trusted locally.
    deadline_after: Duration,
    /// The local deadline and the state, behind one lock. Every change goes through
    /// [`Lease::transition`], which publishes it on `published` under that lock, so no two
    /// changes can overwrite each other's publication.
    tracked: Mutex<Tracked>,
    published: watch::Sender<LeaseState>,
    policy: LeaseLossPolicy,
    /// The store's counters. Here because the lease is what the store's operations and its
    /// renewal thread all share.
    pub(crate) stats: Recorder,
}

/// The owner ids of one acquisition.
///
/// The lease row holds one of them. The store changes it to fence off a statement of its own
/// whose connection broke ([`Lease::next_owner`]): that statement can then no longer lock the
/// row, as a former holder's cannot. Every id is this store's alone. So renewal and release
/// match any of them; one whose change went unanswered may be the row's.
#[derive(Debug)]
struct Owners {
    /// What mutations send: the id last confirmed in the row.
    current: Uuid,
    /// How many changes were confirmed: a statement sent at generation `g` is fenced once it is
    /// greater than `g`.
    generation: u32,
    /// Every id ever sent, confirmed or not.
    all: Vec<Uuid>,
}

/// What [`Lease::tracked`] holds.
#[derive(Debug)]
struct Tracked {
    /// The local deadline, on [`clock`]: the start of the last confirmed renewal (or
    /// acquisition) plus `deadline_after`. The database's expiry is later than this, since the
    /// statement that set it started after that instant and added the full TTL. Only a
    /// confirmed renewal of a held lease moves it.
    deadline: Duration,
    state: State,
}

/// The lease's state. `LeaseState`, what is published, follows it: it leaves `Held` once, at
/// the first change, and never changes after that.
#[derive(Debug, Clone, PartialEq, Eq)]
enum State {
    /// Held: trusted until the local deadline.
    Held,
    /// Lost for good; the first reason wins. Published `Lost`.
    Lost { reason: LossReason },
    /// Renewal stopped without a release (the database out of reach, or the renewal thread
    /// ended unanswered): the lease expires by TTL. Published `Abandoned`. Not given up: the
    /// local deadline still fails operations, and a loss found later is recorded (`lost`).
    Abandoned { lost: Option<LossReason> },
    /// Given up by close or drop: released. Published `Released`, or `Lost` if it was lost
    /// before. Nothing is lost any more: later failures are `Closed`.
    Released {
        /// The loss before the release, if any.
        lost: Option<LossReason>,
        /// Set when [`Lease::lose_unreported`] found a mutation that may still commit after
        /// the release. Whoever waited for it must not be told `Closed`, which reads as "not
        /// written".
        outcome_unknown: bool,
    },
}

/// What happens to the lease: the input of [`Lease::transition`].
#[derive(Debug)]
enum Event {
    /// Found lost, by renewal or an operation.
    Lost(LossReason),
    /// A mutation was dropped while it may still commit, with no caller to tell. Before the
    /// release this is a loss. After it, it is only a note that its outcome is unknown.
    DroppedUnknown(LossReason),
    /// A renewal that started at this instant (on [`clock`]) was confirmed by the database.
    Renewed(Duration),
    /// The renewal thread released the lease (close or drop).
    Released,
    /// The renewal thread stopped without releasing it.
    Abandoned,
}

impl State {
    /// The loss recorded in this state, if any.
    fn lost(&self) -> Option<&LossReason> {
        match self {
            State::Held => None,
            State::Lost { reason } => Some(reason),
            State::Abandoned { lost } | State::Released { lost, .. } => lost.as_ref(),
        }
    }

    /// The state after `event`. A loss is permanent and its first reason wins; a release ends
    /// everything; a lease that is not held can no longer be renewed.
    fn after(self, event: Event) -> State {
        match (self, event) {
            (State::Held, Event::Lost(reason) | Event::DroppedUnknown(reason)) => {
                State::Lost { reason }
            }
            (
                State::Abandoned { lost: None },
                Event::Lost(reason) | Event::DroppedUnknown(reason),
            ) => State::Abandoned { lost: Some(reason) },
            (State::Released { lost, .. }, Event::DroppedUnknown(_)) => {
                State::Released { lost, outcome_unknown: true }
            }
            (State::Held, Event::Released) => {
                State::Released { lost: None, outcome_unknown: false }
            }
            (State::Lost { reason }, Event::Released) => {
                State::Released { lost: Some(reason), outcome_unknown: false }
            }
            (State::Held, Event::Abandoned) => State::Abandoned { lost: None },
            (state, _) => state,
        }
    }
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
        let stats = Recorder::new(&table);
        stats.lease(true, epoch);
        Lease {
            stats,
            owners: Mutex::new(Owners { current: owner_id, generation: 0, all: vec![owner_id] }),
            epoch,
            table,
            deadline_after,
            tracked: Mutex::new(Tracked {
                deadline: acquire_started + deadline_after,
                state: State::Held,
            }),
            published: watch::Sender::new(LeaseState::Held { epoch }),
            policy,
        }
    }

    fn owners(&self) -> std::sync::MutexGuard<'_, Owners> {
        self.owners.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The owner id a mutation sends now, and its generation.
    pub(crate) fn owner(&self) -> (Uuid, u32) {
        let owners = self.owners();
        (owners.current, owners.generation)
    }

    /// Every owner id this store may have left in the lease row: what renewal and release match.
    pub(crate) fn owner_ids(&self) -> Vec<Uuid> {
        self.owners().all.clone()
    }

    /// Whether an owner id was added since `ids` was read ([`Lease::owner_ids`]). Ids are only
    /// ever added, each before the change that writes it is sent ([`Lease::next_owner`]).
    pub(crate) fn owner_ids_added_since(&self, ids: &[Uuid]) -> bool {
        self.owners().all.len() > ids.len()
    }

    /// A new owner id, to be written in place of any of this store's. It joins the ids that
    /// renewal and release match before it is sent: its change may commit unanswered.
    pub(crate) fn next_owner(&self) -> (Vec<Uuid>, Uuid) {
        let mut owners = self.owners();
        let next = Uuid::new_v4();
        let ids = owners.all.clone();
        owners.all.push(next);
        (ids, next)
    }

    /// The lease row now holds `owner` (from [`Lease::next_owner`]): every statement sent with an
    /// earlier id is fenced.
    pub(crate) fn owner_changed(&self, owner: Uuid) {
        let mut owners = self.owners();
        owners.current = owner;
        owners.generation += 1;
    }

    pub(crate) fn subscribe(&self) -> watch::Receiver<LeaseState> {
        self.published.subscribe()
    }

    fn tracked(&self) -> std::sync::MutexGuard<'_, Tracked> {
        self.tracked.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The one place the lease changes. Applies `event`, publishes the first change away from
    /// `Held`, and logs it. Publishing happens under the same lock, so publications never
    /// overwrite each other. Returns the state after the event.
    fn transition(&self, event: Event) -> State {
        let mut tracked = self.tracked();
        if let (State::Held, Event::Renewed(started)) = (&tracked.state, &event) {
            tracked.deadline = *started + self.deadline_after;
            return State::Held;
        }
        let before = tracked.state.clone();
        tracked.state = before.clone().after(event);
        if let (None, Some(reason)) = (before.lost(), tracked.state.lost()) {
            self.stats.failed_closed(reason);
        }
        if before == State::Held && tracked.state != State::Held {
            let epoch = self.epoch;
            let published = match &tracked.state {
                State::Held => unreachable!("checked above"),
                State::Lost { reason } => {
                    tracing::error!(table = %self.table, epoch, %reason, "pgfence lease lost");
                    LeaseState::Lost { epoch, reason: reason.clone() }
                }
                State::Released { .. } => {
                    tracing::info!(table = %self.table, epoch, "pgfence lease released");
                    LeaseState::Released { epoch }
                }
                State::Abandoned { .. } => LeaseState::Abandoned { epoch },
            };
            self.stats.lease(false, epoch);
            self.published.send_replace(published);
        }
        tracked.state.clone()
    }

    /// The local deadline, on [`clock`].
    fn deadline(&self) -> Duration {
        self.tracked().deadline
    }

    /// Time left until the local deadline; zero once it has passed.
    pub(crate) fn remaining(&self) -> Duration {
        self.deadline().saturating_sub(clock())
    }

    /// Whether the lease was given up (released by close or drop).
    fn given_up(&self) -> bool {
        matches!(self.tracked().state, State::Released { .. })
    }

    /// Ok while the lease is neither lost nor past its local deadline. Every operation calls
    /// this first, so a store whose renewal stalled fails fast instead of trying the database.
    pub(crate) fn check(&self) -> Result<()> {
        let (state, deadline) = {
            let tracked = self.tracked();
            (tracked.state.clone(), tracked.deadline)
        };
        if let Some(reason) = state.lost() {
            return Err(self.fail(reason.clone()));
        }
        if deadline <= clock() {
            return Err(self.fail(LossReason::DeadlinePassed));
        }
        Ok(())
    }

    /// Completes once the local deadline has passed, unless the lease was given up by then.
    /// After a release there is no deadline to keep: an operation still running is left to
    /// finish.
    ///
    /// Renewal moves the deadline, so it is read again on every wake-up, at least once a
    /// second. The timers of tokio stop while the machine is suspended. The deadline's clock
    /// does not.
    pub(crate) async fn deadline_passed(&self) {
        const MAX_NAP: Duration = Duration::from_secs(1);
        loop {
            let left = self.remaining();
            if left.is_zero() && !self.given_up() {
                return;
            }
            let nap = if left.is_zero() { MAX_NAP } else { left.min(MAX_NAP) };
            tokio::time::sleep(nap).await;
        }
    }

    /// [`Lease::deadline_passed`] for operations, without a timer of their own while the lease
    /// is held.
    ///
    /// A timer per statement cost the write path a wake-up of the runtime's driver thread. That
    /// was measurable at one writer. So while `Held`, it waits for the state to change. The
    /// renewal thread wakes at least once a second, and publishes `DeadlinePassed` within about
    /// a second of the deadline.
    ///
    /// Once the state is anything else, nothing more will be published. The lease was lost for
    /// another reason, or the store stopped. It then times the deadline itself.
    pub(crate) async fn deadline_reported(&self) {
        let mut state = self.subscribe();
        loop {
            if self.remaining().is_zero() && !self.given_up() {
                return;
            }
            if !matches!(*state.borrow_and_update(), LeaseState::Held { .. }) {
                return self.deadline_passed().await;
            }
            if state.changed().await.is_err() {
                return std::future::pending().await; // The lease is gone: nothing to wait for.
            }
        }
    }

    pub(crate) fn is_lost(&self) -> bool {
        self.tracked().state.lost().is_some()
    }

    /// Whether a mutation was dropped while it may still commit: the lease is lost, or it was
    /// already given up then (see [`Lease::lose_unreported`]).
    pub(crate) fn dropped_unknown(&self) -> bool {
        match &self.tracked().state {
            State::Released { lost, outcome_unknown } => lost.is_some() || *outcome_unknown,
            state => state.lost().is_some(),
        }
    }

    /// Marks the lease lost. The first reason wins. It is logged and published once, if the
    /// lease was still held then. A release that got in first keeps `Released`.
    fn lose(&self, reason: LossReason) -> State {
        self.transition(Event::Lost(reason))
    }

    /// Marks the lease lost where there is no caller to tell (a destructor). `Abort` aborts
    /// here (safe in a destructor, even while unwinding); a panic is not, so under `Panic` the
    /// next operation's [`Lease::check`] raises it. Nothing to lose after the lease was given
    /// up; that a mutation's outcome is unknown is still recorded ([`Lease::dropped_unknown`]).
    pub(crate) fn lose_unreported(&self, reason: LossReason) {
        let state = self.transition(Event::DroppedUnknown(reason));
        if self.policy == LeaseLossPolicy::Abort && !matches!(state, State::Released { .. }) {
            self.abort_process(&Error::LeaseLost { epoch: self.epoch, reason: self.reason() });
        }
    }

    /// Marks the lease lost, applies the loss policy and returns the error to hand to the
    /// caller. After the lease was given up (close, drop) there is nothing to lose: an
    /// operation still running then gets `Closed`, and the state stays `Released`.
    pub(crate) fn fail(&self, reason: LossReason) -> Error {
        match self.lose(reason) {
            State::Released { .. } => Error::Closed,
            _ => self.enforce_policy(),
        }
    }

    /// The error of a mutation that may have committed: [`Lease::fail`] with
    /// `WriteOutcomeUnknown`, except that after a release it is `LeaseLost` all the same, not
    /// `Closed`, which would read as "not written".
    pub(crate) fn fail_outcome_unknown(&self) -> Error {
        self.fail_sent(LossReason::WriteOutcomeUnknown)
    }

    /// The error of a mutation whose statement was sent and may still commit: [`Lease::fail`]
    /// with `reason`, except that after a release it is `LeaseLost` (with `reason`) all the
    /// same, not `Closed`, which would read as "not written". The caller may have found the
    /// lease still held a moment before: a release can land in between.
    pub(crate) fn fail_sent(&self, reason: LossReason) -> Error {
        match self.lose(reason.clone()) {
            State::Released { .. } => Error::LeaseLost { epoch: self.epoch, reason },
            _ => self.enforce_policy(),
        }
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
        self.tracked().state.lost().cloned().unwrap_or(LossReason::Fenced)
    }

    fn abort_process(&self, error: &Error) -> ! {
        tracing::error!(table = %self.table, %error, "pgfence aborting the process");
        eprintln!("pgfence: {error} (table {}); aborting the process", self.table);
        std::process::abort()
    }

    /// A renewal that started at `started` (on [`clock`]) was confirmed by the database. Never
    /// revives a lost lease: loss is permanent even if a late renewal succeeds.
    fn confirmed(&self, started: Duration) {
        self.transition(Event::Renewed(started));
    }

    /// The renewal thread released the lease.
    fn released(&self) {
        self.transition(Event::Released);
    }

    /// The renewal thread stopped without releasing the lease: it expires by TTL. Returns the
    /// state after (a lease already lost or released stays so).
    fn abandoned(&self) -> State {
        self.transition(Event::Abandoned)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) fn lease() -> Lease {
        let ttl = Duration::from_secs(30);
        Lease::new(Uuid::nil(), 7, "t".into(), clock(), ttl, LeaseLossPolicy::FailClosed)
    }

    pub(super) fn published(lease: &Lease) -> LeaseState {
        lease.subscribe().borrow().clone()
    }

    /// A loss that lands after a release leaves the state `Released`. A release after a loss
    /// leaves it `Lost`. Only the first change away from `Held` is published.
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

    /// After the release there is nothing left to lose, so a failure is `Closed`. The exception
    /// is a statement that may still commit: it is `LeaseLost` all the same, since `Closed`
    /// reads as "not written". A mutation dropped with its outcome unknown is recorded. The
    /// published state stays `Released` throughout.
    #[test]
    fn after_a_release_only_unknown_outcomes_are_reported_as_losses() {
        let lease = lease();
        lease.released();
        assert!(matches!(lease.fail(LossReason::Fenced), Error::Closed));
        assert!(!lease.dropped_unknown());
        let e = lease.fail_sent(LossReason::DeadlinePassed);
        let lost = matches!(e, Error::LeaseLost { epoch: 7, reason: LossReason::DeadlinePassed });
        assert!(lost, "{e}");
        lease.lose_unreported(LossReason::WriteOutcomeUnknown);
        assert!(lease.dropped_unknown());
        assert!(!lease.is_lost());
        assert_eq!(published(&lease), LeaseState::Released { epoch: 7 });
    }

    /// A confirmed renewal moves the deadline of a held lease, never of a lost one: loss is
    /// permanent even if a late renewal succeeds.
    #[test]
    fn only_a_held_lease_is_renewed() {
        let lease = lease();
        let started = lease.deadline();
        lease.confirmed(started);
        assert_eq!(lease.deadline(), started + Duration::from_secs(30));
        lease.lose(LossReason::TakenOver);
        lease.confirmed(started + Duration::from_secs(60));
        assert_eq!(lease.deadline(), started + Duration::from_secs(30));
        let e = lease.check().unwrap_err();
        assert!(matches!(e, Error::LeaseLost { reason: LossReason::TakenOver, .. }), "{e}");
    }
}
