//! The subtle ways ordering and fencing can break: a statement orphaned by a broken
//! connection, a dropped write future, a write whose runtime shuts down mid-statement, a stale
//! expiry check after a lock wait, a stalled contender, a hung close, a close racing the local
//! deadline, and a loss found by renewal.

use crate::common;

use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use common::{HANG_GUARD, admin, builder, lease_row, lease_table, table, within};
use pgfence::{Error, LeaseLossPolicy, LeaseState, LossReason, PgKvStore, PoolMode};
use pgfence_testing::PoolMode::Transaction;
use pgfence_testing::{Hold, PgBouncer, Proxy, TestServer};

/// Makes the first write of the value `slow` to `table` sleep `seconds` inside its statement,
/// before it locks the row (a BEFORE INSERT trigger runs before the conflict check). Later
/// executions, a retry included, do not sleep (a sequence is not rolled back), so an orphaned
/// first execution would wake and commit after everything that came later.
async fn slow_trigger(table: &str, seconds: u32) {
    admin()
        .await
        .batch_execute(&format!(
            "CREATE SEQUENCE \"{table}_slow_seq\";
             CREATE FUNCTION \"{table}_slow\"() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN
                 IF NEW.value = 'slow'::bytea AND nextval('\"{table}_slow_seq\"') = 1 THEN
                     PERFORM pg_sleep({seconds});
                 END IF;
                 RETURN NEW;
             END $$;
             CREATE TRIGGER slow BEFORE INSERT ON \"{table}\"
                 FOR EACH ROW EXECUTE FUNCTION \"{table}_slow\"();"
        ))
        .await
        .unwrap();
}

/// Waits until a write to `table` sleeps in `pg_sleep` (the slow trigger).
async fn wait_for_sleeper(table: &str) {
    // The write and the batch alike; behind a transaction pooler a write is a call of the
    // table's function, whose quoted name starts like the table's.
    let pattern = format!("%\"{table}%");
    let sql = "SELECT 1 FROM pg_stat_activity WHERE wait_event = 'PgSleep' AND query LIKE $1";
    common::wait_for_row("slow statement running", sql, &[&pattern]).await
}

/// Waits until no server process runs a statement on `table` (or, by name, on its lease table
/// or functions) but the waiting one: an orphaned statement has ended by then, committed or
/// not. Deterministic where a sleep only makes its end likely.
async fn wait_until_no_statement_on(table: &str) {
    let pattern = format!("%\"{table}%");
    let sql = "SELECT 1 WHERE NOT EXISTS (SELECT 1 FROM pg_stat_activity \
               WHERE state = 'active' AND query LIKE $1 AND pid <> pg_backend_pid())";
    common::wait_for_row("no statement on the table", sql, &[&pattern]).await
}

/// Makes the store's pool open `n` connections (writes held up together by a lock on the lease
/// row), so that the next operations are spread over different connections: two statements on
/// one connection would run in order anyway and hide an ordering bug. Each of the `n` writes
/// runs its own statement (as many as the store's `write_concurrency`); the lock is let go
/// once all `n` wait for it.
async fn warm_pool(store: &PgKvStore, table: &str, n: usize) {
    let mut blocker = admin().await;
    let tx = common::lock_lease_row(&mut blocker, table, "FOR UPDATE").await;
    let writes: Vec<_> =
        (0..n).map(|i| tokio::spawn(store.write("warm", "s", &format!("w{i}"), vec![]))).collect();
    let sql = "SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE $1 \
               HAVING count(*) >= $2";
    let pattern = format!("%INSERT INTO \"{table}\"%");
    common::wait_for_row("the warm-up writes wait", sql, &[&pattern, &(n as i64)]).await;
    tx.rollback().await.unwrap();
    for w in writes {
        within("warm-up write", w).await.unwrap().unwrap();
    }
}

/// The owner id in a table's lease row.
async fn lease_row_owner(table: &str) -> uuid::Uuid {
    let sql = format!("SELECT owner_id FROM \"{table}_lease\"");
    admin().await.query_one(&sql, &[]).await.unwrap().get(0)
}

async fn value_of(table: &str, key: &str) -> Vec<u8> {
    admin()
        .await
        .query_one(&format!("SELECT value FROM \"{table}\" WHERE key = $1"), &[&key])
        .await
        .unwrap()
        .get(0)
}

/// A connection breaks while its write still runs on the server. The server process goes on
/// and would commit the old value after the retry and after a later call: the store must fence
/// it off before it retries. It changes its owner id in the lease row, which waits for the old
/// statement, and ends no server process; the fencing token stays. The sessions use a non-ISO date style and a time zone
/// whose abbreviation is ambiguous, so nothing of the fence may go through text. Their
/// `lock_timeout` (100 ms) is shorter than the wait of the fence for the orphan.
/// Behind a transaction pooler (without those options, which PgBouncer refuses) the same
/// holds, with no server process id to go by.
async fn orphaned_statement_cannot_overwrite_a_later_call(batch: bool, route: Route) {
    let server = TestServer::shared().unwrap();
    let bouncer = match route {
        Route::Direct => None,
        Route::TransactionPooler => {
            Some(PgBouncer::start(server.tcp_addr().unwrap(), Transaction).unwrap())
        }
    };
    let upstream = bouncer.as_ref().map_or_else(|| server.tcp_addr().unwrap(), PgBouncer::addr);
    let proxy = Proxy::start(upstream).await.unwrap();
    let t = table("orphan");
    let mut config = server.config_via(proxy.addr());
    if bouncer.is_none() {
        // PgBouncer refuses startup options it does not track.
        config.options("-c DateStyle=SQL,DMY -c TimeZone=Asia/Kolkata -c lock_timeout=100ms");
    }
    let mode = match route {
        Route::Direct => PoolMode::Session,
        Route::TransactionPooler => PoolMode::Transaction,
    };
    let store = PgKvStore::builder_from_config(config)
        .table(&t)
        .pool_mode(mode)
        .pool_size(2)
        .lease_ttl(Duration::from_secs(30))
        .renew_interval(Duration::from_secs(5))
        .open()
        .await
        .unwrap();
    store.write("o", "s", "k", b"first".to_vec()).await.unwrap();
    let owner = store.owner_id();
    slow_trigger(&t, 2).await;

    let slow = if batch {
        tokio::spawn(store.batch().put("o", "s", "k", b"slow".to_vec()).commit())
    } else {
        tokio::spawn(store.write("o", "s", "k", b"slow".to_vec()))
    };
    wait_for_sleeper(&t).await;
    proxy.cut_all(); // The server process keeps sleeping, then would commit "slow".
    within("slow write", slow).await.unwrap().expect("retried once the old one was fenced off");
    assert_ne!(store.owner_id(), owner, "a new owner id fenced the old statement off");
    assert_eq!(lease_row_owner(&t).await, store.owner_id());
    store.write("o", "s", "k", b"later".to_vec()).await.unwrap();
    // An orphaned statement that survived would commit before it ended.
    wait_until_no_statement_on(&t).await;
    assert_eq!(value_of(&t, "k").await, b"later", "the later call's value stands");
    assert_eq!(*store.lease_state().borrow(), LeaseState::Held { epoch: 1 });
    store.close().await.unwrap();
}

