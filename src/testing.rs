//! Test support: real PostgreSQL servers for tests, and a fault-injecting TCP proxy.
//!
//! Compiled only with the `testing` cargo feature. The crate's own tests, examples and benches
//! get it through a self dev-dependency; nothing here is meant for production use.
//!
//! - [`TestServer::shared`] gives every test of a process the same server: the one named by
//!   `DATABASE_URL` when that is set, otherwise one private temporary cluster, started on first
//!   use and stopped before the process exits.
//! - [`TestCluster`] is a private cluster owned by one test, for tests that stop or restart the
//!   server; [`TestCluster::start_tls`] makes one that takes TCP connections over TLS only, and
//!   logs [`CERT_ROLE`] in by client certificate alone.
//! - [`Proxy`] sits between a client and the server and delays, refuses or cuts connections.
//! - [`unique_name`] gives each test its own table (or database) names, so tests run in parallel
//!   and reruns start clean.
//!
//! # Private clusters
//!
//! A private cluster is made with the PostgreSQL server binaries of the machine (`initdb`,
//! `pg_ctl` and `postgres` on `PATH`, else the newest `/usr/lib/postgresql/<version>/bin`) in a
//! fresh directory under [`std::env::temp_dir`]. It listens on `127.0.0.1` on a free port and on
//! a private Unix socket directory, so it never collides with another server on the machine.
//! PostgreSQL refuses to run as root; when the tests run as root, every server command runs as
//! the `postgres` system user instead.
//!
//! Authentication is `trust` for everyone except [`PASSWORD_ROLE`], which must give
//! [`PASSWORD_ROLE_PASSWORD`] over TCP (`scram-sha-256`), so tests can check how a wrong password
//! is reported, and, on a TLS cluster, [`CERT_ROLE`], which must present its client
//! certificate.
//!
//! Nothing is left running when the process ends. A [`TestCluster`] is stopped and deleted when
//! it is dropped. The private shared server is a static, which Rust never drops; instead, its
//! start registers a function with `atexit` that stops it (`pg_ctl stop -m immediate`), waits
//! until its postmaster has exited, deletes its directory, and releases and reaps its watchdog
//! (below). So when the process ends normally (`main` returns, [`std::process::exit`] is called,
//! or the test harness exits after its last test, passed or failed), every process and file of
//! the shared server is gone before the process has exited: whoever waits for the process and
//! then looks finds nothing. Other threads may still be running at that moment; their
//! connections to the server break. The stop never panics and is bounded: it normally takes a
//! fraction of a second, and gives up after about 20 s.
//!
//! A process that is killed (`SIGKILL`, a Ctrl-C it does not handle) or that aborts (a panic
//! with `panic = "abort"`) runs no destructor and no `atexit` function at all, so every cluster
//! also gets a watchdog process when it is created: a small shell script that blocks reading a
//! pipe whose only write end this process holds and never writes. When this process dies, for
//! any reason, the kernel closes that write end, the script's read returns end-of-file, and the
//! script stops the server (`pg_ctl stop -m immediate`) and deletes the cluster's directory. That
//! happens shortly after the process is gone, not before. After a normal end the watchdog finds
//! nothing left to do. It runs in its own process group so that the Ctrl-C that kills the test
//! process does not kill it too.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::fs;
use std::io::{self, Read, Seek, SeekFrom};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, ToSocketAddrs};
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError, mpsc as std_mpsc};
use std::thread;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot};
use tokio::task::AbortHandle;
use tokio_postgres::config::Host;
use tokio_postgres::{Client, Config, NoTls};

/// The role that must authenticate with a password over TCP.
///
/// Every private cluster creates it at start with the password [`PASSWORD_ROLE_PASSWORD`];
/// on a `DATABASE_URL` server, [`TestServer::ensure_password_role`] creates it.
pub const PASSWORD_ROLE: &str = "pgfence_pw_test";

/// The right password of [`PASSWORD_ROLE`].
pub const PASSWORD_ROLE_PASSWORD: &str = "right-password";

/// The role that must authenticate with a password over TCP, and its right password:
/// `(`[`PASSWORD_ROLE`]`, `[`PASSWORD_ROLE_PASSWORD`]`)`.
pub fn pg_hba_password_role() -> (&'static str, &'static str) {
    (PASSWORD_ROLE, PASSWORD_ROLE_PASSWORD)
}

/// The superuser of private clusters (`initdb -U`), also the system user that runs them when
/// the tests run as root.
const SUPERUSER: &str = "postgres";

/// How many free ports a private cluster tries before giving up. A port found free can be
/// taken by someone else before the server binds it; that is rare, so a few tries suffice.
const START_ATTEMPTS: usize = 5;

/// Connect timeout of every configuration handed out here: a test waiting on a dead server
/// fails instead of hanging.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);

/// `pg_hba.conf` of private clusters. Rules are matched top to bottom, so the password rules
/// for [`PASSWORD_ROLE`] must come before the `trust` rules for everyone.
const PG_HBA_CONF: &str = "\
# Written by pgfence::testing.
# TYPE  DATABASE  USER             ADDRESS        METHOD
local   all       all                             trust
host    all       pgfence_pw_test  127.0.0.1/32   scram-sha-256
host    all       pgfence_pw_test  ::1/128        scram-sha-256
host    all       all              127.0.0.1/32   trust
host    all       all              ::1/128        trust
";

/// The role that a cluster made by [`TestCluster::start_tls`] lets in over TCP only with a
/// client certificate issued to it by the cluster's certificate authority
/// ([`TestCluster::client_cert_pem`]). It may create databases.
pub const CERT_ROLE: &str = "pgfence_cert_test";

/// `pg_hba.conf` of a cluster made by [`TestCluster::start_tls`]: TCP only over TLS, and
/// [`CERT_ROLE`] only with its client certificate (`cert`: verified against `ssl_ca_file`, and
/// its common name must be the role's name).
const PG_HBA_CONF_TLS: &str = "\
# Written by pgfence::testing (TLS only over TCP).
# TYPE     DATABASE  USER               ADDRESS       METHOD
local      all       all                                trust
hostssl    all       pgfence_cert_test  127.0.0.1/32  cert
hostssl    all       all                127.0.0.1/32  trust
hostnossl  all       all                127.0.0.1/32  reject
";

/// Run on a cluster before [`TestCluster::start_tls`] turns TLS on.
const CREATE_CERT_ROLE_SQL: &str = "CREATE ROLE pgfence_cert_test LOGIN CREATEDB";

/// Run once on a new private cluster, as the superuser. `password_encryption` is set to
/// `scram-sha-256` in `postgresql.conf` before the server starts, so the password is stored
/// as the SCRAM verifier that `pg_hba.conf` asks for.
const CREATE_PASSWORD_ROLE_SQL: &str =
    "CREATE ROLE pgfence_pw_test LOGIN PASSWORD 'right-password'";

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

/// How long `pg_ctl` waits for a server to start, or to stop in fast mode (`-t`).
const PG_CTL_WAIT: Duration = Duration::from_secs(60);

