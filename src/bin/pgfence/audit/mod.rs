//! `pgfence audit`: a randomized failover audit a user runs against their own database.
//!
//! It runs holder processes of its own (this binary's hidden `audit-holder` command) on a table
//! of its own. They write continuously while the auditor injects faults it can cause from the
//! client side. Afterwards it checks from the data alone that no acknowledged write was lost,
//! that no write of an epoch committed after a later epoch's (see [`observer`]), and that the
//! epochs only went up. The table and every process are cleaned up, also on SIGINT/SIGTERM or a
//! panic.

mod holder;
mod observer;
mod proxy;
mod report;

use std::collections::HashMap;
use std::ffi::OsString;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use clap::{Args, ValueEnum};
use pgfence::Builder;
use serde_json::Value;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::{mpsc, watch};

pub(crate) use holder::{HolderArgs, holder};

use crate::exit::{Exit, chain};
use crate::hold::Signals;
use crate::target::{Target, quote_table};
use proxy::{Proxy, Upstream};
use report::{Injected, Report};

/// The namespaces of the audit's rows.
const NAMESPACE: &str = "audit";
const SUB_NAMESPACE: &str = "w";

/// Exit code of an audit that found a violation.
const VIOLATION_EXIT: u8 = 7;

/// Exit code of an audit that did not exercise enough: a fault kind it was to inject was not
/// injected, or writes never resumed after it. A mistyped `--duration` must not pass a CI job.
const TOO_LITTLE_EXIT: u8 = 8;

/// Refuses, before anything runs, a duration too short for every fault kind to get its turn.
/// A fault comes at least TTL/2 after the last one's writes resumed, and a paused or killed
/// holder is taken over about a TTL after it stopped renewing. So each kind needs about two
/// TTLs at the least; the check at the end is what counts.
pub(crate) fn check_args(args: &AuditArgs) -> Result<(), Exit> {
    let mut kinds = args.faults.clone();
    kinds.sort();
    kinds.dedup();
    let least = args.ttl * 2 * kinds.len().max(1) as u32;
    if args.duration < least {
        return Err(Exit::usage(format!(
            "--duration {}: too short to inject {} fault kind(s) at TTL {}; give it at least {} \
             (the default is 5m)",
            report::human(args.duration),
            kinds.len(),
            report::human(args.ttl),
            report::human(least)
        )));
    }
    Ok(())
}

/// `pgfence audit`'s arguments.
#[derive(Debug, Args)]
pub(crate) struct AuditArgs {
    /// How long to inject faults: `90s`, `5m`, `1h` (a bare number is seconds). Long enough for
    /// every fault kind: a run that did not inject each and see writes resume fails (exit 8).
    #[arg(long, value_name = "DURATION", default_value = "5m", value_parser = crate::parse_secs)]
    duration: Duration,

    /// Seed of the fault schedule (kinds, gaps, pause lengths); printed, so a run can be
    /// repeated. Default: from the clock.
    #[arg(long, value_name = "N")]
    seed: Option<u64>,

