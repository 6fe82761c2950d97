//! libpq's environment for the connection: `PGHOST`, `PGPORT`, `PGUSER`, `PGDATABASE`,
//! `PGPASSWORD`, `PGPASSFILE` and `~/.pgpass`, `PGAPPNAME`, `PGCONNECT_TIMEOUT`, and the TLS
//! files `PGSSLMODE`, `PGSSLROOTCERT`, `PGSSLCERT`, `PGSSLKEY`.
//!
//! [`crate::Builder::from_env`] is the short way; [`resolve`] is the long one, for a caller
//! that has TLS options of its own or wants the warnings (the `pgfence` command uses it).
//!
//! As in libpq, a parameter given in the connection string wins. The environment fills only
//! what the string leaves out. tokio-postgres parses connection strings but reads no
//! environment. The crates that add it leave out `PGPASSWORD`, the TLS variables and libpq's
//! password-file rules, so this module writes them out.
//!
//! Deliberate differences from libpq: pgfence always verifies the server's certificate and
//! host name when it uses TLS, so `require` and `verify-ca` are verified as `verify-full`.
//! Without any connection string or variable naming the server, the default is libpq's: the
//! local Unix socket (or `localhost`).

use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio_postgres::Config;
use tokio_postgres::config::{Host, SslMode};

use crate::error::{Error, Result};

/// libpq's default port.
const DEFAULT_PORT: u16 = 5432;

/// Where libpq looks for the server's Unix socket when no host is given: Debian's build uses
/// the first, upstream's the second.
const SOCKET_DIRS: [&str; 2] = ["/var/run/postgresql", "/tmp"];

/// Every variable this module reads (with `~/.pgpass`, which is a file). A test that must not
/// inherit its runner's connection clears these in the processes it starts.
pub const VARIABLES: [&str; 12] = [
    "PGHOST",
    "PGPORT",
    "PGUSER",
    "PGDATABASE",
    "PGPASSWORD",
    "PGPASSFILE",
    "PGAPPNAME",
    "PGCONNECT_TIMEOUT",
    "PGSSLMODE",
    "PGSSLROOTCERT",
    "PGSSLCERT",
    "PGSSLKEY",
];

/// The variables that name a server. With none of them and no connection string, a caller
/// may refuse to guess a local server (the `pgfence` command does).
pub const SERVER_VARIABLES: [&str; 4] = ["PGHOST", "PGPORT", "PGDATABASE", "PGUSER"];

/// The TLS files that the options and the environment ask for.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct TlsFiles {
    /// The certificate authorities' PEM file; `None`: no TLS.
    pub root_cert: Option<PathBuf>,
    /// The client certificate chain's and its key's PEM files, both or neither.
    pub client: Option<(PathBuf, PathBuf)>,
}

impl TlsFiles {
    /// The TLS client configuration for [`crate::Builder::tls`] that these files describe.
    /// It trusts exactly the certificates in the root file. `None` without a root file.
    ///
    /// Fails with [`Error::InvalidConfig`] (field `"tls"`) when a file cannot be read or
    /// holds no usable certificate or key. The message names the file, never its content.
    pub fn client_config(&self) -> Result<Option<rustls::ClientConfig>> {
        use rustls::pki_types::{PrivateKeyDer, pem::PemObject};
        let Some(root_path) = &self.root_cert else { return Ok(None) };
        let mut roots = rustls::RootCertStore::empty();
        for cert in pem_certs("certificate authorities", root_path)? {
            roots.add(cert).map_err(|e| bad_file("certificate authorities", root_path, e))?;
        }
        let Some((cert_path, key_path)) = &self.client else {
            return Ok(Some(crate::tls_client_config(roots)));
        };
        let chain = pem_certs("client certificate", cert_path)?;
        let key = PrivateKeyDer::from_pem_file(key_path)
            .map_err(|e| bad_file("client key", key_path, e))?;
        crate::tls_client_config_with_cert(roots, chain, key).map(Some)
    }
}

