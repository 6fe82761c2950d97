//! The open sequence: connect, set up the schema and take the lease in one transaction, start
//! renewal, and assemble the store. [`Builder::open`] and [`Builder::open_until`] document it.

use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use deadpool_postgres::PoolError;
use tokio::sync::{RwLock, oneshot};
use tokio_postgres::error::SqlState;
use tokio_postgres::types::ToSql;
use tracing::Instrument;
use uuid::Uuid;

use super::PgKvStore;
use super::builder::{Builder, Source};
use crate::connect;
use crate::error::{Error, Result};
use crate::exec::{Checkout, Executor, detached, discard};
use crate::keys::TableName;
use crate::lease::{Connector, Keeper, KeeperConfig, Lease};
use crate::schema::{self, Holder, SetupFailed};
use crate::sql::{self, Statements};
use crate::write::Writes;

/// The target of this module's log events: stable, whatever the module's path (see
/// docs/design.md, "Logging").
const LOG: &str = "pgfence::open";

/// [`Builder::open`]: the store, or [`Error::Closed`] if the opening was given up.
pub(crate) async fn open(builder: Builder) -> Result<PgKvStore> {
    open_until(builder, std::future::pending()).await?.ok_or(Error::Closed)
}

pub(crate) async fn open_until(
    builder: Builder,
    stop: impl Future<Output = ()>,
) -> Result<Option<PgKvStore>> {
    attempt(builder, Reuse::default(), stop).await
}

/// What a standby keeps from one attempt to open the store to the next, so that each attempt
/// after the first is quicker. A graceful handoff waits for one attempt.
#[derive(Debug, Clone, Default)]
pub(crate) struct Reuse {
    /// The pool of the attempts, with a connection left idle in it by the last one; the store
    /// takes it over. `None`: each attempt builds its own, as `open()` does.
    pub(crate) pool: Option<connect::Pool>,
    /// Set once an attempt found no transaction pooler on the way in session mode (and read
    /// committed isolation, for a pool passed in or in transaction mode). Later attempts reach the same servers through the same
    /// configuration, so they skip the checks: two more round trips and a connection each.
    pub(crate) checked: Arc<AtomicBool>,
}

/// [`open_until`], reusing what earlier attempts left in `reuse`.
pub(crate) async fn attempt(
    builder: Builder,
    reuse: Reuse,
    stop: impl Future<Output = ()>,
) -> Result<Option<PgKvStore>> {
    let table = builder.validate()?;
    // For the `GRANT` of a permission error; unknown for a pool passed in.
    let role = builder.connection_config().and_then(|c| c.get_user().map(str::to_owned));
    // Dropped when the caller gives up: tells the task that nobody waits for the store.
    let (caller, gone) = oneshot::channel::<()>();
    let opening = open_here(builder, table, reuse, gone).instrument(tracing::Span::current());
    let opening = detached(opening, || Error::Closed);
    tokio::pin!(opening);
    tokio::select! {
        biased;
        opened = &mut opening => opened.map(Some).map_err(|e| e.for_role(role.as_deref())),
        () = stop => {
            drop(caller);
            match opening.await {
                Ok(store) => {
                    if let Err(e) = store.close().await {
                        tracing::warn!(
                            target: LOG,
                            error = %e, "pgfence open stopped after its commit; \
                            releasing failed");
                    }
                }
                Err(e) => tracing::debug!(target: LOG, error = %e, "pgfence open stopped"),
            }
            Ok(None)
        }
    }
}