    /// Holder processes: one holds the lease, the others stand by to take it over.
    #[arg(long, value_name = "N", default_value = "3",
          value_parser = clap::value_parser!(u64).range(2..=16))]
    holders: u64,

    /// The holders' lease TTL (`5s`; a bare number is seconds).
    #[arg(long, value_name = "DURATION", default_value = "5s", value_parser = crate::parse_secs)]
    ttl: Duration,

    /// The lease holder writes a new key this often (`20ms`; a bare number is milliseconds).
    #[arg(long, value_name = "DURATION", default_value = "20ms", value_parser = crate::parse_interval)]
    write_every: Duration,

    /// The observer takes a snapshot this often (a bare number is milliseconds): the
    /// commit-order check's window.
    #[arg(long, value_name = "DURATION", default_value = "25ms", value_parser = crate::parse_interval)]
    poll_every: Duration,

    /// The faults to inject, comma-separated.
    #[arg(
        long,
        value_name = "KINDS",
        value_delimiter = ',',
        default_value = "stop,kill,term,backend,cut"
    )]
    faults: Vec<FaultKind>,

    /// A shell command (`sh -c CMD`) run at each `cmd` fault: a fault outside the holders, such
    /// as a failover tool's switchover or a database server's kill. It adds `cmd` to the
    /// faults. The next fault waits until it has exited.
    #[arg(long, value_name = "CMD")]
    fault_cmd: Option<String>,

    /// Show the holders' stderr, each line prefixed with its process id.
    #[arg(long)]
    verbose: bool,

    /// Tests the audit itself: the holders write with a plain upsert, without the fence, and go
    /// on after losing the lease. The audit must then report violations.
    #[arg(long, hide = true)]
    unfenced: bool,

    /// Tests the audit's cleanup: it panics this long in, with its holders running.
    #[arg(long, value_name = "DURATION", hide = true, value_parser = crate::parse_secs)]
    panic_after: Option<Duration>,
}

/// A fault the auditor injects into the lease holder.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, ValueEnum)]
pub(crate) enum FaultKind {
    /// SIGSTOP for longer than the TTL, then SIGCONT: a paused process that wakes up.
    Stop,
    /// SIGKILL: a crash.
    Kill,
    /// SIGTERM: a graceful shutdown, which releases the lease.
    Term,
    /// `pg_terminate_backend` on the holder's sessions, where the role may.
    Backend,
    /// Every connection of the holder cut by the in-process proxy.
    Cut,
    /// The `--fault-cmd` command, run while the holder writes.
    Cmd,
}

impl FaultKind {
    fn name(self) -> &'static str {
        match self {
            FaultKind::Stop => "stop",
            FaultKind::Kill => "kill",
            FaultKind::Term => "term",
            FaultKind::Backend => "backend",
            FaultKind::Cut => "cut",
            FaultKind::Cmd => "cmd",
        }
    }
}

/// A broken guarantee the audit found.
#[derive(Debug, Clone)]
pub(crate) struct Violation {
    kind: &'static str,
    detail: String,
}

impl Violation {
    fn new(kind: &'static str, detail: String) -> Violation {
        Violation { kind, detail }
    }
}

/// The seeded random numbers of the fault schedule: splitmix64, small and the same everywhere.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// `items` in a random order (Fisher-Yates).
    fn shuffled<T: Copy>(&mut self, items: &[T]) -> Vec<T> {
        let mut items = items.to_vec();
        for i in (1..items.len()).rev() {
            items.swap(i, (self.next() % (i as u64 + 1)) as usize);
        }
        items
    }

    /// A duration between `low` and `high`.
    fn between(&mut self, low: Duration, high: Duration) -> Duration {
        let span = high.saturating_sub(low).as_millis() as u64;
        low + Duration::from_millis(self.next() % (span + 1))
    }
}

/// Time on the system-wide monotonic clock, which the holders read too. So the time of a fault
/// and of a holder's write compare across processes, whenever the auditor reads the line.
fn mono() -> Duration {
    let now = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    Duration::new(now.tv_sec as u64, now.tv_nsec as u32)
}

/// The process ids of the audit's holders, for the cleanup that runs however the audit ends.
type Pids = Arc<Mutex<Vec<u32>>>;

