//! Races between the store's own statements, run in a chosen order by the proxy's statement
//! gates (`pgfence_testing::Gate`): a renewal or a release in transit while the store changes
//! its owner id, and the store's own writes starving that change.
//!
//! The store changes its owner id in the lease row to fence off a write whose connection broke
//! (`sql::CHANGE_OWNER`). Any statement that carries the old ids and is still on its way then
//! finds a row it does not recognise. Each test holds such a statement at the proxy, lets the
//! change commit, and then lets the statement go on. Timeouts here only guard against hangs.

use crate::common;

use std::time::Duration;

use common::{HANG_GUARD, admin, builder, lease_row, table, within};
use pgfence::{Error, LeaseState, LossReason, PgKvStore};
use pgfence_testing::{Gate, GateMatch, Hold, Proxy, TestServer};
use tokio::task::JoinHandle;

/// A store on a fresh table, through a proxy of its own, with `k` = `first`.
pub(crate) async fn proxied_store(
    prefix: &str,
    configure: impl FnOnce(pgfence::Builder) -> pgfence::Builder,
) -> (String, Proxy, PgKvStore) {
    let server = TestServer::shared().unwrap();
    let proxy = Proxy::start(server.tcp_addr().unwrap()).await.unwrap();
    let t = table(prefix);
    let builder = PgKvStore::builder_from_config(server.config_via(proxy.addr()))
        .table(&t)
        .pool_size(4)
        .lease_ttl(Duration::from_secs(30));
    let store = configure(builder).open().await.unwrap();
    store.write("r", "s", "k", b"first".to_vec()).await.unwrap();
    (t, proxy, store)
}

/// The store's fenced writes to `table` (`sql::WRITE`, and `BATCH_PUT` for coalesced ones).
pub(crate) fn writes_to(table: &str) -> GateMatch {
    GateMatch::sql_contains(format!("INSERT INTO \"{table}\""))
}

/// The store's single writes to `table` behind a transaction pooler: calls of the table's
/// fenced function (`sql::WRITE_CALL`).
fn write_calls_to(table: &str) -> GateMatch {
    GateMatch::sql_contains(format!("\"{table}_fenced_write\"("))
}

/// The store's renewal of the lease of `table` (`sql::RENEW`): the only statement that sets
/// `expires_at` to a new TTL from now with a single space before `=`.
fn renewal_of(table: &str) -> GateMatch {
    let lease = format!("\"{table}_lease\"");
    GateMatch::sql_where("the renewal", move |sql| {
        sql.contains(&lease) && sql.contains("SET expires_at = clock_timestamp() + $2")
    })
}

/// The store's release (`sql::RELEASE`): the only statement that notifies.
fn release_of(table: &str) -> GateMatch {
    let lease = format!("\"{table}_lease\"");
    GateMatch::sql_where("the release", move |sql| {
        sql.contains(&lease) && sql.contains("pg_notify")
    })
}

/// Writes `value` to `key` and holds its answer at the proxy once the write has committed.
/// Its caller knows nothing yet. Cutting the returned gate breaks the write's connection: its
/// outcome is unknown, and the store fences it off by changing its owner id.
pub(crate) async fn write_committed_unanswered(
    proxy: &Proxy,
    store: &PgKvStore,
    table: &str,
    key: &str,
    value: &[u8],
) -> (Gate, JoinHandle<pgfence::Result<()>>) {
    let gate = proxy.gate(writes_to(table), Hold::Answer);
    let write = tokio::spawn(store.write("r", "s", key, value.to_vec()));
    within("the write held", gate.held()).await;
    let sql = format!("SELECT 1 FROM \"{table}\" WHERE key = $1 AND value = $2");
    common::wait_for_row("the write committed", &sql, &[&key, &value]).await;
    (gate, write)
}

/// Waits until the lease row no longer holds `owner`: the store's change of its id committed.
pub(crate) async fn wait_for_owner_change(table: &str, owner: uuid::Uuid) {
    let sql = format!("SELECT 1 FROM \"{table}_lease\" WHERE owner_id <> $1");
    common::wait_for_row("the owner id change committed", &sql, &[&owner]).await
}

