//! `pgfence`: the operator's command-line tool for a pgfence table.
//!
//! Reads go through [`pgfence::Inspector`] and never take the lease; `put`, `rm` and `import`
//! take it for the command's duration (failing with exit 3 while another store holds it);
//! `hold` takes it and keeps it until told to stop, printing one JSON line per lease event.
//! Every error is one line on stderr, `pgfence: ...` with its source chain, and a documented
//! exit code; nothing panics.
#![forbid(unsafe_code)]

mod audit;
mod commands;
mod doctor;
mod exit;
mod hold;
#[cfg(feature = "ldk-import")]
mod ldk_import;
mod logging;
mod metrics;
mod output;
mod privileges;
mod target;

use crate::commands::{export, finish, import, release, status};
use crate::exit::{Exit, ROLE, fail};
use crate::hold::CounterKey;
use crate::logging::init_logging;
use crate::output::{done_json, print_line, row_json};
use crate::target::{DEFAULT_CONNECT_TIMEOUT, Target};

use std::ffi::OsString;
use std::io::{self, Read, Write};
use std::os::unix::ffi::OsStringExt;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use clap::{Args, CommandFactory, FromArgMatches, Parser, Subcommand, ValueEnum};
use pgfence::{PgKvStore, check_key};
use serde_json::json;

const EXIT_CODES: &str = "\
Exit codes:
  0  ok
  1  other error (database unreachable, I/O, ...)
  2  usage or configuration error (bad arguments, key, table name or input)
  3  lease held by another store (put, rm, import, hold without --wait)
  4  key not found (get)
  5  lease lost (hold: taken over, force-released, or renewal failed)
  6  no such database or table (nothing was created: check --database-url and --table)
  7  audit: a violation of the guarantees was found
  8  audit: the run did not exercise enough (a fault kind not injected, or no recovery seen)

The connection: --database-url, else $DATABASE_URL, with libpq's environment filling what it
leaves out (PGHOST, PGPORT, PGUSER, PGDATABASE, PGPASSWORD, PGPASSFILE or ~/.pgpass, PGAPPNAME,
PGCONNECT_TIMEOUT, PGSSLMODE, PGSSLROOTCERT, PGSSLCERT, PGSSLKEY). Commands that only read
(status, get, ls, export, release) never create anything; put, rm, import and hold create the
table, but a database only with --create-database.

Without --tls-root-cert, connections are plain TCP or Unix socket (and sslmode=require is
refused); with it, every connection requires TLS and a server certificate from those roots (a
Unix socket host is refused), and --tls-cert with --tls-key presents a client certificate to a
server that asks for one.";

/// The help heading of the options that say where and how to connect. They apply to every
/// command, so each command's help lists them apart from its own.
const CONNECTION: &str = "Connection options";

/// The help heading of the other options every command takes.
const GLOBAL: &str = "Global options";