/// The environment that gives a holder the auditor's connection options.
pub(crate) type ChildEnv = Vec<(&'static str, OsString)>;

pub(crate) async fn audit(
    builder: Builder,
    target: Target,
    args: AuditArgs,
    env: ChildEnv,
    json: bool,
) -> Result<(), Exit> {
    if args.fault_cmd.is_none() && args.faults.contains(&FaultKind::Cmd) {
        return Err(Exit::usage("the fault `cmd` needs --fault-cmd CMD"));
    }
    let seed = args.seed.unwrap_or_else(|| {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
        now.map_or(0, |d| d.as_nanos() as u64) % 1_000_000_000
    });
    let table = audit_table(&target.table, seed);
    let duration = args.duration;
    // Printed first: an interrupted or crashed run can still be repeated.
    eprintln!("pgfence: audit seed {seed}, table {table}, {:?}", args.duration);
    let target = Target { table: table.clone(), ..target };
    let mut signals = Signals::install()?;

    // Creates the table, so the observer has something to poll from the start. The epoch it
    // takes is the audit's own, before any holder's.
    let setup = builder.table(&table).lease_ttl(args.ttl).open().await?;
    let setup_epoch = setup.fencing_token();
    if let Err(e) = setup.close().await {
        let dropped = drop_tables(&target).await;
        return Err(with_cleanup(e.into(), &table, dropped));
    }

    let pids = Pids::default();
    let mut body =
        tokio::spawn(run(target.clone(), args, env, seed, setup_epoch, Arc::clone(&pids)));
    let outcome = tokio::select! {
        joined = &mut body => joined.map_err(|e| format!("the audit failed: {e}")),
        () = signals.recv() => {
            body.abort();
            // Dropping the task's futures kills its holders (kill_on_drop); wait for that.
            let _ = body.await;
            Err(format!("interrupted: nothing checked (repeat with --seed {seed})"))
        }
    };
    reap(&pids);
    let dropped = drop_tables(&target).await;
    let report = match outcome {
        Ok(Ok(report)) => report,
        Ok(Err(exit)) => return Err(with_cleanup(exit, &table, dropped)),
        Err(message) => {
            return Err(with_cleanup(Exit { code: 1, message }, &table, dropped));
        }
    };
    if let Err(e) = &dropped {
        eprintln!("pgfence: warning: cannot drop the audit's table {table}: {e}");
    }
    report.print(json)?;
    let gaps = report.coverage_gaps();
    if !report.violations.is_empty() {
        Err(Exit {
            code: VIOLATION_EXIT,
            message: format!("audit found {} violation(s) (seed {seed})", report.violations.len()),
        })
    } else if !gaps.is_empty() {
        Err(Exit {
            code: TOO_LITTLE_EXIT,
            message: format!(
                "audit did not exercise enough, so it shows nothing (seed {seed}): {}; run it \
                 longer than --duration {}",
                gaps.join("; "),
                report::human(duration)
            ),
        })
    } else {
        Ok(())
    }
}

fn with_cleanup(mut exit: Exit, table: &str, dropped: Result<(), String>) -> Exit {
    if let Err(e) = dropped {
        exit.message.push_str(&format!("; and cannot drop the audit's table {table}: {e}"));
    }
    exit
}

/// A table name no other run uses, in the schema of `--table` if it names one.
fn audit_table(user_table: &str, seed: u64) -> String {
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
    let stamp = now.map_or(0, |d| d.as_micros() as u64) % 1_000_000_000;
    let name = format!("pgfence_audit_{}_{stamp}_{}", seed % 100_000, std::process::id());
    match user_table.split_once('.') {
        Some((schema, _)) => format!("{schema}.{name}"),
        None => name,
    }
}

/// Kills (SIGKILL also ends a stopped process) and reaps every holder still there. tokio has
/// usually reaped them already; then `waitpid` finds nothing, which is fine.
fn reap(pids: &Pids) {
    use rustix::process::{Pid, Signal, WaitOptions, kill_process, waitpid};
    let pids = std::mem::take(&mut *pids.lock().unwrap_or_else(|e| e.into_inner()));
    for pid in pids.into_iter().filter_map(|pid| Pid::from_raw(pid as i32)) {
        // A holder reaped already may have left its pid to an unrelated process: only a
        // process that is still our child is signalled.
        if !is_our_child(pid.as_raw_nonzero().get()) {
            continue;
        }
        let _ = kill_process(pid, Signal::KILL);
        for _ in 0..100 {
            match waitpid(Some(pid), WaitOptions::NOHANG) {
                Ok(None) => std::thread::sleep(Duration::from_millis(10)),
                _ => break,
            }
        }
    }
}

/// Whether `pid` is a child of this process, from `/proc/<pid>/stat` (its 4th field is the
/// parent's pid; the 2nd, the command, is in parentheses and may hold spaces).
fn is_our_child(pid: i32) -> bool {
    let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else { return false };
    let parent = stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().nth(1));
    parent.and_then(|p| p.parse::<u32>().ok()) == Some(std::process::id())
}