/// A write sent with the owner id of before the store fenced off an orphaned statement finds
/// another id in the lease row and writes nothing. That is no loss: the store sends it again,
/// with the new id. The proxy's gates pin the order: the write of `k` commits unanswered; the
/// write of `b` is sent (with the old id: no fence has begun) and held on its way; the first
/// write's connection breaks, and the store's change of owner id commits; then `b` reaches the
/// server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_sent_with_an_owner_id_changed_meanwhile_is_sent_again() {
    use crate::interleavings::{
        proxied_store, wait_for_owner_change, write_committed_unanswered, writes_to,
    };
    let (t, proxy, store) = proxied_store("ownerchg", |b| b).await;
    let owner = store.owner_id();
    let (a_gate, a) = write_committed_unanswered(&proxy, &store, &t, "k", b"v1").await;
    let b_gate = proxy.gate(writes_to(&t), Hold::Statement);
    let b = tokio::spawn(store.write("o", "s", "b", b"b".to_vec()));
    within("b held on its way", b_gate.held()).await; // Sent with `owner`.
    assert!(a_gate.cut());
    wait_for_owner_change(&t, owner).await;
    assert_ne!(store.owner_id(), owner, "a new owner id fenced the broken write off");
    b_gate.release(); // Reaches a row with another id: refused, then sent again.
    within("b", b).await.unwrap().expect("sent again with the new owner id");
    within("k", a).await.unwrap().expect("retried once it was fenced off");
    assert_eq!(value_of(&t, "b").await, b"b");
    assert_eq!(value_of(&t, "k").await, b"v1");
    assert_eq!(*store.lease_state().borrow(), LeaseState::Held { epoch: 1 });
    assert_eq!(lease_row_owner(&t).await, store.owner_id());
    store.close().await.unwrap();
}

