//! Review of f2896ae ("open() and open_until(stop) no longer wait for a server that stopped
//! answering"): waits of the opening that a stop (or the TTL bound on statistics) still does
//! not end, and a connection handed back to the application's pool with a statement unanswered.

mod common;

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use common::{admin, lease_table, table, within};
use pgfence::PgKvStore;
use pgfence::testing::{Proxy, TestCluster};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A TCP proxy that always forwards what the server sends, and what the client sends only until
/// `block` is set; after that it reads and holds back the client's data (counting the chunks
/// in `held`): a server that answered a statement and then hung, as seen from the client.
struct OneWay {
    addr: SocketAddr,
    block: Arc<AtomicBool>,
    held: Arc<AtomicUsize>,
}

impl OneWay {
    async fn start(upstream: SocketAddr) -> OneWay {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let block = Arc::new(AtomicBool::new(false));
        let held = Arc::new(AtomicUsize::new(0));
        let (b, h) = (block.clone(), held.clone());
        tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let (block, held) = (b.clone(), h.clone());
                tokio::spawn(async move {
                    let server = TcpStream::connect(upstream).await.unwrap();
                    let (mut cr, mut cw) = client.into_split();
                    let (mut sr, mut sw) = server.into_split();
                    let up = async move {
                        let mut buf = vec![0u8; 64 * 1024];
                        let mut kept = Vec::new();
                        loop {
                            let n = cr.read(&mut buf).await.unwrap_or(0);
                            if n == 0 {
                                break;
                            }
                            if block.load(Ordering::SeqCst) {
                                kept.extend_from_slice(&buf[..n]); // Held back, never sent.
                                held.fetch_add(1, Ordering::SeqCst);
                            } else if sw.write_all(&buf[..n]).await.is_err() {
                                break;
                            }
                        }
                        drop(sw);
                    };
                    let down = async move {
                        let _ = tokio::io::copy(&mut sr, &mut cw).await;
                    };
                    tokio::join!(up, down);
                });
            }
        });
        OneWay { addr, block, held }
    }
}

/// `open_until(stop)`, with `stop` a channel the test drops.
fn spawn_open_until(
    builder: pgfence::Builder,
) -> (tokio::sync::oneshot::Sender<()>, tokio::task::JoinHandle<pgfence::Result<Option<PgKvStore>>>)
{
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let opening = tokio::spawn(builder.open_until(async move {
        let _ = stopped.await;
    }));
    (stop, opening)
}