/// Forgets a holder that tokio has reaped: its pid may be reused from now on.
fn forget(pids: &Pids, pid: u32) {
    pids.lock().unwrap_or_else(|e| e.into_inner()).retain(|p| *p != pid);
}

async fn drop_tables(target: &Target) -> Result<(), String> {
    let client = target.connect().await.map_err(|e| match e {
        crate::target::ConnectError::NoDatabase(message) => message,
        crate::target::ConnectError::Other(exit) => exit.message,
    })?;
    let sql = format!(
        "DROP TABLE IF EXISTS {}, {}, {}, {}; DROP FUNCTION IF EXISTS {}, {}",
        quote_table(&target.table, ""),
        quote_table(&target.table, "_lease"),
        quote_table(&target.table, "_schema_version"),
        quote_table(&target.table, "_crash_marker"),
        quote_table(&target.table, "_fenced_write"),
        quote_table(&target.table, "_fenced_remove")
    );
    client.batch_execute(&sql).await.map_err(|e| chain(&e))
}

/// What a holder printed, as the auditor reads it.
#[derive(Debug)]
enum Event {
    /// Epoch, and when (see [`mono`]).
    Acquired(i64, Duration),
    /// Key, epoch, and when the write started and returned.
    Ack(String, i64, Duration, Duration),
    Gone,
}

/// One holder process.
struct Holder {
    child: Child,
    pid: u32,
    slot: usize,
    name: String,
    epoch: Option<i64>,
    /// Holds the lease as far as the auditor knows: acquired, not yet lost or exited.
    holding: bool,
    /// The auditor sent it a fault (its exit is then expected).
    targeted: bool,
}

/// Everything the body of the audit shares.
struct Run {
    target: Target,
    args: AuditArgs,
    env: ChildEnv,
    pids: Pids,
    proxies: Vec<Option<Proxy>>,
    events: mpsc::UnboundedSender<(u32, Event)>,
    spawned: u64,
}

impl Run {
    /// Starts a holder in `slot`, through that slot's proxy if there is one.
    fn spawn(&mut self, slot: usize) -> Result<Holder, Exit> {
        self.spawned += 1;
        let name = format!("pgfence-audit {} h{slot}.{}", std::process::id(), self.spawned);
        // This very binary, even if it was replaced on disk since the audit started.
        let exe = match std::path::Path::new("/proc/self/exe") {
            proc if proc.exists() => proc.to_path_buf(),
            _ => std::env::current_exe().map_err(|e| Exit::other("cannot find pgfence", &e))?,
        };
        let mut command = Command::new(exe);
        command
            .arg("--table")
            .arg(&self.target.table)
            .arg("audit-holder")
            .args(["--ttl", &self.args.ttl.as_secs_f64().to_string()])
            .args(["--write-every", &self.args.write_every.as_millis().max(1).to_string()])
            .args(["--name", &name]);
        if let Some(proxy) = &self.proxies[slot] {
            command.args(["--proxy", &proxy.addr.to_string()]);
        }
        if self.args.unfenced {
            command.arg("--unfenced");
        }
        command
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            // Its own process group: a Ctrl-C in the terminal reaches the auditor only, which
            // then ends its holders itself.
            .process_group(0)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(if self.args.verbose { Stdio::inherit() } else { Stdio::null() })
            .kill_on_drop(true);
        let mut child = command.spawn().map_err(|e| Exit::other("cannot start a holder", &e))?;
        let pid = child.id().unwrap_or(0);
        self.pids.lock().unwrap_or_else(|e| e.into_inner()).push(pid);
        let stdout = child.stdout.take();
        let events = self.events.clone();
        tokio::spawn(async move {
            if let Some(stdout) = stdout {
                let mut lines = BufReader::new(stdout).lines();
                while let Ok(Some(line)) = lines.next_line().await {
                    if let Some(event) = parse_event(&line) {
                        let _ = events.send((pid, event));
                    }
                }
            }
            let _ = events.send((pid, Event::Gone));
        });
        Ok(Holder { child, pid, slot, name, epoch: None, holding: false, targeted: false })
    }
}

