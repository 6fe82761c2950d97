//! A PostgreSQL cluster managed by Patroni: [`PatroniCluster`].

use std::fs;
use std::io;
use std::net::Ipv4Addr;
use std::os::unix::fs::DirBuilderExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use rustix::process::{Pid, Signal, kill_process};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_postgres::{Client, Config};

use crate::Replication;
use crate::cluster::{
    CONNECT_TIMEOUT, REAP_WAIT, SUPERUSER, SystemUser, annotate, find_bin_dir, is_executable,
    is_running, log_tail, server_user, wait_until,
};
use crate::connect_spawned;

/// The number of PostgreSQL nodes, each with a Patroni of its own.
const NODES: usize = 3;

/// How long the waits of the harness last before they fail: for etcd, a leader, streaming
/// replicas, a synchronous standby. A failover takes about 10 s here; a loaded machine takes
/// longer.
const WAIT: Duration = Duration::from_secs(90);

/// How long one request to a REST API may take. A switchover is answered only once it is done.
const HTTP_TIMEOUT: Duration = Duration::from_secs(5);
const SWITCHOVER_TIMEOUT: Duration = Duration::from_secs(60);

/// Between two looks at the cluster's state.
const POLL: Duration = Duration::from_millis(100);

/// The PostgreSQL that Debian 12's Patroni 3.0.2 supports, if installed.
const PG15_BIN: &str = "/usr/lib/postgresql/15/bin";

/// The connect timeout of [`PatroniCluster::url`], in seconds. Without one, a connection
/// attempt to a frozen host hangs, and the next host is never tried.
const URL_CONNECT_TIMEOUT_SECS: u64 = 2;

/// The keeper of a cluster, for a test process that dies without dropping it (killed, or
/// aborted by a panic). It blocks reading a pipe whose only write end the test process holds.
/// End-of-file comes when that process drops it or dies. Then it kills what still runs, each
/// process only if its command line names the run directory (a pid may have been reused), and
/// deletes the directory. `$1` is the run directory.
///
/// Patroni first, so that it restarts nothing. Then each postmaster gets SIGQUIT (an immediate
/// shutdown that also ends its children and frees its shared memory), and SIGKILL 5 s later.
/// A SysV segment left by a killed postmaster (no process attached, created by that postmaster)
/// is removed.
const KEEPER_SCRIPT: &str = r#"cat >/dev/null 2>&1
root=$1
ours() { tr '\0' ' ' <"/proc/$1/cmdline" 2>/dev/null | grep -qF "$root"; }
for pid in $(cat "$root/pids" 2>/dev/null); do ours "$pid" && kill -KILL "$pid"; done
for file in "$root"/node*/data/postmaster.pid; do
  [ -f "$file" ] || continue
  pid=$(sed -n 1p "$file")
  ours "$pid" && kill -QUIT "$pid"
done
sleep 5
for file in "$root"/node*/data/postmaster.pid; do
  [ -f "$file" ] || continue
  pid=$(sed -n 1p "$file")
  ours "$pid" && kill -KILL "$pid"
  shmid=$(sed -n 7p "$file" | awk '{print $2}')
  awk -v id="$shmid" -v pid="$pid" '$2 == id && $5 == pid && $7 == 0 { found = 1 }
    END { exit !found }' /proc/sysvipc/shm 2>/dev/null && ipcrm -m "$shmid"
done
rm -rf "$root"
"#;

/// One etcd member, three PostgreSQL 15 nodes and a Patroni for each, on `127.0.0.1`: the
/// high-availability setup that many users run, for tests of switchovers, failovers and split
/// brain.
///
/// It uses the system's packages: Debian 12's `patroni` (3.0.2), `etcd-server` (3.4) and
/// `python3-etcd`, and PostgreSQL from `/usr/lib/postgresql/15/bin` (else the binaries a
/// [`TestCluster`](crate::TestCluster) would use). Patroni talks to etcd's v3 API. Every port is
/// a free loopback port. Every process runs as the `postgres` system user when the tests run as
/// root, since PostgreSQL refuses root. Everything lives in one run directory
/// `pgfence-test-patroni-*`, in `/dev/shm` (memory) if it can, else under
/// [`std::env::temp_dir`].
///
/// Patroni's settings are `ttl: 10`, `loop_wait: 2`, `retry_timeout: 3` and
/// `maximum_lag_on_failover: 1048576`, with `use_pg_rewind` and replication slots. With
/// [`Replication::Synchronous`] it runs in `synchronous_mode`: Patroni names one replica the
/// synchronous standby, and only that one may be promoted. pg_hba trusts everyone on
/// `127.0.0.1`, replication included. Node 0 bootstraps the cluster and is the first leader.
///
/// Dropping it stops everything and deletes the run directory, also during a panic's unwinding.
/// Each process is signalled by its own pid, after checking that it is still the one started:
/// Patroni and etcd are children of this process, and a postmaster (not Patroni's child) must
/// have this cluster's data directory on its command line. A keeper process does the same when
/// the test process dies without dropping it.
///
/// The waiting methods are async and poll. Patroni's REST API and etcd are asked over a minimal
/// HTTP/1.1 client. The others return at once.
#[derive(Debug)]
pub struct PatroniCluster {
    root: PathBuf,
    scope: String,
    replication: Replication,
    run_as: Option<SystemUser>,
    bin_dir: PathBuf,
    patroni: PathBuf,
    etcd_bin: PathBuf,
    etcd_port: u16,
    etcd_peer_port: u16,
    etcd: Mutex<Option<Child>>,
    nodes: Vec<Node>,
    keeper: Mutex<Option<Keeper>>,
}

