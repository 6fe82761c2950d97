//! A fleet's renewal thread: one thread, one runtime and one connection renewing the leases of
//! many stores, each as a task of its own (see [`crate::Fleet`]).
//!
//! Each task is the loop a single store runs on its own thread (`keeper::run`). So each lease
//! keeps its own timers, local deadline, loss policy and release. Only the thread and the
//! connection are shared. tokio-postgres pipelines the tasks' statements on that connection.

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::sync::oneshot;

use super::keeper::{Conn, Connector, renewal_connection};
use crate::error::{Error, Result};

/// How long a renewal or release on the shared connection waits for a lock on its lease row.
///
/// The server runs the pipelined statements one after the other. A statement stuck behind a
/// lock held on its row (an operator's open transaction, say) would hold up every lease's
/// renewal queued behind it. Measured without this: with one row locked, the others renewed
/// nothing for a minute, each retry meeting the locked lease's next attempt. It fails after
/// this instead, and is retried about a second later, as any failed renewal is. Its lease
/// still fails closed only at its own local deadline. Normal contention on a lease row (an
/// acquisition's update, a release) lasts a statement, well below this.
///
/// A session setting, so not made behind a transaction pooler (`PoolMode::Transaction`): there
/// a renewal stuck on a lock holds up the fleet's other renewals until it ends.
const LOCK_TIMEOUT: &str = "SET lock_timeout = '100ms'";

/// The fleet's renewal thread and shared connection.
///
/// Held by the fleet, by each of its stores and by each of their renewal tasks. When the last
/// holder is gone, its drop stops the thread: the runtime then ends, with the connection.
#[derive(Debug)]
pub(crate) struct Renewer {
    handle: tokio::runtime::Handle,
    connection: SharedConnection,
    /// Dropped with the renewer: ends the thread's `block_on`.
    _stop: oneshot::Sender<()>,
}

impl Renewer {
    /// Starts the thread. `ended` is told (dropped) when the thread has ended, its runtime
    /// and every task on it gone.
    pub(crate) fn start(
        connector: Connector,
        connect_timeout: Duration,
        ended: oneshot::Sender<()>,
    ) -> Result<(Renewer, std::thread::JoinHandle<()>)> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|source| Error::Runtime { source })?;
        let handle = runtime.handle().clone();
        let (stop, stopped) = oneshot::channel::<()>();
        let thread = std::thread::Builder::new()
            .name("pgfence-fleet".to_owned())
            .spawn(move || {
                let _ended = ended;
                // A panicking task (`LeaseLossPolicy::Panic`) is caught by the runtime; only
                // that task ends. So this returns only when the renewer is dropped.
                let _ = runtime.block_on(stopped);
                drop(runtime); // Cancels what is left: the shared connection's task.
            })
            .map_err(|source| Error::Runtime { source })?;
        let connection = SharedConnection {
            connector,
            connect_timeout,
            current: Mutex::new(None),
            connecting: tokio::sync::Mutex::new(0),
        };
        Ok((Renewer { handle, connection, _stop: stop }, thread))
    }

    /// Runs `task` on the fleet's thread.
    pub(super) fn spawn(&self, task: impl Future<Output = ()> + Send + 'static) {
        drop(self.handle.spawn(task)); // Detached: it ends on its own, or with the runtime.
    }

    pub(super) fn connection(&self) -> &SharedConnection {
        &self.connection
    }
}

/// The one renewal connection of a fleet, made on first use and made again once it broke or
/// stopped answering. Each connection has a generation number, so that a task can tell whether
/// its prepared statement is on the current one.
#[derive(Debug)]
pub(super) struct SharedConnection {
    connector: Connector,
    connect_timeout: Duration,
    /// The current connection and its generation. A std lock: never held across an await.
    current: Mutex<Option<(u64, Arc<Conn>)>>,
    /// Held while connecting, so that the tasks wait for one connection rather than each
    /// make their own. Holds the last generation handed out.
    connecting: tokio::sync::Mutex<u64>,
}

impl SharedConnection {
    /// The current connection, connecting if there is none or it broke.
    pub(super) async fn get(&self) -> Result<(Arc<Conn>, u64)> {
        if let Some(live) = self.live() {
            return Ok(live);
        }
        let mut generation = self.connecting.lock().await;
        if let Some(live) = self.live() {
            return Ok(live); // Another task connected while this one waited.
        }
        let conn = renewal_connection(&self.connector, self.connect_timeout, LOCK_TIMEOUT).await?;
        let conn = Arc::new(conn);
        *generation += 1;
        *self.current.lock().unwrap_or_else(|e| e.into_inner()) =
            Some((*generation, Arc::clone(&conn)));
        Ok((conn, *generation))
    }

    /// Whether `generation` is the current connection's.
    pub(super) fn is_current(&self, generation: u64) -> bool {
        let current = self.current.lock().unwrap_or_else(|e| e.into_inner());
        current.as_ref().is_some_and(|(g, _)| *g == generation)
    }

    /// Gives up connection `generation` (it stopped answering): the next task to ask connects
    /// anew. Tasks waiting on it keep it until they give up too. A newer one is left alone.
    pub(super) fn replace(&self, generation: u64) {
        let mut current = self.current.lock().unwrap_or_else(|e| e.into_inner());
        if current.as_ref().is_some_and(|(g, _)| *g == generation) {
            *current = None;
        }
    }

    fn live(&self) -> Option<(Arc<Conn>, u64)> {
        let current = self.current.lock().unwrap_or_else(|e| e.into_inner());
        match current.as_ref() {
            Some((generation, conn)) if !conn.client().is_closed() => {
                Some((Arc::clone(conn), *generation))
            }
            _ => None,
        }
    }
}