/// Operator tool for a pgfence table: a key-value store in PostgreSQL that only the holder of
/// the table's lease may mutate.
#[derive(Debug, Parser)]
#[command(name = "pgfence", version, after_help = EXIT_CODES)]
struct Cli {
    /// PostgreSQL connection string (`postgres://user@host/db` or `host=... dbname=...`);
    /// libpq's PG* variables fill in what it leaves out, or stand in for it.
    #[arg(
        long,
        value_name = "URL",
        env = "DATABASE_URL",
        hide_env_values = true,
        global = true,
        help_heading = CONNECTION
    )]
    database_url: Option<String>,

    /// Connect over TLS only, trusting the certificate authorities in this PEM file (the
    /// server's certificate must also name the host connected to).
    #[arg(
        long,
        value_name = "FILE",
        env = "PGFENCE_TLS_ROOT_CERT",
        global = true,
        help_heading = CONNECTION
    )]
    tls_root_cert: Option<std::path::PathBuf>,

    /// With --tls-root-cert: present the client certificate (chain) in this PEM file, for a
    /// server whose pg_hba.conf asks for one.
    #[arg(
        long,
        value_name = "FILE",
        env = "PGFENCE_TLS_CERT",
        global = true,
        help_heading = CONNECTION,
        requires_all = ["tls_key", "tls_root_cert"]
    )]
    tls_cert: Option<std::path::PathBuf>,

    /// The private key of --tls-cert, in a PEM file.
    #[arg(
        long,
        value_name = "FILE",
        env = "PGFENCE_TLS_KEY",
        global = true,
        help_heading = CONNECTION,
        requires = "tls_cert"
    )]
    tls_key: Option<std::path::PathBuf>,

    /// How a pooler in between shares server sessions: `transaction` for PgBouncer in
    /// transaction mode (no prepared statement or session setting is kept on the server).
    #[arg(
        long,
        value_name = "MODE",
        value_enum,
        env = "PGFENCE_POOL_MODE",
        default_value = "session",
        global = true,
        help_heading = CONNECTION
    )]
    pool_mode: PoolModeArg,

    /// The KV table, `table` or `schema.table`; the lease lives in `<table>_lease`.
    #[arg(
        long,
        value_name = "NAME",
        env = "PGFENCE_TABLE",
        default_value = "pgfence_kv",
        global = true,
        help_heading = GLOBAL
    )]
    table: String,

    /// Write commands (put, rm, import, hold, audit): create the database if it does not exist.
    #[arg(long, global = true, help_heading = GLOBAL)]
    create_database: bool,

    /// Output JSON (one object a line; see docs/cli.md) instead of text, errors included.
    /// `hold` and `export` always print JSON.
    #[arg(long, global = true, help_heading = GLOBAL)]
    json: bool,

    /// `--table` came from `PGFENCE_TABLE`, for naming it in an error.
    #[arg(skip)]
    table_from_env: bool,

    #[command(subcommand)]
    command: Command,
}

/// `--pool-mode`: [`pgfence::PoolMode`].
#[derive(Debug, Clone, Copy, ValueEnum)]
enum PoolModeArg {
    /// A direct connection, or a pooler in session mode.
    Session,
    /// A pooler in transaction mode.
    Transaction,
}

