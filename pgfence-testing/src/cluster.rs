//! Private temporary clusters: [`TestCluster`], and the launcher behind it and the shared
//! server.

use std::fs;
use std::io::{self, Read, Seek, SeekFrom};
use std::net::{Ipv4Addr, SocketAddr};
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::{Mutex, PoisonError};
use std::thread;
use std::time::{Duration, Instant};

use pgfence::rustls;
use tokio_postgres::{Client, Config};

use crate::{CERT_ROLE, PASSWORD_ROLE, connect_spawned, redirect};

/// The superuser of private clusters (`initdb -U`), also the system user that runs them when
/// the tests run as root.
pub(crate) const SUPERUSER: &str = "postgres";

/// How many free ports a private cluster tries before giving up. A port found free can be
/// taken by someone else before the server binds it; that is rare, so a few tries suffice.
pub(crate) const START_ATTEMPTS: usize = 5;

/// Connect timeout of every configuration handed out here: a test waiting on a dead server
/// fails instead of hanging.
pub(crate) const CONNECT_TIMEOUT: Duration = Duration::from_secs(30);

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
local   replication  all                          trust
host    replication  all           127.0.0.1/32   trust
";

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

/// How long `pg_ctl` waits for a server to start, or to stop in fast mode (`-t`).
const PG_CTL_WAIT: Duration = Duration::from_secs(60);

/// How long the end of a cluster ([`Cluster::shut_down`]) waits for the immediate stop (`pg_ctl
/// -t`); then for the postmaster's exit, and for the watchdog's, [`REAP_WAIT`] each. Bounded,
/// because for the shared cluster this delays the exit of the process: [`SHUT_DOWN_WAIT`] plus
/// twice [`REAP_WAIT`] is the "about 20 s" of the crate docs. An immediate stop takes milliseconds
/// (the postmaster `SIGKILL`s children that have not quit after 5 s).
const SHUT_DOWN_WAIT: Duration = Duration::from_secs(10);

/// See [`SHUT_DOWN_WAIT`].
pub(crate) const REAP_WAIT: Duration = Duration::from_secs(5);

/// The watchdog of a private cluster (see the crate docs). Arguments: `$1` the `pg_ctl`
/// binary, `$2` the data directory, `$3` the cluster's directory to delete.
const WATCHDOG_SCRIPT: &str = r#"cat >/dev/null 2>&1
"$1" stop -D "$2" -m immediate -w -t 10 >/dev/null 2>&1
rm -rf "$3"
"#;

// ---------------------------------------------------------------------------------------------
// Caller-owned cluster
// ---------------------------------------------------------------------------------------------

