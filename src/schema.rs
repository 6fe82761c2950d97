//! The setup transaction: serialize, create or migrate the schema, take the lease; all or
//! nothing.

use std::time::Duration;

use tokio::sync::oneshot;
use tokio_postgres::IsolationLevel;
use tokio_postgres::error::SqlState;
use tokio_postgres::types::ToSql;
use uuid::Uuid;

use crate::connect::Tls;
use crate::error::{Error, Result, is_connection_error};
use crate::keys::TableName;
use crate::session::PoolMode;
use crate::sql::{self, Statements};

/// The newest schema version this library knows.
pub(crate) fn latest_version() -> i32 {
    sql::MIGRATIONS.last().map_or(0, |(version, _)| *version)
}

/// A lease just taken.
#[derive(Debug)]
pub(crate) struct Acquired {
    pub(crate) owner_id: Uuid,
    pub(crate) epoch: i64,
    /// When the acquiring statement was sent, on the deadline's clock: the local deadline
    /// counts from here, which is before the database computed the expiry.
    pub(crate) started: Duration,
    /// The NOTIFY channel of the table as this setup resolved its name, for the release.
    pub(crate) channel: String,
    /// The token this setup wrote into the crash marker ([`sql::SET_CRASH_MARKER`]).
    pub(crate) crash_token: Uuid,
}

/// Who describes itself in the lease row.
#[derive(Debug)]
pub(crate) struct Holder {
    /// Chosen by the caller, so that it can release a lease whose setup commit went unanswered.
    pub(crate) owner_id: Uuid,
    pub(crate) host: String,
    pub(crate) pid: i32,
    pub(crate) app: String,
}

/// Runs the whole setup in one transaction.
///
/// A transaction-scoped advisory lock keyed by the table serializes concurrent setups. Take 8
/// stores opening a fresh database at once. One creates the schema and wins the lease. The
/// others wait, then find the lease held.
///
/// A live lease is detected first, with a plain read that locks nothing. So a standby never
/// runs DDL or takes a lock that would stall the holder. Only the store that is about to own
/// the table migrates it. Then the schema is created or migrated and the lease taken. If
/// anything fails, the transaction rolls back, schema changes included.
///
/// `caller` is closed when the caller of `open()` is gone: its future dropped, a standby's
/// timeout, the stop of `open_until`. Then the statement running is cancelled, waiting for the
/// setup lock or at the fence, say. Nothing is committed, so an abandoned attempt never takes
/// the lease later. A commit already sent is not waited for then. It may take the lease all
/// the same ([`SetupFailed::commit_unanswered`]). The cancel request goes with `tls`. It is
/// given up after `cancel_within`: a server that stopped answering never completes one over
/// TLS.
///
/// Its statements run as `mode` says: unnamed behind a transaction pooler (see
/// `crate::session`). The transaction holds one server session there too, until it ends.
pub(crate) async fn setup_and_acquire(
    (client, mode): (&mut tokio_postgres::Client, PoolMode),
    (tls, cancel_within): (&Tls, Duration),
    caller: &mut oneshot::Receiver<()>,
    table: &TableName,
    statements: &Statements,
    ttl: Duration,
    holder: &Holder,
) -> Result<Acquired, SetupFailed> {
    let cancel = client.cancel_token();
    // Read committed whatever `default_transaction_isolation` says. Each statement must see
    // what was committed before it. Above all, it must see what a concurrent setup committed
    // while this one waited for the setup lock: the lease it took. Under repeatable read or
    // serializable the snapshot would be older than that wait. Taking the lease would then fail
    // with a serialization error instead of finding it held. That error ends a standby's wait
    // for good.
    let begin = client.build_transaction().isolation_level(IsolationLevel::ReadCommitted).start();
    let mut tx = tokio::select! {
        biased;
        _ = &mut *caller => return Err(Error::Closed.into()),
        tx = begin => tx.map_err(Error::db("begin setup"))?,
    };
    let prepared = tokio::select! {
        biased;
        _ = &mut *caller => None,
        prepared = prepare(mode, &mut tx, table, statements, ttl, holder) => Some(prepared),
    };
    let acquired = match prepared {
        None => {
            tracing::debug!(table = %table.display(), "pgfence open abandoned; cancelling setup");
            if let Err(e) = tls.cancel(&cancel, cancel_within).await {
                // The connection is closed anyway, which rolls back once the server notices;
                // nothing is committed either way.
                tracing::warn!(error = %e, "pgfence could not cancel an abandoned setup");
            }
            return Err(Error::Closed.into());
        }
        Some(Err(e)) => {
            // Not waited for once the caller is gone. A server that stopped answering right
            // after the error would hold it up for good. The connection is then closed
            // instead (see `open_here`), which rolls back as well. `caller` was pending above,
            // so polling it again is sound.
            let rolled_back = tokio::select! {
                biased;
                _ = &mut *caller => None,
                rolled_back = tx.rollback() => Some(rolled_back),
            };
            if let Some(Err(rollback)) = rolled_back {
                tracing::warn!(error = %rollback, "pgfence rollback of a failed setup failed");
            }
            return Err(e.into());
        }
        Some(Ok(acquired)) => acquired,
    };
    if caller.try_recv() != Err(oneshot::error::TryRecvError::Empty) {
        // Gone: the connection is closed (see `open_here`), which rolls back. Waiting for a
        // ROLLBACK here could wait for good. And `caller`, now complete, must not be polled.
        drop(tx);
        return Err(Error::Closed.into());
    }
    let committed = tokio::select! {
        biased;
        _ = &mut *caller => None,
        committed = tx.commit() => Some(committed),
    };
    let failed = match committed {
        Some(Ok(())) => return Ok(acquired),
        Some(Err(e)) if !is_connection_error(&e) => {
            return Err(SetupFailed {
                error: Error::db("commit setup")(e),
                commit_unanswered: false,
            });
        }
        Some(Err(e)) => {
            SetupFailed { error: Error::db("commit setup")(e), commit_unanswered: true }
        }
        None => SetupFailed { error: Error::Closed, commit_unanswered: true },
    };
    // The commit may still be running on the server, waiting for a lock or a synchronous
    // standby, say. A cancel request ends that wait; it carries the session's secret key, so it
    // can reach no other session, behind a pooler either. The caller then releases by owner id
    // (`release_unanswered_setup`), in case the commit got through.
    if let Err(e) = tls.cancel(&cancel, cancel_within).await {
        tracing::warn!(error = %e, "pgfence could not cancel an unanswered setup commit");
    }
    Err(failed)
}

