//! Write coalescing: concurrent writes and removes of different keys share one fenced statement.
//!
//! Every fenced statement share-locks the one lease row. When many run at once, PostgreSQL
//! records the concurrent lockers in a MultiXact. That costs WAL and server CPU on every write.
//! Measured with 16 writers and one statement per write, each write cost one MultiXact and
//! 200-230 more bytes of WAL. The server used 1.25-1.4x the CPU of an unfenced upsert (see
//! BENCHMARKS.md).
//!
//! So at most `write_concurrency` single-key mutation statements run at once. A mutation that
//! arrives while that many run joins a queue. The next statement to start takes the queue,
//! oldest first, up to [`MAX_GROUP`] mutations and [`MAX_GROUP_BYTES`] of values. That is one
//! fenced statement (the same as an atomic batch's), one lease check and one commit. Below that
//! concurrency nothing waits, and every mutation runs its own statement.
//!
//! Durability: a group's one statement commits durably if any of its mutations is durable, and
//! deferred only if all of them are (`write_deferred` and the like). Durable for a deferred
//! mutation is only slower, never weaker. Keeping the two apart instead would take two queues,
//! or groups that skip mutations, and the queue's rule "the oldest first" with them.
//!
//! Fencing is unchanged: a queued mutation commits only inside a statement guarded by the
//! lease CTE, like any other. Per-key order is unchanged too. A mutation joins the queue
//! holding its key's turn, and keeps it until its statement has finished. So the queue never
//! holds two mutations of one key, and nothing later of the key can run in between.
//!
//! Errors:
//!
//! - A group's statement that fails leaves every mutation of the group to run again on its
//!   own. Writes are idempotent under a held turn. So each caller gets the error of its own
//!   mutation, and one failing mutation cannot fail the others.
//! - Each re-run waits for a statement permit like any other. So `write_concurrency` bounds
//!   the re-runs too.
//! - A lost lease or a closed store fails each of them at once, before any SQL.
//! - A statement that may have committed is not run again: each caller gets `LeaseLost` with
//!   `WriteOutcomeUnknown`. It may have committed if its connection broke after it was sent,
//!   and its retries did not settle it.
//! - Nor is a statement that failed with a lost lease run again. Each caller gets that
//!   `LeaseLost`, also if the store was closed meanwhile. A statement abandoned unanswered at
//!   the local deadline is an example.

use std::collections::BTreeMap;
use std::sync::Mutex;

use tokio::sync::{Semaphore, oneshot};

use super::statement::{Durability, Mutation, apply_alone, apply_fenced};
use crate::error::{Error, KeyPath, LossReason, Result};
use crate::exec::Executor;
use crate::lease::Lease;

/// The target of this module's log events: stable, whatever the module's path (see
/// docs/design.md, "Logging").
const LOG: &str = "pgfence::write";

/// The most mutations one shared statement carries.
const MAX_GROUP: usize = 1000;
/// The most value bytes one shared statement carries (unless its first value alone is larger).
const MAX_GROUP_BYTES: usize = 16 << 20;

/// The queue of mutations waiting for a statement, and the statements that may run.
#[derive(Debug)]
pub(crate) struct Coalescer {
    queue: Mutex<Queue>,
    statements: Semaphore,
}

/// The mutations waiting for a statement, by place in line: oldest first.
///
/// Every caller looks up its own mutation each time it gets a statement permit. A map by
/// place makes that O(log n). A scan by key path made n queued callers cost O(n²): 100,000
/// queued writes took minutes (see BENCHMARKS.md, "Memory of queued writes").
#[derive(Debug, Default)]
struct Queue {
    waiting: BTreeMap<Place, Queued>,
    next: Place,
}

/// A mutation's place in the queue, in arrival order. Unique for the coalescer's life.
type Place = u64;

/// A mutation waiting in the queue, with the way back to its caller.
#[derive(Debug)]
struct Queued {
    path: KeyPath,
    mutation: Mutation,
    durability: Durability,
    done: oneshot::Sender<Outcome>,
}

/// What the statement that took a queued mutation reports back.
#[derive(Debug)]
enum Outcome {
    /// The mutation's own result: committed, or the error of a statement it ran alone in.
    Done(Result<()>),
    /// The shared statement failed: run the mutation again on its own for its own result.
    Alone(Mutation),
}

impl Coalescer {
    pub(crate) fn new(statements: usize) -> Coalescer {
        Coalescer { queue: Mutex::new(Queue::default()), statements: Semaphore::new(statements) }
    }

    /// Queues a mutation behind those already waiting; returns its place.
    fn push(&self, queued: Queued) -> Place {
        let mut queue = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        let place = queue.next;
        queue.next += 1;
        queue.waiting.insert(place, queued);
        place
    }