/// The certificates in the PEM file `path`; at least one.
fn pem_certs(what: &str, path: &Path) -> Result<Vec<rustls::pki_types::CertificateDer<'static>>> {
    use rustls::pki_types::{CertificateDer, pem::PemObject};
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| bad_file(what, path, e))?
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(|e| bad_file(what, path, e))?;
    if certs.is_empty() {
        return Err(bad_file(what, path, "no certificate in it"));
    }
    Ok(certs)
}

fn bad_file(what: &str, path: &Path, reason: impl std::fmt::Display) -> Error {
    Error::config("tls", format!("{what} file {}: {reason}", path.display()))
}

/// A connection configuration with the environment applied.
#[derive(Debug)]
#[non_exhaustive]
pub struct Resolved {
    /// The connection string's parameters, with the environment filling the gaps.
    pub config: Config,
    /// `PGCONNECT_TIMEOUT` (as libpq: at least 2 s; 0 or less means the default).
    pub connect_timeout: Option<Duration>,
    /// The TLS files to use; see [`TlsFiles::client_config`].
    pub tls: TlsFiles,
    /// Things the operator should know, as libpq prints them (an ignored password file).
    pub warnings: Vec<String>,
}

/// TLS files given as options, which win over the environment (`PGSSLROOTCERT`, ...).
#[derive(Debug, Default, Clone)]
#[non_exhaustive]
pub struct TlsOptions {
    /// The certificate authorities' PEM file.
    pub root_cert: Option<PathBuf>,
    /// The client certificate chain's PEM file.
    pub cert: Option<PathBuf>,
    /// The client key's PEM file.
    pub key: Option<PathBuf>,
}

/// `url` (if any) with the environment applied, libpq's way; `var` reads a variable
/// (`|name| std::env::var(name).ok()` for the process's own).
///
/// An empty variable counts as unset, as in libpq. A password file with group or world
/// access is ignored with a warning in [`Resolved::warnings`], as libpq does.
///
/// Fails with [`Error::InvalidConfig`] for a connection string or a variable that does not
/// parse; for a variable, the field names it. It also fails so for TLS settings that
/// contradict each other. Nothing is read from the network.
pub fn resolve(
    url: Option<&str>,
    options: TlsOptions,
    var: &dyn Fn(&str) -> Option<String>,
) -> Result<Resolved> {
    // A variable set to the empty string counts as unset, as it does for libpq.
    let var = |name: &str| var(name).filter(|v| !v.is_empty());
    let mut config = match url {
        Some(url) => {
            // The parser's message never contains the string itself, so no password leaks.
            url.parse::<Config>().map_err(|e| Error::config("connection string", e.to_string()))?
        }
        None => Config::new(),
    };
    if config.get_hosts().is_empty() {
        match var("PGHOST") {
            Some(hosts) => hosts.split(',').for_each(|host| add_host(&mut config, host)),
            None => {
                let port = config.get_ports().first().copied();
                let port = port.or_else(|| var("PGPORT").and_then(|p| p.parse().ok()));
                match default_socket_dir(port.unwrap_or(DEFAULT_PORT)) {
                    Some(dir) => config.host_path(dir),
                    None => config.host("localhost"),
                };
            }
        }
    }
    if config.get_ports().is_empty() {
        if let Some(ports) = var("PGPORT") {
            for port in ports.split(',') {
                let port = port
                    .trim()
                    .parse::<u16>()
                    .map_err(|_| Error::config("PGPORT", format!("{ports:?} is not a port")))?;
                config.port(port);
            }
        }
    }
    if config.get_user().is_none() {
        // libpq's default is the operating system user.
        if let Some(user) = var("PGUSER").or_else(|| var("USER")).or_else(|| var("LOGNAME")) {
            config.user(user);
        }
    }
    if config.get_dbname().is_none() {
        if let Some(dbname) = var("PGDATABASE") {
            config.dbname(dbname);
        }
    }
    if config.get_application_name().is_none() {
        if let Some(name) = var("PGAPPNAME") {
            config.application_name(name);
        }
    }
    let connect_timeout = match var("PGCONNECT_TIMEOUT") {
        None => None,
        Some(text) => {
            let secs: i64 = text.trim().parse().map_err(|_| {
                Error::config("PGCONNECT_TIMEOUT", format!("{text:?} is not a number of seconds"))
            })?;
            // As libpq: zero or less waits indefinitely (here: the default), less than 2 is 2.
            (secs > 0).then(|| Duration::from_secs(secs.max(2).unsigned_abs()))
        }
    };
    let mut warnings = Vec::new();
    if config.get_password().is_none() {
        match var("PGPASSWORD") {
            Some(password) => {
                config.password(password);
            }
            None => {
                let file = var("PGPASSFILE")
                    .map(PathBuf::from)
                    .or_else(|| var("HOME").map(|home| Path::new(&home).join(".pgpass")));
                let password =
                    file.and_then(|file| passfile_password(&file, &config, &mut warnings));
                if let Some(password) = password {
                    config.password(password);
                }
            }
        }
    }
    let tls = tls_files(url, &mut config, options, &var)?;
    Ok(Resolved { config, connect_timeout, tls, warnings })
}