/// Issue 27, item 2 (renewal). A renewal carries the store's owner ids as they were when it
/// was sent. Here it is held on its way while the store changes its id to fence off a broken write.
/// Then it reaches the server, whose row holds an id it did not carry. That is the store's own
/// change, not a takeover: the lease stays held and later writes succeed.
///
/// Its renewal interval is long enough for the race to run within one renewal attempt (an
/// attempt gives up after one interval, and a later one carries the new id).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewal_racing_the_stores_own_id_change_keeps_the_lease() {
    let (t, proxy, store) =
        proxied_store("renewrace", |b| b.renew_interval(Duration::from_secs(4))).await;
    let unanswered = write_committed_unanswered(&proxy, &store, &t, "k", b"v1");
    renewal_race(&t, &proxy, &store, unanswered).await;
}

/// The renewal races: hold the store's next renewal, let `unanswered` commit a write whose
/// answer its gate holds, cut that write, let the change of id commit, then let the renewal go
/// on. The lease must stay held, renewed for a whole TTL, and later writes succeed.
async fn renewal_race(
    t: &str,
    proxy: &Proxy,
    store: &PgKvStore,
    unanswered: impl Future<Output = (Gate, JoinHandle<pgfence::Result<()>>)>,
) {
    let renewal = proxy.gate(renewal_of(t), Hold::Statement);
    let owner = store.owner_id();
    let (write_gate, write) = unanswered.await;
    within("the first renewal held", renewal.held()).await; // Sent with `owner` only.
    assert!(write_gate.cut());
    wait_for_owner_change(t, owner).await;
    renewal.release();

    within("the renewal answered", async {
        let held = || matches!(*store.lease_state().borrow(), LeaseState::Held { .. });
        while store.stats().renewals.ok == 0 && held() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    let state = store.lease_state().borrow().clone();
    assert_eq!(state, LeaseState::Held { epoch: 1 }, "the store's own id change is no takeover");
    within("the broken write", write).await.unwrap().expect("retried after the fence");
    within("a later write", store.write("r", "s", "k2", b"v2".to_vec()))
        .await
        .expect("later writes succeed");
    let (row_owner, _, expires_in) = lease_row(&admin().await, t).await;
    assert_eq!(row_owner, store.owner_id());
    assert!(expires_in > 20_000, "renewed for a whole TTL: {expires_in} ms left");
    store.close().await.unwrap();
}

/// A store on a fresh table behind a transaction pooler (`PoolMode::Transaction`), through a
/// proxy of its own in front of PgBouncer, with `k` = `first`. A renewal there runs in a
/// pipelined transaction of its own, and a single write is a call of the table's fenced
/// function. The pooler is returned with the store: dropping it stops it.
async fn pooled_store(
    prefix: &str,
    configure: impl FnOnce(pgfence::Builder) -> pgfence::Builder,
) -> (String, pgfence_testing::PgBouncer, Proxy, PgKvStore) {
    let server = TestServer::shared().unwrap();
    let bouncer = pgfence_testing::PgBouncer::start_sized(
        server.tcp_addr().unwrap(),
        pgfence_testing::PoolMode::Transaction,
        4,
    )
    .unwrap();
    let proxy = Proxy::start(bouncer.addr()).await.unwrap();
    let t = table(prefix);
    let builder = PgKvStore::builder_from_config(server.config_via(proxy.addr()))
        .table(&t)
        .pool_mode(pgfence::PoolMode::Transaction)
        .pool_size(2)
        .lease_ttl(Duration::from_secs(30));
    let store = configure(builder).open().await.unwrap();
    store.write("r", "s", "k", b"first".to_vec()).await.unwrap();
    (t, bouncer, proxy, store)
}

/// [`write_committed_unanswered`] behind a transaction pooler: the write is a call of the
/// table's fenced function.
async fn call_committed_unanswered(
    proxy: &Proxy,
    store: &PgKvStore,
    table: &str,
) -> (Gate, JoinHandle<pgfence::Result<()>>) {
    let gate = proxy.gate(write_calls_to(table), Hold::Answer);
    let write = tokio::spawn(store.write("r", "s", "k", b"v1".to_vec()));
    within("the write held", gate.held()).await;
    let sql = format!("SELECT 1 FROM \"{table}\" WHERE key = 'k' AND value = 'v1'");
    common::wait_for_row("the write committed", &sql, &[]).await;
    (gate, write)
}

/// The same race behind a transaction pooler, where the issue first saw it. The renewal is
/// held on its way after its `BEGIN`; the store's change of owner id commits on another server
/// session; then the renewal reaches the row. The lease stays held.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewal_racing_the_stores_own_id_change_behind_a_transaction_pooler_keeps_the_lease() {
    let (t, _bouncer, proxy, store) =
        pooled_store("renewracetx", |b| b.renew_interval(Duration::from_secs(4))).await;
    renewal_race(&t, &proxy, &store, call_committed_unanswered(&proxy, &store, &t)).await;
}

/// Issue 27, item 2 (release). `close()` releases by owner id, with the ids it had when the
/// release was sent. Here the release is held on its way while the store changes its id to fence off
/// a broken write. Then it reaches the server. The row holds the store's new id, and must be
/// released all the same, so that a new store opens at once.
///
/// `close()` gives up waiting for the unanswered write after `drop_timeout` and releases. The
/// same bounds the release, so the race runs within it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_racing_the_stores_own_id_change_releases_the_lease() {
    let (t, proxy, store) = proxied_store("releaserace", release_race_timers).await;
    let (write_gate, write) = write_committed_unanswered(&proxy, &store, &t, "k", b"v1").await;
    release_race(&t, &proxy, store, write_gate, write).await;
}