/// What the store's connections go through, behind the proxy that breaks them.
enum Route {
    Direct,
    /// PgBouncer in transaction mode (`PoolMode::Transaction`): the server process that ran
    /// the orphan serves the pooler's other clients too, so ending it is never an option.
    TransactionPooler,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_orphaned_by_a_broken_connection_cannot_overwrite_a_later_call() {
    orphaned_statement_cannot_overwrite_a_later_call(false, Route::Direct).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_orphaned_by_a_broken_connection_cannot_overwrite_a_later_call() {
    orphaned_statement_cannot_overwrite_a_later_call(true, Route::Direct).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_orphaned_behind_a_transaction_pooler_cannot_overwrite_a_later_call() {
    orphaned_statement_cannot_overwrite_a_later_call(false, Route::TransactionPooler).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_orphaned_behind_a_transaction_pooler_cannot_overwrite_a_later_call() {
    orphaned_statement_cannot_overwrite_a_later_call(true, Route::TransactionPooler).await;
}

/// Dropping a write future (a timeout, a `select!`) must not let a later call of the key run
/// while the dropped write's statement is still running.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_write_future_cannot_overwrite_a_later_call() {
    let t = table("dropfut");
    let store = builder(&t).pool_size(4).open().await.unwrap();
    store.write("d", "s", "k", b"first".to_vec()).await.unwrap();
    warm_pool(&store, &t, 4).await;
    slow_trigger(&t, 2).await;
    let timed_out = tokio::time::timeout(
        Duration::from_millis(300),
        store.write("d", "s", "k", b"slow".to_vec()),
    )
    .await;
    assert!(timed_out.is_err(), "the slow write was still running when its future was dropped");
    store.write("d", "s", "k", b"later".to_vec()).await.unwrap();
    wait_until_no_statement_on(&t).await;
    assert_eq!(value_of(&t, "k").await, b"later");
    store.close().await.unwrap();
}

/// Gates in a trigger: a write of the value `gate1`, `gate2` or `gate3` to the table waits inside its
/// statement, before it locks the row, until the test opens that gate. Both start closed (held
/// as session advisory locks by the test's own connection).
struct Gates {
    holder: tokio_postgres::Client,
    table: String,
}

impl Gates {
    async fn closed(table: &str) -> Gates {
        Gates::closed_on(admin().await, table).await
    }

    /// The gates on `table` in the database `holder` (a superuser connection) is connected to.
    async fn closed_on(holder: tokio_postgres::Client, table: &str) -> Gates {
        holder
            .batch_execute(&format!(
                "CREATE FUNCTION \"{table}_gate\"() RETURNS trigger LANGUAGE plpgsql AS $$
                 BEGIN
                     IF NEW.value IN ('gate1'::bytea, 'gate2'::bytea, 'gate3'::bytea) THEN
                         PERFORM pg_advisory_xact_lock_shared(hashtext('{table}'),
                                                              get_byte(NEW.value, 4));
                     END IF;
                     RETURN NEW;
                 END $$;
                 CREATE TRIGGER gate BEFORE INSERT ON \"{table}\"
                     FOR EACH ROW EXECUTE FUNCTION \"{table}_gate\"();
                 SELECT pg_advisory_lock(hashtext('{table}'), ascii('1')),
                        pg_advisory_lock(hashtext('{table}'), ascii('2')),
                        pg_advisory_lock(hashtext('{table}'), ascii('3'));"
            ))
            .await
            .unwrap();
        Gates { holder, table: table.to_owned() }
    }

    async fn open(&self, gate: char) {
        let sql = "SELECT pg_advisory_unlock(hashtext($1), ascii($2))";
        let opened: bool =
            self.holder.query_one(sql, &[&self.table, &gate.to_string()]).await.unwrap().get(0);
        assert!(opened, "gate {gate} was closed");
    }

    /// Waits until `n` statements whose text matches `pattern` (SQL LIKE) wait at a gate.
    async fn wait_for(&self, n: i64, pattern: &str) {
        let sql = "SELECT 1 FROM pg_stat_activity WHERE wait_event = 'advisory' AND query LIKE $1 \
                   HAVING count(*) >= $2";
        let pattern = format!("%\"{}\"%{pattern}%", self.table);
        common::wait_for_row("statements waiting at a gate", sql, &[&pattern, &n]).await
    }
}

/// A store on a fresh table through a fault-injecting proxy, with one connection (as
/// `configure` leaves it), `k` = `first`, and closed [`Gates`].
async fn proxied_gated_store(
    prefix: &str,
    configure: impl FnOnce(pgfence::Builder) -> pgfence::Builder,
) -> (String, Proxy, PgKvStore, Gates) {
    let server = TestServer::shared().unwrap();
    let proxy = Proxy::start(server.tcp_addr().unwrap()).await.unwrap();
    let t = table(prefix);
    let builder = PgKvStore::builder_from_config(server.config_via(proxy.addr()))
        .table(&t)
        .pool_size(1)
        .lease_ttl(Duration::from_secs(30))
        .renew_interval(Duration::from_secs(5));
    let store = configure(builder).open().await.unwrap();
    store.write("r", "s", "k", b"first".to_vec()).await.unwrap();
    let gates = Gates::closed(&t).await;
    (t, proxy, store, gates)
}

/// Holds back, for good, the answer of the one write statement waiting at a gate on `table`;
/// whether it is a shared statement (the batch statement, which reads `unnest`).
async fn stall_statement_at_gate(proxy: &Proxy, table: &str) -> bool {
    let at_gate = "SELECT client_port, query LIKE '%unnest%' FROM pg_stat_activity \
                   WHERE wait_event = 'advisory' AND query LIKE $1";
    let pattern = format!("%INSERT INTO \"{table}\"%");
    let row = admin().await.query_one(at_gate, &[&pattern]).await.unwrap();
    let (port, shared): (i32, bool) = (row.get(0), row.get(1));
    proxy.stall(u16::try_from(port).unwrap());
    shared
}

/// Lets the statement stalled at gate 1 ([`stall_statement_at_gate`]) commit, then cuts every
/// connection: its caller learns nothing of the outcome, and the store ends that session and
/// retries. Returns once the retry is held up (preparing it on a new connection needs the
/// table) by an administrator's lock on the table, queued behind the statement and so granted
/// only once it has committed (checked: `k` is `gate1` then).
async fn commit_unanswered_and_hold_the_retry(
    proxy: &Proxy,
    gates: &Gates,
    table: &str,
) -> TableLock {
    let mut lock = TableLock::queue(table).await;
    gates.open('1').await;
    assert_eq!(lock.granted().await, b"gate1", "the statement committed");
    proxy.cut_all();
    lock.wait_for_a_waiter().await;
    lock
}

/// A store on a fresh table (`write_concurrency` statements at once) with `k` = `first`, and
/// closed [`Gates`] on the table.
async fn gated_store(prefix: &str, write_concurrency: usize) -> (String, PgKvStore, Gates) {
    let t = table(prefix);
    let store = builder(&t).pool_size(4).write_concurrency(write_concurrency).open().await.unwrap();
    store.write("r", "s", "k", b"first".to_vec()).await.unwrap();
    let gates = Gates::closed(&t).await;
    (t, store, gates)
}

/// `store.write(key, value)`, called and awaited on a thread of its own through a handle of a
/// runtime of its own (where the write's task is spawned), so that the test can shut that
/// runtime down while the caller still waits. Returns the runtime and the caller's thread.
fn write_on_doomed_runtime(
    store: &PgKvStore,
    key: &str,
    value: &[u8],
) -> (tokio::runtime::Runtime, std::thread::JoinHandle<Result<(), Error>>) {
    let doomed =
        tokio::runtime::Builder::new_multi_thread().worker_threads(1).enable_all().build().unwrap();
    let handle = doomed.handle().clone();
    let write = store.write("r", "s", key, value.to_vec());
    (doomed, std::thread::spawn(move || handle.block_on(write)))
}

async fn outcome_of(caller: std::thread::JoinHandle<Result<(), Error>>) -> Result<(), Error> {
    within("caller", tokio::task::spawn_blocking(move || caller.join().unwrap())).await.unwrap()
}

/// The write's caller learned that its outcome is unknown (`outcome`), and a later call of its
/// key fails the same way instead of succeeding (and being overwritten when the orphan commits).
async fn assert_failed_closed(store: &PgKvStore, outcome: Result<(), Error>) {
    let unknown = |result: &Result<(), Error>| {
        matches!(result, Err(Error::LeaseLost { reason: LossReason::WriteOutcomeUnknown, .. }))
    };
    assert!(unknown(&outcome), "the caller learns the outcome is unknown: {outcome:?}");
    let later = within("later", store.write("r", "s", "k", b"later".to_vec())).await;
    assert!(unknown(&later), "a later call of the key must not succeed: {later:?}");
}

async fn wait_for_value(table: &str, key: &str, value: &[u8]) {
    let sql = format!("SELECT 1 FROM \"{table}\" WHERE key = $1 AND value = $2");
    common::wait_for_row("the value committed", &sql, &[&key, &value]).await
}

/// Time for spawned calls to reach the coalescer's queue (it has nothing to wait on).
async fn settle() {
    tokio::time::sleep(Duration::from_millis(500)).await;
}

/// An administrator's `ACCESS EXCLUSIVE` lock on a table, queued behind the statements using
/// it when requested and held until released. While it is held, preparing a statement on the
/// table, on a connection that has not prepared it yet, waits for it: an attempt held up
/// before anything of it was sent.
struct TableLock {
    table: String,
    granted: Option<tokio::sync::oneshot::Receiver<Vec<u8>>>,
    release: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<()>,
}

impl TableLock {
    /// Requests the lock on `table` (where key `k` exists) and returns once the request waits.
    async fn queue(table: &str) -> TableLock {
        let (granted, granted_rx) = tokio::sync::oneshot::channel();
        let (release, released) = tokio::sync::oneshot::channel::<()>();
        let t = table.to_owned();
        let task = tokio::spawn(async move {
            let mut db = admin().await;
            let tx = db.transaction().await.unwrap();
            tx.batch_execute(&format!("LOCK TABLE \"{t}\" IN ACCESS EXCLUSIVE MODE"))
                .await
                .unwrap();
            let sql = format!("SELECT value FROM \"{t}\" WHERE key = 'k'");
            granted.send(tx.query_one(&sql, &[]).await.unwrap().get(0)).unwrap();
            let _ = released.await;
            tx.rollback().await.unwrap();
        });
        let lock = TableLock { table: table.to_owned(), granted: Some(granted_rx), release, task };
        lock.wait_for_a_waiter().await;
        lock
    }

    /// Waits until the lock is granted; returns the value of `k` then.
    async fn granted(&mut self) -> Vec<u8> {
        let granted = self.granted.take().expect("asked once");
        within("table lock granted", granted).await.unwrap()
    }

    /// Waits until a request for a lock on the table waits (once granted: behind this one).
    async fn wait_for_a_waiter(&self) {
        let sql = "SELECT 1 FROM pg_locks WHERE relation = to_regclass($1) AND NOT granted";
        common::wait_for_row("a lock request waits", sql, &[&format!("\"{}\"", self.table)]).await
    }

    async fn release(self) {
        self.release.send(()).unwrap();
        within("table lock released", self.task).await.unwrap();
    }
}

/// A write's statement is running on the server when the runtime running its task shuts down
/// (the store itself lives on: it was opened on another runtime, and renewal has its own
/// thread). Nobody can learn that statement's outcome, and it still commits later, so the key's
/// order cannot be vouched for: the store must fail closed rather than let a later call of the
/// key succeed and then be overwritten. (Before the store did, the later call returned `Ok` and
/// was overwritten.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_whose_runtime_shuts_down_mid_statement_fails_the_store_closed() {
    let (t, store, gates) = gated_store("rtdown", 4).await;

    let (doomed, caller) = write_on_doomed_runtime(&store, "k", b"gate1");
    gates.wait_for(1, "").await;
    doomed.shutdown_background();
    assert_failed_closed(&store, outcome_of(caller).await).await;

    // The orphaned statement still commits; no call that succeeded is overwritten by it.
    gates.open('1').await;
    wait_for_value(&t, "k", b"gate1").await;
    assert!(matches!(
        *store.lease_state().borrow(),
        LeaseState::Lost { reason: LossReason::WriteOutcomeUnknown, .. }
    ));
    store.close().await.unwrap();
}

/// A write's first attempt commits on the server but its connection breaks before the answer
/// arrives; the store ends that session (its transaction is then decided: here, committed) and
/// is about to retry when the runtime running the write's task shuts down. The write may have
/// committed, so the key's turn, gone with the task, must not be handed on as if nothing had
/// been written: an earlier call of the key, waiting for that turn, would then overwrite the
/// later call's committed value. The store must fail closed instead, as it does when the
/// retries end in an error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_dropped_after_an_attempt_that_may_have_committed_fails_the_store_closed() {
    let (t, proxy, store, gates) = proxied_gated_store("dropretry", |b| b).await;

    // Calls, in this order: `earlier`, then the write of `gate1`, whose task runs on a runtime
    // of its own and takes the key's turn first (it waits at gate 1, inside its statement).
    let earlier = store.write("r", "s", "k", b"earlier".to_vec());
    let (doomed, caller) = write_on_doomed_runtime(&store, "k", b"gate1");
    gates.wait_for(1, "").await;
    let earlier = tokio::spawn(earlier); // Waits for the key's turn.
    stall_statement_at_gate(&proxy, &t).await; // Its answer will never arrive.

    let lock = commit_unanswered_and_hold_the_retry(&proxy, &gates, &t).await;
    doomed.shutdown_background();
    let outcome = outcome_of(caller).await;

    lock.release().await;
    let earlier = within("earlier", earlier).await.unwrap();
    assert_eq!(value_of(&t, "k").await, b"gate1", "the earlier call overwrote the later one");
    assert!(
        matches!(outcome, Err(Error::LeaseLost { reason: LossReason::WriteOutcomeUnknown, .. })),
        "the caller learns the outcome is unknown: {outcome:?}"
    );
    assert!(matches!(earlier, Err(Error::LeaseLost { .. })), "earlier: {earlier:?}");
    store.close().await.unwrap();
}

/// A store closed while a write's retry is still held up, after an attempt that may have
/// committed (and did): `close()` gives up waiting for it (`drop_timeout`) and releases the
/// lease, so the retry finds the lease gone. The caller must learn that its outcome is unknown
/// (`LeaseLost`, `WriteOutcomeUnknown`), not `Closed`, which reads as "not written".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_retried_across_close_after_an_attempt_that_may_have_committed_is_unknown() {
    let (t, proxy, store, gates) =
        proxied_gated_store("closeretry", |b| b.drop_timeout(Duration::from_millis(500))).await;
    let write = tokio::spawn(store.write("r", "s", "k", b"gate1".to_vec()));
    gates.wait_for(1, "").await;
    stall_statement_at_gate(&proxy, &t).await; // Its answer will never arrive.