fn parse_event(line: &str) -> Option<Event> {
    let value: Value = serde_json::from_str(line).ok()?;
    let epoch = value.get("epoch").and_then(Value::as_i64)?;
    let ns = |name: &str| value.get(name).and_then(Value::as_u64).map(Duration::from_nanos);
    match value.get("event").and_then(Value::as_str)? {
        "acquired" => Some(Event::Acquired(epoch, ns("at_ns")?)),
        "ack" => {
            let key = value.get("key")?.as_str()?.to_owned();
            Some(Event::Ack(key, epoch, ns("started_ns")?, ns("done_ns")?))
        }
        _ => None,
    }
}

/// The audit itself: holders, faults, then the checks. Its holders are killed when it is
/// dropped (`kill_on_drop`), also on a panic or an abort.
async fn run(
    target: Target,
    args: AuditArgs,
    env: ChildEnv,
    seed: u64,
    setup_epoch: i64,
    pids: Pids,
) -> Result<Report, Exit> {
    let mut rng = Rng(seed);
    let mut notes = Vec::new();
    let mut kinds: Vec<FaultKind> = args.faults.clone();
    if args.fault_cmd.is_some() {
        kinds.push(FaultKind::Cmd);
    }
    kinds.sort();
    kinds.dedup();
    let upstream = Upstream::of(&target.config);
    let use_proxy = kinds.contains(&FaultKind::Cut) && target.tls.is_none() && upstream.is_some();
    let mut skipped = Vec::new();
    if kinds.contains(&FaultKind::Cut) && !use_proxy {
        kinds.retain(|k| *k != FaultKind::Cut);
        skipped.push(FaultKind::Cut);
        notes.push(if target.tls.is_some() {
            "cut: not injected: a TLS connection cannot go through the proxy".to_owned()
        } else {
            "cut: not injected: the proxy needs exactly one server host".to_owned()
        });
    }
    let holders = args.holders as usize;
    let mut proxies = Vec::new();
    for _ in 0..holders {
        proxies.push(match (&upstream, use_proxy) {
            (Some(upstream), true) => Some(
                Proxy::start(upstream.clone())
                    .await
                    .map_err(|e| Exit::other("cannot start the proxy", &e))?,
            ),
            _ => None,
        });
    }
    let admin = connect(&target).await?;
    let (stop_observer, observer_stop) = watch::channel(false);
    let observer = tokio::spawn(observer::observe(target.clone(), args.poll_every, observer_stop));
    let (sender, mut events) = mpsc::unbounded_channel();
    let ttl = args.ttl;
    let duration = args.duration;
    let panic_after = args.panic_after;
    let mut run = Run { target, args, env, pids, proxies, events: sender, spawned: 0 };
    let mut procs: HashMap<u32, Holder> = HashMap::new();
    for slot in 0..holders {
        let holder = run.spawn(slot)?;
        procs.insert(holder.pid, holder);
    }

    let mut report = Report::new(seed, duration, holders, ttl, &run.target.table, setup_epoch);
    report.notes = notes;
    report.kinds = run.args.faults.clone();
    report.skipped = skipped;
    let start = Instant::now();
    let deadline = start + duration;
    // Stall bound: a fault after which no write is acknowledged for this long.
    let stall = ttl * 4 + run.target.connect_timeout + Duration::from_secs(10);
    // The kinds come in rounds, each a seeded shuffle of them all, so every kind gets its turn
    // early: the first round's gaps are the shortest, TTL/2. Later gaps are random.
    let mut round: Vec<FaultKind> = Vec::new();
    let mut rounds = 0u32;
    let mut next_fault = start + ttl / 2;
    let mut stopped: Option<(u32, Instant)> = None;
    // The `--fault-cmd` command still running, and its number.
    let mut command: Option<(Child, u64)> = None;
    let mut commands = 0u64;
    let mut early_failures = 0u32;
    let mut ticks = tokio::time::interval(Duration::from_millis(20));
    loop {
        tokio::select! {
            Some((pid, event)) = events.recv() => handle(&mut procs, &mut report, pid, event),
            _ = ticks.tick() => {}
        }
        let now = Instant::now();
        if panic_after.is_some_and(|after| now >= start + after) {
            panic!("--panic-after: the deliberate panic of a test");
        }
        // Resume a paused holder once it is well past its TTL.
        if let Some((pid, until)) = stopped {
            if now >= until || now >= deadline {
                signal_pid(pid, rustix::process::Signal::CONT);
                stopped = None;
            }
        }
        // Replace exited holders, so there is always someone to take over.
        let exited: Vec<u32> = procs
            .iter_mut()
            .filter_map(|(pid, h)| matches!(h.child.try_wait(), Ok(Some(_))).then_some(*pid))
            .collect();
        for pid in exited {
            let Some(mut gone) = procs.remove(&pid) else { continue };
            forget(&run.pids, pid);
            let status = gone.child.try_wait().ok().flatten();
            gone.holding = false;
            if !gone.targeted && gone.epoch.is_none() {
                early_failures += 1;
                if early_failures > 3 * holders as u32 {
                    return Err(Exit {
                        code: 1,
                        message: format!(
                            "holders keep exiting before taking the lease (last: {}); run with \
                             --verbose to see why",
                            status.map_or("unknown".to_owned(), |s| s.to_string())
                        ),
                    });
                }
            }
            if now < deadline {
                let holder = run.spawn(gone.slot)?;
                procs.insert(holder.pid, holder);
            }
        }
        if let Some((child, n)) = &mut command {
            if let Ok(Some(status)) = child.try_wait() {
                if !status.success() {
                    report.notes.push(format!("cmd: fault {n} exited with {status}"));
                }
                command = None;
            }
        }
        if now >= deadline {
            break;
        }
        // The next fault: once the last one is over (writes resumed, or stalled), the gap has
        // passed and someone holds the lease.
        if stopped.is_some() || command.is_some() || now < next_fault {
            continue;
        }
        let last_done = match report.faults.last_mut() {
            None => true,
            Some(last) if last.resumed.is_some() => true,
            Some(last) if mono().saturating_sub(last.at) > stall => {
                last.stalled = true;
                true
            }
            Some(_) => false,
        };
        if !last_done {
            continue;
        }
        let current = procs
            .values()
            .filter(|h| h.holding && h.epoch.is_some())
            .max_by_key(|h| h.epoch)
            .map(|h| h.pid);
        let Some(pid) = current else { continue };
        if kinds.is_empty() {
            continue;
        }
        let kind = loop {
            if round.is_empty() {
                round = rng.shuffled(&kinds);
                rounds += 1;
            }
            // A kind found impossible here since its round began is skipped.
            match round.pop() {
                Some(kind) if kinds.contains(&kind) => break kind,
                _ => continue,
            }
        };
        let pause = rng.between(ttl * 3 / 2, ttl * 2);
        let gap = match rounds {
            1 => ttl / 2,
            _ => rng.between(ttl / 2, ttl * 2),
        };
        let holder = procs.get_mut(&pid).ok_or_else(|| Exit::usage("no holder"))?;
        let epoch = holder.epoch.unwrap_or(0);
        let mut injected = Injected::new(kind, mono(), epoch);
        match kind {
            FaultKind::Stop => {
                holder.targeted = true;
                signal_pid(pid, rustix::process::Signal::STOP);
                stopped = Some((pid, now + pause));
            }
            FaultKind::Kill => {
                holder.targeted = true;
                signal_pid(pid, rustix::process::Signal::KILL);
            }
            FaultKind::Term => {
                holder.targeted = true;
                signal_pid(pid, rustix::process::Signal::TERM);
            }
            FaultKind::Backend => {
                match admin.query_one(TERMINATE_BACKENDS, &[&holder.name]).await {
                    Ok(row) => injected.sessions = Some(row.get::<_, i64>(0)),
                    Err(e) => {
                        // Not allowed for this role (or not here): noted, and not tried again.
                        report.notes.push(format!("backend: not injected: {}", chain(&e)));
                        kinds.retain(|k| *k != FaultKind::Backend);
                        report.skipped.push(FaultKind::Backend);
                        continue;
                    }
                }
            }
            FaultKind::Cut => {
                if let Some(proxy) = &run.proxies[holder.slot] {
                    proxy.cut();
                }
            }
            FaultKind::Cmd => {
                commands += 1;
                let cmd = run.args.fault_cmd.as_deref().unwrap_or_default();
                let child = spawn_fault_command(cmd, commands, pid, epoch)
                    .map_err(|e| Exit::other("cannot run --fault-cmd", &e))?;
                command = Some((child, commands));
            }
        }
        report.faults.push(injected);
        next_fault = now + gap;
    }

    // A command still running is part of its fault: let it finish (bounded), while writes
    // go on being acknowledged.
    let command_ending = Instant::now() + stall;
    while let Some((child, n)) = &mut command {
        tokio::select! {
            Some((pid, event)) = events.recv() => handle(&mut procs, &mut report, pid, event),
            _ = ticks.tick() => {}
        }
        match child.try_wait() {
            Ok(Some(status)) => {
                if !status.success() {
                    report.notes.push(format!("cmd: fault {n} exited with {status}"));
                }
                command = None;
            }
            _ if Instant::now() >= command_ending => {
                report.notes.push(format!("cmd: fault {n} still ran at the end; killed"));
                let _ = child.start_kill();
                command = None;
            }
            _ => {}
        }
    }

    // Orderly end: every holder releases (a paused one was resumed above), then what still
    // runs is killed. The events go on being read, so no acknowledgement is missed.
    for holder in procs.values() {
        signal_pid(holder.pid, rustix::process::Signal::TERM);
    }
    let ending = Instant::now() + ttl + Duration::from_secs(10);
    while !procs.is_empty() {
        tokio::select! {
            Some((pid, event)) = events.recv() => handle(&mut procs, &mut report, pid, event),
            _ = ticks.tick() => {}
        }
        if Instant::now() >= ending {
            for holder in procs.values_mut() {
                let _ = holder.child.start_kill();
            }
        }
        procs.retain(|pid, h| {
            let exited = matches!(h.child.try_wait(), Ok(Some(_)));
            if exited {
                forget(&run.pids, *pid);
            }
            !exited
        });
    }
    // Every reader ends at its holder's end of stdout; then the channel closes.
    drop(run.events);
    while let Some((pid, event)) = events.recv().await {
        handle(&mut procs, &mut report, pid, event);
    }
    let _ = stop_observer.send(true);
    let observed = observer
        .await
        .map_err(|e| Exit { code: 1, message: format!("the observer failed: {e}") })?;
    report.snapshots = observed.snapshots;
    report.observer_errors = observed.errors;
    report.violations.extend(observed.violations);
    // A fresh connection: the admin one may have been cut meanwhile.
    let reader = connect(&run.target).await?;
    check_rows(&reader, &run.target, &mut report).await?;
    Ok(report)
}

