//! [`PgBouncer`]: a private PgBouncer in front of a test server.

use std::fs;
use std::io;
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::os::unix::fs::DirBuilderExt;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::time::{Duration, Instant};

use tokio_postgres::Config;

use crate::cluster::{
    CONNECT_TIMEOUT, REAP_WAIT, START_ATTEMPTS, SUPERUSER, annotate, free_port, is_executable,
    log_tail, server_user, wait_until,
};
use crate::redirect;

/// How long [`PgBouncer::start`] waits for the pooler to accept TCP connections.
const START_WAIT: Duration = Duration::from_secs(30);

/// The keeper of one pooler. It starts PgBouncer in the background, then blocks reading a pipe
/// whose only write end the test process holds. End-of-file comes when the test process drops
/// it or dies, for any reason; the keeper then stops PgBouncer and deletes its directory.
/// Arguments: `$1` the `pgbouncer` binary, `$2` its ini file, `$3` the directory to delete.
const KEEPER_SCRIPT: &str = r#""$1" "$2" </dev/null >/dev/null 2>&1 &
pid=$!
cat >/dev/null 2>&1
kill -TERM "$pid" 2>/dev/null
wait "$pid"
rm -rf "$3"
"#;

/// PgBouncer's pool mode (its `pool_mode` setting).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum PoolMode {
    /// A server connection belongs to one client connection until that client disconnects.
    Session,
    /// A server connection belongs to a client only for one transaction.
    Transaction,
}

impl PoolMode {
    fn as_str(self) -> &'static str {
        match self {
            PoolMode::Session => "session",
            PoolMode::Transaction => "transaction",
        }
    }
}

/// A private PgBouncer (Debian's `pgbouncer` package) in front of a test server, in session or
/// transaction mode.
///
/// It listens on `127.0.0.1` on a free port and forwards every database to the server at the
/// `target` address. Its ini file, user list, socket directory and log live in a fresh
/// directory `pgfence-test-bouncer-*` under [`std::env::temp_dir`]. Clients log in as
/// `postgres` without a password (`auth_type = trust`).
///
/// It runs as the `postgres` system user when the tests run as root: PgBouncer refuses to run
/// as root. Dropping it stops PgBouncer and deletes its directory, waiting (bounded) until
/// both are gone. Its keeper process does the same when the test process dies without
/// dropping it (a panic with `panic = "abort"`, a kill).
#[derive(Debug)]
pub struct PgBouncer {
    root: PathBuf,
    port: u16,
    mode: PoolMode,
    keeper: Option<Keeper>,
}

#[derive(Debug)]
struct Keeper {
    child: Child,
    /// Never written to; closing it makes the keeper stop PgBouncer.
    stdin: ChildStdin,
}

/// Server connections per database and user: enough that the tests' stores (pool, renewal and
/// standby connections) never queue for one in session mode.
const DEFAULT_POOL_SIZE: u32 = 150;

impl PgBouncer {
    /// Starts a PgBouncer in `mode` in front of the server at `target` (for example
    /// [`TestCluster::tcp_addr`](crate::TestCluster::tcp_addr)), and returns once it accepts
    /// TCP connections.
    pub fn start(target: SocketAddr, mode: PoolMode) -> io::Result<PgBouncer> {
        PgBouncer::start_sized(target, mode, DEFAULT_POOL_SIZE)
    }

    /// [`PgBouncer::start`] with at most `pool_size` server connections per database and
    /// user. A small pool makes its clients share server sessions in transaction mode.
    pub fn start_sized(
        target: SocketAddr,
        mode: PoolMode,
        pool_size: u32,
    ) -> io::Result<PgBouncer> {
        let binary = find_pgbouncer()?;
        let mut attempt = 1;
        loop {
            match PgBouncer::start_once(&binary, target, mode, pool_size) {
                Err(e) if e.kind() == io::ErrorKind::AddrInUse && attempt < START_ATTEMPTS => {
                    attempt += 1;
                }
                other => return other,
            }
        }
    }

