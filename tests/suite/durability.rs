//! What `Ok` of a write, a remove or a batch promises, whatever the session says: committed with
//! at least `synchronous_commit = on`, at read committed. A role's defaults, a session's
//! startup options, an application's pool and a transaction pooler's other clients may each
//! say otherwise (`synchronous_commit = off`, `default_transaction_isolation = serializable`);
//! none of them may weaken it. A stronger `remote_apply` is kept.
//!
//! A deferred constraint trigger on the store's table records, at each commit, the settings
//! that commit obeys: it fires in the commit itself, after every statement of the transaction.
//! It records too the statement the client sent that made the change: the fenced function's
//! call (migration 6) or a fenced statement. A second trigger, not deferred, passes that on in
//! a setting of the transaction: at the commit that ends an unnamed statement,
//! `current_query()` is no longer set.

use crate::common;

use std::time::Duration;

use common::{admin, server, table};
use pgfence::{PgKvStore, PoolMode};
use pgfence_testing::PgBouncer;

/// Records `synchronous_commit`, `transaction_isolation` and the client's statement at the
/// commit of every change to `t`, into `<t>_commits` (in the test server's database).
async fn record_commit_settings(t: &str) {
    record_commit_settings_in(&admin().await, t).await
}

/// [`record_commit_settings`] in the database of `db`.
async fn record_commit_settings_in(db: &tokio_postgres::Client, t: &str) {
    db.batch_execute(&format!(
        "CREATE TABLE \"{t}_commits\" (op TEXT, sync TEXT, isolation TEXT, query TEXT);
             GRANT INSERT ON \"{t}_commits\" TO PUBLIC;
             CREATE FUNCTION \"{t}_record\"() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN
                 INSERT INTO \"{t}_commits\" VALUES (TG_OP,
                     current_setting('synchronous_commit'),
                     current_setting('transaction_isolation'),
                     current_setting('pgfence_test.query', true));
                 RETURN NULL;
             END $$;
             CREATE FUNCTION \"{t}_sent\"() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN
                 PERFORM set_config('pgfence_test.query', current_query(), true);
                 RETURN NULL;
             END $$;
             CREATE TRIGGER sent AFTER INSERT OR UPDATE OR DELETE ON \"{t}\"
                 FOR EACH ROW EXECUTE FUNCTION \"{t}_sent\"();
             CREATE CONSTRAINT TRIGGER record AFTER INSERT OR UPDATE OR DELETE ON \"{t}\"
                 DEFERRABLE INITIALLY DEFERRED
                 FOR EACH ROW EXECUTE FUNCTION \"{t}_record\"();"
    ))
    .await
    .unwrap();
}

/// Every commit recorded on `t` in the database of `db`: (operation, synchronous_commit,
/// isolation).
async fn commits(db: &tokio_postgres::Client, t: &str) -> Vec<(String, String, String)> {
    let sql = format!("SELECT op, sync, isolation FROM \"{t}_commits\"");
    let rows = db.query(&sql, &[]).await.unwrap();
    rows.iter().map(|r| (r.get(0), r.get(1), r.get(2))).collect()
}

/// The operations of the commits recorded on `t` that a fenced function made (see the module's
/// doc), and the number of every commit recorded.
async fn function_commits(t: &str) -> (Vec<String>, i64) {
    let sql = format!(
        "SELECT coalesce(array_agg(op) FILTER (WHERE query LIKE '%\\_fenced\\_%'), '{{}}'),
                count(*)
           FROM \"{t}_commits\""
    );
    let row = admin().await.query_one(&sql, &[]).await.unwrap();
    (row.get(0), row.get(1))
}

/// Forgets the commits recorded on `t` so far.
async fn forget_commits(t: &str) {
    admin().await.batch_execute(&format!("TRUNCATE \"{t}_commits\"")).await.unwrap();
}

