//! The bound on queued bytes ([`crate::Builder::max_queued_bytes`]): backpressure at admission.
//!
//! A `write`, `remove` or batch `commit` reserves its bytes when its future is first polled.
//! It does so before it is admitted, before its task is spawned and before it waits for its
//! keys' turns. It holds them until it ends. While the bound is taken, further mutations wait
//! in arrival order; none fails or is dropped for it.
//!
//! Why before the turns: a mutation holding a key's turn already holds its bytes, so it never
//! waits for bytes held by one that waits for that turn. Per-key order is untouched: it comes
//! from the ticket taken at call time. A later call that gets its bytes first applies first,
//! and the earlier one is then superseded, as for any poll order.
//!
//! A mutation larger than the bound reserves the whole bound. It waits until nothing else
//! holds bytes, and then runs alone; that one mutation is the only way past the bound.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use super::statement::Mutation;
use crate::error::KeyPath;

/// The bytes that mutations of one store may hold at once.
#[derive(Debug)]
pub(crate) struct Budget {
    permits: Arc<Semaphore>,
    bound: u32,
    held: Arc<AtomicUsize>,
}

/// Bytes reserved by one mutation until it ends.
#[derive(Debug)]
pub(crate) struct Reservation {
    _permit: OwnedSemaphorePermit,
    bytes: usize,
    held: Arc<AtomicUsize>,
}

impl Budget {
    /// `bound` is checked by the builder: 1 to `u32::MAX`.
    pub(crate) fn new(bound: usize) -> Budget {
        let bound = u32::try_from(bound).unwrap_or(u32::MAX).max(1);
        Budget {
            permits: Arc::new(Semaphore::new(bound as usize)),
            bound,
            held: Arc::new(AtomicUsize::new(0)),
        }
    }

    /// Waits until `bytes` fit under the bound, in arrival order, and reserves them.
    pub(crate) async fn reserve(&self, bytes: usize) -> Reservation {
        let permits = u32::try_from(bytes).unwrap_or(u32::MAX).min(self.bound);
        let permit = Arc::clone(&self.permits)
            .acquire_many_owned(permits)
            .await
            .expect("the semaphore is never closed");
        self.held.fetch_add(bytes, Ordering::SeqCst);
        Reservation { _permit: permit, bytes, held: Arc::clone(&self.held) }
    }

    /// The bytes reserved now by mutations not yet ended.
    pub(crate) fn held(&self) -> usize {
        self.held.load(Ordering::SeqCst)
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        self.held.fetch_sub(self.bytes, Ordering::SeqCst);
    }
}

/// A mutation's bytes as the bound counts them: its key path and its value.
pub(crate) fn bytes_of(path: &KeyPath, mutation: &Mutation) -> usize {
    let value = match mutation {
        Mutation::Write(value) => value.len(),
        Mutation::Remove => 0,
    };
    path.primary_namespace.len() + path.secondary_namespace.len() + path.key.len() + value
}