/// How long the end of a cluster ([`Cluster::shut_down`]) waits for the immediate stop (`pg_ctl
/// -t`); then for the postmaster's exit, and for the watchdog's, [`REAP_WAIT`] each. Bounded,
/// because for the shared cluster this delays the exit of the process: [`SHUT_DOWN_WAIT`] plus
/// twice [`REAP_WAIT`] is the "about 20 s" of the module docs. An immediate stop takes milliseconds
/// (the postmaster `SIGKILL`s children that have not quit after 5 s).
const SHUT_DOWN_WAIT: Duration = Duration::from_secs(10);

/// See [`SHUT_DOWN_WAIT`].
const REAP_WAIT: Duration = Duration::from_secs(5);

/// The watchdog of a private cluster (see the module docs). Arguments: `$1` the `pg_ctl`
/// binary, `$2` the data directory, `$3` the cluster's directory to delete.
const WATCHDOG_SCRIPT: &str = r#"cat >/dev/null 2>&1
"$1" stop -D "$2" -m immediate -w -t 10 >/dev/null 2>&1
rm -rf "$3"
"#;

// ---------------------------------------------------------------------------------------------
// Shared server
// ---------------------------------------------------------------------------------------------

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
    /// private temporary cluster (see the [module docs](self)) and every later call, from any
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

    /// The server's TCP address, e.g. as the upstream of a [`Proxy`].
    ///
    /// For `DATABASE_URL`, the first host is resolved (blocking); a Unix socket host is an
    /// error.
    pub fn tcp_addr(&self) -> io::Result<SocketAddr> {
        match &self.kind {
            ServerKind::External { config, .. } => external_tcp_addr(config),
            ServerKind::Private(cluster) => Ok(cluster.tcp_addr()),
        }
    }

    /// [`TestServer::config`], but connecting to `addr` instead, e.g. a [`Proxy::addr`].
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
    /// [`unique_name`]; nothing drops the database afterwards (a private cluster is deleted
    /// whole).
    pub async fn create_database(&self, name: &str) -> Result<Config, tokio_postgres::Error> {
        let client = self.connect().await?;
        client.batch_execute(&format!("CREATE DATABASE {}", quote_ident(name))).await?;
        let mut config = self.config();
        config.dbname(name);
        Ok(config)
    }

    /// Makes sure [`PASSWORD_ROLE`] exists with the password [`PASSWORD_ROLE_PASSWORD`].
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

// ---------------------------------------------------------------------------------------------
// Caller-owned cluster
// ---------------------------------------------------------------------------------------------

/// A private temporary PostgreSQL cluster owned by the caller, for tests that stop, restart or
/// otherwise hurt the server.
///
/// Always private, also when `DATABASE_URL` is set. Made like the private shared server (see
/// the [module docs](self)). Dropping it stops the server (immediate mode) and deletes its
/// directory; if the process dies first, the watchdog does that.
///
/// The methods that run `pg_ctl` block; from async code that is acceptable in tests.
#[derive(Debug)]
pub struct TestCluster {
    cluster: Cluster,
    /// A TLS cluster's certificates, PEM-encoded.
    tls: Option<TlsFiles>,
}

/// The PEM-encoded certificates of a cluster made by [`TestCluster::start_tls`].
#[derive(Debug)]
struct TlsFiles {
    /// The certificate authority that issued the server's and the client's certificates.
    root: String,
    /// A client certificate for [`CERT_ROLE`], and its private key.
    client_cert: String,
    client_key: String,
}

impl TestCluster {
    /// Creates and starts a new private cluster.
    pub fn start() -> io::Result<TestCluster> {
        Ok(TestCluster { cluster: Cluster::launch()?, tls: None })
    }

    /// Creates and starts a new private cluster that takes TCP connections over TLS only (a
    /// plain one is rejected by `pg_hba.conf`; the Unix socket stays open). Its server
    /// certificate names `127.0.0.1` and `localhost`, issued by a certificate authority made for
    /// this cluster alone, which [`TestCluster::tls_client_config`] trusts. [`CERT_ROLE`] logs
    /// in over TCP with the client certificate of [`TestCluster::client_cert_pem`] only.
    pub fn start_tls() -> io::Result<TestCluster> {
        let cluster = Cluster::launch()?;
        let tls = cluster.enable_tls()?;
        Ok(TestCluster { cluster, tls: Some(tls) })
    }

    /// A TLS client configuration that trusts only this cluster's certificate authority; `None`
    /// for a cluster without TLS.
    pub fn tls_client_config(&self) -> Option<rustls::ClientConfig> {
        self.tls.as_ref().map(|tls| crate::tls_client_config(tls.roots()))
    }

    /// [`TestCluster::tls_client_config`], also presenting the client certificate of
    /// [`CERT_ROLE`]; `None` for a cluster without TLS.
    pub fn tls_client_config_with_cert(&self) -> Option<rustls::ClientConfig> {
        use rustls::pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject};
        self.tls.as_ref().map(|tls| {
            let cert = CertificateDer::from_pem_slice(tls.client_cert.as_bytes());
            let key = PrivateKeyDer::from_pem_slice(tls.client_key.as_bytes());
            crate::tls_client_config_with_cert(
                tls.roots(),
                vec![cert.expect("our own PEM")],
                key.expect("our own PEM"),
            )
            .expect("our own certificate and key")
        })
    }

    /// This cluster's certificate authority as PEM (for a `--tls-root-cert` file); `None` for a
    /// cluster without TLS.
    pub fn tls_root_pem(&self) -> Option<&str> {
        self.tls.as_ref().map(|tls| tls.root.as_str())
    }

    /// The client certificate of [`CERT_ROLE`] and its private key, as PEM (for `--tls-cert`
    /// and `--tls-key` files); `None` for a cluster without TLS.
    pub fn client_cert_pem(&self) -> Option<(&str, &str)> {
        self.tls.as_ref().map(|tls| (tls.client_cert.as_str(), tls.client_key.as_str()))
    }

    /// [`TestCluster::config`] logging in as [`CERT_ROLE`] (to the `postgres` database).
    pub fn cert_role_config(&self) -> Config {
        let mut config = self.config();
        config.user(CERT_ROLE);
        config
    }

    /// Stops the server in fast mode (`pg_ctl stop -m fast`): sessions are terminated, the
    /// server shuts down cleanly, and this returns once it is down.
    pub fn stop(&self) -> io::Result<()> {
        self.cluster.stop("fast", PG_CTL_WAIT)
    }

    /// Starts the server again after [`TestCluster::stop`], on the same data directory and port,
    /// and returns once it accepts connections.
    pub fn start_again(&self) -> io::Result<()> {
        self.cluster.start()
    }

    /// [`TestCluster::stop`], then [`TestCluster::start_again`]. Every existing connection
    /// breaks.
    pub fn restart(&self) -> io::Result<()> {
        self.stop()?;
        self.start_again()
    }

    /// A superuser connection configuration (`postgres` user and database).
    pub fn config(&self) -> Config {
        self.cluster.config()
    }

    /// [`TestCluster::config`] as a URL: `postgres://postgres@127.0.0.1:<port>/postgres`.
    pub fn url(&self) -> String {
        self.cluster.url()
    }

    /// The TCP port, the same for the cluster's whole life.
    pub fn port(&self) -> u16 {
        self.cluster.port
    }

    /// The TCP address, `127.0.0.1:<port>`.
    pub fn tcp_addr(&self) -> SocketAddr {
        self.cluster.tcp_addr()
    }

    /// [`TestCluster::config`], but connecting to `addr` instead, e.g. a [`Proxy::addr`].
    pub fn config_via(&self, addr: SocketAddr) -> Config {
        redirect(&self.config(), addr)
    }

    /// The data directory (`PGDATA`).
    pub fn data_dir(&self) -> &Path {
        &self.cluster.data_dir
    }

    /// Opens a superuser connection (over TLS on a [`TestCluster::start_tls`] cluster). Its
    /// connection task is spawned on the current tokio runtime and ends when the client is
    /// dropped or the connection breaks.
    pub async fn connect(&self) -> Result<Client, tokio_postgres::Error> {
        let Some(tls) = self.tls_client_config() else {
            return connect_spawned(&self.config()).await;
        };
        let mut config = self.config();
        config.ssl_mode(tokio_postgres::config::SslMode::Require);
        let (client, _) = crate::connect::Tls::rustls(tls).connect(&config, "test", None).await?;
        Ok(client)
    }
}

