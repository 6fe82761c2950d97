//! Opening against a server that stops answering: with the connection still up (a hung server
//! or middlebox; the kernel still acknowledges, so no TCP timeout fires), `open_until(stop)`
//! returns promptly at its stop from every wait of the opening, a connection left waiting for
//! an answer is closed rather than handed back to a pool, and a plain `open()` does not wait
//! for statistics held up. The hang is `testing::Proxy`'s (`hang`, `hang_requests`), or a lock
//! the test holds on the server.

use crate::common;

use std::future::Future;
use std::time::{Duration, Instant};

use common::{HANG_GUARD, admin, builder, lease_table, table, within};
use pgfence::{Builder, PgKvStore};
use pgfence_testing::{Proxy, TestCluster};

/// A `connect_timeout` that never ends a test: longer than its hang guard, so an opening that
/// waits for it rather than for its stop fails the test.
const NEVER: Duration = Duration::from_secs(2 * HANG_GUARD.as_secs());

/// `open_until` of `builder`, stopped once `stop_when` is done: asserts that it returned
/// `Ok(None)`, and returns how long after the stop it did.
async fn open_stopped_when(builder: Builder, stop_when: impl Future<Output = ()>) -> Duration {
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let opening = builder.open_until(async move {
        let _ = stopped.await;
    });
    let stop_later = async move {
        stop_when.await;
        drop(stop);
        Instant::now()
    };
    let (opened, stopped_at) =
        within("open_until stopped", async { tokio::join!(opening, stop_later) }).await;
    let took = stopped_at.elapsed();
    println!("open_until returned {took:?} after the stop");
    assert!(opened.unwrap().is_none(), "stopped");
    took
}

/// Half a second: long enough for an opening to send its statement.
async fn soon() {
    tokio::time::sleep(Duration::from_millis(500)).await
}

/// A table whose lease is free and whose `COMMIT` of a lease change waits on the server (at a
/// deferred trigger of the lease table) until `gate` (returned) lets it through by unlocking
/// advisory lock (hashtext(table), 7).
async fn commit_gated_table(prefix: &str) -> (String, tokio_postgres::Client) {
    let t = table(prefix);
    common::open(&t).await.close().await.unwrap();
    let gate = admin().await;
    gate.batch_execute(&format!(
        "CREATE FUNCTION \"{t}_gate\"() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN
             PERFORM pg_advisory_xact_lock_shared(hashtext('{t}'), 7);
             RETURN NULL;
         END $$;
         CREATE CONSTRAINT TRIGGER gate AFTER INSERT OR UPDATE ON {lease}
             DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION \"{t}_gate\"();
         SELECT pg_advisory_lock(hashtext('{t}'), 7);",
        lease = lease_table(&t),
    ))
    .await
    .unwrap();
    (t, gate)
}

/// Makes `table` (opened once before) look never analyzed, and locks it in a transaction on
/// `locker` so that the `ANALYZE` at the end of `open()` waits; roll back to let go.
async fn statistics_held_up<'a>(
    locker: &'a mut tokio_postgres::Client,
    table: &str,
) -> tokio_postgres::Transaction<'a> {
    let reset = format!("SELECT pg_stat_reset_single_table_counters('\"{table}\"'::regclass)");
    locker.batch_execute(&reset).await.unwrap();
    let lock = locker.transaction().await.unwrap();
    lock.batch_execute(&format!("LOCK TABLE \"{table}\" IN SHARE UPDATE EXCLUSIVE MODE"))
        .await
        .unwrap();
    lock
}

