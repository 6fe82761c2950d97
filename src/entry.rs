//! Where a configuration becomes a store: every opener of [`Builder`], in one place. The
//! [`Builder`] type, its setters and its checks are in [`crate::config`]; these openers sit
//! above everything they open (a store, a standby, an inspector, a blocking store), so that
//! the modules below read the options without depending on this one.

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
    /// A table that never had planner statistics gets them (`ANALYZE`) once the lease is
    /// taken, as the last step; best effort: held up for longer than one TTL (by a lock, or a
    /// server that stopped answering), it is given up and the store returned without them.
    ///
    /// Dropping the returned future cancels the setup if it is still waiting (for the setup
    /// lock of a concurrent `open()`, at the fence for the old holder's in-flight writes, or for
    /// a server that stopped answering): nothing is committed and the lease is never taken
    /// later. If the commit was sent and not yet answered, that setup's server process is
    /// ended and the lease released by its owner id, in case the commit took it (within
    /// `connect_timeout`; otherwise it expires by its TTL). A store already opened (gathering
    /// statistics) is closed, which releases the lease. A connection left waiting for an
    /// answer is closed, never handed back to a pool. That cancellation runs on in the
    /// background, on the current runtime; to give up and know it is done (before the runtime
    /// shuts down, say), use [`Builder::open_until`].
    pub async fn open(self) -> Result<PgKvStore> {
        store::open::open(self).await
    }

    /// [`Builder::open`], given up when `stop` completes first, as when its future is dropped:
    /// a setup still waiting is cancelled (nothing committed, the lease never taken later), a
    /// commit sent and unanswered is ended and its lease released, a store already opened is
    /// closed. `Ok(None)` then, returned only once all that is done (the server has received
    /// the cancel request, and acts on it at once): nothing of this opening is left running on
    /// the runtime, nor waiting on the server, so the runtime may shut down right after (at
    /// process exit, say). Against a server that stopped answering, it returns as promptly:
    /// the connection waiting for it is closed (its task aborted; the server, if it ever
    /// answers again, rolls back what was not committed), a cancel request that cannot be
    /// delivered (over TLS it needs the server's answer) is given up after `connect_timeout`,
    /// and so is the release of a commit that gets no answer (the lease, if the commit took
    /// it, then expires by its TTL); closing a store already opened waits up to
    /// `drop_timeout` for its release, as [`PgKvStore::close`] does. `stop` is, for example, a
    /// signal, a shutdown channel or a timer.
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
