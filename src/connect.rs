//! How the store connects: plain, or TLS for every connection when [`crate::Builder::tls`] is
//! set, and at read committed whatever the database's default isolation level. The pool goes
//! through here. So do the connections of their own: lease renewal, a standby's LISTEN, and
//! creating a missing database. So none of them can be plain, or stricter, by mistake.

use std::fmt;
use std::ops::Deref;
use std::sync::Arc;
use std::time::Duration;

use deadpool_postgres::{Hook, HookError, Manager, ManagerConfig, PoolError, RecyclingMethod};
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_postgres::config::Host;
use tokio_postgres::{AsyncMessage, CancelToken, Client, Config, Connection, NoTls};
use tokio_postgres_rustls::MakeRustlsConnect;

use crate::error::{Error, HOOK_TIMED_OUT, Result};
use crate::session::PoolMode;
use crate::sql;

/// The TLS client configuration of a store's connections; `None` connects without TLS.
#[derive(Clone, Default)]
pub(crate) struct Tls(Option<MakeRustlsConnect>);

impl Tls {
    pub(crate) fn rustls(config: rustls::ClientConfig) -> Tls {
        Tls(Some(MakeRustlsConnect::new(config)))
    }

    pub(crate) fn is_on(&self) -> bool {
        self.0.is_some()
    }

    /// The manager of a pool the store builds, connecting like [`Tls::connect`], with fast
    /// recycling: a broken connection is noticed on use and retried.
    pub(crate) fn manager(&self, config: Config) -> Manager {
        let manager = ManagerConfig { recycling_method: RecyclingMethod::Fast };
        match &self.0 {
            Some(tls) => Manager::from_config(config, tls.clone(), manager),
            None => Manager::from_config(config, NoTls, manager),
        }
    }

    /// [`Tls::connect_in`] a server session of its own ([`PoolMode::Session`]).
    pub(crate) async fn connect(
        &self,
        config: &Config,
        what: &'static str,
        notifications: Option<mpsc::UnboundedSender<String>>,
    ) -> Result<(Client, JoinHandle<()>), tokio_postgres::Error> {
        self.connect_in(PoolMode::Session, config, what, notifications).await
    }

    /// Connects, spawns the task that drives the connection, and sets the session to read
    /// committed ([`sql::READ_COMMITTED`]), unless `mode` shares sessions (see
    /// [`PoolMode::set_session`]). The task ends when the client is dropped or the connection
    /// breaks (logged at debug level as `what`). A notification on the connection (after
    /// LISTEN) is signalled on `notifications`, by its channel's name.
    pub(crate) async fn connect_in(
        &self,
        mode: PoolMode,
        config: &Config,
        what: &'static str,
        notifications: Option<mpsc::UnboundedSender<String>>,
    ) -> Result<(Client, JoinHandle<()>), tokio_postgres::Error> {
        let (client, task) = match &self.0 {
            Some(tls) => {
                let (client, connection) = config.connect(tls.clone()).await?;
                (client, drive(connection, what, notifications))
            }
            None => {
                let (client, connection) = config.connect(NoTls).await?;
                (client, drive(connection, what, notifications))
            }
        };
        // Aborted if this future is dropped while the `SET` waits (given up after a timeout,
        // or the caller gone). The task would otherwise wait for the answer. It would be left
        // running on the runtime after the opening returned.
        let task = AbortOnDrop(Some(task));
        mode.set_session(&client, sql::READ_COMMITTED).await?;
        Ok((client, task.detach()))
    }
}

/// The servers `config` names, as psql names them: `host:port`, or a Unix socket's path.
/// Never the password. Several hosts are joined with commas.
pub(crate) fn servers(config: &Config) -> String {
    let ports = config.get_ports();
    let port = |i: usize| ports.get(i).or(ports.first()).copied().unwrap_or(5432);
    let hosts = config.get_hosts();
    if hosts.is_empty() {
        return format!("(no host):{}", port(0));
    }
    let named: Vec<String> = hosts
        .iter()
        .enumerate()
        .map(|(i, host)| match host {
            Host::Tcp(name) => format!("{name}:{}", port(i)),
            Host::Unix(dir) => format!("{}/.s.PGSQL.{}", dir.display(), port(i)),
        })
        .collect();
    named.join(",")
}

/// The store's pool, with the servers and the role it connects as. A connection that cannot
/// be had is reported as [`Error::Connect`] naming the servers, not as the pool's error.
#[derive(Clone, Debug)]
pub(crate) struct Pool {
    pool: deadpool_postgres::Pool,
    /// [`servers`] of the configuration, or a description of a pool passed in.
    servers: Arc<str>,
    /// The role, for the `GRANT` of a permission error; unknown for a pool passed in.
    role: Option<Arc<str>>,
    /// How the servers behind it share their sessions: how statements run on it.
    mode: PoolMode,
    /// Whether each connection's server session is the store's own, set to read committed when
    /// it connected: a pool the store built, in session mode.
    own_sessions: bool,
}

