//! Ten standbys on one store: what they cost the server while the holder is healthy, and a
//! chain of graceful handoffs in which exactly one standby acquires each time. Once with a
//! LISTEN connection each, once sharing one.

use crate::common;

use std::time::{Duration, Instant};

use common::{admin, table, within};
use pgfence::{PgKvStore, StandbyState};
use tokio::sync::watch;
use tokio::task::JoinHandle;

const STANDBYS: usize = 10;
/// Long enough that no standby's attempt at the holder's expiry falls in the quiet time below.
const TTL: Duration = Duration::from_secs(60);
const RENEW_EVERY: Duration = Duration::from_secs(5);

type Waiting = (JoinHandle<pgfence::Result<PgKvStore>>, watch::Receiver<StandbyState>);

/// The transactions committed in `db` so far, as the statistics show them.
async fn commits(db: &str) -> i64 {
    let admin = admin().await;
    // Backends report their counts about once a second; a snapshot per transaction is cleared.
    admin.batch_execute("SELECT pg_stat_clear_snapshot()").await.unwrap();
    let row = admin
        .query_one("SELECT xact_commit FROM pg_stat_database WHERE datname = $1", &[&db])
        .await
        .unwrap();
    row.get(0)
}

/// Each server session of the standbys of `app`: its process id and when its last statement
/// started.
async fn statements(app: &str) -> Vec<(i32, Option<std::time::SystemTime>)> {
    let sessions = "SELECT pid, query_start FROM pg_stat_activity WHERE application_name LIKE $1";
    let rows = admin().await.query(sessions, &[&format!("pgfence {app}-standby%")]).await.unwrap();
    rows.iter().map(|row| (row.get(0), row.get(1))).collect()
}

/// Ten standbys wait on one healthy holder, each with a LISTEN connection of its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_standbys_idle_on_one_connection_each_and_exactly_one_takes_over() {
    ten_standbys("sbten", false).await;
}

/// Ten standbys wait on one healthy holder, sharing one LISTEN connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_standbys_share_one_listen_connection_and_exactly_one_takes_over() {
    ten_standbys("sbshare", true).await;
}

