//! The write path, in four parts:
//!
//! - per-key call order ([`ordering`]);
//! - statements shared by concurrent mutations ([`coalesce`]);
//! - atomic batches ([`batch`]);
//! - the fenced statements they all end in ([`statement`]).
//!
//! A `write` takes [`Writes::ticket`] when called and runs [`Writes::mutate`] when polled.
//! It then goes through [`coalesce::Coalescer::apply`], [`statement::apply_alone`] and
//! [`Executor::fenced`](crate::exec::Executor::fenced).

pub(crate) mod batch;
pub(crate) mod budget;
pub(crate) mod coalesce;
pub(crate) mod marker;
pub(crate) mod ordering;
pub(crate) mod statement;

use std::sync::Arc;

use crate::error::{Error, KeyPath, Result};
use crate::exec::Executor;
use budget::{Budget, Reservation};
use coalesce::Coalescer;
use marker::{Marker, Since};
use ordering::{KeyOrder, Ticket};
pub(crate) use statement::{Durability, Mutation};

/// The write path's state, shared by every handle of a store: the per-key order, the queue
/// of mutations waiting to share a statement, and what the last flush vouched for.
#[derive(Debug)]
pub(crate) struct Writes {
    order: Arc<KeyOrder>,
    coalescer: Coalescer,
    /// The crash marker's state: which deferred calls a flush still has to vouch for.
    pub(crate) marker: Marker,
    max_value_size: usize,
    /// The bound on bytes of mutations in flight ([`budget`]).
    budget: Budget,
}

impl Writes {
    pub(crate) fn new(
        write_concurrency: usize,
        max_value_size: usize,
        max_queued_bytes: usize,
        crash_token: uuid::Uuid,
    ) -> Writes {
        Writes {
            order: Arc::new(KeyOrder::default()),
            coalescer: Coalescer::new(write_concurrency),
            marker: Marker::new(crash_token),
            max_value_size,
            budget: Budget::new(max_queued_bytes),
        }
    }

    /// Waits until `bytes` fit under the bound on queued bytes and reserves them (see
    /// [`budget`]). Call it before admission and before waiting for any key's turn.
    pub(crate) async fn reserve(&self, bytes: usize) -> Reservation {
        self.budget.reserve(bytes).await
    }

    /// The bytes reserved now by mutations in flight.
    pub(crate) fn queued_bytes(&self) -> usize {
        self.budget.held()
    }

    /// Takes the key's place in the per-key order. It is called synchronously, when `write`,
    /// `remove` or `commit` is called. So the order is the order of the calls.
    pub(crate) fn ticket(
        &self,
        primary_namespace: &str,
        secondary_namespace: &str,
        key: &str,
    ) -> Ticket {
        self.order.ticket(KeyPath::new(primary_namespace, secondary_namespace, key))
    }

    pub(crate) fn check_value(&self, value: &[u8]) -> Result<()> {
        if value.len() > self.max_value_size {
            return Err(Error::ValueTooLarge { len: value.len(), max: self.max_value_size });
        }
        Ok(())
    }

    /// Runs one fenced mutation in its key's turn (see [`coalesce`]). `since` is what the
    /// call saw of the crash marker ([`Marker::since`]).
    pub(crate) async fn mutate(
        &self,
        exec: &Executor,
        ticket: Ticket,
        mutation: Mutation,
        (durability, since): (Durability, Since),
    ) -> Result<()> {
        // Boxed: a write's future and the store's task for it hold a pointer, not this state.
        // The compiler lays out a future moved into another one more than once. And 100,000
        // queued writes hold one each (see BENCHMARKS.md, "Memory of queued writes").
        Box::pin(self.mutate_in_turn(exec, ticket, mutation, (durability, since))).await
    }

    async fn mutate_in_turn(
        &self,
        exec: &Executor,
        ticket: Ticket,
        mutation: Mutation,
        (durability, since): (Durability, Since),
    ) -> Result<()> {
        self.cover_before_durable(exec, durability, since).await?;
        let turn = match ticket.turn().await {
            Ok(turn) => turn,
            // A later call to this key is already committed: nothing to write. But a store
            // that has lost its lease still fails, as every key operation (and an all-superseded
            // batch) does: `Ok` would vouch for a key a successor may have overwritten since.
            Err(superseded) => {
                return self.superseded_ok(exec, durability, superseded.deferred).await;
            }
        };
        self.coalescer.apply(exec, ticket.path(), mutation, durability).await?;
        let deferred = durability == Durability::Deferred;
        // Counted before the turn is recorded, so that a durable call this one supersedes
        // finds it pending ([`Writes::superseded_ok`]).
        let counted = if deferred { self.marker.deferred_committed(since) } else { Ok(()) };
        turn.applied(deferred);
        counted
    }

    /// Before a durable call's statement: if deferred calls had returned `Ok` unflushed when
    /// it was made, a flush vouches for them first ([`Marker::cover`]). Its `Ok` promises
    /// them durable too, and only the flush can tell that the server did not lose them in a
    /// crash since. Nothing pending, nothing done: a store that never defers pays nothing.
    pub(crate) async fn cover_before_durable(
        &self,
        exec: &Executor,
        durability: Durability,
        since: Since,
    ) -> Result<()> {
        if durability == Durability::Durable && since.pending() {
            return self.marker.cover(exec, since, false).await;
        }
        Ok(())
    }

    /// The result of a mutation (or a batch) that has nothing left to write: every key of it
    /// was superseded by a later call. A store that has lost its lease fails. A durable one
    /// superseded by a deferred one flushes first: its `Ok` promises a durable value, and the
    /// later call's commit may not be on disk yet.
    pub(crate) async fn superseded_ok(
        &self,
        exec: &Executor,
        durability: Durability,
        by_deferred: bool,
    ) -> Result<()> {
        if durability == Durability::Durable && by_deferred {
            return self.marker.cover(exec, self.marker.since(), true).await;
        }
        exec.lease.check()
    }

    /// `flush()`: vouches for every deferred call counted at `since`, taken when it was
    /// called. It always runs the flush statement, which also checks the lease.
    pub(crate) async fn flush(&self, exec: &Executor, since: Since) -> Result<()> {
        self.marker.cover(exec, since, true).await
    }
}