impl Pool {
    /// A pool built from `config`, or (`None`) the application's own, in `mode`.
    pub(crate) fn new(
        pool: deadpool_postgres::Pool,
        config: Option<&Config>,
        mode: PoolMode,
    ) -> Pool {
        let (servers, role) = match config {
            Some(config) => (servers(config).into(), config.get_user().map(Arc::from)),
            // deadpool-postgres keeps its configuration private.
            None => ("the server of the application's pool".into(), None),
        };
        let own_sessions = config.is_some() && mode.keeps_session();
        Pool { pool, servers, role, mode, own_sessions }
    }

    /// Whether the pool's sessions are the store's own, set to read committed
    /// ([`sql::READ_COMMITTED`]). Elsewhere a fenced mutation pins its isolation itself
    /// ([`sql::BEGIN_READ_COMMITTED`]).
    pub(crate) fn own_sessions(&self) -> bool {
        self.own_sessions
    }

    /// A connection of the pool, for `operation`.
    pub(crate) async fn get(&self, operation: &'static str) -> Result<deadpool_postgres::Object> {
        self.pool.get().await.map_err(|e| self.error(operation, e))
    }

    /// The pool's error `e` as this crate reports it.
    pub(crate) fn error(&self, operation: &'static str, e: PoolError) -> Error {
        Error::from_pool(operation, &self.servers, e)
    }

    /// The pool itself, for a caller that handles its errors first.
    pub(crate) fn raw(&self) -> &deadpool_postgres::Pool {
        &self.pool
    }

    /// How statements run on the pool's connections.
    pub(crate) fn mode(&self) -> PoolMode {
        self.mode
    }

    /// The role the pool connects as, when known.
    pub(crate) fn role(&self) -> Option<&str> {
        self.role.as_deref()
    }
}

impl Deref for Pool {
    type Target = deadpool_postgres::Pool;

    fn deref(&self) -> &deadpool_postgres::Pool {
        &self.pool
    }
}

/// A connection's task, aborted when dropped unless [`AbortOnDrop::detach`]ed.
pub(crate) struct AbortOnDrop(pub(crate) Option<JoinHandle<()>>);

impl AbortOnDrop {
    /// The task, no longer aborted on drop.
    pub(crate) fn detach(mut self) -> JoinHandle<()> {
        self.0.take().expect("not yet detached")
    }
}

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        if let Some(task) = self.0.take() {
            task.abort();
        }
    }
}

/// The pool's hook on every connection it creates: [`sql::READ_COMMITTED`], given at most
/// `timeout`, unless `mode` shares sessions ([`PoolMode::set_session`]). A server that stopped
/// answering would otherwise hold it up for good. `timeout` is the connect timeout. tokio-postgres applies that only to the TCP connect, and the pool
/// only to creating the connection, not to its hooks. Session state of a pooled connection,
/// but of a pool the store built and nobody else uses, whose recycling (`Fast`) resets
/// nothing. The fence does not rest on it. Under a stricter level a mutation still commits
/// nothing without the lease; its lock fails instead. This setting only makes the store
/// report a takeover as the loss it is.
pub(crate) fn read_committed(timeout: Duration, mode: PoolMode) -> Hook {
    Hook::async_fn(move |client, _| {
        Box::pin(async move {
            let set = mode.set_session(client, sql::READ_COMMITTED);
            match tokio::time::timeout(timeout, set).await {
                Ok(set) => set.map_err(HookError::Backend),
                Err(_) => Err(HookError::message(HOOK_TIMED_OUT)),
            }
        })
    })
}

impl Tls {
    /// Asks the server to cancel the statement running on the connection of `token`. The
    /// request goes over a connection made like the others. A store on a pool, whose connector
    /// is unknown here, asks without TLS. Given up after `limit`. Over TLS the request waits
    /// for the server's answer to its SSLRequest and for the handshake. A server that stopped
    /// answering never gives them. Without TLS, only the TCP connect is waited for.
    pub(crate) async fn cancel(&self, token: &CancelToken, limit: Duration) -> Result<()> {
        let sent = async {
            match &self.0 {
                Some(tls) => token.cancel_query(tls.clone()).await,
                None => token.cancel_query(NoTls).await,
            }
        };
        match tokio::time::timeout(limit, sent).await {
            Ok(sent) => sent.map_err(Error::db("cancel")),
            Err(_) => Err(Error::Timeout { operation: "cancel", after: limit }),
        }
    }
}

/// A TLS client configuration for [`crate::Builder::tls`] that trusts exactly `roots`. It uses
/// rustls's ring provider and its default protocol versions (TLS 1.2 and 1.3). That holds
/// whatever provider the process has installed as its default. It offers no client
/// certificate: see [`tls_client_config_with_cert`] for a server that asks for one.
pub fn tls_client_config(roots: rustls::RootCertStore) -> rustls::ClientConfig {
    tls_builder(roots).with_no_client_auth()
}

