//! Read-only inspection for operators: the lease row, reads and listings without the lease,
//! and the break-glass release.

use std::pin::Pin;

use futures_util::StreamExt;
use tokio_postgres::RowStream;
use tokio_postgres::error::SqlState;

use crate::connect::{Pool, Tls, check_own_session};
use crate::error::{Error, Result};
use crate::exec::value_or_not_found;
use crate::keys::{TableName, check_key, check_namespaces};
use crate::schema::{self, LeaseInfo};
use crate::sql::{Statement, Statements};

/// Read-only access to a table without its lease: the lease row, reads and listings, and the
/// operator's break-glass release. Created by [`Builder::inspect`](crate::Builder::inspect). A table that does not exist
/// yet reads as empty.
#[derive(Debug)]
pub struct Inspector {
    pool: Pool,
    table: TableName,
    statements: Statements,
    /// For [`Inspector::check_session`]'s own connection when the pool has none to spare.
    config: Option<tokio_postgres::Config>,
    tls: Tls,
}

impl Inspector {
    /// An inspector of `builder`'s table (see [`Builder::inspect`](crate::Builder::inspect)).
    pub(crate) fn new(
        table: TableName,
        pool: Pool,
        config: Option<tokio_postgres::Config>,
        tls: Tls,
    ) -> Inspector {
        Inspector { pool, statements: Statements::new(&table), table, config, tls }
    }

    async fn query(
        &self,
        operation: &'static str,
        sql: &Statement,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    ) -> Result<Option<Vec<tokio_postgres::Row>>> {
        let client = self.pool.get(operation).await?;
        match self.pool.mode().query(&**client, &sql.sql, sql.types, params).await {
            Ok(rows) => Ok(Some(rows)),
            Err(e) if e.code() == Some(&SqlState::UNDEFINED_TABLE) => Ok(None),
            Err(source) => Err(Error::db(operation)(source).for_role(self.pool.role())),
        }
    }

    /// The lease row: holder, epoch, time left. `None` if no store ever opened the table.
    pub async fn lease_info(&self) -> Result<Option<LeaseInfo>> {
        let client = self.pool.get("read lease").await?;
        match schema::lease_info(self.pool.mode(), &**client, &self.statements).await {
            Err(Error::Database { source, .. })
                if source.code() == Some(&SqlState::UNDEFINED_TABLE) =>
            {
                Ok(None)
            }
            other => other,
        }
    }

    /// Reads a value; [`Error::NotFound`] if absent.
    pub async fn read(
        &self,
        primary_namespace: &str,
        secondary_namespace: &str,
        key: &str,
    ) -> Result<Vec<u8>> {
        check_key(primary_namespace, secondary_namespace, key)?;
        let rows = self
            .query("read", &self.statements.read, &[&primary_namespace, &secondary_namespace, &key])
            .await?
            .unwrap_or_default();
        value_or_not_found(&rows, primary_namespace, secondary_namespace, key)
    }

    /// Keys of a namespace pair, in byte order.
    pub async fn list(
        &self,
        primary_namespace: &str,
        secondary_namespace: &str,
    ) -> Result<Vec<String>> {
        check_namespaces(primary_namespace, secondary_namespace)?;
        let rows = self
            .query("list", &self.statements.list, &[&primary_namespace, &secondary_namespace])
            .await?;
        Ok(rows.unwrap_or_default().iter().map(|row| row.get(0)).collect())
    }

    /// Every key as `(primary_namespace, secondary_namespace, key)`, in byte order.
    pub async fn list_all_keys(&self) -> Result<Vec<(String, String, String)>> {
        let rows = self.query("list all keys", &self.statements.list_all, &[]).await?;
        Ok(rows
            .unwrap_or_default()
            .iter()
            .map(|row| (row.get(0), row.get(1), row.get(2)))
            .collect())
    }

