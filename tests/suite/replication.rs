//! A primary that fails over to its streaming replica, while writers run.
//!
//! The store names both servers with `target_session_attrs=read-write`
//! ([`ReplicatedCluster::config`]), so it reconnects to the replica once that is promoted. The
//! primary crashes (`pg_ctl stop -m immediate`): nothing more reaches the replica.
//!
//! - Synchronous replication loses no acknowledged write, and the lease goes on unchanged.
//! - Asynchronous replication may lose the last acquisition. The store that made it then fails
//!   closed, and the next acquisition's fencing token is still above every token given before.

use crate::common;

use std::collections::BTreeSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use common::{table, within};
use pgfence::{Error, LeaseState, PgKvStore};
use pgfence_testing::{ReplicatedCluster, Replication};

fn builder(pair: &ReplicatedCluster, t: &str) -> pgfence::Builder {
    PgKvStore::builder_from_config(pair.config())
        .table(t)
        .pool_size(4)
        .lease_ttl(Duration::from_secs(15))
        .renew_interval(Duration::from_secs(3))
}

fn start(replication: Replication) -> ReplicatedCluster {
    ReplicatedCluster::start(replication).expect("a primary with a streaming replica")
}

/// How a writer ended.
#[derive(Debug)]
struct Written {
    writer: usize,
    /// Every counter whose write returned `Ok`, each written to a key of its own.
    acked: Vec<u64>,
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
    (0..writers)
        .map(|writer| {
            let (store, stop) = (store.clone(), stop.clone());
            tokio::spawn(async move {
                let mut acked = Vec::new();
                for n in 1u64.. {
                    if stop.load(Ordering::Relaxed) {
                        break;
                    }
                    let key = format!("w{writer}-{n}");
                    if let Err(error) = store.write("r", "s", &key, n.to_be_bytes().to_vec()).await
                    {
                        return Written { writer, acked, error: Some(error) };
                    }
                    acked.push(n);
                }
                Written { writer, acked, error: None }
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

/// The keys of the KV table written under fencing token `epoch`, as `client`'s server shows
/// them.
async fn keys_of_epoch(client: &tokio_postgres::Client, t: &str, epoch: i64) -> BTreeSet<String> {
    let sql = format!("SELECT key FROM \"{t}\" WHERE epoch = $1");
    client.query(&sql, &[&epoch]).await.unwrap().iter().map(|row| row.get(0)).collect()
}

/// Crashes the primary and promotes the replica, off the runtime (both block).
async fn fail_over(pair: &Arc<ReplicatedCluster>) {
    let pair = pair.clone();
    within(
        "the failover",
        tokio::task::spawn_blocking(move || {
            pair.crash_primary().expect("crash the primary");
            pair.promote().expect("promote the replica");
        }),
    )
    .await
    .unwrap();
}

/// Synchronous replication: the writers go on through the failover without an error, and every
/// write acknowledged before, during or after it is on the promoted server. A former owner's
/// write never lands after the next owner's acquisition, and fencing tokens keep increasing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn synchronous_failover_keeps_every_acknowledged_write_and_the_lease() {
    let pair = Arc::new(start(Replication::Synchronous));
    let t = table("repl_sync");
    let first = within("open", builder(&pair, &t).open()).await.unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let writers = spawn_writers(&first, 3, &stop);
    tokio::time::sleep(Duration::from_millis(500)).await;
    fail_over(&pair).await;
    // Writes after the promotion: each writer must get further.
    let promoted = pair.replica().connect().await.unwrap();
    let before = keys_of_epoch(&promoted, &t, first.fencing_token()).await.len();
    within("writes on the promoted server", async {
        while keys_of_epoch(&promoted, &t, first.fencing_token()).await.len() < before + 30 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    assert_eq!(*first.lease_state().borrow(), LeaseState::Held { epoch: first.fencing_token() });

    // A successor takes over on the promoted server, as if the first owner had stalled past its
    // expiry: its writers run on and must be fenced from now on.
    let expire = format!("UPDATE \"{t}_lease\" SET expires_at = clock_timestamp() WHERE id = 1");
    promoted.execute(&expire, &[]).await.unwrap();
    let next = within("the takeover", builder(&pair, &t).open()).await.unwrap();
    assert!(
        next.fencing_token() > first.fencing_token(),
        "{} after {}",
        next.fencing_token(),
        first.fencing_token()
    );
    let at_takeover = keys_of_epoch(&promoted, &t, first.fencing_token()).await;
    let written = join(writers).await;
    assert_eq!(
        keys_of_epoch(&promoted, &t, first.fencing_token()).await,
        at_takeover,
        "no write of the former owner landed after the takeover"
    );
    for w in &written {
        assert!(
            matches!(w.error, Some(Error::LeaseLost { .. })),
            "writer {} ended with {:?}, not a lost lease",
            w.writer,
            w.error
        );
        for n in &w.acked {
            let key = format!("w{}-{n}", w.writer);
            assert!(at_takeover.contains(&key), "acknowledged {key} is on the promoted server");
        }
    }
    next.write("r", "s", "after", b"v".to_vec()).await.unwrap();
    next.close().await.unwrap();
    stop.store(true, Ordering::Relaxed);
    drop(first);
}

/// Asynchronous replication: the replica stops receiving, an owner releases, a second one
/// acquires and writes, and the primary crashes. The promoted server has lost that
/// acquisition. The second owner's store must fail closed, and the next acquisition must get a
/// fencing token above the lost one, never the same one again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn asynchronous_failover_never_reissues_a_fencing_token() {
    let pair = Arc::new(start(Replication::Asynchronous));
    let t = table("repl_async");
    let first = within("open", builder(&pair, &t).open()).await.unwrap();
    first.write("r", "s", "first", b"v".to_vec()).await.unwrap();
    first.close().await.unwrap();
    let detach = pair.clone();
    tokio::task::spawn_blocking(move || {
        detach.wait_for_replica()?;
        detach.detach_replica()
    })
    .await
    .unwrap()
    .expect("the replica stops streaming");

    // Only the primary ever sees this acquisition and these writes.
    let lost = within("open", builder(&pair, &t).open()).await.unwrap();
    assert!(lost.fencing_token() > first.fencing_token());
    let stop = Arc::new(AtomicBool::new(false));
    let writers = spawn_writers(&lost, 2, &stop);
    tokio::time::sleep(Duration::from_millis(500)).await;
    fail_over(&pair).await;

    // The promoted server shows the first owner's released lease: the lost owner's writers and
    // renewal find their lease gone and fail closed.
    for w in join(writers).await {
        assert!(
            matches!(w.error, Some(Error::LeaseLost { .. })),
            "writer {} ended with {:?}, not a lost lease",
            w.writer,
            w.error
        );
    }
    within("the renewal's loss", async {
        let mut state = lost.lease_state();
        state.wait_for(|s| matches!(s, LeaseState::Lost { .. })).await.unwrap();
    })
    .await;
    let again = lost.write("r", "s", "again", b"v".to_vec()).await.unwrap_err();
    assert!(matches!(again, Error::LeaseLost { .. }), "{again:?}");

    let next = within("open on the promoted server", builder(&pair, &t).open()).await.unwrap();
    assert!(
        next.fencing_token() > lost.fencing_token(),
        "token {} given again after the promotion (the lost acquisition had it)",
        next.fencing_token()
    );
    let promoted = pair.replica().connect().await.unwrap();
    assert!(keys_of_epoch(&promoted, &t, lost.fencing_token()).await.is_empty());
    next.write("r", "s", "after", b"v".to_vec()).await.unwrap();
    next.close().await.unwrap();
    drop(lost);
}