/// Why [`setup_and_acquire`] failed.
#[derive(Debug)]
pub(crate) struct SetupFailed {
    pub(crate) error: Error,
    /// The commit was sent and no answer came: the connection broke, or the caller stopped
    /// waiting for it. It may have taken the lease on the server all the same.
    pub(crate) commit_unanswered: bool,
}

impl From<Error> for SetupFailed {
    fn from(error: Error) -> SetupFailed {
        SetupFailed { error, commit_unanswered: false }
    }
}

/// The setup transaction's statements up to the commit (see [`setup_and_acquire`]).
async fn prepare(
    mode: PoolMode,
    tx: &mut tokio_postgres::Transaction<'_>,
    table: &TableName,
    statements: &Statements,
    ttl: Duration,
    holder: &Holder,
) -> Result<Acquired> {
    tx.batch_execute(sql::SETUP_TIMEOUTS).await.map_err(Error::db("setup timeouts"))?;
    let (idle, types) = (sql::SETUP_IDLE_TIMEOUT, sql::SETUP_IDLE_TIMEOUT_TYPES);
    (mode.execute(tx, idle, types, &[&ttl.as_millis().to_string()]).await)
        .map_err(Error::db("setup timeouts"))?;
    let lock: [&(dyn ToSql + Sync); 3] = [&sql::SETUP_LOCK_CLASS, &table.schema, &table.name];
    (mode.execute(tx, sql::SETUP_LOCK, sql::SETUP_LOCK_TYPES, &lock).await)
        .map_err(Error::db("setup lock"))?;
    let (exists, types) = (sql::TABLE_EXISTS, sql::TABLE_EXISTS_TYPES);
    let lease_table: Option<String> =
        (mode.query_one(tx, exists, types, &[&table.quoted("_lease")]))
            .await
            .map_err(Error::db("look for the lease table"))?
            .get(0);
    if lease_table.is_some() {
        if let Some(info) = lease_info(mode, tx, statements).await?.filter(|info| info.active) {
            return Err(held(table, info));
        }
    }
    if let Some(schema) = &table.schema {
        let (exists, types) = (sql::SCHEMA_EXISTS, sql::SCHEMA_EXISTS_TYPES);
        let exists: bool = (mode.query_one(tx, exists, types, &[schema]).await)
            .map_err(Error::db("look for the schema"))?
            .get(0);
        if !exists {
            create_schema(tx, table).await?;
        }
    }
    // Looked for first, as the schema is. PostgreSQL checks CREATE on the schema before it
    // looks at IF NOT EXISTS. So a role that may only use the tables an administrator created
    // could not open the store if this ran every time.
    let (exists, types) = (sql::TABLE_EXISTS, sql::TABLE_EXISTS_TYPES);
    let version_table: Option<String> =
        (mode.query_one(tx, exists, types, &[&table.quoted("_schema_version")]))
            .await
            .map_err(Error::db("look for the version table"))?
            .get(0);
    if version_table.is_none() {
        tx.batch_execute(&statements.create_version_table.sql)
            .await
            .map_err(Error::db("create version table"))?;
    }
    let version = &statements.schema_version;
    let found: i32 = (mode.query_one(tx, &version.sql, version.types, &[]).await)
        .map_err(Error::db("read schema version"))?
        .get(0);
    if found > latest_version() {
        return Err(Error::SchemaTooNew {
            table: table.display(),
            found,
            supported: latest_version(),
        });
    }
    if found < latest_version() {
        tx.batch_execute(sql::MIGRATION_TIMEOUTS).await.map_err(Error::db("setup timeouts"))?;
        for (version, migration) in sql::MIGRATIONS.iter().filter(|(v, _)| *v > found) {
            tx.batch_execute(&sql::substitute(migration, table))
                .await
                .map_err(Error::db("migrate schema"))?;
            let record = &statements.record_version;
            (mode.execute(tx, &record.sql, record.types, &[version]).await)
                .map_err(Error::db("record schema version"))?;
            tracing::info!(table = %table.display(), version, "pgfence schema migrated");
        }
        tx.batch_execute(sql::SETUP_TIMEOUTS).await.map_err(Error::db("setup timeouts"))?;
    }

    // Resolved here, in the transaction that took the setup lock by the same rule. So the
    // release wakes every standby of this table, however it spelled the name.
    let channel =
        notify_channel(mode, tx, table).await.map_err(Error::db("resolve table schema"))?;
    let ttl_ms = ttl.as_millis() as i64;
    let acquire = &statements.acquire;
    let params: [&(dyn ToSql + Sync); 5] =
        [&holder.owner_id, &ttl_ms, &holder.host, &holder.pid, &holder.app];
    let rows = (mode.query(tx, &acquire.sql, acquire.types, &params).await)
        .map_err(Error::db("acquire lease"))?;
    let Some(row) = rows.first() else {
        // Taken in the moment since the check above (by a renewal racing an expiry, or an
        // operator): roll everything back, migrations included.
        let info = lease_info(mode, tx, statements).await?;
        return Err(match info {
            Some(info) => held(table, info),
            None => Error::LeaseHeld {
                table: table.display(),
                holder: "unknown".to_owned(),
                epoch: 0,
                expires_in: Duration::ZERO,
            },
        });
    };
    let epoch: i64 = row.get(0);
    // The acquisition may have waited at the fence for the old owner's writes. Count the TTL,
    // and the local deadline, from after that wait. Count from before this statement, though:
    // the local deadline must not come after the database's expiry.
    let started = crate::clock::clock();
    // Exactly one row (query_one fails otherwise): ours, locked by this transaction.
    let restart = &statements.restart_expiry;
    (mode.query_one(tx, &restart.sql, restart.types, &[&holder.owner_id, &ttl_ms]).await)
        .map_err(Error::db("acquire lease"))?;
    // After the lease is ours, in its transaction: before any deferred commit of this store.
    let crash_token = Uuid::new_v4();
    let marker = &statements.set_crash_marker;
    (mode.execute(tx, &marker.sql, marker.types, &[&crash_token]).await)
        .map_err(Error::db("write crash marker"))?;
    Ok(Acquired { owner_id: holder.owner_id, epoch, started, channel, crash_token })
}