    let lock = commit_unanswered_and_hold_the_retry(&proxy, &gates, &t).await;

    let closed = within("close", store.close()).await;
    assert!(matches!(closed, Err(Error::Timeout { .. })), "the write still ran: {closed:?}");
    assert!(matches!(*store.lease_state().borrow(), LeaseState::Released { .. }));
    lock.release().await;
    let outcome = within("the write", write).await.unwrap();
    assert!(
        matches!(outcome, Err(Error::LeaseLost { reason: LossReason::WriteOutcomeUnknown, .. })),
        "the caller learns the outcome is unknown: {outcome:?}"
    );
    assert_eq!(value_of(&t, "k").await, b"gate1");
}

/// A write's first attempt commits but its answer never arrives; before the retry runs,
/// another store takes the lease over. The retry finds the lease gone and writes nothing. The
/// caller must get `LeaseLost` with the reason the lease was lost (`Fenced`: the retry found
/// it), not `Ok` and not an error that reads as "not written": the first attempt committed.
/// (Renewal, which would find the takeover as `TakenOver`, is not due before the test ends.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retry_that_finds_the_lease_taken_over_reports_fenced() {
    let (t, proxy, store, gates) = proxied_gated_store("retryfenced", |b| {
        b.lease_ttl(Duration::from_secs(90)).renew_interval(Duration::from_secs(45))
    })
    .await;
    let write = tokio::spawn(store.write("r", "s", "k", b"gate1".to_vec()));
    gates.wait_for(1, "").await;
    stall_statement_at_gate(&proxy, &t).await; // Its answer will never arrive.
    let lock = commit_unanswered_and_hold_the_retry(&proxy, &gates, &t).await;

    let db = admin().await;
    assert_eq!(common::steal_lease(&db, &t).await, 2);
    lock.release().await;
    let outcome = within("the write", write).await.unwrap();

    assert!(
        matches!(outcome, Err(Error::LeaseLost { epoch: 1, reason: LossReason::Fenced })),
        "the write committed: its caller must not read `not written`: {outcome:?}"
    );
    assert_eq!(value_of(&t, "k").await, b"gate1");
    let lost = LeaseState::Lost { epoch: 1, reason: LossReason::Fenced };
    assert_eq!(*store.lease_state().borrow(), lost);
    store.close().await.unwrap();
}

/// The same for a shared statement (write coalescing): every caller in it is told that its
/// outcome is unknown. Run again alone after the close, each would have got `Closed`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn coalesced_writes_retried_across_close_after_an_attempt_that_may_have_committed_are_unknown()
 {
    let (t, proxy, store, gates) = proxied_gated_store("closeretryco", |b| {
        b.write_concurrency(1).drop_timeout(Duration::from_millis(500))
    })
    .await;
    // `w` holds the one statement (at gate 2) while `k` and `x` queue behind it; then the two
    // share the next statement, which waits at gate 1 (for `k`'s value).
    let first = tokio::spawn(store.write("r", "s", "w", b"gate2".to_vec()));
    gates.wait_for(1, "").await;
    let shared = [("k", b"gate1"), ("x", b"xxxx1")]
        .map(|(key, value)| tokio::spawn(store.write("r", "s", key, value.to_vec())));
    // The store's queue is not visible on the server: a settle time lets the two spawned
    // writes reach it (the coalescing tests do the same). Should they not have, the statement
    // at gate 1 is `k`'s alone, and the test says so instead of checking the wrong thing.
    tokio::time::sleep(Duration::from_millis(500)).await;
    gates.open('2').await;
    within("the first write", first).await.unwrap().unwrap();
    gates.wait_for(1, "").await;
    let shared_statement = stall_statement_at_gate(&proxy, &t).await;
    assert!(shared_statement, "`x` did not reach the queue within the settle time");

    let lock = commit_unanswered_and_hold_the_retry(&proxy, &gates, &t).await;

    let closed = within("close", store.close()).await;
    assert!(matches!(closed, Err(Error::Timeout { .. })), "the writes still ran: {closed:?}");
    lock.release().await;
    for write in shared {
        let outcome = within("a shared write", write).await.unwrap();
        assert!(
            matches!(
                outcome,
                Err(Error::LeaseLost { reason: LossReason::WriteOutcomeUnknown, .. })
            ),
            "each caller learns its outcome is unknown: {outcome:?}"
        );
    }
    assert_eq!(value_of(&t, "x").await, b"xxxx1");
}