    /// Takes the caller's own mutation back out of the queue; false if a statement took it.
    fn withdraw(&self, own: Place) -> bool {
        let mut queue = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        queue.waiting.remove(&own).is_some()
    }

    /// Takes the oldest queued mutations, as many as one statement should carry.
    ///
    /// That is at least one, at most [`MAX_GROUP`] and, past the first, at most
    /// [`MAX_GROUP_BYTES`] of values. The rest stay queued for the next statement. It takes
    /// nothing unless `own`, the caller's mutation, is still queued. A caller whose mutation is
    /// already in a statement leaves the queue to the callers still in it. The group comes with
    /// whether it carries `own`.
    fn take_group(&self, own: Place) -> (Vec<Queued>, bool) {
        let mut queue = self.queue.lock().unwrap_or_else(|e| e.into_inner());
        if !queue.waiting.contains_key(&own) {
            return (Vec::new(), false);
        }
        let mut group = Vec::new();
        let mut bytes = 0;
        let mut carries_own = false;
        while let Some(oldest) = queue.waiting.first_entry() {
            bytes += match &oldest.get().mutation {
                Mutation::Write(value) => value.len(),
                Mutation::Remove => 0,
            };
            if group.len() == MAX_GROUP || (!group.is_empty() && bytes > MAX_GROUP_BYTES) {
                break;
            }
            carries_own |= *oldest.key() == own;
            group.push(oldest.remove());
        }
        (group, carries_own)
    }

    /// Applies one mutation while the caller holds its key's turn. It runs in a statement of
    /// its own when one is free, otherwise together with the others waiting. `Ok` means
    /// committed.
    pub(crate) async fn apply(
        &self,
        exec: &Executor,
        path: &KeyPath,
        mutation: Mutation,
        durability: Durability,
    ) -> Result<()> {
        // Below `write_concurrency` a statement is free: run at once, without queueing. A
        // released permit goes to a waiting caller first, so a free one means nobody waits.
        //
        // Each statement's future is boxed (here and below), allocated only when it runs. Not
        // boxed, its several KB (pool, driver, retries) would be part of every write's future,
        // also of the many waiting in the queue: that was most of their memory.
        if let Ok(_permit) = self.statements.try_acquire() {
            return Box::pin(apply_alone(exec, path, &mutation, durability)).await;
        }
        // A store that has lost its lease fails at once. It does not queue behind statements
        // that may take a while (they fail too, at their own check). (Closing does not fail
        // it: this operation was admitted before, and close() waits for it.)
        exec.lease.check()?;
        let (done, mut outcome) = oneshot::channel();
        let place = self.push(Queued { path: path.clone(), mutation, durability, done });
        let mut waiting =
            Waiting { coalescer: self, lease: &exec.lease, place, carrying_own: false };
        // While its mutation is queued, a caller competes for a statement. With one, it takes
        // the oldest queued mutations and runs them. Its own is among them unless more than a
        // group is queued. So whatever is queued always has a caller about to run it. Once its
        // mutation is in a statement (its own or another caller's), it only waits for the
        // report. It never delays its own result by running other callers' mutations.
        loop {
            tokio::select! {
                biased;
                reported = &mut outcome => {
                    waiting.reported();
                    return self.finish(exec, path, durability, reported).await;
                }
                permit = self.statements.acquire() => {
                    let _permit = permit.expect("the semaphore is never closed");
                    let (group, carries_own) = self.take_group(place);
                    if group.is_empty() {
                        break; // Ours is in another caller's statement.
                    }
                    waiting.carrying_own = carries_own;
                    Box::pin(self.run_group(exec, group)).await;
                    waiting.carrying_own = false;
                }
            }
        }
        let reported = outcome.await;
        waiting.reported();
        self.finish(exec, path, durability, reported).await
    }

    /// The caller's result from what its statement reported.
    async fn finish(
        &self,
        exec: &Executor,
        path: &KeyPath,
        durability: Durability,
        reported: Result<Outcome, oneshot::error::RecvError>,
    ) -> Result<()> {
        match reported {
            Ok(Outcome::Done(result)) => result,
            // The re-run takes a statement like any other, so `write_concurrency` stays a
            // bound. No deadlock: the caller holds no permit here. It drops the one it ran a
            // group with before reading the report. And permit holders never wait for a key's
            // turn.
            Ok(Outcome::Alone(mutation)) => {
                let _permit =
                    self.statements.acquire().await.expect("the semaphore is never closed");
                Box::pin(apply_alone(exec, path, &mutation, durability)).await
            }
            // The statement's task ended without reporting: a panic (which a lease-loss policy
            // raises) or a runtime shutting down. The statement may still be running on the
            // server, so the key's order cannot be vouched for: fail closed.
            Err(_) => Err(exec.lease.fail_outcome_unknown()),
        }
    }

