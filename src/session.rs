//! What the store keeps in a server session, by [`PoolMode`]: prepared statements and session
//! settings. Every statement of the store runs through here, so that one place decides.
//!
//! - [`PoolMode::Session`]: a connection keeps its server session. Statements are prepared
//!   (the driver names them `s0`, `s1`, ... per process). The executor's are cached per
//!   connection, so each is planned once per connection. Session settings are made once, with
//!   `SET`, right after connecting.
//! - [`PoolMode::Transaction`]: the pooler may run each transaction on another server session,
//!   shared with other clients. A named statement could be missing there. Or it could collide
//!   with another client's statement of the same name. So each statement is sent unnamed:
//!   Parse, Bind, Execute and Sync in one round trip (`query_typed`). The driver then needs
//!   the parameter types, which [`crate::sql`] keeps beside each statement. Nothing is `SET`
//!   for a session: it would stay on a server session that other clients use next.

use std::borrow::Cow;

use deadpool_postgres::ClientWrapper;
use tokio_postgres::types::{ToSql, Type};
use tokio_postgres::{Client, Error, GenericClient, Row, RowStream};

use crate::sql::{self, Statement};

/// How the server sessions behind a connection string are shared:
/// [`Builder::pool_mode`](crate::Builder::pool_mode).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum PoolMode {
    /// Each connection keeps one server session until it closes: a direct connection to
    /// PostgreSQL, or a pooler in session mode (PgBouncer's `pool_mode = session`).
    ///
    /// Statements are prepared once per connection and their plans reused. A standby is woken
    /// by the holder's release at once (LISTEN/NOTIFY). `open()` refuses a transaction pooler
    /// it detects ([`crate::Error::PoolerModeUnsupported`]).
    #[default]
    Session,
    /// Each transaction may run on another server session, shared with other clients:
    /// PgBouncer's `pool_mode = transaction`.
    ///
    /// The store then keeps nothing in a server session. Statements are unnamed, parsed and
    /// planned on every execution. No session setting is made, so (see docs/deployments.md):
    ///
    /// - A single `write` or `remove` is one call of the table's PL/pgSQL function
    ///   (`<table>_fenced_write`, `<table>_fenced_remove`), whose statements are planned once
    ///   per server session. It checks the lease, and pins `synchronous_commit`, as the fenced
    ///   statement does.
    /// - Each batch, each renewal, the release, the change of owner id that fences off a
    ///   broken write, and a write or remove whose transaction would not run at read
    ///   committed, runs in a transaction of its own at read committed (`BEGIN
    ///   ISOLATION LEVEL READ COMMITTED`, pipelined with the statement and its `COMMIT` in
    ///   one round trip). Another client's session settings cannot change that.
    /// - Each of them commits with at least `synchronous_commit = on`, whatever another
    ///   client set on the server session: see docs/design.md, "Durability of `Ok`".
    /// - A fleet's shared renewal connection has no `lock_timeout` of 100 ms.
    ///
    /// `open()` does not look for a transaction pooler then. A standby polls the lease
    /// instead of listening for the release. See docs/deployments.md, section "Poolers".
    ///
    /// That standby, alone or in a [`crate::Fleet`], opens no `LISTEN` connection. It looks at
    /// the lease every second (see [`crate::Standby`], "Waking"). A graceful handoff thus takes
    /// up to about a second, half a second on average, instead of tens of milliseconds.
    Transaction,
}