#[derive(Debug)]
struct Node {
    name: String,
    dir: PathBuf,
    data_dir: PathBuf,
    port: u16,
    rest_port: u16,
    /// The node's Patroni, while it runs (`None` after it was killed).
    patroni: Mutex<Option<Child>>,
}

#[derive(Debug)]
struct Keeper {
    child: Child,
    /// Never written to; closing it makes the keeper clean up.
    stdin: ChildStdin,
}

impl PatroniCluster {
    /// Starts etcd, then node 0, which bootstraps the cluster, then the two others. Returns
    /// once node 0 leads, both replicas stream from it, and, in synchronous mode, one of them
    /// is its synchronous standby.
    pub async fn start(replication: Replication) -> io::Result<PatroniCluster> {
        let cluster = PatroniCluster::prepare(replication)?;
        // From here on, an early return drops `cluster`, which stops what it started.
        cluster.start_etcd().await?;
        cluster.start_patroni(0)?;
        let leader = cluster.wait_for_leader().await?;
        if leader != 0 {
            return Err(io::Error::other(format!("node {leader} bootstrapped, not node 0")));
        }
        for node in 1..NODES {
            cluster.start_patroni(node)?;
        }
        cluster.wait_until_healthy().await?;
        Ok(cluster)
    }

    fn prepare(replication: Replication) -> io::Result<PatroniCluster> {
        let patroni = find_program("patroni", "/usr/bin/patroni", "patroni")?;
        let etcd_bin = find_program("etcd", "/usr/bin/etcd", "etcd-server")?;
        let pg15 = PathBuf::from(PG15_BIN);
        let bin_dir = if is_executable(&pg15.join("postgres")) { pg15 } else { find_bin_dir()? };
        let run_as = server_user()?;
        let id = uuid::Uuid::new_v4().simple().to_string()[..12].to_owned();
        let root =
            run_dir_parent().join(format!("pgfence-test-patroni-{}-{id}", std::process::id()));
        // Eight distinct ports: every listener is held until all are chosen. Each is free now;
        // one taken by someone else before its server binds it fails the start (rare).
        let mut held = Vec::new();
        let mut port = || -> io::Result<u16> {
            let listener = std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?;
            let port = listener.local_addr()?.port();
            held.push(listener);
            Ok(port)
        };
        let (etcd_port, etcd_peer_port) = (port()?, port()?);
        let mut nodes = Vec::new();
        for n in 0..NODES {
            let dir = root.join(format!("node{n}"));
            nodes.push(Node {
                name: format!("node{n}"),
                data_dir: dir.join("data"),
                dir,
                port: port()?,
                rest_port: port()?,
                patroni: Mutex::new(None),
            });
        }
        drop(held);
        fs::DirBuilder::new()
            .mode(0o700)
            .create(&root)
            .map_err(|e| annotate(e, format!("could not create {}", root.display())))?;
        // From here on, an early return drops `cluster`, which deletes `root`.
        let cluster = PatroniCluster {
            scope: format!("pgfence-{id}"),
            root,
            replication,
            run_as,
            bin_dir,
            patroni,
            etcd_bin,
            etcd_port,
            etcd_peer_port,
            etcd: Mutex::new(None),
            nodes,
            keeper: Mutex::new(None),
        };
        cluster.give_to_server_user(&cluster.root)?;
        // The keeper comes before the first process, so that nothing can outlive this process.
        *lock(&cluster.keeper) = Some(cluster.spawn_keeper()?);
        for node in &cluster.nodes {
            fs::DirBuilder::new().mode(0o700).create(&node.dir)?;
            fs::DirBuilder::new().mode(0o700).create(node.dir.join("sock"))?;
            cluster.give_to_server_user(&node.dir)?;
            cluster.give_to_server_user(&node.dir.join("sock"))?;
            let yml = node.dir.join("patroni.yml");
            fs::write(&yml, cluster.patroni_yml(node))?;
            cluster.give_to_server_user(&yml)?;
        }
        Ok(cluster)
    }

