//! Test support for pgfence: real PostgreSQL servers for tests, and a fault-injecting TCP proxy.
//!
//! pgfence's own tests, examples and benches use it. So can your own failover tests: start a
//! temporary cluster, put a [`Proxy`] in front of it, and cut or stall connections. Nothing here
//! is meant for production use.
//!
//! - [`TestServer::shared`] gives every test of a process the same server: the one named by
//!   `DATABASE_URL` when that is set, otherwise one private temporary cluster, started on first
//!   use and stopped before the process exits.
//! - [`TestCluster`] is a private cluster owned by one test, for tests that stop or restart the
//!   server; [`TestCluster::start_tls`] makes one that takes TCP connections over TLS only, and
//!   logs [`CERT_ROLE`] in by client certificate alone.
//! - [`PgBouncer`] is a private PgBouncer in session or transaction mode in front of a test
//!   server.
//! - [`ReplicatedCluster`] is a primary with a streaming replica, synchronous or asynchronous,
//!   for tests that crash the primary and promote the replica.
//! - [`PatroniCluster`] is etcd and three PostgreSQL nodes managed by Patroni, for tests of
//!   switchovers, failovers and split brain as the failover tool itself makes them.
//! - [`Proxy`] sits between a client and the server and delays, refuses or cuts connections.
//!   Its [`Gate`]s hold one chosen statement, or its answer, until the test releases it: to
//!   run two statements in the order a race needs, without guessing at timings.
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

// One `unsafe` line in the crate: the `atexit` registration of src/server.rs, which has no safe
// equivalent. Denied everywhere else.
#![deny(unsafe_code)]
#![deny(rust_2018_idioms, rustdoc::broken_intra_doc_links)]
#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]

use std::io;
use std::net::{IpAddr, SocketAddr, ToSocketAddrs};

use tokio_postgres::config::Host;
use tokio_postgres::{Client, Config, NoTls};

mod cluster;
mod gate;
mod patroni;
mod pgbouncer;
mod proxy;
mod replica;
mod server;

pub use cluster::TestCluster;
pub use gate::{Gate, GateMatch, Held, Hold};
pub use patroni::PatroniCluster;
pub use pgbouncer::{PgBouncer, PoolMode};
pub use proxy::Proxy;
pub use replica::{ReplicatedCluster, Replication};
pub use server::TestServer;

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

/// The role that a cluster made by [`TestCluster::start_tls`] lets in over TCP only with a
/// client certificate issued to it by the cluster's certificate authority
/// ([`TestCluster::client_cert_pem`]). It may create databases.
pub const CERT_ROLE: &str = "pgfence_cert_test";

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
