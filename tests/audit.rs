//! `pgfence audit` against the test server: a clean run reports no violation, directly and
//! through PgBouncer; holders that write without the fence make it fail; an interrupted run
//! leaves no table, process or session behind.
#![cfg(feature = "cli")]

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use pgfence_testing::{PgBouncer, PoolMode, TestServer};
use serde_json::Value;

const BIN: &str = env!("CARGO_BIN_EXE_pgfence");

fn server() -> &'static TestServer {
    TestServer::shared()
        .expect("a PostgreSQL server for the tests (DATABASE_URL or local binaries)")
}

/// A running `pgfence audit`, killed and reaped on drop however the test ends. Its holders end
/// by themselves then: they stop when their stdin (held by the auditor) closes.
struct Auditor {
    child: Child,
}

impl Auditor {
    fn start(url: &str, args: &[&str]) -> Auditor {
        Auditor::start_with(url, &[], args)
    }

    /// With `global` options before the `audit` subcommand.
    fn start_with(url: &str, global: &[&str], args: &[&str]) -> Auditor {
        let mut command = Command::new(BIN);
        for variable in pgfence::env::VARIABLES {
            command.env_remove(variable);
        }
        let child = command
            .args(["--database-url", url])
            .args(global)
            .arg("audit")
            .args(args)
            .env_remove("DATABASE_URL")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("spawn pgfence audit");
        Auditor { child }
    }

    /// Waits for the exit (panics after `limit`): the exit code, stdout and stderr.
    fn finish(mut self, limit: Duration) -> (Option<i32>, String, String) {
        let mut out = self.child.stdout.take().expect("stdout");
        // A test may have taken stderr to read it as it comes.
        let err = self.child.stderr.take();
        let stdout = thread::spawn(move || {
            let mut text = String::new();
            let _ = out.read_to_string(&mut text);
            text
        });
        let stderr = thread::spawn(move || {
            let mut text = String::new();
            if let Some(mut err) = err {
                let _ = err.read_to_string(&mut text);
            }
            text
        });
        let deadline = Instant::now() + limit;
        let status = loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                break status;
            }
            assert!(Instant::now() < deadline, "pgfence audit did not end within {limit:?}");
            thread::sleep(Duration::from_millis(50));
        };
        (status.code(), stdout.join().unwrap(), stderr.join().unwrap())
    }
}

impl Drop for Auditor {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
    }
}

/// A PgBouncer in `mode` in front of the test server, and the URL through it.
fn pgbouncer(mode: PoolMode) -> (PgBouncer, String) {
    let addr = server().tcp_addr().expect("the test server's TCP address");
    let bouncer = PgBouncer::start(addr, mode).expect("start pgbouncer");
    let config = server().config();
    let url = format!(
        "postgres://{}@{}/{}",
        config.get_user().unwrap_or("postgres"),
        bouncer.addr(),
        config.get_dbname().unwrap_or("postgres")
    );
    (bouncer, url)
}

/// Runs an audit to its end and returns its exit code, its JSON report and its stderr.
fn audit(url: &str, args: &[&str], limit: Duration) -> (Option<i32>, Value, String) {
    let (code, stdout, stderr) = Auditor::start(url, args).finish(limit);
    let report = serde_json::from_str(&stdout)
        .unwrap_or_else(|e| panic!("a JSON report ({e}): {stdout:?}, stderr {stderr:?}"));
    (code, report, stderr)
}

fn query(sql: &str, table: &str) -> i64 {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    runtime.block_on(async {
        let client = server().connect().await.expect("connect to the test server");
        client.query_one(sql, &[&table]).await.expect(sql).get(0)
    })
}

fn text(sql: &str, table: &str) -> String {
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    runtime.block_on(async {
        let client = server().connect().await.expect("connect to the test server");
        client.query_one(sql, &[&table]).await.expect(sql).get(0)
    })
}

/// Nothing of the audit on `table` is left: no table, no holder process, no session.
fn assert_cleaned_up(table: &str) {
    assert_eq!(
        query("SELECT count(*) FROM pg_class WHERE relname LIKE $1 || '%'", table),
        0,
        "the audit's tables are dropped"
    );
    let holders = std::fs::read_dir("/proc")
        .expect("/proc")
        .filter_map(|entry| std::fs::read(entry.ok()?.path().join("cmdline")).ok())
        .filter(|cmdline| String::from_utf8_lossy(cmdline).contains(table))
        .count();
    assert_eq!(holders, 0, "no holder process of {table} is left");
    // A backend ends a moment after its client: bounded wait.
    let deadline = Instant::now() + Duration::from_secs(10);
    let sql = "SELECT count(*) FROM pg_stat_activity WHERE query LIKE '%' || $1 || '%' \
               AND pid <> pg_backend_pid()";
    while query(sql, table) > 0 {
        let left = "SELECT coalesce(string_agg(application_name || ' ' || state || ': ' || \
                    left(query, 80), '; '), '') FROM pg_stat_activity WHERE query LIKE '%' || \
                    $1 || '%' AND pid <> pg_backend_pid()";
        assert!(Instant::now() < deadline, "sessions of {table} are left: {}", text(left, table));
        thread::sleep(Duration::from_millis(100));
    }
}

