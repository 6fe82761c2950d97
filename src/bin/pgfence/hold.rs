//! `pgfence hold`: takes the lease and keeps it, printing one JSON line per lease event.

use std::io::{self, Write};
use std::time::Duration;

use pgfence::{
    Builder, Error, LeaseLossPolicy, LeaseState, LossReason, PgKvStore, StandbyState, check_key,
};
use serde_json::{Value, json};
use tokio::signal::unix::{Signal, SignalKind, signal};
use tokio::sync::{mpsc, watch};

use crate::HoldArgs;
use crate::exit::{Exit, chain, fail_code};
use crate::logging::{HOLDER_TROUBLE, STANDBY_TROUBLE};
use crate::metrics;
use crate::target::{ConnectError, Target};

/// SIGINT or SIGTERM, whichever comes first.
pub(crate) struct Signals {
    interrupt: Signal,
    terminate: Signal,
}

impl Signals {
    pub(crate) fn install() -> Result<Signals, Exit> {
        let install =
            |kind| signal(kind).map_err(|e| Exit::other("cannot install signal handler", &e));
        Ok(Signals {
            interrupt: install(SignalKind::interrupt())?,
            terminate: install(SignalKind::terminate())?,
        })
    }

    pub(crate) async fn recv(&mut self) {
        tokio::select! {
            _ = self.interrupt.recv() => {}
            _ = self.terminate.recv() => {}
        }
    }
}

/// One JSON line on stdout. A closed stdout does not stop the holder: the lease, not the
/// output, is what it is for.
fn emit(mut event: Value) {
    event["at"] = Value::String(utc_now());
    let mut out = io::stdout().lock();
    let _ = writeln!(out, "{event}").and_then(|()| out.flush());
}

/// The time now, UTC, as RFC 3339 with milliseconds: `2026-12-01T23:57:04.123Z`.
fn utc_now() -> String {
    let now = std::time::SystemTime::now();
    rfc3339(now.duration_since(std::time::UNIX_EPOCH).unwrap_or_default())
}

/// `since` the Unix epoch as RFC 3339, UTC, with milliseconds.
fn rfc3339(since: Duration) -> String {
    let (days, secs) = (since.as_secs() / 86_400, since.as_secs() % 86_400);
    // Days since 1970-01-01 to a civil date (Howard Hinnant's days_from_civil, inverted).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        secs / 3_600,
        secs % 3_600 / 60,
        secs % 60,
        since.subsec_millis()
    )
}

/// Where `hold --write-every` writes its counter.
#[derive(Debug, Clone)]
pub(crate) struct CounterKey {
    primary: String,
    secondary: String,
    key: String,
    /// As given on the command line, for the `write` events.
    name: String,
}

impl CounterKey {
    pub(crate) fn parse(name: &str) -> Result<CounterKey, Exit> {
        let parts: Vec<&str> = name.split('/').collect();
        let (primary, secondary, key) = match parts.as_slice() {
            [key] => ("pgfence", "hold", *key),
            [primary, secondary, key] => (*primary, *secondary, *key),
            _ => {
                return Err(Exit::usage(format!(
                    "--counter-key {name:?}: expected KEY or NS/SUB/KEY"
                )));
            }
        };
        check_key(primary, secondary, key)?;
        Ok(CounterKey {
            primary: primary.to_owned(),
            secondary: secondary.to_owned(),
            key: key.to_owned(),
            name: name.to_owned(),
        })
    }
}

/// The store the metrics endpoint shows. Emptied when `hold` returns, so the endpoint's task
/// never keeps the store alive past the command.
struct Scraped(watch::Sender<Option<PgKvStore>>);

impl Drop for Scraped {
    fn drop(&mut self) {
        self.0.send_replace(None);
    }
}

/// How `hold` ended, once it holds the lease.
enum Ended {
    Signalled,
    Lost,
    WriterFailed(Error),
}

/// How often at most `hold --wait` reports that the standby cannot reach the database.
const TROUBLE_REPORT_EVERY: Duration = Duration::from_secs(30);

