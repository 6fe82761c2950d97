//! The server every test of a process shares: `DATABASE_URL`, or one private cluster.

use std::io;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use tokio_postgres::{Client, Config};

use crate::cluster::{Cluster, SUPERUSER};
use crate::{PASSWORD_ROLE, connect_spawned, external_tcp_addr, quote_ident, redirect};

/// Creates [`PASSWORD_ROLE`] on a `DATABASE_URL` server, or resets its password.
///
/// The advisory lock serializes this between test processes sharing the server: concurrent
/// `ALTER ROLE`s of one role fail with "tuple concurrently updated". Its key is `pgfence` and a
/// byte 1 in ASCII (`0x7067_6665_6e63_6501`), used nowhere else. Advisory locks are per
/// database, so processes using different databases of one server are covered only by the
/// retry in [`TestServer::ensure_password_role`].
const ENSURE_PASSWORD_ROLE_SQL: &str = "
BEGIN;
SELECT pg_advisory_xact_lock(8099555040678864129);
DO $$
BEGIN
    CREATE ROLE pgfence_pw_test LOGIN;
EXCEPTION WHEN duplicate_object OR unique_violation THEN
    NULL;
END
$$;
ALTER ROLE pgfence_pw_test LOGIN PASSWORD 'right-password';
COMMIT;
";

/// A PostgreSQL server for tests: the one named by `DATABASE_URL`, or a private temporary
/// cluster.
///
/// Get it with [`TestServer::shared`]; connect as an administrator with
/// [`TestServer::connect`] or [`TestServer::config`].
#[derive(Debug)]
pub struct TestServer {
    kind: ServerKind,
}

#[derive(Debug)]
enum ServerKind {
    /// A server named by `DATABASE_URL`; nothing of it is ours to start or stop.
    External { config: Config, url: String },
    /// A private cluster of this process, started by [`TestServer::shared`].
    Private(Cluster),
}

/// The outcome of the one start of the shared server, errors included, so every caller gets
/// the same answer. `io::Error` is not `Clone`, hence kind and message.
static SHARED: OnceLock<Result<TestServer, (io::ErrorKind, String)>> = OnceLock::new();

