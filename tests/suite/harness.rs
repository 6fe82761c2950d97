//! Checks of the test harness itself (`pgfence_testing`): the shared server, caller-owned
//! clusters, the cleanup when a test process exits or is killed, and the fault-injecting proxy.
//!
//! Like every test of the crate, these need a real PostgreSQL: `DATABASE_URL`, or the server
//! binaries to start a private cluster. Without either they fail; none of them skips.

use std::io::{BufRead, BufReader, Read};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

use pgfence_testing::{
    PASSWORD_ROLE, PASSWORD_ROLE_PASSWORD, Proxy, TestCluster, TestServer, pg_hba_password_role,
    unique_name,
};
use tokio_postgres::error::SqlState;
use tokio_postgres::{Client, Config, NoTls};

fn shared() -> &'static TestServer {
    TestServer::shared().unwrap_or_else(|e| panic!("no test server: {e}"))
}

async fn connect(config: &Config) -> Client {
    let (client, connection) =
        config.connect(NoTls).await.unwrap_or_else(|e| panic!("connect to {config:?}: {e}"));
    tokio::spawn(async move {
        let _ = connection.await;
    });
    client
}

async fn select_one(client: &Client) -> Result<i32, tokio_postgres::Error> {
    Ok(client.query_one("SELECT 1::int4", &[]).await?.get(0))
}

#[tokio::test]
async fn shared_server_answers_select_1() {
    let server = shared();
    let client = server.connect().await.expect("connect to the shared server");
    assert_eq!(select_one(&client).await.expect("SELECT 1"), 1);
    // The URL describes the same server.
    let by_url: Config = server.url().parse().expect("url() parses as a Config");
    assert_eq!(select_one(&connect(&by_url).await).await.unwrap(), 1);
    if server.is_private() {
        assert_eq!(by_url.get_ports(), [server.port()]);
        assert!(server.data_dir().expect("private data dir").is_dir());
    }
}

/// The shared server is one that pgfence supports: PostgreSQL 13 or later. It prints
/// `server version: <SELECT version()>`, which `scripts/pg-matrix` reads (with `--nocapture`) to
/// check that the harness started the binaries it put first on `PATH`.
#[tokio::test]
async fn server_is_a_supported_version() {
    let client = shared().connect().await.expect("connect to the shared server");
    let row = client
        .query_one("SELECT version(), current_setting('server_version_num')::int4", &[])
        .await
        .expect("SELECT version()");
    let (version, number): (String, i32) = (row.get(0), row.get(1));
    println!("server version: {version}");
    assert!(version.starts_with("PostgreSQL "), "version(): {version}");
    assert!(number >= 13_00_00, "server_version_num {number} ({version}): 13 or later is needed");
}

#[test]
fn concurrent_shared_calls_get_the_same_server() {
    const THREADS: usize = 8;
    let barrier = Arc::new(Barrier::new(THREADS));
    let threads: Vec<_> = (0..THREADS)
        .map(|_| {
            let barrier = Arc::clone(&barrier);
            std::thread::spawn(move || {
                barrier.wait();
                TestServer::shared()
                    .map(|server| (server as *const TestServer as usize, server.port()))
            })
        })
        .collect();
    let results: Vec<_> = threads
        .into_iter()
        .map(|t| t.join().expect("thread panicked").expect("shared()"))
        .collect();
    assert!(results.iter().all(|r| *r == results[0]), "different servers: {results:?}");
    assert_eq!(results[0].1, shared().port());
}

#[tokio::test]
async fn password_role_needs_the_right_password() {
    let server = shared();
    assert_eq!(pg_hba_password_role(), (PASSWORD_ROLE, PASSWORD_ROLE_PASSWORD));
    server.ensure_password_role().await.expect("create the password role");

    match server.password_role_config("wrong-password").connect(NoTls).await {
        Ok(_) => panic!(
            "the server accepted a wrong password for {PASSWORD_ROLE} at {}: its pg_hba.conf \
             must require a password (scram-sha-256 or md5) for that role over TCP",
            server.url()
        ),
        Err(e) => assert_eq!(e.code(), Some(&SqlState::INVALID_PASSWORD), "{e}"),
    }

    let client = connect(&server.password_role_config(PASSWORD_ROLE_PASSWORD)).await;
    let user: String = client.query_one("SELECT current_user::text", &[]).await.unwrap().get(0);
    assert_eq!(user, PASSWORD_ROLE);
}