fn violations(report: &Value) -> Vec<String> {
    report["violations"]
        .as_array()
        .expect("violations")
        .iter()
        .map(|v| format!("{}: {}", v["kind"].as_str().unwrap(), v["detail"].as_str().unwrap()))
        .collect()
}

/// The clean run's checks: no violation, the lease moved, writes were checked, every fault kind
/// was injected and recovered from, and nothing is left behind.
fn assert_clean(code: Option<i32>, report: &Value, stderr: &str) {
    assert_clean_with(code, report, stderr, &["stop", "kill", "term", "backend", "cut"]);
}

/// [`assert_clean`], with only the fault kinds `covered` required to be injected.
fn assert_clean_with(code: Option<i32>, report: &Value, stderr: &str, covered: &[&str]) {
    assert_eq!(violations(report), Vec::<String>::new(), "{report}");
    assert_eq!(report["coverage"]["ok"], true, "{report}");
    assert_eq!(code, Some(0), "{stderr}");
    assert!(report["acquisitions"].as_u64().unwrap() >= 2, "{report}");
    assert!(report["writes_acknowledged"].as_u64().unwrap() >= 100, "{report}");
    let faults = report["faults"].as_object().expect("faults");
    for kind in covered {
        let fault = &faults[*kind];
        assert!(fault["injected"].as_u64().unwrap() >= 1, "{kind}: {report}");
        assert_eq!(fault["covered"], true, "{kind}: {report}");
    }
    assert!(report["snapshots"].as_u64().unwrap() >= 100, "{report}");
    assert_cleaned_up(report["table"].as_str().unwrap());
}

/// A run too short for its fault kinds is refused before anything runs (exit 2): a mistyped
/// `--duration` must not pass a CI job. Nothing is created.
#[test]
fn an_audit_too_short_to_exercise_anything_is_refused() {
    for duration in ["0", "0s", "5s"] {
        let (code, stdout, stderr) =
            Auditor::start(&server().url(), &["--duration", duration, "--ttl", "2"])
                .finish(Duration::from_secs(30));
        assert_eq!(code, Some(2), "--duration {duration}: {stderr}");
        assert!(stdout.is_empty() && stderr.contains("too short"), "{stderr}");
        assert!(!stderr.contains("audit seed"), "nothing ran: {stderr}");
    }
}

#[test]
fn a_30_second_audit_reports_no_violation() {
    let args = ["--duration", "30s", "--seed", "16", "--ttl", "2", "--json"];
    let (code, report, stderr) = audit(&server().url(), &args, Duration::from_secs(120));
    assert_eq!(report["seed"], 16);
    assert!(stderr.contains("audit seed 16"), "the seed is printed first: {stderr}");
    assert_clean(code, &report, &stderr);
}

#[test]
fn a_30_second_audit_through_pgbouncer_in_session_mode_reports_no_violation() {
    let (_bouncer, url) = pgbouncer(PoolMode::Session);
    let args = ["--duration", "30s", "--seed", "17", "--ttl", "2", "--json"];
    let (code, report, stderr) = audit(&url, &args, Duration::from_secs(120));
    assert_clean(code, &report, &stderr);
}

/// `--pool-mode transaction` reaches the holders too: through PgBouncer in transaction mode,
/// each of them writes and hands the lease on as directly.
#[test]
fn a_30_second_audit_through_pgbouncer_in_transaction_mode_reports_no_violation() {
    let (bouncer, url) = pgbouncer(PoolMode::Transaction);
    let args = ["--duration", "30s", "--seed", "18", "--ttl", "2", "--json"];
    let auditor = Auditor::start_with(&url, &["--pool-mode", "transaction"], &args);
    let (code, stdout, stderr) = auditor.finish(Duration::from_secs(120));
    let report: Value = serde_json::from_str(&stdout)
        .unwrap_or_else(|e| panic!("a JSON report ({e}): {stdout:?}, stderr {stderr:?}"));
    // A transaction pooler keeps its server sessions, showing the last client's statement:
    // stopped first, so that only sessions the audit left count.
    drop(bouncer);
    // Server sessions are shared there, so a holder's backend cannot be told apart: that
    // fault may be skipped, as the report then says.
    let backend = &report["faults"]["backend"];
    if backend["injected"] == 0 {
        assert_eq!(backend["skipped"], true, "{report}");
        let notes = report["notes"].to_string();
        assert!(notes.contains("backend: not injected"), "{report}");
    }
    assert_clean_with(code, &report, &stderr, &["stop", "kill", "term", "cut"]);
}