    fn patroni_yml(&self, node: &Node) -> String {
        let synchronous = self.replication == Replication::Synchronous;
        format!(
            "# Written by pgfence_testing::PatroniCluster.
scope: {scope}
namespace: /pgfence/
name: {name}
restapi:
  listen: 127.0.0.1:{rest}
  connect_address: 127.0.0.1:{rest}
etcd3:
  hosts: 127.0.0.1:{etcd}
# No /dev/watchdog here. Production should say `mode: required` (docs/deployments.md).
watchdog:
  mode: off
bootstrap:
  dcs:
    ttl: 10
    loop_wait: 2
    retry_timeout: 3
    maximum_lag_on_failover: 1048576
    synchronous_mode: {synchronous}
    postgresql:
      use_pg_rewind: true
      use_slots: true
      parameters:
        max_connections: 200
        shared_buffers: 16MB
        wal_keep_size: 16MB
        max_wal_size: 64MB
        wal_log_hints: 'on'
        # In the data directory, so deleted with it: a killed postmaster leaves its POSIX
        # segments in /dev/shm otherwise.
        dynamic_shared_memory_type: mmap
  # Numeric values must be strings, or the bootstrap fails. 1 MB WAL segments keep each node
  # near 30 MB.
  initdb:
  - encoding: UTF8
  - locale: C
  - data-checksums
  - wal-segsize: '1'
postgresql:
  listen: 127.0.0.1:{port}
  connect_address: 127.0.0.1:{port}
  data_dir: {data}
  bin_dir: {bin}
  pgpass: {dir}/pgpass
  authentication:
    superuser:
      username: {user}
    replication:
      username: {user}
    rewind:
      username: {user}
  parameters:
    unix_socket_directories: {dir}/sock
  pg_hba:
  - local all all trust
  - host all all 127.0.0.1/32 trust
  - host replication all 127.0.0.1/32 trust
",
            scope = self.scope,
            name = node.name,
            rest = node.rest_port,
            etcd = self.etcd_port,
            port = node.port,
            data = node.data_dir.display(),
            bin = self.bin_dir.display(),
            dir = node.dir.display(),
            user = SUPERUSER,
        )
    }

    async fn start_etcd(&self) -> io::Result<()> {
        let client = format!("http://127.0.0.1:{}", self.etcd_port);
        let peer = format!("http://127.0.0.1:{}", self.etcd_peer_port);
        let log = fs::File::create(self.root.join("etcd.log"))?;
        let mut command = self.command(&self.etcd_bin);
        command
            .args(["--name", "etcd0", "--data-dir"])
            .arg(self.root.join("etcd"))
            .args(["--listen-client-urls", &client, "--advertise-client-urls", &client])
            .args(["--listen-peer-urls", &peer, "--initial-advertise-peer-urls", &peer])
            .args(["--initial-cluster", &format!("etcd0={peer}")])
            .stdout(log.try_clone()?)
            .stderr(log);
        let child = command.spawn().map_err(|e| annotate(e, "could not start etcd".to_owned()))?;
        self.record_pid(child.id())?;
        *lock(&self.etcd) = Some(child);
        let port = self.etcd_port;
        wait_for("etcd to be healthy", || async move {
            let health = http(port, "GET", "/health", "", HTTP_TIMEOUT).await;
            Ok(matches!(health, Ok((200, body)) if body.contains("true")).then_some(()))
        })
        .await
        .map_err(|e| self.with_logs(e))
    }

    fn start_patroni(&self, n: usize) -> io::Result<()> {
        let node = &self.nodes[n];
        let log = fs::OpenOptions::new().create(true).append(true).open(node.log_file())?;
        let mut command = self.command(&self.patroni);
        command.arg(node.dir.join("patroni.yml")).stdout(log.try_clone()?).stderr(log);
        let child =
            command.spawn().map_err(|e| annotate(e, format!("could not start patroni {n}")))?;
        self.record_pid(child.id())?;
        *lock(&node.patroni) = Some(child);
        Ok(())
    }

    /// A command run as the server's system user, in the run directory, in a process group of
    /// its own: a Ctrl-C to the test must leave the cleanup to the keeper.
    fn command(&self, program: &Path) -> Command {
        let mut command = Command::new(program);
        command
            .current_dir(&self.root)
            .stdin(Stdio::null())
            .env("LC_ALL", "C")
            .env("HOME", &self.root)
            .env_remove("PGDATA")
            .env_remove("PGHOST")
            .env_remove("PGPORT")
            .env_remove("PGUSER")
            .process_group(0);
        if let Some(user) = self.run_as {
            command.uid(user.uid).gid(user.gid);
        }
        command
    }

