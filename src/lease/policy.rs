//! What a store does, besides failing closed, when it finds its lease lost.

/// What a store does, besides failing closed, when it finds its lease lost.
///
/// Whatever the policy, the store fails closed: every later operation returns
/// [`Error::LeaseLost`](crate::Error::LeaseLost) and [`crate::PgKvStore::lease_state`] reports
/// [`crate::LeaseState::Lost`]. The policy only decides how loudly.
///
/// A store that released its lease with `close()` has lost nothing, and no policy applies. A
/// write still running then may yet get [`Error::LeaseLost`](crate::Error::LeaseLost) with
/// [`crate::LossReason::WriteOutcomeUnknown`], without a panic or an abort. Its statement may
/// have committed: read the key back.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum LeaseLossPolicy {
    /// Return [`Error::LeaseLost`](crate::Error::LeaseLost) and report the loss on `lease_state`; the application
    /// decides what to do. The default.
    #[default]
    FailClosed,
    /// Also panic, in the task that called the operation that found the loss. When renewal
    /// found it, the renewal thread panics, after one attempt to release the lease. A panic
    /// on the renewal thread stops the process only when it is built with `panic = "abort"`.
    /// Otherwise that thread ends, and [`crate::PgKvStore::close`] returns
    /// [`Error::LeaseLost`](crate::Error::LeaseLost). The release is then not retried, as `FailClosed` would. A loss found
    /// where no caller can be told (a write's task dropped mid-statement when its runtime shut
    /// down) panics in the next operation. In a [`crate::Fleet`], renewal's panic ends that
    /// store's renewal task, not the fleet's thread: the other stores renew on.
    Panic,
    /// Log at error level, then `std::process::abort()`: nothing of the process runs on. This
    /// includes a loss found when a write's task is dropped mid-statement. So shutting down a
    /// runtime while a write runs on it aborts the process, since that write's outcome is
    /// unknown. Await or close the store's writes before shutting a runtime down.
    Abort,
}
