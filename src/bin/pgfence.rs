//! `pgfence`: the operator's command-line tool for a pgfence table.
//!
//! Reads go through [`pgfence::Inspector`] and never take the lease; `put`, `rm` and `import`
//! take it for the command's duration (failing with exit 3 while another store holds it);
//! `hold` takes it and keeps it until told to stop, printing one JSON line per lease event.
//! Every error is one line on stderr, `pgfence: ...` with its source chain, and a documented
//! exit code; nothing panics.
#![forbid(unsafe_code)]

use std::ffi::OsString;
use std::fs::File;
use std::io::{self, BufRead, BufReader, BufWriter, Read, Write};
use std::os::unix::ffi::OsStringExt;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use clap::{Args, CommandFactory, FromArgMatches, Parser, Subcommand};
use pgfence::{Builder, Error, LeaseLossPolicy, LeaseState, PgKvStore, StandbyState, check_key};
use serde_json::{Value, json};
use tokio::signal::unix::{Signal, SignalKind, signal};
use tokio::sync::{mpsc, watch};

const EXIT_CODES: &str = "\
Exit codes:
  0  ok
  1  other error (database unreachable, I/O, ...)
  2  usage or configuration error (bad arguments, key, table name or input)
  3  lease held by another store (put, rm, import, hold without --wait)
  4  key not found (get)
  5  lease lost (hold: taken over, force-released, or renewal failed)
  6  no such database or table (nothing was created: check --database-url and --table)

The connection: --database-url, else $DATABASE_URL, with libpq's environment filling what it
leaves out (PGHOST, PGPORT, PGUSER, PGDATABASE, PGPASSWORD, PGPASSFILE or ~/.pgpass, PGAPPNAME,
PGCONNECT_TIMEOUT, PGSSLMODE, PGSSLROOTCERT, PGSSLCERT, PGSSLKEY). Commands that only read
(status, get, ls, export, release) never create anything; put, rm, import and hold create the
table, but a database only with --create-database.

Without --tls-root-cert, connections are plain TCP or Unix socket (and sslmode=require is
refused); with it, every connection requires TLS and a server certificate from those roots (a
Unix socket host is refused), and --tls-cert with --tls-key presents a client certificate to a
server that asks for one.";

/// Operator tool for a pgfence table: a key-value store in PostgreSQL that only the holder of
/// the table's lease may mutate.
#[derive(Debug, Parser)]
#[command(name = "pgfence", version, after_help = EXIT_CODES)]
struct Cli {
    /// PostgreSQL connection string (`postgres://user@host/db` or `host=... dbname=...`);
    /// libpq's PG* variables fill in what it leaves out, or stand in for it.
    #[arg(long, value_name = "URL", env = "DATABASE_URL", hide_env_values = true, global = true)]
    database_url: Option<String>,

    /// Connect over TLS only, trusting the certificate authorities in this PEM file (the
    /// server's certificate must also name the host connected to).
    #[arg(long, value_name = "FILE", env = "PGFENCE_TLS_ROOT_CERT", global = true)]
    tls_root_cert: Option<std::path::PathBuf>,

    /// With --tls-root-cert: present the client certificate (chain) in this PEM file, for a
    /// server whose pg_hba.conf asks for one.
    #[arg(
        long,
        value_name = "FILE",
        env = "PGFENCE_TLS_CERT",
        global = true,
        requires_all = ["tls_key", "tls_root_cert"]
    )]
    tls_cert: Option<std::path::PathBuf>,

    /// The private key of --tls-cert, in a PEM file.
    #[arg(
        long,
        value_name = "FILE",
        env = "PGFENCE_TLS_KEY",
        global = true,
        requires = "tls_cert"
    )]
    tls_key: Option<std::path::PathBuf>,

    /// The KV table, `table` or `schema.table`; the lease lives in `<table>_lease`.
    #[arg(long, value_name = "NAME", default_value = "pgfence_kv", global = true)]
    table: String,

    /// Write commands (put, rm, import, hold): create the database if it does not exist.
    #[arg(long, global = true)]
    create_database: bool,

    /// Output JSON (one object a line; see docs/cli.md) instead of text. `hold` and `export`
    /// always print JSON.
    #[arg(long, global = true)]
    json: bool,

    #[command(subcommand)]
    command: Command,
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
    /// line per event: waiting, acquired, write, lost, released.
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
    Doctor,
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
    },
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
    /// Lease TTL in seconds; renewal runs every TTL/3 and the store fails closed 2/3 TTL after
    /// the last confirmed renewal, before the database expiry.
    #[arg(long, value_name = "SECS", default_value = "30", value_parser = parse_secs)]
    ttl: Duration,

    /// Stand by until the lease can be taken, instead of failing with exit 3. A graceful
    /// release wakes it at once; otherwise it wakes right after the holder's lease expires.
    #[arg(long)]
    wait: bool,

    /// Every MS milliseconds, write an increasing counter, continuing from the key's current
    /// value: `{"counter":N,"epoch":E}`.
    #[arg(
        long,
        value_name = "MS",
        requires = "counter_key",
        value_parser = clap::value_parser!(u64).range(1..)
    )]
    write_every: Option<u64>,

    /// The counter's key: `KEY` (in namespace pgfence/hold) or `NS/SUB/KEY`.
    #[arg(long, value_name = "KEY", requires = "write_every")]
    counter_key: Option<String>,
}

fn parse_secs(s: &str) -> Result<Duration, String> {
    let secs: f64 = s.parse().map_err(|_| format!("{s:?} is not a number of seconds"))?;
    Duration::try_from_secs_f64(secs).map_err(|_| format!("{s:?} is not a valid duration"))
}

/// How the process ends when a command fails: the exit code and the one line for stderr.
#[derive(Debug)]
struct Exit {
    code: u8,
    message: String,
}

impl Exit {
    fn usage(message: impl Into<String>) -> Exit {
        Exit { code: 2, message: message.into() }
    }

