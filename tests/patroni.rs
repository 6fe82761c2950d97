//! pgfence on a cluster that Patroni manages (`pgfence_testing::PatroniCluster`): etcd and three
//! PostgreSQL 15 nodes. Writers run through the multi-host URL while Patroni switches over,
//! fails over after a `kill -9`, and splits the brain when only the leader's Patroni dies.
//!
//! Each test starts a cluster of its own, one at a time: a cluster takes about 400 MB and
//! several processes, and the machine has two cores. The tests print what they measured on
//! lines starting with `measured:`; docs/deployments.md ("Patroni") quotes them.
//!
//! It needs Debian's `patroni`, `etcd-server` and `python3-etcd` packages, and PostgreSQL 15.

use std::collections::BTreeSet;
use std::future::Future;
use std::io::{BufRead, BufReader, Read};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use pgfence::{Error, LeaseState, PgKvStore};
use pgfence_testing::{PatroniCluster, Replication, unique_name};

/// Generous bound against hangs; never a measurement. A failover takes about 10 s here, and a
/// standby waits up to one TTL after it.
const HANG_GUARD: Duration = Duration::from_secs(120);

/// One cluster at a time, across the tests of this binary. tokio's mutex does not poison, so a
/// failed test does not fail the next ones.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

async fn within<F: Future>(what: &str, fut: F) -> F::Output {
    tokio::time::timeout(HANG_GUARD, fut).await.unwrap_or_else(|_| panic!("{what} hung"))
}

/// Starts a cluster once no other test of this binary has one. Keep the guard until the
/// cluster is dropped.
async fn start(
    replication: Replication,
) -> (tokio::sync::MutexGuard<'static, ()>, Arc<PatroniCluster>) {
    let turn = ONE_AT_A_TIME.lock().await;
    let started = Instant::now();
    let cluster = PatroniCluster::start(replication).await.expect("a Patroni cluster");
    println!("measured: {replication:?} cluster healthy {:?} after its start", started.elapsed());
    (turn, Arc::new(cluster))
}

/// A store through `url` with the library's defaults (TTL 30 s, local deadline 20 s, renewal
/// every 10 s) and a small pool.
fn builder(url: &str, t: &str) -> pgfence::Builder {
    PgKvStore::builder(url).table(t).pool_size(4)
}

/// How a writer ended.
#[derive(Debug)]
struct Written {
    writer: usize,
    /// Every key whose write returned `Ok`, and when it returned.
    acked: Vec<(String, Instant)>,
    /// The longest a write took that returned `Ok`.
    longest: Duration,
    /// The error that ended it, if not the stop flag.
    error: Option<Error>,
}

/// Writers that each write keys `w<writer>-<n>` for n = 1, 2, ... until stopped or until a
/// write fails. A key per write, so that every acknowledged write can be looked for afterwards.
fn spawn_writers(
    store: &PgKvStore,
    writers: usize,
    stop: &Arc<AtomicBool>,
) -> Vec<tokio::task::JoinHandle<Written>> {
    spawn_paced_writers(store, writers, stop, Duration::ZERO)
}

/// [`spawn_writers`], each pausing `pause` after each write.
fn spawn_paced_writers(
    store: &PgKvStore,
    writers: usize,
    stop: &Arc<AtomicBool>,
    pause: Duration,
) -> Vec<tokio::task::JoinHandle<Written>> {
    (0..writers)
        .map(|writer| {
            let (store, stop) = (store.clone(), stop.clone());
            tokio::spawn(async move {
                let mut done =
                    Written { writer, acked: Vec::new(), longest: Duration::ZERO, error: None };
                for n in 1u64.. {
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    let key = format!("w{writer}-{n}");
                    let started = Instant::now();
                    match store.write("r", "s", &key, n.to_be_bytes().to_vec()).await {
                        Ok(()) => {
                            done.longest = done.longest.max(started.elapsed());
                            done.acked.push((key, Instant::now()));
                            tokio::time::sleep(pause).await;
                        }
                        Err(error) => {
                            done.error = Some(error);
                            break;
                        }
                    }
                }
                done
            })
        })
        .collect()
}

async fn join(writers: Vec<tokio::task::JoinHandle<Written>>) -> Vec<Written> {
    let mut out = Vec::new();
    for w in writers {
        out.push(within("writer", w).await.unwrap());
    }
    out
}