impl From<PoolModeArg> for pgfence::PoolMode {
    fn from(mode: PoolModeArg) -> pgfence::PoolMode {
        match mode {
            PoolModeArg::Session => pgfence::PoolMode::Session,
            PoolModeArg::Transaction => pgfence::PoolMode::Transaction,
        }
    }
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Who holds the lease: holder, epoch, time left; or "free". Does not take the lease.
    Status,
    /// Writes a value's bytes to stdout, unchanged; exit 4 if the key is absent.
    Get(KeyArgs),
    /// Writes a value under the lease, taken for this command only (exit 3 if held).
    Put {
        #[command(flatten)]
        key: KeyArgs,
        /// The value; `-` reads it from stdin.
        #[arg(
            value_name = "VALUE",
            allow_hyphen_values = true,
            required_unless_present = "value_file",
            conflicts_with = "value_file"
        )]
        value: Option<OsString>,
        /// Read the value from FILE instead (`-`: stdin).
        #[arg(long, value_name = "FILE")]
        value_file: Option<PathBuf>,
        /// Write an empty value. Without it an empty value is refused: a script whose value
        /// went missing must not blank the key.
        #[arg(long)]
        allow_empty: bool,
    },
    /// Removes a key under the lease, taken for this command only (exit 3 if held).
    Rm(KeyArgs),
    /// Lists keys in byte order. With NS and SUB: of a namespace pair (one key a line). Without
    /// SUB: of a primary namespace. Without NS: of the whole table (`NS/SUB/KEY` a line).
    Ls {
        /// Primary namespace (may be empty: "").
        #[arg(value_name = "NS")]
        primary_namespace: Option<String>,
        /// Secondary namespace (may be empty: "").
        #[arg(value_name = "SUB", requires = "primary_namespace")]
        secondary_namespace: Option<String>,
        /// Only the keys that start with PREFIX.
        #[arg(long, value_name = "PREFIX")]
        prefix: Option<String>,
    },
    /// Takes the lease and keeps it until SIGINT/SIGTERM, then releases it. Prints one JSON
    /// line per event: waiting, retrying, acquired, write, lost, released.
    Hold(HoldArgs),
    /// Break-glass: expires the lease whoever holds it, so a standby can take over at once.
    /// The holder is fenced from its next write and fails closed. Needs --force --yes.
    Release {
        /// Required: this fences a possibly live holder.
        #[arg(long)]
        force: bool,
        /// Required: confirms --force.
        #[arg(long)]
        yes: bool,
    },
    /// Checks the deployment before it is trusted: server version, privileges, durability
    /// settings, timeouts, clock, TLS, and the table. A pass/warn/fail table; exit 1 if a
    /// check fails. Creates nothing and never takes the lease.
    Doctor {
        /// Check a read-only role: the rights of status, get, ls and export only.
        #[arg(long)]
        read_only: bool,
    },
    /// Every row as a JSON line {primary_namespace, secondary_namespace, key, value (base64)}.
    /// Reads without the lease: rows changed while it runs may or may not be included.
    Export {
        /// Write to FILE instead of stdout.
        #[arg(long, value_name = "FILE")]
        out: Option<PathBuf>,
    },
    /// Writes the rows of an export under the lease (exit 3 if held), all in one atomic batch;
    /// other keys are left alone. Bad input (unparsable, or an invalid key) writes nothing.
    Import {
        /// Read from FILE instead of stdin.
        #[arg(long = "in", value_name = "FILE")]
        input: Option<PathBuf>,
        /// Instead of an export: copy a stopped LDK node's FilesystemStore (v1 or v2 layout)
        /// in DIR with LDK's migrate_kv_store_data, then verify every key and value. Needs
        /// the ldk-import feature. Refuses a table that holds keys, unless --force.
        #[arg(long, value_name = "DIR", conflicts_with = "input")]
        from_ldk_fs: Option<PathBuf>,
        /// With --from-ldk-fs: import into a table that already holds keys (same keys are
        /// overwritten, others kept).
        #[arg(long, requires = "from_ldk_fs")]
        force: bool,
        /// With --from-ldk-fs: also move a node's secrets found in DIR (`keys_seed`, say),
        /// which are refused otherwise.
        #[arg(long, requires = "from_ldk_fs")]
        include_secrets: bool,
        /// Import nothing without an error when the input or DIR holds no key (refused
        /// otherwise: a wrong file or directory is the likelier cause).
        #[arg(long)]
        allow_empty: bool,
    },
    /// Checks that fencing holds on this deployment: holder processes of its own write to a
    /// table of its own while it injects faults, then the data is checked. Exit 7 on a
    /// violation. See docs/cli.md.
    Audit(audit::AuditArgs),
    /// One holder process of `audit` (internal).
    #[command(hide = true)]
    AuditHolder(audit::HolderArgs),
}

#[derive(Debug, Args)]
struct KeyArgs {
    /// Primary namespace (may be empty: "").
    #[arg(value_name = "NS")]
    primary_namespace: String,
    /// Secondary namespace (may be empty: "", only with an empty NS).
    #[arg(value_name = "SUB")]
    secondary_namespace: String,
    /// Key: 1 to 120 of [A-Za-z0-9_-].
    #[arg(value_name = "KEY")]
    key: String,
}

#[derive(Debug, Args)]
struct HoldArgs {
    /// Lease TTL (`30s`, `1m`; a bare number is seconds); renewal runs every TTL/3 and the store
    /// fails closed 2/3 TTL after the last confirmed renewal, before the database expiry.
    #[arg(long, value_name = "DURATION", default_value = "30s", value_parser = parse_secs)]
    ttl: Duration,

    /// Stand by until the lease can be taken, instead of failing with exit 3. A graceful
    /// release wakes it at once; otherwise it wakes right after the holder's lease expires.
    #[arg(long)]
    wait: bool,

    /// Every DURATION (`250ms`, `1s`; a bare number is milliseconds), write an increasing
    /// counter, continuing from the key's current value: `{"counter":N,"epoch":E}`.
    #[arg(long, value_name = "DURATION", requires = "counter_key", value_parser = parse_interval)]
    write_every: Option<Duration>,

    /// The counter's key: `KEY` (in namespace pgfence/hold) or `NS/SUB/KEY`.
    #[arg(long, value_name = "KEY", requires = "write_every")]
    counter_key: Option<String>,

