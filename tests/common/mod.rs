//! Helpers shared by the integration tests: the server, store builders and SQL probes.
#![allow(dead_code, unreachable_pub)] // Each test binary uses a different subset.

pub mod conformance;
pub mod errors;

use std::time::Duration;

use pgfence::{Builder, PgKvStore};
use pgfence_testing::{TestServer, unique_name};

/// The shared test server (DATABASE_URL or a private cluster). Fails the test loudly if none.
pub fn server() -> &'static TestServer {
    TestServer::shared()
        .expect("a PostgreSQL server for the tests (DATABASE_URL or local binaries)")
}

/// The name libtest gives test `name` of the module whose `module_path!()` is `module`: the path
/// without the crate's name. For `--exact` in a child process that runs one test of this binary.
pub fn test_path(module: &str, name: &str) -> String {
    match module.split_once("::") {
        Some((_crate, path)) => format!("{path}::{name}"),
        None => name.to_owned(),
    }
}

/// A fresh table name for one test.
pub fn table(prefix: &str) -> String {
    unique_name(prefix)
}

/// A builder on the shared server with test-friendly settings: small pool, and lease timings in
/// seconds so scheduling noise on a busy 2-core machine cannot expire a lease a test expects to
/// hold.
pub fn builder(table: &str) -> Builder {
    PgKvStore::builder_from_config(server().config())
        .table(table)
        .pool_size(4)
        .lease_ttl(Duration::from_secs(15))
        .renew_interval(Duration::from_secs(3))
}

pub async fn open(table: &str) -> PgKvStore {
    builder(table).open().await.expect("open store")
}

/// The server's version as a number (`server_version_num`: 130023 for 13.23, 180004 for 18.4),
/// for the checks whose SQL or expected messages differ between PostgreSQL versions.
pub async fn server_version_num(client: &tokio_postgres::Client) -> i32 {
    client
        .query_one("SELECT current_setting('server_version_num')::int4", &[])
        .await
        .expect("server_version_num")
        .get(0)
}

/// An administrator connection for probing and tampering with the tables directly.
pub async fn admin() -> tokio_postgres::Client {
    server().connect().await.expect("admin connection")
}

/// The two columns of every row `sql` returns on `client`, collected (into a `Vec` of pairs, a
/// map, ...).
pub async fn pairs<A, B, C>(
    client: &tokio_postgres::Client,
    sql: &str,
    params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
) -> C
where
    A: for<'r> tokio_postgres::types::FromSql<'r>,
    B: for<'r> tokio_postgres::types::FromSql<'r>,
    C: FromIterator<(A, B)>,
{
    client.query(sql, params).await.unwrap().iter().map(|row| (row.get(0), row.get(1))).collect()
}

/// Whether the (unqualified) table `name` exists, as `client` sees it.
pub async fn table_exists(client: &tokio_postgres::Client, name: &str) -> bool {
    let found: Option<String> = client
        .query_one("SELECT to_regclass($1)::text", &[&format!("\"{name}\"")])
        .await
        .unwrap()
        .get(0);
    found.is_some()
}

/// The quoted lease table of `table` (unqualified names only).
pub fn lease_table(table: &str) -> String {
    format!("\"{table}_lease\"")
}

/// `(owner_id, epoch, expires_at - now() in ms)` of the lease row.
pub async fn lease_row(client: &tokio_postgres::Client, table: &str) -> (uuid::Uuid, i64, i64) {
    let row = client
        .query_one(
            &format!(
                "SELECT owner_id, epoch, (extract(epoch FROM expires_at - clock_timestamp()) * 1000)::bigint FROM {}",
                lease_table(table)
            ),
            &[],
        )
        .await
        .expect("lease row");
    (row.get(0), row.get(1), row.get(2))
}

