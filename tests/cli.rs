//! The `pgfence` binary as users deploy it: several real processes sharing one database.
//!
//! Every process is spawned through [`Guard`], which kills (after a `SIGCONT`, in case the test
//! stopped it) and reaps it when the test ends, pass or fail. Signals go through `kill(1)`:
//! the crate forbids `unsafe` and has no libc binding. Time limits are generous guards against
//! hangs; the only timing assertions are the issue's own (takeover within TTL + 1 s of a
//! crash, graceful handoff under TTL/2), with TTLs chosen so a loaded 2-core machine cannot
//! fail them spuriously.
#![cfg(feature = "cli")]

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use pgfence_testing::{
    CERT_ROLE, PASSWORD_ROLE, PASSWORD_ROLE_PASSWORD, TestCluster, TestServer, unique_name,
};
use serde_json::Value;
use tokio_postgres::NoTls;

const BIN: &str = env!("CARGO_BIN_EXE_pgfence");

/// Bound on any single wait: only a hang should ever reach it.
const GUARD: Duration = Duration::from_secs(60);

fn server() -> &'static TestServer {
    TestServer::shared()
        .expect("a PostgreSQL server for the tests (DATABASE_URL or local binaries)")
}

// ---------------------------------------------------------------------------------------------
// Processes
// ---------------------------------------------------------------------------------------------

/// A spawned `pgfence`, killed and reaped on drop however the test ends.
struct Guard {
    name: String,
    child: Child,
    readers: Vec<JoinHandle<()>>,
}

impl Guard {
    /// Spawns `pgfence --database-url URL --table TABLE ARGS`, without the test's
    /// `DATABASE_URL`, with the variables `env` set.
    fn spawn(
        name: &str,
        url: &str,
        table: &str,
        args: &[&str],
        stdin: Option<Vec<u8>>,
        env: &[(&str, &str)],
    ) -> Guard {
        let mut command = Command::new(BIN);
        if !url.is_empty() {
            command.args(["--database-url", url]);
        }
        for variable in pgfence::env::VARIABLES {
            command.env_remove(variable);
        }
        command
            .args(["--table", table])
            .args(args)
            .env_remove("DATABASE_URL")
            .envs(env.iter().copied())
            .stdin(if stdin.is_some() { Stdio::piped() } else { Stdio::null() })
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = command.spawn().unwrap_or_else(|e| panic!("spawn {name}: {e}"));
        let mut readers = Vec::new();
        if let (Some(bytes), Some(mut pipe)) = (stdin, child.stdin.take()) {
            // A thread, so a child that does not read cannot block the test.
            readers.push(thread::spawn(move || {
                let _ = pipe.write_all(&bytes); // Closing the pipe is the end of input.
            }));
        }
        Guard { name: name.to_owned(), child, readers }
    }

    fn pid(&self) -> String {
        self.child.id().to_string()
    }

    /// Sends `signal` with kill(1). The child is not reaped before `wait_exit` or drop, so its
    /// pid cannot have been reused.
    fn signal(&self, signal: &str) {
        let status = Command::new("kill")
            .arg(format!("-{signal}"))
            .arg(self.pid())
            .status()
            .expect("run kill");
        assert!(status.success(), "kill -{signal} {} ({}): {status}", self.pid(), self.name);
    }

    /// Waits for the exit; `None` after `limit`.
    fn wait_exit(&mut self, limit: Duration) -> Option<ExitStatus> {
        let deadline = Instant::now() + limit;
        loop {
            if let Some(status) = self.child.try_wait().expect("try_wait") {
                for reader in self.readers.drain(..) {
                    let _ = reader.join(); // Output is complete once the pipes close.
                }
                return Some(status);
            }
            if Instant::now() >= deadline {
                return None;
            }
            thread::sleep(Duration::from_millis(10));
        }
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            // Still ours and unreaped: a stopped process is continued first, then killed.
            let _ = Command::new("kill").arg("-CONT").arg(self.pid()).status();
            let _ = self.child.kill();
        }
        let _ = self.child.wait();
        for reader in self.readers.drain(..) {
            let _ = reader.join();
        }
    }
}

/// The outcome of a one-shot command.
#[derive(Debug)]
struct Ran {
    code: Option<i32>,
    stdout: Vec<u8>,
    stderr: String,
}

impl Ran {
    fn stdout(&self) -> String {
        String::from_utf8_lossy(&self.stdout).into_owned()
    }

    /// Exit `code`, and on failure exactly one `pgfence: ...` line on stderr, or under
    /// `--json` one JSON object with the error and that code.
    fn expect(&self, code: i32, what: &str) -> &Ran {
        assert_eq!(self.code, Some(code), "{what}: {self:?}");
        if code != 0 {
            let lines: Vec<&str> = self.stderr.lines().collect();
            let json = |line: &str| {
                serde_json::from_str::<Value>(line).is_ok_and(|error| {
                    error["error"].is_string() && error["exit_code"].as_i64() == Some(code.into())
                })
            };
            assert!(
                lines.len() == 1 && (lines[0].starts_with("pgfence: ") || json(lines[0])),
                "{what}: one error line expected: {:?}",
                self.stderr
            );
            assert!(!self.stderr.contains("panicked"), "{what}: {:?}", self.stderr);
        }
        self
    }
}

/// Runs a one-shot command to its end (killed after [`GUARD`]).
fn run(url: &str, table: &str, args: &[&str], stdin: Option<&[u8]>) -> Ran {
    run_env(url, table, args, stdin, &[])
}

/// [`run`] with the environment variables `env` set.
fn run_env(
    url: &str,
    table: &str,
    args: &[&str],
    stdin: Option<&[u8]>,
    env: &[(&str, &str)],
) -> Ran {
    let mut guard = Guard::spawn(args[0], url, table, args, stdin.map(<[u8]>::to_vec), env);
    let mut out = guard.child.stdout.take().expect("stdout");
    let mut err = guard.child.stderr.take().expect("stderr");
    let stdout = thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = out.read_to_end(&mut buf);
        buf
    });
    let stderr = thread::spawn(move || {
        let mut buf = String::new();
        let _ = err.read_to_string(&mut buf);
        buf
    });
    let status = guard.wait_exit(GUARD).unwrap_or_else(|| panic!("pgfence {args:?} hung"));
    Ran {
        code: status.code(),
        stdout: stdout.join().expect("stdout reader"),
        stderr: stderr.join().expect("stderr reader"),
    }
}

/// One stdout line of `hold`: its JSON and when the test read it.
#[derive(Debug, Clone)]
struct Event {
    at: Instant,
    json: Value,
}

impl Event {
    fn kind(&self) -> &str {
        self.json["event"].as_str().unwrap_or("")
    }

    fn int(&self, field: &str) -> i64 {
        self.json[field].as_i64().unwrap_or_else(|| panic!("{field} in {}", self.json))
    }
}

#[derive(Debug, Default)]
struct Stream {
    events: Vec<Event>,
    closed: bool,
}

/// A running `pgfence hold`, its stdout read line by line on a thread as it comes.
struct Holder {
    guard: Guard,
    stream: Arc<(Mutex<Stream>, Condvar)>,
    stderr: Arc<Mutex<String>>,
}

impl Holder {
    fn spawn(name: &str, url: &str, table: &str, args: &[&str]) -> Holder {
        let args: Vec<&str> = ["hold"].iter().chain(args).copied().collect();
        let mut guard = Guard::spawn(name, url, table, &args, None, &[]);
        let stream = Arc::new((Mutex::new(Stream::default()), Condvar::new()));
        let stderr = Arc::new(Mutex::new(String::new()));
        let out = guard.child.stdout.take().expect("stdout");
        let err = guard.child.stderr.take().expect("stderr");
        let s = Arc::clone(&stream);
        guard.readers.push(thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                let json = serde_json::from_str(&line).unwrap_or(Value::String(line));
                s.0.lock().unwrap().events.push(Event { at: Instant::now(), json });
                s.1.notify_all();
            }
            s.0.lock().unwrap().closed = true;
            s.1.notify_all();
        }));
        let e = Arc::clone(&stderr);
        guard.readers.push(thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                let mut e = e.lock().unwrap();
                e.push_str(&line);
                e.push('\n');
            }
        }));
        Holder { guard, stream, stderr }
    }

    fn pid(&self) -> String {
        self.guard.pid()
    }

    fn events(&self) -> Vec<Event> {
        self.stream.0.lock().unwrap().events.clone()
    }

    fn stderr(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }

    /// The first event at index `from` or later that is `kind` and satisfies `check`, with its
    /// index. Fails, showing everything the process printed, if the process ends first or after
    /// [`GUARD`].
    fn wait_for(&self, from: usize, kind: &str, check: impl Fn(&Event) -> bool) -> (usize, Event) {
        let deadline = Instant::now() + GUARD;
        let (lock, changed) = &*self.stream;
        let mut stream = lock.lock().unwrap();
        loop {
            let found = stream
                .events
                .iter()
                .enumerate()
                .skip(from)
                .find(|(_, e)| e.kind() == kind && check(e));
            if let Some((i, e)) = found {
                return (i, e.clone());
            }
            let now = Instant::now();
            if stream.closed || now >= deadline {
                let printed: Vec<String> =
                    stream.events.iter().map(|e| e.json.to_string()).collect();
                drop(stream);
                panic!(
                    "{}: no {kind:?} event from #{from} ({}); stdout: {printed:#?}; stderr: {}",
                    self.guard.name,
                    if now >= deadline { "timed out" } else { "stdout closed" },
                    self.stderr()
                );
            }
            stream = changed.wait_timeout(stream, deadline - now).unwrap().0;
        }
    }

    fn acquired(&self) -> Event {
        self.wait_for(0, "acquired", |_| true).1
    }

    /// Waits for `n` more `write` events after index `from`; returns the index of the last.
    fn writes(&self, from: usize, n: usize) -> usize {
        let mut at = from;
        for _ in 0..n {
            at = self.wait_for(at + 1, "write", |_| true).0;
        }
        at
    }

    fn exit_code(&mut self) -> Option<i32> {
        let status = self.guard.wait_exit(GUARD).unwrap_or_else(|| {
            panic!("{} did not exit; stderr: {}", self.guard.name, self.stderr())
        });
        status.code()
    }

    /// `signal` (INT or TERM), then the `released` event and exit 0: a clean, releasing
    /// shutdown.
    fn stop(mut self, signal: &str, epoch: i64) {
        self.guard.signal(signal);
        let code = self.exit_code();
        let events = self.events();
        let mut last = events.last().map(|e| e.json.clone()).unwrap_or_default();
        assert_eq!(code, Some(0), "{}: {events:?}; stderr: {}", self.guard.name, self.stderr());
        let at = last.as_object_mut().and_then(|event| event.remove("at"));
        assert!(at.as_ref().and_then(Value::as_str).is_some_and(is_timestamp), "{events:?}");
        assert_eq!(last, serde_json::json!({ "event": "released", "epoch": epoch }));
    }
}

/// An RFC 3339 UTC time with milliseconds, as `hold` stamps its events: `2026-12-01T23:57:04.123Z`.
fn is_timestamp(text: &str) -> bool {
    let shape = text.bytes().enumerate().all(|(i, c)| match i {
        4 | 7 => c == b'-',
        10 => c == b'T',
        13 | 16 => c == b':',
        19 => c == b'.',
        23 => c == b'Z',
        _ => c.is_ascii_digit(),
    });
    text.len() == 24 && shape
}

// ---------------------------------------------------------------------------------------------
// Database probes
// ---------------------------------------------------------------------------------------------

/// Runs `sql` (which begins a transaction and locks a row) on a session of its own and leaves
/// the transaction open: end it through the returned client, on `runtime`.
fn open_transaction(runtime: &tokio::runtime::Runtime, sql: &str) -> tokio_postgres::Client {
    runtime.block_on(async {
        let (client, connection) = server().config().connect(NoTls).await.expect("connect");
        tokio::spawn(connection);
        client.batch_execute(sql).await.expect("lock a row");
        client
    })
}

/// A query for the sessions running a statement like `pattern` that wait for a lock.
fn lock_wait_of(pattern: &str) -> String {
    format!(
        "SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE '{pattern}'"
    )
}

/// Polls `sql` until it returns rows (`rows`), or none; fails after [`GUARD`].
fn wait_for_rows(sql: &str, rows: bool, what: &str) {
    let deadline = Instant::now() + GUARD;
    while query(&server().config(), sql).is_empty() == rows {
        assert!(Instant::now() < deadline, "timed out: {what}");
        thread::sleep(Duration::from_millis(20));
    }
}

/// Runs one query on `config` (a fresh connection each time; tests are synchronous).
fn query(config: &tokio_postgres::Config, sql: &str) -> Vec<tokio_postgres::Row> {
    let runtime =
        tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    runtime.block_on(async {
        let (client, connection) = config.connect(NoTls).await.expect("probe connection");
        let connection = tokio::spawn(connection);
        let rows = client.query(sql, &[]).await.expect(sql);
        drop(client);
        let _ = connection.await;
        rows
    })
}

/// Every row of the KV table as `(key, epoch column, value)`, sorted by key.
fn rows(config: &tokio_postgres::Config, table: &str) -> Vec<(String, i64, Value)> {
    query(config, &format!("SELECT key, epoch, value FROM \"{table}\" ORDER BY key"))
        .iter()
        .map(|row| {
            let value: Vec<u8> = row.get(2);
            (row.get(0), row.get(1), serde_json::from_slice(&value).expect("a counter value"))
        })
        .collect()
}

fn counter_row(config: &tokio_postgres::Config, table: &str, key: &str) -> (i64, Value) {
    let all = rows(config, table);
    let (_, epoch, value) = all.into_iter().find(|(k, _, _)| k == key).expect("counter row");
    (epoch, value)
}

// ---------------------------------------------------------------------------------------------
// The six failover scenarios of issue 3
// ---------------------------------------------------------------------------------------------

/// Scenario 1: A holds; B's `hold` without `--wait` exits 3 naming A, and so does a `put`.
/// (A runs without `--ttl`: its lease is taken for the default 30 s.)
#[test]
fn contention_exits_3_and_names_the_holder() {
    let (url, table) = (server().url(), unique_name("cli_contend"));
    let a = Holder::spawn("A", &url, &table, &[]);
    let epoch = a.acquired().int("epoch");
    let status = run(&url, &table, &["status", "--json"], None);
    let status: Value = serde_json::from_slice(&status.expect(0, "status").stdout).unwrap();
    let left = status["expires_in_ms"].as_u64().unwrap_or(0);
    assert!(left > 15_000 && left <= 30_000, "a lease of the default 30 s: {status}");

    let b = run(&url, &table, &["hold"], None);
    b.expect(3, "B hold");
    assert!(b.stderr.contains("held by") && b.stderr.contains(&format!(" {}@", a.pid())), "{b:?}");
    let put = run(&url, &table, &["put", "n", "s", "k", "v"], None);
    put.expect(3, "put while held");
    assert!(put.stderr.contains(&format!(" {}@", a.pid())), "{put:?}");

    // A standby stopped while it waits leaves quietly, never having held the lease.
    let mut w = Holder::spawn("W", &url, &table, &["--ttl", "30", "--wait"]);
    w.wait_for(0, "waiting", |e| e.int("epoch") == epoch);
    w.guard.signal("TERM");
    assert_eq!(w.exit_code(), Some(0), "{}", w.stderr());
    assert!(w.events().iter().all(|e| e.kind() == "waiting"), "{:?}", w.events());

    a.stop("INT", epoch);
    run(&url, &table, &["put", "n", "s", "k", "v"], None).expect(0, "put once released");
}