    /// Serve the store's metrics as Prometheus text on http://ADDR/metrics: `HOST:PORT`
    /// (`127.0.0.1:9187`, `localhost:9187`), or `:PORT` for every interface. Names and labels:
    /// docs/metrics.md.
    #[arg(long, value_name = "ADDR", value_parser = metrics::ListenAddr::parse)]
    metrics_addr: Option<metrics::ListenAddr>,
}

/// One syntax for every duration option: a number and a unit, `250ms`, `30s`, `1.5s`, `5m` or
/// `1h`. A bare number is in the option's own unit, `bare`, as its help says: seconds for
/// `--ttl` and `--duration`, milliseconds for `--write-every` and `--poll-every`.
fn parse_duration(s: &str, bare: &str) -> Result<Duration, String> {
    let at = s.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(s.len());
    let (number, unit) = s.split_at(at);
    let scale = match if unit.is_empty() { bare } else { unit } {
        "ms" => 0.001,
        "s" => 1.0,
        "m" => 60.0,
        "h" => 3600.0,
        _ => {
            return Err(format!(
                "{s:?}: expected a number with ms, s, m or h (250ms, 30s, 5m, 1h)"
            ));
        }
    };
    let n: f64 = number
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a duration (250ms, 30s, 5m, 1h)"))?;
    Duration::try_from_secs_f64(n * scale).map_err(|_| format!("{s:?} is not a valid duration"))
}

/// A duration whose bare number is seconds.
fn parse_secs(s: &str) -> Result<Duration, String> {
    parse_duration(s, "s")
}

/// A duration whose bare number is milliseconds; at least one millisecond.
fn parse_interval(s: &str) -> Result<Duration, String> {
    match parse_duration(s, "ms")? {
        d if d < Duration::from_millis(1) => Err(format!("{s:?}: at least 1ms")),
        d => Ok(d),
    }
}

fn main() -> ExitCode {
    let cli = match parse_cli() {
        Ok(cli) => cli,
        Err(e) => return clap_exit(e),
    };
    exit::JSON.store(cli.json, std::sync::atomic::Ordering::Relaxed);
    init_logging();
    let runtime = match tokio::runtime::Runtime::new() {
        Ok(runtime) => runtime,
        Err(e) => return fail(Exit::other("cannot start the async runtime", &e)),
    };
    let result = runtime.block_on(run(cli));
    // Bounded: a blocking task (a stuck DNS lookup) must not hold up the exit.
    runtime.shutdown_timeout(Duration::from_secs(1));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(exit) => fail(exit),
    }
}