// ---------------------------------------------------------------------------------------------
// Launcher
// ---------------------------------------------------------------------------------------------

/// A private cluster: the launcher behind both [`TestServer`] and [`TestCluster`].
///
/// Layout: `root/data` (`PGDATA`), `root/sock` (Unix socket directory), `root/server.log`.
/// Dropping it stops the server and deletes `root` ([`Cluster::shut_down`]); the shared
/// server's is never dropped, and is shut down by [`stop_shared_cluster`] at exit instead.
#[derive(Debug)]
struct Cluster {
    bin_dir: PathBuf,
    root: PathBuf,
    data_dir: PathBuf,
    socket_dir: PathBuf,
    log_file: PathBuf,
    /// The system user that runs the server commands when we are root.
    run_as: Option<SystemUser>,
    /// Chosen by [`Cluster::launch`], then fixed.
    port: u16,
    watchdog: Mutex<Option<Watchdog>>,
}

#[derive(Debug, Clone, Copy)]
struct SystemUser {
    uid: u32,
    gid: u32,
}

#[derive(Debug)]
struct Watchdog {
    child: Child,
    /// The write end of the watchdog's stdin. Never written to; closing it (by dropping it, or
    /// by this process dying) makes the watchdog clean up.
    stdin: ChildStdin,
}

impl Cluster {
    fn launch() -> io::Result<Cluster> {
        let bin_dir = find_bin_dir()?;
        let run_as = server_user()?;
        let root = std::env::temp_dir().join(format!(
            "pgfence-test-{}-{}",
            std::process::id(),
            &uuid::Uuid::new_v4().simple().to_string()[..12]
        ));
        fs::DirBuilder::new()
            .mode(0o700)
            .create(&root)
            .map_err(|e| annotate(e, format!("could not create {}", root.display())))?;
        let mut cluster = Cluster {
            bin_dir,
            data_dir: root.join("data"),
            socket_dir: root.join("sock"),
            log_file: root.join("server.log"),
            root,
            run_as,
            port: 0,
            watchdog: Mutex::new(None),
        };
        // From here on, an early return drops `cluster`, which deletes `root` and stops a
        // server started in it.
        fs::DirBuilder::new().mode(0o700).create(&cluster.socket_dir)?;
        cluster.give_to_server_user(&cluster.root)?;
        cluster.give_to_server_user(&cluster.socket_dir)?;
        // The watchdog comes before the first server command, so that nothing started after
        // it can outlive this process.
        *cluster.watchdog.get_mut().unwrap_or_else(PoisonError::into_inner) =
            Some(cluster.spawn_watchdog()?);
        cluster.initdb()?;
        cluster.configure()?;
        cluster.start_on_free_port()?;
        cluster.create_password_role()?;
        Ok(cluster)
    }

    fn config(&self) -> Config {
        let mut config = Config::new();
        config
            .host("127.0.0.1")
            .port(self.port)
            .user(SUPERUSER)
            .dbname(SUPERUSER)
            .connect_timeout(CONNECT_TIMEOUT);
        config
    }

    fn url(&self) -> String {
        format!("postgres://{SUPERUSER}@127.0.0.1:{}/{SUPERUSER}", self.port)
    }

    fn tcp_addr(&self) -> SocketAddr {
        SocketAddr::from((Ipv4Addr::LOCALHOST, self.port))
    }

    fn bin(&self, name: &str) -> PathBuf {
        self.bin_dir.join(name)
    }

    /// A command that runs as the server's system user, in the cluster's directory, with the
    /// C locale (so server messages are English and can be matched).
    fn command(&self, program: &Path) -> Command {
        let mut command = Command::new(program);
        command
            .current_dir(&self.root)
            .stdin(Stdio::null())
            .env("LC_ALL", "C")
            .env_remove("PGDATA")
            .env_remove("PGPORT")
            .env_remove("PGHOST");
        if let Some(user) = self.run_as {
            command.uid(user.uid).gid(user.gid);
        }
        command
    }

    fn give_to_server_user(&self, path: &Path) -> io::Result<()> {
        match self.run_as {
            Some(user) => std::os::unix::fs::chown(path, Some(user.uid), Some(user.gid))
                .map_err(|e| annotate(e, format!("could not chown {}", path.display()))),
            None => Ok(()),
        }
    }

    fn spawn_watchdog(&self) -> io::Result<Watchdog> {
        let mut command = Command::new("/bin/sh");
        command
            .arg("-c")
            .arg(WATCHDOG_SCRIPT)
            .arg("pgfence-test-watchdog")
            .arg(self.bin("pg_ctl"))
            .arg(&self.data_dir)
            .arg(&self.root)
            .current_dir("/")
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            // Its own process group: a Ctrl-C to the test's group must not kill it before it
            // has cleaned up.
            .process_group(0);
        if let Some(user) = self.run_as {
            command.uid(user.uid).gid(user.gid);
        }
        let mut child = command
            .spawn()
            .map_err(|e| annotate(e, "could not start the watchdog /bin/sh".to_owned()))?;
        // The pipe's write end is close-on-exec (std creates every descriptor so), so no other
        // child inherits it and our death really closes it.
        let stdin =
            child.stdin.take().ok_or_else(|| io::Error::other("watchdog has no stdin pipe"))?;
        Ok(Watchdog { child, stdin })
    }