/// Creates the table's missing schema.
///
/// Setups of two tables in one new schema do not wait for each other: their setup locks differ.
/// So another may create the schema first. This one's `CREATE SCHEMA` then waits for that
/// transaction. Once it commits, this one fails with a unique violation on the schema's name,
/// with the schema there as wanted. Under a savepoint, that failure is undone alone and the
/// setup goes on.
async fn create_schema(tx: &mut tokio_postgres::Transaction<'_>, table: &TableName) -> Result<()> {
    let savepoint =
        tx.savepoint("pgfence_create_schema").await.map_err(Error::db("create schema"))?;
    match savepoint.batch_execute(&sql::substitute(sql::CREATE_SCHEMA, table)).await {
        Ok(()) => savepoint.commit().await.map_err(Error::db("create schema")),
        Err(e) if e.code() == Some(&SqlState::UNIQUE_VIOLATION) => {
            tracing::debug!(table = %table.display(), "pgfence schema created concurrently");
            savepoint.rollback().await.map_err(Error::db("create schema"))
        }
        Err(source) => Err(Error::db("create schema")(source)),
    }
}

/// The NOTIFY channel of `table`, with its name resolved by `client`'s session
/// ([`sql::TABLE_SCHEMA`]). The holder that releases, the standby that listens and the
/// operator's force release each resolve it on their own connection. They meet on one channel.
pub(crate) async fn notify_channel(
    mode: PoolMode,
    client: &(impl tokio_postgres::GenericClient + Sync),
    table: &TableName,
) -> std::result::Result<String, tokio_postgres::Error> {
    let (schema, types) = (sql::TABLE_SCHEMA, sql::TABLE_SCHEMA_TYPES);
    let schema: Option<String> =
        mode.query_one(client, schema, types, &[&table.schema]).await?.get(0);
    Ok(sql::notify_channel(table, schema.as_deref()))
}