/// Parses the command line and the environment. An environment variable set to the empty
/// string counts as unset, for the TLS files as for `DATABASE_URL`. Containers often set every
/// variable, some empty. clap would take it as an empty value, which a path option refuses
/// ("a value is required"). An empty value given on the command line is still refused.
fn parse_cli() -> Result<Cli, clap::Error> {
    let mut command = Cli::command();
    let empty: Vec<clap::Id> = command
        .get_arguments()
        .filter(|arg| arg.get_env().and_then(std::env::var_os).is_some_and(|v| v.is_empty()))
        .map(|arg| arg.get_id().clone())
        .collect();
    for id in empty {
        command = command.mut_arg(id, |arg| arg.env(None::<&'static str>));
    }
    let mut matches = command.try_get_matches()?;
    let table_from_env =
        matches.value_source("table") == Some(clap::parser::ValueSource::EnvVariable);
    let mut cli = Cli::from_arg_matches_mut(&mut matches)?;
    cli.table_from_env = table_from_env;
    Ok(cli)
}

/// Help and version go to stdout as clap renders them; a usage error becomes one line.
fn clap_exit(e: clap::Error) -> ExitCode {
    use clap::error::{ContextKind, ContextValue, ErrorKind};
    // Not parsed: `--json` is looked for as a word of the command line.
    let json = std::env::args_os().skip(1).take_while(|a| a != "--").any(|a| a == "--json");
    exit::JSON.store(json, std::sync::atomic::Ordering::Relaxed);
    match e.kind() {
        ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => {
            let _ = e.print();
            return ExitCode::SUCCESS;
        }
        // `pgfence` alone: the help, on stderr, as a usage error.
        ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
            let _ = e.print();
            return ExitCode::from(2);
        }
        _ => {}
    }
    let typed = match e.get(ContextKind::InvalidSubcommand).or(e.get(ContextKind::InvalidArg)) {
        Some(ContextValue::String(typed)) => Some(typed.clone()),
        _ => None,
    };
    let suggestion = match (e.kind(), &typed) {
        (ErrorKind::InvalidSubcommand, Some(typed)) => {
            closest(typed, Cli::command().get_subcommands().map(|c| c.get_name().to_owned()))
        }
        (ErrorKind::UnknownArgument, Some(typed)) if typed.starts_with("--") => {
            closest(typed, option_names())
        }
        _ => None,
    }
    .map(|name| format!("; did you mean '{name}'?"));
    let rendered = e.render().to_string();
    // clap's message is the paragraph before the first blank line; keep its usage line too.
    let message: Vec<&str> =
        rendered.lines().take_while(|l| !l.trim().is_empty()).map(str::trim).collect();
    let mut message = message.join(" ");
    if matches!(e.kind(), ErrorKind::InvalidValue | ErrorKind::ValueValidation) {
        if let Some(arg) = typed.as_deref().and_then(from_environment) {
            // clap names the option, though the value came from its variable.
            message = message.replace(&format!("'{}'", arg.1), &arg.0);
        }
    }
    let message = message.strip_prefix("error: ").unwrap_or(&message);
    let usage = rendered.lines().find_map(|l| l.strip_prefix("Usage: "));
    let message = format!("{message}{}", suggestion.unwrap_or_default());
    let line = match usage {
        Some(usage) => format!("{message} (usage: {usage}; see --help)"),
        None => format!("{message} (see --help)"),
    };
    fail(Exit::usage(line))
}

/// For an option clap names as `--name <VALUE>` in an error: if its value came from its
/// environment variable (set, and the option absent from the command line), how to name it,
/// `PGFENCE_POOL_MODE (the variable of --pool-mode)`, and clap's name of it.
fn from_environment(shown: &str) -> Option<(String, String)> {
    let long = shown.strip_prefix("--")?.split(' ').next()?;
    let command = Cli::command();
    let arg = command.get_arguments().find(|arg| arg.get_long() == Some(long))?;
    let variable = arg.get_env()?.to_str()?.to_owned();
    std::env::var_os(&variable).filter(|value| !value.is_empty())?;
    let option = format!("--{long}");
    let given = std::env::args_os()
        .skip(1)
        .take_while(|a| a != "--")
        .any(|a| a.to_str().is_some_and(|a| a == option || a.starts_with(&format!("{option}="))));
    (!given).then(|| (format!("{variable} (the variable of {option})"), shown.to_owned()))
}

/// The long options, `--name`, of the command line's command and the global ones, for
/// suggestions. The command is the first word that names one.
fn option_names() -> Vec<String> {
    let command = Cli::command();
    let named = std::env::args().skip(1).find_map(|word| {
        command.get_subcommands().find(|c| c.get_name() == word && !c.is_hide_set())
    });
    let arguments =
        command.get_arguments().chain(named.into_iter().flat_map(|c| c.get_arguments()));
    arguments
        .filter(|arg| !arg.is_hide_set())
        .filter_map(|arg| arg.get_long().map(|long| format!("--{long}")))
        .collect()
}

/// The name nearest to a mistyped one, if it is close (at most 2 edits).
fn closest(typed: &str, names: impl IntoIterator<Item = String>) -> Option<String> {
    names
        .into_iter()
        .map(|name| (edit_distance(typed, &name), name))
        .filter(|(distance, _)| *distance <= 2)
        .min()
        .map(|(_, name)| name)
}

/// Levenshtein distance, by characters.
fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let substitute = diagonal + usize::from(ca != *cb);
            diagonal = row[j + 1];
            row[j + 1] = substitute.min(row[j] + 1).min(row[j + 1] + 1);
        }
    }
    row[b.len()]
}