#[tokio::test]
async fn unique_names_are_safe_and_distinct() {
    let a = unique_name("Harness Test-ä");
    let b = unique_name("Harness Test-ä");
    assert_ne!(a, b);
    for name in [&a, &b, &unique_name(""), &unique_name("9lives"), &unique_name(&"x".repeat(100))] {
        assert!(name.len() <= 40, "{name}");
        assert!(name.starts_with(|c: char| c.is_ascii_lowercase()), "{name}");
        assert!(name.chars().all(|c| matches!(c, 'a'..='z' | '0'..='9' | '_')), "{name}");
    }
    // Usable unquoted as a table name.
    let client = shared().connect().await.unwrap();
    client
        .batch_execute(&format!("CREATE TABLE {a} (k int); DROP TABLE {a}"))
        .await
        .expect("unique name as a table name");
}

#[tokio::test]
async fn create_database_gives_a_usable_database() {
    let server = shared();
    let name = unique_name("harness_db");
    let config = server.create_database(&name).await.expect("create database");
    let client = connect(&config).await;
    let db: String = client.query_one("SELECT current_database()::text", &[]).await.unwrap().get(0);
    assert_eq!(db, name);
    drop(client);
    if !server.is_private() {
        // Not ours to keep on someone else's server.
        let admin = server.connect().await.unwrap();
        admin.batch_execute(&format!("DROP DATABASE {name}")).await.unwrap();
    }
}

#[tokio::test]
async fn cluster_restart_breaks_connections_and_keeps_data() {
    let cluster = TestCluster::start().expect("start a private cluster");
    let port = cluster.port();
    let client = cluster.connect().await.expect("connect");
    client.batch_execute("CREATE TABLE kept (v int); INSERT INTO kept VALUES (42)").await.unwrap();

    cluster.restart().expect("restart");
    let err = select_one(&client)
        .await
        .expect_err("a connection from before the restart must not survive it");
    assert!(client.is_closed(), "client still open after: {err}");

    let client = cluster.connect().await.expect("connect after the restart");
    let v: i32 = client.query_one("SELECT v FROM kept", &[]).await.unwrap().get(0);
    assert_eq!(v, 42);
    assert_eq!(cluster.port(), port);

    cluster.stop().expect("stop");
    assert!(cluster.connect().await.is_err(), "connected to a stopped server");
    cluster.start_again().expect("start again");
    assert_eq!(select_one(&cluster.connect().await.unwrap()).await.unwrap(), 1);

    let data_dir = cluster.data_dir().to_owned();
    drop(cluster);
    assert!(!data_dir.exists(), "{} left behind", data_dir.display());
    assert!(
        TcpStream::connect((Ipv4Addr::LOCALHOST, port)).is_err(),
        "something still listens on port {port} after the cluster was dropped"
    );
}

/// A child process that is killed if the test fails before it means to kill it.
struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// When set, [`killed_test_process_leaves_no_server`] plays the test process that gets killed.
const CHILD_ENV: &str = "PGFENCE_HARNESS_KILLED_CHILD";

#[test]
fn killed_test_process_leaves_no_server() {
    if std::env::var_os(CHILD_ENV).is_some() {
        // The child: start servers, report them, and wait to be killed.
        let cluster = TestCluster::start().expect("start a private cluster");
        let shared = shared();
        for data_dir in [cluster.data_dir(), shared.data_dir().expect("private shared server")] {
            println!("CHILD-SERVER {} {}", postmaster_pid(data_dir), data_dir.display());
        }
        println!("CHILD-READY");
        // Wait to be killed. Should the parent die first, its end of our stdin closes.
        let _ = std::io::stdin().read_to_end(&mut Vec::new());
        panic!("the parent went away without killing the child");
    }

    // The parent: run this same test as a child process, SIGKILL it, and check that its
    // servers (a `TestCluster` and a private shared server) go away anyway.
    let mut child = KillOnDrop(
        Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                &crate::common::test_path(module_path!(), "killed_test_process_leaves_no_server"),
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_ENV, "1")
            // The child's shared server must be a private one.
            .env_remove("DATABASE_URL")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("spawn the child test process"),
    );
    let mut servers: Vec<(u32, PathBuf)> = Vec::new();
    let mut lines = BufReader::new(child.0.stdout.take().unwrap()).lines();
    loop {
        let line = lines.next().expect("the child ended before it was ready").unwrap();
        // libtest may print "test <name> ... " in front of the first line.
        if let Some((_, rest)) = line.split_once("CHILD-SERVER ") {
            let (pid, dir) = rest.split_once(' ').unwrap();
            servers.push((pid.parse().unwrap(), PathBuf::from(dir)));
        } else if line.contains("CHILD-READY") {
            break;
        }
    }
    assert_eq!(servers.len(), 2);
    for (pid, dir) in &servers {
        assert!(PathBuf::from(format!("/proc/{pid}")).exists(), "server {pid} not running");
        assert!(dir.exists());
    }

    child.0.kill().expect("SIGKILL the child");
    child.0.wait().unwrap();
    let killed = Instant::now();
    // Generous bound against hangs; cleanup normally takes well under a second.
    let deadline = killed + Duration::from_secs(20);
    for (pid, dir) in &servers {
        let root = dir.parent().unwrap();
        while (PathBuf::from(format!("/proc/{pid}")).exists() || root.exists())
            && Instant::now() < deadline
        {
            std::thread::sleep(Duration::from_millis(20));
        }
        assert!(
            !PathBuf::from(format!("/proc/{pid}")).exists(),
            "postmaster {pid} still running {:?} after its test process was killed",
            killed.elapsed()
        );
        assert!(!root.exists(), "{} left behind", root.display());
    }
    eprintln!("servers of the killed process gone after {:?}", killed.elapsed());
}