/// Waits until, on the server of `probe`, a session named `pgfence {app}` waits on a lock in a
/// statement matching `pattern` (SQL LIKE).
async fn wait_for_lock_wait(probe: &tokio_postgres::Client, app: &str, pattern: &str) {
    let sql = "SELECT 1 FROM pg_stat_activity WHERE application_name = $1
                AND wait_event_type = 'Lock' AND query LIKE $2";
    let app = format!("pgfence {app}");
    within(&format!("a lock wait in {pattern}"), async {
        while probe.query(sql, &[&app, &pattern]).await.unwrap().is_empty() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
}

/// A server that hangs from the start: the opening waits for the answer to its connection's
/// startup.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_until_stopped_while_connecting_to_a_hung_server_returns_at_once() {
    let server = common::server();
    let proxy = Proxy::start(server.tcp_addr().unwrap()).await.unwrap();
    proxy.hang();
    let t = table("hungconnect");
    let builder = PgKvStore::builder_from_config(server.config_via(proxy.addr()))
        .table(&t)
        .connect_timeout(NEVER);
    open_stopped_when(builder, soon()).await;
    let made = common::table_exists(&admin().await, &format!("{t}_lease")).await;
    assert!(!made, "nothing of the setup ran");
}

/// The application's pool (`builder_from_pool`), whose server hangs after its connection was
/// made: the opening's first statement goes unanswered, and its connection is closed, not
/// handed back to the pool (its next user would wait behind that statement).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_until_stopped_on_a_pool_whose_server_hangs_returns_at_once() {
    let server = common::server();
    let proxy = Proxy::start(server.tcp_addr().unwrap()).await.unwrap();
    let manager = pgfence::deadpool_postgres::Manager::new(
        server.config_via(proxy.addr()),
        tokio_postgres::NoTls,
    );
    let pool = pgfence::deadpool_postgres::Pool::builder(manager).max_size(1).build().unwrap();
    drop(pool.get().await.unwrap()); // Made, and idle in the pool.
    proxy.hang();
    let builder =
        PgKvStore::builder_from_pool(pool.clone()).table(table("hungpool")).connect_timeout(NEVER);
    open_stopped_when(builder, soon()).await;
    assert_eq!(pool.status().size, 0, "the unanswered connection left the pool");
}

/// A setup statement fails (here: cancelled while it waits for the setup lock; a `LeaseHeld`
/// takes the same path, a standby's usual one) and the server then stops answering: the
/// setup's `ROLLBACK` gets no answer, and is not waited for once stopped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_until_stopped_while_a_failed_setup_rolls_back_returns_at_once() {
    let server = common::server();
    let t = table("rbhang");
    common::open(&t).await.close().await.unwrap();
    let mut locker = admin().await;
    let lock = common::hold_setup_lock(&mut locker, &t).await;
    let proxy = Proxy::start(server.tcp_addr().unwrap()).await.unwrap();
    let app = format!("rbhang-{t}");
    let builder = PgKvStore::builder_from_config(server.config_via(proxy.addr()))
        .table(&t)
        .application_name(&app)
        .connect_timeout(NEVER);
    let rollback_unanswered = async {
        common::wait_for_app_lock_wait(&app).await;
        proxy.hang_requests(); // From now on the server hears nothing more.
        let cancel = "SELECT pg_cancel_backend(pid) FROM pg_stat_activity
                       WHERE application_name = $1 AND wait_event_type = 'Lock'";
        let cancelled = admin().await.query(cancel, &[&format!("pgfence {app}")]).await.unwrap();
        assert_eq!(cancelled.len(), 1, "the setup waiting for the lock");
        within("the client sends its ROLLBACK", async {
            while proxy.held() == 0 {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await;
    };
    open_stopped_when(builder, rollback_unanswered).await;
    lock.rollback().await.unwrap();
}

/// The setup's `COMMIT` waits on the server. That commit may still take the lease, so before
/// it returns the opening cancels it, waits for the setup's transaction to end (its setup
/// lock), and releases by its owner id: the lease stays free, and nothing of the opening is
/// left on the server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_until_stopped_while_its_commit_is_unanswered_leaves_the_lease_free() {
    let (t, gate) = commit_gated_table("commitgate").await;
    let app = format!("commitgate-{t}");
    let builder = builder(&t).application_name(&app).connect_timeout(NEVER);
    open_stopped_when(builder, common::wait_for_app_lock_wait(&app)).await;
    common::wait_until_no_sessions(&app).await;
    let (_, epoch, ms_left) = common::lease_row(&admin().await, &t).await;
    assert_eq!(epoch, 1, "the stopped setup's commit took nothing");
    assert!(ms_left <= 0, "nobody holds the lease");
    let unlock = "SELECT pg_advisory_unlock(hashtext($1), 7)";
    assert!(gate.query_one(unlock, &[&t]).await.unwrap().get::<_, bool>(0), "the gate held");
}

/// On the application's pool, the setup's `COMMIT` waits on the server, which then stops
/// answering: the release by owner id takes another connection of the pool, gets no answer,
/// and is given up after `connect_timeout`. Every connection left waiting for an answer is
/// closed, none handed back to the application's pool.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abandoned_release_never_hands_its_connection_back_to_the_pool() {
    let server = common::server();
    let (t, _gate) = commit_gated_table("relpool").await;
    let proxy = Proxy::start(server.tcp_addr().unwrap()).await.unwrap();
    let app = format!("relpool-{t}");
    let mut config = server.config_via(proxy.addr());
    config.application_name(&app);
    let manager = pgfence::deadpool_postgres::Manager::new(config, tokio_postgres::NoTls);
    let pool = pgfence::deadpool_postgres::Pool::builder(manager).max_size(2).build().unwrap();
    let (a, b) = (pool.get().await.unwrap(), pool.get().await.unwrap());
    drop((a, b)); // Both made, and idle in the pool.
    let builder = PgKvStore::builder_from_pool(pool.clone())
        .table(&t)
        .connect_timeout(Duration::from_secs(2));
    let commit_waiting_then_hang = async {
        let at_gate = "SELECT 1 FROM pg_stat_activity WHERE application_name = $1
                        AND wait_event_type = 'Lock' AND query = 'COMMIT'";
        common::wait_for_row("the commit waits at the gate", at_gate, &[&app]).await;
        proxy.hang();
    };
    open_stopped_when(builder, commit_waiting_then_hang).await;
    let status = pool.status();
    println!("application pool after the stop: {status:?}");
    assert_eq!(status.size, 0, "every connection left waiting for an answer was closed");
}