async fn run(cli: Cli) -> Result<(), Exit> {
    let url = cli.database_url.as_deref().filter(|u| !u.is_empty());
    let var = |name: &str| std::env::var(name).ok();
    let names_a_server =
        pgfence::env::SERVER_VARIABLES.iter().any(|name| var(name).is_some_and(|v| !v.is_empty()));
    if url.is_none() && !names_a_server {
        return Err(Exit::usage(
            "no database: pass --database-url URL, set DATABASE_URL, or set libpq's PGHOST, \
             PGPORT, PGUSER or PGDATABASE",
        ));
    }
    let mut options = pgfence::env::TlsOptions::default();
    options.root_cert = cli.tls_root_cert.clone();
    options.cert = cli.tls_cert.clone();
    options.key = cli.tls_key.clone();
    let resolved = pgfence::env::resolve(url, options, &var)?;
    if let Some(user) = resolved.config.get_user() {
        let _ = ROLE.set(user.to_owned()); // Set once, here.
    }
    for warning in &resolved.warnings {
        let _ = writeln!(io::stderr(), "pgfence: warning: {warning}");
    }
    let tls = resolved.tls.client_config()?;
    // One-shot commands need few connections; `hold` uses one for writes, one for its reads.
    let mut builder = PgKvStore::builder_from_config(resolved.config.clone())
        .table(&cli.table)
        .pool_size(2)
        .pool_mode(cli.pool_mode.into());
    if let Some(timeout) = resolved.connect_timeout {
        builder = builder.connect_timeout(timeout);
    }
    if let Some(tls) = &tls {
        builder = builder.tls(tls.clone());
    }
    // Bad input and the table name are refused before anything connects.
    check_input(&cli.command)?;
    let _ = privileges::COMMAND.set((
        command_name(&cli.command),
        uses(&cli.command),
        cli.table.clone(),
    ));
    builder.clone().inspect().await.map_err(|e| match e {
        pgfence::Error::InvalidConfig { field: "table", .. } if cli.table_from_env => {
            Exit::usage(format!("PGFENCE_TABLE (the variable of --table): {e}"))
        }
        e => e.into(),
    })?;
    let target = Target {
        config: resolved.config,
        tls,
        table: cli.table.clone(),
        connect_timeout: resolved.connect_timeout.unwrap_or(DEFAULT_CONNECT_TIMEOUT),
        pool_mode: cli.pool_mode.into(),
    };
    match &cli.command {
        Command::Status
        | Command::Get(_)
        | Command::Ls { .. }
        | Command::Export { .. }
        | Command::Release { .. } => target.require_table().await?,
        // It reports what is missing as a failed check.
        Command::Doctor { .. } => {}
        // A holder rides out connection errors, as `hold --wait` does.
        Command::AuditHolder(_) => target.require_database(false, true).await?,
        Command::Put { .. }
        | Command::Rm(_)
        | Command::Import { .. }
        | Command::Hold(_)
        | Command::Audit(_) => {
            target
                .require_database(cli.create_database, matches!(cli.command, Command::Hold(_)))
                .await?
        }
    }
    let json = cli.json;
    let holder_env = audit_env(&cli);
    match cli.command {
        Command::Status => status(builder, json).await,
        Command::Get(k) => {
            let inspector = builder.inspect().await?;
            let value =
                inspector.read(&k.primary_namespace, &k.secondary_namespace, &k.key).await?;
            if json {
                return print_line(&row_json(
                    &k.primary_namespace,
                    &k.secondary_namespace,
                    &k.key,
                    &value,
                ));
            }
            let mut out = io::stdout().lock();
            out.write_all(&value).and_then(|()| out.flush()).map_err(|e| Exit::other("stdout", &e))
        }
        Command::Put { key: k, value, value_file, allow_empty } => {
            // Bad input changes nothing: checked before the lease is taken.
            check_key(&k.primary_namespace, &k.secondary_namespace, &k.key)?;
            let value = put_value(value, value_file)?;
            if value.is_empty() && !allow_empty {
                return Err(Exit::usage(format!(
                    "the value for {}/{}/{} is empty: refusing to blank the key (pass \
                     --allow-empty to write an empty value)",
                    k.primary_namespace, k.secondary_namespace, k.key
                )));
            }
            let store = builder.open().await?;
            let epoch = store.fencing_token();
            let written =
                store.write(&k.primary_namespace, &k.secondary_namespace, &k.key, value).await;
            finish(store, written).await?;
            done_json(json, "put", &k, epoch)
        }
        Command::Rm(k) => {
            check_key(&k.primary_namespace, &k.secondary_namespace, &k.key)?;
            let store = builder.open().await?;
            let epoch = store.fencing_token();
            let removed =
                store.remove(&k.primary_namespace, &k.secondary_namespace, &k.key, false).await;
            finish(store, removed).await?;
            done_json(json, "rm", &k, epoch)
        }
        Command::Ls { primary_namespace, secondary_namespace, prefix } => {
            let inspector = builder.inspect().await?;
            let keys: Vec<(String, String, String)> =
                match (&primary_namespace, &secondary_namespace) {
                    (Some(primary), Some(secondary)) => inspector
                        .list(primary, secondary)
                        .await?
                        .into_iter()
                        .map(|key| (primary.clone(), secondary.clone(), key))
                        .collect(),
                    (primary, _) => inspector
                        .list_all_keys()
                        .await?
                        .into_iter()
                        .filter(|(p, _, _)| primary.as_ref().is_none_or(|primary| p == primary))
                        .collect(),
                };
            let prefix = prefix.unwrap_or_default();
            let mut out = io::stdout().lock();
            keys.iter()
                .filter(|(_, _, key)| key.starts_with(&prefix))
                .try_for_each(|(p, s, key)| match (json, secondary_namespace.is_some()) {
                    (true, _) => writeln!(
                        out,
                        "{}",
                        json!({ "primary_namespace": p, "secondary_namespace": s, "key": key })
                    ),
                    (false, true) => writeln!(out, "{key}"),
                    (false, false) => writeln!(out, "{p}/{s}/{key}"),
                })
                .and_then(|()| out.flush())
                .map_err(|e| Exit::other("stdout", &e))
        }
        Command::Hold(args) => hold::hold(builder, args, target).await,
        Command::Release { force, yes } => release(builder, force && yes, json).await,
        Command::Export { out } => export(builder, out).await,
        Command::Doctor { read_only } => doctor::doctor(builder, &target, read_only, json).await,
        Command::Import { from_ldk_fs: Some(dir), force, include_secrets, allow_empty, .. } => {
            let asked = ImportAsked { force, include_secrets, allow_empty };
            import_ldk_fs(builder, dir, asked, json).await
        }
        Command::Import { input, allow_empty, .. } => {
            import(builder, input, allow_empty, json).await
        }
        Command::Audit(args) => audit::audit(builder, target, args, holder_env, json).await,
        Command::AuditHolder(args) => audit::holder(target, args).await,
    }
}