/// Takes the lease from outside, as another owner would after an expiry: expire it, then
/// acquire with a new owner id and epoch + 1. Returns the new epoch.
pub async fn steal_lease(client: &tokio_postgres::Client, table: &str) -> i64 {
    let row = client
        .query_one(
            &format!(
                "UPDATE {} SET owner_id = gen_random_uuid(), epoch = epoch + 1,
                        expires_at = clock_timestamp() + interval '1 hour'
                  WHERE id = 1 RETURNING epoch",
                lease_table(table)
            ),
            &[],
        )
        .await
        .expect("steal lease");
    row.get(0)
}

/// Generous bound against hangs; never a measurement.
pub const HANG_GUARD: Duration = Duration::from_secs(60);

/// Awaits `fut`, failing the test if it takes longer than [`HANG_GUARD`].
pub async fn within<F: std::future::Future>(what: &str, fut: F) -> F::Output {
    tokio::time::timeout(HANG_GUARD, fut).await.unwrap_or_else(|_| panic!("{what} hung"))
}

/// Begins a transaction on `client` that holds the lease row of `table` with the row lock
/// `mode` (`FOR UPDATE`, `FOR NO KEY UPDATE`, `FOR KEY SHARE`), to block exactly what that mode
/// conflicts with. Roll it back or commit it to let go.
pub async fn lock_lease_row<'a>(
    client: &'a mut tokio_postgres::Client,
    table: &str,
    mode: &str,
) -> tokio_postgres::Transaction<'a> {
    let sql = format!("SELECT 1 FROM {} WHERE id = 1 {mode}", lease_table(table));
    lock_row(client, &sql, &[]).await
}

/// A table whose lease is free, and a transaction on `client` that holds its lease row `FOR
/// KEY SHARE`, as an old holder's write in flight does: every `open()` waits at the fence until
/// the transaction ends.
pub async fn fence_closed<'a>(
    client: &'a mut tokio_postgres::Client,
    table: &str,
) -> tokio_postgres::Transaction<'a> {
    open(table).await.close().await.unwrap();
    lock_lease_row(client, table, "FOR KEY SHARE").await
}

/// How many server sessions a store configured with `application_name(app)` has.
pub async fn sessions_of(app: &str) -> i64 {
    let sql = "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1";
    admin().await.query_one(sql, &[&format!("pgfence {app}")]).await.unwrap().get(0)
}

/// Waits until a session of a store configured with `application_name(app)` waits on a lock.
pub async fn wait_for_app_lock_wait(app: &str) {
    let sql = "SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock'
                AND application_name = $1";
    wait_for_row("lock wait", sql, &[&format!("pgfence {app}")]).await
}

/// Waits until no session of a store configured with `application_name(app)` is left.
pub async fn wait_until_no_sessions(app: &str) {
    within(&format!("the sessions of {app} gone"), async {
        while sessions_of(app).await > 0 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
}

/// The class key of the store's setup lock (`sql::SETUP_LOCK_CLASS`, "pgfe").
pub const SETUP_LOCK_CLASS: i32 = 0x7067_6665;

/// Begins a transaction on `client` that holds the setup lock of the unqualified table `table`
/// (resolved in `public`, as the store's `sql::SETUP_LOCK` resolves it), as a concurrent
/// `open()` of it does: every `open()` of the table waits for it until the transaction ends.
pub async fn hold_setup_lock<'a>(
    client: &'a mut tokio_postgres::Client,
    table: &str,
) -> tokio_postgres::Transaction<'a> {
    let sql = "SELECT pg_advisory_xact_lock($1, hashtext('public.' || $2))";
    lock_row(client, sql, &[&SETUP_LOCK_CLASS, &table]).await
}

/// Begins a transaction on `client` that holds the row of `key` in `table` `FOR UPDATE`, so
/// that a write of that key blocks inside its statement, after its lease check. Roll it back
/// or commit it to let go.
pub async fn lock_key_row<'a>(
    client: &'a mut tokio_postgres::Client,
    table: &str,
    key: &str,
) -> tokio_postgres::Transaction<'a> {
    let sql = format!("SELECT 1 FROM \"{table}\" WHERE key = $1 FOR UPDATE");
    lock_row(client, &sql, &[&key]).await
}