/// The same race behind a transaction pooler: there the release runs in a pipelined
/// transaction of its own, pinned to read committed, on whichever server session the pooler
/// gives it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_racing_the_stores_own_id_change_behind_a_transaction_pooler_releases_the_lease() {
    let (t, _bouncer, proxy, store) = pooled_store("releaseracetx", release_race_timers).await;
    let (write_gate, write) = call_committed_unanswered(&proxy, &store, &t).await;
    release_race(&t, &proxy, store, write_gate, write).await;
}

/// The timers of the release races: no renewal during the race, and `close()` gives up
/// waiting for the unanswered write after 3 s.
fn release_race_timers(builder: pgfence::Builder) -> pgfence::Builder {
    builder.renew_interval(Duration::from_secs(10)).drop_timeout(Duration::from_secs(3))
}

/// The release races above, once the write to `k` is committed and its answer held at `proxy`
/// by `write_gate`: close, hold the release, cut the write, let the change of id commit, then
/// let the release go on. The row must be released, and a new store open at once.
async fn release_race(
    t: &str,
    proxy: &Proxy,
    store: PgKvStore,
    write_gate: Gate,
    write: JoinHandle<pgfence::Result<()>>,
) {
    let owner = store.owner_id();
    let release = proxy.gate(release_of(t), Hold::Statement);
    let closing = tokio::spawn({
        let store = store.clone();
        async move { store.close().await }
    });
    within("the release held", release.held()).await; // Sent with `owner` only.
    assert!(write_gate.cut());
    wait_for_owner_change(t, owner).await;
    release.release();

    let closed = within("close", closing).await.unwrap();
    // `Timeout`: close() released while the write was still running, as it says.
    assert!(matches!(closed, Ok(()) | Err(Error::Timeout { .. })), "close: {closed:?}");
    assert!(matches!(*store.lease_state().borrow(), LeaseState::Released { .. }));
    let (row_owner, _, expires_in) = lease_row(&admin().await, t).await;
    assert!(
        expires_in <= 0,
        "close() released the row, held by the store's new id {row_owner}: it expires in \
         {expires_in} ms"
    );
    let next = within("a new store opens", builder(t).open()).await.expect("opens at once");
    assert_eq!(next.fencing_token(), 2);
    let write = within("the broken write", write).await.unwrap();
    assert!(
        matches!(
            write,
            Ok(()) | Err(Error::LeaseLost { reason: LossReason::WriteOutcomeUnknown, .. })
        ),
        "committed (its retry before the release) or unknown, never `Closed`: {write:?}"
    );
    next.close().await.unwrap();
}