/// The command's name, as users type it.
fn command_name(command: &Command) -> &'static str {
    match command {
        Command::Status => "status",
        Command::Get(_) => "get",
        Command::Put { .. } => "put",
        Command::Rm(_) => "rm",
        Command::Ls { .. } => "ls",
        Command::Hold(_) => "hold",
        Command::Release { .. } => "release",
        Command::Doctor { .. } => "doctor",
        Command::Export { .. } => "export",
        Command::Import { .. } => "import",
        Command::Audit(_) => "audit",
        Command::AuditHolder(_) => "audit-holder",
    }
}

/// What the command does with the tables, for the rights it needs.
fn uses(command: &Command) -> privileges::Use {
    use privileges::Use;
    match command {
        Command::Get(_) | Command::Ls { .. } | Command::Export { .. } => Use::Read,
        Command::Status => Use::Status,
        Command::Release { .. } => Use::Release,
        Command::Doctor { read_only: true } => Use::Reader,
        _ => Use::Write,
    }
}

/// The connection options of this command, as the environment of `audit`'s holders: the URL
/// stays out of their command lines, where `ps` would show its password. The pool mode too.
fn audit_env(cli: &Cli) -> audit::ChildEnv {
    let mut env = Vec::new();
    if let Some(url) = &cli.database_url {
        env.push(("DATABASE_URL", OsString::from(url)));
    }
    let files = [
        ("PGFENCE_TLS_ROOT_CERT", &cli.tls_root_cert),
        ("PGFENCE_TLS_CERT", &cli.tls_cert),
        ("PGFENCE_TLS_KEY", &cli.tls_key),
    ];
    for (name, file) in files {
        if let Some(file) = file {
            env.push((name, file.clone().into_os_string()));
        }
    }
    // Behind a transaction pooler, a holder in session mode would fail every statement.
    let mode = match cli.pool_mode {
        PoolModeArg::Session => "session",
        PoolModeArg::Transaction => "transaction",
    };
    env.push(("PGFENCE_POOL_MODE", OsString::from(mode)));
    env
}