    fn initdb(&self) -> io::Result<()> {
        run(
            self.command(&self.bin("initdb"))
                .arg("-D")
                .arg(&self.data_dir)
                .args(["-U", SUPERUSER, "--auth=trust", "-E", "UTF8", "--locale=C"])
                // The cluster is thrown away; the server itself still runs with fsync=on.
                .arg("--no-sync"),
            "initdb",
        )
    }

    /// Makes a certificate authority, a server certificate for `127.0.0.1` and `localhost` and
    /// a client certificate for [`CERT_ROLE`] (which it creates), turns TLS on, allows TCP over
    /// TLS only, and restarts the server (a reload would take effect some time after `pg_ctl
    /// reload` returns).
    fn enable_tls(&self) -> io::Result<TlsFiles> {
        let tls_error = |e: rcgen::Error| io::Error::other(format!("test certificates: {e}"));
        let mut ca_params = rcgen::CertificateParams::new(Vec::new()).map_err(tls_error)?;
        ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        ca_params.distinguished_name.push(rcgen::DnType::CommonName, "pgfence test CA");
        let ca = rcgen::CertifiedIssuer::self_signed(
            ca_params,
            rcgen::KeyPair::generate().map_err(tls_error)?,
        )
        .map_err(tls_error)?;
        let server_key = rcgen::KeyPair::generate().map_err(tls_error)?;
        let server_cert =
            rcgen::CertificateParams::new(vec!["127.0.0.1".to_owned(), "localhost".to_owned()])
                .map_err(tls_error)?
                .signed_by(&server_key, &ca)
                .map_err(tls_error)?;
        let client_key = rcgen::KeyPair::generate().map_err(tls_error)?;
        let mut client_params = rcgen::CertificateParams::new(Vec::new()).map_err(tls_error)?;
        client_params.distinguished_name.push(rcgen::DnType::CommonName, CERT_ROLE);
        let client_cert = client_params.signed_by(&client_key, &ca).map_err(tls_error)?;
        for (name, pem) in [
            ("server.crt", server_cert.pem()),
            ("server.key", server_key.serialize_pem()),
            ("root.crt", ca.pem()),
        ] {
            let path = self.data_dir.join(name);
            fs::write(&path, pem)?;
            // PostgreSQL refuses a key file that others may read.
            fs::set_permissions(&path, fs::Permissions::from_mode(0o600))?;
            self.give_to_server_user(&path)?;
        }
        self.run_sql(CREATE_CERT_ROLE_SQL, CERT_ROLE)?;
        let hba = self.data_dir.join("pg_hba.conf");
        fs::write(&hba, PG_HBA_CONF_TLS)?;
        let conf = self.data_dir.join("postgresql.conf");
        let mut text = fs::read_to_string(&conf)?;
        text.push_str(
            "ssl = on\nssl_cert_file = 'server.crt'\nssl_key_file = 'server.key'\n\
             ssl_ca_file = 'root.crt'\n",
        );
        fs::write(&conf, text)?;
        self.stop("fast", PG_CTL_WAIT)?;
        self.start()?;
        Ok(TlsFiles {
            root: ca.pem(),
            client_cert: client_cert.pem(),
            client_key: client_key.serialize_pem(),
        })
    }

    fn configure(&self) -> io::Result<()> {
        let hba = self.data_dir.join("pg_hba.conf");
        fs::write(&hba, PG_HBA_CONF)?;
        self.give_to_server_user(&hba)?;
        let socket_dir = self.socket_dir.to_string_lossy().replace('\'', "''");
        // max_connections: tests run in parallel, each with a pool plus renewal and standby
        // connections (see DESIGN.md, "Testing against real PostgreSQL").
        let settings = format!(
            "\n# Added by pgfence::testing.\n\
             listen_addresses = '127.0.0.1'\n\
             unix_socket_directories = '{socket_dir}'\n\
             max_connections = 400\n\
             shared_buffers = 64MB\n\
             fsync = on\n\
             password_encryption = 'scram-sha-256'\n"
        );
        let conf = self.data_dir.join("postgresql.conf");
        let mut text = fs::read_to_string(&conf)?;
        text.push_str(&settings);
        fs::write(&conf, text)?;
        self.give_to_server_user(&conf)
    }