    /// Runs the statement of a taken group and reports to every caller in it.
    async fn run_group(&self, exec: &Executor, group: Vec<Queued>) {
        let mut carried = Carried { lease: &exec.lease, group };
        let group = &mut carried.group;
        if group.len() == 1 {
            let (path, mutation) = (&group[0].path, &group[0].mutation);
            let result = apply_alone(exec, path, mutation, group[0].durability).await;
            let Queued { done, .. } = group.pop().expect("one mutation");
            // The caller waits for this (its task runs to the end); nothing to do if not.
            let _ = done.send(Outcome::Done(result));
            return;
        }
        group.sort_by(|a, b| sort_key(&a.path).cmp(&sort_key(&b.path)));
        exec.lease.stats.shared(group.len());
        tracing::debug!(
            target: LOG,
            mutations = group.len(), "pgfence coalesced mutations into one statement");
        // One statement, so one commit for all: durable if any of them asked for that.
        let durability = Durability::of_group(group.iter().map(|q| q.durability));
        let ops = group.iter().map(|q| (&q.path, &q.mutation));
        let result = apply_fenced(exec, ops, durability).await;
        if let Err(e) = &result {
            tracing::warn!(target: LOG, error = %e, mutations = group.len(),
                "pgfence coalesced statement failed; each mutation runs again on its own");
        }
        // A lost lease is not run again either: each caller gets the same loss. Its statement
        // may have committed (`WriteOutcomeUnknown`, or `DeadlinePassed` with the statement
        // still unanswered). A close() may have released the lease meanwhile. Run alone then,
        // each mutation would get `Closed`, "not written". (Run alone otherwise, each would
        // fail at its lease check anyway.)
        let lost = match &result {
            Err(Error::LeaseLost { reason, .. }) => Some(reason),
            _ => None,
        };
        for Queued { mutation, done, .. } in group.drain(..) {
            let outcome = match (&result, lost) {
                (Ok(()), _) => Outcome::Done(Ok(())),
                (Err(_), Some(reason)) => Outcome::Done(Err(exec.lease.fail_sent(reason.clone()))),
                (Err(_), None) => Outcome::Alone(mutation),
            };
            let _ = done.send(outcome);
        }
    }
}

/// The queued mutations a statement carries, until their callers are told its outcome.
///
/// It may be dropped before that, when the task running the statement was dropped because its
/// runtime shut down. It then tells the callers what can be known:
///
/// - If the statement may have been sent, the task's own guard in `Executor::run`
///   (`exec::OutcomePending`, dropped first) has marked the lease lost. After a release, that
///   guard recorded the unknown outcome instead; run alone then, each would get `Closed`. The
///   callers learn that their outcome is unknown: their channel closes.
/// - Otherwise nothing of the statement can ever land. Each caller gets its mutation back to
///   run on its own, as after a failed shared statement. The store need not fail closed for a
///   statement that never ran.
struct Carried<'a> {
    lease: &'a Lease,
    group: Vec<Queued>,
}

impl Drop for Carried<'_> {
    fn drop(&mut self) {
        if self.lease.dropped_unknown() {
            return;
        }
        for Queued { mutation, done, .. } in self.group.drain(..) {
            let _ = done.send(Outcome::Alone(mutation));
        }
    }
}

/// Held by a caller from queueing its mutation until it has the report of the statement that
/// carried it.
///
/// It may be dropped before that, when the caller's task was dropped because its runtime shut
/// down. Then:
///
/// - A mutation still queued is withdrawn.
/// - A mutation carried by the caller's own statement, never sent, is let go (see
///   [`Carried`]).
/// - A mutation that a statement may carry makes the store fail closed, as for a statement of
///   one's own (see `exec::OutcomePending`). That statement may commit it after a later call of
///   the key, whose turn is gone with the task.
struct Waiting<'a> {
    coalescer: &'a Coalescer,
    lease: &'a Lease,
    place: Place,
    /// Whether the caller's mutation is in the statement this caller itself is running.
    carrying_own: bool,
}

impl Waiting<'_> {
    fn reported(self) {
        std::mem::forget(self); // Holds only references: nothing leaks.
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        if self.coalescer.withdraw(self.place) {
            return; // Still queued: it never runs.
        }
        // In this caller's own statement, whose guard (dropped before this) recorded it if it
        // may have been sent (see [`Carried`]): nothing recorded, it never ran.
        if self.carrying_own && !self.lease.dropped_unknown() {
            return;
        }
        tracing::error!(
            target: LOG,
            "pgfence mutation dropped while a shared statement may still run it");
        self.lease.lose_unreported(LossReason::WriteOutcomeUnknown);
    }
}

fn sort_key(path: &KeyPath) -> (&str, &str, &str) {
    (&path.primary_namespace, &path.secondary_namespace, &path.key)
}