#[cfg(feature = "ldk-import")]
use crate::ldk_import::import_ldk_fs;

/// Without the `ldk-import` feature, `check_input` refuses `--from-ldk-fs` before this.
#[cfg(not(feature = "ldk-import"))]
async fn import_ldk_fs(
    _: pgfence::Builder,
    _: PathBuf,
    _: ImportAsked,
    _: bool,
) -> Result<(), Exit> {
    Err(no_ldk_import())
}

/// What `import --from-ldk-fs` was asked to allow.
#[cfg_attr(not(feature = "ldk-import"), allow(dead_code))]
pub(crate) struct ImportAsked {
    /// Into a table that holds keys.
    pub(crate) force: bool,
    /// A node's secrets too.
    pub(crate) include_secrets: bool,
    /// An empty directory.
    pub(crate) allow_empty: bool,
}

#[cfg(not(feature = "ldk-import"))]
fn no_ldk_import() -> Exit {
    Exit::usage("--from-ldk-fs: this pgfence was built without the ldk-import feature")
}

/// Refuses bad arguments that clap cannot check (keys, confirmations) with exit 2, before
/// anything connects.
fn check_input(command: &Command) -> Result<(), Exit> {
    match command {
        Command::Put { key: k, value: Some(value), .. } => {
            check_key(&k.primary_namespace, &k.secondary_namespace, &k.key)?;
            // VALUE may start with `-`, so a mistyped option would be written as the value.
            let separated = std::env::args_os().any(|a| a == "--");
            if let Some(option) = value.to_str().filter(|v| v.starts_with("--") && !separated) {
                let nearest = closest(option, option_names())
                    .map(|name| format!(" (did you mean '{name}'?)"))
                    .unwrap_or_default();
                return Err(Exit::usage(format!(
                    "VALUE {option:?} looks like an option{nearest}; to write it as the value, \
                     put it after `--`: put NS SUB KEY -- {option}"
                )));
            }
        }
        Command::Get(k) | Command::Put { key: k, .. } | Command::Rm(k) => {
            check_key(&k.primary_namespace, &k.secondary_namespace, &k.key)?;
        }
        // Any valid key: only the namespaces are checked.
        Command::Ls { primary_namespace: Some(primary), secondary_namespace, .. } => {
            check_key(primary, secondary_namespace.as_deref().unwrap_or(""), "k")?;
        }
        Command::Release { force, yes } if !(*force && *yes) => {
            return Err(Exit::usage(
                "release expires the lease of a possibly live holder; pass both --force and --yes",
            ));
        }
        Command::Hold(args) => {
            args.counter_key.as_deref().map(CounterKey::parse).transpose()?;
        }
        Command::Audit(args) => audit::check_args(args)?,
        #[cfg(not(feature = "ldk-import"))]
        Command::Import { from_ldk_fs: Some(_), .. } => return Err(no_ldk_import()),
        _ => {}
    }
    Ok(())
}

/// The value of `put`: the argument, or stdin when it is `-`, or the file of `--value-file`
/// (`-`: stdin). Stdin is never read unasked: a script that forgot the value must not blank
/// the key.
fn put_value(value: Option<OsString>, file: Option<PathBuf>) -> Result<Vec<u8>, Exit> {
    let read_stdin = || {
        let mut buf = Vec::new();
        io::stdin().read_to_end(&mut buf).map_err(|e| Exit::other("stdin", &e))?;
        Ok(buf)
    };
    match (value, file) {
        (Some(value), None) if value == "-" => read_stdin(),
        (Some(value), None) => Ok(value.into_vec()),
        (None, Some(file)) if file.as_os_str() == "-" => read_stdin(),
        (None, Some(file)) => std::fs::read(&file)
            .map_err(|e| Exit::usage(format!("--value-file {}: {e}", file.display()))),
        // clap requires exactly one of them.
        _ => Err(Exit::usage("put needs VALUE (`-`: stdin) or --value-file FILE")),
    }
}