/// [`check_every_mutation_commits`], and whether the single writes and the remove committed
/// through their fenced functions (`true`) or none did (`false`).
async fn check_commits_through_functions(store: &PgKvStore, t: &str, sync: &str, called: bool) {
    forget_commits(t).await;
    check_every_mutation_commits(&admin().await, store, t, sync).await;
    let (mut ops, all) = function_commits(t).await;
    ops.sort();
    ops.dedup();
    let expected: &[&str] = if called { &["DELETE", "INSERT", "UPDATE"] } else { &[] };
    assert_eq!(ops, expected, "commits through a function, of {all}");
    assert!(all > 0);
}

/// A write, an overwrite, a coalesced pair, a batch and a remove on `store`: each returns
/// `Ok`, and each commit on `t` (in the database of `db`) obeyed `sync` at read committed.
async fn check_every_mutation_commits(
    db: &tokio_postgres::Client,
    store: &PgKvStore,
    t: &str,
    sync: &str,
) {
    store.write("d", "s", "a", b"1".to_vec()).await.unwrap();
    store.write("d", "s", "a", b"2".to_vec()).await.unwrap();
    let (x, y) = tokio::join!(
        store.write("d", "s", "x", b"x".to_vec()),
        store.write("d", "s", "y", b"y".to_vec())
    );
    x.unwrap();
    y.unwrap();
    store.batch().put("d", "s", "b", b"b".to_vec()).remove("d", "s", "x").commit().await.unwrap();
    store.remove("d", "s", "a", false).await.unwrap();
    let commits = commits(db, t).await;
    let ops: Vec<&str> = commits.iter().map(|(op, _, _)| op.as_str()).collect();
    for op in ["INSERT", "UPDATE", "DELETE"] {
        assert!(ops.contains(&op), "a commit of each kind was recorded: {commits:?}");
    }
    for (op, recorded_sync, isolation) in &commits {
        assert_eq!(recorded_sync, sync, "{op}: {commits:?}");
        assert_eq!(isolation, "read committed", "{op}: {commits:?}");
    }
}

/// A store whose role's defaults and whose session's startup options ask for asynchronous
/// commits at serializable: its changes commit durably, at read committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ok_is_durable_whatever_the_role_and_the_session_set() {
    let t = table("durrole");
    let role = t.clone();
    let admin = admin().await;
    admin
        .batch_execute(&format!(
            "CREATE ROLE \"{role}\" LOGIN SUPERUSER PASSWORD 'durable';
             ALTER ROLE \"{role}\" SET synchronous_commit = off;
             ALTER ROLE \"{role}\" SET default_transaction_isolation = serializable;"
        ))
        .await
        .unwrap();
    for (options, sync) in [
        ("", "on"),
        ("-c synchronous_commit=local -c default_transaction_isolation=repeatable\\ read", "on"),
        // Stronger than `on`: kept (without a synchronous standby, it waits for no one).
        ("-c synchronous_commit=remote_apply", "remote_apply"),
    ] {
        let t = table("durrole");
        let mut config = server().config();
        config.user(&role).password("durable");
        let base = config.get_options().unwrap_or_default().to_owned();
        config.options(format!("{base} {options}"));
        let store = PgKvStore::builder_from_config(config)
            .table(&t)
            .pool_size(2)
            .lease_ttl(Duration::from_secs(30))
            .open()
            .await
            .unwrap();
        record_commit_settings(&t).await;
        check_every_mutation_commits(&admin, &store, &t, sync).await;
        store.close().await.unwrap();
    }
    admin
        .batch_execute(&format!(
            "REASSIGN OWNED BY \"{role}\" TO CURRENT_USER; DROP ROLE \"{role}\";"
        ))
        .await
        .unwrap();
}