/// A server that stops answering with the connections still up (here a proxy that holds back
/// everything from the moment a write is running on the server: its answer, a read, renewal).
/// The operations waiting for an answer return `LeaseLost` (`DeadlinePassed`) at the local
/// deadline instead of waiting for the server. The write was sent, so its outcome is unknown,
/// not failed: it commits all the same. Neither connection goes back to the pool, where the next
/// user would queue behind an unanswered statement.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operations_unanswered_at_the_local_deadline_return_lease_lost() {
    let server = TestServer::shared().unwrap();
    let proxy = Proxy::start(server.tcp_addr().unwrap()).await.unwrap();
    let t = table("unanswered");
    let store = PgKvStore::builder_from_config(server.config_via(proxy.addr()))
        .table(&t)
        .pool_size(2)
        .lease_ttl(Duration::from_secs(6)) // local deadline 4 s
        .renew_interval(Duration::from_secs(1))
        .open()
        .await
        .unwrap();
    store.write("u", "s", "k", b"first".to_vec()).await.unwrap();
    warm_pool(&store, &t, 2).await;
    slow_trigger(&t, 3).await;
    let write = tokio::spawn(store.write("u", "s", "k", b"slow".to_vec()));
    wait_for_sleeper(&t).await;
    proxy.set_delay(Duration::from_secs(3600)); // Nothing gets through any more.
    let read = tokio::spawn({
        let store = store.clone();
        async move { store.read("u", "s", "k").await }
    });

    let deadline_passed =
        |e: &Error| matches!(e, Error::LeaseLost { reason: LossReason::DeadlinePassed, .. });
    let e = within("unanswered write", write).await.unwrap().unwrap_err();
    assert!(deadline_passed(&e), "{e:?}");
    let e = within("unanswered read", read).await.unwrap().unwrap_err();
    assert!(deadline_passed(&e), "{e:?}");
    let lost = LeaseState::Lost { epoch: 1, reason: LossReason::DeadlinePassed };
    assert_eq!(*store.lease_state().borrow(), lost);
    let sql = format!("SELECT value FROM \"{t}\" WHERE key = 'k'");
    let db = admin().await;
    within("the unanswered write commits", async {
        while db.query_one(&sql, &[]).await.unwrap().get::<_, Vec<u8>>(0) != b"slow" {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;

    proxy.set_delay(Duration::ZERO);
    // Both pooled connections wait for answers held back for an hour: only a new one answers.
    let info = within("lease info on a new connection", store.lease_info()).await.unwrap();
    assert_eq!(info.map(|info| info.epoch), Some(1));
    store.close().await.unwrap();
}

/// What the store logs when an operation gives up waiting for its answer at the local deadline:
/// after it saw the deadline pass, before it reports the loss to its caller.
const GAVE_UP_AT_THE_DEADLINE: &str =
    "pgfence gave up waiting for the server at the local deadline";

/// A pause point in the store's code, for a window too narrow to hit otherwise: the first task
/// of a [`Paused`] runtime that logs the error event `message` stops inside that log call, and
/// so at that point of the code, until the test lets it go (or [`HANG_GUARD`] passes). Tasks of
/// other runtimes (the other tests of this binary) are not paused.
#[derive(Clone)]
struct Pause(Arc<PauseState>);

struct PauseState {
    message: &'static str,
    reached: Mutex<Option<tokio::sync::oneshot::Sender<()>>>,
    go: (Mutex<bool>, Condvar),
}

thread_local! {
    /// The pause point of the [`Paused`] runtime this thread belongs to, if any.
    static PAUSE_HERE: std::cell::RefCell<Option<Pause>> = const { std::cell::RefCell::new(None) };
}

impl Pause {
    /// The pause point, and what completes once a task stops at it.
    fn at(message: &'static str) -> (Pause, tokio::sync::oneshot::Receiver<()>) {
        let (reached, reached_rx) = tokio::sync::oneshot::channel();
        let state = PauseState {
            message,
            reached: Mutex::new(Some(reached)),
            go: (Mutex::new(false), Condvar::new()),
        };
        (Pause(Arc::new(state)), reached_rx)
    }

    fn go(&self) {
        let (go, cv) = &self.0.go;
        *go.lock().unwrap() = true;
        cv.notify_all();
    }

    /// On the thread logging `message`: stops there, the first time.
    fn logged(&self, message: &str) {
        if message != self.0.message {
            return;
        }
        let Some(reached) = self.0.reached.lock().unwrap().take() else {
            return; // Only the first task to get here stops.
        };
        let _ = reached.send(());
        let (go, cv) = &self.0.go;
        let _ = cv.wait_timeout_while(go.lock().unwrap(), HANG_GUARD, |go| !*go).unwrap();
    }
}

/// A runtime (one worker thread) whose tasks stop at a [`Pause`]. Dropped, it lets them go and
/// shuts down in the background (a runtime cannot be dropped in place inside another one).
struct Paused {
    runtime: Option<tokio::runtime::Runtime>,
    pause: Pause,
}

impl Paused {
    fn at(pause: &Pause) -> Paused {
        common::errors::observe("hazards: pause at a logged error", |event| {
            if let Some(pause) = PAUSE_HERE.with(|here| here.borrow().clone()) {
                pause.logged(&event.message);
            }
        });
        let on_thread = pause.clone();
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .on_thread_start(move || {
                PAUSE_HERE.with(|here| *here.borrow_mut() = Some(on_thread.clone()))
            })
            .build()
            .unwrap();
        Paused { runtime: Some(runtime), pause: pause.clone() }
    }

    /// Spawns `work` here: so do the tasks it spawns (a write's own task, say).
    fn spawn<T: Send + 'static>(
        &self,
        work: impl std::future::Future<Output = T> + Send + 'static,
    ) -> tokio::task::JoinHandle<T> {
        self.runtime.as_ref().expect("until dropped").spawn(work)
    }
}

impl Drop for Paused {
    fn drop(&mut self) {
        self.pause.go();
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

/// A store whose lease cannot be renewed from now on (an administrator holds its row `FOR NO
/// KEY UPDATE`, which conflicts with renewal, and not with the writes' `FOR KEY SHARE`), and so
/// whose local deadline passes. Roll the transaction back to let a release through.
async fn block_renewal<'a>(
    blocker: &'a mut tokio_postgres::Client,
    table: &str,
) -> tokio_postgres::Transaction<'a> {
    common::lock_lease_row(blocker, table, "FOR NO KEY UPDATE").await
}

/// A store with a short local deadline (3 s; the TTL is long, so that only the local deadline
/// matters), renewed often, on a fresh table with `k` = `first`, and closed [`Gates`].
async fn deadline_gated_store(
    prefix: &str,
    write_concurrency: usize,
) -> (String, PgKvStore, Gates) {
    let t = table(prefix);
    let store = builder(&t)
        .pool_size(2)
        .write_concurrency(write_concurrency)
        .lease_ttl(Duration::from_secs(60))
        .local_deadline(Duration::from_secs(3))
        .renew_interval(Duration::from_millis(500))
        .drop_timeout(Duration::from_secs(2))
        .open()
        .await
        .unwrap();
    store.write("r", "s", "k", b"first".to_vec()).await.unwrap();
    let gates = Gates::closed(&t).await;
    (t, store, gates)
}

/// A write's statement is sent and still unanswered when the local deadline passes, and
/// `close()` (which gave up waiting for it) releases the lease right after the write saw the
/// deadline pass and before it reported the loss: a window of a few instructions, held open
/// here by pausing the write's task at its log event of that moment. The statement may still
/// commit (it locked the lease row before the release; here it does), so the caller must get
/// `LeaseLost` (`DeadlinePassed`), as without the close, not `Closed`, which reads as "not
/// written".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_unanswered_at_the_deadline_as_close_releases_is_lease_lost_not_closed() {
    let (t, store, gates) = deadline_gated_store("deadlineclose", 4).await;
    let (pause, reached) = Pause::at(GAVE_UP_AT_THE_DEADLINE);
    let paused = Paused::at(&pause);
    let write = paused.spawn(store.write("r", "s", "k", b"gate1".to_vec()));
    gates.wait_for(1, "").await; // Sent: it waits at gate 1, its lease row lock taken.

    let mut blocker = admin().await;
    let tx = block_renewal(&mut blocker, &t).await;
    within("the write gives up at the deadline", reached).await.unwrap();
    tx.rollback().await.unwrap();
    let closed = within("close", store.close()).await;
    assert!(matches!(closed, Err(Error::Timeout { .. })), "released, the write ran: {closed:?}");
    pause.go();
    let outcome = within("the write", write).await.unwrap();

    gates.open('1').await;
    wait_for_value(&t, "k", b"gate1").await; // The statement commits.
    assert!(
        matches!(outcome, Err(Error::LeaseLost { reason: LossReason::DeadlinePassed, .. })),
        "the write committed: its caller must not read `not written`: {outcome:?}"
    );
}

