//! Standby acquisition (LISTEN/NOTIFY handoff, crash takeover, timeout, cancellation) and the
//! read-only inspector's break-glass release.

use crate::common;

use std::time::{Duration, Instant};

use common::{admin, builder, lease_table, table, within};
use pgfence::{Error, LeaseState, LossReason, PgKvStore, StandbyState};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// Long enough that an acquisition soon after a release proves the release, not an expiry.
const TTL: Duration = Duration::from_secs(30);

fn standby_builder(t: &str, app: &str) -> pgfence::Builder {
    builder(t).lease_ttl(TTL).renew_interval(Duration::from_secs(5)).application_name(app)
}

/// Starts a standby named `app` on `t` and returns once it reports `Waiting`.
async fn waiting_standby(
    t: &str,
    app: &str,
) -> (tokio::task::JoinHandle<pgfence::Result<PgKvStore>>, watch::Receiver<StandbyState>) {
    let standby = standby_builder(t, app).standby();
    let mut progress = standby.progress();
    let waiting = tokio::spawn(standby.open());
    within("standby waiting", progress.wait_for(|s| matches!(s, StandbyState::Waiting { .. })))
        .await
        .unwrap();
    (waiting, progress)
}

/// Runs `release` and waits for the standby's takeover; the takeover, timed from the start of
/// the release, must come well before the TTL (a standby that missed the release would wait for
/// the expiry, one whole TTL).
async fn takeover_after(
    release: impl std::future::Future<Output = ()>,
    waiting: JoinHandle<pgfence::Result<PgKvStore>>,
) -> PgKvStore {
    let released = Instant::now();
    release.await;
    let store = within("standby acquires", waiting).await.unwrap().unwrap();
    let took = released.elapsed();
    println!("takeover {took:?} after the release (TTL {TTL:?})");
    assert!(took < TTL / 2, "woken by the release, not by the expiry: {took:?}");
    store
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_release_wakes_the_standby_at_once() {
    let t = table("handoff");
    let active = standby_builder(&t, "active").open().await.unwrap();
    let (waiting, progress) = waiting_standby(&t, "standby").await;
    match &*progress.borrow() {
        StandbyState::Waiting { holder, epoch, expires_in } => {
            assert!(holder.contains("active"), "{holder}");
            assert_eq!(*epoch, 1);
            assert!(*expires_in > Duration::from_secs(10));
        }
        other => panic!("{other:?}"),
    }
    // Give the standby a moment in its wait, then release gracefully.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!waiting.is_finished(), "the standby waits while the lease is held");
    let store = takeover_after(async { active.close().await.unwrap() }, waiting).await;
    assert_eq!(store.fencing_token(), 2);
    assert_eq!(*progress.borrow(), StandbyState::Acquired { epoch: 2 });
    store.close().await.unwrap();
}

/// `t` and `public.t` name one table and one lease row, so a release by either spelling wakes
/// a standby that uses the other at once, not after the TTL: the holder's `close()` and an
/// operator's force release alike.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_wakes_a_standby_that_spells_the_table_otherwise() {
    let t = table("spelling");
    let qualified = format!("public.{t}");
    let active = standby_builder(&t, "active").open().await.unwrap();
    let (waiting, _) = waiting_standby(&qualified, "standby").await;
    let store = takeover_after(async { active.close().await.unwrap() }, waiting).await;
    assert_eq!(store.fencing_token(), 2);

    let (waiting, _) = waiting_standby(&t, "standby2").await;
    let inspector = builder(&qualified).inspect().await.unwrap();
    let force_release = async {
        let released = inspector.force_release().await.unwrap().unwrap();
        assert_eq!(released.owner_id, store.owner_id());
    };
    let next = takeover_after(force_release, waiting).await;
    assert_eq!(next.fencing_token(), 3);
    next.close().await.unwrap();
    drop(store);
}

