//! Where a configuration becomes a store: every opener of [`Builder`], in one place.
//!
//! The [`Builder`] type, its setters and its checks are in [`crate::config`]. These openers sit
//! above everything they open: a store, a standby, an inspector, a blocking store. So the
//! modules below read the options without depending on this one.

use std::future::Future;

use crate::blocking;
use crate::config::Builder;
use crate::error::Result;
use crate::inspect::Inspector;
use crate::standby::Standby;
use crate::store::{self, PgKvStore};

impl Builder {
    /// Checks the options, connects, creates or migrates the schema and takes the lease, all in
    /// one transaction. Fails with [`Error::LeaseHeld`](crate::Error::LeaseHeld) (and changes
    /// nothing) while another live store holds the lease. Creates the database if it does not
    /// exist and the role may.
    ///
    /// As its last step, `open()` gathers planner statistics (`ANALYZE`) for a table that never
    /// had them. This is best effort. If a lock or a silent server holds it up for more than
    /// one TTL, the store is returned without them.
    ///
    /// # Cancellation
    ///
    /// Dropping the returned future cancels a setup that is still waiting. It may wait for the
    /// setup lock of a concurrent `open()`, at the fence for the old holder's in-flight writes,
    /// or for a silent server. Nothing is committed then, and the lease is never taken later.
    ///
    /// - If the commit was sent and not yet answered, that setup's server process is ended.
    ///   The lease is then released by its owner id, in case the commit took it.
    /// - That release is given up after `connect_timeout`; the lease then expires by its TTL.
    /// - A store already opened (gathering statistics) is closed, which releases the lease.
    /// - A connection left waiting for an answer is closed, never handed back to a pool.
    ///
    /// That cancellation runs on in the background, on the current runtime. To give up and
    /// know it is done, before the runtime shuts down say, use [`Builder::open_until`].
    ///
    /// A silent server is one that stopped answering with its connection still up. See
    /// [A server that stops answering](https://github.com/pgfence/pgfence/blob/main/docs/design.md#a-server-that-stops-answering)
    /// in docs/design.md.
    pub async fn open(self) -> Result<PgKvStore> {
        store::open::open(self).await
    }

    /// [`Builder::open`], given up when `stop` completes first.
    ///
    /// `stop` is, for example, a signal, a shutdown channel or a timer. Giving up does what
    /// dropping the `open()` future does (see [`Builder::open`], "Cancellation"):
    ///
    /// - A setup still waiting is cancelled: nothing is committed, and the lease is never
    ///   taken later.
    /// - A commit sent and unanswered is ended, and its lease released.
    /// - A store already opened is closed.
    ///
    /// It returns `Ok(None)` only once all that is done, and the server has received the cancel
    /// request. The server acts on that request at once. Nothing of this opening is left
    /// running on the runtime or waiting on the server. So the runtime may shut down right
    /// after, at process exit say.
    ///
    /// It returns as promptly from a server that stopped answering:
    ///
    /// - The connection waiting for it is closed and its task aborted. If the server ever
    ///   answers again, it rolls back what was not committed.
    /// - A cancel request that cannot be delivered is given up after `connect_timeout`. Over
    ///   TLS, delivering it needs the server's answer.
    /// - So is the release of a commit that gets no answer. If that commit took the lease, the
    ///   lease then expires by its TTL.
    /// - Closing a store already opened waits up to `drop_timeout` for its release, as
    ///   [`PgKvStore::close`] does.
    pub async fn open_until(self, stop: impl Future<Output = ()>) -> Result<Option<PgKvStore>> {
        store::open::open_until(self, stop).await
    }

    /// A standby for this configuration: see [`Standby`].
    pub fn standby(self) -> Standby {
        Standby::new(self)
    }

    /// Waits, without limit, until the lease can be taken, then opens the store. Shorthand for
    /// `self.standby().open()`; use [`Builder::standby`] for a timeout or progress reports.
    pub async fn open_when_available(self) -> Result<PgKvStore> {
        self.standby().open().await
    }

    /// Read-only access to the table without taking the lease, for operators and tools.
    pub async fn inspect(self) -> Result<Inspector> {
        Inspector::new(&self)
    }

    /// Opens a [`blocking::PgKvStore`]: the same as [`blocking::PgKvStore::open`] with this
    /// builder.
    pub fn open_blocking(self) -> Result<blocking::PgKvStore> {
        blocking::PgKvStore::open(self)
    }
}