async fn open_here(
    builder: Builder,
    table: TableName,
    reuse: Reuse,
    mut caller: oneshot::Receiver<()>,
) -> Result<PgKvStore> {
    let statements = Statements::new(&table);
    let deadline_after = builder.deadline();
    // A fleet closed or dropped opens nothing more: its renewal thread may be gone.
    let fleet = match &builder.fleet {
        Some(share) => Some(share.renewer.upgrade().ok_or(Error::Closed)?),
        None => None,
    };
    let pool = match reuse.pool {
        Some(pool) => pool,
        None => builder.pool()?,
    };
    let (connector, config) = match &builder.source {
        Source::Config(_) => {
            let config = builder.connection_config().expect("a config source");
            let mode = pool.mode();
            (Connector::Config(Box::new(config.clone()), builder.tls.clone(), mode), Some(config))
        }
        Source::Pool(_) => (Connector::Pool(pool.clone()), None),
        Source::Invalid(_) => unreachable!("validate() rejects an invalid source"),
    };

    // Every wait for the server below ends when the caller is gone (`Error::Closed`). So
    // `open_until` returns at its stop even from a server that stopped answering. A
    // connection left with a statement unanswered then is closed. It is never handed back to
    // a pool (the application's own, with `builder_from_pool`). Its next user would queue
    // behind that statement, and a cancel request may land late.
    let connecting = connect(&pool, config.as_ref(), &builder.tls, builder.connect_timeout);
    let mut client = unless_abandoned(&mut caller, connecting).await?;
    let holder = Holder {
        owner_id: Uuid::new_v4(),
        host: host_name(),
        pid: std::process::id() as i32,
        app: builder.application_name.clone(),
    };
    // Quick statements (they wait for no lock), so given up after `connect_timeout`. A
    // pooled connection may have gone silent while idle (a middlebox that hung). It then costs
    // this attempt, which a standby retries, instead of holding it up for good.
    let mode = pool.mode();
    let checks = async {
        // First: in session mode, the checks below and the setup use prepared statements.
        // Where the store does not own the sessions (a pool passed in, a transaction pooler),
        // their default isolation does not matter: each fenced mutation pins read committed
        // (`sql::BEGIN_READ_COMMITTED_ONLY`, or its function's check).
        if !reuse.checked.load(Ordering::Relaxed) {
            if mode.keeps_session() {
                connect::check_own_session(&pool, config.as_ref(), &builder.tls, &client).await?;
            }
            reuse.checked.store(true, Ordering::Relaxed);
        } else {
            // The one quick statement on a connection reused from an earlier attempt.
            client.batch_execute(sql::PING).await.map_err(Error::db("check connection"))?;
        }
        Ok(())
    };
    match answered_in_time(&mut caller, builder.connect_timeout, checks).await {
        Some(checked) => checked?,
        None => {
            discard(client);
            return Err(match is_abandoned(&mut caller) {
                true => Error::Closed,
                false => {
                    Error::Timeout { operation: "check connection", after: builder.connect_timeout }
                }
            });
        }
    };
    let acquired = schema::setup_and_acquire(
        (&mut client, mode),
        (&builder.tls, builder.connect_timeout),
        &mut caller,
        &table,
        &statements,
        builder.lease_ttl,
        &holder,
    )
    .await;
    let acquired = match acquired {
        Ok(acquired) => acquired,
        Err(SetupFailed { error, commit_unanswered }) => {
            if is_abandoned(&mut caller) || commit_unanswered {
                // Closed before the release below needs a connection of the same pool.
                discard(client);
            }
            if commit_unanswered {
                let owner_id = holder.owner_id;
                let release = release_unanswered_setup(&pool, &table, &statements, owner_id);
                if tokio::time::timeout(builder.connect_timeout, release).await.is_err() {
                    tracing::warn!(target: LOG, table = %table.display(),
                        "pgfence could not release a lease whose setup commit went unanswered in \
                            time; it expires by its TTL");
                }
            }
            return Err(error);
        }
    };
    tracing::info!(target: LOG, table = %table.display(), epoch = acquired.epoch,
        owner_id = %acquired.owner_id, "pgfence lease acquired");

    let lease = Arc::new(Lease::new(
        acquired.owner_id,
        acquired.epoch,
        table.display(),
        acquired.started,
        deadline_after,
        builder.on_lease_lost,
    ));
    let keeper_config = KeeperConfig {
        connector,
        renew_sql: statements.renew.clone(),
        release_sql: statements.release.clone(),
        notify_channel: acquired.channel.clone(),
        ttl: builder.lease_ttl,
        renew_interval: builder.renew_every(),
        connect_timeout: builder.connect_timeout,
        release_timeout: builder.drop_timeout,
    };
    let spawned = match &fleet {
        Some(fleet) => Ok(Keeper::spawn_in(fleet, Arc::clone(&lease), keeper_config)),
        None => Keeper::spawn(Arc::clone(&lease), keeper_config),
    };
    let keeper = match spawned {
        Ok(keeper) => keeper,
        Err(e) => {
            // No renewal means no lease: give it back now rather than by TTL, whether or not
            // the caller is still there. Not waited for beyond `connect_timeout`. A server that
            // stopped answering would hold the opening up for good. The lease then expires by
            // its TTL. The connection, left with the release unanswered, is closed rather than
            // handed back to the pool.
            let owners = [acquired.owner_id];
            let params: [&(dyn ToSql + Sync); 2] = [&&owners[..], &acquired.channel];
            let release = &statements.release;
            let release = mode.query(&**client, &release.sql, release.types, &params);
            match tokio::time::timeout(builder.connect_timeout, release).await.ok() {
                Some(Ok(_)) => drop(client),
                Some(Err(release)) => {
                    tracing::error!(
                        target: LOG,
                        error = %release, "pgfence could not release after a failed \
                        start");
                }
                None => {
                    tracing::error!(target: LOG, table = %table.display(),
                        "pgfence gave up releasing after a failed start; the lease expires by its \
                            TTL");
                    discard(client);
                }
            }
            return Err(e);
        }
    };
    // A table that never had statistics gets them now. Then point reads and removes use the
    // primary key rather than the pagination index. Without any, the planner may scan a
    // whole namespace through the latter: measured 1-2.5 ms instead of 0.2 ms per read on
    // 4,096 keys. Autovacuum keeps them fresh later; an analyzed table is not delayed.
    // Best effort: ANALYZE locks nothing writers need. After the renewal thread started, so
    // that a cancelled open() cannot leave a committed lease without renewal and release.
    // Not waited for beyond one TTL, nor once the caller is gone. A lock held by someone
    // else, or a server that stopped answering, would otherwise hold up the opened store
    // (its lease taken) for as long.
    let analyzing = async {
        let (never, types) = (sql::NEVER_ANALYZED, sql::NEVER_ANALYZED_TYPES);
        match mode.query_one(&**client, never, types, &[&table.quoted("")]).await {
            Ok(row) if row.get::<_, bool>(0) => client.batch_execute(&statements.analyze.sql).await,
            other => other.map(drop),
        }
    };
    match answered_in_time(&mut caller, builder.lease_ttl, analyzing).await {
        Some(Ok(())) => drop(client), // Back to the pool.
        Some(Err(e)) => {
            tracing::warn!(
                target: LOG,
                error = %e, "pgfence could not check or gather table statistics");
        }
        None => {
            tracing::warn!(target: LOG, table = %table.display(),
                "pgfence gave up gathering table statistics (held up, or open() abandoned)");
            if let Err(e) =
                builder.tls.cancel(&client.cancel_token(), builder.connect_timeout).await
            {
                tracing::warn!(
                    target: LOG,
                    error = %e, "pgfence could not cancel gathering statistics");
            }
            discard(client);
        }
    }
    Ok(PgKvStore {
        exec: Arc::new(Executor {
            pool,
            // A fleet's pool is the fleet's to close.
            owns_pool: builder.fleet.is_none() && !matches!(builder.source, Source::Pool(_)),
            table,
            statements,
            lease,
            closed: AtomicBool::new(false),
            gate: Arc::new(RwLock::new(())),
            keeper: tokio::sync::Mutex::new(Some(keeper)),
            page_size: builder.page_size,
            drop_timeout: builder.drop_timeout,
            retry_for: builder.lease_ttl,
            fencing: tokio::sync::Mutex::new(()),
            fence_under_way: std::sync::atomic::AtomicBool::new(false),
            skip_functions: std::sync::atomic::AtomicU32::new(0),
        }),
        writes: Arc::new(Writes::new(
            builder.write_concurrency,
            builder.max_value_size,
            builder.max_queued_bytes,
            acquired.crash_token,
        )),
    })
}