/// An unqualified name resolves through the session's `search_path`, which need not start with
/// `public`: with `<schema>` first, `t` and `<schema>.t` name one table, and a release by one
/// wakes a standby using the other at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unqualified_names_resolve_through_the_search_path() {
    let schema = table("path");
    let t = table("onpath");
    admin().await.batch_execute(&format!("CREATE SCHEMA \"{schema}\"")).await.unwrap();
    let mut config = common::server().config();
    let options = config.get_options().unwrap_or_default().to_owned();
    config.options(format!("{options} -c search_path={schema}"));
    let active = PgKvStore::builder_from_config(config)
        .table(&t)
        .pool_size(2)
        .lease_ttl(TTL)
        .renew_interval(Duration::from_secs(5))
        .application_name("active")
        .open()
        .await
        .unwrap();
    let found: Option<String> = admin()
        .await
        .query_one("SELECT to_regclass($1)::text", &[&format!("\"{schema}\".\"{t}_lease\"")])
        .await
        .unwrap()
        .get(0);
    assert!(found.is_some(), "the unqualified name was created in {schema}");
    let (waiting, _) = waiting_standby(&format!("{schema}.{t}"), "standby").await;
    let store = takeover_after(async { active.close().await.unwrap() }, waiting).await;
    assert_eq!(store.fencing_token(), 2);
    store.close().await.unwrap();
}

/// A crashed holder never releases: the standby takes over right after the expiry, never
/// before it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn crashed_holder_is_taken_over_after_expiry() {
    let t = table("crash");
    standby_builder(&t, "first").open().await.unwrap().close().await.unwrap();
    // A "crashed" owner: a lease row that nobody renews, expiring in 2 s.
    let db = admin().await;
    db.execute(
        &format!(
            "UPDATE {} SET owner_id = gen_random_uuid(), epoch = epoch + 1,
                    expires_at = clock_timestamp() + interval '2 seconds' WHERE id = 1",
            lease_table(&t)
        ),
        &[],
    )
    .await
    .unwrap();
    let started = Instant::now();
    let store =
        within("takeover", standby_builder(&t, "standby").open_when_available()).await.unwrap();
    let took = started.elapsed();
    println!("crash takeover after {took:?} (lease had 2 s left)");
    assert!(took >= Duration::from_millis(1500), "never before the expiry: {took:?}");
    assert_eq!(store.fencing_token(), 3);
    store.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standby_timeout_is_a_typed_error() {
    let t = table("sbtimeout");
    let active = standby_builder(&t, "active").open().await.unwrap();
    let e = standby_builder(&t, "standby")
        .standby()
        .timeout(Duration::from_millis(800))
        .open()
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Timeout { operation: "wait for lease", .. }), "{e:?}");
    assert_eq!(*active.lease_state().borrow(), LeaseState::Held { epoch: 1 });
    active.close().await.unwrap();
}

/// Drops the standby's `open()` future (aborting the task that runs it) and waits until every
/// session of the standby named `app` is gone.
async fn drop_and_wait_until_gone(standby: JoinHandle<pgfence::Result<PgKvStore>>, app: &str) {
    standby.abort();
    assert!(standby.await.unwrap_err().is_cancelled());
    common::wait_until_no_sessions(app).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropping_the_standby_future_leaves_nothing_running() {
    let t = table("sbcancel");
    let active = standby_builder(&t, "active").open().await.unwrap();
    let app = format!("sb-{t}");
    let (waiting, _progress) = waiting_standby(&t, &app).await;
    assert!(common::sessions_of(&app).await >= 1, "the standby listens on a connection of its own");
    drop_and_wait_until_gone(waiting, &app).await;
    active.close().await.unwrap();
}

/// A standby whose future is dropped (as its `timeout` does) in the middle of an acquisition,
/// here waiting at the fence for the expired holder's in-flight write, leaves nothing behind:
/// the attempt's statement is cancelled (its session goes), and it never takes the lease later,
/// when the write has finished. The next store to open gets epoch 2.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standby_dropped_mid_acquisition_never_takes_the_lease_later() {
    dropped_at_the_fence_never_takes_the_lease_later("sbfence", |b| {
        tokio::spawn(b.standby().open())
    })
    .await;
}

/// The same for a plain `open()`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_dropped_at_the_fence_never_takes_the_lease_later() {
    dropped_at_the_fence_never_takes_the_lease_later("openfence", |b| tokio::spawn(b.open())).await;
}