/// Runs `sql` (which takes a lock and returns one row) in a transaction that it leaves open.
async fn lock_row<'a>(
    client: &'a mut tokio_postgres::Client,
    sql: &str,
    params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
) -> tokio_postgres::Transaction<'a> {
    let tx = client.transaction().await.unwrap();
    tx.query_one(sql, params).await.unwrap();
    tx
}

/// A write in flight: the write of key `f/s/k` (whose value was `old`) to `in-flight` waits,
/// inside its statement and after its lease check, for the row lock of the returned
/// transaction, holding its FOR KEY SHARE lock on the lease row, so a takeover must wait for it
/// (the fence). Commit or roll the transaction back to let the write go on.
pub async fn write_waiting_for_a_row_lock<'a>(
    store: &PgKvStore,
    table: &str,
    blocker: &'a mut tokio_postgres::Client,
) -> (tokio_postgres::Transaction<'a>, tokio::task::JoinHandle<pgfence::Result<()>>) {
    store.write("f", "s", "k", b"old".to_vec()).await.unwrap();
    let tx = lock_key_row(blocker, table, "k").await;
    let write = tokio::spawn(store.write("f", "s", "k", b"in-flight".to_vec()));
    wait_for_query_lock_wait(&format!("%INSERT INTO \"{table}\"%")).await;
    (tx, write)
}

/// [`write_waiting_for_a_row_lock`], and then `store`'s lease expires while the write waits.
pub async fn write_in_flight_on_an_expired_lease<'a>(
    store: &PgKvStore,
    table: &str,
    blocker: &'a mut tokio_postgres::Client,
) -> (tokio_postgres::Transaction<'a>, tokio::task::JoinHandle<pgfence::Result<()>>) {
    let (tx, write) = write_waiting_for_a_row_lock(store, table, blocker).await;
    // An UPDATE of expires_at only: it does not wait for the writer.
    let expire =
        format!("UPDATE {} SET expires_at = clock_timestamp() WHERE id = 1", lease_table(table));
    admin().await.execute(&expire, &[]).await.unwrap();
    (tx, write)
}