    /// Appends `pid` to the list the keeper reads.
    fn record_pid(&self, pid: u32) -> io::Result<()> {
        use std::io::Write;
        let mut file =
            fs::OpenOptions::new().create(true).append(true).open(self.root.join("pids"))?;
        writeln!(file, "{pid}")
    }

    fn give_to_server_user(&self, path: &Path) -> io::Result<()> {
        match self.run_as {
            Some(user) => std::os::unix::fs::chown(path, Some(user.uid), Some(user.gid))
                .map_err(|e| annotate(e, format!("could not chown {}", path.display()))),
            None => Ok(()),
        }
    }

    fn spawn_keeper(&self) -> io::Result<Keeper> {
        let mut child = Command::new("/bin/sh")
            .arg("-c")
            .arg(KEEPER_SCRIPT)
            .arg("pgfence-test-patroni-keeper")
            .arg(&self.root)
            .current_dir("/")
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .process_group(0)
            .spawn()
            .map_err(|e| annotate(e, "could not start the keeper /bin/sh".to_owned()))?;
        // Close-on-exec, like every descriptor std makes: only this process holds it.
        let stdin = child.stdin.take().ok_or_else(|| io::Error::other("keeper has no stdin"))?;
        Ok(Keeper { child, stdin })
    }

    /// How it replicates: [`Replication::Synchronous`] is Patroni's `synchronous_mode`.
    pub fn replication(&self) -> Replication {
        self.replication
    }

    /// The number of nodes: 3.
    pub fn nodes(&self) -> usize {
        self.nodes.len()
    }

    /// Node `n`'s name in Patroni (`node0`, `node1`, `node2`), also its `application_name` in
    /// the leader's `pg_stat_replication`.
    pub fn name(&self, n: usize) -> &str {
        &self.nodes[n].name
    }

    /// Node `n`'s PostgreSQL port on `127.0.0.1`.
    pub fn port(&self, n: usize) -> u16 {
        self.nodes[n].port
    }

    /// Node `n`'s Patroni REST API port on `127.0.0.1`.
    pub fn rest_port(&self, n: usize) -> u16 {
        self.nodes[n].rest_port
    }

    /// Node `n`'s data directory.
    pub fn data_dir(&self, n: usize) -> &Path {
        &self.nodes[n].data_dir
    }

    /// A superuser configuration for node `n` alone, whatever its role.
    pub fn config(&self, n: usize) -> Config {
        let mut config = Config::new();
        config
            .host("127.0.0.1")
            .port(self.nodes[n].port)
            .user(SUPERUSER)
            .dbname(SUPERUSER)
            .connect_timeout(CONNECT_TIMEOUT);
        config
    }

    /// Opens a superuser connection to node `n`. Its connection task is spawned on the current
    /// tokio runtime.
    pub async fn connect(&self, n: usize) -> Result<Client, tokio_postgres::Error> {
        connect_spawned(&self.config(n)).await
    }

    /// The URL clients use: every node, `target_session_attrs=read-write` and a connect timeout
    /// of 2 s. A connection goes to the first node, in this order, that accepts writes.
    pub fn url(&self) -> String {
        self.url_of(&(0..self.nodes.len()).collect::<Vec<_>>())
    }

    /// [`PatroniCluster::url`] with only the nodes `nodes`, in that order. A router that follows
    /// Patroni (HAProxy checking `GET /primary`) never sends a new connection to a node whose
    /// Patroni is dead; leaving that node out of the URL does the same.
    pub fn url_of(&self, nodes: &[usize]) -> String {
        let hosts: Vec<String> =
            nodes.iter().map(|n| format!("127.0.0.1:{}", self.nodes[*n].port)).collect();
        format!(
            "postgres://{SUPERUSER}@{}/{SUPERUSER}?target_session_attrs=read-write\
             &connect_timeout={URL_CONNECT_TIMEOUT_SECS}",
            hosts.join(",")
        )
    }

    /// The node whose Patroni says it leads and whose PostgreSQL accepts writes, if any. A node
    /// whose Patroni is dead is never the leader here, even if its PostgreSQL still accepts
    /// writes.
    pub async fn leader(&self) -> Option<usize> {
        for n in 0..self.nodes.len() {
            if self.is_leader(n).await {
                return Some(n);
            }
        }
        None
    }

    async fn is_leader(&self, n: usize) -> bool {
        if !self.patroni_running(n) {
            return false;
        }
        let rest = self.nodes[n].rest_port;
        if !matches!(http(rest, "GET", "/primary", "", HTTP_TIMEOUT).await, Ok((200, _))) {
            return false;
        }
        let writable = "SELECT NOT pg_is_in_recovery()";
        matches!(self.query_bool(n, writable).await, Ok(true))
    }

    /// Waits for a leader (see [`PatroniCluster::leader`]) and returns it.
    pub async fn wait_for_leader(&self) -> io::Result<usize> {
        self.wait_for_leader_other_than(None).await
    }