/// Starts `--fault-cmd` with `sh -c`. It learns which fault it is and whom it hits from
/// `PGFENCE_AUDIT_FAULT` (1, 2, ...), `PGFENCE_AUDIT_HOLDER_PID` and `PGFENCE_AUDIT_EPOCH`.
/// Its output goes to stderr, so that stdout holds the report alone. Killed if the audit ends
/// first (`kill_on_drop`).
fn spawn_fault_command(cmd: &str, n: u64, pid: u32, epoch: i64) -> std::io::Result<Child> {
    use std::os::fd::AsFd;
    let stderr = std::io::stderr().as_fd().try_clone_to_owned()?;
    Command::new("/bin/sh")
        .arg("-c")
        .arg(cmd)
        .env("PGFENCE_AUDIT_FAULT", n.to_string())
        .env("PGFENCE_AUDIT_HOLDER_PID", pid.to_string())
        .env("PGFENCE_AUDIT_EPOCH", epoch.to_string())
        .stdin(Stdio::null())
        .stdout(Stdio::from(stderr))
        .kill_on_drop(true)
        .spawn()
}

/// Terminates the sessions of one holder (by its application_name), counting them. The
/// auditor's own session is never one of them: it has a different name.
const TERMINATE_BACKENDS: &str = "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) \
     FROM pg_stat_activity WHERE application_name = $1";

