//! Where a command connects, and the checks made before the library may create anything.

use std::time::Duration;

use tokio_postgres::types::Type;

use crate::exit::{Exit, denied};
use crate::output::secs;

/// The connect timeout when `PGCONNECT_TIMEOUT` sets none: the library's default.
pub(crate) const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Where a command connects, for the checks the CLI makes itself before handing over to the
/// library. It checks that the database exists, and for reads the table too. The library's
/// `open()` creates a missing database and table, which a typo must not do.
#[derive(Clone)]
pub(crate) struct Target {
    pub(crate) config: tokio_postgres::Config,
    pub(crate) tls: Option<pgfence::rustls::ClientConfig>,
    pub(crate) table: String,
    pub(crate) connect_timeout: Duration,
    /// `--pool-mode`. The CLI's own statements are unnamed in either mode (`query_typed`):
    /// each runs once, so nothing is lost, and none is left on a pooler's server session.
    pub(crate) pool_mode: pgfence::PoolMode,
}

/// Why [`Target::connect`] failed.
pub(crate) enum ConnectError {
    /// The database does not exist (SQLSTATE 3D000).
    NoDatabase(String),
    Other(Exit),
}

impl Target {
    /// `host:port` of every host, as psql names them (never the password).
    pub(crate) fn servers(&self) -> String {
        use tokio_postgres::config::Host;
        let ports = self.config.get_ports();
        let servers: Vec<String> = self
            .config
            .get_hosts()
            .iter()
            .enumerate()
            .map(|(i, host)| {
                let port = ports.get(i).or(ports.first()).copied().unwrap_or(5432);
                match host {
                    Host::Tcp(name) => format!("{name}:{port}"),
                    Host::Unix(dir) => format!("{}/.s.PGSQL.{port}", dir.display()),
                }
            })
            .collect();
        servers.join(",")
    }

    fn database(&self) -> &str {
        self.config.get_dbname().or(self.config.get_user()).unwrap_or("postgres")
    }

    pub(crate) async fn connect(&self) -> Result<tokio_postgres::Client, ConnectError> {
        use tokio_postgres::error::SqlState;
        let mut config = self.config.clone();
        config.connect_timeout(self.connect_timeout);
        let connecting = async {
            match &self.tls {
                Some(tls) => {
                    // Never a fallback to plain text: the password must not go out unencrypted.
                    config.ssl_mode(tokio_postgres::config::SslMode::Require);
                    let tls = tokio_postgres_rustls::MakeRustlsConnect::new(tls.clone());
                    let (client, connection) = config.connect(tls).await?;
                    tokio::spawn(connection);
                    Ok(client)
                }
                None => {
                    let (client, connection) = config.connect(tokio_postgres::NoTls).await?;
                    tokio::spawn(connection);
                    Ok::<_, tokio_postgres::Error>(client)
                }
            }
        };
        let servers = self.servers();
        match tokio::time::timeout(self.connect_timeout, connecting).await {
            Ok(Ok(client)) => Ok(client),
            Ok(Err(e)) if e.code() == Some(&SqlState::INVALID_CATALOG_NAME) => {
                Err(ConnectError::NoDatabase(format!(
                    "database {:?} does not exist on {servers}",
                    self.database()
                )))
            }
            Ok(Err(e)) => {
                Err(ConnectError::Other(Exit::other(&format!("cannot connect to {servers}"), &e)))
            }
            Err(_) => Err(ConnectError::Other(Exit {
                code: 1,
                message: format!(
                    "cannot connect to {servers}: no answer within {}",
                    secs(self.connect_timeout)
                ),
            })),
        }
    }

    /// For commands that only read: exit 6 unless the database and both tables exist.
    pub(crate) async fn require_table(&self) -> Result<(), Exit> {
        let client = match self.connect().await {
            Ok(client) => client,
            Err(ConnectError::NoDatabase(message)) => {
                return Err(Exit::missing(format!("{message} (check the connection string)")));
            }
            Err(ConnectError::Other(exit)) => return Err(exit),
        };
        let (kv, lease) = (quote_table(&self.table, ""), quote_table(&self.table, "_lease"));
        let row = client
            .query_typed_one(TABLES_EXIST, &[(&kv, Type::TEXT), (&lease, Type::TEXT)])
            .await
            .map_err(|e| {
                denied("check the table", &e).unwrap_or(Exit::other("check the table", &e))
            })?;
        let (has_kv, has_lease): (bool, bool) = (row.get(0), row.get(1));
        let database = self.database();
        match (has_kv, has_lease) {
            (true, true) => Ok(()),
            (false, _) => Err(Exit::missing(format!(
                "no table {} in database {database:?} (check --table; nothing was created)",
                self.table
            ))),
            (true, false) => Err(Exit::missing(format!(
                "table {} in database {database:?} has no lease table {}_lease: not a pgfence \
                 table (check --table)",
                self.table, self.table
            ))),
        }
    }

    /// For commands that write: exit 6 if the database does not exist, unless `create` (the
    /// library then creates it). A `standby` goes on to the library on other connection
    /// errors, which it rides out; the others report them here, naming the server.
    pub(crate) async fn require_database(&self, create: bool, standby: bool) -> Result<(), Exit> {
        match self.connect().await {
            Ok(_) => Ok(()),
            Err(ConnectError::NoDatabase(_)) if create => Ok(()),
            Err(ConnectError::NoDatabase(message)) => Err(Exit::missing(format!(
                "{message} (check the connection string, or pass --create-database to create it)"
            ))),
            Err(ConnectError::Other(_)) if standby => Ok(()),
            Err(ConnectError::Other(exit)) => Err(exit),
        }
    }
}

/// Whether the KV table and its lease table exist, by their quoted names (resolved on the
/// search path when unqualified, as the store's statements are). A missing schema is a
/// missing table.
const TABLES_EXIST: &str =
    "SELECT to_regclass($1::text) IS NOT NULL, to_regclass($2::text) IS NOT NULL";

/// `table` (`name` or `schema.name`, already checked by the library) with `suffix` added to
/// the name, each part quoted.
pub(crate) fn quote_table(table: &str, suffix: &str) -> String {
    let quote = |part: &str| format!("\"{}\"", part.replace('"', "\"\""));
    match table.split_once('.') {
        Some((schema, name)) => format!("{}.{}", quote(schema), quote(&format!("{name}{suffix}"))),
        None => quote(&format!("{table}{suffix}")),
    }
}