    /// Every entry with its value, in the order of [`Inspector::list_all_keys`], read as they
    /// arrive. It is one statement, so one consistent snapshot of the table. Memory stays
    /// bounded whatever the table's size: the driver reads the next rows from the socket only
    /// as [`Entries::next`] takes them. The entries hold one pooled connection until dropped.
    pub async fn entries(&self) -> Result<Entries> {
        let operation = "read entries";
        let client = self.pool.get(operation).await?;
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 0] = [];
        let entries = self.pool.mode().query_raw(&client, &self.statements.entries, &params);
        let rows = match entries.await {
            Ok(rows) => Some(Box::pin(rows)),
            Err(e) if e.code() == Some(&SqlState::UNDEFINED_TABLE) => None,
            Err(source) => return Err(Error::db(operation)(source).for_role(self.pool.role())),
        };
        Ok(Entries { rows, _client: client, role: self.pool.role().map(str::to_owned) })
    }

    /// Checks that a connection keeps one server session of its own, as a store needs. This
    /// is the check [`Builder::open`](crate::Builder::open) makes first; it changes nothing on the server.
    ///
    /// It fails with [`Error::PoolerModeUnsupported`] when it sees a pooler that hands server
    /// sessions out per transaction (PgBouncer's transaction or statement mode). Passing is
    /// no proof: a busy pooler may hide that mode. A session pooler passes. With
    /// [`PoolMode::Transaction`](crate::PoolMode::Transaction) the store needs no session of
    /// its own, so this checks nothing and passes.
    pub async fn check_session(&self) -> Result<()> {
        if !self.pool.mode().keeps_session() {
            return Ok(());
        }
        let client = self.pool.get("check for a transaction pooler").await?;
        check_own_session(&self.pool, self.config.as_ref(), &self.tls, &client).await
    }

    /// Break-glass: expires the lease whoever holds it, so another store can take it at once.
    /// It wakes waiting standbys.
    ///
    /// The holder, if still running, is fenced from its next write on. It fails closed at its
    /// next renewal.
    ///
    /// It returns the holder it released, or `None` when it released nothing. It releases
    /// nothing when nobody held the lease. Nor does it when the lease it found expired or
    /// changed hands before its release ran. A new holder is then left alone: see
    /// [`Inspector::lease_info`] for who holds the lease now.
    pub async fn force_release(&self) -> Result<Option<LeaseInfo>> {
        let held = self.lease_info().await?.filter(|info| info.active);
        let Some(held) = held else { return Ok(None) };
        let client = self.pool.get("force release").await?;
        let channel = schema::notify_channel(self.pool.mode(), &**client, &self.table)
            .await
            .map_err(Error::db("resolve table schema"))?;
        drop(client);
        let rows = self
            .query("force release", &self.statements.release, &[&vec![held.owner_id], &channel])
            .await?
            .unwrap_or_default();
        // Empty: the lease expired or changed hands between the two statements. The release
        // is by owner id, so a new holder keeps its lease, and nothing was released.
        if rows.is_empty() {
            tracing::info!(table = %self.table.display(), epoch = held.epoch,
                "pgfence force release found the lease expired or taken over; released nothing");
            return Ok(None);
        }
        tracing::warn!(table = %self.table.display(), epoch = held.epoch, holder = %held.holder,
            "pgfence lease force-released by an operator");
        Ok(Some(held))
    }
}

/// One entry of [`Inspector::entries`]: `(primary_namespace, secondary_namespace, key, value)`.
pub type Entry = (String, String, String, Vec<u8>);

/// The entries of a table as [`Inspector::entries`] reads them.
pub struct Entries {
    /// `None` for a table that does not exist yet: no entries.
    rows: Option<Pin<Box<RowStream>>>,
    /// The connection the rows arrive on, back to the pool when dropped.
    _client: deadpool_postgres::Object,
    role: Option<String>,
}

impl Entries {
    /// The next entry, or `None` after the last.
    pub async fn next(&mut self) -> Option<Result<Entry>> {
        let row = self.rows.as_mut()?.next().await?;
        Some(match row {
            Ok(row) => Ok((row.get(0), row.get(1), row.get(2), row.get(3))),
            Err(source) => Err(Error::db("read entries")(source).for_role(self.role.as_deref())),
        })
    }
}

impl std::fmt::Debug for Entries {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Entries").finish_non_exhaustive()
    }
}