    /// Waits for a leader other than `old`, as after a failover or switchover from it.
    pub async fn wait_for_new_leader(&self, old: usize) -> io::Result<usize> {
        self.wait_for_leader_other_than(Some(old)).await
    }

    async fn wait_for_leader_other_than(&self, old: Option<usize>) -> io::Result<usize> {
        let what = match old {
            Some(old) => format!("a leader other than node {old}"),
            None => "a leader".to_owned(),
        };
        wait_for(&what, || async {
            for n in (0..self.nodes.len()).filter(|n| Some(*n) != old) {
                if self.is_leader(n).await {
                    return Ok(Some(n));
                }
            }
            Ok(None)
        })
        .await
        .map_err(|e| self.with_logs(e))
    }

    /// Waits until `count` other nodes stream from `leader`: its `pg_stat_replication` shows
    /// each streaming, and each is on the leader's timeline. A former leader whose history
    /// forked may stream for a moment on its old timeline first; it rejoins only once rewound.
    pub async fn wait_for_replicas(&self, leader: usize, count: usize) -> io::Result<()> {
        wait_for(&format!("{count} replicas streaming from node {leader}"), || async move {
            let timeline = self.timeline(leader).await.ok();
            let mut streaming = 0;
            for n in (0..self.nodes.len()).filter(|n| *n != leader) {
                let sql = format!(
                    "SELECT count(*) FROM pg_stat_replication WHERE application_name = '{}' \
                     AND state = 'streaming'",
                    self.nodes[n].name
                );
                if self.query_i64(leader, &sql).await.unwrap_or(0) == 1
                    && timeline.is_some()
                    && self.timeline(n).await.ok() == timeline
                {
                    streaming += 1;
                }
            }
            Ok((streaming >= count).then_some(()))
        })
        .await
        .map_err(|e| self.with_logs(e))
    }