    fn other(context: &str, error: &(dyn std::error::Error + 'static)) -> Exit {
        Exit { code: 1, message: format!("{context}: {}", chain(error)) }
    }

    /// Exit 6: the database or table the command names does not exist.
    fn missing(message: impl Into<String>) -> Exit {
        Exit { code: 6, message: message.into() }
    }
}

impl From<Error> for Exit {
    fn from(e: Error) -> Exit {
        let code = match &e {
            Error::LeaseHeld { .. } => 3,
            Error::NotFound(_) => 4,
            Error::LeaseLost { .. } => 5,
            Error::InvalidKey { .. }
            | Error::InvalidConfig { .. }
            | Error::ValueTooLarge { .. }
            | Error::BatchTooLarge { .. } => 2,
            _ => 1,
        };
        let mut message = chain(&e);
        if let Some(hint) = grant_hint(&e) {
            message.push_str(&format!(" (fix: {hint})"));
        }
        Exit { code, message }
    }
}

/// The role the command connects as, for the `GRANT` a permission error needs.
static ROLE: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// For a permission error (SQLSTATE 42501) anywhere in the chain of `error`: the statement an
/// administrator runs to fix it, from the server's message.
fn grant_hint(error: &(dyn std::error::Error + 'static)) -> Option<String> {
    let mut source = Some(error);
    let db = std::iter::from_fn(|| {
        let current = source?;
        source = current.source();
        Some(current)
    })
    .find_map(|e| e.downcast_ref::<tokio_postgres::Error>()?.as_db_error())?;
    if db.code() != &tokio_postgres::error::SqlState::INSUFFICIENT_PRIVILEGE {
        return None;
    }
    let role = ROLE.get().map_or("<role>", String::as_str);
    let message = db.message();
    let object = |prefix: &str| message.strip_prefix(prefix).map(str::to_owned);
    Some(if let Some(schema) = object("permission denied for schema ") {
        format!("GRANT USAGE, CREATE ON SCHEMA {schema} TO {role}")
    } else if let Some(table) = object("permission denied for table ") {
        format!("GRANT SELECT, INSERT, UPDATE, DELETE ON {table} TO {role}")
    } else if let Some(database) = object("permission denied for database ") {
        format!("GRANT CREATE ON DATABASE {database} TO {role}")
    } else if message.starts_with("permission denied to create database") {
        format!("ALTER ROLE {role} CREATEDB, or create the database as an administrator")
    } else {
        "run `pgfence doctor`, which names the privileges the role lacks".to_owned()
    })
}

/// The error and its sources on one line. tokio-postgres already shows its cause in its own
/// message. So a source whose text is already there is not repeated.
fn chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut line = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let text = cause.to_string();
        if !line.contains(&text) {
            line.push_str(": ");
            line.push_str(&text);
        }
        source = cause.source();
    }
    line.replace('\n', " ")
}

fn main() -> ExitCode {
    let cli = match parse_cli() {
        Ok(cli) => cli,
        Err(e) => return clap_exit(e),
    };
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
    Cli::from_arg_matches_mut(&mut command.try_get_matches()?)
}

/// The library reports renewal retries, failed releases and fallbacks through `tracing`:
/// show warnings and errors on stderr (`RUST_LOG` overrides, e.g. `RUST_LOG=pgfence=debug`).
/// Colour only on a terminal, and never with `NO_COLOR` set (<https://no-color.org>).
fn init_logging() {
    use std::io::IsTerminal;
    use tracing_subscriber::Layer as _;
    use tracing_subscriber::layer::SubscriberExt as _;
    use tracing_subscriber::util::SubscriberInitExt as _;
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    let no_color = std::env::var_os("NO_COLOR").is_some_and(|v| !v.is_empty());
    let ansi = io::stderr().is_terminal() && !no_color;
    let layer = tracing_subscriber::fmt::layer()
        .with_writer(io::stderr)
        .with_ansi(ansi)
        .with_filter(filter)
        .with_filter(tracing_subscriber::filter::filter_fn(|event| !reported_by_the_cli(event)));
    tracing_subscriber::registry().with(layer).with(StandbyTrouble).init();
}

/// Where [`StandbyTrouble`] sends the standby's warnings while `hold --wait` listens.
static STANDBY_TROUBLE: std::sync::Mutex<Option<mpsc::UnboundedSender<String>>> =
    std::sync::Mutex::new(None);

/// Passes the standby's warnings (retries, LISTEN trouble) to `hold --wait`, which reports
/// them itself. It reports them rate-limited, with the whole cause, and as a JSON event a
/// supervisor can see.
/// The library logs them about once a second, with the cause cut to its first line.
struct StandbyTrouble;

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for StandbyTrouble {
    fn on_event(&self, event: &tracing::Event<'_>, _: tracing_subscriber::layer::Context<'_, S>) {
        if !is_standby_warning(event.metadata()) {
            return;
        }
        let mut text = EventText::default();
        event.record(&mut text);
        let listening = STANDBY_TROUBLE.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(sender) = listening.as_ref() {
            let _ = sender.send(text.0); // `hold` may have stopped listening.
        }
    }
}

/// An event's message and fields on one line: `message: field=value ...`.
#[derive(Default)]
struct EventText(String);

impl tracing::field::Visit for EventText {
    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        let text = match field.name() {
            "message" => format!("{value:?}"),
            name => format!("{name}={value:?}"),
        };
        if !self.0.is_empty() {
            self.0.push_str(": ");
        }
        self.0.push_str(&text);
    }
}

/// The standby's warnings (every `pgfence::standby` warning).
fn is_standby_warning(event: &tracing::Metadata<'_>) -> bool {
    event.target() == "pgfence::standby" && *event.level() == tracing::Level::WARN
}

/// The library's events that the CLI reports itself; otherwise both would say the same thing.
/// They are the lease loss (the `lost` event and the exit-5 error line), and an operator's
/// force release (the `release` command's own output). They also include the standby's
/// warnings (see [`StandbyTrouble`]). Recognised by level, module and a field only they have,
/// as the library gives its events no stable names.
fn reported_by_the_cli(event: &tracing::Metadata<'_>) -> bool {
    let has = |field: &str| event.fields().field(field).is_some();
    // Targets are module paths: the lease's events come from its submodules.
    let target = event.target();
    if target == "pgfence::lease" || target.starts_with("pgfence::lease::") {
        return *event.level() == tracing::Level::ERROR && has("reason");
    }
    matches!(target, "pgfence::standby" | "pgfence::inspect")
        && *event.level() == tracing::Level::WARN
}

fn fail(exit: Exit) -> ExitCode {
    ExitCode::from(fail_code(exit))
}