/// A table that has never had statistics, whose `ANALYZE` at the end of `open()` waits for a
/// lock the test holds. `open_until` stopped then returns, having closed the store it opened
/// (the lease released), and a plain `open()` returns after about one TTL without them: it
/// gives up on the statistics (best effort) rather than wait with the lease taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_does_not_wait_for_statistics_held_up() {
    let t = table("analyzewait");
    common::open(&t).await.close().await.unwrap();
    let mut locker = admin().await;
    let lock = statistics_held_up(&mut locker, &t).await;

    let app = format!("analyzewait-{t}");
    let stopped = builder(&t).application_name(&app).connect_timeout(NEVER);
    open_stopped_when(stopped, common::wait_for_app_lock_wait(&app)).await;
    common::wait_until_no_sessions(&app).await;
    let (_, epoch, ms_left) = common::lease_row(&admin().await, &t).await;
    assert_eq!(epoch, 2, "the stopped opening took the lease");
    assert!(ms_left <= 0, "and released it");

    let ttl = Duration::from_secs(3);
    let builder = builder(&t).lease_ttl(ttl).renew_interval(Duration::from_millis(500));
    let opening = builder.application_name(&app).open();
    let started = Instant::now();
    let store = within("open() with statistics held up", opening).await.unwrap();
    println!("open() returned after {:?} (TTL {ttl:?})", started.elapsed());
    store.write("n", "", "k", b"v".to_vec()).await.unwrap();
    store.close().await.unwrap();
    lock.rollback().await.unwrap();
}

/// `open_until` stopped while `ANALYZE` waits, on a server that then stops answering: the
/// store already opened is closed, and its release is given up within `drop_timeout`, as
/// `close()` does.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_until_stopped_during_statistics_on_a_hung_server_gives_up_the_release_in_time() {
    let server = common::server();
    let proxy = Proxy::start(server.tcp_addr().unwrap()).await.unwrap();
    let t = table("analyzehang");
    common::open(&t).await.close().await.unwrap();
    let mut locker = admin().await;
    let lock = statistics_held_up(&mut locker, &t).await;
    let app = format!("analyzehang-{t}");
    let drop_timeout = Duration::from_secs(6);
    let builder = PgKvStore::builder_from_config(server.config_via(proxy.addr()))
        .table(&t)
        .lease_ttl(Duration::from_secs(30))
        .renew_interval(Duration::from_millis(500))
        .connect_timeout(Duration::from_secs(2))
        .drop_timeout(drop_timeout)
        .application_name(&app);
    let analyze_waiting_then_hang = async {
        wait_for_lock_wait(&admin().await, &app, "ANALYZE%").await;
        // The renewal thread's own session exists (its first renewal has run).
        let renewing = "SELECT 1 FROM pg_stat_activity WHERE application_name = $1
                         AND query ILIKE '%UPDATE%' AND state = 'idle'";
        common::wait_for_row("a renewal ran", renewing, &[&format!("pgfence {app}")]).await;
        proxy.hang();
    };
    let took = open_stopped_when(builder, analyze_waiting_then_hang).await;
    assert!(took < drop_timeout + Duration::from_secs(2), "the release given up late: {took:?}");
    lock.rollback().await.unwrap();
}

