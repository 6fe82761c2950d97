//! Running synchronous store calls in each context they must work in: a plain thread with no
//! runtime, a worker of a multi-thread tokio runtime, and the only thread of a current-thread
//! runtime. Shared by blocking.rs and by ldk.rs of tests-ldk.
#![allow(dead_code, unreachable_pub)] // Each test binary uses a different subset.

use std::future::Future;
use std::panic;
use std::sync::mpsc::{self, RecvTimeoutError};
use std::thread;
use std::time::Duration;

use crate::common::conformance::block_on;

/// Generous bound on one whole scenario (a conformance run is hundreds of statements on a busy
/// 2-core machine). A bound against hangs, never a measurement.
pub const SCENARIO_LIMIT: Duration = Duration::from_secs(300);

/// Where the synchronous calls of a scenario run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Where {
    /// A plain thread with no tokio runtime in reach; futures are driven by [`block_on`].
    PlainThread,
    /// A task on a worker thread of a 2-worker multi-thread runtime.
    MultiThreadRuntime,
    /// The only thread of a current-thread runtime: a blocking call that needed this runtime
    /// to make progress would deadlock here.
    CurrentThreadRuntime,
}

impl Where {
    pub const ALL: [Where; 3] =
        [Where::PlainThread, Where::MultiThreadRuntime, Where::CurrentThreadRuntime];
}

/// Runs the future made by `make` in `place`, on a fresh thread, and fails the test if it does
/// not finish within [`SCENARIO_LIMIT`] (a deadlock) or if it panics (the panic is resumed
/// here). Everything the scenario creates (stores, runtimes) is created and dropped in `place`.
pub fn run_in<F, T>(place: Where, what: &str, make: impl FnOnce() -> F + Send + 'static) -> T
where
    F: Future<Output = T> + Send + 'static,
    T: Send + 'static,
{
    let what = format!("{what} ({place:?})");
    guarded(&what, move || match place {
        Where::PlainThread => {
            assert!(tokio::runtime::Handle::try_current().is_err(), "no runtime in reach");
            block_on(make())
        }
        Where::MultiThreadRuntime => {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .expect("test runtime");
            // Spawned, so the scenario runs on a worker thread, not in `block_on`'s thread.
            let output = runtime.block_on(runtime.spawn(make()));
            drop(runtime);
            output.unwrap_or_else(|e| panic::resume_unwind(e.into_panic()))
        }
        Where::CurrentThreadRuntime => {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("test runtime");
            let output = runtime.block_on(make());
            drop(runtime);
            output
        }
    })
}

/// Runs `f` on a fresh thread; fails the test if it takes longer than [`SCENARIO_LIMIT`], and
/// resumes its panic if it panics.
pub fn guarded<T: Send + 'static>(what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let (done, result) = mpsc::channel();
    let thread = thread::Builder::new()
        .name(what.chars().take(15).collect())
        .spawn(move || {
            let _ = done.send(f());
        })
        .expect("spawn scenario thread");
    match result.recv_timeout(SCENARIO_LIMIT) {
        Ok(output) => {
            thread.join().expect("scenario thread ended");
            output
        }
        Err(RecvTimeoutError::Timeout) => panic!("{what} hung for {SCENARIO_LIMIT:?}"),
        Err(RecvTimeoutError::Disconnected) => match thread.join() {
            Err(panic) => panic::resume_unwind(panic),
            Ok(()) => unreachable!("the thread sends before it ends"),
        },
    }
}