/// A connection of the pool, creating the database first if it does not exist (and the role
/// may; only with a connection config, `config`).
async fn connect(
    pool: &connect::Pool,
    config: Option<&tokio_postgres::Config>,
    tls: &connect::Tls,
    connect_timeout: Duration,
) -> Result<deadpool_postgres::Object> {
    match pool.raw().get().await {
        Err(PoolError::Backend(e)) if e.code() == Some(&SqlState::INVALID_CATALOG_NAME) => {
            let Some(config) = config else {
                return Err(pool.error("connect", PoolError::Backend(e)));
            };
            schema::create_database(config, tls, connect_timeout, pool.mode()).await?;
            pool.get("connect").await
        }
        other => other.map_err(|e| pool.error("connect", e)),
    }
}

/// `work`, unless the caller of `open()` is gone first (`caller` closed): `Error::Closed` then,
/// and `work` is dropped.
async fn unless_abandoned<T>(
    caller: &mut oneshot::Receiver<()>,
    work: impl Future<Output = Result<T>>,
) -> Result<T> {
    tokio::select! {
        biased;
        _ = caller => Err(Error::Closed),
        done = work => done,
    }
}

/// `work`, unless the caller of `open()` is gone first or `limit` passes: `None` then, and
/// `work` is dropped (a connection it left with a statement unanswered must be discarded).
async fn answered_in_time<T>(
    caller: &mut oneshot::Receiver<()>,
    limit: Duration,
    work: impl Future<Output = T>,
) -> Option<T> {
    tokio::select! {
        biased;
        _ = caller => None,
        done = tokio::time::timeout(limit, work) => done.ok(),
    }
}