/// Scenario 2: A holds and writes every 20 ms; B stands by; `kill -9` A: B acquires within
/// TTL + 1 s of the kill, with epoch + 1, and goes on counting from the store.
#[test]
fn crash_takeover_within_ttl() {
    const TTL: Duration = Duration::from_secs(6);
    let (url, table) = (server().url(), unique_name("cli_crash"));
    let args = ["--ttl", "6", "--write-every", "20", "--counter-key", "counter"];
    let mut a = Holder::spawn("A", &url, &table, &args);
    let a_epoch = a.acquired().int("epoch");
    a.writes(0, 5);
    let b = Holder::spawn("B", &url, &table, &[&["--wait"][..], &args[..]].concat());
    b.wait_for(0, "waiting", |e| e.int("epoch") == a_epoch);

    let killed = Instant::now();
    a.guard.signal("KILL");
    assert_eq!(a.exit_code(), None, "killed by a signal");
    let acquired = b.acquired();
    let took = acquired.at - killed;
    println!("crash takeover: B acquired {took:?} after kill -9 of A (TTL {TTL:?})");
    assert!(took < TTL + Duration::from_secs(1), "takeover took {took:?}");
    let b_epoch = acquired.int("epoch");
    assert_eq!(b_epoch, a_epoch + 1);

    // B rebuilt the counter from the store: it never goes back, and the row carries B's epoch.
    let a_last =
        a.events().iter().rev().find(|e| e.kind() == "write").expect("A wrote").int("counter");
    let (i, first) = b.wait_for(0, "write", |_| true);
    assert!(first.int("counter") > a_last, "{first:?} after A's {a_last}");
    b.writes(i, 3);
    let (epoch, value) = counter_row(&server().config(), &table, "counter");
    assert_eq!((epoch, value["epoch"].as_i64()), (b_epoch, Some(b_epoch)));
    b.stop("TERM", b_epoch);
}

/// Scenario 3: SIGTERM to the holder: the standby acquires well before the TTL could have expired.
#[test]
fn graceful_handoff_is_fast() {
    // The standby's waiting event comes from a look at the lease just taken: without the
    // release's NOTIFY it would sleep for the rest of that lease, at least 2/3 of the TTL.
    const TTL: Duration = Duration::from_secs(10);
    let (url, table) = (server().url(), unique_name("cli_handoff"));
    let b = Holder::spawn("B", &url, &table, &["--ttl", "10"]);
    let b_epoch = b.acquired().int("epoch");
    let c = Holder::spawn("C", &url, &table, &["--ttl", "10", "--wait"]);
    c.wait_for(0, "waiting", |e| e.int("epoch") == b_epoch);

    let terminated = Instant::now();
    b.stop("TERM", b_epoch);
    let acquired = c.acquired();
    let handoff = acquired.at - terminated;
    println!("graceful handoff: C acquired {handoff:?} after SIGTERM to B (TTL {TTL:?})");
    assert!(handoff < TTL / 2, "handoff took {handoff:?}");
    assert_eq!(acquired.int("epoch"), b_epoch + 1);
    c.stop("TERM", b_epoch + 1);
}

/// Scenario 4: C holds and writes; SIGSTOP C for longer than the TTL; D acquires and writes;
/// SIGCONT C: C reports the loss and exits 5, and no row of C's epoch changed after D's
/// acquisition.
#[test]
fn stale_owner_is_fenced_and_exits_5() {
    const TTL: Duration = Duration::from_secs(6);
    let (url, table, db) = (server().url(), unique_name("cli_stale"), server().config());
    let mut c = Holder::spawn(
        "C",
        &url,
        &table,
        &["--ttl", "6", "--write-every", "20", "--counter-key", "stale/c/counter"],
    );
    let c_epoch = c.acquired().int("epoch");
    c.writes(0, 5);
    let d = Holder::spawn(
        "D",
        &url,
        &table,
        &["--ttl", "6", "--wait", "--write-every", "20", "--counter-key", "stale/d/counter"],
    );
    d.wait_for(0, "waiting", |e| e.int("epoch") == c_epoch);

    let stopped = Instant::now();
    c.guard.signal("STOP");
    let d_epoch = d.acquired().int("epoch");
    assert_eq!(d_epoch, c_epoch + 1);
    let (i, _) = d.wait_for(0, "write", |_| true);
    d.writes(i, 3);
    // Everything C committed: its own key, with its epoch in the column and in the value.
    let before = rows(&db, &table);
    let of_c: Vec<_> = before.iter().filter(|(_, epoch, _)| *epoch == c_epoch).cloned().collect();
    assert_eq!(of_c.len(), 1, "{before:?}");
    assert_eq!(of_c[0].2["epoch"].as_i64(), Some(c_epoch));
    if let Some(rest) = (TTL + Duration::from_millis(500)).checked_sub(stopped.elapsed()) {
        thread::sleep(rest); // Stopped for longer than the TTL, whatever D's timing.
    }

    let printed_before_cont = c.events().len();
    c.guard.signal("CONT");
    assert_eq!(c.exit_code(), Some(5), "C: {:?}; stderr: {}", c.events(), c.stderr());
    let (at, lost) = c.wait_for(0, "lost", |_| true);
    assert_eq!(lost.int("epoch"), c_epoch);
    assert_eq!(at, c.events().len() - 1, "lost is C's last word: {:?}", c.events());
    assert!(c.stderr().contains("lease lost"), "{}", c.stderr());
    let after_cont: Vec<String> =
        c.events()[printed_before_cont..].iter().map(|e| e.json.to_string()).collect();
    println!("stale owner: C stopped {:?}, then printed {after_cont:?}", stopped.elapsed());

    let after = rows(&db, &table);
    let of_c_after: Vec<_> =
        after.iter().filter(|(_, epoch, _)| *epoch == c_epoch).cloned().collect();
    assert_eq!(of_c_after, of_c, "a write of C's epoch committed after D took over");
    assert!(after.iter().all(|(_, epoch, _)| *epoch <= d_epoch), "{after:?}");
    // D never noticed anything and goes on writing.
    let (j, _) = d.wait_for(0, "write", |_| true);
    d.writes(j, 3);
    assert!(d.events().iter().all(|e| e.kind() != "lost"), "{:?}", d.events());
    d.stop("TERM", d_epoch);
}