/// How often at most `hold` reports that the holder retries: renewals are retried about once a
/// second until the local deadline, 2/3 TTL after the last confirmed one.
const RETRY_REPORT_EVERY: Duration = Duration::from_secs(5);

/// How often `hold` samples the store's local deadline, to tell a force release from an
/// expiry when the lease is lost.
const DEADLINE_SAMPLE_EVERY: Duration = Duration::from_millis(500);

pub(crate) async fn hold(builder: Builder, args: HoldArgs, target: Target) -> Result<(), Exit> {
    // Installed before anything else: from here on SIGINT/SIGTERM mean "release and exit 0".
    // They never mean the default instant death that would leave the lease to expire by TTL.
    let mut signals = Signals::install()?;
    let counter = args.counter_key.as_deref().map(CounterKey::parse).transpose()?;
    // Bound first, so an address in use fails before the lease is taken. Served from now on:
    // a standby shows `pgfence_lease_held` 0 while it waits.
    let scraped = Scraped(watch::channel(None).0);
    if let Some(addr) = args.metrics_addr {
        let listener = metrics::bind(&addr).await?;
        metrics::serve(listener, target.table.clone(), scraped.0.subscribe());
    }
    // The library's defaults for the TTL. Renewal every TTL/3 leaves another TTL/3 of retries
    // (about one a second) before the local deadline at 2/3 TTL. That deadline itself comes
    // before the DB expiry.
    let builder = builder.lease_ttl(args.ttl).on_lease_lost(LeaseLossPolicy::FailClosed);
    // For a look at the lease row once the lease is lost: who holds it now.
    let inspecting = builder.clone();

    // A signal before the lease is taken gives up the opening. A setup may still be waiting,
    // at the fence for the old holder's writes, say. `open_until` returns once it is cancelled
    // on the server, so the exit leaves nothing behind. Exit 0, the lease never held.
    let opened = if args.wait {
        let standby = builder.standby();
        let mut progress = standby.progress();
        let (trouble_sender, mut trouble) = mpsc::unbounded_channel();
        *STANDBY_TROUBLE.lock().unwrap_or_else(|e| e.into_inner()) = Some(trouble_sender);
        // A report is made by a connection attempt of the CLI's own, which names the server
        // and gives the whole cause. It is spawned, so the standby's opening is never held up.
        let (report_sender, mut reports) = mpsc::unbounded_channel::<String>();
        let mut reported_at: Option<tokio::time::Instant> = None;
        let mut probing = false;
        // The holder and epoch last printed: `waiting` is printed when they change, not at
        // each look (every second behind a transaction pooler).
        let mut shown: Option<(String, i64)> = None;
        let opening = standby.open_until(signals.recv());
        tokio::pin!(opening);
        let opened = loop {
            tokio::select! {
                opened = &mut opening => break opened,
                Some(warning) = trouble.recv() => {
                    let due = reported_at.is_none_or(|at| at.elapsed() >= TROUBLE_REPORT_EVERY);
                    if due && !probing {
                        probing = true;
                        let (target, sender) = (target.clone(), report_sender.clone());
                        tokio::spawn(async move {
                            let cause = match target.connect().await {
                                Err(ConnectError::Other(exit)) => exit.message,
                                Err(ConnectError::NoDatabase(message)) => message,
                                // Reachable now: the library's own words are all there is.
                                Ok(_) => warning,
                            };
                            let _ = sender.send(cause);
                        });
                    }
                }
                Some(cause) = reports.recv() => {
                    probing = false;
                    reported_at = Some(tokio::time::Instant::now());
                    emit(json!({ "event": "retrying", "error": cause }));
                    let _ = writeln!(io::stderr(), "pgfence: standby retrying: {cause}");
                    shown = None; // The next `waiting` is a change of state again.
                }
                Ok(()) = progress.changed() => {
                    let state = progress.borrow_and_update().clone();
                    let StandbyState::Waiting { holder, epoch, expires_in } = state else {
                        continue;
                    };
                    if shown.as_ref() != Some(&(holder.clone(), epoch)) {
                        shown = Some((holder.clone(), epoch));
                        emit(json!({
                            "event": "waiting",
                            "holder": holder,
                            "epoch": epoch,
                            "expires_in_ms": expires_in.as_millis() as u64,
                        }));
                    }
                }
            }
        };
        *STANDBY_TROUBLE.lock().unwrap_or_else(|e| e.into_inner()) = None;
        opened?
    } else {
        builder.open_until(signals.recv()).await?
    };
    let Some(store) = opened else { return Ok(()) };
    scraped.0.send_replace(Some(store.clone()));
    let epoch = store.fencing_token();
    emit(json!({ "event": "acquired", "epoch": epoch, "owner_id": store.owner_id().to_string() }));

    let (stop, stopped) = watch::channel(false);
    let mut writer = match (counter, args.write_every) {
        (Some(counter), Some(every)) => {
            let start = match counter_start(&store, &counter).await {
                Ok(start) => start,
                Err(exit) => {
                    // Reporting the cause; a failed release is only worth a warning beside it.
                    if let Err(e) = store.close().await {
                        tracing::warn!(error = %e, "releasing the lease failed");
                    }
                    return Err(exit);
                }
            };
            Some(tokio::spawn(write_counter(store.clone(), counter, start, every, stopped)))
        }
        _ => None,
    };

    let mut state = store.lease_state();
    let (retry_sender, mut retries) = mpsc::unbounded_channel();
    *HOLDER_TROUBLE.lock().unwrap_or_else(|e| e.into_inner()) = Some(retry_sender);
    let mut retry_reported_at: Option<tokio::time::Instant> = None;
    // The latest local deadline seen: until then the lease cannot have expired in the database.
    let mut trusted = Trusted::default();
    let mut samples = tokio::time::interval(DEADLINE_SAMPLE_EVERY);
    let ended = {
        let writer_done = async {
            match writer {
                Some(ref mut handle) => handle.await,
                None => std::future::pending().await,
            }
        };
        tokio::pin!(writer_done);
        loop {
            tokio::select! {
                () = signals.recv() => break Ended::Signalled,
                // Renewal (or a write) found the loss: the watch reports it whoever found it.
                _ = state.wait_for(|s| matches!(s, LeaseState::Lost { .. })) => break Ended::Lost,
                finished = &mut writer_done => break match finished {
                    Ok(Err(e)) if e.is_lease_lost() => Ended::Lost,
                    Ok(Err(e)) => Ended::WriterFailed(e),
                    // The writer returns Ok only when stopped, and panics never (nothing in it
                    // unwraps); report either as a failed writer all the same.
                    Ok(Ok(())) | Err(_) => Ended::WriterFailed(Error::Closed),
                },
                Some(warning) = retries.recv() => {
                    let due = retry_reported_at.is_none_or(|at| at.elapsed() >= RETRY_REPORT_EVERY);
                    if due {
                        retry_reported_at = Some(tokio::time::Instant::now());
                        emit(json!({ "event": "retrying", "epoch": epoch, "error": warning }));
                    }
                }
                _ = samples.tick() => trusted.sample(&store),
            }
        }
    };
    *HOLDER_TROUBLE.lock().unwrap_or_else(|e| e.into_inner()) = None;
    if let Ended::Lost = ended {
        // Report at once: the process must stop now, whatever the cleanup costs. Nothing of
        // this store can commit any more, so the write in flight is simply dropped. We await the
        // aborted writer; it stops at its next await. Then a `write` event for a write that
        // committed before the loss is never printed after `lost`.
        if let Some(handle) = writer {
            handle.abort();
            if !handle.is_finished() {
                let _ = handle.await;
            }
        }
        let lost = lost_exit(&store, &inspecting, trusted).await;
        // Best effort: the release is a no-op by owner id once the lease is someone else's.
        match tokio::time::timeout(CLEANUP_LIMIT, store.close()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(error = %e, "closing the lost store failed"),
            Err(_) => tracing::warn!(?CLEANUP_LIMIT, "closing the lost store timed out"),
        }
        return Err(lost.unwrap_or(Exit { code: 5, message: "lease lost".to_owned() }));
    }
    // Orderly: let the writer finish the write in flight; it never starts another after
    // `stop`. So close() releases after the last write of this epoch, not beside it. A second
    // signal skips the wait, as an impatient operator expects.
    let shutdown = async {
        let _ = stop.send(true); // The writer may have ended already; then nothing listens.
        // A writer that already ended was awaited above (its result is in `ended`): a
        // JoinHandle must not be polled again after it returned.
        let writer = writer.filter(|_| !matches!(ended, Ended::WriterFailed(_)));
        let written = match writer {
            Some(handle) => match handle.await {
                Ok(result) => result,
                Err(e) => Err(Error::Runtime { source: io::Error::other(e.to_string()) }),
            },
            None => Ok(()),
        };
        (written, store.close().await)
    };
    let (written, closed) = tokio::select! {
        done = shutdown => done,
        // At once, without running destructors: dropping the store would wait for a release.
        () = signals.recv() => std::process::exit(i32::from(fail_code(Exit {
            code: 1,
            message: "signalled again: exiting without releasing the lease; it expires by its TTL"
                .to_owned(),
        }))),
    };
    // The loss may have been found by the last write or by renewal during the shutdown.
    if let Some(lost) = lost_exit(&store, &inspecting, trusted).await {
        return Err(lost);
    }
    if let Ended::WriterFailed(e) = ended {
        return Err(Exit { code: 1, message: format!("counter write failed: {}", chain(&e)) });
    }
    if let Err(e) = written {
        return Err(Exit { code: 1, message: format!("last counter write failed: {}", chain(&e)) });
    }
    closed.map_err(|e| Exit {
        code: 1,
        message: format!("releasing the lease failed (it expires by its TTL): {}", chain(&e)),
    })?;
    emit(json!({ "event": "released", "epoch": epoch }));
    Ok(())
}