/// A statement's parameters, as every caller binds them.
type Params<'a> = &'a [&'a (dyn ToSql + Sync)];

impl PoolMode {
    /// Runs `sql` (parameters of `types`) and returns its rows.
    pub(crate) async fn query(
        self,
        client: &(impl GenericClient + Sync),
        sql: &str,
        types: &[Type],
        params: Params<'_>,
    ) -> Result<Vec<Row>, Error> {
        match self {
            PoolMode::Session => client.query(sql, params).await,
            PoolMode::Transaction => client.query_typed(sql, &typed(types, params)).await,
        }
    }

    /// [`PoolMode::query`] of a statement that returns exactly one row (an error otherwise).
    pub(crate) async fn query_one(
        self,
        client: &(impl GenericClient + Sync),
        sql: &str,
        types: &[Type],
        params: Params<'_>,
    ) -> Result<Row, Error> {
        match self {
            PoolMode::Session => client.query_one(sql, params).await,
            PoolMode::Transaction => client.query_typed_one(sql, &typed(types, params)).await,
        }
    }

    /// Runs `sql` and returns the number of rows it changed.
    pub(crate) async fn execute(
        self,
        client: &(impl GenericClient + Sync),
        sql: &str,
        types: &[Type],
        params: Params<'_>,
    ) -> Result<u64, Error> {
        match self {
            PoolMode::Session => client.execute(sql, params).await,
            PoolMode::Transaction => client.execute_typed(sql, &typed(types, params)).await,
        }
    }

    /// [`PoolMode::query`] for a statement that writes the lease row outside a fenced mutation
    /// (the fence's change of owner id, the release). On a session that is not the store's own
    /// (`own_session` false) it runs pinned, as a mutation does:
    /// [`Prepared::query_read_committed`]. On the store's own, its session is pinned already
    /// ([`sql::READ_COMMITTED`]).
    pub(crate) async fn query_pinned(
        self,
        client: &Client,
        statement: &Statement,
        params: Params<'_>,
        own_session: bool,
    ) -> Result<Vec<Row>, Error> {
        match own_session {
            true => self.query(client, &statement.sql, statement.types, params).await,
            false => {
                let pinned = match self {
                    PoolMode::Session => Prepared::Named(client.prepare(&statement.sql).await?),
                    PoolMode::Transaction => Prepared::Unnamed(Cow::Borrowed(statement)),
                };
                pinned.query_read_committed(client, params).await
            }
        }
    }

    /// [`PoolMode::query`], with the rows read as they arrive.
    pub(crate) async fn query_raw(
        self,
        client: &Client,
        statement: &Statement,
        params: Params<'_>,
    ) -> Result<RowStream, Error> {
        match self {
            PoolMode::Session => {
                client.query_raw(statement.sql.as_str(), params.iter().copied()).await
            }
            PoolMode::Transaction => {
                client.query_typed_raw(&statement.sql, typed(statement.types, params)).await
            }
        }
    }

    /// Makes `statement` ready to run on the pooled connection `client`: prepared once per
    /// connection in session mode (its plan reused), unnamed in transaction mode.
    pub(crate) async fn prepare_cached<'a>(
        self,
        client: &ClientWrapper,
        statement: &'a Statement,
    ) -> Result<Prepared<'a>, Error> {
        match self {
            PoolMode::Session => client.prepare_cached(&statement.sql).await.map(Prepared::Named),
            PoolMode::Transaction => Ok(Prepared::Unnamed(Cow::Borrowed(statement))),
        }
    }

    /// [`PoolMode::prepare_cached`] on a connection without a statement cache: prepared anew
    /// in session mode.
    pub(crate) async fn prepare<'a>(
        self,
        client: &Client,
        statement: &'a Statement,
    ) -> Result<Prepared<'a>, Error> {
        match self {
            PoolMode::Session => client.prepare(&statement.sql).await.map(Prepared::Named),
            PoolMode::Transaction => Ok(Prepared::Unnamed(Cow::Borrowed(statement))),
        }
    }

    /// Makes the session `settings` (`SET` statements) on a connection, for the rest of its
    /// session. Only in session mode: behind a transaction pooler they would stay on a server
    /// session that other clients use next, and not on the ones this client gets.
    pub(crate) async fn set_session(self, client: &Client, settings: &str) -> Result<(), Error> {
        match self {
            PoolMode::Session => client.batch_execute(settings).await,
            PoolMode::Transaction => Ok(()),
        }
    }

    /// Whether a connection keeps its server session (see [`PoolMode::Session`]).
    pub(crate) fn keeps_session(self) -> bool {
        self == PoolMode::Session
    }
}

/// A statement ready to run on one connection ([`PoolMode::prepare`]).
#[derive(Debug)]
pub(crate) enum Prepared<'a> {
    /// Prepared on the connection's session.
    Named(tokio_postgres::Statement),
    /// Parsed and planned anew each time it runs.
    Unnamed(Cow<'a, Statement>),
}

impl Prepared<'_> {
    /// The same, owning its statement: to keep it beyond the statement it was made from.
    pub(crate) fn into_owned(self) -> Prepared<'static> {
        match self {
            Prepared::Named(statement) => Prepared::Named(statement),
            Prepared::Unnamed(statement) => Prepared::Unnamed(Cow::Owned(statement.into_owned())),
        }
    }

    /// Runs the statement on the connection it was made ready for.
    pub(crate) async fn query(
        &self,
        client: &Client,
        params: Params<'_>,
    ) -> Result<Vec<Row>, Error> {
        match self {
            Prepared::Named(statement) => client.query(statement, params).await,
            Prepared::Unnamed(statement) => {
                client.query_typed(&statement.sql, &typed(statement.types, params)).await
            }
        }
    }
}

impl Prepared<'_> {
    /// [`Prepared::query`] in a transaction of its own at read committed, with a durable commit,
    /// whatever the session's defaults: [`Prepared::query_in`] of [`sql::BEGIN_READ_COMMITTED`].
    pub(crate) async fn query_read_committed(
        &self,
        client: &Client,
        params: Params<'_>,
    ) -> Result<Vec<Row>, Error> {
        self.query_in(sql::BEGIN_READ_COMMITTED, client, params).await
    }

    /// [`Prepared::query`] in a transaction of its own, begun by `begin`
    /// ([`sql::BEGIN_READ_COMMITTED`], or [`sql::BEGIN_READ_COMMITTED_ONLY`] for a statement
    /// that pins its commit itself). `begin`, the statement and `COMMIT` are pipelined: the
    /// driver sends all three before it waits for an answer, so they cost one round trip.
    ///
    /// The first error wins. An error of the statement rolls back (its `COMMIT` answers
    /// `ROLLBACK`). An error of the `COMMIT` alone, a broken connection say, leaves the outcome
    /// unknown, as for a statement of its own.
    pub(crate) async fn query_in(
        &self,
        begin: &str,
        client: &Client,
        params: Params<'_>,
    ) -> Result<Vec<Row>, Error> {
        let (begun, rows, committed) = tokio::join!(
            client.batch_execute(begin),
            self.query(client, params),
            client.batch_execute(sql::COMMIT),
        );
        begun?;
        let rows = rows?;
        committed?;
        Ok(rows)
    }
}

/// Each parameter with its type, as `query_typed` takes them.
fn typed<'a>(types: &[Type], params: Params<'a>) -> Vec<(&'a (dyn ToSql + Sync), Type)> {
    debug_assert_eq!(types.len(), params.len(), "one type per parameter");
    params.iter().copied().zip(types.iter().cloned()).collect()
}