/// `--tls-root-cert FILE`, against a cluster that takes TCP connections over TLS only: trusting
/// the cluster's certificate authority, the CLI writes and reads; without the option its plain
/// connection is rejected by the server (exit 1); a file with no certificate in it is a
/// configuration error (exit 2). A role that the server lets in by client certificate only
/// writes and reads with `--tls-cert` and `--tls-key`, is refused without them (exit 1), and
/// `--tls-cert` alone, or without `--tls-root-cert`, is a usage error (exit 2).
#[test]
fn tls_options_connect_over_verified_tls() {
    let cluster = TestCluster::start_tls().expect("a private cluster with TLS");
    let (url, table) = (cluster.url(), unique_name("cli_tls"));
    let dir = std::env::temp_dir().join(unique_name("pgfence_cli_tls"));
    std::fs::create_dir(&dir).unwrap();
    let (ca, empty) = (dir.join("ca.pem"), dir.join("empty.pem"));
    std::fs::write(&ca, cluster.tls_root_pem().expect("a TLS cluster")).unwrap();
    std::fs::write(&empty, "").unwrap();
    let (ca, empty) = (ca.to_str().unwrap(), empty.to_str().unwrap());

    run(&url, &table, &["put", "--tls-root-cert", ca, "ns", "sub", "k", "v"], None)
        .expect(0, "put over TLS");
    let read = run(&url, &table, &["get", "--tls-root-cert", ca, "ns", "sub", "k"], None);
    assert_eq!(read.expect(0, "get over TLS").stdout(), "v");
    let plain = run(&url, &table, &["get", "ns", "sub", "k"], None);
    let unencrypted = unencrypted_wording(&cluster);
    let refused = plain.expect(1, "get without TLS").stderr.contains("pg_hba.conf rejects");
    assert!(refused && plain.stderr.contains(unencrypted), "{unencrypted}: {plain:?}");
    let no_roots = run(&url, &table, &["status", "--tls-root-cert", empty], None);
    assert!(no_roots.expect(2, "no certificate").stderr.contains("no certificate"), "{no_roots:?}");

    // The certificate role, in a database of its own that the first put creates when asked.
    let cert_url =
        format!("postgres://{CERT_ROLE}@127.0.0.1:{}/{}", cluster.port(), unique_name("cli_cert"));
    let (cert, key) = (dir.join("client.pem"), dir.join("client.key"));
    let (cert_pem, key_pem) = cluster.client_cert_pem().expect("a TLS cluster");
    std::fs::write(&cert, cert_pem).unwrap();
    std::fs::write(&key, key_pem).unwrap();
    let (cert, key) = (cert.to_str().unwrap(), key.to_str().unwrap());
    let with_cert = |args: &[&str]| {
        let args = [&["--tls-root-cert", ca, "--tls-cert", cert, "--tls-key", key], args].concat();
        run(&cert_url, &table, &args, None)
    };
    with_cert(&["put", "--create-database", "ns", "sub", "k", "by certificate"])
        .expect(0, "put with a client certificate");
    let read = with_cert(&["get", "ns", "sub", "k"]);
    assert_eq!(read.expect(0, "get with a client certificate").stdout(), "by certificate");
    let refused = run(&cert_url, &table, &["get", "--tls-root-cert", ca, "ns", "sub", "k"], None);
    assert!(
        refused.expect(1, "no client certificate").stderr.contains("certificate"),
        "{refused:?}"
    );
    for args in [
        &["get", "--tls-root-cert", ca, "--tls-cert", cert, "ns", "sub", "k"][..],
        &["get", "--tls-cert", cert, "--tls-key", key, "ns", "sub", "k"][..],
    ] {
        run(&cert_url, &table, args, None).expect(2, "an incomplete set of TLS options");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A second SIGINT/SIGTERM while `hold` shuts down (here its last write waits for a row lock
/// another session holds, so the shutdown cannot finish) exits at once with 1, without
/// releasing: the lease stays held, to expire by its TTL.
#[test]
fn second_signal_exits_at_once_without_releasing() {
    let (url, table) = (server().url(), unique_name("cli_twice"));
    let args = ["--ttl", "30", "--write-every", "20", "--counter-key", "counter"];
    let mut a = Holder::spawn("A", &url, &table, &args);
    let epoch = a.acquired().int("epoch");
    a.writes(0, 2);

    // A transaction of its own holds the counter's row, so A's next write waits for it.
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    let lock = format!("BEGIN; SELECT 1 FROM \"{table}\" WHERE key = 'counter' FOR UPDATE");
    let blocker = open_transaction(&runtime, &lock);
    let waiting = lock_wait_of(&format!("%INSERT INTO \"{table}\"%"));
    wait_for_rows(&waiting, true, "A's write waiting for the row lock");

    a.guard.signal("INT");
    // The first signal starts the shutdown, which waits for that write.
    thread::sleep(Duration::from_secs(1));
    assert!(a.guard.child.try_wait().unwrap().is_none(), "A waits for its write");
    a.guard.signal("INT");
    assert_eq!(a.exit_code(), Some(1), "{}", a.stderr());
    assert!(a.stderr().contains("signalled again"), "{}", a.stderr());
    assert!(a.events().iter().all(|e| e.kind() != "released"), "{:?}", a.events());
    let status = run(&url, &table, &["status", "--json"], None);
    let status: Value = serde_json::from_slice(&status.expect(0, "status").stdout).unwrap();
    assert_eq!((status["state"].as_str(), status["epoch"].as_i64()), (Some("held"), Some(epoch)));
    runtime.block_on(blocker.batch_execute("ROLLBACK")).expect("let the row go");
}

/// SIGTERM while `hold` waits at the fence to take a free lease (a session of the old holder's
/// still holds the lease row, as a write in flight does) ends it at once with 0, before it
/// ever held the lease, with `--wait` and without, and leaves nothing waiting on the server:
/// its setup is cancelled there before the process exits, so it never takes the lease later.
#[test]
fn signal_while_waiting_at_the_fence_exits_and_leaves_nothing_behind() {
    let (url, table) = (server().url(), unique_name("cli_fence"));
    run(&url, &table, &["put", "n", "s", "k", "v"], None).expect(0, "create the table");
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    let lock = format!("BEGIN; SELECT 1 FROM \"{table}_lease\" WHERE id = 1 FOR KEY SHARE");
    let blocker = open_transaction(&runtime, &lock);
    let at_the_fence = lock_wait_of(&format!("%INSERT INTO \"{table}_lease\"%"));
    for (name, args) in [("plain", &["--ttl", "30"][..]), ("standby", &["--ttl", "30", "--wait"])] {
        let mut h = Holder::spawn(name, &url, &table, args);
        wait_for_rows(&at_the_fence, true, &format!("{name} waiting at the fence"));
        h.guard.signal("TERM");
        assert_eq!(h.exit_code(), Some(0), "{name}: {}", h.stderr());
        assert!(h.events().iter().all(|e| e.kind() != "acquired"), "{name}: {:?}", h.events());
        // The cancel request was sent before the exit; the server acts on it at once.
        wait_for_rows(&at_the_fence, false, &format!("{name}'s setup gone from the fence"));
    }
    runtime.block_on(blocker.batch_execute("COMMIT")).expect("let the lease row go");
    let status = run(&url, &table, &["status", "--json"], None);
    let status: Value = serde_json::from_slice(&status.expect(0, "status").stdout).unwrap();
    assert_eq!(status["epoch"].as_i64(), Some(1), "nobody took the lease after put: {status}");
}

/// Scenario 5: a restart of the database (pg_ctl restart) shorter than the local deadline while
/// A holds: A keeps its lease and its epoch, and keeps writing.
#[test]
fn database_restart_within_the_deadline_keeps_the_lease() {
    // TTL 30 s: renewal every 10 s, local deadline 20 s, far above a restart even on a loaded
    // machine.
    const TTL: Duration = Duration::from_secs(30);
    const DEADLINE: Duration = Duration::from_secs(20);
    let cluster = TestCluster::start().expect("a private cluster to restart");
    let (url, table) = (cluster.url(), unique_name("cli_restart"));
    let mut a = Holder::spawn(
        "A",
        &url,
        &table,
        &["--ttl", "30", "--write-every", "20", "--counter-key", "counter"],
    );
    let epoch = a.acquired().int("epoch");
    let before = a.writes(0, 5);

    let started = Instant::now();
    cluster.restart().expect("restart");
    let restarted = Instant::now();
    println!("database restart took {:?}", restarted - started);
    assert!(restarted - started < DEADLINE, "the restart must be shorter than the deadline");
    let printed = a.events().len();
    let mut last = a.writes((printed - 1).max(before), 10);

    // A renewal after the restart: the expiry lies beyond where any renewal before it could
    // have put it (expires_in + time since the restart > TTL). Renewal runs every TTL/3.
    let status = loop {
        let since = restarted.elapsed();
        let status = run(&url, &table, &["status", "--json"], None);
        let status: Value = serde_json::from_slice(&status.expect(0, "status").stdout).unwrap();
        assert_eq!(status["state"], "held", "{status}");
        assert_eq!(status["epoch"].as_i64(), Some(epoch), "{status}");
        let expires_in = Duration::from_millis(status["expires_in_ms"].as_u64().unwrap_or(0));
        if expires_in + since > TTL {
            break status;
        }
        assert!(since < GUARD, "no renewal after the restart: {status}");
        thread::sleep(Duration::from_millis(500));
    };
    let holder = status["holder"].as_str().unwrap_or("");
    assert!(holder.contains(&format!(" {}@", a.pid())), "{status}");
    last = a.writes(last, 10);

    let events = a.events();
    assert!(events.iter().all(|e| e.kind() != "lost"), "{events:?}");
    // The retries while the server was away reach a JSON reader too, not only the log.
    let retrying = events.iter().find(|e| e.kind() == "retrying").expect("a retrying event");
    assert_eq!(retrying.int("epoch"), epoch, "{events:?}");
    assert!(retrying.json["error"].as_str().is_some_and(|e| !e.is_empty()), "{events:?}");
    let writes = events[..=last].iter().filter(|e| e.kind() == "write");
    assert!(writes.clone().all(|e| e.int("epoch") == epoch), "{events:?}");
    let counters: Vec<i64> = writes.map(|e| e.int("counter")).collect();
    assert!(counters.windows(2).all(|w| w[1] == w[0] + 1), "{counters:?}");
    assert_eq!(a.guard.child.try_wait().expect("try_wait"), None, "A is still running");
    let (row_epoch, value) = counter_row(&cluster.config(), &table, "counter");
    assert_eq!((row_epoch, value["epoch"].as_i64()), (epoch, Some(epoch)));
    let stderr = a.stderr();
    if !stderr.is_empty() {
        println!("A's stderr around the restart:\n{stderr}");
    }
    a.stop("TERM", epoch);
}

/// Scenario 6: `release --force --yes` against a live holder: the holder finds the loss at its
/// next renewal (it does not write), exits 5, and a standby acquires.
#[test]
fn force_release_fences_a_live_holder() {
    let (url, table) = (server().url(), unique_name("cli_force"));
    let mut a = Holder::spawn("A", &url, &table, &["--ttl", "6"]);
    let a_epoch = a.acquired().int("epoch");
    let b = Holder::spawn("B", &url, &table, &["--ttl", "6", "--wait"]);
    b.wait_for(0, "waiting", |e| e.int("epoch") == a_epoch);

    let released = run(&url, &table, &["release", "--force", "--yes"], None);
    released.expect(0, "release --force --yes");
    let said = released.stdout();
    assert!(
        said.contains(&format!(" {}@", a.pid())) && said.contains(&format!("epoch {a_epoch}")),
        "{said}"
    );

    assert_eq!(a.exit_code(), Some(5), "A: {:?}; stderr: {}", a.events(), a.stderr());
    let (at, lost) = a.wait_for(0, "lost", |_| true);
    assert_eq!(lost.int("epoch"), a_epoch);
    assert_eq!(at, a.events().len() - 1, "lost is A's last word: {:?}", a.events());
    // Named as what it was, though B took the lease at once.
    assert_eq!(lost.json["cause"], "force_released", "{}", lost.json);
    let reason = lost.json["reason"].as_str().unwrap_or_default();
    assert!(reason.starts_with("force-released") && reason.contains("release --force"), "{reason}");
    assert!(a.stderr().contains("force-released"), "{}", a.stderr());
    let b_epoch = b.acquired().int("epoch");
    assert_eq!(b_epoch, a_epoch + 1);
    b.stop("TERM", b_epoch);
}

/// The lease changes hands while `release --force --yes` runs (between its look at the holder
/// and its release): it releases nothing, says so and names the new holder, which keeps its
/// lease. Forced deterministically: the takeover is an uncommitted update of the lease row,
/// which the release statement waits for; committed, it leaves the release no owner to match.
#[test]
fn force_release_racing_a_takeover_names_the_new_holder() {
    let (url, table) = (server().url(), unique_name("cli_forcerace"));
    let a = Holder::spawn("A", &url, &table, &[]);
    let a_epoch = a.acquired().int("epoch");
    let runtime = tokio::runtime::Runtime::new().expect("runtime");
    let (client, connection) = runtime.block_on(server().config().connect(NoTls)).expect("connect");
    runtime.spawn(connection);
    let takeover = format!(
        "BEGIN; UPDATE \"{table}_lease\" SET owner_id = gen_random_uuid(), epoch = epoch + 1,
                expires_at = clock_timestamp() + interval '1 hour',
                holder_app = 'thief', holder_pid = 4242, holder_host = 'node-b'
          WHERE id = 1"
    );
    runtime.block_on(client.batch_execute(&takeover)).expect("takeover");
    let release = thread::spawn({
        let (url, table) = (url.clone(), table.clone());
        move || run(&url, &table, &["release", "--force", "--yes"], None)
    });
    let waiting = format!(
        "SELECT 1 FROM pg_stat_activity
          WHERE wait_event_type = 'Lock' AND query LIKE '%released AS%{table}_lease%'"
    );
    let started = Instant::now();
    while query(&server().config(), &waiting).is_empty() {
        assert!(started.elapsed() < GUARD, "the release never waited for the takeover");
        thread::sleep(Duration::from_millis(20));
    }
    runtime.block_on(client.batch_execute("COMMIT")).expect("commit the takeover");
    let released = release.join().expect("release thread");
    let said = released.expect(0, "release racing a takeover").stdout();
    assert!(
        said.starts_with("released nothing")
            && said.contains("thief 4242@node-b")
            && said.contains(&format!("epoch {}", a_epoch + 1))
            && !said.contains(&format!(" {}@", a.pid())),
        "{said}"
    );
    let status = run(&url, &table, &["status"], None).expect(0, "status").stdout();
    assert!(status.starts_with("held by thief 4242@node-b"), "the new holder kept it: {status}");
}

/// An environment variable set to the empty string counts as unset, as containers often set
/// them: with the TLS variables (and `DATABASE_URL`, beside `--database-url`) empty, commands
/// connect as without them, each alone or all together. An empty path given as an option is
/// still a usage error.
#[test]
fn empty_environment_variables_count_as_unset() {
    let (url, table) = (server().url(), unique_name("cli_emptyenv"));
    let empty = [
        ("PGFENCE_TLS_ROOT_CERT", ""),
        ("PGFENCE_TLS_CERT", ""),
        ("PGFENCE_TLS_KEY", ""),
        ("DATABASE_URL", ""),
    ];
    run_env(&url, &table, &["put", "a", "b", "c", "v"], None, &empty).expect(0, "put");
    for set in empty.iter().map(std::slice::from_ref).chain([&empty[..]]) {
        let status = run_env(&url, &table, &["status"], None, set);
        let status = status.expect(0, &format!("{set:?}")).stdout();
        assert!(status.starts_with("free (last epoch 1, last holder pgfence "), "{status}");
    }
    for option in ["--tls-root-cert", "--tls-cert", "--tls-key"] {
        run(&url, &table, &["status", option, ""], None).expect(2, &format!("{option} \"\""));
    }
}

// ---------------------------------------------------------------------------------------------
// One-shot commands and exit codes
// ---------------------------------------------------------------------------------------------

#[test]
fn one_shot_commands_round_trip() {
    let (url, table) = (server().url(), unique_name("cli_oneshot"));
    let missing = run(&url, &table, &["status"], None);
    missing.expect(6, "status of a table nothing created yet");

    run(&url, &table, &["put", "app", "cfg", "greeting", "hello"], None).expect(0, "put VALUE");
    let binary = b"\x00\xffbinary\n".to_vec();
    run(&url, &table, &["put", "app", "cfg", "blob", "-"], Some(&binary)).expect(0, "put -");
    run(&url, &table, &["put", "", "", "top", "-5"], None).expect(0, "put, empty namespaces");
    assert_eq!(
        run(&url, &table, &["get", "app", "cfg", "greeting"], None).expect(0, "get").stdout,
        b"hello"
    );
    assert_eq!(
        run(&url, &table, &["get", "app", "cfg", "blob"], None).expect(0, "get").stdout,
        binary
    );
    assert_eq!(run(&url, &table, &["get", "", "", "top"], None).expect(0, "get").stdout, b"-5");
    assert_eq!(
        run(&url, &table, &["ls", "app", "cfg"], None).expect(0, "ls").stdout(),
        "blob\ngreeting\n"
    );

    let status: Value =
        serde_json::from_slice(&run(&url, &table, &["status", "--json"], None).stdout).unwrap();
    assert_eq!(status["state"], "free", "{status}");
    assert_eq!(status["epoch"], 3, "each put took and released the lease: {status}");
    let holder = status["holder"].as_str().unwrap_or_default();
    assert!(holder.starts_with("pgfence "), "the last holder is kept: {status}");

    // Export to a file, import into a fresh table, export again: the same lines.
    let dir = std::env::temp_dir().join(unique_name("cli_export"));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("rows.jsonl");
    run(&url, &table, &["export", "--out", file.to_str().unwrap()], None).expect(0, "export");
    let exported = std::fs::read_to_string(&file).unwrap();
    assert_eq!(exported.lines().count(), 3, "{exported}");
    let copy = unique_name("cli_import");
    let imported = run(&url, &copy, &["import", "--in", file.to_str().unwrap()], None);
    assert_eq!(imported.expect(0, "import").stdout(), "imported 3 keys\n");
    let again = run(&url, &copy, &["export"], None);
    assert_eq!(again.expect(0, "export").stdout(), exported);
    assert_eq!(run(&url, &copy, &["get", "app", "cfg", "blob"], None).stdout, binary);
    // Import from stdin, too; bad input changes nothing (exit 2, before taking the lease).
    let piped = run(&url, &copy, &["import"], Some(exported.as_bytes()));
    piped.expect(0, "import from stdin");
    let bad = format!("{exported}{{\"primary_namespace\":\"x\"}}\n");
    run(&url, &copy, &["import"], Some(bad.as_bytes())).expect(2, "import of bad input");
    let bad_key = exported.replace("\"key\":\"blob\"", "\"key\":\"not a key\"");
    run(&url, &copy, &["import"], Some(bad_key.as_bytes())).expect(2, "import of an invalid key");
    assert_eq!(run(&url, &copy, &["export"], None).stdout(), exported);
    std::fs::remove_dir_all(&dir).unwrap();

    run(&url, &table, &["rm", "app", "cfg", "greeting"], None).expect(0, "rm");
    run(&url, &table, &["rm", "app", "cfg", "greeting"], None).expect(0, "rm of a missing key");
    let missing = run(&url, &table, &["get", "app", "cfg", "greeting"], None);
    missing.expect(4, "get of a removed key");
    assert!(missing.stdout.is_empty() && missing.stderr.contains("not found"), "{missing:?}");
    assert_eq!(run(&url, &table, &["ls", "app", "cfg"], None).stdout(), "blob\n");
    assert_eq!(run(&url, &table, &["ls", "no", "such"], None).expect(0, "ls").stdout(), "");
    let released = run(&url, &table, &["release", "--force", "--yes"], None);
    let released = released.expect(0, "release, nobody holds it");
    assert!(released.stdout().contains("nobody held the lease"), "{released:?}");
}

#[test]
fn usage_and_config_errors_exit_2() {
    let (url, table) = (server().url(), unique_name("cli_usage"));
    let help = run(&url, &table, &["--help"], None);
    let text = help.expect(0, "--help").stdout();
    let codes = ["0  ok", "2  usage", "3  lease held", "4  key not found", "5  lease lost"];
    for code in codes.into_iter().chain(["6  no such database or table", "TLS", "PGPASSWORD"]) {
        assert!(text.contains(code), "--help documents {code:?}: {text}");
    }
    let cases: &[&[&str]] = &[
        &["frobnicate"],
        &["get", "a", "b"],
        &["status", "--bogus"],
        &["release"],
        &["release", "--force"],
        &["release", "--yes"],
        &["hold", "--write-every", "20"],
        &["hold", "--counter-key", "k"],
        &["hold", "--ttl", "soon"],
        &["hold", "--ttl", "0"],
        &["get", "a", "b", "not a key"],
        &["put", "a", "b", "c/d", "v"],
        &["ls", "", "b"],
        &["hold", "--write-every", "20", "--counter-key", "a/b"],
    ];
    for args in cases {
        run(&url, &table, args, None).expect(2, &format!("{args:?}"));
    }
    run(&url, "not a table", &["status"], None).expect(2, "invalid --table");
    run("postgres://[::1", &table, &["status"], None).expect(2, "unparsable URL");

    // sslmode=require names the CLI's option, not a library API.
    let require = "postgres://postgres@127.0.0.1:1/postgres?sslmode=require";
    let require = run(require, &table, &["status"], None);
    assert!(require.expect(2, "sslmode=require").stderr.contains("--tls-root-cert"), "{require:?}");

    let typo = run(&url, &table, &["statsu"], None);
    assert!(
        typo.expect(2, "a mistyped command").stderr.contains("did you mean 'status'?"),
        "{typo:?}"
    );
    let far = run(&url, &table, &["frobnicate"], None);
    assert!(!far.expect(2, "an unknown command").stderr.contains("did you mean"), "{far:?}");

    let no_url = run("", &table, &["status"], None);
    no_url.expect(2, "neither --database-url nor DATABASE_URL");
    assert!(no_url.stderr.contains("DATABASE_URL"), "{no_url:?}");

    // Unreachable server: exit 1, one line with the cause.
    let refused =
        run("postgres://postgres@127.0.0.1:1/postgres", &table, &["get", "a", "b", "c"], None);
    refused.expect(1, "unreachable server");
    assert!(refused.stderr.contains("onnection refused"), "{refused:?}");
}

/// Bad input is refused before the lease is taken: exit 2 even while another process holds
/// the lease, and no acquisition (the epoch does not move).
#[test]
fn bad_input_is_refused_before_taking_the_lease() {
    let (url, table) = (server().url(), unique_name("cli_badinput"));
    run(&url, &table, &["put", "a", "b", "c", "v"], None).expect(0, "first put");
    let epoch = |url: &str, table: &str| {
        let out = run(url, table, &["status", "--json"], None).expect(0, "status").stdout();
        let status: serde_json::Value = serde_json::from_str(out.trim()).unwrap();
        status["epoch"].as_i64().unwrap()
    };
    let before = epoch(&url, &table);
    for args in [&["put", "a", "b", "bad key", "v"][..], &["rm", "a", "b", "bad/key"]] {
        run(&url, &table, args, None).expect(2, &format!("{args:?}"));
    }
    let bad_rows = "{\"primary_namespace\":\"a\",\"secondary_namespace\":\"b\",\"key\":\"bad key\",\"value\":\"\"}\n";
    let import = run(&url, &table, &["import"], Some(bad_rows.as_bytes()));
    import.expect(2, "import of a bad key");
    assert!(import.stderr.contains("line 1"), "{import:?}");
    let not_utf8 = run(&url, &table, &["import"], Some(b"\xff\xfe\n"));
    not_utf8.expect(2, "import of bytes that are not UTF-8");
    assert!(not_utf8.stderr.contains("line 1"), "{not_utf8:?}");
    assert_eq!(epoch(&url, &table), before, "no lease was taken");
}

// ---------------------------------------------------------------------------------------------
// The operator's first hour (issue 18)
// ---------------------------------------------------------------------------------------------

/// A key-value connection string for database `name` on the test server, as its
/// administrator.
fn url_for_database(name: &str) -> String {
    let config = server().config();
    let addr = server().tcp_addr().expect("the test server's TCP address");
    let user = config.get_user().expect("the administrator's user name");
    let mut url = format!("host={} port={} user={user} dbname={name}", addr.ip(), addr.port());
    if let Some(password) = config.get_password() {
        let password = String::from_utf8_lossy(password);
        url.push_str(&format!(
            " password='{}'",
            password.replace('\\', "\\\\").replace('\'', "\\'")
        ));
    }
    url
}

/// Finding 1: a mistyped table or database is reported (exit 6) by the commands that only
/// read, and nothing is created; a write command creates a missing database only with
/// `--create-database`, and creates the table as the library does.
#[test]
fn reads_create_nothing_and_a_missing_table_or_database_exits_6() {
    let (url, table) = (server().url(), unique_name("cli_typo"));
    let schema = unique_name("cli_nosuchschema");
    let in_schema = format!("{schema}.t");
    let reads: [&[&str]; 6] = [
        &["status"],
        &["status", "--json"],
        &["get", "a", "b", "c"],
        &["ls", "a", "b"],
        &["export"],
        &["release", "--force", "--yes"],
    ];
    for name in [table.as_str(), in_schema.as_str()] {
        for args in reads {
            let ran = run(&url, name, args, None);
            ran.expect(6, &format!("{args:?} with --table {name}"));
            assert!(ran.stderr.contains(&format!("no table {name} ")), "{ran:?}");
            assert!(ran.stdout.is_empty(), "{ran:?}");
        }
    }
    let created = format!(
        "SELECT relname FROM pg_class WHERE relname LIKE '{table}%' \
         UNION ALL SELECT nspname FROM pg_namespace WHERE nspname = '{schema}'"
    );
    assert!(query(&server().config(), &created).is_empty(), "a read created something");

    let database = unique_name("cli_nodb");
    let db_url = url_for_database(&database);
    let exists = || {
        let sql = format!("SELECT 1 FROM pg_database WHERE datname = '{database}'");
        !query(&server().config(), &sql).is_empty()
    };
    let commands: [&[&str]; 5] = [
        &["status"],
        &["get", "a", "b", "c"],
        &["put", "a", "b", "c", "v"],
        &["rm", "a", "b", "c"],
        &["hold", "--wait"],
    ];
    for args in commands {
        let ran = run(&db_url, &table, args, None);
        ran.expect(6, &format!("{args:?} on a missing database"));
        assert!(ran.stderr.contains(&format!("database \"{database}\" does not exist")), "{ran:?}");
    }
    let import = run(&db_url, &table, &["import"], Some(b""));
    import.expect(6, "import into a missing database");
    assert!(!exists(), "a command created the database unasked");

    let put = ["put", "--create-database", "a", "b", "c", "v"];
    run(&db_url, &table, &put, None).expect(0, "put --create-database");
    assert!(exists(), "--create-database creates the database");
    assert_eq!(run(&db_url, &table, &["get", "a", "b", "c"], None).expect(0, "get").stdout, b"v");
    // A write command creates the table, as the library does.
    run(&url, &table, &["put", "a", "b", "c", "v"], None).expect(0, "put into a new table");
    run(&url, &table, &["status"], None).expect(0, "status once a store opened the table");
}

/// Finding 2: `put` reads stdin only when the value is `-` (or `--value-file -`): a forgotten
/// value, with stdin empty or not a terminal (cron, CI), is a usage error and the key keeps
/// its value.
#[test]
fn put_reads_stdin_only_when_the_value_is_a_dash() {
    let (url, table) = (server().url(), unique_name("cli_stdin"));
    let key = ["app", "cfg", "greeting"];
    let get = |what: &str| {
        run(&url, &table, &["get", key[0], key[1], key[2]], None).expect(0, what).stdout.clone()
    };
    run(&url, &table, &["put", key[0], key[1], key[2], "hello"], None).expect(0, "put");
    for stdin in [None, Some(&b""[..]), Some(&b"piped"[..])] {
        let ran = run(&url, &table, &["put", key[0], key[1], key[2]], stdin);
        ran.expect(2, &format!("put without a value, stdin {stdin:?}"));
        assert!(ran.stderr.contains("VALUE"), "{ran:?}");
    }
    assert_eq!(get("after the refused puts"), b"hello");

    run(&url, &table, &["put", key[0], key[1], key[2], "-"], Some(b"dash")).expect(0, "put -");
    assert_eq!(get("put -"), b"dash");
    let from_stdin = ["put", key[0], key[1], key[2], "--value-file", "-"];
    run(&url, &table, &from_stdin, Some(b"file dash")).expect(0, "--value-file -");
    assert_eq!(get("--value-file -"), b"file dash");
    let dir = std::env::temp_dir().join(unique_name("cli_valuefile"));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("value.bin");
    std::fs::write(&file, b"\x00from a file\xff").unwrap();
    let from_file = ["put", key[0], key[1], key[2], "--value-file", file.to_str().unwrap()];
    run(&url, &table, &from_file, None).expect(0, "--value-file FILE");
    assert_eq!(get("--value-file FILE"), b"\x00from a file\xff");
    let both = ["put", key[0], key[1], key[2], "v", "--value-file", file.to_str().unwrap()];
    run(&url, &table, &both, None).expect(2, "VALUE and --value-file");
    // An empty value blanks nothing unless asked: from stdin, from an argument, from a file.
    let empty = dir.join("empty");
    std::fs::write(&empty, b"").unwrap();
    let empty_file = ["put", key[0], key[1], key[2], "--value-file", empty.to_str().unwrap()];
    let dash = ["put", key[0], key[1], key[2], "-"];
    let argument = ["put", key[0], key[1], key[2], ""];
    let cases: [(&[&str], Option<&[u8]>); 3] =
        [(&dash, Some(b"")), (&argument, None), (&empty_file, None)];
    for (args, stdin) in cases {
        let ran = run(&url, &table, args, stdin);
        assert!(ran.expect(2, "an empty value").stderr.contains("--allow-empty"), "{ran:?}");
    }
    assert_eq!(get("after the refused empty values"), b"\x00from a file\xff");
    run(&url, &table, &[&dash[..], &["--allow-empty"]].concat(), Some(b"")).expect(0, "asked");
    assert_eq!(get("an empty value, asked for"), b"");
    run(&url, &table, &from_file, None).expect(0, "--value-file FILE");
    let missing = dir.join("missing");
    let unreadable = ["put", key[0], key[1], key[2], "--value-file", missing.to_str().unwrap()];
    run(&url, &table, &unreadable, None).expect(2, "--value-file of a missing file");
    assert_eq!(get("after the refused puts"), b"\x00from a file\xff");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Finding 7: `hold --write-every 0` would write in a tight loop: refused, before anything
/// connects (the table is never created).
#[test]
fn hold_refuses_write_every_0() {
    let (url, table) = (server().url(), unique_name("cli_every0"));
    let ran = run(&url, &table, &["hold", "--write-every", "0", "--counter-key", "k"], None);
    ran.expect(2, "--write-every 0");
    assert!(ran.stderr.contains("--write-every"), "{ran:?}");
    run(&url, &table, &["status"], None).expect(6, "no lease was ever taken");
}

/// Finding 6: no colour codes on a stderr that is not a terminal; the loss of the lease is one
/// error line, not a log line and an error line; a successful force release prints no warning.
#[test]
fn logs_are_plain_and_one_line_per_error() {
    let (url, table) = (server().url(), unique_name("cli_logs"));
    // The library's log lines (here its info events), on a pipe: no colour codes.
    let env = [("RUST_LOG", "pgfence=debug")];
    let logged = run_env(&url, &table, &["put", "a", "b", "c", "v"], None, &env);
    logged.expect(0, "put with debug logs");
    assert!(logged.stderr.contains(" INFO pgfence::"), "log lines: {logged:?}");
    assert!(!logged.stderr.contains('\x1b'), "colour codes on a pipe: {:?}", logged.stderr);

    let mut a = Holder::spawn("A", &url, &table, &["--ttl", "6"]);
    let epoch = a.acquired().int("epoch");
    let released = run(&url, &table, &["release", "--force", "--yes"], None);
    released.expect(0, "release --force --yes");
    assert_eq!(released.stderr, "", "a successful release warns of nothing");
    assert_eq!(a.exit_code(), Some(5), "A: {:?}; stderr: {}", a.events(), a.stderr());
    let stderr = a.stderr();
    let lines: Vec<&str> = stderr.lines().collect();
    assert!(
        lines.len() == 1 && lines[0].starts_with(&format!("pgfence: lease lost (epoch {epoch})")),
        "one error line: {stderr:?}"
    );
}

/// Finding 3: libpq's environment. Without a connection string, `PGHOST`, `PGPORT`, `PGUSER`
/// and `PGDATABASE` name the server; `PGPASSWORD`, `PGPASSFILE` and `~/.pgpass` (ignored with a
/// warning if others may read it) give the password; a connection string wins over all of
/// them; TLS modes that need certificate authorities, and bad values, are usage errors.
#[test]
fn libpq_environment_names_the_server_and_the_password() {
    let (url, table) = (server().url(), unique_name("cli_libpq"));
    let config = server().config();
    let addr = server().tcp_addr().expect("the test server's TCP address");
    let (host, port) = (addr.ip().to_string(), addr.port().to_string());
    let admin = config.get_user().expect("the administrator");
    let dbname = config.get_dbname().unwrap_or(admin).to_owned();
    let admin_password = config.get_password().map(|p| String::from_utf8_lossy(p).into_owned());
    let home = std::env::temp_dir().join(unique_name("cli_home"));
    std::fs::create_dir_all(&home).unwrap();
    let home_str = home.to_str().unwrap().to_owned();
    let server_env = |user: &'static str| {
        let user = if user.is_empty() { admin } else { user };
        vec![
            ("PGHOST", host.clone()),
            ("PGPORT", port.clone()),
            ("PGUSER", user.to_owned()),
            ("PGDATABASE", dbname.clone()),
            ("HOME", home_str.clone()),
        ]
    };
    let with = |base: Vec<(&'static str, String)>, extra: &[(&'static str, &str)]| {
        let mut env = base;
        env.extend(extra.iter().map(|(k, v)| (*k, (*v).to_owned())));
        env
    };
    let run_with = |url: &str, args: &[&str], env: &[(&'static str, String)]| {
        let env: Vec<(&str, &str)> = env.iter().map(|(k, v)| (*k, v.as_str())).collect();
        run_env(url, &table, args, None, &env)
    };

    let mut env = server_env("");
    if let Some(password) = &admin_password {
        env.push(("PGPASSWORD", password.clone()));
    }
    run_with("", &["put", "a", "b", "c", "v"], &env).expect(0, "put with libpq's environment");
    assert_eq!(run_with("", &["get", "a", "b", "c"], &env).expect(0, "get").stdout, b"v");
    // A connection string wins: a wrong PGPORT and PGUSER beside it are not used.
    let wrong = [("PGPORT", "1".to_owned()), ("PGUSER", "nobody".to_owned())];
    run_with(&url, &["get", "a", "b", "c"], &wrong).expect(0, "the URL wins");
    run_with("", &["status"], &[("HOME", home_str.clone())]).expect(2, "nothing names a server");

    // The password role, allowed to read the table.
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    runtime.block_on(server().ensure_password_role()).expect("the password role");
    let grant = format!("GRANT SELECT ON \"{table}\", \"{table}_lease\" TO {PASSWORD_ROLE}");
    query(&config, &grant);
    let role = server_env(PASSWORD_ROLE);
    let status =
        run_with("", &["status"], &with(role.clone(), &[("PGPASSWORD", PASSWORD_ROLE_PASSWORD)]));
    assert!(
        status.expect(0, "PGPASSWORD").stdout().starts_with("free (last epoch 1"),
        "{status:?}"
    );
    let secret = "wrong-secret-9d41";
    let refused = run_with("", &["status"], &with(role.clone(), &[("PGPASSWORD", secret)]));
    refused.expect(1, "a wrong PGPASSWORD");
    assert!(refused.stderr.contains("password authentication failed"), "{refused:?}");
    assert!(refused.stderr.contains(&format!("{host}:{port}")), "names the server: {refused:?}");
    assert!(!refused.stderr.contains(secret), "never the password: {refused:?}");

    // A password file: the first matching line wins; `*` matches anything.
    let passfile = home.join("pgfence.pgpass");
    let lines = format!(
        "# comment\nother-host:*:*:*:nope\n{host}:{port}:*:{PASSWORD_ROLE}:{PASSWORD_ROLE_PASSWORD}\n*:*:*:*:nope\n"
    );
    std::fs::write(&passfile, &lines).unwrap();
    let chmod = |path: &std::path::Path, mode: u32| {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode)).unwrap();
    };
    chmod(&passfile, 0o600);
    let passfile_env = with(role.clone(), &[("PGPASSFILE", passfile.to_str().unwrap())]);
    run_with("", &["status"], &passfile_env).expect(0, "PGPASSFILE");
    chmod(&passfile, 0o644);
    let ignored = run_with("", &["status"], &passfile_env);
    assert_eq!(ignored.code, Some(1), "a password file others may read is ignored: {ignored:?}");
    let lines: Vec<&str> = ignored.stderr.lines().collect();
    assert!(
        lines.len() == 2
            && lines[0].starts_with("pgfence: warning: password file")
            && lines[0].contains("group or world access")
            && lines[1].contains("password"),
        "{ignored:?}"
    );
    // ~/.pgpass when PGPASSFILE is not set.
    let dot_pgpass = home.join(".pgpass");
    let line = format!("{host}:{port}:*:{PASSWORD_ROLE}:{PASSWORD_ROLE_PASSWORD}\n");
    std::fs::write(&dot_pgpass, line).unwrap();
    chmod(&dot_pgpass, 0o600);
    run_with("", &["status"], &role).expect(0, "~/.pgpass");

    // TLS asked for without certificate authorities, and values that make no sense.
    for (name, value) in [
        ("PGSSLMODE", "verify-full"),
        ("PGSSLMODE", "require"),
        ("PGSSLMODE", "sometimes"),
        ("PGCONNECT_TIMEOUT", "soon"),
        ("PGPORT", "port"),
    ] {
        let ran = run_with("", &["status"], &with(role.clone(), &[(name, value)]));
        ran.expect(2, &format!("{name}={value}"));
        assert!(ran.stderr.contains(name) || ran.stderr.contains("sslmode"), "{ran:?}");
    }
    std::fs::remove_dir_all(&home).unwrap();
}

/// Finding 8: `imported 1 key`, and an input file that cannot be opened is a bad input file
/// (exit 2, as the table of exit codes says).
#[test]
fn import_wording_and_a_missing_input_file() {
    let (url, table) = (server().url(), unique_name("cli_import1"));
    let row = "{\"primary_namespace\":\"a\",\"secondary_namespace\":\"b\",\"key\":\"c\",\"value\":\"dg==\"}\n";
    let imported = run(&url, &table, &["import"], Some(row.as_bytes()));
    assert_eq!(imported.expect(0, "import").stdout(), "imported 1 key\n");
    let missing = std::env::temp_dir().join(unique_name("cli_nonexistent"));
    let ran = run(&url, &table, &["import", "--in", missing.to_str().unwrap()], None);
    ran.expect(2, "import --in a missing file");
}

/// Finding 8: `--json` on every command, one JSON object a line (schemas in docs/cli.md);
/// `ls` of a primary namespace, of the whole table and by prefix; `hold`'s events are
/// timestamped.
#[test]
fn every_command_has_json_output_and_ls_lists_by_namespace_and_prefix() {
    let (url, table) = (server().url(), unique_name("cli_json"));
    let json_of = |args: &[&str], stdin: Option<&[u8]>| -> Vec<Value> {
        let ran = run(&url, &table, args, stdin);
        let out = ran.expect(0, &format!("{args:?}")).stdout();
        out.lines().map(|line| serde_json::from_str(line).expect(line)).collect()
    };
    let text_of = |args: &[&str]| run(&url, &table, args, None).expect(0, "text").stdout();
    let put = json_of(&["put", "--json", "a", "b", "k1", "v1"], None);
    let done = |command: &str, sub: &str, key: &str, epoch: i64| {
        serde_json::json!({ "command": command, "primary_namespace": "a",
            "secondary_namespace": sub, "key": key, "epoch": epoch })
    };
    assert_eq!(put, [done("put", "b", "k1", 1)]);
    assert_eq!(
        json_of(&["put", "--json", "a", "c", "k2", "v2"], None),
        [done("put", "c", "k2", 2)]
    );
    assert_eq!(text_of(&["put", "", "", "top", "x"]), "", "text put prints nothing");
    let got = json_of(&["get", "--json", "a", "b", "k1"], None);
    let row = serde_json::json!({ "primary_namespace": "a", "secondary_namespace": "b",
        "key": "k1", "value": "djE=" });
    assert_eq!(got, [row]);
    let listed = json_of(&["ls", "--json", "a", "b"], None);
    let entry = serde_json::json!({ "primary_namespace": "a", "secondary_namespace": "b",
        "key": "k1" });
    assert_eq!(listed, [entry]);
    assert_eq!(text_of(&["ls"]), "//top\na/b/k1\na/c/k2\n");
    assert_eq!(text_of(&["ls", "a"]), "a/b/k1\na/c/k2\n");
    assert_eq!(text_of(&["ls", "--prefix", "k2"]), "a/c/k2\n");
    assert_eq!(text_of(&["ls", "a", "b", "--prefix", "x"]), "");
    assert_eq!(json_of(&["ls", "--json", "a"], None).len(), 2);

    let status = json_of(&["status", "--json"], None);
    assert_eq!(status[0]["state"], "free", "{status:?}");
    assert_eq!(status[0]["epoch"], 3, "{status:?}");
    assert_eq!(json_of(&["rm", "--json", "a", "c", "k2"], None), [done("rm", "c", "k2", 4)]);
    let line = "{\"primary_namespace\":\"a\",\"secondary_namespace\":\"b\",\"key\":\"k3\",\"value\":\"\"}\n";
    let imported = json_of(&["import", "--json"], Some(line.as_bytes()));
    assert_eq!(imported, [serde_json::json!({ "command": "import", "imported": 1 })]);
    let released = json_of(&["release", "--force", "--yes", "--json"], None);
    assert_eq!(released, [serde_json::json!({ "state": "nobody" })]);

    let holder = Holder::spawn("H", &url, &table, &[]);
    let acquired = holder.acquired();
    let at = acquired.json["at"].as_str().unwrap_or_default();
    assert!(is_timestamp(at), "{}", acquired.json);
    let held = json_of(&["release", "--force", "--yes", "--json"], None);
    assert_eq!(held[0]["state"], "released", "{held:?}");
    assert_eq!(held[0]["epoch"], acquired.int("epoch"), "{held:?}");
}

/// Finding 5: a standby against a server that is down reports it as a `retrying` event on
/// stdout, with the whole cause and the server, and one line on stderr: at most one report
/// every 30 s, not the library's line a second.
#[test]
fn a_standby_reports_an_unreachable_server_once_with_the_whole_cause() {
    let table = unique_name("cli_down");
    let refused = "postgres://postgres@127.0.0.1:1/postgres";
    let standby = Holder::spawn("W", refused, &table, &["--wait"]);
    let (at, retrying) = standby.wait_for(0, "retrying", |_| true);
    let error = retrying.json["error"].as_str().unwrap_or_default().to_owned();
    assert!(error.contains("127.0.0.1:1") && error.contains("onnection refused"), "{error}");
    assert!(retrying.json["at"].as_str().is_some_and(is_timestamp), "{}", retrying.json);
    // The library retries about once a second; three seconds bring no second report.
    thread::sleep(Duration::from_secs(3));
    let events = standby.events();
    assert_eq!(events.len(), at + 1, "one report: {events:?}");
    let stderr = standby.stderr();
    let lines: Vec<&str> = stderr.lines().collect();
    assert!(
        lines.len() == 1 && lines[0] == format!("pgfence: standby retrying: {error}"),
        "one line: {stderr:?}"
    );
}

/// `pgfence doctor` against the test cluster: every check present with pass, warn or fail and
/// a detail saying what to change; nothing created; a role setting (here given as a connection
/// option) turns a warning into a pass; a missing database fails with exit 1.
#[test]
fn doctor_checks_the_deployment_and_creates_nothing() {
    let (url, table) = (server().url(), unique_name("cli_doctor"));
    let report = |url: &str, code: i32| -> Value {
        let ran = run(url, &table, &["doctor", "--json"], None);
        serde_json::from_slice(&ran.expect(code, "doctor --json").stdout).expect("one JSON object")
    };
    let find = |report: &Value, name: &str| -> (String, String) {
        let checks = report["checks"].as_array().expect("checks");
        let c = checks
            .iter()
            .find(|c| c["check"] == name)
            .unwrap_or_else(|| panic!("{name}: {report}"));
        (c["status"].as_str().unwrap().to_owned(), c["detail"].as_str().unwrap().to_owned())
    };
    let fresh = report(&url, 0);
    assert_eq!(find(&fresh, "connection").0, "pass", "{fresh}");
    // One space between words: no run of spaces from a broken line continuation.
    for check in fresh["checks"].as_array().unwrap() {
        assert!(!check["detail"].as_str().unwrap().contains("  "), "{check}");
    }
    let privileges = find(&fresh, "privileges").1;
    assert!(privileges.ends_with("in schema public"), "the schema is named: {fresh}");
    assert_ne!(find(&fresh, "server version").0, "fail", "{fresh}");
    assert_eq!(find(&fresh, "privileges").0, "pass", "the administrator: {fresh}");
    let wal = find(&fresh, "wal timeline");
    assert!(wal.0 == "pass" && wal.1.contains("timeline 1"), "a primary's WAL: {fresh}");
    assert_eq!(find(&fresh, "clock").0, "pass", "the same machine: {fresh}");
    let tls = find(&fresh, "tls");
    assert!(tls.0 == "warn" && tls.1.contains("--tls-root-cert"), "{fresh}");
    let sync = find(&fresh, "synchronous_standby_names");
    assert!(sync.0 == "warn" && sync.1.contains("replica"), "no replica here: {fresh}");
    let idle = find(&fresh, "idle_in_transaction_session_timeout");
    assert!(idle.0 == "warn" && idle.1.contains("ALTER ROLE"), "{fresh}");
    let missing = find(&fresh, "table");
    assert!(missing.0 == "warn" && missing.1.contains("no table"), "{fresh}");
    assert_eq!(fresh["status"], "warn", "{fresh}");
    let created = format!("SELECT relname FROM pg_class WHERE relname LIKE '{table}%'");
    assert!(query(&server().config(), &created).is_empty(), "doctor created something");

    run(&url, &table, &["put", "a", "b", "c", "v"], None).expect(0, "put");
    let dbname = server().config().get_dbname().unwrap_or("postgres").to_owned();
    let with_timeout = format!(
        "{} options='-c idle_in_transaction_session_timeout=60000'",
        url_for_database(&dbname)
    );
    let used = report(&with_timeout, 0);
    assert_eq!(find(&used, "idle_in_transaction_session_timeout").0, "pass", "{used}");
    assert_eq!(find(&used, "schema version").0, "pass", "{used}");
    let lease = find(&used, "lease");
    assert!(lease.0 == "pass" && lease.1.starts_with("free (last epoch 1"), "{used}");

    // The text table: one aligned row a check.
    let text = run(&url, &table, &["doctor"], None).expect(0, "doctor").stdout();
    let columns: Vec<usize> =
        text.lines().map(|l| l.find("  pass").or(l.find("  warn")).unwrap_or(0)).collect();
    assert!(columns.len() >= 10 && columns.windows(2).all(|w| w[0] == w[1] && w[0] > 0), "{text}");

    let nodb = report(&url_for_database(&unique_name("cli_doctor_nodb")), 1);
    assert_eq!(nodb["status"], "fail", "{nodb}");
    assert!(find(&nodb, "connection").1.contains("does not exist"), "{nodb}");
}

/// `pgfence doctor` tells a direct connection from one through a pooler, and fails a pooler in
/// transaction mode with what to change. The pooler is a real PgBouncer before the test server.
#[test]
fn doctor_detects_a_pooler_and_its_mode() {
    use pgfence_testing::{PgBouncer, PoolMode};
    let table = unique_name("cli_doctor_pooler");
    let pooler = |url: &str, code: i32| -> (String, String) {
        let ran = run(url, &table, &["doctor", "--json"], None);
        let report: Value = serde_json::from_slice(&ran.expect(code, "doctor --json").stdout)
            .expect("one JSON object");
        let checks = report["checks"].as_array().expect("checks");
        let c =
            checks.iter().find(|c| c["check"] == "pooler").unwrap_or_else(|| panic!("{report}"));
        (c["status"].as_str().unwrap().to_owned(), c["detail"].as_str().unwrap().to_owned())
    };
    let dbname = server().config().get_dbname().unwrap_or("postgres").to_owned();
    let direct = pooler(&url_for_database(&dbname), 0);
    assert!(direct.0 == "pass" && direct.1.starts_with("none seen"), "{direct:?}");

    let addr = server().tcp_addr().expect("the test server's TCP address");
    for (mode, code) in [(PoolMode::Session, 0), (PoolMode::Transaction, 1)] {
        let bouncer = PgBouncer::start(addr, mode).expect("start pgbouncer");
        let url =
            format!("host=127.0.0.1 port={} user=postgres dbname={dbname}", bouncer.addr().port());
        let (status, detail) = pooler(&url, code);
        match mode {
            PoolMode::Session => assert!(
                status == "pass"
                    && detail.contains("sits between")
                    && detail.contains(&addr.port().to_string()),
                "session mode: {status} {detail}"
            ),
            _ => assert!(
                status == "fail"
                    && detail.contains("pool_mode = session")
                    && detail.contains("--pool-mode transaction"),
                "transaction mode: {status} {detail}"
            ),
        }
    }
}

/// With `--pool-mode transaction` (or `PGFENCE_POOL_MODE`) the commands work through PgBouncer in
/// transaction mode, and `doctor` passes its pooler check.
#[test]
fn commands_through_a_transaction_pooler_with_pool_mode_transaction() {
    use pgfence_testing::{PgBouncer, PoolMode};
    let table = unique_name("cli_txn_pooler");
    let addr = server().tcp_addr().expect("the test server's TCP address");
    let bouncer = PgBouncer::start(addr, PoolMode::Transaction).expect("start pgbouncer");
    let dbname = server().config().get_dbname().unwrap_or("postgres").to_owned();
    let url =
        format!("host=127.0.0.1 port={} user=postgres dbname={dbname}", bouncer.addr().port());
    let mode = ["--pool-mode", "transaction"];
    run(&url, &table, &[&["put"][..], &mode, &["n", "s", "k", "v"]].concat(), None)
        .expect(0, "put");
    let env = [("PGFENCE_POOL_MODE", "transaction")];
    let got = run_env(&url, &table, &["get", "n", "s", "k"], None, &env);
    assert_eq!(got.expect(0, "get").stdout, b"v");
    let listed = run(&url, &table, &[&["ls"][..], &mode, &["n", "s"]].concat(), None);
    assert_eq!(listed.expect(0, "ls").stdout(), "k\n");
    run(&url, &table, &[&["status"][..], &mode].concat(), None).expect(0, "status");
    let ran = run_env(&url, &table, &["doctor", "--json"], None, &env);
    let report: Value = serde_json::from_slice(&ran.stdout).expect("one JSON object");
    let checks = report["checks"].as_array().expect("checks");
    let pooler = checks.iter().find(|c| c["check"] == "pooler").expect("a pooler check");
    assert_eq!(pooler["status"], "pass", "{report}");
    assert!(pooler["detail"].as_str().unwrap().contains("--pool-mode transaction"), "{report}");
    // The session mode (the default) refuses the same pooler, in the CLI's words.
    let refused = run(&url, &table, &["put", "n", "s", "k", "w"], None);
    assert_ne!(refused.code, Some(0), "{:?}", refused.stderr);
    assert!(refused.stderr.contains("--pool-mode transaction"), "{:?}", refused.stderr);
    assert!(!refused.stderr.contains("Builder::"), "{:?}", refused.stderr);

    // A standby behind it looks at the lease every second, and prints `waiting` once: the
    // state did not change.
    let a = Holder::spawn("A", &url, &table, &mode);
    let epoch = a.acquired().int("epoch");
    let w = Holder::spawn("W", &url, &table, &[&mode[..], &["--wait"]].concat());
    w.wait_for(0, "waiting", |e| e.int("epoch") == epoch);
    thread::sleep(Duration::from_secs(3));
    assert_eq!(w.events().len(), 1, "one waiting line: {:?}", w.events());
    a.stop("TERM", epoch);
    let next = w.acquired().int("epoch");
    w.stop("TERM", next);
}

/// How the server names a connection's missing encryption when pg_hba.conf refuses it:
/// "no encryption" since PostgreSQL 14, "SSL off" before.
fn unencrypted_wording(cluster: &TestCluster) -> &'static str {
    let version = tokio::runtime::Runtime::new().expect("runtime").block_on(async {
        let client = cluster.connect().await.expect("connect over TLS");
        client.query_one("SHOW server_version_num", &[]).await.expect("version").get::<_, String>(0)
    });
    if version.parse::<i32>().expect("a number") >= 14_00_00 { "no encryption" } else { "SSL off" }
}

