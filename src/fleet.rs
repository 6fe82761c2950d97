//! [`Fleet`]: many stores in one process, sharing one pool and one renewal thread.

use std::sync::Arc;

use tokio::sync::oneshot;

use crate::connect;
use crate::error::{Error, Result};
use crate::lease::{Connector, Renewer};
use crate::store::{Builder, FleetShare, Listener, PoolMode, Source};

/// Many stores in one process (one per tenant, say), sharing one connection pool and one
/// renewal thread. Made from a [`Builder`] with [`Builder::fleet`].
///
/// A store opened alone has a pool and a renewal thread with its own connection. A thousand
/// stores would cost a thousand threads and thousands of server connections. A fleet's stores
/// share instead:
///
/// - One pool, of [`Builder::pool_size`] connections, for all their operations.
/// - One renewal thread, with a current-thread runtime as a single store's. A busy application
///   runtime can never delay it.
/// - One renewal connection (made again when it breaks). Each lease's renewal is a task of its
///   own on that thread. Its statements are pipelined on the shared connection.
///
/// Each store keeps its own lease, fencing token, local deadline, loss policy, and release on
/// `close()` or drop. One store's loss, close, renewal failure or release failure leaves the
/// others alone. A broken shared connection is made again, and every lease retries on it. A
/// lease that renewal cannot confirm fails closed at its own local deadline, as alone.
///
/// [`LeaseLossPolicy::Panic`](crate::LeaseLossPolicy::Panic) panics that lease's renewal
/// task, not the fleet's thread. The runtime catches the panic; the other leases renew on.
/// The store then reports [`Error::LeaseLost`] on `close()`, as a store alone does.
///
/// ```no_run
/// # async fn run() -> pgfence::Result<()> {
/// let fleet = pgfence::PgKvStore::builder("postgres://app@db/app").pool_size(16).fleet()?;
/// let a = fleet.builder("tenant_a").open().await?;
/// let b = fleet.builder("tenant_b").lease_ttl(std::time::Duration::from_secs(10)).open().await?;
/// a.close().await?;
/// b.close().await?;
/// fleet.close().await;
/// # Ok(())
/// # }
/// ```
///
/// # Shutting down
///
/// [`Fleet::close`] waits until every store opened from the fleet is closed or dropped. It
/// then stops the renewal thread and closes the pool. Dropping the fleet releases nothing: it
/// holds no lease. The renewal thread then stops by itself once the last store is gone.
/// After either, builders from the fleet open nothing ([`Error::Closed`]).
#[derive(Debug)]
pub struct Fleet {
    /// The options every store starts from.
    template: Builder,
    pool: connect::Pool,
    /// `None` once closed.
    renewer: Option<Arc<Renewer>>,
    /// The one LISTEN connection of the fleet's waiting standbys; `None` for a pool source and
    /// in [`PoolMode::Transaction`], whose standbys poll.
    listener: Option<Arc<Listener>>,
    /// Closed when the renewal thread has ended.
    ended: Option<oneshot::Receiver<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Builder {
    /// A [`Fleet`] on this builder's server, its pool of [`Builder::pool_size`] connections
    /// and the connection options set so far. Its stores start from this builder's other
    /// options; each may change them.
    ///
    /// It starts the renewal thread and builds the pool; it connects to nothing yet. Fails with
    /// [`Error::InvalidConfig`] for an option [`Builder::open`] would refuse, and on a
    /// builder that is already a fleet's.
    pub fn fleet(self) -> Result<Fleet> {
        self.validate()?;
        if self.fleet.is_some() {
            return Err(Error::config("fleet", "this builder is already a fleet's"));
        }
        let pool = self.pool()?;
        let connector = match &self.source {
            Source::Pool(_) => Connector::Pool(pool.clone()),
            _ => {
                let config = self.connection_config().expect("validate() refuses anything else");
                Connector::Config(Box::new(config), self.tls.clone(), self.pool_mode)
            }
        };
        let (ended, ended_rx) = oneshot::channel();
        let (renewer, thread) = Renewer::start(connector, self.connect_timeout, ended)?;
        // Behind a transaction pooler a LISTEN would stay on a shared server session: the
        // standbys poll instead (see `Standby`, "Waking"), and the listener is never made.
        let listener = match self.pool_mode {
            PoolMode::Transaction => None,
            PoolMode::Session => self.listen_config().map(|config| {
                Arc::new(Listener::new(config, self.tls.clone(), self.connect_timeout))
            }),
        };
        Ok(Fleet {
            listener,
            template: self,
            pool,
            renewer: Some(Arc::new(renewer)),
            ended: Some(ended_rx),
            thread: Some(thread),
        })
    }
}

impl Fleet {
    /// A builder for the store of `table` in this fleet: see [`Builder::table`].
    ///
    /// It opens the store with the fleet's pool and renewal thread; [`Builder::open`],
    /// [`Builder::standby`], [`Builder::open_blocking`] and [`Builder::inspect`] work as
    /// usual. Every per-store option applies (TTL, local deadline, loss policy, ...). The
    /// connection options are the fleet's: its pool, TLS and connect timeout are used whatever
    /// this builder says. Its waiting standbys share one LISTEN connection, and run their
    /// attempts on the fleet's pool. In [`PoolMode::Transaction`] there is no LISTEN
    /// connection: they poll (see [`crate::Standby`], "Waking").
    pub fn builder(&self, table: impl Into<String>) -> Builder {
        let mut builder = self.template.clone().table(table);
        let renewer = self.renewer.as_ref().expect("set until close(), which consumes the fleet");
        builder.fleet =
            Some(FleetShare { pool: self.pool.clone(), renewer: Arc::downgrade(renewer) });
        builder.listener = self.listener.clone();
        builder
    }

    /// Stops the fleet once every store opened from it is closed or dropped: waits for that,
    /// then for the renewal thread to end, and closes the pool. Builders from the fleet open
    /// nothing from now on ([`Error::Closed`]). Close the stores first: this waits for them.
    pub async fn close(mut self) {
        drop(self.renewer.take());
        if let Some(ended) = self.ended.take() {
            let _ = ended.await; // Closed when the thread ends, whatever way.
        }
        if let Some(thread) = self.thread.take() {
            // It has ended: the join is immediate.
            let _ = tokio::task::spawn_blocking(move || thread.join()).await;
        }
        self.pool.close();
    }
}