    /// In synchronous mode: waits until Patroni names a synchronous standby (`GET /sync` is 200
    /// on it) and the leader's `pg_stat_replication` shows it streaming as `sync`. Returns it.
    ///
    /// After bootstrap, a switchover or a failover there is a gap of a few seconds without one.
    /// A switchover in that gap fails, and a failover finds no node it may promote.
    pub async fn wait_for_sync_standby(&self) -> io::Result<usize> {
        if self.replication != Replication::Synchronous {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "no synchronous standby: the cluster is asynchronous",
            ));
        }
        wait_for("a synchronous standby", || async {
            let Some(leader) = self.leader().await else { return Ok(None) };
            for n in (0..self.nodes.len()).filter(|n| *n != leader && self.patroni_running(*n)) {
                let rest = self.nodes[n].rest_port;
                if !matches!(http(rest, "GET", "/sync", "", HTTP_TIMEOUT).await, Ok((200, _))) {
                    continue;
                }
                let sql = format!(
                    "SELECT count(*) FROM pg_stat_replication WHERE application_name = '{}' \
                     AND state = 'streaming' AND sync_state = 'sync'",
                    self.nodes[n].name
                );
                if self.query_i64(leader, &sql).await.unwrap_or(0) == 1 {
                    return Ok(Some(n));
                }
            }
            Ok(None)
        })
        .await
        .map_err(|e| self.with_logs(e))
    }

    /// Waits until there is a leader, every other node whose Patroni runs streams from it, and
    /// in synchronous mode one of them is its synchronous standby. Returns the leader.
    pub async fn wait_until_healthy(&self) -> io::Result<usize> {
        let leader = self.wait_for_leader().await?;
        let others = (0..self.nodes.len()).filter(|n| *n != leader && self.patroni_running(*n));
        self.wait_for_replicas(leader, others.count()).await?;
        if self.replication == Replication::Synchronous {
            self.wait_for_sync_standby().await?;
        }
        // The leader may have changed meanwhile; the caller gets the one that is healthy now.
        self.wait_for_leader().await
    }

    /// A switchover through the leader's REST API (`POST /switchover`), to `candidate` or to a
    /// node Patroni picks (in synchronous mode, only the synchronous standby may be picked).
    /// First waits until the cluster is healthy, since a switchover in synchronous mode fails
    /// while no synchronous standby is named. Fails unless Patroni answers 200. Returns the new
    /// leader once it accepts writes.
    pub async fn switchover(&self, candidate: Option<usize>) -> io::Result<usize> {
        let leader = self.wait_until_healthy().await?;
        let body = match candidate {
            Some(c) => format!(
                r#"{{"leader": "{}", "candidate": "{}"}}"#,
                self.nodes[leader].name, self.nodes[c].name
            ),
            None => format!(r#"{{"leader": "{}"}}"#, self.nodes[leader].name),
        };
        let rest = self.nodes[leader].rest_port;
        let (status, answer) = http(rest, "POST", "/switchover", &body, SWITCHOVER_TIMEOUT).await?;
        if status != 200 {
            return Err(io::Error::other(format!(
                "switchover from node {leader} refused: HTTP {status}: {answer}"
            )));
        }
        let new = self.wait_for_new_leader(leader).await?;
        match candidate {
            Some(c) if c != new => {
                Err(io::Error::other(format!("switchover went to node {new}, not node {c}")))
            }
            _ => Ok(new),
        }
    }

    /// Kills node `n` as a crash would: SIGKILL to its Patroni, then to its postmaster and every
    /// child of it. The postmaster is stopped (SIGSTOP) first, so that it starts no new child
    /// while its children are killed; they are found as its children, and each is killed only
    /// while it still is. Returns once all of them are gone.
    pub fn kill_node(&self, n: usize) -> io::Result<()> {
        self.kill_patroni(n)?;
        let Some(postmaster) = self.nodes[n].postmaster() else { return Ok(()) };
        signal(postmaster, Signal::STOP);
        let children = children_of(postmaster);
        for child in &children {
            if parent_of(*child) == Some(postmaster) {
                signal(*child, Signal::KILL);
            }
        }
        signal(postmaster, Signal::KILL);
        let all: Vec<u32> = children.iter().copied().chain([postmaster]).collect();
        wait_until(REAP_WAIT, || all.iter().all(|pid| !is_running(*pid)));
        match all.iter().find(|pid| is_running(**pid)) {
            Some(pid) => {
                Err(io::Error::other(format!("process {pid} of node {n} outlived SIGKILL")))
            }
            None => Ok(()),
        }
    }

    /// Kills node `n`'s Patroni alone (SIGKILL). Its PostgreSQL goes on as it was: a leader's
    /// stays a primary that accepts writes, while Patroni promotes another node once the
    /// leader key expires. That is a split brain.
    pub fn kill_patroni(&self, n: usize) -> io::Result<()> {
        // Our child, not reaped yet: its pid cannot have been reused.
        if let Some(mut child) = lock(&self.nodes[n].patroni).take() {
            let _ = child.kill();
            child.wait()?;
        }
        Ok(())
    }

    /// Starts node `n`'s Patroni again, after [`PatroniCluster::kill_node`] or
    /// [`PatroniCluster::kill_patroni`] (a Patroni still running is killed first). Patroni then
    /// starts, or takes over, the node's PostgreSQL. A former leader is demoted: it rejoins as a
    /// replica, through pg_rewind when its history forked. Returns at once; wait with
    /// [`PatroniCluster::wait_until_healthy`].
    pub fn restart_node(&self, n: usize) -> io::Result<()> {
        self.kill_patroni(n)?;
        self.start_patroni(n)
    }

    /// Whether node `n`'s Patroni runs (it was not killed).
    pub fn patroni_running(&self, n: usize) -> bool {
        lock(&self.nodes[n].patroni)
            .as_mut()
            .is_some_and(|child| matches!(child.try_wait(), Ok(None)))
    }

    /// Whether node `n`'s PostgreSQL runs, whatever its Patroni does.
    pub fn postgres_running(&self, n: usize) -> bool {
        self.nodes[n].postmaster().is_some()
    }

    /// Stops (SIGSTOP) every WAL sender of node `n`'s PostgreSQL: nothing it commits from now on
    /// reaches a replica, as with a replica lagging behind. Returns how many were stopped. Undo
    /// with [`PatroniCluster::resume_wal_senders`]; [`PatroniCluster::kill_node`] kills them.
    pub fn pause_wal_senders(&self, n: usize) -> io::Result<usize> {
        self.signal_wal_senders(n, Signal::STOP)
    }

    /// Lets the WAL senders of node `n` run again (SIGCONT).
    pub fn resume_wal_senders(&self, n: usize) -> io::Result<usize> {
        self.signal_wal_senders(n, Signal::CONT)
    }

    fn signal_wal_senders(&self, n: usize, sig: Signal) -> io::Result<usize> {
        let postmaster = self.nodes[n]
            .postmaster()
            .ok_or_else(|| io::Error::other(format!("node {n}'s PostgreSQL is not running")))?;
        let senders: Vec<u32> = children_of(postmaster)
            .into_iter()
            .filter(|pid| cmdline(*pid).contains(": walsender "))
            .collect();
        for pid in &senders {
            signal(*pid, sig);
        }
        Ok(senders.len())
    }

    /// The timeline node `n` is on, as its Patroni reports it (`GET /patroni`).
    pub async fn timeline(&self, n: usize) -> io::Result<u64> {
        let (status, body) =
            http(self.nodes[n].rest_port, "GET", "/patroni", "", HTTP_TIMEOUT).await?;
        let timeline = body
            .split("\"timeline\":")
            .nth(1)
            .and_then(|rest| rest.trim_start().split(|c: char| !c.is_ascii_digit()).next())
            .and_then(|digits| digits.parse().ok());
        timeline.ok_or_else(|| io::Error::other(format!("no timeline in HTTP {status}: {body}")))
    }

    /// Node `n`'s Patroni log so far (its output, with PostgreSQL's own log lines it relays).
    pub fn patroni_log(&self, n: usize) -> String {
        fs::read_to_string(self.nodes[n].log_file()).unwrap_or_default()
    }

    /// `GET /cluster` from the first node whose Patroni answers: every member with its role,
    /// state, timeline and lag, as JSON. For messages.
    pub async fn status(&self) -> String {
        for n in (0..self.nodes.len()).filter(|n| self.patroni_running(*n)) {
            if let Ok((200, body)) =
                http(self.nodes[n].rest_port, "GET", "/cluster", "", HTTP_TIMEOUT).await
            {
                return body;
            }
        }
        "(no Patroni answers)".to_owned()
    }

    async fn query_i64(&self, n: usize, sql: &str) -> io::Result<i64> {
        let client = self.connect(n).await.map_err(io::Error::other)?;
        let row = client.query_one(sql, &[]).await.map_err(io::Error::other)?;
        Ok(row.get(0))
    }

    async fn query_bool(&self, n: usize, sql: &str) -> io::Result<bool> {
        let client = self.connect(n).await.map_err(io::Error::other)?;
        let row = client.query_one(sql, &[]).await.map_err(io::Error::other)?;
        Ok(row.get(0))
    }

    /// `error` with the end of each log, for a wait that failed.
    fn with_logs(&self, error: io::Error) -> io::Error {
        let mut text =
            format!("{error}\n--- etcd.log ---\n{}", log_tail(&self.root.join("etcd.log"), 0));
        for node in &self.nodes {
            text.push_str(&format!("\n--- {} ---\n{}", node.name, log_tail(&node.log_file(), 0)));
        }
        io::Error::new(error.kind(), text)
    }

    /// Stops everything and deletes the run directory. Bounded and never panicking: it runs on
    /// drop, also while a panic unwinds.
    fn shut_down(&self) {
        // Patroni first, so that none restarts or promotes anything meanwhile.
        for n in 0..self.nodes.len() {
            let _ = self.kill_patroni(n);
        }
        let postmasters: Vec<(usize, u32)> =
            (0..self.nodes.len()).filter_map(|n| Some((n, self.nodes[n].postmaster()?))).collect();
        for (_, pid) in &postmasters {
            // An immediate shutdown ends the children and frees the shared memory too.
            signal(*pid, Signal::QUIT);
        }
        wait_until(REAP_WAIT, || postmasters.iter().all(|(_, pid)| !is_running(*pid)));
        for (n, _) in &postmasters {
            let _ = self.kill_node(*n);
        }
        for node in &self.nodes {
            node.remove_orphaned_shared_memory();
        }
        if let Some(mut etcd) = lock(&self.etcd).take() {
            let _ = etcd.kill();
            let _ = etcd.wait();
        }
        let _ = fs::remove_dir_all(&self.root);
        if let Some(Keeper { mut child, stdin }) = lock(&self.keeper).take() {
            // Released, the keeper finds nothing left to do; wait (bounded) so it is reaped.
            drop(stdin);
            wait_until(REAP_WAIT + REAP_WAIT, || !matches!(child.try_wait(), Ok(None)));
        }
    }
}