/// A store in a database whose defaults ask for asynchronous commits at serializable
/// (`ALTER DATABASE .. SET`): its changes commit durably, at read committed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ok_is_durable_whatever_the_database_set() {
    let (config, db) = common::own_database("durdb").await;
    let name = config.get_dbname().unwrap().to_owned();
    db.batch_execute(&format!(
        "ALTER DATABASE \"{name}\" SET synchronous_commit = off;
         ALTER DATABASE \"{name}\" SET default_transaction_isolation = serializable;"
    ))
    .await
    .unwrap();
    let t = table("durdb");
    let store = PgKvStore::builder_from_config(config.clone())
        .table(&t)
        .pool_size(2)
        .lease_ttl(Duration::from_secs(30))
        .open()
        .await
        .unwrap();
    // A new session of that database has the defaults the store overrides.
    let (probe, connection) = config.connect(tokio_postgres::NoTls).await.unwrap();
    let connection = tokio::spawn(connection);
    let row = probe.query_one("SHOW synchronous_commit", &[]).await.unwrap();
    assert_eq!(row.get::<_, String>(0), "off");
    record_commit_settings_in(&db, &t).await;
    check_every_mutation_commits(&db, &store, &t, "on").await;
    store.close().await.unwrap();
    drop(probe);
    connection.await.unwrap().unwrap();
}

/// A store on an application's pool, whose connections default to asynchronous commits, at
/// serializable or not: its changes commit durably, at read committed. A stronger
/// `remote_apply` is kept. Its single writes and removes commit through their fenced functions,
/// but not at serializable: the function refuses to run there, and the store runs the
/// statement in a transaction of its own at read committed instead.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ok_is_durable_on_a_pool_passed_in_whatever_its_sessions_set() {
    use pgfence::deadpool_postgres::{Manager, Pool};
    for (options, sync, called) in [
        ("-c synchronous_commit=off -c default_transaction_isolation=serializable", "on", false),
        ("-c synchronous_commit=off", "on", true),
        ("-c synchronous_commit=remote_apply", "remote_apply", true),
    ] {
        let t = table("durpool");
        let mut config = server().config();
        let base = config.get_options().unwrap_or_default().to_owned();
        config.options(format!("{base} {options}"));
        let manager = Manager::new(config, pgfence::tokio_postgres::NoTls);
        let pool = Pool::builder(manager).max_size(2).build().unwrap();
        let store = PgKvStore::builder_from_pool(pool)
            .table(&t)
            .lease_ttl(Duration::from_secs(30))
            .open()
            .await
            .unwrap();
        record_commit_settings(&t).await;
        check_commits_through_functions(&store, &t, sync, called).await;
        store.close().await.unwrap();
    }
}

/// A PgBouncer in transaction mode with one server session in front of the test server, its
/// connection configuration, and a store of table `t` through it with `pool_size` connections.
pub(crate) async fn behind_one_server_session(
    t: &str,
    pool_size: usize,
) -> (PgBouncer, pgfence::tokio_postgres::Config, PgKvStore) {
    let server = server();
    let addr = server.tcp_addr().unwrap();
    let bouncer = PgBouncer::start_sized(addr, pgfence_testing::PoolMode::Transaction, 1).unwrap();
    let config = bouncer.config_via(&server.config());
    let store = PgKvStore::builder_from_config(config.clone())
        .table(t)
        .pool_mode(PoolMode::Transaction)
        .pool_size(pool_size)
        .lease_ttl(Duration::from_secs(30))
        .open()
        .await
        .unwrap();
    (bouncer, config, store)
}