/// Finding 3, TLS: `PGSSLMODE`, `PGSSLROOTCERT`, `PGSSLCERT` and `PGSSLKEY` stand in for the
/// TLS options: verified TLS, a client certificate, and `disable` refused by a server that
/// takes TLS only. `PGAPPNAME` names the connections.
#[test]
fn libpq_tls_variables_connect_over_verified_tls() {
    let cluster = TestCluster::start_tls().expect("a private cluster with TLS");
    let table = unique_name("cli_pgssl");
    let dir = std::env::temp_dir().join(unique_name("pgfence_cli_pgssl"));
    std::fs::create_dir(&dir).unwrap();
    let (ca, cert, key) = (dir.join("ca.pem"), dir.join("client.pem"), dir.join("client.key"));
    std::fs::write(&ca, cluster.tls_root_pem().expect("a TLS cluster")).unwrap();
    let (cert_pem, key_pem) = cluster.client_cert_pem().expect("a TLS cluster");
    std::fs::write(&cert, cert_pem).unwrap();
    std::fs::write(&key, key_pem).unwrap();
    let (ca, cert, key) = (ca.to_str().unwrap(), cert.to_str().unwrap(), key.to_str().unwrap());
    let port = cluster.port().to_string();
    let home = dir.to_str().unwrap();
    let server = [("PGHOST", "127.0.0.1"), ("PGPORT", port.as_str()), ("HOME", home)];
    let env = |extra: &[(&'static str, &'static str)]| -> Vec<(&str, &str)> {
        server.iter().chain(extra).copied().collect()
    };
    let verified = [("PGUSER", "postgres"), ("PGSSLMODE", "verify-full")];
    let mut with_roots = env(&verified);
    with_roots.push(("PGSSLROOTCERT", ca));
    with_roots.push(("PGAPPNAME", "cli-pgappname"));
    run_env("", &table, &["put", "ns", "sub", "k", "v"], None, &with_roots).expect(0, "put");
    let read = run_env("", &table, &["get", "ns", "sub", "k"], None, &with_roots);
    assert_eq!(read.expect(0, "get over TLS from PGSSLROOTCERT").stdout(), "v");
    let doctor = run_env("", &table, &["doctor"], None, &with_roots).expect(0, "doctor").stdout();
    assert!(doctor.lines().any(|l| l.starts_with("tls") && l.contains(" pass ")), "{doctor}");

    let plain = env(&[("PGUSER", "postgres"), ("PGSSLMODE", "disable")]);
    let refused = run_env("", &table, &["get", "ns", "sub", "k"], None, &plain);
    let unencrypted = unencrypted_wording(&cluster);
    assert!(refused.expect(1, "sslmode disable").stderr.contains(unencrypted), "{refused:?}");

    // The certificate role may connect but not use the administrator's table: the doctor
    // says which GRANT fixes that.
    let mut by_certificate = env(&[("PGUSER", CERT_ROLE), ("PGSSLMODE", "verify-full")]);
    by_certificate.extend([("PGSSLROOTCERT", ca), ("PGSSLCERT", cert), ("PGSSLKEY", key)]);
    by_certificate.push(("PGDATABASE", "postgres"));
    let doctor = run_env("", &table, &["doctor"], None, &by_certificate);
    let report = doctor.expect(1, "doctor as the certificate role").stdout();
    let row = |name: &str| report.lines().find(|l| l.starts_with(name)).unwrap_or_default();
    assert!(row("connection").contains(" pass "), "{report}");
    assert!(
        row("privileges").contains(" fail ") && row("privileges").contains("GRANT"),
        "{report}"
    );
    by_certificate.retain(|(name, _)| *name != "PGSSLKEY");
    let half = run_env("", &table, &["status"], None, &by_certificate);
    half.expect(2, "PGSSLCERT without PGSSLKEY");

    // PGAPPNAME names the connections: a holder's are found by it while it holds.
    let mut holder_env = with_roots.clone();
    holder_env.retain(|(name, _)| *name != "PGAPPNAME");
    holder_env.push(("PGAPPNAME", "cli-pgappname-hold"));
    let _holder = Guard::spawn("H", "", &table, &["hold"], None, &holder_env);
    let sql = "SELECT 1 FROM pg_stat_activity WHERE application_name = 'cli-pgappname-hold'";
    let deadline = Instant::now() + GUARD;
    while query_tls(&cluster, sql).is_empty() {
        assert!(Instant::now() < deadline, "no connection named by PGAPPNAME");
        thread::sleep(Duration::from_millis(50));
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

/// Runs `sql` on the TLS cluster as its administrator, over verified TLS.
fn query_tls(cluster: &TestCluster, sql: &str) -> Vec<tokio_postgres::Row> {
    let runtime =
        tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    runtime.block_on(async {
        let client = cluster.connect().await.expect("admin connection");
        client.query(sql, &[]).await.expect(sql)
    })
}

/// Finding 4 (the CLI's part): a permission error says which `GRANT` fixes it. The password
/// role may not create in a new schema of the administrator's.
#[test]
fn a_permission_error_names_the_grant() {
    let schema = unique_name("cli_grant");
    query(&server().config(), &format!("CREATE SCHEMA {schema}"));
    let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    runtime.block_on(server().ensure_password_role()).expect("the password role");
    let addr = server().tcp_addr().expect("the test server's TCP address");
    let dbname = server().config().get_dbname().unwrap_or("postgres").to_owned();
    let url = format!("postgres://{PASSWORD_ROLE}:{PASSWORD_ROLE_PASSWORD}@{addr}/{dbname}");
    let table = format!("{schema}.t");
    let denied = run(&url, &table, &["put", "a", "b", "c", "v"], None);
    denied.expect(1, "put without CREATE on the schema");
    // It cannot see whether the tables exist, so it names both grants.
    for right in ["USAGE", "CREATE"] {
        let grant = format!("GRANT {right} ON SCHEMA {schema} TO {PASSWORD_ROLE}");
        assert!(denied.stderr.contains(&grant), "{denied:?}");
    }
    query(
        &server().config(),
        &format!("GRANT USAGE, CREATE ON SCHEMA {schema} TO {PASSWORD_ROLE}"),
    );
    run(&url, &table, &["put", "a", "b", "c", "v"], None).expect(0, "put once granted");
}

/// The SQL block of docs/deployments.md under `heading`, one statement a line, for schema
/// `schema`, table `kv` and role `role` (the docs write `app`, `node_state`, `svc`, `reader`).
fn documented_grants(heading: &str, schema: &str, kv: &str, role: &str) -> Vec<String> {
    let docs = include_str!("../docs/deployments.md");
    let section = docs.split(heading).nth(1).unwrap_or_else(|| panic!("no {heading:?}"));
    let block = section.split("```sql\n").nth(1).and_then(|rest| rest.split("```").next());
    let block = block.unwrap_or_else(|| panic!("no SQL block under {heading:?}"));
    block
        .lines()
        .map(|line| {
            line.replace("app.node_state", &format!("{schema}.{kv}"))
                .replace("SCHEMA app ", &format!("SCHEMA {schema} "))
                .replace(" TO svc;", &format!(" TO {role};"))
                .replace(" TO reader;", &format!(" TO {role};"))
        })
        .collect()
}

/// A key-value connection string of the test server's database for `role`, which logs in
/// without a password (the test cluster trusts local connections).
fn url_for_role(role: &str) -> String {
    let addr = server().tcp_addr().expect("the test server's TCP address");
    let dbname = server().config().get_dbname().unwrap_or("postgres").to_owned();
    format!("host={} port={} user={role} dbname={dbname}", addr.ip(), addr.port())
}

/// `doctor` names the session defaults a role or the connection's options set that pgfence
/// overrides for its own writes (issue 27, item 3), and no longer warns of them: `put` through
/// such a role still commits durably (tests/suite/durability.rs shows that).
#[test]
fn doctor_reports_the_session_defaults_pgfence_overrides() {
    let (table, role) = (unique_name("cli_overrides"), unique_name("cli_weak"));
    let admin = server().config();
    for sql in [
        format!("CREATE ROLE {role} LOGIN SUPERUSER"),
        format!("ALTER ROLE {role} SET synchronous_commit = off"),
    ] {
        query(&admin, &sql);
    }
    let url =
        format!("{} options='-c default_transaction_isolation=serializable'", url_for_role(&role));
    let ran = run(&url, &table, &["doctor", "--json"], None);
    let report: Value = serde_json::from_slice(&ran.expect(0, "doctor").stdout).unwrap();
    let (status, detail) = doctor_check(&report, "session overrides");
    assert_eq!(status, "pass", "{report}");
    assert_eq!(
        detail,
        format!(
            "ALTER ROLE {role} SET synchronous_commit = off: pgfence commits its own writes \
             with on; default_transaction_isolation = serializable in the connection's \
             options: pgfence runs its own transactions at read committed; other clients keep \
             them"
        ),
        "{report}"
    );
    let (status, detail) = doctor_check(&report, "synchronous_commit");
    assert!(status == "pass" && detail.starts_with("off;"), "{report}");
    run(&url, &table, &["put", "a", "b", "c", "v"], None).expect(0, "put through the role");
    let plain = run(&server().url(), &table, &["doctor", "--json"], None);
    let report: Value = serde_json::from_slice(&plain.expect(0, "doctor").stdout).unwrap();
    assert_eq!(doctor_check(&report, "session overrides").1, "none", "{report}");
    query(&admin, &format!("REASSIGN OWNED BY {role} TO CURRENT_USER"));
    query(&admin, &format!("DROP ROLE {role}"));
}

/// `doctor` names a database's defaults too (`ALTER DATABASE .. SET`), the third source a
/// session default comes from: each setting pgfence overrides, isolation included.
#[test]
fn doctor_reports_a_database_default_pgfence_overrides() {
    let (table, db) = (unique_name("cli_dboverrides"), unique_name("cli_weakdb"));
    let admin = server().config();
    for sql in [
        format!("CREATE DATABASE {db}"),
        format!("ALTER DATABASE {db} SET synchronous_commit = off"),
        format!("ALTER DATABASE {db} SET default_transaction_isolation = serializable"),
    ] {
        query(&admin, &sql);
    }
    let report = doctor_report(&url_for_database(&db), &table);
    let (status, detail) = doctor_check(&report, "session overrides");
    assert_eq!(status, "pass", "{report}");
    assert_eq!(
        detail,
        format!(
            "ALTER DATABASE {db} SET synchronous_commit = off: pgfence commits its own writes \
             with on; ALTER DATABASE {db} SET default_transaction_isolation = serializable: \
             pgfence runs its own transactions at read committed; other clients keep them"
        ),
        "{report}"
    );
    query(&admin, &format!("DROP DATABASE {db} WITH (FORCE)"));
}

/// A database's default hidden by the role's own: `pg_settings` shows only the role's, but
/// `doctor` names both, read from `pg_db_role_setting`. The role is not a superuser: any role
/// may read that catalog, unless an administrator revoked that.
#[test]
fn doctor_reports_a_database_default_hidden_by_the_role() {
    let table = unique_name("cli_hidden");
    let (db, role) = (unique_name("cli_hiddendb"), unique_name("cli_hiddenrole"));
    let admin = server().config();
    for sql in [
        format!("CREATE DATABASE {db}"),
        format!("CREATE ROLE {role} LOGIN"),
        format!("ALTER DATABASE {db} SET synchronous_commit = off"),
        format!("ALTER ROLE {role} SET synchronous_commit = local"),
    ] {
        query(&admin, &sql);
    }
    let report = doctor_report(&url_for_role_in(&role, &db), &table);
    let (status, detail) = doctor_check(&report, "session overrides");
    assert_eq!(status, "pass", "{report}");
    assert_eq!(
        detail,
        format!(
            "ALTER ROLE {role} SET synchronous_commit = local, ALTER DATABASE {db} SET \
             synchronous_commit = off (hidden here by the role's value): pgfence commits its \
             own writes with on; other clients keep them"
        ),
        "{report}"
    );
    // Where an administrator revoked it (each database has its own grant on a shared catalog),
    // pg_settings shows only the role's value, and doctor says so.
    let mut in_db = admin.clone();
    in_db.dbname(&db);
    query(&in_db, "REVOKE SELECT ON pg_catalog.pg_db_role_setting FROM PUBLIC");
    let report = doctor_report(&url_for_role_in(&role, &db), &table);
    assert_eq!(
        doctor_check(&report, "session overrides").1,
        format!(
            "ALTER ROLE {role} SET synchronous_commit = local: pgfence commits its own writes \
             with on; other clients keep them; only the values in effect are shown: this role \
             may not read pg_db_role_setting"
        ),
        "{report}"
    );
    query(&admin, &format!("DROP DATABASE {db} WITH (FORCE)"));
    query(&admin, &format!("DROP ROLE {role}"));
}

/// `ALTER ROLE .. IN DATABASE .. SET`, the strongest of the three levels: named where it
/// applies, above the database's default it hides, and not in another database.
#[test]
fn doctor_reports_a_role_default_in_one_database() {
    let table = unique_name("cli_roleindb");
    let (db, role) = (unique_name("cli_roleindb_db"), unique_name("cli_roleindb_role"));
    let admin = server().config();
    for sql in [
        format!("CREATE DATABASE {db}"),
        format!("CREATE ROLE {role} LOGIN"),
        format!("ALTER DATABASE {db} SET default_transaction_isolation = serializable"),
        format!(
            "ALTER ROLE {role} IN DATABASE {db} SET default_transaction_isolation = \
             'repeatable read'"
        ),
    ] {
        query(&admin, &sql);
    }
    let report = doctor_report(&url_for_role_in(&role, &db), &table);
    let (status, detail) = doctor_check(&report, "session overrides");
    assert_eq!(status, "pass", "{report}");
    assert_eq!(
        detail,
        format!(
            "ALTER ROLE {role} IN DATABASE {db} SET default_transaction_isolation = 'repeatable \
             read', ALTER DATABASE {db} SET default_transaction_isolation = serializable \
             (hidden here by the role's value in this database): pgfence runs its own \
             transactions at read committed; other clients keep them"
        ),
        "{report}"
    );
    let elsewhere = doctor_report(&url_for_role(&role), &table);
    assert_eq!(doctor_check(&elsewhere, "session overrides").1, "none", "{elsewhere}");
    query(&admin, &format!("DROP DATABASE {db} WITH (FORCE)"));
    query(&admin, &format!("DROP ROLE {role}"));
}

/// What pgfence keeps is not called overridden: `remote_apply`, stronger than the `on` it
/// raises weaker values to, and read committed, the level it uses anyway.
#[test]
fn doctor_does_not_call_remote_apply_overridden() {
    let (table, role) = (unique_name("cli_kept"), unique_name("cli_kept_role"));
    let admin = server().config();
    for sql in [
        format!("CREATE ROLE {role} LOGIN"),
        format!("ALTER ROLE {role} SET synchronous_commit = remote_apply"),
        format!("ALTER ROLE {role} SET default_transaction_isolation = 'read committed'"),
    ] {
        query(&admin, &sql);
    }
    let report = doctor_report(&url_for_role(&role), &table);
    assert_eq!(doctor_check(&report, "session overrides"), ("pass".into(), "none".into()));
    let (status, detail) = doctor_check(&report, "synchronous_commit");
    assert!(status == "pass" && detail == "remote_apply: pgfence keeps it", "{report}");
    query(&admin, &format!("DROP ROLE {role}"));
}

/// A key-value connection string of database `db` for `role` (trusted: no password).
fn url_for_role_in(role: &str, db: &str) -> String {
    let addr = server().tcp_addr().expect("the test server's TCP address");
    format!("host={} port={} user={role} dbname={db}", addr.ip(), addr.port())
}

/// The report of `doctor --json` through `url`. A role that is no superuser may fail its
/// `privileges` check (PostgreSQL 15 grants no `CREATE` on `public`), so exit 1 is fine too.
fn doctor_report(url: &str, table: &str) -> Value {
    let ran = run(url, table, &["doctor", "--json"], None);
    assert!(matches!(ran.code, Some(0 | 1)), "doctor: {ran:?}");
    serde_json::from_slice(&ran.stdout).unwrap_or_else(|e| panic!("doctor: {e}: {ran:?}"))
}

/// The status and detail of check `name` of a `doctor --json` report.
fn doctor_check(report: &Value, name: &str) -> (String, String) {
    let checks = report["checks"].as_array().expect("checks");
    let c =
        checks.iter().find(|c| c["check"] == name).unwrap_or_else(|| panic!("{name}: {report}"));
    (c["status"].as_str().unwrap().to_owned(), c["detail"].as_str().unwrap().to_owned())
}

/// Issue 30, item 1: a schema owned by one role and used by others. The owner creates the
/// tables as docs/deployments.md says; the application's role, with only the documented
/// grants, puts, removes, holds, renews, releases and waits as a standby; a read-only role runs
/// every read command. `doctor` agrees with what happens in each case, and a missing right is
/// named by the same `GRANT` in the command's error and in `doctor`.
#[test]
fn least_privilege_roles_agree_with_doctor() {
    let schema = unique_name("cli_priv");
    let [owner, app, reader] = ["owner", "app", "reader"].map(|r| unique_name(&format!("cli_{r}")));
    let admin = server().config();
    for sql in [
        format!("CREATE ROLE {owner} LOGIN"),
        format!("CREATE ROLE {app} LOGIN"),
        format!("CREATE ROLE {reader} LOGIN"),
        format!("CREATE SCHEMA {schema} AUTHORIZATION {owner}"),
    ] {
        query(&admin, &sql);
    }
    let table = format!("{schema}.node_state");
    let (owner_url, app_url, reader_url) =
        (url_for_role(&owner), url_for_role(&app), url_for_role(&reader));
    let doctor = |url: &str, args: &[&str], code: i32| -> Value {
        let args: Vec<&str> = ["doctor", "--json"].iter().chain(args).copied().collect();
        let ran = run(url, &table, &args, None);
        serde_json::from_slice(&ran.expect(code, "doctor --json").stdout).expect("one JSON object")
    };
    // The owner, not a superuser, may create tables in its schema. Unqualified, a name lives in
    // the first schema of the search path, which doctor names (it once passed the text
    // "current_schema()" as the schema's name).
    query(&admin, &format!("ALTER ROLE {owner} SET search_path = {schema}"));
    let fresh = unique_name("cli_priv_fresh");
    let ran = run(&owner_url, &fresh, &["doctor", "--json"], None);
    let report: Value = serde_json::from_slice(&ran.expect(0, "doctor").stdout).unwrap();
    let (status, detail) = doctor_check(&report, "privileges");
    assert!(status == "pass" && detail.ends_with(&format!("in schema {schema}")), "{report}");
    run(&owner_url, &table, &["rm", "pgfence", "setup", "init"], None)
        .expect(0, "the owner creates");
    run(&owner_url, &table, &["put", "app", "cfg", "greeting", "hello"], None).expect(0, "put");

    // Nothing granted yet: doctor and put name the same first grant.
    let usage = format!("GRANT USAGE ON SCHEMA {schema} TO {app}");
    let report = doctor(&app_url, &[], 1);
    let (status, detail) = doctor_check(&report, "privileges");
    assert!(status == "fail" && detail.contains(&usage), "{report}");
    let put = run(&app_url, &table, &["put", "app", "cfg", "k", "v"], None);
    assert!(put.expect(1, "put without grants").stderr.contains(&usage), "{put:?}");

    // The documented grants, less INSERT on the lease table: both name that table.
    let grants =
        documented_grants("### Tables an administrator created", &schema, "node_state", &app);
    let lease = format!("{schema}.node_state_lease");
    let short = format!("GRANT SELECT, UPDATE ON {lease} TO {app};");
    for grant in &grants {
        let grant =
            grant.replace(&format!("GRANT SELECT, INSERT, UPDATE ON {lease} TO {app};"), &short);
        query(&admin, &grant);
    }
    let report = doctor(&app_url, &[], 1);
    let (status, detail) = doctor_check(&report, "privileges");
    assert!(
        status == "fail" && detail.contains(&format!("GRANT INSERT ON {lease} TO {app}")),
        "{report}"
    );
    let put = run(&app_url, &table, &["put", "app", "cfg", "k", "v"], None);
    let needed = format!("GRANT SELECT, INSERT, UPDATE ON {lease} TO {app}");
    assert!(put.expect(1, "put without INSERT").stderr.contains(&needed), "{put:?}");
    assert!(!put.stderr.contains("during"), "the command's words, not the library's: {put:?}");

    // All of them: doctor passes the role, and everything a writer does works.
    for grant in &grants {
        query(&admin, grant);
    }
    let report = doctor(&app_url, &[], 0);
    assert_eq!(doctor_check(&report, "privileges").0, "pass", "{report}");
    assert_eq!(doctor_check(&report, "schema version").0, "pass", "{report}");
    run(&app_url, &table, &["put", "app", "cfg", "k", "v"], None).expect(0, "put");
    run(&app_url, &table, &["rm", "app", "cfg", "k"], None).expect(0, "rm");
    let a = Holder::spawn(
        "A",
        &app_url,
        &table,
        &["--ttl", "3", "--write-every", "200", "--counter-key", "beat"],
    );
    let epoch = a.acquired().int("epoch");
    let b = Holder::spawn("B", &app_url, &table, &["--ttl", "3", "--wait"]);
    b.wait_for(0, "waiting", |e| e.int("epoch") == epoch);
    // Past two renewals (every second at TTL 3 s), still writing.
    thread::sleep(Duration::from_secs(3));
    a.writes(0, 3);
    a.stop("TERM", epoch);
    let next = b.acquired().int("epoch");
    assert_eq!(next, epoch + 1);
    b.stop("TERM", next);

    // The read-only role: the read commands work with SELECT alone, doctor --read-only passes
    // it, doctor (for a writer) fails it, and put names the grant it lacks.
    for grant in documented_grants("### Read-only roles", &schema, "node_state", &reader) {
        query(&admin, &grant);
    }
    let listed = run(&reader_url, &table, &["ls"], None);
    assert!(listed.expect(0, "ls").stdout().contains("app/cfg/greeting"), "{listed:?}");
    run(&reader_url, &table, &["ls", "app", "cfg"], None).expect(0, "ls NS SUB");
    let got = run(&reader_url, &table, &["get", "app", "cfg", "greeting"], None);
    assert_eq!(got.expect(0, "get").stdout, b"hello");
    let status = run(&reader_url, &table, &["status"], None);
    assert!(status.expect(0, "status").stdout().starts_with("free"), "{status:?}");
    let exported = run(&reader_url, &table, &["export"], None);
    assert!(exported.expect(0, "export").stdout().contains("greeting"), "{exported:?}");
    let report = doctor(&reader_url, &["--read-only"], 0);
    let (status, detail) = doctor_check(&report, "privileges");
    assert!(status == "pass" && detail.contains("may read"), "{report}");
    let report = doctor(&reader_url, &[], 1);
    let (status, detail) = doctor_check(&report, "privileges");
    assert!(status == "fail" && detail.contains("doctor --read-only"), "{report}");
    let put = run(&reader_url, &table, &["put", "app", "cfg", "k", "v"], None);
    // The first right it lacks: opening reads the version table first.
    let version = format!("{schema}.node_state_schema_version");
    let needed = format!("put needs SELECT on table {version}; fix: GRANT SELECT ON {version}");
    assert!(put.expect(1, "a reader's put").stderr.contains(&needed), "{put:?}");

    // Without SELECT on the lease table, status names exactly that grant, and ls still works.
    query(&admin, &format!("REVOKE SELECT ON {lease} FROM {reader}"));
    let status = run(&reader_url, &table, &["status"], None);
    let needed =
        format!("status needs SELECT on table {lease}; fix: GRANT SELECT ON {lease} TO {reader}");
    assert!(status.expect(1, "status without SELECT").stderr.contains(&needed), "{status:?}");
    let report = doctor(&reader_url, &["--read-only"], 1);
    let (status, detail) = doctor_check(&report, "privileges");
    assert!(
        status == "fail" && detail.contains(&format!("GRANT SELECT ON {lease} TO {reader}")),
        "{report}"
    );
    run(&reader_url, &table, &["ls"], None).expect(0, "ls without the lease table");
}

/// `import --from-ldk-fs`: an LDK FilesystemStore, v1 or v2 layout, moved into a table.
#[cfg(feature = "ldk-import")]
mod ldk_import {
    use std::collections::BTreeMap;
    use std::path::PathBuf;

    use lightning::util::persist::{KVStoreSync, MigratableKVStoreSync};
    use lightning_persister::fs_store::v1::FilesystemStore;
    use lightning_persister::fs_store::v2::FilesystemStoreV2;
    use pgfence::PgKvStore;
    use pgfence::ldk::LdkStore;

    use super::{run, server, unique_name};

    type Contents = BTreeMap<(String, String, String), Vec<u8>>;

    /// A directory removed when the test ends.
    struct TempDir(PathBuf);

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn contents<S: MigratableKVStoreSync>(store: &S) -> Contents {
        let keys = store.list_all_keys().expect("list_all_keys");
        let read = |(p, s, k): (String, String, String)| {
            let value = store.read(&p, &s, &k).expect("read");
            ((p, s, k), value)
        };
        keys.into_iter().map(read).collect()
    }

    /// Keys in every namespace shape LDK uses, with the names LDK gives them, and values of
    /// every byte (one empty).
    fn fill<S: KVStoreSync>(store: &S) {
        let monitor = "0101010101010101010101010101010101010101010101010101010101010101_0";
        let rows: [(&str, &str, &str, Vec<u8>); 6] = [
            ("", "", "manager", (0..=255).collect()),
            ("", "", "network_graph", vec![7; 70_000]),
            ("monitors", "", monitor, vec![1, 2, 3]),
            ("monitor_updates", monitor, "1", vec![]),
            ("bdk_wallet", "", "descriptor", b"wpkh(...)".to_vec()),
            ("payments", "", "abcdef", vec![0; 3]),
        ];
        for (p, s, k, v) in rows {
            store.write(p, s, k, v).expect("write to the filesystem store");
        }
    }

    fn table_contents(table: &str) -> Contents {
        let builder = PgKvStore::builder_from_config(server().config()).table(table);
        let store = LdkStore::open(builder).expect("open the imported table");
        let found = contents(&store);
        store.close().expect("close");
        found
    }

    /// Both layouts: every key and value arrives; a table with keys is refused (exit 2,
    /// nothing written) unless `--force`.
    #[test]
    fn filesystem_store_v1_and_v2_move_into_a_table() {
        let url = server().url();
        for layout in ["v1", "v2"] {
            let dir = TempDir(std::env::temp_dir().join(unique_name("cli_ldkfs")));
            let source = match layout {
                "v1" => {
                    let store = FilesystemStore::new(dir.0.clone());
                    fill(&store);
                    contents(&store)
                }
                _ => {
                    let store = FilesystemStoreV2::new(dir.0.clone()).expect("v2 store");
                    fill(&store);
                    contents(&store)
                }
            };
            assert_eq!(source.len(), 6, "{layout}");
            let table = unique_name("cli_ldkfs");
            let path = dir.0.to_str().unwrap();
            let ran = run(&url, &table, &["import", "--from-ldk-fs", path], None);
            let expected = format!(
                "imported 6 keys from an LDK FilesystemStore ({layout} layout), all verified\n"
            );
            assert_eq!(ran.expect(0, layout).stdout(), expected);
            assert_eq!(table_contents(&table), source, "{layout}: every key and value");

            // A second import into the now non-empty table is refused and changes nothing.
            let other = unique_name("cli_ldkfs_other");
            run(&url, &other, &["put", "a", "", "k", "v"], None).expect(0, "put");
            let before = table_contents(&other);
            let refused = run(&url, &other, &["import", "--from-ldk-fs", path], None);
            refused.expect(2, "non-empty table");
            assert!(refused.stderr.contains("--force"), "{refused:?}");
            assert_eq!(table_contents(&other), before, "{layout}: refused import wrote nothing");

            let forced =
                run(&url, &other, &["import", "--json", "--from-ldk-fs", path, "--force"], None);
            let json: serde_json::Value =
                serde_json::from_str(forced.expect(0, "--force").stdout().trim()).unwrap();
            assert_eq!(json["imported"], 6);
            assert_eq!(json["layout"], layout);
            let mut merged = source.clone();
            merged.extend(before);
            assert_eq!(table_contents(&other), merged, "{layout}: forced import keeps others");
        }
    }

    /// What must not be imported unasked is refused before the lease is taken, with exit 2 and
    /// nothing created: a node's storage directory instead of its `fs_store`, a directory that
    /// is not an LDK store, a node's secret, an empty directory.
    #[test]
    fn from_ldk_fs_refuses_what_is_not_an_ldk_store_a_secret_or_nothing() {
        let url = server().url();
        let import = |dir: &TempDir, extra: &[&str], code: i32| {
            let table = unique_name("cli_ldkfs_refused");
            let args = [&["import", "--from-ldk-fs", dir.0.to_str().unwrap()][..], extra].concat();
            let ran = run(&url, &table, &args, None);
            ran.expect(code, &format!("{args:?}"));
            if code != 0 {
                run(&url, &table, &["status"], None).expect(6, "nothing was created");
            }
            (ran.stdout(), ran.stderr)
        };
        let temp = || TempDir(std::env::temp_dir().join(unique_name("cli_ldkfs_dir")));

        // A node's storage directory: its store in fs_store, its seed beside it.
        let node = temp();
        fill(&FilesystemStore::new(node.0.join("fs_store")));
        std::fs::write(node.0.join("keys_seed"), [7u8; 64]).unwrap();
        let (_, stderr) = import(&node, &[], 2);
        assert!(stderr.contains(node.0.join("fs_store").to_str().unwrap()), "{stderr}");

        // A store with the seed among its keys, as LDK's sample node keeps it.
        let sample = temp();
        let store = FilesystemStore::new(sample.0.clone());
        fill(&store);
        store.write("", "", "keys_seed", vec![7; 32]).unwrap();
        let (_, stderr) = import(&sample, &[], 2);
        assert!(stderr.contains("keys_seed") && stderr.contains("--include-secrets"), "{stderr}");
        let (stdout, _) = import(&sample, &["--include-secrets"], 0);
        assert!(stdout.starts_with("imported 7 keys"), "{stdout}");

        // Keys, but none of LDK's.
        let other = temp();
        FilesystemStore::new(other.0.clone()).write("payments", "", "abcdef", vec![1]).unwrap();
        let (_, stderr) = import(&other, &[], 2);
        assert!(stderr.contains("not an LDK store"), "{stderr}");

        // Nothing at all.
        let empty = temp();
        std::fs::create_dir_all(&empty.0).unwrap();
        let (_, stderr) = import(&empty, &[], 2);
        assert!(stderr.contains("--allow-empty"), "{stderr}");
        let (stdout, _) = import(&empty, &["--allow-empty"], 0);
        assert!(stdout.starts_with("imported 0 keys"), "{stdout}");
    }

    /// A missing directory is a usage error; `--force` needs `--from-ldk-fs`.
    #[test]
    fn from_ldk_fs_argument_errors() {
        let (url, table) = (server().url(), unique_name("cli_ldkfs_args"));
        let missing = std::env::temp_dir().join(unique_name("cli_nonexistent"));
        run(&url, &table, &["import", "--from-ldk-fs", missing.to_str().unwrap()], None)
            .expect(2, "missing directory");
        run(&url, &table, &["import", "--force"], None).expect(2, "--force alone");
        run(&url, &table, &["import", "--include-secrets"], None).expect(2, "alone too");
        // An empty export is refused too, unless asked.
        let empty = run(&url, &table, &["import"], Some(b""));
        assert!(empty.expect(2, "an empty import").stderr.contains("--allow-empty"), "{empty:?}");
        let allowed = run(&url, &table, &["import", "--allow-empty"], Some(b""));
        assert_eq!(allowed.expect(0, "an empty import, asked").stdout(), "imported 0 keys\n");
    }
}

// ---------------------------------------------------------------------------------------------
// Examples
// ---------------------------------------------------------------------------------------------

/// The debug examples of the workspace, built once by cargo (a no-op when they are fresh):
/// `cargo test --test cli` builds only this test and the binary. Their directory.
fn examples() -> &'static std::path::Path {
    static BUILT: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    BUILT.get_or_init(|| {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
        let status = Command::new(cargo)
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .args(["build", "--workspace", "--all-features", "--examples", "--quiet"])
            .status()
            .expect("run cargo build --examples");
        assert!(status.success(), "cargo build --examples: {status}");
        // This test runs from target/debug/deps; the examples are in target/debug/examples.
        let exe = std::env::current_exe().expect("the test's path");
        exe.parent().and_then(|deps| deps.parent()).expect("target/debug").join("examples")
    })
}

/// Runs example `name` with `args`, with `DATABASE_URL` set to the test server's (killed
/// after [`GUARD`]).
fn run_example(name: &str, args: &[&str]) -> Ran {
    let mut command = Command::new(examples().join(name));
    for variable in pgfence::env::VARIABLES {
        command.env_remove(variable);
    }
    let mut child = command
        .args(args)
        .env("DATABASE_URL", server().url())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("spawn example {name}: {e}"));
    let (mut out, mut err) = (child.stdout.take().unwrap(), child.stderr.take().unwrap());
    let stdout = thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = out.read_to_end(&mut buf);
        buf
    });
    let mut guard = Guard { name: name.to_owned(), child, readers: Vec::new() };
    let mut stderr = String::new();
    let _ = err.read_to_string(&mut stderr);
    let status = guard.wait_exit(GUARD).unwrap_or_else(|| panic!("example {name} hung"));
    Ran { code: status.code(), stdout: stdout.join().unwrap(), stderr }
}