impl TestServer {
    /// The server every test of this process shares.
    ///
    /// If `DATABASE_URL` is set (and not empty), it is parsed as a [`tokio_postgres::Config`]
    /// and that server is used; no process is started. Otherwise the first call starts one
    /// private temporary cluster (see the [crate docs](crate)) and every later call, from any
    /// thread, returns that same cluster; concurrent first calls wait for the one start. The
    /// cluster is stopped and deleted before the process exits, when it ends normally (`main`
    /// returns, [`std::process::exit`], the test harness exiting); a process that is killed or
    /// aborts leaves that to the cluster's watchdog, which does it shortly after.
    ///
    /// This blocks while the cluster starts (a few seconds), also when called from async code.
    /// A failed start is not retried: every call returns the same error.
    pub fn shared() -> io::Result<&'static TestServer> {
        match SHARED.get_or_init(|| TestServer::init().map_err(|e| (e.kind(), e.to_string()))) {
            Ok(server) => Ok(server),
            Err((kind, message)) => Err(io::Error::new(*kind, message.clone())),
        }
    }

    fn init() -> io::Result<TestServer> {
        match std::env::var("DATABASE_URL") {
            Ok(url) if !url.trim().is_empty() => {
                let mut config: Config = url.parse().map_err(|e| {
                    io::Error::new(
                        io::ErrorKind::InvalidInput,
                        format!("DATABASE_URL is not a valid PostgreSQL connection string: {e}"),
                    )
                })?;
                if config.get_dbname().is_none() {
                    // The server's default is a database named like the user.
                    let dbname = config.get_user().unwrap_or(SUPERUSER).to_owned();
                    config.dbname(dbname);
                }
                Ok(TestServer { kind: ServerKind::External { config, url } })
            }
            _ => {
                let cluster = Cluster::launch()?;
                // Once: `init` runs once per process. On an error, dropping `cluster` stops it.
                stop_shared_cluster_at_exit()?;
                Ok(TestServer { kind: ServerKind::Private(cluster) })
            }
        }
    }

    /// Whether this is a private cluster of this process (`DATABASE_URL` unset).
    pub fn is_private(&self) -> bool {
        matches!(self.kind, ServerKind::Private(_))
    }

    /// An administrator (superuser) connection configuration, with the database name set.
    pub fn config(&self) -> Config {
        match &self.kind {
            ServerKind::External { config, .. } => config.clone(),
            ServerKind::Private(cluster) => cluster.config(),
        }
    }

    /// The administrator connection as a string that parses as a [`tokio_postgres::Config`]:
    /// `postgres://postgres@127.0.0.1:<port>/postgres` for a private cluster, `DATABASE_URL`
    /// as given otherwise.
    pub fn url(&self) -> String {
        match &self.kind {
            ServerKind::External { url, .. } => url.clone(),
            ServerKind::Private(cluster) => cluster.url(),
        }
    }

    /// The server's port (for `DATABASE_URL`, its first port, 5432 if none is given).
    pub fn port(&self) -> u16 {
        match &self.kind {
            ServerKind::External { config, .. } => {
                config.get_ports().first().copied().unwrap_or(5432)
            }
            ServerKind::Private(cluster) => cluster.port,
        }
    }

    /// The server's TCP address, e.g. as the upstream of a [`Proxy`](crate::Proxy).
    ///
    /// For `DATABASE_URL`, the first host is resolved (blocking); a Unix socket host is an
    /// error.
    pub fn tcp_addr(&self) -> io::Result<SocketAddr> {
        match &self.kind {
            ServerKind::External { config, .. } => external_tcp_addr(config),
            ServerKind::Private(cluster) => Ok(cluster.tcp_addr()),
        }
    }

    /// [`TestServer::config`], but connecting to `addr` instead, e.g. a
    /// [`Proxy::addr`](crate::Proxy::addr).
    pub fn config_via(&self, addr: SocketAddr) -> Config {
        redirect(&self.config(), addr)
    }

    /// The data directory of a private cluster; `None` for `DATABASE_URL`.
    pub fn data_dir(&self) -> Option<&Path> {
        match &self.kind {
            ServerKind::External { .. } => None,
            ServerKind::Private(cluster) => Some(cluster.data_dir.as_path()),
        }
    }

    /// Opens an administrator connection. Its connection task is spawned on the current tokio
    /// runtime and ends when the client is dropped or the connection breaks.
    pub async fn connect(&self) -> Result<Client, tokio_postgres::Error> {
        connect_spawned(&self.config()).await
    }

    /// Creates database `name` and returns [`TestServer::config`] pointed at it. Use a
    /// [`unique_name`](crate::unique_name); nothing drops the database afterwards (a private
    /// cluster is deleted whole).
    pub async fn create_database(&self, name: &str) -> Result<Config, tokio_postgres::Error> {
        let client = self.connect().await?;
        client.batch_execute(&format!("CREATE DATABASE {}", quote_ident(name))).await?;
        let mut config = self.config();
        config.dbname(name);
        Ok(config)
    }

    /// Makes sure [`PASSWORD_ROLE`] exists with the password
    /// [`PASSWORD_ROLE_PASSWORD`](crate::PASSWORD_ROLE_PASSWORD).
    ///
    /// A private cluster creates it at start, so this does nothing there. On a `DATABASE_URL`
    /// server it creates the role or resets its password; whether a wrong password is then
    /// refused depends on that server's `pg_hba.conf`, which tests must check.
    pub async fn ensure_password_role(&self) -> Result<(), tokio_postgres::Error> {
        if self.is_private() {
            return Ok(());
        }
        let client = self.connect().await?;
        let mut attempt = 1;
        loop {
            match client.batch_execute(ENSURE_PASSWORD_ROLE_SQL).await {
                Ok(()) => return Ok(()),
                // A race with another process using another database of the server.
                Err(_) if attempt < 5 => {
                    client.batch_execute("ROLLBACK").await?;
                    attempt += 1;
                    tokio::time::sleep(Duration::from_millis(50 * attempt)).await;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// A configuration that logs in as [`PASSWORD_ROLE`] with `password` over TCP, to the
    /// administrator's database.
    pub fn password_role_config(&self, password: &str) -> Config {
        let mut config = match &self.kind {
            ServerKind::External { config, .. } => config.clone(),
            ServerKind::Private(cluster) => cluster.config(),
        };
        config.user(PASSWORD_ROLE).password(password);
        config
    }
}

/// The process that registered [`stop_shared_cluster`] with `atexit`. A child forked from it
/// without `exec` inherits the registration and must not stop a cluster that is not its own.
static SHARED_CLUSTER_OWNER: AtomicU32 = AtomicU32::new(0);

/// Makes the normal exit of this process stop the private shared cluster first (see the module
/// docs).
///
/// Why `atexit`: std has no hook run at exit, and statics are never dropped. `exit` runs
/// `atexit` functions both when `main` returns and on [`std::process::exit`], and the test
/// harness ends in one or the other.
fn stop_shared_cluster_at_exit() -> io::Result<()> {
    SHARED_CLUSTER_OWNER.store(std::process::id(), Ordering::SeqCst);
    // SAFETY: `atexit` only records the function; `stop_shared_cluster` takes nothing and never
    // unwinds.
    #[allow(unsafe_code)]
    let status = unsafe { libc::atexit(stop_shared_cluster) };
    if status == 0 {
        Ok(())
    } else {
        Err(io::Error::other("could not register the stop of the shared test cluster (atexit)"))
    }
}

/// Run by `exit`, on the exiting thread. Other threads may still be running and using the
/// server; stopping it under them is the point.
extern "C" fn stop_shared_cluster() {
    if std::process::id() != SHARED_CLUSTER_OWNER.load(Ordering::SeqCst) {
        return;
    }
    // Unwinding out of an `extern "C"` function aborts. Nothing below should panic, but should
    // it, the exit goes on and the watchdog cleans up after it.
    let _ = std::panic::catch_unwind(|| {
        // `get`, not `shared()`: never start a server now, nor wait for a start in progress on
        // another thread (that cluster is left to its watchdog).
        if let Some(Ok(TestServer { kind: ServerKind::Private(cluster) })) = SHARED.get() {
            cluster.shut_down();
        }
    });
}