fn add_host(config: &mut Config, host: &str) {
    let host = host.trim();
    if host.starts_with('/') {
        config.host_path(host);
    } else {
        config.host(host);
    }
}

/// libpq's default Unix socket directory that has a socket for `port`.
fn default_socket_dir(port: u16) -> Option<&'static str> {
    SOCKET_DIRS.into_iter().find(|dir| Path::new(dir).join(format!(".s.PGSQL.{port}")).exists())
}

/// The password for the first host of `config` in the password file `path`, by libpq's rules.
/// Lines are `host:port:database:user:password`, and the first matching line wins. `*`
/// matches anything, `\` escapes `:` and `\`, and `#` starts a comment. A missing file is no
/// password; a file with group or world access is ignored with a warning, as libpq does.
fn passfile_password(path: &Path, config: &Config, warnings: &mut Vec<String>) -> Option<String> {
    use std::os::unix::fs::PermissionsExt;
    let metadata = std::fs::metadata(path).ok()?;
    if !metadata.is_file() {
        warnings.push(format!("password file {} is not a plain file: ignored", path.display()));
        return None;
    }
    if metadata.permissions().mode() & 0o077 != 0 {
        warnings.push(format!(
            "password file {} has group or world access; permissions should be u=rw (0600) or \
             less: ignored",
            path.display()
        ));
        return None;
    }
    let text = match std::fs::read_to_string(path) {
        Ok(text) => text,
        Err(e) => {
            warnings.push(format!("password file {}: {e}: ignored", path.display()));
            return None;
        }
    };
    let host = match config.get_hosts().first() {
        Some(Host::Tcp(name)) => name.clone(),
        // libpq matches a socket in the default directory as `localhost`.
        Some(Host::Unix(dir)) if SOCKET_DIRS.iter().any(|d| dir == Path::new(d)) => {
            "localhost".to_owned()
        }
        Some(Host::Unix(dir)) => dir.display().to_string(),
        None => "localhost".to_owned(),
    };
    let port = config.get_ports().first().copied().unwrap_or(DEFAULT_PORT).to_string();
    let user = config.get_user().unwrap_or_default();
    let dbname = config.get_dbname().unwrap_or(user);
    let wanted = [host.as_str(), port.as_str(), dbname, user];
    text.lines().filter(|line| !line.starts_with('#') && !line.trim().is_empty()).find_map(|line| {
        let fields = split_passfile_line(line);
        let [h, p, d, u, password] = fields.as_slice() else { return None };
        let matches =
            [h, p, d, u].iter().zip(wanted).all(|(field, want)| *field == "*" || *field == want);
        matches.then(|| password.clone())
    })
}