/// The current holder of the lease, as seen by operators and by `LeaseHeld`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseInfo {
    /// The holder's owner id now: each is one store's alone. A store changes it, keeping its
    /// epoch, to fence off a write of its own whose connection broke.
    pub owner_id: Uuid,
    /// The holder's fencing token.
    pub epoch: i64,
    /// Host, process id and application name, as `app pid@host`.
    pub holder: String,
    /// Time left by the database clock; zero when expired or released.
    pub expires_in: Duration,
    /// Whether the lease is currently valid.
    pub active: bool,
}

/// Reads the lease row; `None` if the lease was never taken.
pub(crate) async fn lease_info(
    mode: PoolMode,
    client: &(impl tokio_postgres::GenericClient + Sync),
    statements: &Statements,
) -> Result<Option<LeaseInfo>> {
    let holder = &statements.holder;
    let rows = (mode.query(client, &holder.sql, holder.types, &[]).await)
        .map_err(Error::db("read lease"))?;
    Ok(rows.first().map(|row| {
        let host: String = row.get("holder_host");
        let pid: i32 = row.get("holder_pid");
        let app: String = row.get("holder_app");
        let expires_in_ms: i64 = row.get("expires_in_ms");
        LeaseInfo {
            owner_id: row.get("owner_id"),
            epoch: row.get("epoch"),
            holder: format!("{app} {pid}@{host}"),
            expires_in: Duration::from_millis(expires_in_ms.max(0) as u64),
            active: row.get("active"),
        }
    }))
}

fn held(table: &TableName, info: LeaseInfo) -> Error {
    Error::LeaseHeld {
        table: table.display(),
        holder: info.holder,
        epoch: info.epoch,
        expires_in: info.expires_in,
    }
}

/// Creates the database named in `config` when it does not exist (connecting to the
/// `postgres` database with the same credentials and TLS). A concurrent creation is not an
/// error. Making that connection (its startup and, in `mode`, its read-committed `SET`) is
/// given up after `connect_timeout`, as the pool's are. The `CREATE DATABASE` itself is not timed: it may
/// legitimately take long, for a template copy or a checkpoint. So a server that stops
/// answering right then holds up a plain `open()` until it answers. The caller's stop ends
/// that wait.
pub(crate) async fn create_database(
    config: &tokio_postgres::Config,
    tls: &Tls,
    connect_timeout: Duration,
    mode: PoolMode,
) -> Result<()> {
    let name = config.get_dbname().or(config.get_user()).unwrap_or("postgres").to_owned();
    let mut admin = config.clone();
    admin.dbname("postgres");
    let operation = "connect to create database";
    let connecting = tls.connect_in(mode, &admin, "create database", None);
    let (client, connection) = match tokio::time::timeout(connect_timeout, connecting).await {
        Ok(connected) => {
            connected.map_err(|e| Error::connect(operation, &crate::connect::servers(&admin), e))?
        }
        Err(_) => return Err(Error::Timeout { operation, after: connect_timeout }),
    };
    // Database names cannot be bind parameters; quote the identifier (doubling quotes).
    let quoted = format!("\"{}\"", name.replace('"', "\"\""));
    // Aborted if this future is dropped while the statement waits (the caller of `open()`
    // gone). Nothing of the opening is left running on the runtime then.
    let connection = crate::connect::AbortOnDrop(Some(connection));
    let result = client.batch_execute(&format!("CREATE DATABASE {quoted}")).await;
    drop(client);
    let _ = connection.detach().await; // Ends once the client is gone.
    match result {
        Ok(()) => {
            tracing::info!(database = %name, "pgfence created the database");
            Ok(())
        }
        // Concurrent creations: the loser sees either the duplicate or the catalog's unique
        // index, depending on timing. Either way the database now exists.
        Err(e)
            if e.code() == Some(&SqlState::DUPLICATE_DATABASE)
                || e.code() == Some(&SqlState::UNIQUE_VIOLATION) =>
        {
            Ok(())
        }
        Err(source) => Err(Error::db("create database")(source)),
    }
}