/// The same for a shared statement (write coalescing). Its callers must not have their
/// mutations handed back to run alone, which after the release fails them with `Closed`: each
/// must get `LeaseLost` (`DeadlinePassed`), as without the close. (Here the statement commits
/// both.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn coalesced_writes_unanswered_at_the_deadline_as_close_releases_are_lease_lost_not_closed() {
    let (t, store, gates) = deadline_gated_store("deadlinecloseco", 1).await;
    let (pause, reached) = Pause::at(GAVE_UP_AT_THE_DEADLINE);
    let paused = Paused::at(&pause);
    // `w` holds the one statement (at gate 2) while `k` and `x` queue behind it; then the two
    // share the next statement, which waits at gate 1 (for `k`'s value).
    let first = tokio::spawn(store.write("r", "s", "w", b"gate2".to_vec()));
    gates.wait_for(1, "").await;
    let [k, x] = [("k", b"gate1"), ("x", b"xxxx1")]
        .map(|(key, value)| paused.spawn(store.write("r", "s", key, value.to_vec())));
    settle().await; // The queue is not visible on the server; checked below.
    gates.open('2').await;
    within("the first write", first).await.unwrap().unwrap();
    gates.wait_for(1, "unnest").await; // Only the shared statement reads `unnest`.

    let mut blocker = admin().await;
    let tx = block_renewal(&mut blocker, &t).await;
    within("the shared statement gives up at the deadline", reached).await.unwrap();
    tx.rollback().await.unwrap();
    let closed = within("close", store.close()).await;
    assert!(matches!(closed, Err(Error::Timeout { .. })), "released, the writes ran: {closed:?}");
    pause.go();
    let outcomes = [within("k", k).await, within("x", x).await];

    gates.open('1').await;
    wait_for_value(&t, "x", b"xxxx1").await; // The shared statement commits x (and k).
    assert_eq!(value_of(&t, "k").await, b"gate1");
    for outcome in outcomes {
        let outcome = outcome.unwrap();
        assert!(
            matches!(outcome, Err(Error::LeaseLost { reason: LossReason::DeadlinePassed, .. })),
            "each write committed: its caller must not read `not written`: {outcome:?}"
        );
    }
}

/// A connection breaks while its write still runs on the server, and the statement goes on
/// holding the lease row (waiting at a gate). The store's change of owner id waits for it, and
/// cannot be confirmed within its retries (one TTL). The old statement may commit at any time,
/// so the store fails closed (`WriteOutcomeUnknown`) instead of retrying: a later call of the
/// key must not succeed and then be overwritten. Renewal goes on meanwhile, so the loss is
/// this one, not a passed deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn write_that_cannot_be_fenced_off_in_time_fails_the_store_closed() {
    let server = TestServer::shared().unwrap();
    let proxy = Proxy::start(server.tcp_addr().unwrap()).await.unwrap();
    let t = table("nofence");
    let store = PgKvStore::builder_from_config(server.config_via(proxy.addr()))
        .table(&t)
        .lease_ttl(Duration::from_secs(4))
        .renew_interval(Duration::from_millis(500))
        .open()
        .await
        .unwrap();
    store.write("r", "s", "k", b"first".to_vec()).await.unwrap();
    let gates = Gates::closed(&t).await;

    let write = tokio::spawn(store.write("r", "s", "k", b"gate1".to_vec()));
    gates.wait_for(1, "").await;
    proxy.cut_all(); // The server process keeps waiting at the gate, then would commit.
    assert_failed_closed(&store, within("write", write).await.unwrap()).await;

    // The orphaned statement still commits; no call that succeeded is overwritten by it.
    gates.open('1').await;
    wait_for_value(&t, "k", b"gate1").await;
    store.close().await.unwrap();
}

/// Under `LeaseLossPolicy::Panic`, the loss found when a write's task is dropped mid-statement
/// is found in a destructor, where a panic is unsafe: the waiting caller and the next operation
/// raise it instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn panic_policy_after_a_write_dropped_mid_statement_panics_in_the_next_operation() {
    let t = table("rtdownp");
    let store = builder(&t).on_lease_lost(LeaseLossPolicy::Panic).open().await.unwrap();
    let gates = Gates::closed(&t).await;
    let (doomed, caller) = write_on_doomed_runtime(&store, "k", b"gate1");
    gates.wait_for(1, "").await;
    doomed.shutdown_background();
    let joined = within("caller", tokio::task::spawn_blocking(move || caller.join())).await;
    assert!(joined.unwrap().is_err(), "the waiting caller panicked");
    let next = tokio::spawn({
        let store = store.clone();
        async move { store.read("r", "s", "k").await }
    });
    assert!(within("next operation", next).await.unwrap_err().is_panic(), "the next one too");
    gates.open('1').await;
    store.close().await.unwrap();
}