/// Makes every insert into `table` of a value starting with `slow` sleep inside its statement,
/// after the statement took the lease row FOR KEY SHARE (a BEFORE INSERT trigger runs once
/// the insert has a row to insert, read from the locked lease row). Key `k` sleeps 2 s, the
/// others 0.9 s. Each insert records in `<table>_seen` its key and the owner id of the lease
/// row it locked: the id it was sent with.
async fn slow_inserts(table: &str) {
    admin()
        .await
        .batch_execute(&format!(
            "CREATE TABLE \"{table}_seen\" (key TEXT, owner_id UUID);
             CREATE FUNCTION \"{table}_slow\"() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN
                 INSERT INTO \"{table}_seen\" SELECT NEW.key, owner_id FROM \"{table}_lease\";
                 IF substring(NEW.value FROM 1 FOR 4) = 'slow'::bytea THEN
                     PERFORM pg_sleep(CASE WHEN NEW.key = 'k' THEN 2 ELSE 0.9 END);
                 END IF;
                 RETURN NEW;
             END $$;
             CREATE TRIGGER slow BEFORE INSERT ON \"{table}\"
                 FOR EACH ROW EXECUTE FUNCTION \"{table}_slow\"();"
        ))
        .await
        .unwrap();
}

/// Waits until `n` statements on `table` sleep in the trigger of [`slow_inserts`], one of them
/// on the session at `port`.
async fn wait_for_sleepers(table: &str, n: i64, port: u16) {
    let sql = "SELECT 1 FROM pg_stat_activity WHERE wait_event = 'PgSleep' AND query LIKE $1 \
               HAVING count(*) >= $2 AND bool_or(client_port = $3)";
    let pattern = format!("%INSERT INTO \"{table}\"%");
    common::wait_for_row("slow statements running", sql, &[&pattern, &n, &i32::from(port)]).await
}