/// A setup statement fails (here: cancelled while it waits for the setup lock; a `LeaseHeld`
/// takes the same path) and the server then stops answering: the setup's `ROLLBACK` gets no
/// answer. `open_until` stopped then must still return at once, as its docs promise for a
/// server that stopped answering; on f2896ae the rollback is awaited without watching the stop.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_until_stopped_while_a_failed_setup_rolls_back_on_a_hung_server_returns() {
    let server = common::server();
    let t = table("rbhang");
    common::open(&t).await.close().await.unwrap();
    let mut locker = admin().await;
    let lock = common::hold_setup_lock(&mut locker, &t).await;
    let proxy = OneWay::start(server.tcp_addr().unwrap()).await;
    let app = format!("rbhang-{t}");
    let builder = PgKvStore::builder_from_config(server.config_via(proxy.addr))
        .table(&t)
        .application_name(&app)
        .connect_timeout(Duration::from_secs(2));
    let (stop, opening) = spawn_open_until(builder);
    common::wait_for_app_lock_wait(&app).await;
    let pid: i32 = admin()
        .await
        .query_one(
            "SELECT pid FROM pg_stat_activity WHERE application_name = $1 AND wait_event_type = 'Lock'",
            &[&format!("pgfence {app}")],
        )
        .await
        .unwrap()
        .get(0);
    proxy.block.store(true, Ordering::SeqCst); // From now on the server hears nothing more.
    admin().await.execute("SELECT pg_cancel_backend($1)", &[&pid]).await.unwrap();
    within("the client sends its ROLLBACK", async {
        while proxy.held.load(Ordering::SeqCst) == 0 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    drop(stop);
    let started = Instant::now();
    let opened = within("open_until stopped during the rollback", opening).await.unwrap();
    println!("open_until returned {:?} after the stop", started.elapsed());
    assert!(opened.unwrap().is_none());
    lock.rollback().await.unwrap();
}

/// A store with TLS whose `ANALYZE` (at the end of `open()`) is held up by a lock, and whose
/// server then stops answering. The docs: given up after one TTL, "the store is returned
/// without them". But giving up sends a cancel request, which over TLS waits for the server's
/// answer to its SSLRequest, for ever on a hung server: on f2896ae `open()` never returns.
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
    let reset = format!("SELECT pg_stat_reset_single_table_counters('\"{t}\"'::regclass)");
    locker.batch_execute(&reset).await.unwrap();
    let lock = locker.transaction().await.unwrap();
    lock.batch_execute(&format!("LOCK TABLE \"{t}\" IN SHARE UPDATE EXCLUSIVE MODE"))
        .await
        .unwrap();

    let started = Instant::now();
    let opening = tokio::spawn(builder().open());
    let probe = cluster.connect().await.unwrap();
    let waiting = "SELECT 1 FROM pg_stat_activity WHERE application_name = $1
                    AND wait_event_type = 'Lock' AND query ILIKE 'ANALYZE%'";
    within("ANALYZE waits for the lock", async {
        while probe.query(waiting, &[&format!("pgfence {app}")]).await.unwrap().is_empty() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    proxy.hang();
    let store =
        within("open() with statistics held up on a hung server", opening).await.unwrap().unwrap();
    println!("open() returned after {:?} (TTL {ttl:?})", started.elapsed());
    let _ = store.close().await; // The server hangs: the release may fail.
    lock.rollback().await.unwrap();
}

/// The same cancel request, sent when `open_until` is stopped while the setup waits (for the
/// setup lock) and the TLS server stopped answering: on f2896ae `open_until` never returns.
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
    let (stop, opening) = spawn_open_until(builder);
    let probe = cluster.connect().await.unwrap();
    let waiting = "SELECT 1 FROM pg_stat_activity WHERE application_name = $1
                    AND wait_event_type = 'Lock'";
    within("the setup waits for the setup lock", async {
        while probe.query(waiting, &[&format!("pgfence {app}")]).await.unwrap().is_empty() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    proxy.hang();
    drop(stop);
    let started = Instant::now();
    let opened = within("open_until stopped on a hung TLS server", opening).await.unwrap();
    println!("open_until returned {:?} after the stop", started.elapsed());
    assert!(opened.unwrap().is_none());
    lock.rollback().await.unwrap();
}

/// `builder_from_pool`: `open_until` stopped while its commit waits (a deferred trigger holds
/// it), and the server then stops answering. The release by owner id takes another connection
/// of the application's pool, gets no answer, and is given up after `connect_timeout`. The
/// docs: "A connection left waiting for an answer is closed, never handed back to a pool."
/// On f2896ae the release's connection goes back to the application's pool with its statement
/// unanswered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abandoned_release_never_hands_its_connection_back_to_the_pool() {
    let server = common::server();
    let t = table("relpool");
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
    let (stop, opening) = spawn_open_until(builder);
    let at_gate = "SELECT 1 FROM pg_stat_activity WHERE application_name = $1
                    AND wait_event_type = 'Lock' AND query = 'COMMIT'";
    common::wait_for_row("the commit waits at the gate", at_gate, &[&app]).await;
    proxy.hang();
    drop(stop);
    let opened = within("open_until stopped", opening).await.unwrap();
    assert!(opened.unwrap().is_none());
    let status = pool.status();
    println!("application pool after the stop: {status:?}");
    assert_eq!(status.size, 0, "every connection left waiting for an answer was closed");
}

/// `open_until` stopped while `ANALYZE` waits for a lock, on a server that then stops
/// answering: the store already opened is closed. The docs of `Builder::open_until` at f2896ae
/// said "a release that gets no answer is given up after `connect_timeout`" (this test then
/// asserted that, and failed after 20 s); but `close()` gives its release `drop_timeout`
/// (here 20 s, with `connect_timeout` 2 s), as the docs now say.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_until_stopped_during_statistics_on_a_hung_server_gives_up_the_release_in_time() {
    let server = common::server();
    let proxy = Proxy::start(server.tcp_addr().unwrap()).await.unwrap();
    let t = table("analyzehang");
    common::open(&t).await.close().await.unwrap();
    let mut locker = admin().await;
    let reset = format!("SELECT pg_stat_reset_single_table_counters('\"{t}\"'::regclass)");
    locker.batch_execute(&reset).await.unwrap();
    let lock = locker.transaction().await.unwrap();
    lock.batch_execute(&format!("LOCK TABLE \"{t}\" IN SHARE UPDATE EXCLUSIVE MODE"))
        .await
        .unwrap();
    let app = format!("analyzehang-{t}");
    let connect_timeout = Duration::from_secs(2);
    let drop_timeout = Duration::from_secs(20);
    let builder = PgKvStore::builder_from_config(server.config_via(proxy.addr()))
        .table(&t)
        .lease_ttl(Duration::from_secs(30))
        .renew_interval(Duration::from_millis(500))
        .connect_timeout(connect_timeout)
        .drop_timeout(drop_timeout)
        .application_name(&app);
    let (stop, opening) = spawn_open_until(builder);
    let waiting = "SELECT 1 FROM pg_stat_activity WHERE application_name = $1
                    AND wait_event_type = 'Lock' AND query ILIKE 'ANALYZE%'";
    common::wait_for_row("ANALYZE waits", waiting, &[&format!("pgfence {app}")]).await;
    // The renewal thread's own session exists (its first renewal has run).
    let renewing = "SELECT 1 FROM pg_stat_activity WHERE application_name = $1
                     AND query ILIKE '%UPDATE%' AND state = 'idle'";
    common::wait_for_row("a renewal ran", renewing, &[&format!("pgfence {app}")]).await;
    proxy.hang();
    drop(stop);
    let started = Instant::now();
    let opened = within("open_until stopped", opening).await.unwrap();
    let took = started.elapsed();
    println!("open_until returned {took:?} after the stop (connect_timeout {connect_timeout:?})");
    assert!(opened.unwrap().is_none());
    assert!(
        took < drop_timeout + Duration::from_secs(10),
        "the release was given up late: {took:?}"
    );
    lock.rollback().await.unwrap();
}