/// Starts an acquisition with `open` on a table whose expired holder has a write in flight,
/// drops it while it waits at the fence, and checks that it never takes the lease later.
async fn dropped_at_the_fence_never_takes_the_lease_later(
    prefix: &str,
    open: impl FnOnce(pgfence::Builder) -> JoinHandle<pgfence::Result<PgKvStore>>,
) {
    let t = table(prefix);
    let active = standby_builder(&t, "active").open().await.unwrap();
    let mut blocker = admin().await;
    let (tx, write) = common::write_in_flight_on_an_expired_lease(&active, &t, &mut blocker).await;

    let app = format!("drop-{t}");
    let attempt = open(standby_builder(&t, &app));
    common::wait_for_query_lock_wait(&format!("%INSERT INTO {}%", lease_table(&t))).await;
    drop_and_wait_until_gone(attempt, &app).await;

    tx.commit().await.unwrap();
    within("the in-flight write", write).await.unwrap().expect("the fenced write commits");
    // An abandoned attempt still running would hold the setup lock and take the lease (epoch 2)
    // as soon as the write is done; this store would then wait for it and find epoch 2 taken.
    let next = standby_builder(&t, "next").open().await.expect("the lease is free");
    assert_eq!(next.fencing_token(), 2);
    next.close().await.unwrap();
}

/// docs/design.md, `open()`:
/// "Dropping the `open()` future (or a standby's `timeout`) cancels a setup
/// still waiting (for the setup lock, or at the fence for the old holder's writes) and commits
/// nothing, so an abandoned attempt never takes the lease later." Here the setup waits for the
/// setup lock, which an administrator's transaction holds as a concurrent `open()` would: the
/// attempt dropped there leaves no session behind, and once the lock is free, the next store
/// to open finds the lease free and gets epoch 2 (an abandoned attempt still waiting would
/// have been granted the lock first and taken epoch 2 itself).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_dropped_waiting_for_the_setup_lock_never_takes_the_lease_later() {
    dropped_waiting_for_the_setup_lock_never_takes_the_lease_later("openlock", |b| {
        tokio::spawn(b.open())
    })
    .await;
}

/// The same for a standby, whose future is dropped while its acquisition waits for the setup
/// lock.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standby_dropped_waiting_for_the_setup_lock_never_takes_the_lease_later() {
    dropped_waiting_for_the_setup_lock_never_takes_the_lease_later("sblock", |b| {
        tokio::spawn(b.standby().open())
    })
    .await;
}

/// Starts an acquisition with `open` on a table whose lease is free (epoch 1) while another
/// transaction holds the table's setup lock, drops it while the server shows it waiting for
/// that lock, and checks that it never takes the lease later.
async fn dropped_waiting_for_the_setup_lock_never_takes_the_lease_later(
    prefix: &str,
    open: impl FnOnce(pgfence::Builder) -> JoinHandle<pgfence::Result<PgKvStore>>,
) {
    let t = table(prefix);
    standby_builder(&t, "first").open().await.unwrap().close().await.unwrap();
    let mut locker = admin().await;
    let tx = common::hold_setup_lock(&mut locker, &t).await;

    let app = format!("drop-{t}");
    let attempt = open(standby_builder(&t, &app));
    let waiting = "SELECT 1 FROM pg_stat_activity
                    WHERE wait_event_type = 'Lock' AND wait_event = 'advisory'
                      AND application_name = $1";
    let name = format!("pgfence {app}");
    common::wait_for_row("the setup waiting for the setup lock", waiting, &[&name]).await;
    drop_and_wait_until_gone(attempt, &app).await;

    tx.commit().await.unwrap();
    let next = standby_builder(&t, "next").open().await.expect("the lease is free");
    assert_eq!(next.fencing_token(), 2);
    next.close().await.unwrap();
}