impl Drop for PatroniCluster {
    fn drop(&mut self) {
        self.shut_down();
    }
}

impl Node {
    fn log_file(&self) -> PathBuf {
        self.dir.join("patroni.log")
    }

    /// The node's postmaster, from `postmaster.pid`, if it runs and its command line names this
    /// node's data directory.
    fn postmaster(&self) -> Option<u32> {
        let pid = self.pid_file_line(0)?.trim().parse().ok()?;
        let data_dir = self.data_dir.to_string_lossy();
        (is_running(pid) && cmdline(pid).contains(data_dir.as_ref())).then_some(pid)
    }

    fn pid_file_line(&self, line: usize) -> Option<String> {
        let text = fs::read_to_string(self.data_dir.join("postmaster.pid")).ok()?;
        text.lines().nth(line).map(str::to_owned)
    }

    /// A killed postmaster leaves its SysV shared memory segment; `postmaster.pid` names it.
    /// Removed only if no process is attached and that postmaster created it.
    fn remove_orphaned_shared_memory(&self) {
        let Some(pid) = self.pid_file_line(0).and_then(|l| l.trim().parse::<u32>().ok()) else {
            return;
        };
        let Some(shmid) =
            self.pid_file_line(6).and_then(|l| l.split_whitespace().nth(1).map(str::to_owned))
        else {
            return;
        };
        let table = fs::read_to_string("/proc/sysvipc/shm").unwrap_or_default();
        let orphaned = table.lines().any(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            fields.len() > 6
                && fields[1] == shmid
                && fields[4] == pid.to_string()
                && fields[6] == "0"
        });
        if orphaned && !is_running(pid) {
            let _ = Command::new("ipcrm").args(["-m", &shmid]).stdin(Stdio::null()).output();
        }
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

fn signal(pid: u32, sig: Signal) {
    if let Some(pid) = i32::try_from(pid).ok().and_then(Pid::from_raw) {
        // It may have exited meanwhile: then there is nothing to signal.
        let _ = kill_process(pid, sig);
    }
}

/// A process's command line, its arguments joined by spaces; empty if it is gone.
fn cmdline(pid: u32) -> String {
    let bytes = fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
    String::from_utf8_lossy(&bytes).replace('\0', " ")
}

/// The parent's pid, from `/proc/<pid>/stat`: the 4th field; the 2nd, the command, is in
/// parentheses and may hold spaces.
fn parent_of(pid: u32) -> Option<u32> {
    let stat = fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    stat.rsplit_once(')')?.1.split_whitespace().nth(1)?.parse().ok()
}

fn children_of(parent: u32) -> Vec<u32> {
    let Ok(entries) = fs::read_dir("/proc") else { return Vec::new() };
    entries
        .flatten()
        .filter_map(|entry| entry.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| parent_of(*pid) == Some(parent))
        .collect()
}

/// Where run directories go: `/dev/shm` if it is a writable directory, else
/// [`std::env::temp_dir`]. etcd and PostgreSQL flush to disk on every commit. On a shared disk
/// under load one flush took seconds here. etcd then missed Patroni's 1 s timeouts, and Patroni
/// demoted its leader for "DCS is not accessible". In memory, a flush is only a copy, and a
/// process killed by a test loses nothing of it all the same.
fn run_dir_parent() -> PathBuf {
    let shm = PathBuf::from("/dev/shm");
    let writable = fs::metadata(&shm).is_ok_and(|m| m.is_dir() && !m.permissions().readonly());
    if writable { shm } else { std::env::temp_dir() }
}

/// `name` on `PATH`, else at `fallback`; an error naming the Debian package otherwise.
fn find_program(name: &str, fallback: &str, package: &str) -> io::Result<PathBuf> {
    let on_path = std::env::var_os("PATH").and_then(|path| {
        std::env::split_paths(&path).map(|dir| dir.join(name)).find(|p| is_executable(p))
    });
    let fallback = PathBuf::from(fallback);
    on_path.or_else(|| is_executable(&fallback).then_some(fallback)).ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::NotFound,
            format!(
                "no {name} on PATH: install it (`apt-get install --no-install-recommends \
                 patroni etcd-server python3-etcd`; {name} is in `{package}`)"
            ),
        )
    })
}