    fn start_on_free_port(&mut self) -> io::Result<()> {
        let mut attempt = 1;
        loop {
            self.port = free_port()?;
            match self.start() {
                Ok(()) => return Ok(()),
                Err(e) if e.kind() == io::ErrorKind::AddrInUse && attempt < START_ATTEMPTS => {
                    attempt += 1;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// `pg_ctl start`, waiting until the server accepts connections. A port taken by someone
    /// else is reported as [`io::ErrorKind::AddrInUse`].
    fn start(&self) -> io::Result<()> {
        let log_start = fs::metadata(&self.log_file).map(|m| m.len()).unwrap_or(0);
        let output = self
            .command(&self.bin("pg_ctl"))
            .arg("start")
            .arg("-D")
            .arg(&self.data_dir)
            .arg("-l")
            .arg(&self.log_file)
            .args(["-w", "-t"])
            .arg(PG_CTL_WAIT.as_secs().to_string())
            .arg("-o")
            .arg(format!("-p {}", self.port))
            .output()
            .map_err(|e| annotate(e, "could not run pg_ctl start".to_owned()))?;
        if output.status.success() {
            return Ok(());
        }
        let log = log_tail(&self.log_file, log_start);
        let kind = if log.contains("could not bind")
            || log.contains("Address already in use")
            || log.contains("could not create any TCP/IP sockets")
        {
            io::ErrorKind::AddrInUse
        } else {
            io::ErrorKind::Other
        };
        Err(io::Error::new(
            kind,
            format!(
                "could not start PostgreSQL in {} on port {} ({}): {}{}\n--- end of {} ---\n{}",
                self.data_dir.display(),
                self.port,
                output.status,
                String::from_utf8_lossy(&output.stdout),
                String::from_utf8_lossy(&output.stderr),
                self.log_file.display(),
                log
            ),
        ))
    }

    /// `pg_ctl stop -m <mode>`, waiting at most `wait` for the server to be down.
    fn stop(&self, mode: &str, wait: Duration) -> io::Result<()> {
        run(
            self.command(&self.bin("pg_ctl"))
                .arg("stop")
                .arg("-D")
                .arg(&self.data_dir)
                .args(["-m", mode, "-w", "-t"])
                .arg(wait.as_secs().to_string()),
            "pg_ctl stop",
        )
    }

    /// Stops the server in immediate mode, waits until its postmaster has exited, deletes
    /// `root`, then releases the watchdog, which finds nothing left to do, and reaps it.
    ///
    /// Best effort, bounded (see [`SHUT_DOWN_WAIT`]) and never panicking: it runs on drop and,
    /// for the shared cluster, while the process exits. The server may not be running (stopped
    /// by the test, or never started), and the watchdog retries both steps anyway.
    fn shut_down(&self) {
        let postmaster = self.postmaster_pid();
        if self.stop("immediate", SHUT_DOWN_WAIT).is_ok() {
            if let Some(pid) = postmaster {
                // `pg_ctl stop -w` returns once `postmaster.pid` is gone, which the postmaster
                // deletes (after all its children have exited) a moment before it exits itself.
                // It is not our child (`pg_ctl` daemonizes it), so poll. Should its pid be
                // reused in that moment, this only waits out its bound.
                wait_until(REAP_WAIT, || !is_running(pid));
            }
        }
        let _ = fs::remove_dir_all(&self.root);
        let watchdog = self.watchdog.lock().unwrap_or_else(PoisonError::into_inner).take();
        if let Some(Watchdog { mut child, stdin }) = watchdog {
            // Releasing the watchdog finds nothing left to do; wait (bounded) so it is reaped.
            drop(stdin);
            wait_until(REAP_WAIT, || !matches!(child.try_wait(), Ok(None)));
        }
    }

    /// The postmaster's process id, from `postmaster.pid`; `None` when the server is not
    /// running (or the file is unreadable).
    fn postmaster_pid(&self) -> Option<u32> {
        let pid_file = fs::read_to_string(self.data_dir.join("postmaster.pid")).ok()?;
        pid_file.lines().next()?.trim().parse().ok()
    }

    fn create_password_role(&self) -> io::Result<()> {
        self.run_sql(CREATE_PASSWORD_ROLE_SQL, PASSWORD_ROLE)
    }

    /// Runs `sql` as the superuser over plain TCP, creating `role`.
    fn run_sql(&self, sql: &'static str, role: &str) -> io::Result<()> {
        let config = self.config();
        // This may be called from inside a tokio runtime (a test calling `shared()`), where
        // blocking on a future is not allowed: run the SQL on a thread of its own.
        thread::spawn(move || -> io::Result<()> {
            let runtime = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
            runtime.block_on(async {
                let client = connect_spawned(&config).await.map_err(io::Error::other)?;
                client.batch_execute(sql).await.map_err(io::Error::other)
            })
        })
        .join()
        .map_err(|_| io::Error::other(format!("the thread creating role {role} panicked")))?
        .map_err(|e| annotate(e, format!("could not create role {role}")))
    }
}

impl TlsFiles {
    fn roots(&self) -> rustls::RootCertStore {
        use rustls::pki_types::{CertificateDer, pem::PemObject};
        let mut roots = rustls::RootCertStore::empty();
        let root = CertificateDer::from_pem_slice(self.root.as_bytes()).expect("our own PEM");
        roots.add(root).expect("the cluster's own CA certificate");
        roots
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        self.shut_down();
    }
}

/// Calls `done` every 10 ms until it returns true or `limit` has passed.
fn wait_until(limit: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !done() && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(10));
    }
}

/// Whether process `pid` is running: it exists and has not exited. A zombie (exited, not yet
/// reaped by its parent) holds no port, memory or file any more, so it does not count.
fn is_running(pid: u32) -> bool {
    // "pid (comm) state ...": the command name may hold spaces and parentheses, so the state is
    // the first field after the last ')'.
    fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        let state = stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().next());
        !matches!(state, None | Some("Z" | "X" | "x"))
    })
}

/// The directory holding `initdb`, `pg_ctl` and `postgres`: the first such directory on
/// `PATH`, else the newest `/usr/lib/postgresql/<version>/bin`.
fn find_bin_dir() -> io::Result<PathBuf> {
    const TOOLS: [&str; 3] = ["initdb", "pg_ctl", "postgres"];
    let has_tools = |dir: &Path| TOOLS.iter().all(|tool| is_executable(&dir.join(tool)));
    let on_path = std::env::var_os("PATH")
        .and_then(|path| std::env::split_paths(&path).find(|dir| has_tools(dir)));
    if let Some(dir) = on_path {
        return Ok(dir);
    }
    let mut newest: Option<(Vec<u32>, PathBuf)> = None;
    if let Ok(entries) = fs::read_dir("/usr/lib/postgresql") {
        for entry in entries.flatten() {
            let name = entry.file_name();
            // "15", "9.6": compare numerically, part by part.
            let Some(version) =
                name.to_str().and_then(|v| v.split('.').map(|part| part.parse().ok()).collect())
            else {
                continue;
            };
            let dir = entry.path().join("bin");
            if has_tools(&dir) && newest.as_ref().is_none_or(|(best, _)| version > *best) {
                newest = Some((version, dir));
            }
        }
    }
    newest.map(|(_, dir)| dir).ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::NotFound,
            "no PostgreSQL server binaries (initdb, pg_ctl, postgres) on PATH or in \
             /usr/lib/postgresql/<version>/bin: install PostgreSQL (e.g. `apt-get install \
             postgresql`) or set DATABASE_URL to a server the tests may use",
        )
    })
}

fn is_executable(path: &Path) -> bool {
    fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// `None` when we may run the server ourselves; the `postgres` system user when we are root,
/// which PostgreSQL refuses to run as.
fn server_user() -> io::Result<Option<SystemUser>> {
    if effective_uid()? != 0 {
        return Ok(None);
    }
    let passwd = fs::read_to_string("/etc/passwd").unwrap_or_default();
    passwd
        .lines()
        .find_map(|line| {
            let fields: Vec<&str> = line.split(':').collect();
            match fields.as_slice() {
                [name, _, uid, gid, ..] if *name == SUPERUSER => {
                    Some(SystemUser { uid: uid.parse().ok()?, gid: gid.parse().ok()? })
                }
                _ => None,
            }
        })
        .map(Some)
        .ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::NotFound,
                "the tests run as root, which PostgreSQL refuses to run as, and there is no \
                 `postgres` system user in /etc/passwd to run the private test cluster as: \
                 create one (the `postgresql` package does), run the tests as another user, \
                 or set DATABASE_URL",
            )
        })
}

fn effective_uid() -> io::Result<u32> {
    // "Uid:\treal\teffective\tsaved\tfilesystem"
    if let Ok(status) = fs::read_to_string("/proc/self/status") {
        let euid = status
            .lines()
            .find_map(|line| line.strip_prefix("Uid:"))
            .and_then(|ids| ids.split_whitespace().nth(1))
            .and_then(|euid| euid.parse().ok());
        if let Some(euid) = euid {
            return Ok(euid);
        }
    }
    let output = Command::new("id")
        .arg("-u")
        .output()
        .map_err(|e| annotate(e, "could not run `id -u`".to_owned()))?;
    String::from_utf8_lossy(&output.stdout)
        .trim()
        .parse()
        .map_err(|_| io::Error::other("could not find out the user id (`id -u`)"))
}

fn free_port() -> io::Result<u16> {
    // The port is free now; the server binds it a moment later, and `start_on_free_port`
    // retries in the rare case someone took it in between.
    Ok(std::net::TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?.local_addr()?.port())
}

fn run(command: &mut Command, what: &str) -> io::Result<()> {
    let output = command.output().map_err(|e| annotate(e, format!("could not run {what}")))?;
    if output.status.success() {
        Ok(())
    } else {
        Err(io::Error::other(format!(
            "{what} failed ({}): {}{}",
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        )))
    }
}