/// An `open()` on the application's pool (`builder_from_pool`) abandoned while its setup waits
/// at the fence cancels the setup and closes that connection instead of handing it back: the
/// cancel request can land late, and must not hit the next statement of whoever takes the
/// connection next. One abandoned while it still waits for a connection of the pool never
/// takes one: the connection it waited for serves the next user as usual.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn abandoned_open_never_hands_its_connection_back_to_the_pool() {
    let server = common::server();
    let manager = pgfence::deadpool_postgres::Manager::new(server.config(), tokio_postgres::NoTls);
    let pool = pgfence::deadpool_postgres::Pool::builder(manager).max_size(1).build().unwrap();
    let pid = "SELECT pg_backend_pid()";
    let first: i32 = pool.get().await.unwrap().query_one(pid, &[]).await.unwrap().get(0);
    let t = table("abandoned");
    let mut blocker = admin().await;
    let tx = common::fence_closed(&mut blocker, &t).await;
    let opening = tokio::spawn(PgKvStore::builder_from_pool(pool.clone()).table(&t).open());
    let at_fence = "SELECT 1 FROM pg_stat_activity WHERE pid = $1 AND wait_event_type = 'Lock'";
    common::wait_for_row("the setup waiting at the fence", at_fence, &[&first]).await;
    opening.abort(); // Its caller gives up.
    assert!(opening.await.unwrap_err().is_cancelled());
    let next = within("a connection", pool.get()).await.unwrap();
    let second: i32 = next.query_one(pid, &[]).await.unwrap().get(0);
    assert_ne!(first, second, "the abandoned setup's connection was closed, not reused");
    next.query_one("SELECT pg_sleep(0.3)", &[]).await.expect("no late cancel hits it");
    tx.commit().await.unwrap();

    let held = next;
    let opening = tokio::spawn(PgKvStore::builder_from_pool(pool.clone()).table(&t).open());
    within("the open waits for the pool's only connection", async {
        while pool.status().waiting == 0 {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    opening.abort();
    assert!(opening.await.unwrap_err().is_cancelled());
    drop(held);
    let next = within("a connection", pool.get()).await.unwrap();
    let third: i32 = next.query_one(pid, &[]).await.unwrap().get(0);
    assert_eq!(second, third, "the open that waited for it never took it");
    next.query_one("SELECT pg_sleep(0.3)", &[]).await.expect("no late cancel hits it");
    let (_, epoch, _) = common::lease_row(&admin().await, &t).await;
    assert_eq!(epoch, 1, "neither open took the lease");
}

/// With its LISTEN connection killed, the standby polls (and reconnects) and still takes over
/// soon after a release.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standby_survives_losing_its_listen_connection() {
    let t = table("sbkill");
    let active = standby_builder(&t, "active").open().await.unwrap();
    let app = format!("sb-{t}");
    let (waiting, _progress) = waiting_standby(&t, &app).await;
    let killed: i64 = admin()
        .await
        .query_one(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name = $1",
            &[&format!("pgfence {app}")],
        )
        .await
        .unwrap()
        .get(0);
    assert!(killed >= 1);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let store = takeover_after(async { active.close().await.unwrap() }, waiting).await;
    store.close().await.unwrap();
}

/// A standby that cannot reach the server for a while (every connection cut, new ones refused)
/// keeps waiting through the connection errors, and takes over once the server is back and the
/// holder releases.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standby_keeps_waiting_through_connection_errors() {
    let t = table("sbdown");
    let active = standby_builder(&t, "active").open().await.unwrap();
    let server = common::server();
    let proxy = pgfence_testing::Proxy::start(server.tcp_addr().unwrap()).await.unwrap();
    let standby = PgKvStore::builder_from_config(server.config_via(proxy.addr()))
        .table(&t)
        .lease_ttl(TTL)
        .renew_interval(Duration::from_secs(5))
        .standby();
    let mut progress = standby.progress();
    let waiting = tokio::spawn(standby.open());
    within("standby waiting", progress.wait_for(|s| matches!(s, StandbyState::Waiting { .. })))
        .await
        .unwrap();

    proxy.set_refuse(true);
    proxy.cut_all();
    tokio::time::sleep(Duration::from_secs(3)).await; // Several polls, every one failing.
    assert!(!waiting.is_finished(), "the standby still waits: {:?}", *progress.borrow());
    proxy.set_refuse(false);
    active.close().await.unwrap();
    let store = within("standby acquires", waiting).await.unwrap().unwrap();
    assert_eq!(store.fencing_token(), 2);
    store.close().await.unwrap();
}