/// With TLS, a store whose `ANALYZE` is held up by a lock, and whose server then stops
/// answering: giving up the statistics after one TTL sends a cancel request, which over TLS
/// waits for the server's answer to its SSLRequest. It is given up after `connect_timeout`, so
/// `open()` still returns.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_with_tls_gives_up_statistics_on_a_hung_server() {
    let cluster = TestCluster::start_tls().expect("a private cluster with TLS");
    let proxy = Proxy::start(cluster.tcp_addr()).await.unwrap();
    let t = table("tlsanalyze");
    let app = format!("tlsanalyze-{t}");
    let ttl = Duration::from_secs(3);
    let builder = || {
        PgKvStore::builder_from_config(cluster.config_via(proxy.addr()))
            .tls(cluster.tls_client_config().unwrap())
            .table(&t)
            .pool_size(2)
            .lease_ttl(ttl)
            .renew_interval(Duration::from_millis(500))
            .connect_timeout(Duration::from_secs(2))
            .drop_timeout(Duration::from_secs(2))
            .application_name(&app)
    };
    builder().open().await.unwrap().close().await.unwrap();
    let mut locker = cluster.connect().await.unwrap();
    let lock = statistics_held_up(&mut locker, &t).await;

    let started = Instant::now();
    let opening = tokio::spawn(builder().open());
    wait_for_lock_wait(&cluster.connect().await.unwrap(), &app, "ANALYZE%").await;
    proxy.hang();
    let store =
        within("open() with statistics held up on a hung server", opening).await.unwrap().unwrap();
    println!("open() returned after {:?} (TTL {ttl:?})", started.elapsed());
    let _ = store.close().await; // The server hangs: the release may fail.
    lock.rollback().await.unwrap();
}

/// The same cancel request, sent when `open_until` is stopped while the setup waits (for the
/// setup lock) and the TLS server stopped answering.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_until_with_tls_stopped_on_a_hung_server_returns() {
    let cluster = TestCluster::start_tls().expect("a private cluster with TLS");
    let proxy = Proxy::start(cluster.tcp_addr()).await.unwrap();
    let t = table("tlssetup");
    let app = format!("tlssetup-{t}");
    let mut locker = cluster.connect().await.unwrap();
    let lock = common::hold_setup_lock(&mut locker, &t).await;
    let builder = PgKvStore::builder_from_config(cluster.config_via(proxy.addr()))
        .tls(cluster.tls_client_config().unwrap())
        .table(&t)
        .connect_timeout(Duration::from_secs(2))
        .application_name(&app);
    let probe = cluster.connect().await.unwrap();
    let setup_waiting_then_hang = async {
        wait_for_lock_wait(&probe, &app, "%").await;
        proxy.hang();
    };
    open_stopped_when(builder, setup_waiting_then_hang).await;
    lock.rollback().await.unwrap();
}

/// A missing database, on a server that answers each new connection's startup and nothing
/// after it: the pool's connection fails at startup (no such database), and the connection of
/// its own that creates it gets no answer to its read-committed `SET`. The documented bound of
/// a new connection's startup and `SET` is `connect_timeout`: a plain `open()` fails within
/// about that, rather than waiting for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_creating_a_database_on_a_hung_server_gives_up_after_connect_timeout() {
    let server = common::server();
    let proxy = Proxy::start(server.tcp_addr().unwrap()).await.unwrap();
    proxy.hang_after_client_chunks(1);
    let mut config = server.config_via(proxy.addr());
    config.dbname(pgfence_testing::unique_name("hungcreatedb"));
    let connect_timeout = Duration::from_secs(2);
    let builder = PgKvStore::builder_from_config(config)
        .table(table("hungcreatedb"))
        .connect_timeout(connect_timeout);
    let started = Instant::now();
    let opened = within("open() creating a database", builder.open()).await;
    let took = started.elapsed();
    println!("open() returned {took:?}: {:?}", opened.as_ref().err());
    assert!(opened.is_err(), "the server never answered");
    assert!(proxy.held() > 0, "the hang was met");
    assert!(took < 2 * connect_timeout + Duration::from_secs(5), "gave up late: {took:?}");
}