async fn connect(target: &Target) -> Result<tokio_postgres::Client, Exit> {
    target.connect().await.map_err(|e| match e {
        crate::target::ConnectError::NoDatabase(message) => Exit::missing(message),
        crate::target::ConnectError::Other(exit) => exit,
    })
}

fn signal_pid(pid: u32, signal: rustix::process::Signal) {
    if let Some(pid) = rustix::process::Pid::from_raw(pid as i32) {
        // The process may have exited meanwhile: then there is nothing to signal.
        let _ = rustix::process::kill_process(pid, signal);
    }
}

fn handle(procs: &mut HashMap<u32, Holder>, report: &mut Report, pid: u32, event: Event) {
    match event {
        Event::Acquired(epoch, at) => {
            if let Some(holder) = procs.get_mut(&pid) {
                holder.epoch = Some(epoch);
                holder.holding = true;
            }
            report.acquired(pid, epoch, at);
        }
        Event::Ack(key, epoch, started, done) => report.acked(key, epoch, started, done),
        Event::Gone => {
            if let Some(holder) = procs.get_mut(&pid) {
                holder.holding = false;
            }
        }
    }
}

/// The end check, with every holder gone: each acknowledged key is in the table, with its
/// value and epoch.
async fn check_rows(
    client: &tokio_postgres::Client,
    target: &Target,
    report: &mut Report,
) -> Result<(), Exit> {
    let sql = format!(
        "SELECT key, value, epoch FROM {} WHERE primary_namespace = $1 AND \
         secondary_namespace = $2",
        quote_table(&target.table, "")
    );
    let rows = client
        .query(&sql, &[&NAMESPACE, &SUB_NAMESPACE])
        .await
        .map_err(|e| Exit::other("read the audit table", &e))?;
    let mut found: HashMap<String, (Vec<u8>, i64)> = rows
        .iter()
        .map(|row| (row.get::<_, String>(0), (row.get::<_, Vec<u8>>(1), row.get::<_, i64>(2))))
        .collect();
    report.rows = found.len() as u64;
    let mut lost = Vec::new();
    for (key, epoch) in &report.acks {
        match found.remove(key) {
            Some((value, row_epoch)) if value == key.as_bytes() && row_epoch == *epoch => {}
            Some((_, row_epoch)) => {
                lost.push(format!("{key} (epoch {epoch}): changed, epoch {row_epoch}"))
            }
            None => lost.push(format!("{key} (epoch {epoch}): missing")),
        }
    }
    report.unacked_rows = found.len() as u64;
    lost.sort();
    if !lost.is_empty() {
        let shown: Vec<&str> = lost.iter().take(5).map(String::as_str).collect();
        report.violations.push(Violation::new(
            "lost_write",
            format!("{} acknowledged write(s) not in the table: {}", lost.len(), shown.join("; ")),
        ));
    }
    Ok(())
}