/// A standby whose connections are refused for a while with "too many connections" (SQLSTATE
/// 53300, here the role's connection limit) keeps waiting, and takes over once connections are
/// accepted again and the holder releases.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standby_keeps_waiting_through_too_many_connections() {
    let (config, superuser) = common::own_database("sbfull").await;
    let role = config.get_user().unwrap().to_owned();
    let t = table("sbfull");
    let builder = || {
        PgKvStore::builder_from_config(config.clone())
            .table(&t)
            .pool_size(1)
            .lease_ttl(TTL)
            .renew_interval(Duration::from_secs(5))
    };
    let active = builder().open().await.unwrap();
    let standby = builder().standby();
    let mut progress = standby.progress();
    let waiting = tokio::spawn(standby.open());
    within("standby waiting", progress.wait_for(|s| matches!(s, StandbyState::Waiting { .. })))
        .await
        .unwrap();

    // New connections of the role are refused; a notification wakes the standby to try.
    superuser.batch_execute(&format!("ALTER ROLE {role} CONNECTION LIMIT 0")).await.unwrap();
    superuser.batch_execute(&format!("NOTIFY pgfence_{t}")).await.unwrap();
    let refused = builder().open().await.unwrap_err();
    assert!(format!("{refused:?}").contains("53300") && refused.is_retryable(), "{refused:?}");
    tokio::time::sleep(Duration::from_secs(3)).await; // Several attempts, every one refused.
    assert!(!waiting.is_finished(), "the standby still waits: {:?}", *progress.borrow());
    superuser.batch_execute(&format!("ALTER ROLE {role} CONNECTION LIMIT -1")).await.unwrap();
    active.close().await.unwrap();
    let store = within("standby acquires", waiting).await.unwrap().unwrap();
    assert_eq!(store.fencing_token(), 2);
    store.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspector_reads_without_the_lease_and_force_releases() {
    let t = table("inspect");
    let missing = builder(&table("nosuch")).inspect().await.unwrap();
    assert_eq!(missing.lease_info().await.unwrap(), None);
    assert!(missing.list("a", "b").await.unwrap().is_empty());
    assert!(missing.read("a", "b", "c").await.unwrap_err().is_not_found());

    let active = standby_builder(&t, "active").open().await.unwrap();
    active.write("i", "s", "k", b"v".to_vec()).await.unwrap();
    let inspector = builder(&t).inspect().await.unwrap();
    let info = inspector.lease_info().await.unwrap().unwrap();
    assert!(info.active && info.epoch == 1 && info.owner_id == active.owner_id());
    assert_eq!(inspector.read("i", "s", "k").await.unwrap(), b"v");
    assert_eq!(inspector.list("i", "s").await.unwrap(), vec!["k".to_owned()]);
    assert_eq!(inspector.list_all_keys().await.unwrap().len(), 1);

    let held = inspector.force_release().await.unwrap().expect("someone held it");
    assert_eq!(held.owner_id, active.owner_id());
    assert_eq!(inspector.force_release().await.unwrap(), None, "now nobody holds it");
    // The holder is fenced from its next write on.
    let e = active.write("i", "s", "k", b"after".to_vec()).await.unwrap_err();
    assert!(matches!(e, Error::LeaseLost { reason: LossReason::Fenced, .. }), "{e:?}");
    assert_eq!(inspector.read("i", "s", "k").await.unwrap(), b"v");
    let next = builder(&t).open().await.unwrap();
    assert_eq!(next.fencing_token(), 2);
    next.close().await.unwrap();
}

/// `open_until` gives up when its `stop` completes, and returns only once the attempt is
/// cancelled on the server: here each attempt waits at the fence, on a runtime of its own that
/// is shut down the moment `open_until` returns, and still nothing is left waiting, and nobody
/// takes the lease later. The same for a standby stopped, or timed out, at the fence.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_until_stopped_leaves_nothing_even_when_its_runtime_ends_at_once() {
    #[derive(Debug, Clone, Copy)]
    enum How {
        Open,
        Standby,
        StandbyTimeout,
    }
    let t = table("until");
    let mut blocker = admin().await;
    let tx = common::fence_closed(&mut blocker, &t).await;
    for how in [How::Open, How::Standby, How::StandbyTimeout] {
        let app = format!("until-{how:?}-{t}");
        let builder = standby_builder(&t, &app);
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let attempt = std::thread::spawn(move || {
            let runtime = tokio::runtime::Runtime::new().unwrap();
            let stop = async {
                let _ = stopped.await;
            };
            let opened = runtime.block_on(async move {
                match how {
                    How::Open => builder.open_until(stop).await,
                    How::Standby => builder.standby().open_until(stop).await,
                    How::StandbyTimeout => {
                        builder.standby().timeout(Duration::from_secs(3)).open().await.map(Some)
                    }
                }
            });
            drop(runtime); // At once: nothing it still ran could send a cancel request now.
            opened
        });
        common::wait_for_app_lock_wait(&app).await;
        drop(stop);
        let opened = within("open_until", tokio::task::spawn_blocking(move || attempt.join()))
            .await
            .unwrap()
            .unwrap();
        match how {
            How::StandbyTimeout => {
                let e = opened.unwrap_err();
                assert!(matches!(e, Error::Timeout { .. }), "{e:?}");
            }
            _ => assert!(opened.unwrap().is_none(), "{how:?} stopped"),
        }
        common::wait_until_no_sessions(&app).await;
    }
    tx.commit().await.unwrap();
    let (_, epoch, ms_left) = common::lease_row(&admin().await, &t).await;
    assert_eq!(epoch, 1, "nobody took the lease");
    assert!(ms_left <= 0, "nobody holds it");
}