/// The same with write coalescing: the dropped write sits in a statement that another caller
/// (on a runtime that lives on) runs for a group of queued writes. The statement carries on
/// after the dropped caller's key turn is gone, so the store must fail closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_write_whose_runtime_shuts_down_in_a_shared_statement_fails_the_store_closed() {
    let (t, store, gates) = gated_store("rtdownq", 2).await;

    // Both statements allowed are busy (behind gates 1 and 3); `c` queues, then `k` behind it.
    let holds = [("hold1", b"gate1"), ("hold3", b"gate3")]
        .map(|(key, gate)| tokio::spawn(store.write("r", "s", key, gate.to_vec())));
    gates.wait_for(2, "").await;
    let c = tokio::spawn(store.write("r", "s", "c", b"c".to_vec()));
    settle().await;
    let (doomed, caller) = write_on_doomed_runtime(&store, "k", b"gate2");
    settle().await;
    // One statement frees up: `c`'s caller, first in line for it, takes the group (c, k) and
    // runs it; k's row waits at gate 2. `k`'s caller still waits for a statement of its own.
    gates.open('1').await;
    gates.wait_for(1, "unnest").await;
    doomed.shutdown_background();

    assert_failed_closed(&store, outcome_of(caller).await).await;
    gates.open('2').await;
    wait_for_value(&t, "k", b"gate2").await;
    gates.open('3').await;
    for hold in holds {
        within("hold", hold).await.unwrap().unwrap();
    }
    within("c", c).await.unwrap().expect("c's own statement committed");
    store.close().await.unwrap();
}

/// The same after `close()` released the lease: a shared statement was sent and still runs
/// on the server when the runtime of the caller running it shuts down. After the release that
/// drop marks nothing lost, but the statement may commit all the same (it locked the lease
/// row before the release), so the other caller in it must not have its mutation handed back
/// to run alone, which after the close returns `Closed` ("not written"): it must learn that
/// its outcome is unknown; and so must the caller whose task was dropped. (Here the statement
/// commits both.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shared_statement_sent_before_a_close_is_unknown_to_its_callers_when_its_runner_is_dropped()
{
    let t = table("rtdownclose");
    let store = builder(&t)
        .pool_size(4)
        .write_concurrency(1)
        .drop_timeout(Duration::from_millis(500))
        .open()
        .await
        .unwrap();
    store.write("r", "s", "k", b"first".to_vec()).await.unwrap();
    let gates = Gates::closed(&t).await;

    // The only statement allowed is busy (behind gate 1); `k` queues, then `x` behind it.
    let hold = tokio::spawn(store.write("r", "s", "hold", b"gate1".to_vec()));
    gates.wait_for(1, "").await;
    let (doomed, caller) = write_on_doomed_runtime(&store, "k", b"gate2");
    settle().await;
    let x = tokio::spawn(store.write("r", "s", "x", b"x".to_vec()));
    settle().await;
    // The statement frees up: `k`'s caller, first in line for it, takes the group (k, x) and
    // sends its statement, which waits at gate 2 (for `k`'s row).
    gates.open('1').await;
    within("hold", hold).await.unwrap().unwrap();
    gates.wait_for(1, "unnest").await;

    let closed = within("close", store.close()).await;
    assert!(matches!(closed, Err(Error::Timeout { .. })), "the writes still ran: {closed:?}");
    assert!(matches!(*store.lease_state().borrow(), LeaseState::Released { .. }));
    doomed.shutdown_background();
    let k = outcome_of(caller).await;
    let x = within("x", x).await.unwrap();

    gates.open('2').await;
    wait_for_value(&t, "x", b"x").await; // The shared statement commits x (and k).
    assert!(
        matches!(k, Err(Error::LeaseLost { reason: LossReason::WriteOutcomeUnknown, .. })),
        "k was committed: its caller must not read `not written`: {k:?}"
    );
    assert!(
        matches!(x, Err(Error::LeaseLost { reason: LossReason::WriteOutcomeUnknown, .. })),
        "x was committed: its caller must not read `not written`: {x:?}"
    );
}

/// A queued write whose runtime shuts down before any statement took it is withdrawn: it never
/// runs (its key's turn is gone, so it could land after a later call), and the store goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_write_whose_runtime_shuts_down_before_its_statement_is_withdrawn() {
    let (t, store, gates) = gated_store("rtdownw", 1).await;

    let hold = tokio::spawn(store.write("r", "s", "hold", b"gate1".to_vec()));
    gates.wait_for(1, "").await;
    let (doomed, caller) = write_on_doomed_runtime(&store, "k", b"dropped");
    settle().await;
    doomed.shutdown_background();
    let outcome = outcome_of(caller).await;
    assert!(matches!(outcome, Err(Error::Closed)), "nothing ran: {outcome:?}");

    // The next queued write's statement would carry the dropped one, had it stayed queued.
    let x = tokio::spawn(store.write("r", "s", "x", b"x".to_vec()));
    settle().await;
    gates.open('1').await;
    within("hold", hold).await.unwrap().unwrap();
    within("x", x).await.unwrap().unwrap();
    assert_eq!(value_of(&t, "k").await, b"first", "the withdrawn write never ran");
    assert_eq!(*store.lease_state().borrow(), LeaseState::Held { epoch: 1 });
    store.close().await.unwrap();
}

/// A queued write whose runtime shuts down after its caller took a group of queued writes for
/// a shared statement, but before that statement was sent (preparing it waits for an
/// administrator's table lock): nothing of the group can land, so this is the same as a write
/// withdrawn from the queue. Its caller gets `Closed`, the other write of the group runs on its
/// own, and the store goes on, instead of failing closed for a statement that never ran.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queued_write_whose_runtime_shuts_down_before_its_shared_statement_is_sent() {
    let (t, store, gates) = gated_store("rtdowns", 1).await;

    // The only statement allowed is busy (behind gate 1); `k` queues, then `x` behind it.
    let hold = tokio::spawn(store.write("r", "s", "hold", b"gate1".to_vec()));
    gates.wait_for(1, "").await;
    let (doomed, caller) = write_on_doomed_runtime(&store, "k", b"dropped");
    settle().await;
    let x = tokio::spawn(store.write("r", "s", "x", b"x".to_vec()));
    settle().await;
    // The statement frees up: `k`'s caller, first in line for it, takes the group (k, x) and
    // prepares its statement (never prepared on any connection so far), held up by the lock.
    let mut lock = TableLock::queue(&t).await;
    gates.open('1').await;
    within("hold", hold).await.unwrap().unwrap();
    lock.granted().await;
    lock.wait_for_a_waiter().await;
    doomed.shutdown_background();
    let outcome = outcome_of(caller).await;

    lock.release().await;
    let x = within("x", x).await.unwrap();
    assert!(matches!(outcome, Err(Error::Closed)), "nothing ran: {outcome:?}");
    assert!(x.is_ok(), "x runs on its own: {x:?}");
    assert_eq!(value_of(&t, "x").await, b"x");
    assert_eq!(value_of(&t, "k").await, b"first", "the dropped write never ran");
    assert_eq!(*store.lease_state().borrow(), LeaseState::Held { epoch: 1 });
    store.close().await.unwrap();
}

/// A mutation that waited for the lease row lock re-checks the expiry once it has the lock:
/// if the lease expired meanwhile, nothing changes, even though the row itself never changed
/// (PostgreSQL re-evaluates a locking query's WHERE only when the row was updated). Each kind
/// of mutation has its own statement, so each is checked, at the same time on tables of their
/// own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mutation_that_waited_past_the_expiry_changes_nothing() {
    let checks = common::Fenced::ALL.map(|fenced| tokio::spawn(waited_past_the_expiry(fenced)));
    for check in checks {
        check.await.unwrap();
    }
}