/// Prints the error line and returns the exit code.
fn fail_code(exit: Exit) -> u8 {
    // Nowhere left to report a failing stderr; the exit code still tells.
    let _ = writeln!(io::stderr(), "pgfence: {}", exit.message);
    exit.code
}

/// Help and version go to stdout as clap renders them; a usage error becomes one line.
fn clap_exit(e: clap::Error) -> ExitCode {
    use clap::error::ErrorKind;
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
    let suggestion = match (e.kind(), e.get(clap::error::ContextKind::InvalidSubcommand)) {
        (ErrorKind::InvalidSubcommand, Some(clap::error::ContextValue::String(typed))) => {
            closest_command(typed).map(|name| format!("; did you mean '{name}'?"))
        }
        _ => None,
    };
    let rendered = e.render().to_string();
    // clap's message is the paragraph before the first blank line; keep its usage line too.
    let message: Vec<&str> =
        rendered.lines().take_while(|l| !l.trim().is_empty()).map(str::trim).collect();
    let message = message.join(" ");
    let message = message.strip_prefix("error: ").unwrap_or(&message);
    let usage = rendered.lines().find_map(|l| l.strip_prefix("Usage: "));
    let message = format!("{message}{}", suggestion.unwrap_or_default());
    let line = match usage {
        Some(usage) => format!("{message} (usage: {usage}; see --help)"),
        None => format!("{message} (see --help)"),
    };
    fail(Exit::usage(line))
}

/// The command nearest to a mistyped one, if it is close (at most 2 edits).
fn closest_command(typed: &str) -> Option<String> {
    Cli::command()
        .get_subcommands()
        .map(|command| command.get_name().to_owned())
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
    let mut builder =
        PgKvStore::builder_from_config(resolved.config.clone()).table(&cli.table).pool_size(2);
    if let Some(timeout) = resolved.connect_timeout {
        builder = builder.connect_timeout(timeout);
    }
    if let Some(tls) = &tls {
        builder = builder.tls(tls.clone());
    }
    // Bad input and the table name are refused before anything connects.
    check_input(&cli.command)?;
    builder.clone().inspect().await?;
    let target = Target {
        config: resolved.config,
        tls,
        table: cli.table.clone(),
        connect_timeout: resolved.connect_timeout.unwrap_or(DEFAULT_CONNECT_TIMEOUT),
    };
    match &cli.command {
        Command::Status
        | Command::Get(_)
        | Command::Ls { .. }
        | Command::Export { .. }
        | Command::Release { .. } => target.require_table().await?,
        // It reports what is missing as a failed check.
        Command::Doctor => {}
        Command::Put { .. } | Command::Rm(_) | Command::Import { .. } | Command::Hold(_) => {
            target
                .require_database(cli.create_database, matches!(cli.command, Command::Hold(_)))
                .await?
        }
    }
    let json = cli.json;
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
        Command::Put { key: k, value, value_file } => {
            // Bad input changes nothing: checked before the lease is taken.
            check_key(&k.primary_namespace, &k.secondary_namespace, &k.key)?;
            let value = put_value(value, value_file)?;
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
        Command::Hold(args) => hold(builder, args, target).await,
        Command::Release { force, yes } => release(builder, force && yes, json).await,
        Command::Export { out } => export(builder, out).await,
        Command::Doctor => doctor(builder, &target, json).await,
        Command::Import { input } => import(builder, input, json).await,
    }
}

/// One line on stdout.
fn print_line(line: &dyn std::fmt::Display) -> Result<(), Exit> {
    writeln!(io::stdout(), "{line}").map_err(|e| Exit::other("stdout", &e))
}

/// A row as `export` writes it (`value` in base64); also `get --json`.
fn row_json(primary: &str, secondary: &str, key: &str, value: &[u8]) -> Value {
    json!({
        "primary_namespace": primary,
        "secondary_namespace": secondary,
        "key": key,
        "value": BASE64.encode(value),
    })
}

/// What `put --json` and `rm --json` print once done: the command, the key and the epoch of
/// the lease it was done under. Nothing without `--json`.
fn done_json(json: bool, command: &str, k: &KeyArgs, epoch: i64) -> Result<(), Exit> {
    if !json {
        return Ok(());
    }
    print_line(&json!({
        "command": command,
        "primary_namespace": k.primary_namespace,
        "secondary_namespace": k.secondary_namespace,
        "key": k.key,
        "epoch": epoch,
    }))
}