/// Tables of the test server whose name is `prefix` and a `unique_name` suffix.
fn tables_named(prefix: &str) -> Vec<String> {
    let sql = format!(
        "SELECT relname::text FROM pg_class WHERE relkind = 'r' \
         AND relname ~ '^{prefix}_[0-9a-f]{{16}}(_lease|_schema_version|_crash_marker)?$'"
    );
    query(&server().config(), &sql).iter().map(|row| row.get(0)).collect()
}

/// Finding 9: every example answers `--help` with usage on stdout and exit 0 (batch_shapes
/// exited 1, demo and ldk ran). On a given server (`DATABASE_URL`), `demo` and `bench` use it
/// and leave no tables behind; a debug build of `bench` warns that its figures need
/// `--release`.
#[test]
fn examples_answer_help_and_leave_no_tables_on_a_given_server() {
    for name in ["demo", "ldk", "batch_shapes", "bench"] {
        let help = run_example(name, &["--help"]);
        assert_eq!(help.code, Some(0), "{name} --help: {help:?}");
        assert!(help.stdout().starts_with("usage: "), "{name} --help: {help:?}");
    }
    let bad = run_example("batch_shapes", &["many"]);
    assert!(bad.code == Some(2) && bad.stderr.starts_with("usage: "), "{bad:?}");

    let before = tables_named("demo");
    let demo = run_example("demo", &[]);
    assert_eq!(demo.code, Some(0), "demo: {demo:?}");
    assert!(demo.stdout().starts_with("Using DATABASE_URL."), "{demo:?}");
    assert_eq!(tables_named("demo"), before, "demo left its tables");

    let before = tables_named("bench");
    let args = ["--concurrency", "1", "--duration-secs", "0.2", "--rounds", "1"];
    let bench = run_example("bench", &[&args[..], &["--keys-per-writer", "2"]].concat());
    assert_eq!(bench.code, Some(0), "bench: {bench:?}");
    assert!(!bench.stderr.contains("private PostgreSQL"), "bench used DATABASE_URL: {bench:?}");
    assert!(bench.stderr.starts_with("warning: a debug build"), "{bench:?}");
    assert!(bench.stdout().contains("--release"), "the table says so too: {bench:?}");
    assert_eq!(tables_named("bench"), before, "bench left its tables");
}

