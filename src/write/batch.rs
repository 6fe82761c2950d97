//! Atomic batches: many puts and removes, one fence check, one statement, one round trip.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::{Arc, Weak};

use tracing::Instrument;

use super::Writes;
use super::budget::bytes_of;
use super::marker::Since;
use super::ordering::Ticket;
use super::statement::{Durability, Mutation, apply_fenced};
use crate::error::{Error, Result};
use crate::exec::{Executor, admitted};
use crate::keys::{MAX_BATCH_BYTES, check_key};
use crate::stats::Op;

/// What each operation of a batch adds to its size besides its keys, namespaces and value.
///
/// The statement sends them as array elements, each with a 4-byte length. Without this, a batch
/// of many tiny operations would pass [`MAX_BATCH_BYTES`] and still reach PostgreSQL's 1 GiB
/// message limit. Some 30 million operations, each with a one-byte key, would do it.
const BATCH_BYTES_PER_OPERATION: usize = 16;

/// An atomic group of puts and removes, built with [`PgKvStore::batch`](crate::PgKvStore::batch)
/// and applied with [`Batch::commit`].
///
/// # Guarantees
///
/// - **All or nothing.** Every operation is applied in one SQL statement under one fence
///   check. That is the same `FOR KEY SHARE` check on the lease row as a single `write`. Either
///   every change commits under this store's lease, or none does.
/// - **Validation first.** Every key and value is checked as it is added. The batch's size is
///   checked against [`MAX_BATCH_BYTES`] at `commit`. If any is invalid, `commit` returns the
///   first error and runs no SQL, so nothing is written.
/// - **Per-key order with single operations.** `commit()` takes every key's place in the
///   per-key order when it is *called*, like [`PgKvStore::write`](crate::PgKvStore::write). A
///   *later* call may already have changed one of the batch's keys: a `write`, `remove` or
///   another batch called after this `commit`. That operation of the batch is dropped, since
///   the later value must win. The rest of the batch is still applied atomically. Nothing of a
///   batch ever overwrites a later call.
/// - **Last op wins within a batch.** When a key appears several times, only the last put or
///   remove of it is applied.
/// - **Lease loss.** If the lease is gone, `commit` returns [`Error::LeaseLost`], nothing is
///   written, and the store fails closed like after a failed `write`.
///
/// An empty batch runs no statement, and nor does one whose every operation was superseded.
/// It still fails with [`Error::Closed`] or [`Error::LeaseLost`] when the store is closed or
/// has lost its lease.
///
/// An uncommitted batch does not keep the store alive. Dropping the last
/// [`PgKvStore`](crate::PgKvStore) handle releases the lease even while a batch exists. Its
/// `commit` then returns [`Error::Closed`] and writes nothing. The future `commit` returns does
/// keep the store alive until it is done.
#[derive(Debug)]
#[must_use = "a batch does nothing until `commit()` is called and awaited"]
pub struct Batch {
    /// Weak: a batch being built must not hold the lease (and its renewal) after the store's
    /// last handle is gone.
    exec: Weak<Executor>,
    writes: Arc<Writes>,
    /// The last operation of each key; the map's order is the order key turns are taken in.
    ops: BTreeMap<(String, String, String), Mutation>,
    /// The first validation error, reported by `commit` before any SQL runs.
    invalid: Option<Error>,
}

/// One key of a committed batch: its operation and its place in the key's order.
struct Entry {
    ticket: Ticket,
    op: Mutation,
}

impl Batch {
    /// An empty batch of a store (see [`crate::PgKvStore::batch`]).
    pub(crate) fn new(exec: &Arc<Executor>, writes: Arc<Writes>) -> Batch {
        Batch { exec: Arc::downgrade(exec), writes, ops: BTreeMap::new(), invalid: None }
    }

    /// Adds a write of `value` to the key (creating or replacing it). Replaces any earlier
    /// operation of the same key in this batch.
    pub fn put(
        mut self,
        primary_namespace: &str,
        secondary_namespace: &str,
        key: &str,
        value: Vec<u8>,
    ) -> Self {
        let checked = check_key(primary_namespace, secondary_namespace, key)
            .and_then(|()| self.writes.check_value(&value));
        self.add(checked, primary_namespace, secondary_namespace, key, Mutation::Write(value));
        self
    }

    /// Adds a removal of the key (removing a missing key is not an error). Replaces any
    /// earlier operation of the same key in this batch.
    pub fn remove(mut self, primary_namespace: &str, secondary_namespace: &str, key: &str) -> Self {
        let checked = check_key(primary_namespace, secondary_namespace, key);
        self.add(checked, primary_namespace, secondary_namespace, key, Mutation::Remove);
        self
    }

    /// The number of distinct keys the batch changes.
    pub fn len(&self) -> usize {
        self.ops.len()
    }

    /// True when the batch changes no key.
    pub fn is_empty(&self) -> bool {
        self.ops.is_empty()
    }

    fn add(
        &mut self,
        checked: Result<()>,
        primary: &str,
        secondary: &str,
        key: &str,
        op: Mutation,
    ) {
        match checked {
            Ok(()) => {
                self.ops.insert((primary.to_owned(), secondary.to_owned(), key.to_owned()), op);
            }
            Err(e) => {
                self.invalid.get_or_insert(e);
            }
        }
    }