/// The fields of a password-file line: split at unescaped `:`, with `\x` read as `x`.
fn split_passfile_line(line: &str) -> Vec<String> {
    let mut fields = vec![String::new()];
    let mut chars = line.chars();
    while let Some(c) = chars.next() {
        match c {
            '\\' => fields.last_mut().expect("one field").extend(chars.next()),
            ':' if fields.len() < 5 => fields.push(String::new()),
            c => fields.last_mut().expect("one field").push(c),
        }
    }
    fields
}

/// The TLS files: options first, then `PGSSLROOTCERT`, `PGSSLCERT` and `PGSSLKEY`, as
/// `PGSSLMODE` (or the string's `sslmode`) asks. With TLS, pgfence always verifies the
/// server's certificate and host name. So a mode that asks for TLS needs the certificate
/// authorities, and `verify-ca` is verified as `verify-full`.
fn tls_files(
    url: Option<&str>,
    config: &mut Config,
    options: TlsOptions,
    var: &dyn Fn(&str) -> Option<String>,
) -> Result<TlsFiles> {
    // tokio-postgres does not say whether the string set `sslmode` (it defaults to prefer).
    let url_mode = url.is_some_and(|u| u.contains("sslmode="));
    let env_mode = var("PGSSLMODE");
    let mode = match (&env_mode, url_mode) {
        (Some(mode), false) => mode.as_str(),
        (_, true) => match config.get_ssl_mode() {
            SslMode::Disable => "disable",
            SslMode::Require => "require",
            _ => "prefer",
        },
        (None, false) => "prefer",
    };
    let from_env = |name: &str| var(name).map(PathBuf::from);
    let home_file = |name: &str| {
        var("HOME")
            .map(|home| Path::new(&home).join(".postgresql").join(name))
            .filter(|p| p.exists())
    };
    let verify = match mode {
        "disable" => {
            if options.root_cert.is_some() {
                return Err(Error::config(
                    "tls",
                    "sslmode disable contradicts the certificate authorities given as an option",
                ));
            }
            config.ssl_mode(SslMode::Disable);
            return Ok(TlsFiles::default());
        }
        "allow" | "prefer" => false,
        "require" | "verify-ca" | "verify-full" => true,
        other => {
            return Err(Error::config(
                "PGSSLMODE",
                format!(
                    "{other:?}: expected disable, allow, prefer, require, verify-ca or verify-full"
                ),
            ));
        }
    };
    let mut root_cert = options.root_cert.or_else(|| from_env("PGSSLROOTCERT"));
    if verify {
        // libpq's default file for the certificate authorities.
        root_cert = root_cert.or_else(|| home_file("root.crt"));
        if root_cert.is_none() {
            return Err(Error::config(
                "tls",
                format!(
                    "sslmode {mode}: pgfence verifies the server's certificate: set \
                     PGSSLROOTCERT (the `pgfence` command: --tls-root-cert) to the certificate \
                     authorities' PEM file"
                ),
            ));
        }
        if env_mode.is_some() && !url_mode {
            // The library takes `require` with its TLS configuration to mean verified TLS.
            config.ssl_mode(SslMode::Require);
        }
    }
    let Some(root_cert) = root_cert else { return Ok(TlsFiles::default()) };
    let cert = options.cert.or_else(|| from_env("PGSSLCERT"));
    let key = options.key.or_else(|| from_env("PGSSLKEY"));
    let client = match (cert, key) {
        (Some(cert), Some(key)) => Some((cert, key)),
        (None, None) => None,
        _ => {
            return Err(Error::config(
                "tls",
                "a client certificate needs both PGSSLCERT and PGSSLKEY",
            ));
        }
    };
    Ok(TlsFiles { root_cert: Some(root_cert), client })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passfile_lines_split_at_unescaped_colons() {
        assert_eq!(split_passfile_line(r"h:5432:db:u:p\:w\\d"), ["h", "5432", "db", "u", r"p:w\d"]);
        assert_eq!(split_passfile_line("*:*:*:u:a:b"), ["*", "*", "*", "u", "a:b"]);
    }
}