/// Issue 27, item 1. The store's change of owner id needs the lease row exclusively. Its own
/// writes take the row FOR KEY SHARE, and PostgreSQL grants them that while the change waits.
/// Writes that overlap without a gap would starve the change for good.
///
/// Here a write starts every 0.3 s, and each holds the row for 0.9 s (three overlap, so a late
/// start on a busy machine leaves no gap). The write of `k` breaks while it still runs on the
/// server. The store must fence it off all the same: no fail-closed, the broken write's retry
/// succeeds, and the later call of `k` stands. `retry_for` (the TTL, 6 s) bounds how long the
/// store may try.
///
/// The writes start once the change waits for the row. None of them takes the row with the
/// old id: the change waits only for the two statements already in flight (`k`, 2 s, and one
/// other), and every write started meanwhile goes out after it, with the new id.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn owner_change_is_not_starved_by_the_stores_own_writes() {
    let (t, proxy, store) =
        proxied_store("starved", |b| b.pool_size(8).lease_ttl(Duration::from_secs(6))).await;
    let owner = store.owner_id();
    slow_inserts(&t).await;

    let gate = proxy.gate(writes_to(&t), Hold::Answer);
    let broken = tokio::spawn(store.write("r", "s", "k", b"slow k".to_vec()));
    let port = within("the write of k held", gate.held()).await.client_port;
    let spawn_write =
        |i: usize| tokio::spawn(store.write("bg", "s", &format!("b{i}"), b"slow".into()));
    let mut others = vec![spawn_write(0)];
    wait_for_sleepers(&t, 2, port).await; // k, and another write beside it.
    assert!(gate.cut()); // k sleeps on in its server session.
    let later = tokio::spawn(store.write("r", "s", "k", b"later".to_vec()));
    let sql = "SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE $1";
    let change = format!("%UPDATE \"{t}_lease\"%SET owner_id = $2%");
    common::wait_for_row("the change of owner id waits for the row", sql, &[&change]).await;

    let mut every = tokio::time::interval(Duration::from_millis(300));
    let mut broken = std::pin::pin!(broken);
    let outcome = tokio::time::timeout(HANG_GUARD, async {
        loop {
            tokio::select! {
                outcome = &mut broken => break outcome.unwrap(),
                _ = every.tick() => others.push(spawn_write(others.len())),
            }
        }
    })
    .await
    .expect("the broken write hung");
    let n = others.len();
    assert!(outcome.is_ok(), "the broken write's retry succeeds ({n} writes started): {outcome:?}");
    for (i, other) in others.into_iter().enumerate() {
        within("another write", other).await.unwrap().unwrap_or_else(|e| panic!("b{i}: {e:?}"));
    }
    within("the later call", later).await.unwrap().expect("the later call of k succeeds");
    assert_eq!(store.read("r", "s", "k").await.unwrap(), b"later", "the later call stands");
    assert_eq!(*store.lease_state().borrow(), LeaseState::Held { epoch: 1 });
    assert_ne!(store.owner_id(), owner, "the broken write was fenced off by a new id");
    let sql = format!("SELECT key FROM \"{t}_seen\" WHERE owner_id = $1 ORDER BY key");
    let rows = admin().await.query(&sql, &[&owner]).await.unwrap();
    let old: Vec<String> = rows.iter().map(|r| r.get(0)).collect();
    assert_eq!(old, ["b0", "k"], "only the statements in flight took the row with the old id");
    store.close().await.unwrap();
}

/// A `close()` that gave up waiting for a running write releases the lease while the write is
/// still on its way. The write then reaches a row the store itself released, and is refused.
/// That is the store's own release, not a successor's: the caller learns `Closed` (nothing was
/// written), and the store is `Released`, never `Lost { Fenced }` (which would abort the
/// process under `LeaseLossPolicy::Abort`). The model in tests/model.rs found this
/// (`a_close_that_gives_up_waiting_reports_its_own_release_as_fenced`). Here the write is held
/// before the server, and the release's answer is held until the write was refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_refused_by_its_own_stores_release_is_closed_not_fenced() {
    let (t, proxy, store) =
        proxied_store("ownrelease", |b| b.drop_timeout(Duration::from_secs(1))).await;
    let write_gate = proxy.gate(writes_to(&t), Hold::Statement);
    let write = tokio::spawn(store.write("r", "s", "k", b"late".to_vec()));
    within("the write held", write_gate.held()).await;
    let release = proxy.gate(release_of(&t), Hold::Answer);
    let closing = tokio::spawn({
        let store = store.clone();
        async move { store.close().await }
    });
    within("the release sent", release.held()).await;
    let sql = format!("SELECT 1 FROM \"{t}_lease\" WHERE expires_at <= clock_timestamp()");
    common::wait_for_row("the release committed", &sql, &[]).await;
    write_gate.release(); // The write reaches the released row.
    let write = within("the write", write).await.unwrap();
    assert!(matches!(write, Err(Error::Closed)), "refused by the store's own release: {write:?}");
    release.release();
    let closed = within("close", closing).await.unwrap();
    assert!(matches!(closed, Err(Error::Timeout { .. })), "close gave up waiting: {closed:?}");
    let state = store.lease_state().borrow().clone();
    assert!(matches!(state, LeaseState::Released { .. }), "{state:?}");
    let sql = format!("SELECT value FROM \"{t}\" WHERE key = 'k'");
    let value: Vec<u8> = admin().await.query_one(&sql, &[]).await.unwrap().get(0);
    assert_eq!(value, b"first", "nothing of the refused write landed");
}