/// The postmaster's process id, from the first line of `postmaster.pid` in `data_dir`.
fn postmaster_pid(data_dir: &Path) -> u32 {
    let pid_file = std::fs::read_to_string(data_dir.join("postmaster.pid")).unwrap();
    pid_file.lines().next().unwrap().trim().parse().unwrap()
}

/// Whether process `pid` exists and has not exited. A zombie (exited, not yet reaped by its
/// parent) holds no port, memory or file any more, so it does not count.
fn is_running(pid: u32) -> bool {
    // "pid (comm) state ...": the state is the first field after the last ')'.
    std::fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        let state = stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().next());
        !matches!(state, None | Some("Z" | "X" | "x"))
    })
}

/// The running processes whose command line contains `text`, as `pid: command line`.
fn processes_mentioning(text: &str) -> Vec<String> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Some(pid) = entry.file_name().to_str().and_then(|name| name.parse::<u32>().ok()) else {
            continue;
        };
        // Gone since the listing: not running.
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else { continue };
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        if cmdline.contains(text) && is_running(pid) {
            found.push(format!("{pid}: {}", cmdline.trim_end()));
        }
    }
    found
}

/// When set, [`exited_test_process_leaves_no_server`] plays the test process that exits.
const EXITING_CHILD_ENV: &str = "PGFENCE_HARNESS_EXITING_CHILD";

/// A test process that ends normally has stopped its private shared server, deleted its
/// directory and reaped its watchdog before it has exited: nothing of it is left for whoever
/// waited for the process, not even a moment later. (A killed one relies on the watchdog, which
/// cleans up only after the process is gone: [`killed_test_process_leaves_no_server`].)
#[test]
fn exited_test_process_leaves_no_server() {
    if std::env::var_os(EXITING_CHILD_ENV).is_some() {
        // The child: start the shared server, keep a connection to it open on another thread,
        // report the server, and pass. libtest then exits the process with that thread still
        // running.
        let server = shared();
        let data_dir = server.data_dir().expect("private shared server").to_owned();
        let config = server.config();
        let (connected, is_connected) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build();
            runtime.expect("a runtime").block_on(async {
                let _client = connect(&config).await;
                connected.send(()).unwrap();
                std::future::pending::<()>().await
            })
        });
        is_connected.recv().expect("the connected thread failed");
        println!("CHILD-SERVER {} {}", postmaster_pid(&data_dir), data_dir.display());
        return;
    }

    // The parent: run this same test as a child process, wait for it to exit, and look at once.
    let output = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            &crate::common::test_path(module_path!(), "exited_test_process_leaves_no_server"),
            "--nocapture",
            "--test-threads=1",
        ])
        .env(EXITING_CHILD_ENV, "1")
        // The child's shared server must be a private one, also when DATABASE_URL is set here.
        .env_remove("DATABASE_URL")
        .stdin(Stdio::null())
        .output()
        .expect("run the child test process");
    // The checks come first, before anything that takes time: the watchdog would clean up a
    // moment later anyway, and must not be what passes this test.
    let stdout = String::from_utf8_lossy(&output.stdout);
    // libtest may print "test <name> ... " in front of the line.
    let server =
        stdout.lines().find_map(|line| line.split_once("CHILD-SERVER ")).map(|(_, rest)| {
            let (pid, dir) = rest.split_once(' ').unwrap();
            (pid.parse::<u32>().unwrap(), PathBuf::from(dir))
        });
    let Some((pid, data_dir)) = server else {
        panic!(
            "the child reported no server ({}):\n{stdout}\n{}",
            output.status,
            String::from_utf8_lossy(&output.stderr)
        );
    };
    let root = data_dir.parent().unwrap();
    let postmaster_running = is_running(pid);
    let root_exists = root.exists();
    let left = processes_mentioning(&root.to_string_lossy());

    assert!(
        output.status.success(),
        "the child test failed ({}):\n{stdout}\n{}",
        output.status,
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(!postmaster_running, "postmaster {pid} still running after its test process exited");
    assert!(!root_exists, "{} still there after its test process exited", root.display());
    assert!(
        left.is_empty(),
        "processes of the cluster in {} still running after its test process exited \
         (server or watchdog): {left:#?}",
        root.display()
    );
}