/// The last lines of the server log written since byte `from`.
fn log_tail(path: &Path, from: u64) -> String {
    const MAX_BYTES: u64 = 8 * 1024;
    let Ok(mut file) = fs::File::open(path) else {
        return "(no server log)".to_owned();
    };
    let len = file.metadata().map(|m| m.len()).unwrap_or(0);
    let start = from.max(len.saturating_sub(MAX_BYTES));
    let mut bytes = Vec::new();
    if file.seek(SeekFrom::Start(start)).is_err() || file.read_to_end(&mut bytes).is_err() {
        return "(server log unreadable)".to_owned();
    }
    String::from_utf8_lossy(&bytes).into_owned()
}

fn annotate(error: io::Error, context: String) -> io::Error {
    io::Error::new(error.kind(), format!("{context}: {error}"))
}

// ---------------------------------------------------------------------------------------------
// Connection helpers
// ---------------------------------------------------------------------------------------------

async fn connect_spawned(config: &Config) -> Result<Client, tokio_postgres::Error> {
    let (client, connection) = config.connect(NoTls).await?;
    // A connection error also fails the client's next call (or marks it closed), which is
    // where tests look; nothing to report here.
    tokio::spawn(async move {
        let _ = connection.await;
    });
    Ok(client)
}

/// `config` with its hosts and ports replaced by `addr` (for example a [`Proxy`]'s):
/// `Config::host` and `port` add to the host lists, so everything else is copied into a fresh
/// configuration.
pub fn redirect(config: &Config, addr: SocketAddr) -> Config {
    let mut out = Config::new();
    out.host(addr.ip().to_string()).port(addr.port());
    if let Some(user) = config.get_user() {
        out.user(user);
    }
    if let Some(password) = config.get_password() {
        out.password(password);
    }
    if let Some(dbname) = config.get_dbname() {
        out.dbname(dbname);
    }
    if let Some(options) = config.get_options() {
        out.options(options);
    }
    if let Some(name) = config.get_application_name() {
        out.application_name(name);
    }
    if let Some(timeout) = config.get_connect_timeout() {
        out.connect_timeout(*timeout);
    }
    out.ssl_mode(config.get_ssl_mode()).channel_binding(config.get_channel_binding());
    out
}

fn external_tcp_addr(config: &Config) -> io::Result<SocketAddr> {
    let port = config.get_ports().first().copied().unwrap_or(5432);
    if let Some(ip) = config.get_hostaddrs().first() {
        return Ok(SocketAddr::new(*ip, port));
    }
    match config.get_hosts().first() {
        Some(Host::Tcp(host)) => {
            if let Ok(ip) = host.parse::<IpAddr>() {
                return Ok(SocketAddr::new(ip, port));
            }
            (host.as_str(), port).to_socket_addrs()?.next().ok_or_else(|| {
                io::Error::new(io::ErrorKind::NotFound, format!("{host} has no address"))
            })
        }
        _ => Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "DATABASE_URL names no TCP host (a Unix socket has no TCP address)",
        )),
    }
}

fn quote_ident(name: &str) -> String {
    format!("\"{}\"", name.replace('"', "\"\""))
}

/// A name for a test's own table, schema or database: `prefix` made identifier-safe, then `_`
/// and 16 random hex digits.
///
/// The result is lowercase `[a-z0-9_]`, starts with a letter (a `t` is put in front
/// otherwise), is at most 40 characters long (the prefix is shortened to fit) and is unique
/// across calls and processes with overwhelming probability, so it needs no quoting and
/// reruns never meet leftovers.
pub fn unique_name(prefix: &str) -> String {
    const MAX_LEN: usize = 40;
    const RANDOM_HEX: usize = 16;
    let mut name: String = prefix
        .chars()
        .map(|c| match c.to_ascii_lowercase() {
            c @ ('a'..='z' | '0'..='9' | '_') => c,
            _ => '_',
        })
        .collect();
    if !name.starts_with(|c: char| c.is_ascii_lowercase()) {
        name.insert(0, 't');
    }
    // All ASCII by now, so truncating bytes cuts no character.
    name.truncate(MAX_LEN - RANDOM_HEX - 1);
    name.push('_');
    name.push_str(&format!("{:016x}", uuid::Uuid::new_v4().as_u128() as u64));
    name
}

// ---------------------------------------------------------------------------------------------
// Proxy
// ---------------------------------------------------------------------------------------------

/// A fault-injecting TCP proxy between clients and a server, on loopback (or on the address
/// given to [`Proxy::start_on`]).
///
/// Each accepted connection is forwarded to the upstream address. While it runs, a test can
/// delay every chunk of data ([`Proxy::set_delay`]), refuse new connections
/// ([`Proxy::set_refuse`]), abruptly close every current connection ([`Proxy::cut_all`]),
/// corrupt what the server sends on one of them ([`Proxy::corrupt_next_reply`]), or hold back
/// the data of one connection ([`Proxy::stall`]), of all ([`Proxy::hang`]), what the clients
/// send ([`Proxy::hang_requests`]), or what new sessions send after their startup
/// ([`Proxy::hang_after_client_chunks`]).
///
/// The accept loop and one task per connection run on the tokio runtime that called
/// [`Proxy::start`] (multi-thread or current-thread; it must have time enabled, as
/// `#[tokio::test]` runtimes do). Delays are timed by one thread of the proxy's own (for
/// sub-millisecond accuracy; tokio timers tick in milliseconds). Dropping the proxy aborts the tasks and stops and joins that thread:
/// nothing keeps running, and every proxied connection is closed.
#[derive(Debug)]
pub struct Proxy {
    addr: SocketAddr,
    upstream: SocketAddr,
    shared: Arc<ProxyShared>,
    accept_task: AbortHandle,
    /// The timer thread, joined on drop.
    timer_thread: Option<thread::JoinHandle<()>>,
}

#[derive(Debug)]
struct ProxyShared {
    /// One-way delay in nanoseconds.
    delay_nanos: AtomicU64,
    refuse: AtomicBool,
    /// The upstream-side local port of the connection whose next chunk from the server is to be
    /// corrupted; 0 for none.
    corrupt_port: AtomicU32,
    /// Upstream-side local ports of the connections whose data is held back.
    stalled_ports: Mutex<HashSet<u32>>,
    /// Set when every connection's data is held back ([`Proxy::hang`]).
    hung: AtomicBool,
    /// Set when what every client sends is held back ([`Proxy::hang_requests`]).
    requests_hung: AtomicBool,
    /// Chunks held back so far, for good ([`Proxy::held`]).
    held: AtomicU64,
    /// How many chunks a new connection's client may send before the rest is held back
    /// ([`Proxy::hang_after_client_chunks`]); `u32::MAX` for no limit.
    client_chunks: AtomicU32,
    connections: Mutex<Connections>,
    timer: DelayTimer,
}