/// Bounds the cleanup after a loss. The release it attempts is a no-op (by owner id, and the
/// lease is no longer ours). So it must not hold up the exit.
const CLEANUP_LIMIT: Duration = Duration::from_secs(5);

/// Until when the store's lease is sure to be valid in the database: the latest local deadline
/// sampled. The local deadline comes before the database's expiry.
#[derive(Clone, Copy, Default)]
struct Trusted(Option<tokio::time::Instant>);

impl Trusted {
    fn sample(&mut self, store: &PgKvStore) {
        let stats = store.stats();
        if matches!(stats.lease, LeaseState::Held { .. }) {
            let until = tokio::time::Instant::now() + stats.deadline_in;
            self.0 = Some(self.0.map_or(until, |seen| seen.max(until)));
        }
    }

    /// Whether the lease was still valid in the database now, had nobody ended it early.
    fn still(self) -> bool {
        self.0.is_some_and(|until| tokio::time::Instant::now() < until)
    }
}

/// How long `hold` looks at the lease row after a loss, to name who holds it now.
const LOOK_LIMIT: Duration = Duration::from_secs(2);

/// If the store's lease is lost: prints the `lost` event and returns exit 5.
///
/// The library's reason says what found the loss: a refused write, or a renewal that found the
/// row not ours. The lease row says more. It still names this store, expired, while the local
/// deadline had not passed: an operator expired it early, `pgfence release --force`. It names
/// another holder: who took it.
async fn lost_exit(store: &PgKvStore, inspecting: &Builder, trusted: Trusted) -> Option<Exit> {
    let (epoch, reason) = match &*store.lease_state().borrow() {
        LeaseState::Lost { epoch, reason } => (*epoch, reason.clone()),
        _ => return None,
    };
    let mut cause = match reason {
        LossReason::Fenced => "fenced",
        LossReason::TakenOver => "taken_over",
        LossReason::DeadlinePassed => "deadline_passed",
        LossReason::WriteOutcomeUnknown => "write_outcome_unknown",
        _ => "other",
    };
    let mut text = reason.to_string();
    if matches!(reason, LossReason::Fenced | LossReason::TakenOver) {
        let look = async { inspecting.clone().inspect().await?.lease_info().await };
        if let Ok(Ok(Some(row))) = tokio::time::timeout(LOOK_LIMIT, look).await {
            let ours = row.owner_id == store.owner_id();
            (cause, text) = match (ours, row.active, trusted.still()) {
                (true, false, true) => (
                    "force_released",
                    "force-released: the lease was expired before its time, as `pgfence \
                     release --force` does; nobody took it over"
                        .to_owned(),
                ),
                (false, _, true) => (
                    "force_released",
                    format!(
                        "force-released: the lease was expired before its time, as `pgfence \
                         release --force` does, then taken by {} (epoch {})",
                        row.holder, row.epoch
                    ),
                ),
                (false, _, false) => {
                    (cause, format!("{text}; now held by {} (epoch {})", row.holder, row.epoch))
                }
                _ => (cause, text),
            };
        }
    }
    emit(json!({ "event": "lost", "epoch": epoch, "reason": text, "cause": cause }));
    Some(Exit { code: 5, message: format!("lease lost (epoch {epoch}): {text}") })
}