/// A standby (no stop, no timeout) on the application's pool, whose one idle connection stops
/// answering (a middlebox holds back that connection only; new connections get through) while
/// the standby waits: once the holder releases, the standby's next attempt takes that
/// connection, whose first statement (a quick check before the setup) goes unanswered. The
/// attempt gives up after `connect_timeout`, closes that connection, and the standby retries
/// on a new one and takes the released lease, instead of waiting in one attempt for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standby_does_not_wait_for_good_in_one_attempt_on_a_silent_connection() {
    let server = common::server();
    let proxy = Proxy::start(server.tcp_addr().unwrap()).await.unwrap();
    let t = table("standbysilent");
    let holder = common::open(&t).await;
    let app = format!("standbysilent-{t}");
    let mut config = server.config_via(proxy.addr());
    config.application_name(&app);
    let manager = pgfence::deadpool_postgres::Manager::new(config, tokio_postgres::NoTls);
    let pool = pgfence::deadpool_postgres::Pool::builder(manager).max_size(1).build().unwrap();
    let standby = PgKvStore::builder_from_pool(pool.clone())
        .table(&t)
        .lease_ttl(Duration::from_secs(5))
        .renew_interval(Duration::from_secs(1))
        .connect_timeout(Duration::from_secs(2))
        .standby();
    let mut progress = standby.progress();
    let opening = tokio::spawn(standby.open());
    let waiting = progress.wait_for(|s| matches!(s, pgfence::StandbyState::Waiting { .. }));
    within("standby waiting", waiting).await.unwrap();
    let admin = admin().await;
    let pooled = "SELECT client_port FROM pg_stat_activity WHERE application_name = $1";
    let port: i32 = admin.query_one(pooled, &[&app]).await.unwrap().get(0);
    proxy.stall(u16::try_from(port).unwrap());
    holder.close().await.unwrap();
    let released = Instant::now();
    let store = within("standby takeover", opening).await.unwrap().expect("the standby opens");
    println!("standby took over {:?} after the release", released.elapsed());
    assert!(proxy.held() > 0, "the silent connection was met");
    store.close().await.unwrap();
}

/// `Builder::open_until` promises that once it returned `Ok(None)`, "nothing of this opening is
/// left running on the runtime, nor waiting on the server". A missing database, on a server
/// that answers each connection's startup and nothing after it: the connection that creates
/// the database waits for its `SET`, the stop comes, `Ok(None)`; that connection's task
/// (`connect::Tls::connect` spawns it; unlike a pooled one's, nothing aborts it) is still alive
/// on the runtime (the proxy runs on a runtime of its own, so the count is the opening's).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_until_stopped_leaves_nothing_running_on_the_runtime() {
    let server = common::server();
    let proxy_rt = tokio::runtime::Runtime::new().unwrap();
    let addr = server.tcp_addr().unwrap();
    let proxy = proxy_rt.spawn(async move { Proxy::start(addr).await.unwrap() }).await.unwrap();
    proxy.hang_after_client_chunks(1);
    let mut config = server.config_via(proxy.addr());
    config.dbname(pgfence_testing::unique_name("leftrunning"));
    let builder =
        PgKvStore::builder_from_config(config).table(table("leftrunning")).connect_timeout(NEVER);
    let metrics = tokio::runtime::Handle::current().metrics();
    let before = metrics.num_alive_tasks();
    let stop = async {
        while proxy.held() == 0 {
            tokio::time::sleep(Duration::from_millis(20)).await
        }
    };
    let opened = within("open_until", builder.open_until(stop)).await;
    assert!(matches!(opened, Ok(None)), "{:?}", opened.as_ref().err());
    tokio::time::sleep(Duration::from_millis(500)).await;
    let after = metrics.num_alive_tasks();
    println!("alive tasks before {before}, after Ok(None) {after}");
    drop(proxy);
    proxy_rt.shutdown_background();
    assert_eq!(after, before, "tasks of the opening still running after Ok(None)");
}