/// Via a proxy: a query works; a delay slows it down; refusing blocks new connections only;
/// `cut_all` breaks the connection; dropping the proxy closes its port.
async fn check_proxy() {
    let server = shared();
    let proxy =
        Proxy::start(server.tcp_addr().expect("server address")).await.expect("start the proxy");
    let via_proxy = server.config_via(proxy.addr());
    let client = connect(&via_proxy).await;
    assert_eq!(select_one(&client).await.expect("SELECT 1 via the proxy"), 1);
    assert_eq!(proxy.connection_count(), 1);

    proxy.set_delay(Duration::from_millis(50));
    let started = Instant::now();
    assert_eq!(select_one(&client).await.unwrap(), 1);
    let elapsed = started.elapsed();
    assert!(elapsed >= Duration::from_millis(50), "delayed query took {elapsed:?}");
    proxy.set_delay(Duration::ZERO);

    proxy.set_refuse(true);
    assert!(via_proxy.connect(NoTls).await.is_err(), "connected through a refusing proxy");
    assert_eq!(select_one(&client).await.unwrap(), 1, "refusing broke an existing connection");
    proxy.set_refuse(false);

    proxy.cut_all();
    let result = tokio::time::timeout(Duration::from_secs(30), select_one(&client))
        .await
        .expect("a query on a cut connection hung");
    assert!(result.is_err() || client.is_closed(), "connection survived cut_all");
    assert!(client.is_closed());

    let client = connect(&via_proxy).await;
    assert_eq!(select_one(&client).await.unwrap(), 1, "new connection after cut_all");

    let addr: SocketAddr = proxy.addr();
    drop(proxy);
    let result = tokio::time::timeout(Duration::from_secs(30), select_one(&client))
        .await
        .expect("a query through a dropped proxy hung");
    assert!(result.is_err(), "connection survived dropping the proxy");
    // The listener is gone once the aborted accept task has been dropped by the runtime.
    let deadline = Instant::now() + Duration::from_secs(10);
    while tokio::net::TcpStream::connect(addr).await.is_ok() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        tokio::net::TcpStream::connect(addr).await.is_err(),
        "the dropped proxy still accepts connections"
    );
}

#[tokio::test]
async fn proxy_on_current_thread_runtime() {
    check_proxy().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_on_multi_thread_runtime() {
    check_proxy().await;
}

/// A sub-millisecond delay: every round trip takes at least twice the one-way delay, and a
/// large answer (many chunks in flight at once) arrives whole and in order. Only lower bounds
/// are asserted; the median is printed, since how close it gets depends on the machine's load.
async fn check_proxy_sub_millisecond_delay() {
    const ONE_WAY: Duration = Duration::from_micros(300);
    let server = shared();
    let proxy =
        Proxy::start(server.tcp_addr().expect("server address")).await.expect("start the proxy");
    let client = connect(&server.config_via(proxy.addr())).await;
    let statement = client.prepare("SELECT 1::int4").await.expect("prepare SELECT 1");
    proxy.set_delay(ONE_WAY);

    let mut round_trips = Vec::new();
    for _ in 0..50 {
        let started = Instant::now();
        let one: i32 = client.query_one(&statement, &[]).await.expect("SELECT 1").get(0);
        round_trips.push(started.elapsed());
        assert_eq!(one, 1);
    }
    round_trips.sort();
    assert!(round_trips[0] >= 2 * ONE_WAY, "a round trip took only {:?}", round_trips[0]);
    eprintln!(
        "round trip with {ONE_WAY:?} each way: min {:?}, median {:?}, max {:?}",
        round_trips[0],
        round_trips[round_trips.len() / 2],
        round_trips[round_trips.len() - 1]
    );

    let rows: i32 = 200_000;
    let expected: String = (1..=rows).map(|i| i.to_string()).collect::<Vec<_>>().join(",");
    let got: String = client
        .query_one(
            "SELECT string_agg(i::text, ',' ORDER BY i) FROM generate_series(1, $1) i",
            &[&rows],
        )
        .await
        .expect("a large answer through the delay")
        .get(0);
    assert!(got == expected, "the large answer came out of order or incomplete");
}

#[tokio::test]
async fn proxy_sub_millisecond_delay_on_current_thread_runtime() {
    check_proxy_sub_millisecond_delay().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_sub_millisecond_delay_on_multi_thread_runtime() {
    check_proxy_sub_millisecond_delay().await;
}