/// Issue 30, item 2: the options are consistent. One duration syntax; `--table` from
/// `PGFENCE_TABLE`; a bad variable named as the variable; a mistyped option gets a
/// suggestion; a command's help lists its own options apart from the connection options;
/// `--metrics-addr` takes `:PORT` and a host name; errors are JSON under `--json`.
#[test]
fn options_are_consistent_and_errors_follow_json() {
    let (url, table) = (server().url(), unique_name("cli_options"));
    // Durations: units everywhere, a bare number in the option's own unit.
    let args = ["--ttl", "30s", "--write-every", "200ms", "--counter-key", "beat"];
    let a = Holder::spawn("A", &url, &table, &args);
    let epoch = a.acquired().int("epoch");
    a.writes(0, 2);
    a.stop("TERM", epoch);
    let bad = run(&url, &table, &["hold", "--ttl", "30x"], None);
    assert!(bad.expect(2, "--ttl 30x").stderr.contains("250ms, 30s, 5m, 1h"), "{bad:?}");

    // PGFENCE_TABLE stands in for --table, which wins over it.
    run(&url, &table, &["put", "a", "b", "c", "v"], None).expect(0, "put");
    let mut command = Command::new(BIN);
    for variable in pgfence::env::VARIABLES {
        command.env_remove(variable);
    }
    let got = command
        .args(["--database-url", &url, "get", "a", "b", "c"])
        .env("PGFENCE_TABLE", &table)
        .output()
        .expect("run pgfence");
    assert_eq!(got.stdout, b"v", "{got:?}");
    let env = [("PGFENCE_TABLE", "not a table")];
    let named = run_env(&url, &table, &["get", "a", "b", "c"], None, &env);
    assert_eq!(named.expect(0, "--table wins").stdout, b"v");

    // A bad variable is named as the variable; a bad option as the option.
    let env = [("PGFENCE_POOL_MODE", "sesion")];
    let bad = run_env(&url, &table, &["status"], None, &env);
    assert!(bad.expect(2, "bad PGFENCE_POOL_MODE").stderr.contains("PGFENCE_POOL_MODE"), "{bad:?}");
    let bad = run(&url, &table, &["--pool-mode", "sesion", "status"], None);
    let stderr = &bad.expect(2, "bad --pool-mode").stderr;
    assert!(stderr.contains("--pool-mode") && !stderr.contains("PGFENCE_POOL_MODE"), "{bad:?}");

    // A mistyped option: the nearest of this command's options, or none.
    let typo = run(&url, &table, &["hold", "--ttll", "3"], None);
    assert!(typo.expect(2, "--ttll").stderr.contains("did you mean '--ttl'?"), "{typo:?}");
    let typo = run(&url, &table, &["put", "a", "b", "c", "--alow-empty"], None);
    let stderr = &typo.expect(2, "--alow-empty").stderr;
    assert!(stderr.contains("did you mean '--allow-empty'?"), "{typo:?}");
    let far = run(&url, &table, &["status", "--bogus"], None);
    assert!(!far.expect(2, "--bogus").stderr.contains("did you mean"), "{far:?}");

    // A command's help: its options first, the connection options under their own heading.
    let help = run(&url, &table, &["hold", "--help"], None);
    let help = help.expect(0, "hold --help").stdout();
    let (own, rest) = help.split_once("Connection options:").expect("a connection heading");
    assert!(own.contains("--ttl") && own.contains("--wait") && !own.contains("--database-url"));
    assert!(rest.contains("--database-url") && !rest.contains("--ttl"), "{help}");

    // Errors under --json: one JSON object on stderr, with the exit code.
    let missing = run(&url, &unique_name("cli_options_none"), &["status", "--json"], None);
    assert_eq!(missing.code, Some(6), "{missing:?}");
    let error: Value = serde_json::from_str(missing.stderr.trim()).expect("a JSON error");
    assert_eq!(error["exit_code"], 6, "{error}");
    assert!(error["error"].as_str().unwrap().contains("no table"), "{error}");
    let usage = run(&url, &table, &["--json", "status", "--bogus"], None);
    let error: Value = serde_json::from_str(usage.stderr.trim()).expect("a JSON usage error");
    assert_eq!((usage.code, error["exit_code"].as_i64()), (Some(2), Some(2)), "{usage:?}");

    // --metrics-addr: every interface with :PORT; a host name.
    for addr in [format!(":{}", free_port()), format!("localhost:{}", free_port())] {
        let args = ["--ttl", "3", "--metrics-addr", &addr];
        let m = Holder::spawn("M", &url, &table, &args);
        let epoch = m.acquired().int("epoch");
        let port = addr.rsplit_once(':').unwrap().1;
        let (code, text) = curl(&format!("localhost:{port}"), "/metrics");
        assert!(code == "200" && text.contains("pgfence_lease_held"), "{addr}: {code} {text}");
        m.stop("TERM", epoch);
    }
    let bad = run(&url, &table, &["hold", "--metrics-addr", "9187"], None);
    assert!(bad.expect(2, "--metrics-addr 9187").stderr.contains(":PORT"), "{bad:?}");
}