/// [`tls_client_config`], but also presenting `cert_chain` (the client's certificate first)
/// with its private `key`. For a server whose `pg_hba.conf` asks for a client certificate
/// (method `cert`, or `clientcert=verify-full`).
///
/// Fails with [`Error::InvalidConfig`] (field `"tls"`) when the chain is empty. It fails the
/// same way when the key is not usable (an unsupported type, or malformed). Whether the key
/// matches the certificate is checked by the server, which then refuses the connection.
pub fn tls_client_config_with_cert(
    roots: rustls::RootCertStore,
    cert_chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
) -> Result<rustls::ClientConfig> {
    if cert_chain.is_empty() {
        return Err(Error::config("tls", "the client certificate chain is empty"));
    }
    tls_builder(roots)
        .with_client_auth_cert(cert_chain, key)
        .map_err(|e| Error::config("tls", format!("client certificate or key: {e}")))
}

fn tls_builder(
    roots: rustls::RootCertStore,
) -> rustls::ConfigBuilder<rustls::ClientConfig, rustls::client::WantsClientCert> {
    rustls::ClientConfig::builder_with_provider(Arc::new(rustls::crypto::ring::default_provider()))
        .with_safe_default_protocol_versions()
        .expect("ring's default provider supports TLS 1.2 and 1.3")
        .with_root_certificates(roots)
}

impl fmt::Debug for Tls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(if self.is_on() { "Tls(rustls)" } else { "Tls(off)" })
    }
}

fn drive<S, T>(
    mut connection: Connection<S, T>,
    what: &'static str,
    notifications: Option<mpsc::UnboundedSender<String>>,
) -> JoinHandle<()>
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
    T: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    tokio::spawn(async move {
        // Notifications arrive only through poll_message; the plain `Connection` future would
        // drop them.
        while let Some(message) = std::future::poll_fn(|cx| connection.poll_message(cx)).await {
            match message {
                Ok(AsyncMessage::Notification(notification)) => {
                    if let Some(notifications) = &notifications {
                        // The receiver may be gone.
                        let _ = notifications.send(notification.channel().to_owned());
                    }
                }
                Ok(AsyncMessage::Notice(notice)) => {
                    tracing::debug!(notice = %notice, "pgfence {what} connection notice");
                }
                Ok(_) => {}
                Err(e) => {
                    tracing::debug!(error = %e, "pgfence {what} connection ended");
                    break;
                }
            }
        }
    })
}

/// Refuses a connection through a pooler that hands server sessions out per transaction
/// (PgBouncer's transaction or statement mode), for a store in `PoolMode::Session`: its
/// prepared statements live in a session of its own.
///
/// Only session state can tell, and setting any would leak into the pooler's shared server
/// sessions. So this compares server process ids, which change nothing (simple protocol: no
/// prepared statement either). `client` asks for its pid `p`; a second connection of the pool
/// asks for its own; then `client` asks again. Directly or through a session pooler, `client`
/// keeps server process `p` for as long as it is connected. So no other connection can be
/// served by `p`, and `client` never sees another pid. Either observation is therefore proof of
/// a per-transaction pooler. Not seeing one is no proof of the contrary: another client may have
/// taken `p` in between. PgBouncer reuses its most recently freed server first, so on a pooler
/// that is not busy the second connection gets `p`.
pub(crate) async fn check_own_session(
    pool: &Pool,
    config: Option<&tokio_postgres::Config>,
    tls: &Tls,
    client: &tokio_postgres::Client,
) -> Result<()> {
    let operation = "check for a transaction pooler";
    let first = backend_pid(client).await.map_err(Error::db(operation))?;
    // A spare connection of the pool, else (pool size 1) one of its own if the store has the
    // configuration. Never a wait for the pool: a caller's pool of one would wait for
    // `client`, which it never gets back.
    let status = pool.status();
    let other = if status.available > 0 || status.size < status.max_size {
        let other = pool.get(operation).await?;
        let pid = backend_pid(&other).await.map_err(Error::db(operation))?;
        // Closed now, not kept in the pool. A partition during the setup that follows would
        // leave this idle session on the server for hours: the server ends only sessions idle
        // in a transaction, and it hears of a vanished client only through keepalives.
        drop(deadpool_postgres::Object::take(other));
        Some(pid)
    } else if let Some(config) = config {
        let (other, _task) = tls
            .connect(config, "pooler check", None)
            .await
            .map_err(|e| Error::connect(operation, &servers(config), e))?;
        Some(backend_pid(&other).await.map_err(Error::db(operation))?)
    } else {
        None
    };
    let again = backend_pid(client).await.map_err(Error::db(operation))?;
    if other == Some(first) || again != first {
        return Err(Error::PoolerModeUnsupported { pool_mode: "transaction" });
    }
    Ok(())
}

/// `pg_backend_pid()` over the simple query protocol (see `sql::BACKEND_PID`).
async fn backend_pid(
    client: &tokio_postgres::Client,
) -> std::result::Result<i32, tokio_postgres::Error> {
    let messages = client.simple_query(sql::BACKEND_PID).await?;
    let pid = messages.iter().find_map(|message| match message {
        tokio_postgres::SimpleQueryMessage::Row(row) => row.get(0).and_then(|pid| pid.parse().ok()),
        _ => None,
    });
    // PostgreSQL always answers with one integer; 0 never names a process.
    Ok(pid.unwrap_or(0))
}
