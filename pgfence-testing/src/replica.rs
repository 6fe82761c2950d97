//! A primary with a streaming replica that can be promoted: [`ReplicatedCluster`].

use std::io;
use std::thread;
use std::time::{Duration, Instant};

use tokio_postgres::Config;
use tokio_postgres::config::TargetSessionAttrs;

use crate::TestCluster;
use crate::cluster::{CONNECT_TIMEOUT, Cluster, SUPERUSER};
use crate::connect_spawned;

/// How long the harness waits for the replica to stream, to catch up, to stop streaming, or to
/// accept writes after its promotion.
const REPLICATION_WAIT: Duration = Duration::from_secs(60);

/// How the primary of a [`ReplicatedCluster`] commits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Replication {
    /// `synchronous_standby_names = '*'` with the default `synchronous_commit = on`: a commit
    /// returns once the replica has flushed it. A promotion loses no acknowledged commit.
    Synchronous,
    /// The default: a commit returns once the primary has flushed it. A promotion loses what the
    /// replica had not received yet.
    Asynchronous,
}

/// Two private clusters: a primary, and a hot standby streaming from it, on the same machine.
///
/// It is for failover tests: crash the primary ([`ReplicatedCluster::crash_primary`]), promote
/// the replica ([`ReplicatedCluster::promote`]), and check what the promoted server holds. A
/// client given [`ReplicatedCluster::config`] names both servers and connects to whichever
/// accepts writes, as a client of a real failover pair would.
///
/// The replica's data directory is a copy of the primary's, taken while the primary is stopped
/// in fast mode (a valid base backup). It streams from the primary with `standby.signal` and
/// `primary_conninfo` (PostgreSQL 12 or later). So it needs only `initdb`, `pg_ctl` and
/// `postgres`, like every private cluster, and no `pg_basebackup`.
///
/// Each server is a [`TestCluster`]: dropping this stops both and deletes their directories, and
/// their watchdogs do it if the process dies first. The methods block; from async code that is
/// acceptable in tests (or use `spawn_blocking`).
#[derive(Debug)]
pub struct ReplicatedCluster {
    primary: TestCluster,
    replica: TestCluster,
    replication: Replication,
}

impl ReplicatedCluster {
    /// Starts a primary and a replica streaming from it. With [`Replication::Synchronous`], this
    /// returns once the primary reports the replica as its synchronous standby.
    pub fn start(replication: Replication) -> io::Result<ReplicatedCluster> {
        let primary = TestCluster::start()?;
        let replica = TestCluster::from_cluster(Cluster::launch_replica(&primary.cluster)?);
        let cluster = ReplicatedCluster { primary, replica, replication };
        cluster.wait_for_primary("the replica to stream", "state = 'streaming'")?;
        if replication == Replication::Synchronous {
            // Set only now: with a synchronous standby named but not connected, every commit
            // on the primary would wait for it.
            let config = cluster.primary.config();
            query(config.clone(), "ALTER SYSTEM SET synchronous_standby_names = '*'")?;
            query(config, "SELECT pg_reload_conf()")?;
            cluster.wait_for_primary("the replica to be synchronous", "sync_state = 'sync'")?;
        }
        Ok(cluster)
    }

    /// The primary (until [`ReplicatedCluster::promote`], the only server accepting writes).
    pub fn primary(&self) -> &TestCluster {
        &self.primary
    }

    /// The replica: a read-only hot standby until [`ReplicatedCluster::promote`].
    pub fn replica(&self) -> &TestCluster {
        &self.replica
    }

    /// The replication mode it was started with.
    pub fn replication(&self) -> Replication {
        self.replication
    }

    /// A superuser configuration naming the primary, then the replica, with
    /// `target_session_attrs=read-write`. A connection goes to the first that accepts writes:
    /// the primary while it runs, the promoted replica after a failover.
    pub fn config(&self) -> Config {
        let mut config = Config::new();
        config
            .host("127.0.0.1")
            .port(self.primary.port())
            .host("127.0.0.1")
            .port(self.replica.port())
            .user(SUPERUSER)
            .dbname(SUPERUSER)
            .target_session_attrs(TargetSessionAttrs::ReadWrite)
            .connect_timeout(CONNECT_TIMEOUT);
        config
    }

    /// [`ReplicatedCluster::config`] as a URL, as libpq takes it too.
    pub fn url(&self) -> String {
        format!(
            "postgres://{SUPERUSER}@127.0.0.1:{},127.0.0.1:{}/{SUPERUSER}\
             ?target_session_attrs=read-write",
            self.primary.port(),
            self.replica.port()
        )
    }