/// Ten standbys wait on one healthy holder: idle LISTEN connections (one each, or one shared),
/// and no statement. Then the holder closes, and so does each successor in turn: every time
/// exactly one standby acquires, with a higher epoch. Prints the median handoff.
async fn ten_standbys(prefix: &str, shared: bool) {
    let (config, _superuser) = common::own_database(prefix).await;
    let db = config.get_dbname().expect("a database name").to_owned();
    let t = table(prefix);
    let app = format!("{prefix}-{}", &t[t.len() - 8..]);
    let builder = |name: &str| {
        PgKvStore::builder_from_config(config.clone())
            .table(&t)
            .pool_size(2)
            .lease_ttl(TTL)
            .renew_interval(RENEW_EVERY)
            .application_name(format!("{app}-{name}"))
    };
    let mut holder = builder("holder").open().await.expect("the first holder opens");
    // Shared: the standbys of one fleet, with its one LISTEN connection and its pool.
    let fleet = builder("standby-fleet").fleet().expect("a fleet");
    let mut waiting: Vec<Waiting> = Vec::new();
    for i in 0..STANDBYS {
        let standby = match shared {
            true => fleet.builder(&t),
            false => builder(&format!("standby{i}")),
        };
        let standby = standby.standby();
        let mut progress = standby.progress();
        let task = tokio::spawn(standby.open());
        within("standby waiting", progress.wait_for(|s| matches!(s, StandbyState::Waiting { .. })))
            .await
            .unwrap();
        waiting.push((task, progress));
    }

    // While the holder is healthy: connections and statements of the standbys. A connection
    // an attempt closed (its pooler check's own, say) may linger on the server for a moment
    // on a loaded machine: counted again until the expected count, for at most 10 s.
    let sessions = format!(
        "SELECT count(*), count(*) FILTER (WHERE state = 'idle' AND query LIKE 'LISTEN%'), \
                count(*) FILTER (WHERE state = 'idle' AND query NOT LIKE 'LISTEN%') \
         FROM pg_stat_activity WHERE application_name LIKE 'pgfence {app}-standby%'"
    );
    let admin_client = admin().await;
    let settled = Instant::now() + Duration::from_secs(10);
    let (all, listening, warm) = loop {
        let row = admin_client.query_one(&sessions, &[]).await.unwrap();
        let counts: (i64, i64, i64) = (row.get(0), row.get(1), row.get(2));
        let (all, listening, warm) = counts;
        let expected = match shared {
            true => listening == 1 && warm <= 2 && all <= 3,
            false => {
                (listening, warm, all) == (STANDBYS as i64, STANDBYS as i64, 2 * STANDBYS as i64)
            }
        };
        if expected || Instant::now() > settled {
            break counts;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    // Each standby also keeps the connection of its last attempt idle, for its next one.
    eprintln!(
        "{STANDBYS} standbys (shared: {shared}): {all} server connections, {listening} idle in \
         LISTEN, {warm} idle for the next attempt"
    );
    if shared {
        // One LISTEN connection, and the attempts on the fleet's pool of 2.
        assert_eq!(listening, 1, "LISTEN connections");
        assert!(warm <= 2 && all <= 3, "{all} connections, {warm} warm");
    } else {
        assert_eq!(listening, STANDBYS as i64, "LISTEN connections");
        assert_eq!((warm, all), (STANDBYS as i64, 2 * STANDBYS as i64), "one warm each");
    }
    // An idle backend reports its transactions to the statistics up to 10 s late (PostgreSQL
    // 15's PGSTAT_IDLE_INTERVAL): those of the standbys' first looks must not count below.
    tokio::time::sleep(Duration::from_secs(11)).await;
    const QUIET: Duration = Duration::from_secs(15);
    let before = commits(&db).await;
    let statements_before = statements(&app).await;
    tokio::time::sleep(QUIET).await;
    let during = commits(&db).await - before;
    let statements_after = statements(&app).await;
    // A session's last statement, by when it started: the same at both ends if it ran none.
    // (The statistics miss a transaction that reads no table, `SELECT 1` say, until the
    // session ends.)
    let active = statements_after.iter().filter(|s| !statements_before.contains(s)).count();
    eprintln!(
        "{STANDBYS} standbys (shared: {shared}): {active} sessions ran a statement in {QUIET:?}"
    );
    assert_eq!(active, 0, "no statement from a waiting standby: {statements_after:?}");
    eprintln!(
        "{STANDBYS} standbys (shared: {shared}) and a holder: {during} transactions in {QUIET:?}"
    );
    // The holder renews every 5 s: one transaction each. The standbys run none: TCP keepalives
    // check their LISTEN connections, and their attempt at the holder's expiry (about a TTL
    // after each looked) falls after this. The server's own autovacuum may run a few.
    let renewals = (QUIET.as_secs() / RENEW_EVERY.as_secs()) as i64 + 1;
    assert!(during <= renewals + 5, "{during} transactions in {QUIET:?}");

    let mut handoffs = Vec::new();
    let mut epoch = holder.fencing_token();
    while !waiting.is_empty() {
        let started = Instant::now();
        holder.close().await.expect("a graceful close");
        let winner = within("a standby acquires", async {
            loop {
                if let Some(i) = waiting.iter().position(|(task, _)| task.is_finished()) {
                    break i;
                }
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        })
        .await;
        handoffs.push(started.elapsed());
        // Long enough for every woken standby to have made its attempt.
        tokio::time::sleep(Duration::from_millis(500)).await;
        let finished = waiting.iter().filter(|(task, _)| task.is_finished()).count();
        assert_eq!(finished, 1, "exactly one standby acquires");
        let (task, progress) = waiting.swap_remove(winner);
        holder = task.await.unwrap().expect("the winner opens the store");
        assert!(matches!(*progress.borrow(), StandbyState::Acquired { .. }));
        assert!(holder.fencing_token() > epoch, "each acquisition has a higher epoch");
        epoch = holder.fencing_token();
        holder.write("ns", "sub", "k", epoch.to_be_bytes().to_vec()).await.unwrap();
    }
    holder.close().await.unwrap();
    within("the fleet closes", fleet.close()).await;
    handoffs.sort();
    eprintln!(
        "graceful handoff (shared: {shared}) with {STANDBYS} down to 1 standbys waiting: median \
         {:?}, min {:?}, max {:?}",
        handoffs[handoffs.len() / 2],
        handoffs[0],
        handoffs[handoffs.len() - 1]
    );
}