/// The lease changes hands between the force release's look at it and its release statement:
/// the release is by the owner it found, so it releases nothing and says so (`None`), and the
/// new holder keeps its lease. Forced deterministically: the takeover is an uncommitted
/// update holding the lease row, the release statement waits for it, and then finds its owner
/// gone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn force_release_racing_a_takeover_releases_nothing() {
    let t = table("forcerace");
    let active = standby_builder(&t, "active").open().await.unwrap();
    let inspector = builder(&t).inspect().await.unwrap();
    let mut db = admin().await;
    let takeover = db.transaction().await.unwrap();
    let thief: uuid::Uuid = takeover
        .query_one(
            &format!(
                "UPDATE {} SET owner_id = gen_random_uuid(), epoch = epoch + 1,
                        expires_at = clock_timestamp() + interval '1 hour'
                  WHERE id = 1 RETURNING owner_id",
                lease_table(&t)
            ),
            &[],
        )
        .await
        .unwrap()
        .get(0);
    let release = tokio::spawn(async move { inspector.force_release().await });
    common::wait_for_query_lock_wait(&format!("%released AS%{}%", lease_table(&t))).await;
    takeover.commit().await.unwrap();
    let released = within("force release", release).await.unwrap().unwrap();
    assert_eq!(released, None, "nothing was released");
    let now = builder(&t).inspect().await.unwrap().lease_info().await.unwrap().unwrap();
    assert!(now.active && now.owner_id == thief && now.epoch == 2, "{now:?}");
    assert_ne!(thief, active.owner_id());
    drop(active);
}

/// A standby's LISTEN connection that went silent on the way, while its TCP peer still answers
/// (here a proxy holds back all its traffic, and the proxy's kernel answers the keepalives, as a
/// hung middlebox would), misses the release's notification. The standby still makes its attempt
/// when the lease it saw would have expired, and takes it then. A connection silently dropped
/// on the way, which keepalives find sooner, is tested in tests/partition.rs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standby_whose_listen_connection_went_silent_takes_over_at_the_expiry_it_saw() {
    const HOLDER_TTL: Duration = Duration::from_secs(6);
    let server = common::server();
    let proxy = pgfence_testing::Proxy::start(server.tcp_addr().unwrap()).await.unwrap();
    let t = table("sbsilent");
    let active = builder(&t)
        .lease_ttl(HOLDER_TTL)
        .renew_interval(Duration::from_secs(2))
        .open()
        .await
        .unwrap();
    let app = format!("sb-{t}");
    let standby = PgKvStore::builder_from_config(server.config_via(proxy.addr()))
        .table(&t)
        .lease_ttl(TTL)
        .connect_timeout(Duration::from_secs(2))
        .application_name(&app)
        .standby();
    let mut progress = standby.progress();
    let waiting = tokio::spawn(standby.open());
    within("standby waiting", progress.wait_for(|s| matches!(s, StandbyState::Waiting { .. })))
        .await
        .unwrap();
    let listening = "SELECT client_port FROM pg_stat_activity
                      WHERE application_name = $1 AND query LIKE 'LISTEN%'";
    let port: i32 =
        admin().await.query_one(listening, &[&format!("pgfence {app}")]).await.unwrap().get(0);
    proxy.stall(u16::try_from(port).unwrap());

    let released = Instant::now();
    active.close().await.unwrap();
    let store = within("standby acquires", waiting).await.unwrap().unwrap();
    let took = released.elapsed();
    println!("takeover {took:?} after the release (holder's TTL {HOLDER_TTL:?})");
    assert!(took < HOLDER_TTL + Duration::from_secs(3), "by the expiry it saw: {took:?}");
    assert_eq!(store.fencing_token(), 2);
    store.close().await.unwrap();
}