/// A running example, its stdout read line by line as it comes, each with when it was read.
struct Running {
    guard: Guard,
    lines: Arc<Mutex<Vec<(Instant, String)>>>,
}

impl Running {
    fn spawn(name: &str, args: &[&str]) -> Running {
        let mut command = Command::new(examples().join(name));
        for variable in pgfence::env::VARIABLES {
            command.env_remove(variable);
        }
        let mut child = command
            .args(args)
            .env("DATABASE_URL", server().url())
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("spawn example {name}: {e}"));
        let out = child.stdout.take().expect("stdout");
        let lines = Arc::new(Mutex::new(Vec::new()));
        let read = Arc::clone(&lines);
        let reader = thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                read.lock().unwrap().push((Instant::now(), line));
            }
        });
        Running { guard: Guard { name: name.to_owned(), child, readers: vec![reader] }, lines }
    }

    /// When the first line starting with `prefix` was read; fails after [`GUARD`].
    fn wait_for(&self, prefix: &str) -> Instant {
        let deadline = Instant::now() + GUARD;
        loop {
            let lines = self.lines.lock().unwrap();
            if let Some((at, _)) = lines.iter().find(|(_, line)| line.starts_with(prefix)) {
                return *at;
            }
            assert!(Instant::now() < deadline, "{}: no {prefix:?} in {lines:?}", self.guard.name);
            drop(lines);
            thread::sleep(Duration::from_millis(20));
        }
    }
}