/// Behind a transaction pooler with one server session, another client sets that session to
/// asynchronous commits, then to serializable too, after the store opened. The store's
/// changes, on that same server session, still commit durably at read committed. Its single
/// writes and removes commit through their fenced functions at first. At serializable none
/// does: the function refuses to run, and the store runs the statement in a transaction of its
/// own at read committed instead. Back at read committed, the store soon calls them again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ok_is_durable_whatever_a_transaction_poolers_other_client_set() {
    let t = table("durbounce");
    let (_bouncer, config, store) = behind_one_server_session(&t, 2).await;
    record_commit_settings(&t).await;
    let (neighbour, connection) = config.connect(pgfence::tokio_postgres::NoTls).await.unwrap();
    let connection = tokio::spawn(connection);
    neighbour.batch_execute("SET synchronous_commit = off").await.unwrap();
    // The one server session now has the neighbour's settings.
    let row = neighbour.query_one("SHOW synchronous_commit", &[]).await.unwrap();
    assert_eq!(row.get::<_, String>(0), "off");
    check_commits_through_functions(&store, &t, "on", true).await;
    neighbour.batch_execute("SET default_transaction_isolation = serializable").await.unwrap();
    let row = neighbour.query_one("SHOW default_transaction_isolation", &[]).await.unwrap();
    assert_eq!(row.get::<_, String>(0), "serializable");
    check_commits_through_functions(&store, &t, "on", false).await;
    // Back at read committed: after at most 64 more writes in their own transactions, the
    // store calls the functions again.
    neighbour.batch_execute("SET default_transaction_isolation = 'read committed'").await.unwrap();
    for i in 0..64 {
        store.write("d", "s", "again", vec![i]).await.unwrap();
    }
    check_commits_through_functions(&store, &t, "on", true).await;
    store.close().await.unwrap();
    drop(neighbour);
    connection.await.unwrap().unwrap();
}

/// The fence's change of owner id and the release write the lease row outside a fenced
/// mutation, and pin their commits the same way. Behind a transaction pooler with one server
/// session, another client sets that session to asynchronous commits at serializable. A write's
/// connection then breaks after its commit, unanswered: the store changes its owner id to fence
/// it off, retries it, and is closed, which releases the lease. Each of those commits on the
/// lease row, renewals included, is durable at read committed. (Before they were pinned, the
/// change and the release committed with the neighbour's `off` at serializable.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fence_and_release_commit_durably_whatever_a_transaction_poolers_other_client_set() {
    let t = table("durfence");
    let server = server();
    let bouncer = PgBouncer::start_sized(
        server.tcp_addr().unwrap(),
        pgfence_testing::PoolMode::Transaction,
        1,
    )
    .unwrap();
    let proxy = pgfence_testing::Proxy::start(bouncer.addr()).await.unwrap();
    let store = PgKvStore::builder_from_config(server.config_via(proxy.addr()))
        .table(&t)
        .pool_mode(PoolMode::Transaction)
        .pool_size(2)
        .lease_ttl(Duration::from_secs(30))
        .open()
        .await
        .unwrap();
    let owner = store.owner_id();
    let lease = format!("{t}_lease");
    record_commit_settings(&lease).await;
    let (neighbour, connection) =
        bouncer.config_via(&server.config()).connect(pgfence::tokio_postgres::NoTls).await.unwrap();
    let connection = tokio::spawn(connection);
    neighbour
        .batch_execute(
            "SET synchronous_commit = off; SET default_transaction_isolation = serializable",
        )
        .await
        .unwrap();
    let row = neighbour.query_one("SHOW default_transaction_isolation", &[]).await.unwrap();
    assert_eq!(row.get::<_, String>(0), "serializable", "the one server session is shared");
    // The function refuses to run at serializable; from now on the store's writes run in a
    // pipelined transaction of their own: `INSERT INTO` the table, which the gate below holds.
    store.write("r", "s", "k", b"first".to_vec()).await.unwrap();

    let (gate, write) =
        crate::interleavings::write_committed_unanswered(&proxy, &store, &t, "k", b"v1").await;
    assert!(gate.cut());
    crate::interleavings::wait_for_owner_change(&t, owner).await;
    common::within("the broken write", write).await.unwrap().expect("retried after the fence");
    store.close().await.unwrap();

    let (_, _, expires_in) = common::lease_row(&admin().await, &t).await;
    assert!(expires_in <= 0, "released: {expires_in} ms left");
    let commits = commits(&admin().await, &lease).await;
    let updates = commits.iter().filter(|(op, _, _)| op == "UPDATE").count();
    assert!(updates >= 2, "the change of owner id and the release: {commits:?}");
    for (op, sync, isolation) in &commits {
        assert_eq!(
            (sync.as_str(), isolation.as_str()),
            ("on", "read committed"),
            "{op}: {commits:?}"
        );
    }
    drop(neighbour);
    connection.await.unwrap().unwrap();
}