/// A private temporary PostgreSQL cluster owned by the caller, for tests that stop, restart or
/// otherwise hurt the server.
///
/// Always private, also when `DATABASE_URL` is set. Made like the private shared server (see
/// the [crate docs](crate)). Dropping it stops the server (immediate mode) and deletes its
/// directory; if the process dies first, the watchdog does that.
///
/// The methods that run `pg_ctl` block; from async code that is acceptable in tests.
#[derive(Debug)]
pub struct TestCluster {
    pub(crate) cluster: Cluster,
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
    /// A cluster without TLS, around one made by the launcher.
    pub(crate) fn from_cluster(cluster: Cluster) -> TestCluster {
        TestCluster { cluster, tls: None }
    }

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
        self.tls.as_ref().map(|tls| pgfence::tls_client_config(tls.roots()))
    }

    /// [`TestCluster::tls_client_config`], also presenting the client certificate of
    /// [`CERT_ROLE`]; `None` for a cluster without TLS.
    pub fn tls_client_config_with_cert(&self) -> Option<rustls::ClientConfig> {
        use rustls::pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject};
        self.tls.as_ref().map(|tls| {
            let cert = CertificateDer::from_pem_slice(tls.client_cert.as_bytes());
            let key = PrivateKeyDer::from_pem_slice(tls.client_key.as_bytes());
            pgfence::tls_client_config_with_cert(
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

    /// Stops the server in immediate mode (`pg_ctl stop -m immediate`), as a crash would: sessions
    /// are killed, nothing more is written or sent to a replica, and the next start recovers
    /// from the WAL. Returns once the server is down.
    pub fn crash(&self) -> io::Result<()> {
        self.cluster.stop("immediate", PG_CTL_WAIT)
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

    /// [`TestCluster::config`], but connecting to `addr` instead, e.g. a
    /// [`Proxy::addr`](crate::Proxy::addr).
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
        let tls = tokio_postgres_rustls::MakeRustlsConnect::new(tls);
        let (client, connection) = config.connect(tls).await?;
        // As in `connect_spawned`: a broken connection fails the client's next call.
        tokio::spawn(async move {
            let _ = connection.await;
        });
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
pub(crate) struct Cluster {
    bin_dir: PathBuf,
    root: PathBuf,
    pub(crate) data_dir: PathBuf,
    socket_dir: PathBuf,
    log_file: PathBuf,
    /// The system user that runs the server commands when we are root.
    run_as: Option<SystemUser>,
    /// Chosen by [`Cluster::launch`], then fixed.
    pub(crate) port: u16,
    watchdog: Mutex<Option<Watchdog>>,
}

#[derive(Debug, Clone, Copy)]
pub(crate) struct SystemUser {
    pub(crate) uid: u32,
    pub(crate) gid: u32,
}

#[derive(Debug)]
struct Watchdog {
    child: Child,
    /// The write end of the watchdog's stdin. Never written to; closing it (by dropping it, or
    /// by this process dying) makes the watchdog clean up.
    stdin: ChildStdin,
}

impl Cluster {
    pub(crate) fn launch() -> io::Result<Cluster> {
        let mut cluster = Cluster::prepare()?;
        cluster.initdb()?;
        cluster.configure()?;
        cluster.start_on_free_port()?;
        cluster.create_password_role()?;
        Ok(cluster)
    }

    /// A hot standby streaming from `primary` (see [`crate::ReplicatedCluster`]).
    ///
    /// Its data directory is a copy of the primary's, taken while the primary is stopped in
    /// fast mode. A cleanly stopped data directory is a valid base backup, and copying it needs
    /// no `pg_basebackup`, which the server-only packages of the version matrix lack. The
    /// primary is started again on its port whatever the copy's outcome.
    pub(crate) fn launch_replica(primary: &Cluster) -> io::Result<Cluster> {
        let mut cluster = Cluster::prepare()?;
        primary.stop("fast", PG_CTL_WAIT)?;
        let copied = run(
            cluster
                .command(Path::new("cp"))
                .arg("-a")
                .arg(&primary.data_dir)
                .arg(&cluster.data_dir),
            "cp -a (copy of the primary's data directory)",
        );
        primary.start()?;
        copied?;
        // Appended after the primary's settings, so this socket directory wins.
        cluster.configure()?;
        let conf = cluster.data_dir.join("postgresql.conf");
        let mut text = fs::read_to_string(&conf)?;
        text.push_str(&format!(
            "primary_conninfo = 'host=127.0.0.1 port={} user={SUPERUSER} \
             application_name=pgfence_replica'\nhot_standby = on\n",
            primary.port
        ));
        fs::write(&conf, text)?;
        let signal = cluster.data_dir.join("standby.signal");
        fs::write(&signal, "")?;
        cluster.give_to_server_user(&signal)?;
        cluster.start_on_free_port()?;
        Ok(cluster)
    }

    /// `pg_ctl promote`, waiting until the server accepts writes.
    pub(crate) fn promote(&self) -> io::Result<()> {
        run(
            self.command(&self.bin("pg_ctl"))
                .arg("promote")
                .arg("-D")
                .arg(&self.data_dir)
                .args(["-w", "-t"])
                .arg(PG_CTL_WAIT.as_secs().to_string()),
            "pg_ctl promote",
        )
    }

    /// The directories, the watchdog and the struct of a new cluster, before its data directory
    /// exists.
    fn prepare() -> io::Result<Cluster> {
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
        Ok(cluster)
    }

    pub(crate) fn config(&self) -> Config {
        let mut config = Config::new();
        config
            .host("127.0.0.1")
            .port(self.port)
            .user(SUPERUSER)
            .dbname(SUPERUSER)
            .connect_timeout(CONNECT_TIMEOUT);
        config
    }

    pub(crate) fn url(&self) -> String {
        format!("postgres://{SUPERUSER}@127.0.0.1:{}/{SUPERUSER}", self.port)
    }

    pub(crate) fn tcp_addr(&self) -> SocketAddr {
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
    pub(crate) fn stop(&self, mode: &str, wait: Duration) -> io::Result<()> {
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
    pub(crate) fn shut_down(&self) {
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
pub(crate) fn wait_until(limit: Duration, mut done: impl FnMut() -> bool) {
    let deadline = Instant::now() + limit;
    while !done() && Instant::now() < deadline {
        thread::sleep(Duration::from_millis(10));
    }
}

/// Whether process `pid` is running: it exists and has not exited. A zombie (exited, not yet
/// reaped by its parent) holds no port, memory or file any more, so it does not count.
pub(crate) fn is_running(pid: u32) -> bool {
    // "pid (comm) state ...": the command name may hold spaces and parentheses, so the state is
    // the first field after the last ')'.
    fs::read_to_string(format!("/proc/{pid}/stat")).is_ok_and(|stat| {
        let state = stat.rsplit_once(')').and_then(|(_, rest)| rest.split_whitespace().next());
        !matches!(state, None | Some("Z" | "X" | "x"))
    })
}

/// The directory holding `initdb`, `pg_ctl` and `postgres`: the first such directory on
/// `PATH`, else the newest `/usr/lib/postgresql/<version>/bin`.
pub(crate) fn find_bin_dir() -> io::Result<PathBuf> {
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

pub(crate) fn is_executable(path: &Path) -> bool {
    fs::metadata(path).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

/// `None` when we may run the server ourselves; the `postgres` system user when we are root,
/// which PostgreSQL refuses to run as.
pub(crate) fn server_user() -> io::Result<Option<SystemUser>> {
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

pub(crate) fn free_port() -> io::Result<u16> {
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
pub(crate) fn log_tail(path: &Path, from: u64) -> String {
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

pub(crate) fn annotate(error: io::Error, context: String) -> io::Error {
    io::Error::new(error.kind(), format!("{context}: {error}"))
}