/// Where the counter goes on: after the value in the store, written by this or an earlier
/// holder. A new holder rebuilds its state from the store, as any successor must.
async fn counter_start(store: &PgKvStore, counter: &CounterKey) -> Result<u64, Exit> {
    match store.read(&counter.primary, &counter.secondary, &counter.key).await {
        Ok(bytes) => serde_json::from_slice::<Value>(&bytes)
            .ok()
            .and_then(|v| v.get("counter").and_then(Value::as_u64))
            .map(|n| n + 1)
            .ok_or_else(|| {
                Exit::usage(format!(
                    "--counter-key {}: the key holds a value that is not a pgfence counter",
                    counter.name
                ))
            }),
        Err(e) if e.is_not_found() => Ok(1),
        Err(e) => Err(e.into()),
    }
}

/// Writes `{"counter":N,"epoch":E}` every `every` until stopped, one write at a time, and
/// prints a `write` event for each committed one. Returns the first error that is not worth
/// retrying on the next tick: lease lost, closed, anything but a connection problem. A
/// connection problem the store could not ride out itself is reported and retried.
async fn write_counter(
    store: PgKvStore,
    counter: CounterKey,
    start: u64,
    every: Duration,
    mut stopped: watch::Receiver<bool>,
) -> Result<(), Error> {
    let epoch = store.fencing_token();
    let mut ticks = tokio::time::interval(every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let mut n = start;
    loop {
        tokio::select! {
            _ = stopped.wait_for(|stop| *stop) => return Ok(()),
            _ = ticks.tick() => {}
        }
        let value = json!({ "counter": n, "epoch": epoch }).to_string().into_bytes();
        match store.write(&counter.primary, &counter.secondary, &counter.key, value).await {
            Ok(()) => {
                emit(
                    json!({ "event": "write", "key": counter.name, "counter": n, "epoch": epoch }),
                );
                n += 1;
            }
            Err(e) if e.is_retryable() => {
                let cause = chain(&e);
                emit(json!({ "event": "retrying", "epoch": epoch, "error": cause }));
                let _ = writeln!(io::stderr(), "pgfence: counter write failed, retrying: {cause}");
            }
            Err(e) => return Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_are_rfc3339_utc() {
        assert_eq!(rfc3339(Duration::ZERO), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339(Duration::from_millis(951_782_400_250)), "2000-02-29T00:00:00.250Z");
        assert_eq!(rfc3339(Duration::from_secs(1_796_169_599)), "2026-12-01T23:59:59.000Z");
    }
}
