//! Which deferred writes a flush vouches for, and the crash marker that tells it.
//!
//! The store wrote a token into the crash marker, an UNLOGGED table, when it took the lease.
//! Every crash recovery of the server empties that table, and a promoted standby starts with
//! it empty. [`sql::FLUSH`](crate::sql::FLUSH) checks the token in its durable commit. Kept:
//! no crash since the token was written, so every deferred commit before the flush is durable
//! now. Gone: deferred commits since the last flush may be lost. The flush then writes a new
//! token, and this module starts a new *generation*: deferred writes from then on are covered
//! by the new token.
//!
//! The rule it keeps: a `flush`, or a durable call made while deferred calls were pending, does
//! not return `Ok` unless every deferred call that returned `Ok` before it was called is
//! durable. If one may be lost, the caller gets [`Error::DeferredWritesLost`], and so does the
//! flush that found the loss. A deferred call started under an older generation and answered
//! after the loss was found gets that error itself: its commit may have come before the crash,
//! and the new token does not cover it.
//!
//! A durable call with no deferred call pending does nothing here: no flush, no wait.

use std::sync::Mutex;

use uuid::Uuid;

use crate::error::{Error, Result};
use crate::exec::Executor;

/// The crash marker's state in the store, behind one lock ([`Marker::state`]).
#[derive(Debug)]
struct State {
    /// Bumped each time a flush finds the token gone.
    generation: u64,
    /// The token of this generation, in the crash marker since its flush (or the setup)
    /// committed.
    token: Uuid,
    /// Deferred calls of this generation that returned `Ok`.
    oks: u64,
    /// How many of `oks` a flush vouched for: those counted when it began.
    flushed: u64,
    /// The last generation that ended, and its `flushed` then: a durable call of that
    /// generation with no more `oks` than that was covered before the loss.
    ended: Option<(u64, u64)>,
    /// Flush statements begun, of every generation: each one's number.
    begun: u64,
    /// The number of the last flush that found the token kept.
    kept_by: u64,
}

/// What a call saw of the marker when it was made.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Since {
    generation: u64,
    /// The generation's `oks` then: the deferred calls a durable call must cover.
    oks: u64,
    /// Whether some of them were not flushed yet.
    pending: bool,
    /// The flushes begun by then: a flush numbered higher began after the call.
    begun: u64,
}

impl Since {
    /// Whether deferred calls had returned `Ok` and were not flushed when this was taken.
    pub(crate) fn pending(&self) -> bool {
        self.pending
    }
}

/// The crash marker's state, shared by every handle of a store ([`super::Writes`]).
#[derive(Debug)]
pub(crate) struct Marker {
    state: Mutex<State>,
    /// Held by the flush under way. Flushes go one at a time: each checks the token the last
    /// one left, and a loss starts exactly one new generation. A durable call that waited here
    /// for a flush that began after it was made need not flush again.
    flushing: tokio::sync::Mutex<()>,
}

impl Marker {
    /// The state after the setup wrote `token`.
    pub(crate) fn new(token: Uuid) -> Marker {
        let state =
            State { generation: 0, token, oks: 0, flushed: 0, ended: None, begun: 0, kept_by: 0 };
        Marker { state: Mutex::new(state), flushing: tokio::sync::Mutex::new(()) }
    }

    fn state(&self) -> std::sync::MutexGuard<'_, State> {
        // Never held across an await, and nothing in it panics.
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Taken when a mutation or a flush is called, synchronously, before anything is sent.
    pub(crate) fn since(&self) -> Since {
        let s = self.state();
        Since { generation: s.generation, oks: s.oks, pending: s.oks > s.flushed, begun: s.begun }
    }

    /// A deferred call taken at `since` committed. It counts as pending for the next flush.
    /// If a flush found the token gone since the call was made, the new token does not cover
    /// its commit: [`Error::DeferredWritesLost`].
    pub(crate) fn deferred_committed(&self, since: Since) -> Result<()> {
        let mut s = self.state();
        if s.generation != since.generation {
            return Err(Error::DeferredWritesLost { writes: 1 });
        }
        s.oks += 1;
        Ok(())
    }

    /// Makes durable every deferred call counted at `since`, or fails if one may be lost.
    ///
    /// `always`: run the flush statement even if an earlier flush vouched for them already,
    /// unless that one began after `since` (`flush()` does: the statement also checks the
    /// lease, and one that began after the call checked it after the call too). So concurrent
    /// `flush()` calls share one statement, each waiting for at most the one under way and the
    /// next. A durable call does not: many of them after one deferred call share one flush.
    pub(crate) async fn cover(&self, exec: &Executor, since: Since, always: bool) -> Result<()> {
        let _flushing = self.flushing.lock().await;
        let (token, begun, number) = {
            let mut s = self.state();
            if s.generation != since.generation {
                // A flush found a loss since the call. Were its deferred calls flushed before?
                match s.ended {
                    Some((generation, flushed))
                        if generation == since.generation && since.oks <= flushed => {}
                    Some((generation, flushed)) if generation == since.generation => {
                        return Err(Error::DeferredWritesLost { writes: since.oks - flushed });
                    }
                    // More than one loss since: nothing tells, so it may be lost.
                    _ => return Err(Error::DeferredWritesLost { writes: since.oks }),
                }
                if !always {
                    return Ok(());
                }
            } else if s.flushed >= since.oks && (!always || s.kept_by > since.begun) {
                return Ok(());
            }
            s.begun += 1;
            (s.token, s.oks, s.begun)
        };
        let next = Uuid::new_v4();
        let kept = exec.flush(token, next).await?;
        let mut s = self.state();
        if kept {
            // Every deferred call counted when the flush began had committed before it.
            s.flushed = s.flushed.max(begun);
            s.kept_by = number;
            return Ok(());
        }
        // The flush wrote `next`, and committed. Deferred calls counted from now on are of the
        // new generation; those of the old one that were not flushed may be lost.
        let lost = s.oks - s.flushed;
        tracing::error!(
            table = %exec.table.display(),
            lost,
            "pgfence found its crash marker gone: the server crashed or failed over, and \
             deferred writes since the last flush may be lost"
        );
        let ended = Some((s.generation, s.flushed));
        let (generation, begun) = (s.generation + 1, s.begun);
        *s = State { generation, token: next, oks: 0, flushed: 0, ended, begun, kept_by: 0 };
        match lost {
            0 => Ok(()),
            writes => Err(Error::DeferredWritesLost { writes }),
        }
    }
}