    fn start_once(
        binary: &Path,
        target: SocketAddr,
        mode: PoolMode,
        pool_size: u32,
    ) -> io::Result<PgBouncer> {
        let run_as = server_user()?;
        let root = std::env::temp_dir().join(format!(
            "pgfence-test-bouncer-{}-{}",
            std::process::id(),
            &uuid::Uuid::new_v4().simple().to_string()[..12]
        ));
        fs::DirBuilder::new()
            .mode(0o700)
            .create(&root)
            .map_err(|e| annotate(e, format!("could not create {}", root.display())))?;
        let port = free_port()?;
        // From here on, an early return drops `bouncer`, which deletes `root`.
        let mut bouncer = PgBouncer { root, port, mode, keeper: None };
        let socket_dir = bouncer.root.join("sock");
        fs::DirBuilder::new().mode(0o700).create(&socket_dir)?;
        let ini = bouncer.root.join("pgbouncer.ini");
        let userlist = bouncer.root.join("userlist.txt");
        let log = bouncer.root.join("pgbouncer.log");
        let text = format!(
            "; Written by pgfence_testing.\n\
             [databases]\n\
             * = host={host} port={target_port}\n\
             [pgbouncer]\n\
             listen_addr = 127.0.0.1\n\
             listen_port = {port}\n\
             unix_socket_dir = {sock}\n\
             pidfile = {pid}\n\
             logfile = {log}\n\
             auth_type = trust\n\
             auth_file = {userlist}\n\
             pool_mode = {mode}\n\
             max_client_conn = 500\n\
             default_pool_size = {pool_size}\n\
             max_db_connections = 0\n\
             ignore_startup_parameters = extra_float_digits\n",
            host = target.ip(),
            target_port = target.port(),
            sock = socket_dir.display(),
            pid = bouncer.root.join("pgbouncer.pid").display(),
            log = log.display(),
            userlist = userlist.display(),
            mode = mode.as_str(),
        );
        fs::write(&ini, text)?;
        fs::write(&userlist, format!("\"{SUPERUSER}\" \"\"\n"))?;
        if let Some(user) = run_as {
            for path in [&bouncer.root, &socket_dir, &ini, &userlist] {
                std::os::unix::fs::chown(path, Some(user.uid), Some(user.gid))
                    .map_err(|e| annotate(e, format!("could not chown {}", path.display())))?;
            }
        }
        let mut command = Command::new("/bin/sh");
        command
            .arg("-c")
            .arg(KEEPER_SCRIPT)
            .arg("pgfence-test-bouncer-keeper")
            .arg(binary)
            .arg(&ini)
            .arg(&bouncer.root)
            .current_dir("/")
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            // Its own process group: a Ctrl-C to the test's group must not kill it before it
            // has stopped PgBouncer.
            .process_group(0);
        if let Some(user) = run_as {
            command.uid(user.uid).gid(user.gid);
        }
        let mut child = command
            .spawn()
            .map_err(|e| annotate(e, "could not start the pgbouncer keeper".to_owned()))?;
        // Close-on-exec, like every descriptor std makes: only this process holds it.
        let stdin = child.stdin.take().ok_or_else(|| io::Error::other("keeper has no stdin"))?;
        bouncer.keeper = Some(Keeper { child, stdin });
        bouncer.wait_until_listening(&log)?;
        Ok(bouncer)
    }

    fn wait_until_listening(&self, log: &Path) -> io::Result<()> {
        let deadline = Instant::now() + START_WAIT;
        loop {
            if TcpStream::connect_timeout(&self.addr(), Duration::from_millis(200)).is_ok() {
                return Ok(());
            }
            let text = log_tail(log, 0);
            if text.contains("Address already in use") {
                return Err(io::Error::new(io::ErrorKind::AddrInUse, text));
            }
            if Instant::now() >= deadline || text.contains("FATAL") {
                return Err(io::Error::other(format!(
                    "pgbouncer did not start on port {} within {START_WAIT:?}\n--- {} ---\n{text}",
                    self.port,
                    log.display()
                )));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// The pool mode it runs in.
    pub fn mode(&self) -> PoolMode {
        self.mode
    }

    /// The TCP address clients connect to, `127.0.0.1:<port>`.
    pub fn addr(&self) -> SocketAddr {
        SocketAddr::from((Ipv4Addr::LOCALHOST, self.port))
    }

    /// A connection configuration through the pooler: the `postgres` user and database.
    pub fn config(&self) -> Config {
        let mut config = Config::new();
        config
            .host("127.0.0.1")
            .port(self.port)
            .user(SUPERUSER)
            .dbname(SUPERUSER)
            .connect_timeout(CONNECT_TIMEOUT);
        config
    }

    /// `config` (for example one naming another database) through the pooler.
    pub fn config_via(&self, config: &Config) -> Config {
        redirect(config, self.addr())
    }

    /// The pooler's log so far.
    pub fn log(&self) -> String {
        log_tail(&self.root.join("pgbouncer.log"), 0)
    }
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        if let Some(Keeper { mut child, stdin }) = self.keeper.take() {
            // End-of-file makes the keeper stop PgBouncer, wait for it and delete `root`.
            drop(stdin);
            wait_until(REAP_WAIT + REAP_WAIT, || !matches!(child.try_wait(), Ok(None)));
        }
        let _ = fs::remove_dir_all(&self.root);
    }
}

/// `pgbouncer` on `PATH`, else Debian's `/usr/sbin/pgbouncer`.
fn find_pgbouncer() -> io::Result<PathBuf> {
    let on_path = std::env::var_os("PATH").and_then(|path| {
        std::env::split_paths(&path)
            .map(|dir| dir.join("pgbouncer"))
            .find(|binary| is_executable(binary))
    });
    let debian = PathBuf::from("/usr/sbin/pgbouncer");
    on_path.or_else(|| is_executable(&debian).then_some(debian)).ok_or_else(|| {
        io::Error::new(
            io::ErrorKind::NotFound,
            "no pgbouncer binary on PATH or at /usr/sbin/pgbouncer: install it (`apt-get \
             install pgbouncer`)",
        )
    })
}