/// A standby whose setup transaction the server ends for idling in it longer than the TTL
/// (`idle_in_transaction_session_timeout`, which the setup sets: here the link turns slower
/// than the TTL mid-setup, as in a stall of the network) keeps waiting: the server ended the
/// session, a broken connection like any other, and the standby takes the lease once the link
/// is fast again. Set up so that the statement the client sent meanwhile is the first after a
/// simple query (a migration), so that the server's FATAL error (SQLSTATE 25P03) is the answer
/// it gets, rather than a "connection closed".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn standby_keeps_waiting_when_the_server_ends_an_idle_setup() {
    let server = common::server();
    let proxy = pgfence_testing::Proxy::start(server.tcp_addr().unwrap()).await.unwrap();
    let t = table("sbidle");
    builder(&t).open().await.unwrap().close().await.unwrap();
    // The next store to take the lease runs migration 4 again, which waits for this lock.
    let admin = admin().await;
    admin
        .batch_execute(&format!("DELETE FROM \"{t}_schema_version\" WHERE version >= 4"))
        .await
        .unwrap();
    let mut locker = common::admin().await;
    let lock = locker.transaction().await.unwrap();
    lock.batch_execute(&format!("LOCK TABLE \"{t}\" IN ACCESS SHARE MODE")).await.unwrap();

    let app = format!("sb-{t}");
    let standby = PgKvStore::builder_from_config(server.config_via(proxy.addr()))
        .table(&t)
        .pool_size(1)
        .lease_ttl(Duration::from_secs(1))
        .connect_timeout(Duration::from_secs(20))
        .application_name(&app)
        .standby();
    let waiting = tokio::spawn(standby.open());
    let migrating = "SELECT count(*) FROM pg_stat_activity
                      WHERE application_name = $1 AND wait_event_type = 'Lock'";
    within("the standby's migration waits for the lock", async {
        while admin
            .query_one(migrating, &[&format!("pgfence {app}")])
            .await
            .unwrap()
            .get::<_, i64>(0)
            == 0
        {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    // A round trip of 1.4 s from now on: the setup's session idles that long after the
    // migration, longer than its TTL.
    proxy.set_delay(Duration::from_millis(700));
    lock.rollback().await.unwrap();
    tokio::time::sleep(Duration::from_secs(5)).await;
    if waiting.is_finished() {
        panic!("the standby gave up: {:?}", waiting.await.unwrap().map(|s| s.fencing_token()));
    }
    proxy.set_delay(Duration::ZERO);
    let store = within("standby acquires", waiting).await.unwrap().unwrap();
    store.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inspector_entries_stream_every_value_in_order_from_one_snapshot() {
    let mut none = builder(&table("nosuch")).inspect().await.unwrap().entries().await.unwrap();
    assert!(none.next().await.is_none(), "a missing table has no entries");

    let t = table("entries");
    let store = builder(&t).open().await.unwrap();
    for (p, s, k) in [("b", "", "k"), ("a", "s", "y"), ("a", "s", "x"), ("a", "", "z")] {
        store.write(p, s, k, format!("{p}/{s}/{k}").into_bytes()).await.unwrap();
    }
    let inspector = builder(&t).inspect().await.unwrap();
    let mut entries = inspector.entries().await.unwrap();
    let first = entries.next().await.unwrap().unwrap();
    // Changes after the statement started are not seen: the entries are one snapshot.
    store.remove("b", "", "k", false).await.unwrap();
    store.write("a", "s", "w", b"new".to_vec()).await.unwrap();
    let mut seen = vec![first];
    while let Some(entry) = entries.next().await {
        seen.push(entry.unwrap());
    }
    let expected: Vec<_> = [("a", "", "z"), ("a", "s", "x"), ("a", "s", "y"), ("b", "", "k")]
        .iter()
        .map(|(p, s, k)| {
            (p.to_string(), s.to_string(), k.to_string(), format!("{p}/{s}/{k}").into_bytes())
        })
        .collect();
    assert_eq!(seen, expected);
    drop(entries);
    store.close().await.unwrap();
}