#[derive(Debug, Default)]
struct Connections {
    next_id: u64,
    tasks: HashMap<u64, AbortHandle>,
    /// Set when the proxy is dropped. Aborting the accept task takes effect only at its next
    /// await, so it may still be about to register a connection: it checks this first.
    closed: bool,
}

impl ProxyShared {
    fn delay(&self) -> Duration {
        Duration::from_nanos(self.delay_nanos.load(Ordering::Relaxed))
    }

    fn connections(&self) -> std::sync::MutexGuard<'_, Connections> {
        self.connections.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Proxy {
    /// Starts a proxy listening on `127.0.0.1` (a free port) that forwards to `upstream`.
    ///
    /// Must be called within a tokio runtime.
    pub async fn start(upstream: SocketAddr) -> io::Result<Proxy> {
        Proxy::start_on(Ipv4Addr::LOCALHOST.into(), upstream).await
    }

    /// [`Proxy::start`], listening on `ip` (a free port) instead: an address of another
    /// interface, for clients on the far side of it.
    pub async fn start_on(ip: IpAddr, upstream: SocketAddr) -> io::Result<Proxy> {
        let listener = TcpListener::bind((ip, 0)).await?;
        let addr = listener.local_addr()?;
        let (timer, timer_thread) = DelayTimer::start()?;
        let shared = Arc::new(ProxyShared {
            delay_nanos: AtomicU64::new(0),
            refuse: AtomicBool::new(false),
            corrupt_port: AtomicU32::new(0),
            stalled_ports: Mutex::new(HashSet::new()),
            hung: AtomicBool::new(false),
            requests_hung: AtomicBool::new(false),
            held: AtomicU64::new(0),
            client_chunks: AtomicU32::new(u32::MAX),
            connections: Mutex::new(Connections::default()),
            timer,
        });
        let accept_task =
            tokio::spawn(accept_loop(listener, upstream, Arc::clone(&shared))).abort_handle();
        Ok(Proxy { addr, upstream, shared, accept_task, timer_thread: Some(timer_thread) })
    }

    /// The address clients connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The address connections are forwarded to.
    pub fn upstream(&self) -> SocketAddr {
        self.upstream
    }

    /// Delays every chunk forwarded in either direction by `one_way` (so a request and its
    /// answer take at least twice that). Order is kept and throughput is not limited: chunks
    /// are read as they arrive, and each is written out when its own delay has passed. Applies
    /// to data read from now on, also on existing connections. Zero (the default) turns it off.
    ///
    /// The delay is a lower bound, and it holds to a fraction of a millisecond also below a
    /// millisecond: a chunk goes out typically 0.1–0.2 ms after it is due (the kernel's timer
    /// slack and two thread wake-ups; more on a loaded machine or a virtual one), on top of the
    /// ~50 µs the extra hop costs anyway. Measure the round trip rather than assume it.
    pub fn set_delay(&self, one_way: Duration) {
        let nanos = u64::try_from(one_way.as_nanos()).unwrap_or(u64::MAX);
        self.shared.delay_nanos.store(nanos, Ordering::Relaxed);
    }

    /// Abruptly closes every current connection, in both directions, dropping data in flight.
    /// New connections are accepted as usual.
    pub fn cut_all(&self) {
        let tasks = std::mem::take(&mut self.shared.connections().tasks);
        for task in tasks.values() {
            task.abort();
        }
    }

    /// While `refuse` is true, new connections are accepted and closed at once, without
    /// contacting the upstream. Existing connections are not affected.
    pub fn set_refuse(&self, refuse: bool) {
        self.shared.refuse.store(refuse, Ordering::Relaxed);
    }

    /// Flips one bit of the next chunk of data the server sends on one connection: the one
    /// whose server session reports `client_port` as its `pg_stat_activity.client_port` (the
    /// proxy's side of that connection). Over TLS the client's decryption of it fails.
    pub fn corrupt_next_reply(&self, client_port: u16) {
        self.shared.corrupt_port.store(u32::from(client_port), Ordering::SeqCst);
    }

    /// Holds back everything either side sends from now on, on one connection: the one whose
    /// server session reports `client_port` as its `pg_stat_activity.client_port`. The
    /// connection stays up and nothing is refused, as through a NAT or firewall that silently
    /// dropped it, or a middlebox that hangs.
    pub fn stall(&self, client_port: u16) {
        let mut stalled = self.shared.stalled_ports.lock().unwrap_or_else(PoisonError::into_inner);
        stalled.insert(u32::from(client_port));
    }

    /// Holds back everything either side sends from now on, on every connection, current and
    /// new ones alike: as a server that hung (its kernel still accepts connections and
    /// acknowledges data, but nothing answers), or a middlebox that did. Nothing is refused or
    /// closed.
    pub fn hang(&self) {
        self.shared.hung.store(true, Ordering::SeqCst);
    }

    /// Holds back everything the clients send from now on, on every connection, current and
    /// new ones alike, while what the server sends still passes: a server that answered what
    /// it had and then hung, as its clients see it.
    pub fn hang_requests(&self) {
        self.shared.requests_hung.store(true, Ordering::SeqCst);
    }

    /// How many chunks of data (as read, in either direction) the proxy has held back for good
    /// so far: by [`Proxy::stall`], [`Proxy::hang`], [`Proxy::hang_requests`] or
    /// [`Proxy::hang_after_client_chunks`].
    pub fn held(&self) -> u64 {
        self.shared.held.load(Ordering::SeqCst)
    }

    /// On connections made from now on, forwards only the first `n` chunks of data the client
    /// sends (read as they arrive) and holds back the rest; what the server sends passes. With
    /// `n = 1` and a role that needs no password, the server answers the startup and nothing
    /// after it: a session that hangs right after it began.
    pub fn hang_after_client_chunks(&self, n: u32) {
        self.shared.client_chunks.store(n, Ordering::SeqCst);
    }

    /// The number of connections currently being forwarded.
    pub fn connection_count(&self) -> usize {
        self.shared.connections().tasks.len()
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept_task.abort();
        self.shared.connections().closed = true;
        self.cut_all();
        self.shared.timer.stop();
        if let Some(timer_thread) = self.timer_thread.take() {
            // Prompt: the thread wakes for the stop request and never blocks on anything else.
            let _ = timer_thread.join();
        }
    }
}

/// Wakes the proxy's writers when their chunks are due, from a thread of its own.
///
/// Why not tokio timers: they have a resolution of 1 ms and round every deadline up to the
/// next tick, so a 100 µs delay became about 1.1 ms per direction and a round trip below ~2.5 ms
/// could not be emulated. A plain thread blocking with a timeout (a futex wait, like
/// `std::thread::sleep`) is woken by a high-resolution kernel timer, typically 50–100 µs late
/// (the default timer slack is 50 µs; a hypervisor adds to it), and uses no CPU while it waits:
/// unlike spinning out the last sub-millisecond on the runtime, this costs nothing on a machine
/// whose few cores the server and the client share (a spin per chunk in flight would take a
/// core from the server the benches measure). Waking the writer's task from this thread adds
/// one more thread wake-up. One thread serves every connection of a proxy; it only times, the
/// tokio tasks still do all the I/O, so it works the same on current-thread and multi-thread
/// runtimes.
#[derive(Debug)]
struct DelayTimer {
    requests: std_mpsc::Sender<TimerRequest>,
}

#[derive(Debug)]
enum TimerRequest {
    /// Send on `waker` once `due` has passed.
    Wake { due: Instant, waker: oneshot::Sender<()> },
    /// End the thread (the proxy is dropped). Pending wakers are dropped, which their waiting
    /// tasks (aborted by then) would see as an error.
    Stop,
}

impl DelayTimer {
    fn start() -> io::Result<(DelayTimer, thread::JoinHandle<()>)> {
        let (requests, incoming) = std_mpsc::channel();
        let thread = thread::Builder::new()
            .name("pgfence-proxy-timer".to_owned())
            .spawn(move || DelayTimer::run(incoming))?;
        Ok((DelayTimer { requests }, thread))
    }