    /// Returns once the replica has replayed all the WAL the primary had inserted when called.
    ///
    /// That includes transactions committed with `synchronous_commit = off`, whose commit
    /// record is flushed (and only then sent) by the WAL writer a moment later.
    pub fn wait_for_replica(&self) -> io::Result<()> {
        let lsn = query(self.primary.config(), "SELECT pg_current_wal_insert_lsn()::text")?;
        let lsn = lsn.first().cloned().flatten().unwrap_or_default();
        let caught_up = format!("SELECT pg_last_wal_replay_lsn() >= '{lsn}'::pg_lsn");
        wait_for(&format!("the replica to replay up to {lsn}"), || {
            Ok(query(self.replica.config(), &caught_up)?.first() == Some(&Some("t".to_owned())))
        })
    }

    /// Stops the replica's streaming, so that nothing the primary commits from now on reaches
    /// it. Then a promotion loses those commits, as an asynchronous replica that lags does.
    /// Refused with [`Replication::Synchronous`]: every commit would wait for the replica.
    pub fn detach_replica(&self) -> io::Result<()> {
        if self.replication == Replication::Synchronous {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "detach_replica on a synchronous pair would block every commit on the primary",
            ));
        }
        // `primary_conninfo` is reloadable since PostgreSQL 13. Empty, the replica stops its
        // WAL receiver and stays in recovery.
        query(self.replica.config(), "ALTER SYSTEM SET primary_conninfo = ''")?;
        query(self.replica.config(), "SELECT pg_reload_conf()")?;
        wait_for("the replica to stop streaming", || {
            Ok(query(self.primary.config(), "SELECT 1 FROM pg_stat_replication")?.is_empty())
        })
    }

    /// Crashes the primary: [`TestCluster::crash`] (`pg_ctl stop -m immediate`).
    pub fn crash_primary(&self) -> io::Result<()> {
        self.primary.crash()
    }

    /// Promotes the replica (`pg_ctl promote`), and returns once it accepts writes. It starts a
    /// new timeline. The primary should be down by then; else both accept writes.
    pub fn promote(&self) -> io::Result<()> {
        self.replica.cluster.promote()?;
        wait_for("the promoted replica to accept writes", || {
            let shown = query(self.replica.config(), "SELECT pg_is_in_recovery()")?;
            Ok(shown.first() == Some(&Some("f".to_owned())))
        })
    }

    /// Waits until the primary's `pg_stat_replication` shows the replica with `condition`.
    fn wait_for_primary(&self, what: &str, condition: &str) -> io::Result<()> {
        let sql = format!(
            "SELECT 1 FROM pg_stat_replication \
              WHERE application_name = 'pgfence_replica' AND {condition}"
        );
        wait_for(what, || Ok(!query(self.primary.config(), &sql)?.is_empty()))
    }
}

/// Calls `done` every 50 ms until it returns true, for at most [`REPLICATION_WAIT`]. An error
/// of `done` ends the wait with that error; a wait that runs out is a `TimedOut` error.
fn wait_for(what: &str, mut done: impl FnMut() -> io::Result<bool>) -> io::Result<()> {
    let deadline = Instant::now() + REPLICATION_WAIT;
    while !done()? {
        if Instant::now() >= deadline {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("gave up waiting for {what} after {REPLICATION_WAIT:?}"),
            ));
        }
        thread::sleep(Duration::from_millis(50));
    }
    Ok(())
}

/// Runs `sql` (one statement, simple query protocol) and returns the first column of every row,
/// as text.
///
/// On a thread of its own with its own runtime: it may be called from inside a tokio runtime,
/// where blocking on a future is not allowed.
fn query(config: Config, sql: &str) -> io::Result<Vec<Option<String>>> {
    let owned = sql.to_owned();
    thread::spawn(move || -> io::Result<Vec<Option<String>>> {
        let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        runtime.block_on(async {
            let client = connect_spawned(&config).await.map_err(io::Error::other)?;
            let messages = client.simple_query(&owned).await.map_err(io::Error::other)?;
            Ok(messages
                .iter()
                .filter_map(|message| match message {
                    tokio_postgres::SimpleQueryMessage::Row(row) => {
                        Some(row.get(0).map(str::to_owned))
                    }
                    _ => None,
                })
                .collect())
        })
    })
    .join()
    .map_err(|_| io::Error::other(format!("the thread running `{sql}` panicked")))?
    .map_err(|e| io::Error::new(e.kind(), format!("`{sql}`: {e}")))
}