/// Polls `sql` until it returns a row (asks the server; never a timing guess), failing the test
/// after [`HANG_GUARD`].
pub async fn wait_for_row(
    what: &str,
    sql: &str,
    params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
) {
    let db = admin().await;
    within(what, async {
        while db.query(sql, params).await.unwrap().is_empty() {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
}

/// Waits until some backend running a query matching `pattern` (SQL LIKE) waits on a lock.
pub async fn wait_for_query_lock_wait(pattern: &str) {
    let sql = "SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock' AND query LIKE $1";
    wait_for_row("lock wait", sql, &[&pattern]).await
}

/// Waits (bounded by [`HANG_GUARD`]) until the store reports its lease lost.
pub async fn wait_until_lost(store: &PgKvStore) {
    let mut state = store.lease_state();
    within("lease loss", state.wait_for(|s| matches!(s, pgfence::LeaseState::Lost { .. })))
        .await
        .unwrap();
}

/// The fenced mutations, one per fenced statement text (`sql::WRITE`, `REMOVE`, `BATCH_PUT`,
/// which coalesced writes share too, and `BATCH`): a fencing property holds for the store only
/// if it holds for each of them.
#[derive(Debug, Clone, Copy)]
pub enum Fenced {
    Write,
    Remove,
    PutBatch,
    MixedBatch,
}

impl Fenced {
    pub const ALL: [Fenced; 4] =
        [Fenced::Write, Fenced::Remove, Fenced::PutBatch, Fenced::MixedBatch];

    /// Writes `k` (and `k2`) and removes `gone`, in namespace `("s", "s")`, as this kind of
    /// mutation does.
    pub fn run(
        self,
        store: &PgKvStore,
    ) -> std::pin::Pin<Box<dyn std::future::Future<Output = pgfence::Result<()>> + Send>> {
        match self {
            Fenced::Write => Box::pin(store.write("s", "s", "k", b"late".to_vec())),
            Fenced::Remove => Box::pin(store.remove("s", "s", "gone", false)),
            Fenced::PutBatch => Box::pin(
                store
                    .batch()
                    .put("s", "s", "k", b"late".to_vec())
                    .put("s", "s", "k2", vec![])
                    .commit(),
            ),
            Fenced::MixedBatch => Box::pin(
                store
                    .batch()
                    .put("s", "s", "k", b"late".to_vec())
                    .remove("s", "s", "gone")
                    .commit(),
            ),
        }
    }
}

/// Every `(key, value)` of `table`, sorted by key, read by an administrator connection.
pub async fn all_rows(table: &str) -> Vec<(String, Vec<u8>)> {
    admin()
        .await
        .query(&format!("SELECT key, value FROM \"{table}\" ORDER BY key"), &[])
        .await
        .expect("read rows")
        .iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect()
}

/// Makes the database refuse every insert or update of the key `key` in `table` (a trigger
/// raises "`key` refused"): a database error that belongs to that key's write only.
pub async fn refuse_key(table: &str, key: &str) {
    admin()
        .await
        .batch_execute(&format!(
            "CREATE FUNCTION \"{table}_refuse\"() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN
                 IF NEW.key = '{key}' THEN RAISE EXCEPTION '{key} refused'; END IF;
                 RETURN NEW;
             END $$;
             CREATE TRIGGER refuse BEFORE INSERT OR UPDATE ON \"{table}\"
                 FOR EACH ROW EXECUTE FUNCTION \"{table}_refuse\"();"
        ))
        .await
        .expect("create the refusing trigger")
}

/// A fresh database owned by a fresh login role that is not a superuser (privileges apply to
/// it): that role's configuration for the database, and a superuser connection to it.
pub async fn own_database(prefix: &str) -> (tokio_postgres::Config, tokio_postgres::Client) {
    let (role, db) = (table(&format!("{prefix}_role")), table(&format!("{prefix}_db")));
    admin().await.batch_execute(&format!("CREATE ROLE {role} LOGIN")).await.unwrap();
    let superuser = server().create_database(&db).await.expect("create database");
    let (client, connection) =
        superuser.connect(tokio_postgres::NoTls).await.expect("connect to the new database");
    tokio::spawn(connection);
    client.batch_execute(&format!("ALTER DATABASE {db} OWNER TO {role}")).await.unwrap();
    let mut config = superuser;
    config.user(&role);
    (config, client)
}

/// Revokes EXECUTE on `pg_terminate_backend` from PUBLIC in the database of `superuser` (as a
/// hardened database may): its roles that are not superusers can no longer end sessions. The
/// function is `(integer, bigint)` (pid, timeout) since PostgreSQL 14 and `(integer)` before.
pub async fn revoke_terminate(superuser: &tokio_postgres::Client) {
    let signature =
        if server_version_num(superuser).await >= 14_00_00 { "integer, bigint" } else { "integer" };
    superuser
        .batch_execute(&format!(
            "REVOKE EXECUTE ON FUNCTION pg_terminate_backend({signature}) FROM PUBLIC"
        ))
        .await
        .unwrap();
}

/// A fresh directory under the system's temporary one, removed with everything in it when
/// dropped, also when the test panics.
pub struct TempDir(pub std::path::PathBuf);

impl TempDir {
    pub fn new(prefix: &str) -> TempDir {
        let path = std::env::temp_dir().join(unique_name(prefix));
        std::fs::create_dir_all(&path).expect("create a temporary directory");
        TempDir(path)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