/// Issue 30, item 3: the failover example of docs/design.md is `examples/failover.rs`, which
/// builds with the README's tokio features. Run twice, one becomes active and says so; SIGTERM
/// (as systemd, Docker and Kubernetes send it) releases the lease, so the standby takes over
/// at once rather than after the 30 s TTL; SIGTERM to a standby ends it too.
#[test]
fn the_failover_example_is_documented_and_stops_cleanly_on_sigterm() {
    let example = include_str!("../examples/failover.rs");
    let body = &example[example.find("use std::time::Duration;").expect("the program")..];
    let design = include_str!("../docs/design.md");
    assert!(design.contains(&format!("```rust,no_run\n{body}```")), "design.md shows the example");
    // CI builds examples with every dev-dependency, whose tokio has every feature: so the
    // README's tokio line is checked against what the program uses.
    let readme = include_str!("../README.md");
    let line = readme.lines().find(|l| l.starts_with("tokio = {")).expect("README's tokio line");
    let mut needed = vec!["macros", "rt-multi-thread"];
    if body.contains("tokio::signal") {
        needed.push("signal");
    }
    for feature in needed {
        assert!(line.contains(&format!("\"{feature}\"")), "README's tokio needs {feature}: {line}");
    }

    let table = unique_name("cli_failover_example");
    let a = Running::spawn("failover", &[&table]);
    a.wait_for("active: ");
    let b = Running::spawn("failover", &[&table]);
    b.wait_for("standing by: ");
    let mut c = Running::spawn("failover", &[&table]);
    c.wait_for("standing by: ");
    // A standby ends at once, never having held the lease.
    c.guard.signal("TERM");
    assert_eq!(c.guard.wait_exit(GUARD).and_then(|s| s.code()), Some(0), "the standby exits 0");

    let mut a = a;
    let stopped = Instant::now();
    a.guard.signal("TERM");
    assert_eq!(a.guard.wait_exit(GUARD).and_then(|s| s.code()), Some(0), "A exits 0");
    a.wait_for("shutting down: releasing the lease");
    let active = b.wait_for("active: ");
    let waited = active.saturating_duration_since(stopped);
    assert!(waited < Duration::from_secs(10), "released, not expired (TTL 30 s): {waited:?}");
    let mut b = b;
    b.guard.signal("INT");
    assert_eq!(b.guard.wait_exit(GUARD).and_then(|s| s.code()), Some(0), "B exits 0 on Ctrl-C");
    query(
        &server().config(),
        &format!(
            "DROP TABLE \"{table}\", \"{table}_lease\", \"{table}_schema_version\", \
             \"{table}_crash_marker\""
        ),
    );
}

/// A port nothing listens on now (bound, then freed).
fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind a free port");
    listener.local_addr().expect("local address").port()
}

/// `GET http://addr/path` with curl, a real HTTP client: the status code and the body.
fn curl(addr: &str, path: &str) -> (String, String) {
    let out = Command::new("curl")
        .args(["-sS", "--max-time", "10", "-w", "\n%{http_code}"])
        .arg(format!("http://{addr}{path}"))
        .output()
        .expect("run curl");
    assert!(out.status.success(), "curl {addr}{path}: {out:?}");
    let text = String::from_utf8(out.stdout).expect("utf-8");
    let (body, code) = text.rsplit_once('\n').expect("the status code line");
    (code.to_owned(), body.to_owned())
}

/// The value of the sample `name{table="TABLE"[,labels]}` in a Prometheus text exposition.
fn sample(text: &str, name: &str, table: &str, labels: &str) -> f64 {
    let sep = if labels.is_empty() { "" } else { "," };
    let series = format!("{name}{{table=\"{table}\"{sep}{labels}}} ");
    let line = text.lines().find(|l| l.starts_with(&series));
    let value = line.unwrap_or_else(|| panic!("no {series:?} in:\n{text}"));
    value[series.len()..].parse().unwrap_or_else(|e| panic!("{value:?}: {e}"))
}

/// `hold --metrics-addr` serves Prometheus text. Scraped twice with curl, the write and
/// renewal counters have moved, the lease is shown held with its epoch, and every write was
/// timed. Only `/metrics` is served.
#[test]
fn hold_serves_metrics_that_move_between_scrapes() {
    let (url, table) = (server().url(), unique_name("cli_metrics"));
    let addr = format!("127.0.0.1:{}", free_port());
    let args = ["--ttl", "3", "--write-every", "50", "--counter-key", "c", "--metrics-addr", &addr];
    let holder = Holder::spawn("M", &url, &table, &args);
    let epoch = holder.acquired().int("epoch");
    let at = holder.writes(0, 3);
    let (code, first) = curl(&addr, "/metrics");
    assert_eq!(code, "200", "{first}");
    assert_eq!(sample(&first, "pgfence_lease_held", &table, ""), 1.0);
    assert_eq!(sample(&first, "pgfence_lease_epoch", &table, ""), epoch as f64);
    assert!(sample(&first, "pgfence_lease_deadline_seconds", &table, "") > 0.0, "{first}");
    let writes = |text: &str| sample(text, "pgfence_operations_total", &table, "op=\"write\"");
    let renewals = |text: &str| sample(text, "pgfence_renewals_total", &table, "outcome=\"ok\"");
    assert!(writes(&first) >= 3.0, "{first}");

    // Renewal runs every second (TTL 3 s): wait for one more, and for more writes.
    holder.writes(at, 3);
    let deadline = Instant::now() + GUARD;
    let second = loop {
        let (_, text) = curl(&addr, "/metrics");
        if renewals(&text) > renewals(&first) && writes(&text) > writes(&first) {
            break text;
        }
        assert!(Instant::now() < deadline, "counters did not move:\n{first}\n---\n{text}");
        thread::sleep(Duration::from_millis(200));
    };
    let timed = "pgfence_operation_duration_seconds_count";
    assert!(sample(&second, timed, &table, "op=\"write\"") >= writes(&first), "{second}");
    let errors = sample(&second, "pgfence_operation_errors_total", &table, "op=\"write\"");
    assert_eq!(errors, 0.0);
    assert_eq!(sample(&second, "pgfence_fail_closed_total", &table, "reason=\"fenced\""), 0.0);
    assert!(second.contains("# TYPE pgfence_renewal_duration_seconds histogram"), "{second}");
    assert_eq!(curl(&addr, "/other").0, "404");
    holder.stop("TERM", epoch);
}

/// An address already in use is a usage error (exit 2) before the lease is taken.
#[test]
fn hold_with_a_metrics_address_in_use_exits_2_without_the_lease() {
    let (url, table) = (server().url(), unique_name("cli_metrics_busy"));
    let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = taken.local_addr().expect("local address").to_string();
    let ran = run(&url, &table, &["hold", "--metrics-addr", &addr], None);
    ran.expect(2, "metrics address in use");
    assert!(ran.stderr.contains("--metrics-addr"), "{}", ran.stderr);
    let sql = format!("SELECT to_regclass('\"{table}_lease\"') IS NULL");
    let rows = query(&server().config(), &sql);
    assert!(rows[0].get::<_, bool>(0), "nothing was created, no lease was taken");
}
