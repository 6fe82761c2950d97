//! The one safe reaction to a lost lease: stop the application, within a bound, or abort.
//!
//! A lost lease means another instance may now own the state. This process must stop
//! signing, broadcasting and persisting at once. A [`Watchdog`] waits on a [`LeaseWatch`] in a
//! thread of its own. When the lease leaves [`LeaseState::Held`], it calls the shutdown the
//! application gave it, on a fresh thread. If that shutdown has not returned within the bound,
//! the watchdog aborts the process: a hung shutdown must not leave a fenced node running.
//!
//! It needs no async runtime and no LDK. For an ldk-node `Node`, the shutdown is
//! `node.stop()` followed by `std::process::exit(1)`; see `examples/ldk-node/`.
//!
//! ```no_run
//! use std::time::Duration;
//! use pgfence::PgKvStore;
//! use pgfence::shutdown::Watchdog;
//!
//! let store = pgfence::blocking::PgKvStore::open(
//!     PgKvStore::builder("postgres://app@db.internal/node").table("node_state"),
//! )?;
//! let watchdog = Watchdog::spawn(store.lease_watch(), Duration::from_secs(5), |state| {
//!     eprintln!("lease ended ({state:?}): stopping");
//!     // Stop the node here, then exit non-zero so the supervisor restarts it as a standby.
//!     std::process::exit(1);
//! })?;
//! // ... run the application ...
//! // A planned shutdown: stop the watchdog first, then close the store.
//! watchdog.stop();
//! store.close()?;
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

use std::future::Future;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, mpsc};
use std::task::{Context, Waker};
use std::thread;
use std::time::Duration;

use crate::LeaseState;
use crate::blocking::{LeaseWatch, Unpark};

/// Calls a shutdown when the lease leaves [`LeaseState::Held`], and aborts the process if that
/// shutdown takes longer than a bound. See the [module docs](self).
///
/// It owns its thread. [`Watchdog::stop`] or dropping it ends the thread and joins it. Stop it
/// before a planned close of the store: a closed store's lease is `Released`, which also calls
/// the shutdown. Once the shutdown has started, stopping waits for it (at most the bound, then
/// the process aborts). So never stop or drop the watchdog from inside its own shutdown.
#[derive(Debug)]
pub struct Watchdog {
    stop: Arc<AtomicBool>,
    /// `Some` until stopped.
    thread: Option<thread::JoinHandle<()>>,
}

impl Watchdog {
    /// Starts watching `watch`. When the lease leaves `Held` (lost, released or abandoned),
    /// `shutdown` runs once with that state, on a thread of its own. The process aborts if it
    /// has not returned after `bound`, or if it panics. Fails only if no thread can be started.
    pub fn spawn<F>(watch: LeaseWatch, bound: Duration, shutdown: F) -> std::io::Result<Watchdog>
    where
        F: FnOnce(LeaseState) + Send + 'static,
    {
        let stop = Arc::new(AtomicBool::new(false));
        let flag = stop.clone();
        let thread =
            thread::Builder::new().name("pgfence-watchdog".to_owned()).spawn(move || {
                if let Some(state) = wait_for_end(watch, &flag) {
                    run_bounded(state, bound, shutdown);
                }
            })?;
        Ok(Watchdog { stop, thread: Some(thread) })
    }

    /// Stops watching and joins the thread. If the shutdown already started, this waits for it
    /// to return (the process aborts after the bound).
    pub fn stop(mut self) {
        self.stop_and_join();
    }

    fn stop_and_join(&mut self) {
        let Some(thread) = self.thread.take() else { return };
        self.stop.store(true, Ordering::SeqCst);
        // An unpark before the thread parks is kept: it cannot miss the flag.
        thread.thread().unpark();
        // The thread only panics if the process is aborting anyway.
        let _ = thread.join();
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        self.stop_and_join();
    }
}

/// Parks until the lease leaves `Held` (its state then) or `stop` is set (`None`).
fn wait_for_end(mut watch: LeaseWatch, stop: &AtomicBool) -> Option<LeaseState> {
    let waker = Waker::from(Arc::new(Unpark(thread::current())));
    let mut cx = Context::from_waker(&waker);
    {
        let mut ended = std::pin::pin!(watch.0.wait_for(|s| !matches!(s, LeaseState::Held { .. })));
        loop {
            if stop.load(Ordering::SeqCst) {
                return None;
            }
            // An error only once the store is gone; it published its last state before.
            if ended.as_mut().poll(&mut cx).is_ready() {
                break;
            }
            thread::park();
        }
    }
    Some(watch.state())
}

/// Runs `shutdown` on a thread of its own; aborts the process unless it returns within `bound`.
fn run_bounded<F>(state: LeaseState, bound: Duration, shutdown: F)
where
    F: FnOnce(LeaseState) + Send + 'static,
{
    tracing::error!(?state, ?bound, "pgfence lease ended: shutting down");
    let (done, returned) = mpsc::channel::<()>();
    let runner = thread::Builder::new().name("pgfence-shutdown".to_owned()).spawn(move || {
        shutdown(state);
        let _ = done.send(());
    });
    let runner = match runner {
        Ok(runner) => runner,
        Err(error) => abort(&format!("could not start the shutdown thread: {error}")),
    };
    match returned.recv_timeout(bound) {
        Ok(()) => {
            let _ = runner.join();
        }
        Err(mpsc::RecvTimeoutError::Timeout) => {
            abort(&format!("the shutdown did not return within {bound:?}"))
        }
        // The sender was dropped unsent: the shutdown panicked, so the node may still run.
        Err(mpsc::RecvTimeoutError::Disconnected) => abort("the shutdown panicked"),
    }
}

fn abort(why: &str) -> ! {
    tracing::error!("pgfence watchdog aborting the process: {why}");
    std::process::abort()
}