/// The audit can fail: holders that write without the fence, and go on after losing the
/// lease, are caught committing an old epoch's writes after a newer epoch's.
#[test]
fn holders_writing_without_the_fence_fail_the_audit() {
    let args = ["--duration", "12s", "--seed", "3", "--ttl", "2", "--faults", "stop", "--json"];
    let (code, report, stderr) =
        audit(&server().url(), &[&args[..], &["--unfenced"]].concat(), Duration::from_secs(90));
    let found = violations(&report);
    assert!(found.iter().any(|v| v.starts_with("late_write: ")), "{report}");
    assert_eq!(code, Some(7), "{stderr}");
    assert!(stderr.contains("violation(s) (seed 3)"), "{stderr}");
    assert_cleaned_up(report["table"].as_str().unwrap());
}

/// Starts an audit and returns once its holders write: the auditor, the rest of its stderr
/// and its table.
fn audit_writing(args: &[&str]) -> (Auditor, BufReader<std::process::ChildStderr>, String) {
    let mut auditor = Auditor::start(&server().url(), args);
    // The first line names the table: `pgfence: audit seed N, table T, ...`.
    let mut stderr = BufReader::new(auditor.child.stderr.take().expect("stderr"));
    let mut first = String::new();
    stderr.read_line(&mut first).expect("the first stderr line");
    let table = first
        .split("table ")
        .nth(1)
        .and_then(|rest| rest.split(',').next())
        .unwrap_or_else(|| panic!("a table name in {first:?}"))
        .to_owned();
    // A holder's session, not the auditor's: its setup may still be creating the table.
    let deadline = Instant::now() + Duration::from_secs(60);
    let sql = "SELECT count(*) FROM pg_stat_activity WHERE query LIKE '%' || $1 || '%' \
               AND application_name LIKE 'pgfence-audit %'";
    while query(sql, &table) == 0 {
        assert!(Instant::now() < deadline, "the holders of {table} never wrote");
        thread::sleep(Duration::from_millis(100));
    }
    (auditor, stderr, table)
}

#[test]
fn an_interrupted_audit_leaves_nothing_behind() {
    let (auditor, mut stderr, table) =
        audit_writing(&["--duration", "5m", "--ttl", "2", "--holders", "2"]);
    thread::sleep(Duration::from_secs(2));
    let pid = auditor.child.id().to_string();
    let killed = Command::new("kill").args(["-INT", &pid]).status().expect("kill");
    assert!(killed.success());
    let mut rest = String::new();
    let _ = stderr.read_to_string(&mut rest);
    let (code, _, _) = auditor.finish(Duration::from_secs(60));
    assert_eq!(code, Some(1), "{rest}");
    assert!(rest.contains("interrupted"), "{rest}");
    assert_cleaned_up(&table);
}

/// An auditor killed outright cleans nothing up. Its holders still stop: their stdin closes.
#[test]
fn a_killed_auditor_leaves_no_writer_behind() {
    let (mut auditor, _stderr, table) =
        audit_writing(&["--duration", "5m", "--ttl", "2", "--holders", "2"]);
    auditor.child.kill().expect("SIGKILL the auditor");
    let _ = auditor.child.wait();
    let deadline = Instant::now() + Duration::from_secs(30);
    let holders = || {
        std::fs::read_dir("/proc")
            .expect("/proc")
            .filter_map(|entry| std::fs::read(entry.ok()?.path().join("cmdline")).ok())
            .filter(|cmdline| String::from_utf8_lossy(cmdline).contains(&table))
            .count()
    };
    while holders() > 0 {
        assert!(Instant::now() < deadline, "holders of {table} outlived their auditor");
        thread::sleep(Duration::from_millis(100));
    }
    // What the auditor would have dropped: the test's to drop.
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    runtime.block_on(async {
        let client = server().connect().await.expect("connect to the test server");
        let drop = format!(
            "DROP TABLE \"{table}\", \"{table}_lease\", \"{table}_schema_version\", \
             \"{table}_crash_marker\""
        );
        client.batch_execute(&drop).await.expect("the audit's tables were left");
    });
    drop(runtime); // Closes the connection that dropped them.
    assert_cleaned_up(&table);
}

/// A panic in the auditor still ends its holders and drops its table.
#[test]
fn a_panicking_audit_leaves_nothing_behind() {
    let args = ["--duration", "5m", "--ttl", "2", "--holders", "2", "--panic-after", "6"];
    let (code, stdout, stderr) =
        Auditor::start(&server().url(), &args).finish(Duration::from_secs(90));
    assert_eq!(code, Some(1), "{stderr}");
    assert!(stdout.is_empty(), "no report: {stdout}");
    assert!(stderr.contains("the deliberate panic"), "{stderr}");
    assert!(stderr.contains("pgfence: the audit failed"), "{stderr}");
    let table = stderr
        .split("table ")
        .nth(1)
        .and_then(|rest| rest.split(',').next())
        .unwrap_or_else(|| panic!("a table name in {stderr:?}"))
        .to_owned();
    assert_cleaned_up(&table);
}