    /// Applies the batch atomically.
    ///
    /// Every key's place in the per-key order is taken now, in this call. The returned future
    /// does the work and may outlive the store handle. `Ok` means that every operation not
    /// superseded by a later call committed, in one transaction, under this store's lease. It
    /// fails with [`Error::Closed`] if every handle of the store was dropped before this call.
    pub fn commit(self) -> impl Future<Output = Result<()>> + Send + 'static {
        self.commit_as(Durability::Durable)
    }

    /// [`Batch::commit`], without waiting for the commit's WAL flush, as
    /// [`PgKvStore::write_deferred`](crate::PgKvStore::write_deferred) does.
    ///
    /// Atomicity, fencing and per-key order are those of `commit`. `Ok` means committed, not
    /// yet durable: a server crash before the next durable commit or
    /// [`PgKvStore::flush`](crate::PgKvStore::flush) may lose it, whole. Never a part of it.
    pub fn commit_deferred(self) -> impl Future<Output = Result<()>> + Send + 'static {
        self.commit_as(Durability::Deferred)
    }

    fn commit_as(
        self,
        durability: Durability,
    ) -> impl Future<Output = Result<()>> + Send + 'static {
        let Batch { exec, writes, ops, invalid } = self;
        // Tickets are taken here, synchronously, so the batch's place in every key's order is
        // the moment `commit` was called, whatever happens to the future afterwards.
        let prepared = match (invalid.or_else(|| too_large(&ops)), exec.upgrade()) {
            (Some(e), _) => Err(e),
            (None, None) => Err(Error::Closed),
            (None, Some(exec)) => {
                let span = tracing::debug_span!(
                    "pgfence",
                    operation = "batch",
                    table = %exec.table.display(),
                    ops = ops.len(),
                    epoch = exec.lease.epoch,
                );
                let entries: Vec<Entry> = ops
                    .into_iter()
                    .map(|((primary, secondary, key), op)| Entry {
                        ticket: writes.ticket(&primary, &secondary, &key),
                        op,
                    })
                    .collect();
                // What the call saw of the crash marker, also now.
                Ok((exec, entries, span, writes.marker.since()))
            }
        };
        async move {
            let (exec, entries, span, since) = prepared?;
            let bytes = entries.iter().map(|e| bytes_of(e.ticket.path(), &e.op)).sum();
            let reserved = writes.reserve(bytes).await;
            let store = Arc::clone(&exec);
            let work = async move {
                let _reserved = reserved;
                apply(&store, &writes, entries, (durability, since)).await
            };
            if durability == Durability::Deferred {
                exec.lease.stats.deferred();
            }
            admitted(&exec, Op::Batch, work.instrument(span)).await
        }
    }
}

/// [`Error::BatchTooLarge`] if the operations' keys and values, and
/// [`BATCH_BYTES_PER_OPERATION`] for each, add up to more than [`MAX_BATCH_BYTES`].
fn too_large(ops: &BTreeMap<(String, String, String), Mutation>) -> Option<Error> {
    too_large_for(ops, MAX_BATCH_BYTES)
}

fn too_large_for(ops: &BTreeMap<(String, String, String), Mutation>, max: usize) -> Option<Error> {
    let len: usize = ops
        .iter()
        .map(|((primary, secondary, key), op)| {
            let value = match op {
                Mutation::Write(value) => value.len(),
                Mutation::Remove => 0,
            };
            primary.len() + secondary.len() + key.len() + value + BATCH_BYTES_PER_OPERATION
        })
        .sum();
    (len > max).then_some(Error::BatchTooLarge { len, max })
}

/// Takes the key turns, then runs the one fenced statement.
async fn apply(
    exec: &Executor,
    writes: &Writes,
    entries: Vec<Entry>,
    (durability, since): (Durability, Since),
) -> Result<()> {
    // Before any turn is taken: a flush need not hold up these keys.
    writes.cover_before_durable(exec, durability, since).await?;
    // Turns are taken one key at a time in the map's sorted key order and held together until
    // the statement has finished. Single-key operations hold one turn at a time. Every batch
    // takes its turns in the same global order. So no two waiters can wait on each other in a
    // cycle: no deadlock. Holding every turn across the statement (and its retries) is what
    // keeps per-key order: nothing later of any of these keys can run in between.
    let mut turns = Vec::with_capacity(entries.len());
    let mut ops = Vec::with_capacity(entries.len());
    let mut by_deferred = false;
    for entry in &entries {
        match entry.ticket.turn().await {
            Ok(turn) => {
                turns.push(turn);
                ops.push((entry.ticket.path(), &entry.op));
            }
            // A later call of this key is already applied: it must win.
            Err(superseded) => by_deferred |= superseded.deferred,
        }
    }
    if turns.is_empty() {
        // Nothing to write, but an operation of a fenced store still fails. The batch's own
        // commit, had it run, would have made a deferred later call durable (it commits after
        // it): without one, a durable batch flushes.
        return writes.superseded_ok(exec, durability, by_deferred).await;
    }
    apply_fenced(exec, ops, durability).await?;
    let deferred = durability == Durability::Deferred;
    // Counted before the turns are recorded, as a single mutation is ([`Writes::mutate`]).
    let counted = if deferred { writes.marker.deferred_committed(since) } else { Ok(()) };
    for turn in turns {
        turn.applied(deferred);
    }
    counted
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ops(keys: &[&str]) -> BTreeMap<(String, String, String), Mutation> {
        keys.iter()
            .map(|key| ((String::new(), String::new(), (*key).to_owned()), Mutation::Remove))
            .collect()
    }

    /// Tiny operations count what goes with them on the wire too: 16 bytes each. Counting only
    /// their names let a batch of some 30 million one-byte keys past `MAX_BATCH_BYTES`. It then
    /// reached PostgreSQL's 1 GiB message limit, which closes the connection.
    #[test]
    fn each_operation_counts_its_lengths_on_the_wire() {
        let three = ops(&["a", "b", "c"]);
        assert!(too_large_for(&three, 3 * 17).is_none());
        let e = too_large_for(&three, 3 * 17 - 1).expect("over the limit");
        assert!(matches!(e, Error::BatchTooLarge { len: 51, max: 50 }), "{e}");
    }
}