/// Refuses bad arguments that clap cannot check (keys, confirmations) with exit 2, before
/// anything connects.
fn check_input(command: &Command) -> Result<(), Exit> {
    match command {
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

/// The connect timeout when `PGCONNECT_TIMEOUT` sets none: the library's default.
const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// Where a command connects, for the checks the CLI makes itself before handing over to the
/// library. It checks that the database exists, and for reads the table too. The library's
/// `open()` creates a missing database and table, which a typo must not do.
#[derive(Clone)]
struct Target {
    config: tokio_postgres::Config,
    tls: Option<pgfence::rustls::ClientConfig>,
    table: String,
    connect_timeout: Duration,
}

/// Why [`Target::connect`] failed.
enum ConnectError {
    /// The database does not exist (SQLSTATE 3D000).
    NoDatabase(String),
    Other(Exit),
}

impl Target {
    /// `host:port` of every host, as psql names them (never the password).
    fn servers(&self) -> String {
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

    async fn connect(&self) -> Result<tokio_postgres::Client, ConnectError> {
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
    async fn require_table(&self) -> Result<(), Exit> {
        let client = match self.connect().await {
            Ok(client) => client,
            Err(ConnectError::NoDatabase(message)) => {
                return Err(Exit::missing(format!("{message} (check the connection string)")));
            }
            Err(ConnectError::Other(exit)) => return Err(exit),
        };
        let (kv, lease) = (quote_table(&self.table, ""), quote_table(&self.table, "_lease"));
        let row = client
            .query_one(TABLES_EXIST, &[&kv, &lease])
            .await
            .map_err(|e| Exit::other("check the table", &e))?;
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
    async fn require_database(&self, create: bool, standby: bool) -> Result<(), Exit> {
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
fn quote_table(table: &str, suffix: &str) -> String {
    let quote = |part: &str| format!("\"{}\"", part.replace('"', "\"\""));
    match table.split_once('.') {
        Some((schema, name)) => format!("{}.{}", quote(schema), quote(&format!("{name}{suffix}"))),
        None => quote(&format!("{table}{suffix}")),
    }
}

/// A duration as people read it: `4.0 s`, the one format of every human line.
fn secs(duration: Duration) -> String {
    format!("{:.1} s", duration.as_secs_f64())
}

/// One check of `doctor`.
struct Check {
    name: &'static str,
    status: Status,
    /// What was found and, for a warning or a failure, what to change.
    detail: String,
}

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Status {
    Pass,
    Warn,
    Fail,
}

impl Status {
    fn as_str(self) -> &'static str {
        match self {
            Status::Pass => "pass",
            Status::Warn => "warn",
            Status::Fail => "fail",
        }
    }
}

fn check(name: &'static str, status: Status, detail: impl Into<String>) -> Check {
    Check { name, status, detail: detail.into() }
}

/// The server-side facts `doctor` reads, in one statement: nothing is created or changed.
/// (`has_table_privilege` with a list is true if any one is held, hence one call each.)
const DOCTOR_FACTS: &str = "SELECT
    current_setting('server_version_num')::int,
    current_setting('server_version'),
    current_setting('synchronous_commit'),
    current_setting('synchronous_standby_names'),
    current_setting('idle_in_transaction_session_timeout'),
    current_setting('statement_timeout'),
    coalesce((SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()), false),
    extract(epoch FROM clock_timestamp())::float8,
    current_user::text,
    (SELECT rolsuper FROM pg_roles WHERE rolname = current_user),
    current_user = session_user,
    to_regclass($1::text) IS NOT NULL,
    to_regclass($2::text) IS NOT NULL,
    to_regclass($3::text) IS NOT NULL,
    coalesce(to_regnamespace($4::text)::text, ''),
    CASE WHEN to_regnamespace($4::text) IS NULL THEN false
         ELSE has_schema_privilege(to_regnamespace($4::text), 'CREATE') END,
    CASE WHEN to_regclass($1::text) IS NULL THEN true
         ELSE has_table_privilege($1::text, 'SELECT') AND has_table_privilege($1::text, 'INSERT')
          AND has_table_privilege($1::text, 'UPDATE') AND has_table_privilege($1::text, 'DELETE')
    END,
    CASE WHEN to_regclass($2::text) IS NULL THEN true
         ELSE has_table_privilege($2::text, 'SELECT') AND has_table_privilege($2::text, 'UPDATE')
    END";

/// `doctor`: each check a row of a pass/warn/fail table (or `--json`); exit 1 if one fails.
async fn doctor(builder: Builder, target: &Target, json: bool) -> Result<(), Exit> {
    let checks = doctor_checks(builder, target).await;
    let worst = checks.iter().map(|c| c.status).max().unwrap_or(Status::Pass);
    if json {
        let rows: Vec<Value> = checks
            .iter()
            .map(|c| json!({ "check": c.name, "status": c.status.as_str(), "detail": c.detail }))
            .collect();
        print_line(&json!({ "status": worst.as_str(), "checks": rows }))?;
    } else {
        let width = checks.iter().map(|c| c.name.len()).max().unwrap_or(0);
        let mut out = io::stdout().lock();
        for c in &checks {
            writeln!(out, "{:<width$}  {:<4}  {}", c.name, c.status.as_str(), c.detail)
                .map_err(|e| Exit::other("stdout", &e))?;
        }
    }
    match worst {
        Status::Fail => Err(Exit { code: 1, message: "doctor: a check failed".to_owned() }),
        _ => Ok(()),
    }
}

async fn doctor_checks(builder: Builder, target: &Target) -> Vec<Check> {
    let mut checks = Vec::new();
    let started = std::time::SystemTime::now();
    let client = match target.connect().await {
        Ok(client) => client,
        Err(ConnectError::NoDatabase(message)) => {
            checks.push(check(
                "connection",
                Status::Fail,
                format!("{message}: create it (CREATE DATABASE) or fix the connection string"),
            ));
            return checks;
        }
        Err(ConnectError::Other(exit)) => {
            checks.push(check("connection", Status::Fail, exit.message));
            return checks;
        }
    };
    checks.push(check("connection", Status::Pass, format!("connected to {}", target.servers())));
    let kv = quote_table(&target.table, "");
    let lease = quote_table(&target.table, "_lease");
    let version = quote_table(&target.table, "_schema_version");
    let schema = match target.table.split_once('.') {
        Some((schema, _)) => schema.to_owned(),
        None => String::new(),
    };
    // Unqualified: the first schema of the search path that exists, where the store creates.
    let schema_sql = if schema.is_empty() { "current_schema()".to_owned() } else { schema.clone() };
    let facts = match client.query_one(DOCTOR_FACTS, &[&kv, &lease, &version, &schema_sql]).await {
        Ok(row) => row,
        Err(e) => {
            checks.push(check("server facts", Status::Fail, chain(&e)));
            return checks;
        }
    };
    let rtt = started.elapsed().unwrap_or_default();
    let number: i32 = facts.get(0);
    let shown: String = facts.get(1);
    checks.push(match number {
        n if n < 100_000 => check("server version", Status::Fail, format!(
            "PostgreSQL {shown}: pgfence needs 10 or later; upgrade the server"
        )),
        n if (150_000..160_000).contains(&n) => {
            check("server version", Status::Pass, format!("PostgreSQL {shown}"))
        }
        _ => check("server version", Status::Warn, format!(
            "PostgreSQL {shown}: pgfence is tested on 15 only; run its tests against this server"
        )),
    });
    let (sync_commit, standbys): (String, String) = (facts.get(2), facts.get(3));
    checks.push(match sync_commit.as_str() {
        "off" | "local" => check("synchronous_commit", Status::Warn, format!(
            "{sync_commit}: an acknowledged write may be lost in a crash;              ALTER ROLE ... SET synchronous_commit = on"
        )),
        _ => check("synchronous_commit", Status::Pass, sync_commit.clone()),
    });
    checks.push(if standbys.trim().is_empty() {
        check("synchronous_standby_names", Status::Warn,
            "empty: acknowledged writes are on this server only, and a failover to a replica may              lose them; list the replicas in synchronous_standby_names")
    } else {
        check("synchronous_standby_names", Status::Pass, standbys.clone())
    });
    let (idle, statement): (String, String) = (facts.get(4), facts.get(5));
    checks.push(if idle == "0" {
        check("idle_in_transaction_session_timeout", Status::Warn,
            "0 (none): a session left idle in a transaction keeps its locks for good;              ALTER ROLE ... SET idle_in_transaction_session_timeout = '1min'")
    } else {
        check("idle_in_transaction_session_timeout", Status::Pass, idle)
    });
    checks.push(if statement == "0" {
        check("statement_timeout", Status::Warn,
            "0 (none): a stuck statement runs for good;              ALTER ROLE ... SET statement_timeout = '1min' (above your longest batch)")
    } else {
        check("statement_timeout", Status::Pass, statement)
    });
    let ssl: bool = facts.get(6);
    checks.push(if ssl {
        check("tls", Status::Pass, "the connection is encrypted")
    } else {
        check(
            "tls",
            Status::Warn,
            "plain text: pass --tls-root-cert (or PGSSLMODE=verify-full with PGSSLROOTCERT)",
        )
    });
    let server_clock: f64 = facts.get(7);
    let local_clock = started.duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    let difference = (server_clock - (local_clock + rtt / 2).as_secs_f64()).abs();
    let difference = Duration::from_secs_f64(difference);
    checks.push(if difference > Duration::from_secs(1) {
        check("clock", Status::Warn, format!(
            "this machine and the server differ by {}: leases go by the server's clock, but              logs will not line up; run NTP on both", secs(difference)
        ))
    } else {
        check("clock", Status::Pass, format!("within {} of the server", secs(difference.max(rtt))))
    });
    let (role, superuser, own_role): (String, Option<bool>, bool) =
        (facts.get(8), facts.get(9), facts.get(10));
    let (has_kv, has_lease, has_version): (bool, bool, bool) =
        (facts.get(11), facts.get(12), facts.get(13));
    let (schema_name, can_create, kv_rights, lease_rights): (String, bool, bool, bool) =
        (facts.get(14), facts.get(15), facts.get(16), facts.get(17));
    let superuser = superuser.unwrap_or(false);
    checks.push(match (has_kv, can_create || superuser) {
        (true, _) if kv_rights && lease_rights => {
            check("privileges", Status::Pass, format!("{role} may use the tables"))
        }
        (true, _) => check("privileges", Status::Fail, format!(
            "{role} lacks rights on the tables: GRANT SELECT, INSERT, UPDATE, DELETE ON {kv}, {lease} TO {role}"
        )),
        (false, true) => check("privileges", Status::Pass, format!(
            "{role} may create the tables in schema {schema_name}"
        )),
        (false, false) if schema_name.is_empty() => check("privileges", Status::Fail, format!(
            "schema {} does not exist: CREATE SCHEMA {} AUTHORIZATION {role}",
            if schema.is_empty() { "(search path)" } else { &schema },
            if schema.is_empty() { "..." } else { &schema }
        )),
        (false, false) => check("privileges", Status::Fail, format!(
            "{role} cannot create the tables: GRANT CREATE ON SCHEMA {schema_name} TO {role}"
        )),
    });
    checks.push(if own_role || superuser {
        check("session control", Status::Pass, format!("{role} can end its own sessions"))
    } else {
        check("session control", Status::Fail,
            "current_user differs from the login role (SET ROLE): pgfence could not end a              session whose write may still commit; log in as the role that owns the tables")
    });
    drop(client);
    if !(has_kv && has_lease) {
        checks.push(check(
            "table",
            Status::Warn,
            format!("no table {} yet: put, import or hold creates it", target.table),
        ));
        return checks;
    }
    let schema_version = if has_version {
        match target.connect().await {
            Ok(client) => {
                let sql = format!("SELECT coalesce(max(version), 0) FROM {version}");
                client.query_one(&sql, &[]).await.map(|row| row.get::<_, i32>(0)).ok()
            }
            Err(_) => None,
        }
    } else {
        None
    };
    checks.push(match schema_version {
        Some(v) => check("schema version", Status::Pass, format!("{v}")),
        None => check(
            "schema version",
            Status::Warn,
            format!("no readable {version}: opening a store migrates it"),
        ),
    });
    let lease_state = match builder.inspect().await {
        Ok(inspector) => inspector.lease_info().await,
        Err(e) => Err(e),
    };
    checks.push(match lease_state {
        Ok(Some(i)) if i.active => check(
            "lease",
            Status::Pass,
            format!("held by {} (epoch {}, expires in {})", i.holder, i.epoch, secs(i.expires_in)),
        ),
        Ok(Some(i)) => check(
            "lease",
            Status::Pass,
            format!("free (last epoch {}, last holder {})", i.epoch, i.holder),
        ),
        Ok(None) => check("lease", Status::Pass, "free (never held)"),
        Err(e) => check("lease", Status::Fail, chain(&e)),
    });
    checks
}

/// Closes a store after a one-shot mutation, releasing the lease at once. The mutation's
/// error, if any, is the one reported. A failed release after a successful mutation is an
/// error too. The change is committed, but the lease now expires only by its TTL.
async fn finish(store: PgKvStore, result: pgfence::Result<()>) -> Result<(), Exit> {
    let closed = store.close().await;
    result?;
    closed.map_err(|e| Exit {
        code: 1,
        message: format!(
            "committed, but releasing the lease failed (it expires by its TTL): {}",
            chain(&e)
        ),
    })
}

async fn status(builder: Builder, json: bool) -> Result<(), Exit> {
    let info = builder.inspect().await?.lease_info().await?;
    let line = match (&info, json) {
        (Some(i), true) if i.active => json!({
            "state": "held",
            "holder": i.holder,
            "epoch": i.epoch,
            "owner_id": i.owner_id.to_string(),
            "expires_in_ms": i.expires_in.as_millis() as u64,
        })
        .to_string(),
        (Some(i), true) => {
            json!({ "state": "free", "epoch": i.epoch, "holder": i.holder }).to_string()
        }
        (None, true) => json!({ "state": "free", "epoch": null }).to_string(),
        (Some(i), false) if i.active => format!(
            "held by {} (epoch {}, owner {}, expires in {})",
            i.holder,
            i.epoch,
            i.owner_id,
            secs(i.expires_in)
        ),
        (Some(i), false) => format!("free (last epoch {}, last holder {})", i.epoch, i.holder),
        (None, false) => "free (never held)".to_owned(),
    };
    writeln!(io::stdout(), "{line}").map_err(|e| Exit::other("stdout", &e))
}

async fn release(builder: Builder, confirmed: bool, json: bool) -> Result<(), Exit> {
    if !confirmed {
        return Err(Exit::usage(
            "release expires the lease of a possibly live holder; pass both --force and --yes",
        ));
    }
    let inspector = builder.inspect().await?;
    let released = inspector.force_release().await?;
    let now = match released {
        Some(_) => None,
        None => inspector.lease_info().await?.filter(|info| info.active),
    };
    if json {
        let holder = |state: &str, info: &pgfence::LeaseInfo| {
            json!({
                "state": state,
                "holder": info.holder,
                "epoch": info.epoch,
                "owner_id": info.owner_id.to_string(),
            })
        };
        return print_line(&match (&released, &now) {
            (Some(held), _) => holder("released", held),
            (None, Some(now)) => holder("changed_hands", now),
            (None, None) => json!({ "state": "nobody" }),
        });
    }
    let line = match released {
        Some(held) => format!(
            "released the lease held by {} (epoch {}, owner {}); it is fenced from its next write",
            held.holder, held.epoch, held.owner_id
        ),
        // Released nothing. A live holder now took the lease while this command ran. The
        // release is by the owner it found. Name the new holder, and do not release it unasked.
        None => match now {
            Some(now) => format!(
                "released nothing: the lease changed hands while this command ran and is held by \
                 {} (epoch {}, owner {}); run it again to release that holder",
                now.holder, now.epoch, now.owner_id
            ),
            None => "nobody held the lease".to_owned(),
        },
    };
    writeln!(io::stdout(), "{line}").map_err(|e| Exit::other("stdout", &e))
}

async fn export(builder: Builder, out: Option<PathBuf>) -> Result<(), Exit> {
    let inspector = builder.inspect().await?;
    let writer: Box<dyn Write> = match &out {
        Some(path) => Box::new(
            File::create(path).map_err(|e| Exit::other(&format!("{}", path.display()), &e))?,
        ),
        None => Box::new(io::stdout().lock()),
    };
    let mut writer = BufWriter::new(writer);
    let target = out.as_ref().map_or_else(|| "stdout".to_owned(), |p| p.display().to_string());
    for (primary, secondary, key) in inspector.list_all_keys().await? {
        let value = match inspector.read(&primary, &secondary, &key).await {
            Ok(value) => value,
            Err(e) if e.is_not_found() => continue, // Removed since the listing.
            Err(e) => return Err(e.into()),
        };
        let line = row_json(&primary, &secondary, &key, &value);
        writeln!(writer, "{line}").map_err(|e| Exit::other(&target, &e))?;
    }
    writer.flush().map_err(|e| Exit::other(&target, &e))
}

async fn import(builder: Builder, input: Option<PathBuf>, json: bool) -> Result<(), Exit> {
    let source = input.as_ref().map_or_else(|| "stdin".to_owned(), |p| p.display().to_string());
    let reader: Box<dyn BufRead> = match &input {
        // An input file that cannot be opened is a bad input file: exit 2.
        Some(path) => Box::new(BufReader::new(
            File::open(path).map_err(|e| Exit::usage(format!("--in {source}: {e}")))?,
        )),
        None => Box::new(io::stdin().lock()),
    };
    // Parse everything before taking the lease: bad input changes nothing.
    let mut rows = Vec::new();
    for (n, line) in reader.lines().enumerate() {
        let line = line.map_err(|e| match e.kind() {
            io::ErrorKind::InvalidData => {
                Exit::usage(format!("{source} line {}: not UTF-8", n + 1))
            }
            _ => Exit::other(&source, &e),
        })?;
        if line.trim().is_empty() {
            continue;
        }
        let row = parse_row(&line)
            .map_err(|reason| Exit::usage(format!("{source} line {}: {reason}", n + 1)))?;
        rows.push(row);
    }
    let store = builder.open().await?;
    let count = rows.len();
    let batch =
        rows.into_iter().fold(store.batch(), |batch, (p, s, k, v)| batch.put(&p, &s, &k, v));
    let committed = batch.commit().await;
    finish(store, committed).await?;
    if json {
        return print_line(&json!({ "command": "import", "imported": count }));
    }
    let keys = if count == 1 { "key" } else { "keys" };
    print_line(&format_args!("imported {count} {keys}"))
}

type Row = (String, String, String, Vec<u8>);

fn parse_row(line: &str) -> Result<Row, String> {
    let row: Value = serde_json::from_str(line).map_err(|e| format!("not JSON: {e}"))?;
    let field = |name: &str| {
        row.get(name)
            .and_then(Value::as_str)
            .map(str::to_owned)
            .ok_or_else(|| format!("missing string field {name:?}"))
    };
    let value =
        BASE64.decode(field("value")?).map_err(|e| format!("\"value\" is not base64: {e}"))?;
    let (primary, secondary, key) =
        (field("primary_namespace")?, field("secondary_namespace")?, field("key")?);
    check_key(&primary, &secondary, &key).map_err(|e| e.to_string())?;
    Ok((primary, secondary, key, value))
}

/// SIGINT or SIGTERM, whichever comes first.
struct Signals {
    interrupt: Signal,
    terminate: Signal,
}

impl Signals {
    fn install() -> Result<Signals, Exit> {
        let install =
            |kind| signal(kind).map_err(|e| Exit::other("cannot install signal handler", &e));
        Ok(Signals {
            interrupt: install(SignalKind::interrupt())?,
            terminate: install(SignalKind::terminate())?,
        })
    }

    async fn recv(&mut self) {
        tokio::select! {
            _ = self.interrupt.recv() => {}
            _ = self.terminate.recv() => {}
        }
    }
}

/// One JSON line on stdout. A closed stdout does not stop the holder: the lease, not the
/// output, is what it is for.
fn emit(mut event: Value) {
    event["at"] = Value::String(utc_now());
    let mut out = io::stdout().lock();
    let _ = writeln!(out, "{event}").and_then(|()| out.flush());
}

/// The time now, UTC, as RFC 3339 with milliseconds: `2026-12-01T23:57:04.123Z`.
fn utc_now() -> String {
    let now = std::time::SystemTime::now();
    rfc3339(now.duration_since(std::time::UNIX_EPOCH).unwrap_or_default())
}

/// `since` the Unix epoch as RFC 3339, UTC, with milliseconds.
fn rfc3339(since: Duration) -> String {
    let (days, secs) = (since.as_secs() / 86_400, since.as_secs() % 86_400);
    // Days since 1970-01-01 to a civil date (Howard Hinnant's days_from_civil, inverted).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        secs / 3_600,
        secs % 3_600 / 60,
        secs % 60,
        since.subsec_millis()
    )
}

/// Where `hold --write-every` writes its counter.
#[derive(Debug, Clone)]
struct CounterKey {
    primary: String,
    secondary: String,
    key: String,
    /// As given on the command line, for the `write` events.
    name: String,
}

impl CounterKey {
    fn parse(name: &str) -> Result<CounterKey, Exit> {
        let parts: Vec<&str> = name.split('/').collect();
        let (primary, secondary, key) = match parts.as_slice() {
            [key] => ("pgfence", "hold", *key),
            [primary, secondary, key] => (*primary, *secondary, *key),
            _ => {
                return Err(Exit::usage(format!(
                    "--counter-key {name:?}: expected KEY or NS/SUB/KEY"
                )));
            }
        };
        check_key(primary, secondary, key)?;
        Ok(CounterKey {
            primary: primary.to_owned(),
            secondary: secondary.to_owned(),
            key: key.to_owned(),
            name: name.to_owned(),
        })
    }
}

/// How `hold` ended, once it holds the lease.
enum Ended {
    Signalled,
    Lost,
    WriterFailed(Error),
}

/// How often at most `hold --wait` reports that the standby cannot reach the database.
const TROUBLE_REPORT_EVERY: Duration = Duration::from_secs(30);

async fn hold(builder: Builder, args: HoldArgs, target: Target) -> Result<(), Exit> {
    // Installed before anything else: from here on SIGINT/SIGTERM mean "release and exit 0".
    // They never mean the default instant death that would leave the lease to expire by TTL.
    let mut signals = Signals::install()?;
    let counter = args.counter_key.as_deref().map(CounterKey::parse).transpose()?;
    // The library's defaults for the TTL. Renewal every TTL/3 leaves another TTL/3 of retries
    // (about one a second) before the local deadline at 2/3 TTL. That deadline itself comes
    // before the DB expiry.
    let builder = builder.lease_ttl(args.ttl).on_lease_lost(LeaseLossPolicy::FailClosed);

    // A signal before the lease is taken gives up the opening. A setup may still be waiting,
    // at the fence for the old holder's writes, say. `open_until` returns once it is cancelled
    // on the server, so the exit leaves nothing behind. Exit 0, the lease never held.
    let opened = if args.wait {
        let standby = builder.standby();
        let mut progress = standby.progress();
        let (trouble_sender, mut trouble) = mpsc::unbounded_channel();
        *STANDBY_TROUBLE.lock().unwrap_or_else(|e| e.into_inner()) = Some(trouble_sender);
        // A report is made by a connection attempt of the CLI's own, which names the server
        // and gives the whole cause. It is spawned, so the standby's opening is never held up.
        let (report_sender, mut reports) = mpsc::unbounded_channel::<String>();
        let mut reported_at: Option<tokio::time::Instant> = None;
        let mut probing = false;
        let opening = standby.open_until(signals.recv());
        tokio::pin!(opening);
        let opened = loop {
            tokio::select! {
                opened = &mut opening => break opened,
                Some(warning) = trouble.recv() => {
                    let due = reported_at.is_none_or(|at| at.elapsed() >= TROUBLE_REPORT_EVERY);
                    if due && !probing {
                        probing = true;
                        let (target, sender) = (target.clone(), report_sender.clone());
                        tokio::spawn(async move {
                            let cause = match target.connect().await {
                                Err(ConnectError::Other(exit)) => exit.message,
                                Err(ConnectError::NoDatabase(message)) => message,
                                // Reachable now: the library's own words are all there is.
                                Ok(_) => warning,
                            };
                            let _ = sender.send(cause);
                        });
                    }
                }
                Some(cause) = reports.recv() => {
                    probing = false;
                    reported_at = Some(tokio::time::Instant::now());
                    emit(json!({ "event": "retrying", "error": cause }));
                    let _ = writeln!(io::stderr(), "pgfence: standby retrying: {cause}");
                }
                Ok(()) = progress.changed() => {
                    let state = progress.borrow_and_update().clone();
                    if let StandbyState::Waiting { holder, epoch, expires_in } = state {
                        emit(json!({
                            "event": "waiting",
                            "holder": holder,
                            "epoch": epoch,
                            "expires_in_ms": expires_in.as_millis() as u64,
                        }));
                    }
                }
            }
        };
        *STANDBY_TROUBLE.lock().unwrap_or_else(|e| e.into_inner()) = None;
        opened?
    } else {
        builder.open_until(signals.recv()).await?
    };
    let Some(store) = opened else { return Ok(()) };
    let epoch = store.fencing_token();
    emit(json!({ "event": "acquired", "epoch": epoch, "owner_id": store.owner_id().to_string() }));

    let (stop, stopped) = watch::channel(false);
    let mut writer = match (counter, args.write_every) {
        (Some(counter), Some(every)) => {
            let start = match counter_start(&store, &counter).await {
                Ok(start) => start,
                Err(exit) => {
                    // Reporting the cause; a failed release is only worth a warning beside it.
                    if let Err(e) = store.close().await {
                        tracing::warn!(error = %e, "releasing the lease failed");
                    }
                    return Err(exit);
                }
            };
            let every = Duration::from_millis(every);
            Some(tokio::spawn(write_counter(store.clone(), counter, start, every, stopped)))
        }
        _ => None,
    };

    let mut state = store.lease_state();
    let ended = {
        let writer_done = async {
            match writer {
                Some(ref mut handle) => handle.await,
                None => std::future::pending().await,
            }
        };
        tokio::pin!(writer_done);
        tokio::select! {
            () = signals.recv() => Ended::Signalled,
            // Renewal (or a write) found the loss: the watch reports it whoever found it.
            _ = state.wait_for(|s| matches!(s, LeaseState::Lost { .. })) => Ended::Lost,
            finished = &mut writer_done => match finished {
                Ok(Err(e)) if e.is_lease_lost() => Ended::Lost,
                Ok(Err(e)) => Ended::WriterFailed(e),
                // The writer returns Ok only when stopped, and panics never (nothing in it
                // unwraps); report either as a failed writer all the same.
                Ok(Ok(())) | Err(_) => Ended::WriterFailed(Error::Closed),
            },
        }
    };
    if let Ended::Lost = ended {
        // Report at once: the process must stop now, whatever the cleanup costs. Nothing of
        // this store can commit any more, so the write in flight is simply dropped. We await the
        // aborted writer; it stops at its next await. Then a `write` event for a write that
        // committed before the loss is never printed after `lost`.
        if let Some(handle) = writer {
            handle.abort();
            if !handle.is_finished() {
                let _ = handle.await;
            }
        }
        let lost = lost_exit(&store);
        // Best effort: the release is a no-op by owner id once the lease is someone else's.
        match tokio::time::timeout(CLEANUP_LIMIT, store.close()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::warn!(error = %e, "closing the lost store failed"),
            Err(_) => tracing::warn!(?CLEANUP_LIMIT, "closing the lost store timed out"),
        }
        return Err(lost.unwrap_or(Exit { code: 5, message: "lease lost".to_owned() }));
    }
    // Orderly: let the writer finish the write in flight; it never starts another after
    // `stop`. So close() releases after the last write of this epoch, not beside it. A second
    // signal skips the wait, as an impatient operator expects.
    let shutdown = async {
        let _ = stop.send(true); // The writer may have ended already; then nothing listens.
        // A writer that already ended was awaited above (its result is in `ended`): a
        // JoinHandle must not be polled again after it returned.
        let writer = writer.filter(|_| !matches!(ended, Ended::WriterFailed(_)));
        let written = match writer {
            Some(handle) => match handle.await {
                Ok(result) => result,
                Err(e) => Err(Error::Runtime { source: io::Error::other(e.to_string()) }),
            },
            None => Ok(()),
        };
        (written, store.close().await)
    };
    let (written, closed) = tokio::select! {
        done = shutdown => done,
        // At once, without running destructors: dropping the store would wait for a release.
        () = signals.recv() => std::process::exit(i32::from(fail_code(Exit {
            code: 1,
            message: "signalled again: exiting without releasing the lease; it expires by its TTL"
                .to_owned(),
        }))),
    };
    // The loss may have been found by the last write or by renewal during the shutdown.
    if let Some(lost) = lost_exit(&store) {
        return Err(lost);
    }
    if let Ended::WriterFailed(e) = ended {
        return Err(Exit { code: 1, message: format!("counter write failed: {}", chain(&e)) });
    }
    if let Err(e) = written {
        return Err(Exit { code: 1, message: format!("last counter write failed: {}", chain(&e)) });
    }
    closed.map_err(|e| Exit {
        code: 1,
        message: format!("releasing the lease failed (it expires by its TTL): {}", chain(&e)),
    })?;
    emit(json!({ "event": "released", "epoch": epoch }));
    Ok(())
}

/// Bounds the cleanup after a loss. The release it attempts is a no-op (by owner id, and the
/// lease is no longer ours). So it must not hold up the exit.
const CLEANUP_LIMIT: Duration = Duration::from_secs(5);

/// If the store's lease is lost: prints the `lost` event and returns exit 5.
fn lost_exit(store: &PgKvStore) -> Option<Exit> {
    let (epoch, reason) = match &*store.lease_state().borrow() {
        LeaseState::Lost { epoch, reason } => (*epoch, reason.to_string()),
        _ => return None,
    };
    emit(json!({ "event": "lost", "epoch": epoch, "reason": reason }));
    Some(Exit { code: 5, message: format!("lease lost (epoch {epoch}): {reason}") })
}

/// Where the counter goes on: after the value in the store, written by this or an earlier
/// holder. A new holder rebuilds its state from the store, as any successor must.
async fn counter_start(store: &PgKvStore, counter: &CounterKey) -> Result<u64, Exit> {
    match store.read(&counter.primary, &counter.secondary, &counter.key).await {
        Ok(bytes) => serde_json::from_slice::<Value>(&bytes)
            .ok()
            .and_then(|v| v.get("counter").and_then(Value::as_u64))
            .map(|n| n + 1)
            .ok_or_else(|| {
                Exit::usage(format!(
                    "--counter-key {}: the key holds a value that is not a pgfence counter",
                    counter.name
                ))
            }),
        Err(e) if e.is_not_found() => Ok(1),
        Err(e) => Err(e.into()),
    }
}

/// Writes `{"counter":N,"epoch":E}` every `every` until stopped, one write at a time, and
/// prints a `write` event for each committed one. Returns the first error that is not worth
/// retrying on the next tick: lease lost, closed, anything but a connection problem. A
/// connection problem the store could not ride out itself is reported and retried.
async fn write_counter(
    store: PgKvStore,
    counter: CounterKey,
    start: u64,
    every: Duration,
    mut stopped: watch::Receiver<bool>,
) -> Result<(), Error> {
    let epoch = store.fencing_token();
    let mut ticks = tokio::time::interval(every);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    let mut n = start;
    loop {
        tokio::select! {
            _ = stopped.wait_for(|stop| *stop) => return Ok(()),
            _ = ticks.tick() => {}
        }
        let value = json!({ "counter": n, "epoch": epoch }).to_string().into_bytes();
        match store.write(&counter.primary, &counter.secondary, &counter.key, value).await {
            Ok(()) => {
                emit(
                    json!({ "event": "write", "key": counter.name, "counter": n, "epoch": epoch }),
                );
                n += 1;
            }
            Err(e) if e.is_retryable() => {
                let _ = writeln!(
                    io::stderr(),
                    "pgfence: counter write failed, retrying: {}",
                    chain(&e)
                );
            }
            Err(e) => return Err(e),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_are_rfc3339_utc() {
        assert_eq!(rfc3339(Duration::ZERO), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339(Duration::from_millis(951_782_400_250)), "2000-02-29T00:00:00.250Z");
        assert_eq!(rfc3339(Duration::from_secs(1_796_169_599)), "2026-12-01T23:59:59.000Z");
    }
}