/// Whether the caller of `open()` is gone.
fn is_abandoned(caller: &mut oneshot::Receiver<()>) -> bool {
    caller.try_recv() != Err(oneshot::error::TryRecvError::Empty)
}

/// Cleans up after a setup whose commit went unanswered because its connection broke.
///
/// That commit may have taken the lease, and no store would renew or release it. So it would
/// stay held by nobody until it expires, and a standby retrying would wait for it.
///
/// So this takes the setup lock ([`sql::SETUP_LOCK`]), which the setup transaction holds until
/// it ends. Its commit, if any, is then decided; a release before that could miss a commit
/// still on its way. In the same transaction it releases the lease by the setup's owner id,
/// which matches nothing if the commit did not happen. No server process is ended, so this is
/// safe behind a transaction pooler too. This is best effort: the lease expires by its TTL
/// otherwise. A setup whose commit never reached the server holds the lock until the server
/// ends it, one TTL idle in its transaction ([`sql::SETUP_IDLE_TIMEOUT`]); the caller gives up
/// waiting before that.
async fn release_unanswered_setup(
    pool: &connect::Pool,
    table: &TableName,
    statements: &Statements,
    owner_id: Uuid,
) {
    let operation = "release after an unanswered setup commit";
    let attempt = async {
        // Closed, not handed back, if this attempt is given up with a statement unanswered
        // (the caller's timeout): the pool may be the application's own.
        let mut client = Checkout::new(pool.get(operation).await?);
        let released = async {
            let mode = pool.mode();
            let tx = client.transaction().await?;
            let lock: [&(dyn ToSql + Sync); 3] =
                [&sql::SETUP_LOCK_CLASS, &table.schema, &table.name];
            mode.execute(&*tx, sql::SETUP_LOCK, sql::SETUP_LOCK_TYPES, &lock).await?;
            let channel = schema::notify_channel(mode, &*tx, table).await?;
            let release = &statements.release;
            let owners = [owner_id];
            let params: [&(dyn ToSql + Sync); 2] = [&&owners[..], &channel];
            let rows = mode.query(&*tx, &release.sql, release.types, &params).await?;
            tx.commit().await?;
            Ok(rows)
        };
        let released = released.await;
        client.answered();
        released.map_err(Error::db(operation))
    };
    match attempt.await {
        Ok(rows) if rows.is_empty() => {
            tracing::debug!(
                target: LOG,
                table = %table.display(), "pgfence unanswered setup commit took no \
                lease");
        }
        Ok(_) => tracing::warn!(target: LOG, table = %table.display(), %owner_id,
            "pgfence released the lease of a setup whose commit went unanswered"),
        Err(e) => tracing::warn!(target: LOG, table = %table.display(), error = %e,
            "pgfence could not release the lease of a setup whose commit went unanswered; it \
                expires by its TTL"),
    }
}

/// The host name for the lease row, best effort (it is only shown to operators).
pub(crate) fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .or_else(|_| std::fs::read_to_string("/etc/hostname"))
        .map(|s| s.trim().to_owned())
        .ok()
        .filter(|s| !s.is_empty())
        .or_else(|| std::env::var("HOSTNAME").ok())
        .unwrap_or_else(|| "unknown-host".to_owned())
}