/// The keys written under fencing token `epoch`, as node `n` shows them now.
async fn keys_of_epoch(
    cluster: &PatroniCluster,
    n: usize,
    t: &str,
    epoch: i64,
) -> BTreeSet<String> {
    let client = cluster.connect(n).await.expect("connect to a node");
    let sql = format!("SELECT key FROM \"{t}\" WHERE epoch = $1");
    client.query(&sql, &[&epoch]).await.unwrap().iter().map(|row| row.get(0)).collect()
}

/// Waits until node `n` shows `more` keys of `epoch` beyond those it shows now: the writers get
/// on there.
async fn wait_for_progress(cluster: &PatroniCluster, n: usize, t: &str, epoch: i64, more: usize) {
    let before = keys_of_epoch(cluster, n, t, epoch).await.len();
    within("writes on the leader", async {
        while keys_of_epoch(cluster, n, t, epoch).await.len() < before + more {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
}

async fn wait_until_lost(store: &PgKvStore) -> LeaseState {
    let mut state = store.lease_state();
    within("the lease's loss", state.wait_for(|s| matches!(s, LeaseState::Lost { .. })))
        .await
        .unwrap()
        .clone()
}

/// A standby in a process of its own: this test binary again, running [`successor_child`].
/// It waits for the lease on `url`, writes key `successor`, and closes its store once its
/// stdin closes. Killed and reaped on drop, however the test ends.
struct Successor {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Arc<Mutex<Vec<String>>>,
}

impl Successor {
    fn start(url: &str, t: &str, ttl: Duration) -> Successor {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "successor_child", "--include-ignored", "--nocapture"])
            .args(["--test-threads", "1"])
            .env("PGFENCE_SUCCESSOR_URL", url)
            .env("PGFENCE_SUCCESSOR_TABLE", t)
            .env("PGFENCE_SUCCESSOR_TTL_MS", ttl.as_millis().to_string())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start the successor process");
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().expect("stdout");
        let lines = Arc::new(Mutex::new(Vec::new()));
        let sink = lines.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                sink.lock().unwrap().push(line);
            }
        });
        Successor { child, stdin, lines }
    }

    /// Waits for its line starting with `successor: <what>`, and returns the rest of it.
    async fn wait_for(&self, what: &str) -> String {
        let prefix = format!("successor: {what}");
        let waited = tokio::time::timeout(HANG_GUARD, async {
            loop {
                let found =
                    self.lines.lock().unwrap().iter().find_map(|line| {
                        line.strip_prefix(&prefix).map(|rest| rest.trim().to_owned())
                    });
                if let Some(rest) = found {
                    return rest;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
        .await;
        waited.unwrap_or_else(|_| {
            let lines = self.lines.lock().unwrap().join("\n");
            panic!("the successor's `{what}` hung; its output:\n{lines}")
        })
    }

    /// Closes its stdin; it closes its store and exits 0.
    async fn finish(mut self) {
        drop(self.stdin.take());
        self.wait_for("closed").await;
        let status = within("the successor's exit", async {
            loop {
                if let Some(status) = self.child.try_wait().unwrap() {
                    return status;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
        .await;
        assert!(status.success(), "the successor exited with {status}");
    }
}

impl Drop for Successor {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The successor's process (see [`Successor`]).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "run in a child process by the tests that need a successor"]
async fn successor_child() {
    let var = |name| std::env::var(name).unwrap_or_else(|_| panic!("only as a child: {name}"));
    let (url, t) = (var("PGFENCE_SUCCESSOR_URL"), var("PGFENCE_SUCCESSOR_TABLE"));
    let ttl = Duration::from_millis(var("PGFENCE_SUCCESSOR_TTL_MS").parse().unwrap());
    let standby = builder(&url, &t).lease_ttl(ttl).application_name("successor").standby();
    // Each change of its state, for the parent's messages.
    let mut progress = standby.progress();
    tokio::spawn(async move {
        while progress.changed().await.is_ok() {
            println!("successor: state {:?}", *progress.borrow_and_update());
        }
    });
    let store = standby.open().await.expect("the successor takes the lease");
    println!("successor: acquired {}", store.fencing_token());
    store.write("r", "s", "successor", b"v".to_vec()).await.expect("the successor writes");
    println!("successor: wrote");
    tokio::task::spawn_blocking(|| {
        let mut rest = Vec::new();
        let _ = std::io::stdin().read_to_end(&mut rest);
    })
    .await
    .unwrap();
    store.close().await.expect("the successor releases");
    println!("successor: closed");
}

/// Synchronous mode, two switchovers through Patroni's REST API while three writers run. A
/// switchover takes a few seconds, well within the local deadline (20 s by default): the store
/// keeps its lease and fencing token, no write fails, and every acknowledged write is on the
/// new leader.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn synchronous_switchover_keeps_the_lease_and_every_write() {
    let (_turn, cluster) = start(Replication::Synchronous).await;
    let t = unique_name("pat_switch");
    let store = within("open", builder(&cluster.url(), &t).open()).await.unwrap();
    let token = store.fencing_token();
    let stop = Arc::new(AtomicBool::new(false));
    let writers = spawn_writers(&store, 3, &stop);
    let mut leader = cluster.wait_for_leader().await.unwrap();
    wait_for_progress(&cluster, leader, &t, token, 30).await;
    for round in 1..=2 {
        // A switchover fails while no synchronous standby is named; not part of its time.
        cluster.wait_until_healthy().await.unwrap();
        let started = Instant::now();
        let new = within("the switchover", cluster.switchover(None)).await.unwrap();
        println!(
            "measured: switchover {round}, node {leader} to node {new}: {:?} until it accepts writes",
            started.elapsed()
        );
        wait_for_progress(&cluster, new, &t, token, 30).await;
        leader = new;
    }
    stop.store(true, Ordering::Relaxed);
    let written = join(writers).await;
    let on_leader = keys_of_epoch(&cluster, leader, &t, token).await;
    let mut acked = 0;
    for w in &written {
        assert!(w.error.is_none(), "writer {} failed: {:?}", w.writer, w.error);
        for (key, _) in &w.acked {
            assert!(on_leader.contains(key), "acknowledged {key} is on the new leader");
        }
        acked += w.acked.len();
    }
    let longest = written.iter().map(|w| w.longest).max().unwrap();
    println!(
        "measured: switchovers: {acked} writes acknowledged, none failed, longest {longest:?}"
    );
    assert_eq!(*store.lease_state().borrow(), LeaseState::Held { epoch: token });
    assert_eq!(store.fencing_token(), token);
    within("close", store.close()).await.unwrap();
}

/// Synchronous mode, `kill -9` of the leader's Patroni and PostgreSQL while three writers run,
/// with the library's defaults (TTL 30 s, local deadline 20 s). Patroni promotes the
/// synchronous standby after its `ttl` (10 s). Every acknowledged write is on it. The store
/// keeps its lease if it renews there before its local deadline, and fails closed otherwise.
/// A standby in another process takes over: once the store released the lease on its loss, or,
/// if it kept it, once an operator force-releases it, as after the holder stalled. No write of
/// the former owner lands after that acquisition.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn synchronous_failover_after_kill_keeps_every_acknowledged_write() {
    let (_turn, cluster) = start(Replication::Synchronous).await;
    let t = unique_name("pat_kill");
    let first = within("open", builder(&cluster.url(), &t).open()).await.unwrap();
    let token = first.fencing_token();
    let successor = Successor::start(&cluster.url(), &t, Duration::from_secs(30));
    let stop = Arc::new(AtomicBool::new(false));
    let writers = spawn_writers(&first, 3, &stop);
    let old = cluster.wait_until_healthy().await.unwrap();
    wait_for_progress(&cluster, old, &t, token, 30).await;

    let killed = Instant::now();
    cluster.kill_node(old).unwrap();
    let new = within("the failover", cluster.wait_for_new_leader(old)).await.unwrap();
    let failover = killed.elapsed();
    // The writers get on there, or the store fails closed.
    let mut state = first.lease_state();
    within("writes after the failover, or the loss", async {
        let lost = state.wait_for(|s| matches!(s, LeaseState::Lost { .. }));
        tokio::select! {
            () = wait_for_progress(&cluster, new, &t, token, 30) => {}
            _ = lost => {}
        }
    })
    .await;
    let resumed = killed.elapsed();
    let after = first.lease_state().borrow().clone();
    println!(
        "measured: kill -9 of leader node {old} (synchronous): node {new} accepts writes after \
         {failover:?}; the store: {after:?} {resumed:?} after the kill"
    );
    match after {
        LeaseState::Held { epoch } => {
            assert_eq!(epoch, token);
            let inspector = builder(&cluster.url(), &t).inspect().await.unwrap();
            let released = inspector.force_release().await.unwrap().expect("the store held it");
            assert_eq!(released.owner_id, first.owner_id());
        }
        LeaseState::Lost { .. } => {}
        other => panic!("the store is {other:?}"),
    }
    let acquired: i64 = successor.wait_for("acquired").await.parse().unwrap();
    let at_takeover = keys_of_epoch(&cluster, new, &t, token).await;
    let written = join(writers).await;
    assert_eq!(
        keys_of_epoch(&cluster, new, &t, token).await,
        at_takeover,
        "no write of the former owner landed after the successor's acquisition"
    );
    let mut acked = 0;
    for w in &written {
        assert!(
            matches!(w.error, Some(Error::LeaseLost { .. })),
            "writer {} ended with {:?}, not a lost lease",
            w.writer,
            w.error
        );
        for (key, _) in &w.acked {
            assert!(at_takeover.contains(key), "acknowledged {key} is on the new leader");
        }
        acked += w.acked.len();
    }
    assert!(acquired > token, "the successor's token {acquired} is above {token}");
    successor.wait_for("wrote").await;
    let longest = written.iter().map(|w| w.longest).max().unwrap();
    println!(
        "measured: kill -9 (synchronous): {acked} writes acknowledged, all on node {new}, \
         longest {longest:?}; tokens {token} then {acquired}"
    );
    successor.finish().await;
    drop(first);
}

/// Asynchronous mode: a lost acquisition. The leader's WAL senders are stopped, as with
/// replicas lagging behind; a store acquires and writes; then the leader is killed. The
/// promoted node never saw that acquisition nor those writes: every one of them is lost,
/// although acknowledged. The store fails closed, and the next acquisition gets a fencing token
/// above the lost one (the timeline floor), never the same one again. The old leader rejoins
/// through pg_rewind, which takes the lost writes out of its history too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn asynchronous_failover_never_reissues_a_fencing_token() {
    let (_turn, cluster) = start(Replication::Asynchronous).await;
    let t = unique_name("pat_async");
    let old = cluster.wait_for_leader().await.unwrap();
    let first = within("open", builder(&cluster.url(), &t).open()).await.unwrap();
    first.write("r", "s", "first", b"v".to_vec()).await.unwrap();
    let first_token = first.fencing_token();
    within("close", first.close()).await.unwrap();
    // Both replicas have the release before anything is held back. It commits
    // asynchronously, so it may follow the write by a moment.
    let released = format!(
        "SELECT count(*) FROM \"{t}_lease\" WHERE id = 1 AND expires_at <= clock_timestamp()"
    );
    within("the replicas catch up", async {
        for n in (0..cluster.nodes()).filter(|n| *n != old) {
            let replica = cluster.connect(n).await.unwrap();
            while replica.query_one(&released, &[]).await.map_or(0, |r| r.get::<_, i64>(0)) == 0 {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    })
    .await;
    assert_eq!(cluster.pause_wal_senders(old).unwrap(), 2, "two WAL senders stopped");

    // Only the old leader ever sees this acquisition and these writes.
    let lost = within("open", builder(&cluster.url(), &t).open()).await.unwrap();
    let lost_token = lost.fencing_token();
    assert!(lost_token > first_token);
    let stop = Arc::new(AtomicBool::new(false));
    let writers = spawn_writers(&lost, 2, &stop);
    wait_for_progress(&cluster, old, &t, lost_token, 50).await;
    let killed = Instant::now();
    cluster.kill_node(old).unwrap();
    let new = within("the failover", cluster.wait_for_new_leader(old)).await.unwrap();
    let failover = killed.elapsed();

    let written = join(writers).await;
    for w in &written {
        assert!(
            matches!(w.error, Some(Error::LeaseLost { .. })),
            "writer {} ended with {:?}, not a lost lease",
            w.writer,
            w.error
        );
    }
    let state = wait_until_lost(&lost).await;
    let on_new = keys_of_epoch(&cluster, new, &t, lost_token).await;
    let acked: Vec<&String> = written.iter().flat_map(|w| w.acked.iter().map(|(k, _)| k)).collect();
    let missing = acked.iter().filter(|key| !on_new.contains(**key)).count();
    let next = within("open on the new leader", builder(&cluster.url(), &t).open()).await.unwrap();
    let next_token = next.fencing_token();
    println!(
        "measured: kill -9 of leader node {old} (asynchronous, WAL senders stopped): node {new} \
         accepts writes after {failover:?}; {} writes acknowledged, {missing} of them lost; \
         the store: {state:?}; tokens {first_token}, {lost_token} (lost), then {next_token}",
        acked.len()
    );
    assert_eq!(missing, acked.len(), "the promoted node saw none of the held-back writes");
    assert!(
        next_token > lost_token,
        "token {next_token} given again after the promotion (the lost acquisition had it)"
    );
    next.write("r", "s", "after", b"v".to_vec()).await.unwrap();

    // The old leader rejoins as a replica of the new one, through pg_rewind.
    let restarted = Instant::now();
    cluster.restart_node(old).unwrap();
    within("the old leader rejoins", async {
        cluster.wait_for_replicas(new, 2).await.unwrap();
        while !keys_of_epoch(&cluster, old, &t, next_token).await.contains("after") {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    let rejoined = restarted.elapsed();
    let log = cluster.patroni_log(old);
    let rewinds: Vec<&str> = log.lines().filter(|l| l.contains("pg_rewind")).collect();
    println!(
        "measured: node {old} streams from node {new} {rejoined:?} after its restart: {rewinds:?}"
    );
    assert!(log.contains("running pg_rewind"), "the old leader was rewound:\n{log}");
    assert!(keys_of_epoch(&cluster, old, &t, lost_token).await.is_empty(), "rewound away");
    assert_eq!(cluster.timeline(old).await.unwrap(), cluster.timeline(new).await.unwrap());
    within("close", next.close()).await.unwrap();
    drop(lost);
}

/// Only the leader's Patroni is killed, in synchronous mode. Its PostgreSQL goes on as a
/// primary, an orphan, while Patroni promotes the synchronous standby. The store's connections
/// stay on the orphan (its URL names the orphan first), where its commits wait for a
/// synchronous standby that no longer streams from it. A successor that never connects to the
/// orphan (as through a router that follows Patroni) takes over on the new leader once the
/// lease expires there. Patroni started again on the old leader demotes the orphan, which
/// rejoins through pg_rewind. The fence holds on the new leader, and the store on the orphan
/// fails closed at its local deadline, before the successor's acquisition. No write it
/// acknowledged is lost.
///
/// - Its renewals commit synchronously, so on the orphan they wait for the synchronous standby
///   that no longer streams from it, like its writes: the local deadline passes, and the store
///   fails closed before the successor's acquisition. (They once committed with
///   `synchronous_commit = off`, succeeded on the orphan, and the store kept reporting `Held`.)
/// - Patroni 3.0.2, started again on the old leader, first reloads the orphan without
///   `synchronous_standby_names`, then demotes it. The reload releases every commit waiting for
///   the synchronous standby. The store failed closed before, so it acknowledges none of them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn synchronous_split_brain_fails_closed_and_loses_no_acknowledged_write() {
    split_brain(Replication::Synchronous).await;
}

/// The same in asynchronous mode: a real split brain. The orphan goes on acknowledging the
/// store's writes, and confirming its renewals, while the successor holds the lease on the new
/// leader. Both stores hold a lease at once, each on its own database. The writes the orphan
/// acknowledged after the takeover are lost when it rejoins. Shown, not prevented: synchronous
/// mode with a store that fails closed, or Patroni's watchdog, prevent it (docs/deployments.md,
/// "Patroni").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn asynchronous_split_brain_loses_what_the_orphan_acknowledged() {
    split_brain(Replication::Asynchronous).await;
}

/// How long the split brain tests wait for the demoted orphan to rejoin.
const REJOIN_WAIT: Duration = Duration::from_secs(60);

/// Each writer's pause after each write in the split brain tests.
const SPLIT_PAUSE: Duration = Duration::from_millis(10);

/// The TTL of the split brain tests: the successor waits for it after the promotion.
const SPLIT_TTL: Duration = Duration::from_secs(15);

/// The split brain of the tests above, with what each mode must show.
async fn split_brain(replication: Replication) {
    let (_turn, cluster) = start(replication).await;
    let t = unique_name("pat_split");
    let old = cluster.wait_until_healthy().await.unwrap();
    let others: Vec<usize> = (0..cluster.nodes()).filter(|n| *n != old).collect();
    let order: Vec<usize> = [old].into_iter().chain(others.iter().copied()).collect();
    let first = within("open", builder(&cluster.url_of(&order), &t).lease_ttl(SPLIT_TTL).open())
        .await
        .unwrap();
    let token = first.fencing_token();
    let stop = Arc::new(AtomicBool::new(false));
    // Paced: an orphan that writes at full speed for half a minute may leave pg_rewind without
    // the WAL it needs from before the fork (wal_keep_size is 16 MB), and then never rejoins.
    let writers = spawn_paced_writers(&first, 3, &stop, SPLIT_PAUSE);
    wait_for_progress(&cluster, old, &t, token, 30).await;

    let killed = Instant::now();
    cluster.kill_patroni(old).unwrap();
    let new = within("the promotion", cluster.wait_for_new_leader(old)).await.unwrap();
    let promoted = Instant::now();
    let successor = Successor::start(&cluster.url_of(&others), &t, SPLIT_TTL);
    let acquired: i64 = successor.wait_for("acquired").await.parse().unwrap();
    let took_over = Instant::now();
    successor.wait_for("wrote").await;
    let at_takeover = keys_of_epoch(&cluster, new, &t, token).await;
    // Both sides a little longer: what does the store on the orphan do meanwhile?
    tokio::time::sleep(Duration::from_secs(3)).await;
    let during = first.lease_state().borrow().clone();
    let orphan_lease = lease_on(&cluster, old, &t).await;
    let new_lease = lease_on(&cluster, new, &t).await;
    let on_orphan = keys_of_epoch(&cluster, old, &t, token).await.len();

    // Patroni again on the old leader: it demotes the orphan, which rejoins as a replica.
    let restarted = Instant::now();
    cluster.restart_node(old).unwrap();
    let after = wait_until_lost(&first).await;
    let lost_after = killed.elapsed();
    let rejoin = tokio::time::timeout(REJOIN_WAIT, cluster.wait_for_replicas(new, 2)).await;
    let rejoined = restarted.elapsed();
    let rejoin: Result<(), String> = match rejoin {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(e.to_string().lines().next().unwrap_or_default().to_owned()),
        Err(_) => Err(format!("not within {REJOIN_WAIT:?}")),
    };
    let written = join(writers).await;
    let on_new = keys_of_epoch(&cluster, new, &t, token).await;
    let acked: Vec<&(String, Instant)> = written.iter().flat_map(|w| w.acked.iter()).collect();
    let lost: Vec<&str> =
        acked.iter().filter(|(k, _)| !on_new.contains(k)).map(|(k, _)| k.as_str()).collect();
    let count_after = |at: Instant| acked.iter().filter(|(_, done)| *done > at).count();
    println!(
        "measured: split brain ({replication:?}): Patroni of leader node {old} killed; node {new} \
         promoted after {:?}; successor acquired token {acquired} {:?} after the promotion",
        promoted - killed,
        took_over - promoted
    );
    println!(
        "measured: split brain ({replication:?}): 3 s after the takeover the store (token \
         {token}) is {during:?}; lease on the orphan {orphan_lease}, on node {new} {new_lease}"
    );
    println!(
        "measured: split brain ({replication:?}): acknowledged {} writes, {} after the \
         promotion, {} after the takeover; {on_orphan} on the orphan, {} on node {new}; lost \
         {}; the store {after:?} {lost_after:?} after the kill; the orphan's rejoin \
         {rejoined:?} after Patroni's restart: {rejoin:?}",
        acked.len(),
        count_after(promoted),
        count_after(took_over),
        on_new.len(),
        lost.len()
    );
    assert!(acquired > token, "the successor's token {acquired} is above {token}");
    assert_eq!(
        on_new, at_takeover,
        "no write of the store landed on node {new} after the takeover"
    );
    for w in &written {
        assert!(
            matches!(w.error, Some(Error::LeaseLost { .. })),
            "writer {} ended with {:?}, not a lost lease",
            w.writer,
            w.error
        );
    }
    match replication {
        Replication::Synchronous => {
            assert!(
                matches!(during, LeaseState::Lost { .. }),
                "fails closed on the orphan: {during:?}"
            );
            assert_eq!(lost, Vec::<&str>::new(), "no acknowledged write is lost");
        }
        Replication::Asynchronous => {
            assert_eq!(
                during,
                LeaseState::Held { epoch: token },
                "the orphan confirms the store's renewals: two holders at once"
            );
            let after_takeover: Vec<&str> = acked
                .iter()
                .filter(|(_, done)| *done > took_over)
                .map(|(k, _)| k.as_str())
                .collect();
            assert!(
                !after_takeover.is_empty(),
                "the orphan acknowledged writes after the takeover"
            );
            for key in &after_takeover {
                assert!(lost.contains(key), "{key}, acknowledged on the orphan, is lost");
            }
        }
        other => panic!("no split brain test for {other:?}"),
    }
    successor.finish().await;
    drop(first);
}

/// The lease row as node `n` shows it: `epoch E, expires in S s`.
async fn lease_on(cluster: &PatroniCluster, n: usize, t: &str) -> String {
    let client = cluster.connect(n).await.expect("connect to a node");
    let sql = format!(
        "SELECT epoch, extract(epoch FROM expires_at - clock_timestamp())::float8 \
           FROM \"{t}_lease\" WHERE id = 1"
    );
    let row = client.query_one(&sql, &[]).await.unwrap();
    format!("epoch {}, expires in {:.1} s", row.get::<_, i64>(0), row.get::<_, f64>(1))
}

/// `pgfence audit --fault-cmd` across Patroni's own faults, in synchronous mode, for 60 s: its
/// command asks this test for the next fault, alternately a switchover and a `kill -9` of the
/// leader (then restarted, and the cluster healthy again). The audit finds no violation.
#[cfg(feature = "cli")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_60_second_audit_across_switchovers_and_kills_finds_no_violation() {
    let (_turn, cluster) = start(Replication::Synchronous).await;
    let faults = FaultChannel::new();
    let served = tokio::spawn(serve_faults(cluster.clone(), faults.clone()));
    // Also on a panic: the fault server's blocking read of the request pipe would otherwise
    // keep the test's runtime from shutting down, and the test would hang instead of failing.
    let stop_faults = StopFaults(faults.clone());
    let url = cluster.url();
    let command = faults.command();
    let args = [
        "--database-url",
        &url,
        "audit",
        "--duration",
        "60s",
        "--seed",
        "10",
        "--ttl",
        "10",
        "--faults",
        "cmd",
        "--fault-cmd",
        &command,
        "--json",
    ]
    .map(str::to_owned);
    let started = Instant::now();
    let audited = tokio::task::spawn_blocking(move || {
        let mut audit = Command::new(env!("CARGO_BIN_EXE_pgfence"));
        for variable in pgfence::env::VARIABLES {
            audit.env_remove(variable);
        }
        audit.env_remove("DATABASE_URL").args(&args).stdin(Stdio::null());
        let child =
            KillOnDrop(audit.stdout(Stdio::piped()).stderr(Stdio::piped()).spawn().unwrap());
        child.wait_with_output(Duration::from_secs(300))
    })
    .await
    .unwrap();
    let took = started.elapsed();
    drop(stop_faults);
    let done = within("the fault server", served).await.unwrap();
    let (code, stdout, stderr) = audited;
    let report: serde_json::Value = serde_json::from_str(&stdout)
        .unwrap_or_else(|e| panic!("a JSON report ({e}): {stdout:?}, stderr {stderr}"));
    println!("measured: audit across Patroni faults ({took:?}): {done:?}");
    println!("measured: audit report: {report}");
    assert_eq!(report["violations"], serde_json::json!([]), "{report}\n{stderr}");
    assert_eq!(code, Some(0), "{stderr}");
    assert_eq!(report["notes"], serde_json::json!([]), "every fault command succeeded");
    assert!(report["faults"]["cmd"]["injected"].as_u64().unwrap() >= 2, "{report}");
    assert!(done.iter().any(|d| d.starts_with("switchover")), "{done:?}");
    assert!(done.iter().any(|d| d.starts_with("kill")), "{done:?}");
    assert!(report["writes_acknowledged"].as_u64().unwrap() >= 100, "{report}");
}

/// A child process killed and reaped on drop, however the test ends.
#[cfg(feature = "cli")]
struct KillOnDrop(Child);

#[cfg(feature = "cli")]
impl KillOnDrop {
    /// Its exit code, stdout and stderr; panics after `limit`.
    fn wait_with_output(mut self, limit: Duration) -> (Option<i32>, String, String) {
        let read = |pipe: Option<Box<dyn Read + Send>>| {
            std::thread::spawn(move || {
                let mut text = String::new();
                if let Some(mut pipe) = pipe {
                    let _ = pipe.read_to_string(&mut text);
                }
                text
            })
        };
        let stdout = read(self.0.stdout.take().map(|p| Box::new(p) as Box<dyn Read + Send>));
        let stderr = read(self.0.stderr.take().map(|p| Box::new(p) as Box<dyn Read + Send>));
        let deadline = Instant::now() + limit;
        let status = loop {
            if let Some(status) = self.0.try_wait().unwrap() {
                break status;
            }
            assert!(Instant::now() < deadline, "pgfence audit did not end within {limit:?}");
            std::thread::sleep(Duration::from_millis(100));
        };
        (status.code(), stdout.join().unwrap(), stderr.join().unwrap())
    }
}

#[cfg(feature = "cli")]
impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Two named pipes between the audit's `--fault-cmd` and this test: the command writes a
/// request to one and waits for the answer on the other. Their directory is deleted on drop.
#[cfg(feature = "cli")]
#[derive(Clone)]
struct FaultChannel {
    dir: Arc<TempDir>,
}

#[cfg(feature = "cli")]
struct TempDir(std::path::PathBuf);

#[cfg(feature = "cli")]
impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

#[cfg(feature = "cli")]
impl FaultChannel {
    fn new() -> FaultChannel {
        let dir = std::env::temp_dir().join(unique_name("pgfence_faults"));
        std::fs::create_dir(&dir).unwrap();
        let dir = TempDir(dir);
        for name in ["request", "answer"] {
            let made = Command::new("mkfifo").arg(dir.0.join(name)).status().expect("mkfifo");
            assert!(made.success(), "mkfifo {name}");
        }
        FaultChannel { dir: Arc::new(dir) }
    }

    fn path(&self, name: &str) -> std::path::PathBuf {
        self.dir.0.join(name)
    }

    /// The `--fault-cmd`: one request, then success only if the answer is `ok`.
    fn command(&self) -> String {
        format!(
            "echo fault > '{}' && read -r answer < '{}' && [ \"$answer\" = ok ]",
            self.path("request").display(),
            self.path("answer").display()
        )
    }

    /// The next request, once a writer comes (blocks).
    fn request(&self) -> String {
        std::fs::read_to_string(self.path("request")).unwrap_or_default().trim().to_owned()
    }

    /// Writes `line` to `name` if a reader comes within 10 s. Opened without blocking, so that
    /// a reader that went away (a command the audit killed) cannot hang the test.
    fn send(&self, name: &str, line: &str) {
        use std::io::Write;
        use std::os::unix::fs::OpenOptionsExt;
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            let opened = std::fs::OpenOptions::new()
                .write(true)
                .custom_flags(libc::O_NONBLOCK)
                .open(self.path(name));
            if let Ok(mut pipe) = opened {
                let _ = writeln!(pipe, "{line}");
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Ends [`serve_faults`].
    fn stop(&self) {
        self.send("request", "stop");
    }
}

/// Stops the fault server when dropped.
#[cfg(feature = "cli")]
struct StopFaults(FaultChannel);

#[cfg(feature = "cli")]
impl Drop for StopFaults {
    fn drop(&mut self) {
        self.0.stop();
    }
}

/// Answers the audit's fault requests until [`FaultChannel::stop`]: switchovers and kills in
/// turn. Returns what each did.
#[cfg(feature = "cli")]
async fn serve_faults(cluster: Arc<PatroniCluster>, faults: FaultChannel) -> Vec<String> {
    let mut done = Vec::new();
    loop {
        let channel = faults.clone();
        let request = tokio::task::spawn_blocking(move || channel.request()).await.unwrap();
        if request == "stop" {
            return done;
        }
        let started = Instant::now();
        let outcome = if done.len() % 2 == 0 {
            cluster.switchover(None).await.map(|new| format!("switchover to node {new}"))
        } else {
            kill_leader_and_restart(&cluster).await
        };
        let answer = match outcome {
            Ok(what) => {
                done.push(format!("{what}, healthy after {:?}", started.elapsed()));
                "ok".to_owned()
            }
            Err(e) => {
                done.push(format!("failed: {e}"));
                format!("error: {}", e.to_string().lines().next().unwrap_or_default())
            }
        };
        let channel = faults.clone();
        tokio::task::spawn_blocking(move || channel.send("answer", &answer)).await.unwrap();
    }
}

/// `kill -9` of the leader's node, then its restart once another leads; returns once the
/// cluster is healthy again.
#[cfg(feature = "cli")]
async fn kill_leader_and_restart(cluster: &PatroniCluster) -> std::io::Result<String> {
    let old = cluster.wait_until_healthy().await?;
    cluster.kill_node(old)?;
    let new = cluster.wait_for_new_leader(old).await?;
    cluster.restart_node(old)?;
    cluster.wait_until_healthy().await?;
    Ok(format!("kill -9 of node {old}, node {new} leads"))
}