/// Calls `probe` every [`POLL`] until it returns a value, for at most [`WAIT`]. An error of
/// `probe` ends the wait with it; a wait that runs out is a `TimedOut` error.
async fn wait_for<T, F, Fut>(what: &str, mut probe: F) -> io::Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = io::Result<Option<T>>>,
{
    let deadline = Instant::now() + WAIT;
    loop {
        if let Some(value) = probe().await? {
            return Ok(value);
        }
        if Instant::now() >= deadline {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("gave up waiting for {what} after {WAIT:?}"),
            ));
        }
        tokio::time::sleep(POLL).await;
    }
}

/// One HTTP/1.1 request to `127.0.0.1:port`: the status code and the body. `Connection: close`,
/// so the answer ends where the stream does. Enough for Patroni's REST API and etcd's health.
async fn http(
    port: u16,
    method: &str,
    path: &str,
    body: &str,
    limit: Duration,
) -> io::Result<(u16, String)> {
    let exchange = async {
        let mut stream = TcpStream::connect((Ipv4Addr::LOCALHOST, port)).await?;
        let request = format!(
            "{method} {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\
             Content-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        stream.write_all(request.as_bytes()).await?;
        let mut answer = Vec::new();
        stream.read_to_end(&mut answer).await?;
        Ok::<_, io::Error>(String::from_utf8_lossy(&answer).into_owned())
    };
    let answer = tokio::time::timeout(limit, exchange).await.map_err(|_| {
        io::Error::new(io::ErrorKind::TimedOut, format!("{method} {path} on port {port}"))
    })??;
    let (head, body) = answer.split_once("\r\n\r\n").unwrap_or((&answer, ""));
    let status = head.split_whitespace().nth(1).and_then(|s| s.parse().ok()).ok_or_else(|| {
        io::Error::new(io::ErrorKind::InvalidData, format!("not an HTTP answer: {head:?}"))
    })?;
    Ok((status, body.to_owned()))
}