    fn run(incoming: std_mpsc::Receiver<TimerRequest>) {
        // Keyed by due time, then arrival (equal due times are kept, in order).
        let mut pending: BTreeMap<(Instant, u64), oneshot::Sender<()>> = BTreeMap::new();
        let mut arrivals: u64 = 0;
        loop {
            let now = Instant::now();
            while let Some(entry) = pending.first_entry() {
                if entry.key().0 > now {
                    break;
                }
                // The task may have gone (its connection cut): nothing to wake then.
                let _ = entry.remove().send(());
            }
            let request = match pending.first_key_value() {
                Some((&(next_due, _), _)) => {
                    match incoming.recv_timeout(next_due.saturating_duration_since(now)) {
                        Ok(request) => request,
                        Err(std_mpsc::RecvTimeoutError::Timeout) => continue,
                        Err(std_mpsc::RecvTimeoutError::Disconnected) => return,
                    }
                }
                None => match incoming.recv() {
                    Ok(request) => request,
                    Err(std_mpsc::RecvError) => return,
                },
            };
            match request {
                TimerRequest::Wake { due, waker } => {
                    pending.insert((due, arrivals), waker);
                    arrivals += 1;
                }
                TimerRequest::Stop => return,
            }
        }
    }

    /// Returns once `due` has passed.
    async fn sleep_until(&self, due: Instant) {
        if due <= Instant::now() {
            return;
        }
        let (waker, woken) = oneshot::channel();
        let sent = self.requests.send(TimerRequest::Wake { due, waker }).is_ok();
        if !sent || woken.await.is_err() {
            // The timer thread has stopped: the proxy is being dropped and this task is about
            // to be aborted. Never shorten a delay, even then.
            tokio::time::sleep_until(due.into()).await;
        }
    }

    fn stop(&self) {
        let _ = self.requests.send(TimerRequest::Stop);
    }
}

async fn accept_loop(listener: TcpListener, upstream: SocketAddr, shared: Arc<ProxyShared>) {
    loop {
        let client = match listener.accept().await {
            Ok((client, _)) => client,
            Err(_) => {
                // E.g. out of file descriptors: back off instead of spinning.
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        if shared.refuse.load(Ordering::Relaxed) {
            drop(client);
            continue;
        }
        let mut connections = shared.connections();
        if connections.closed {
            return;
        }
        let id = connections.next_id;
        connections.next_id += 1;
        let task_shared = Arc::clone(&shared);
        // The lock is held across the spawn, so the task's removal of its entry (if it ends at
        // once, on another worker) waits until the entry is there.
        let task = tokio::spawn(async move {
            let _ = forward(client, upstream, &task_shared).await;
            task_shared.connections().tasks.remove(&id);
        });
        connections.tasks.insert(id, task.abort_handle());
    }
}

/// Forwards one connection until both directions have ended, or until either fails (then the
/// whole connection is dropped, closing both sockets).
async fn forward(client: TcpStream, upstream: SocketAddr, shared: &ProxyShared) -> io::Result<()> {
    let server = TcpStream::connect(upstream).await?;
    client.set_nodelay(true)?;
    server.set_nodelay(true)?;
    let port = u32::from(server.local_addr()?.port());
    let client_chunks = shared.client_chunks.load(Ordering::SeqCst);
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    tokio::try_join!(
        pump(client_read, server_write, shared, port, false, client_chunks),
        pump(server_read, client_write, shared, port, true, u32::MAX),
    )?;
    Ok(())
}

/// One direction of a connection. The reader stamps each chunk with its due time and queues
/// it; the writer writes each chunk once it is due (woken by the proxy's [`DelayTimer`]). The
/// two run concurrently, so a delay adds latency without limiting throughput, and the queue
/// keeps the order. `port`: the connection's port on the server side (see
/// [`Proxy::corrupt_next_reply`] and [`Proxy::stall`]); `from_server`: the direction;
/// `passing`: how many chunks pass before the rest is held back
/// ([`Proxy::hang_after_client_chunks`]; `u32::MAX`: all).
async fn pump(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    shared: &ProxyShared,
    port: u32,
    from_server: bool,
    mut passing: u32,
) -> io::Result<()> {
    let (tx, mut rx) = mpsc::unbounded_channel::<(Instant, Vec<u8>)>();
    let read = async move {
        // Owned by this block, so end-of-file drops it and the writer sees the queue end.
        let tx = tx;
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            let n = from.read(&mut buf).await?;
            if n == 0 {
                return Ok::<(), io::Error>(());
            }
            let stalled = shared.hung.load(Ordering::SeqCst)
                || passing == 0
                || (!from_server && shared.requests_hung.load(Ordering::SeqCst))
                || shared
                    .stalled_ports
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .contains(&port);
            if stalled {
                shared.held.fetch_add(1, Ordering::SeqCst);
            }
            if passing != u32::MAX {
                passing = passing.saturating_sub(1);
            }
            // Held back for a day: in effect never, as the proxy is dropped long before.
            let delay = if stalled { Duration::from_secs(86_400) } else { shared.delay() };
            let due = Instant::now() + delay;
            let mut chunk = buf[..n].to_vec();
            if from_server {
                let corrupt = &shared.corrupt_port;
                if corrupt.compare_exchange(port, 0, Ordering::SeqCst, Ordering::SeqCst).is_ok() {
                    chunk[n - 1] ^= 1;
                }
            }
            if tx.send((due, chunk)).is_err() {
                // The writer has failed; `try_join!` reports its error.
                return Ok(());
            }
        }
    };
    let write = async move {
        while let Some((due, chunk)) = rx.recv().await {
            shared.timer.sleep_until(due).await;
            to.write_all(&chunk).await?;
        }
        // Pass the half-close on: the peer sees end-of-file after the last chunk.
        to.shutdown().await
    };
    tokio::try_join!(read, write)?;
    Ok(())
}
