//! Per-key write ordering, fixed when a method is called rather than when its future runs.
//!
//! Every mutation of a key takes a version number synchronously, in the call to `write` or
//! `remove`. When its future runs, it takes the key's async lock. It applies its change only if
//! no later version has been applied yet.
//!
//! Otherwise it was superseded and returns `Ok` without touching the database. The later
//! call's value is the one the caller asked for last. The exception is a store that lost its
//! lease meanwhile: then it fails closed like every operation. A durable mutation superseded by
//! a deferred one makes that one durable first ([`Superseded::deferred`]).
//!
//! So whatever order futures are polled or complete in, the key ends in the state of the last
//! call that succeeded. An earlier call can never overwrite a later one.
//!
//! The key lock is held across the whole statement. That includes retries of a statement
//! whose outcome is unknown. So a retry can never land after a later call's write.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use tokio::sync::{Mutex as AsyncMutex, OwnedMutexGuard};

use crate::error::KeyPath;

/// The versions and locks of keys with mutations in flight.
///
/// An entry lives while tickets of its key exist. They are counted explicitly under the map
/// lock, not with `Arc::strong_count`, which changes outside it. So concurrent drops can never
/// leave an entry behind.
#[derive(Debug, Default)]
pub(crate) struct KeyOrder {
    slots: Mutex<HashMap<KeyPath, Slot>>,
}

#[derive(Debug, Default)]
struct Slot {
    /// The last version handed out.
    last_version: u64,
    /// Tickets of this key alive now.
    tickets: usize,
    /// The highest version applied to the database, guarded by the key's async lock.
    applied: Arc<AsyncMutex<Applied>>,
}

/// The highest version of a key applied to the database.
#[derive(Debug, Default)]
struct Applied {
    version: u64,
    /// Whether it was applied by a deferred mutation, which may not be durable yet.
    deferred: bool,
}

/// What a superseded mutation learns: a later call of its key is applied already.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Superseded {
    /// The later call was deferred, so its commit may not be durable yet. A durable mutation
    /// must not return `Ok` on its strength before a flush.
    pub(crate) deferred: bool,
}

/// A mutation's place in its key's order, taken when the method is called.
#[derive(Debug)]
pub(crate) struct Ticket {
    order: Arc<KeyOrder>,
    path: KeyPath,
    applied: Arc<AsyncMutex<Applied>>,
    version: u64,
}

/// The key lock, held while a mutation runs.
#[derive(Debug)]
pub(crate) struct Turn {
    applied: OwnedMutexGuard<Applied>,
    version: u64,
}

impl KeyOrder {
    /// Takes the next version of `path`. Synchronous: call it in the method, not in the future.
    pub(crate) fn ticket(self: &Arc<Self>, path: KeyPath) -> Ticket {
        let mut slots = self.slots.lock().unwrap_or_else(|e| e.into_inner());
        let slot = slots.entry(path.clone()).or_default();
        slot.last_version += 1;
        slot.tickets += 1;
        let (version, applied) = (slot.last_version, Arc::clone(&slot.applied));
        drop(slots);
        Ticket { order: Arc::clone(self), path, applied, version }
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.slots.lock().unwrap().len()
    }
}

impl Ticket {
    /// Waits for the key's lock. `Err`: a later call of this key has already been applied,
    /// so this one is superseded and must not touch the database.
    pub(crate) async fn turn(&self) -> Result<Turn, Superseded> {
        let applied = Arc::clone(&self.applied).lock_owned().await;
        if applied.version >= self.version {
            return Err(Superseded { deferred: applied.deferred });
        }
        Ok(Turn { applied, version: self.version })
    }

    pub(crate) fn path(&self) -> &KeyPath {
        &self.path
    }
}

impl Turn {
    /// Records that this version reached the database, deferred or not.
    pub(crate) fn applied(mut self, deferred: bool) {
        *self.applied = Applied { version: self.version, deferred };
    }
}

impl Drop for Ticket {
    fn drop(&mut self) {
        let mut slots = self.order.slots.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(slot) = slots.get_mut(&self.path) {
            slot.tickets -= 1;
            if slot.tickets == 0 {
                slots.remove(&self.path);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn path(key: &str) -> KeyPath {
        KeyPath { primary_namespace: "p".into(), secondary_namespace: "s".into(), key: key.into() }
    }

    #[tokio::test]
    async fn later_call_supersedes_earlier_one() {
        let order = Arc::new(KeyOrder::default());
        let first = order.ticket(path("k"));
        let second = order.ticket(path("k"));
        let other = order.ticket(path("other"));
        second.turn().await.expect("second runs first").applied(true);
        let superseded = first.turn().await.expect_err("first was superseded by second");
        assert!(superseded.deferred, "by a deferred mutation");
        assert!(other.turn().await.is_ok(), "other keys are independent");
        drop((first, second, other));
        assert_eq!(order.len(), 0, "entries go when the last ticket goes");
    }

    #[test]
    fn concurrent_drops_leave_no_entry() {
        let order = Arc::new(KeyOrder::default());
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let order = Arc::clone(&order);
                std::thread::spawn(move || {
                    for i in 0..5_000 {
                        let key = format!("k{}", i % 7);
                        let a = order.ticket(path(&key));
                        let b = order.ticket(path(&key));
                        drop((a, b));
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(order.len(), 0);
    }

    #[tokio::test]
    async fn failed_mutation_does_not_supersede() {
        let order = Arc::new(KeyOrder::default());
        let first = order.ticket(path("k"));
        let second = order.ticket(path("k"));
        drop(second.turn().await.expect("second runs")); // failed: not applied
        assert!(first.turn().await.is_ok(), "first still runs after second failed");
    }
}