async fn waited_past_the_expiry(fenced: common::Fenced) {
    let t = table("stalecheck");
    let store = builder(&t)
        .lease_ttl(Duration::from_secs(4))
        .local_deadline(Duration::from_secs(3))
        .renew_interval(Duration::from_millis(500))
        .open()
        .await
        .unwrap();
    store.write("s", "s", "gone", b"kept".to_vec()).await.unwrap();
    let before = common::all_rows(&t).await;
    // FOR UPDATE blocks the mutations' FOR KEY SHARE and the renewal alike.
    let mut blocker = admin().await;
    let tx = common::lock_lease_row(&mut blocker, &t, "FOR UPDATE").await;
    let mutation = tokio::spawn(fenced.run(&store));
    let statement = format!("%{}%FOR KEY SHARE%", lease_table(&t));
    common::wait_for_query_lock_wait(&statement).await;
    let db = admin().await;
    within("database expiry", async {
        while lease_row(&db, &t).await.2 > -200 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    // The caller got `LeaseLost` at the local deadline; the statement still waits on the server.
    let e = within("mutation", mutation).await.unwrap().unwrap_err();
    assert!(e.is_lease_lost(), "{fenced:?}: {e:?}");
    let waiting = "SELECT count(*) FROM pg_stat_activity
                    WHERE wait_event_type = 'Lock' AND query LIKE $1";
    let n: i64 = db.query_one(waiting, &[&statement]).await.unwrap().get(0);
    assert_eq!(n, 1, "{fenced:?} is still waiting for the lock");
    tx.rollback().await.unwrap(); // The lease row is unchanged: only the clock moved.
    let running = "SELECT 1 FROM pg_stat_activity WHERE state = 'active' AND query LIKE $1";
    within("the statement ends", async {
        while !db.query(running, &[&statement]).await.unwrap().is_empty() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    assert_eq!(common::all_rows(&t).await, before, "{fenced:?} changed nothing after the expiry");
}

/// A standby whose acquisition failed and which then stalls inside its transaction (paused,
/// partitioned) must hold no lock on the lease row: the holder keeps writing and renewing.
/// This is the statement shape of the acquisition (see `sql::ACQUIRE`): a plain UPDATE whose
/// WHERE fails locks nothing, unlike `ON CONFLICT DO UPDATE ... WHERE`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stalled_failed_acquisition_does_not_block_the_holder() {
    let t = table("stalled");
    let store = builder(&t).renew_interval(Duration::from_millis(500)).open().await.unwrap();
    let mut standby = admin().await;
    let tx = standby.transaction().await.unwrap();
    let taken = tx
        .query(
            &format!(
                "UPDATE {} SET owner_id = gen_random_uuid(), epoch = epoch + 1
                  WHERE id = 1 AND expires_at <= clock_timestamp() RETURNING epoch",
                lease_table(&t)
            ),
            &[],
        )
        .await
        .unwrap();
    assert!(taken.is_empty(), "the lease is held: the attempt fails");
    // The standby now stalls with its transaction open. The holder is unaffected.
    within("write beside a stalled standby", store.write("s", "s", "k", b"v".to_vec()))
        .await
        .unwrap();
    let expiry = format!("SELECT expires_at::text FROM {}", lease_table(&t));
    let db = admin().await;
    let before: String = db.query_one(&expiry, &[]).await.unwrap().get(0);
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let after: String = db.query_one(&expiry, &[]).await.unwrap().get(0);
    assert!(after > before, "renewal went on: {before} -> {after}");
    tx.rollback().await.unwrap();
    // And the real failed open leaves no lock and no schema work behind either.
    let e = builder(&t).open().await.unwrap_err();
    assert!(e.is_lease_held(), "{e:?}");
    store.close().await.unwrap();
}

/// `close()` does not wait forever for a hung operation: it releases after `drop_timeout` and
/// says so. The release stays safe: a successor still waits for the hung write's lock. Once
/// released, the lease has no local deadline any more: the write is not abandoned at it, and
/// its caller learns that it committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_with_a_hung_operation_is_bounded_and_still_fenced() {
    let t = table("hungclose");
    let store = builder(&t)
        .drop_timeout(Duration::from_secs(1))
        .lease_ttl(Duration::from_secs(3)) // local deadline 2 s
        .renew_interval(Duration::from_millis(500))
        .open()
        .await
        .unwrap();
    let mut blocker = admin().await;
    let (tx, hung) = common::write_waiting_for_a_row_lock(&store, &t, &mut blocker).await;
    let e = within("close", store.close()).await.unwrap_err();
    assert!(matches!(e, Error::Timeout { .. }), "{e:?}");
    assert!(lease_row(&admin().await, &t).await.2 <= 0, "released anyway");
    tokio::time::sleep(Duration::from_secs(3)).await; // Past the local deadline.
    assert!(!hung.is_finished(), "the write still waits for the row lock");
    // A successor's takeover waits for the hung write, which commits first.
    let successor = tokio::spawn(builder(&t).open());
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert!(!successor.is_finished(), "the takeover waits for the in-flight write");
    tx.commit().await.unwrap();
    within("hung write", hung).await.unwrap().unwrap();
    let successor = within("successor", successor).await.unwrap().unwrap();
    assert_eq!(successor.read("f", "s", "k").await.unwrap(), b"in-flight");
    successor.close().await.unwrap();
}

/// When renewal finds the lease lost, the store releases it at once (by owner id), so a standby
/// need not wait out the TTL, even while the handle is still alive.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn renewal_loss_releases_at_once() {
    let t = table("lossrelease");
    let store = builder(&t)
        .lease_ttl(Duration::from_secs(60))
        .local_deadline(Duration::from_secs(2))
        .renew_interval(Duration::from_millis(500))
        .open()
        .await
        .unwrap();
    let mut blocker = admin().await;
    let tx = common::lock_lease_row(&mut blocker, &t, "FOR NO KEY UPDATE").await;
    common::wait_until_lost(&store).await;
    tx.rollback().await.unwrap(); // Lets the release through (it waits at most 2 s).
    let db = admin().await;
    within("release after loss", async {
        while lease_row(&db, &t).await.2 > 0 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await;
    let next = builder(&t).open().await.expect("a standby takes over long before the TTL");
    assert_eq!(next.fencing_token(), 2);
    drop(store);
    next.close().await.unwrap();
}

/// Generic code gets `'static` futures from the trait too, not only from the inherent methods.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn trait_write_futures_are_static_for_generic_callers() {
    fn spawn_write<S: pgfence::KvStore>(
        store: &S,
        key: String,
    ) -> tokio::task::JoinHandle<pgfence::Result<()>> {
        tokio::spawn(store.write("g", "s", &key, b"v".to_vec()))
    }
    let store = builder(&table("generic")).open().await.unwrap();
    spawn_write(&store, "k".to_owned()).await.unwrap().unwrap();
    assert_eq!(store.read("g", "s", "k").await.unwrap(), b"v");
    store.close().await.unwrap();
}
