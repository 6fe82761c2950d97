//! How a failed command ends: its exit code and its one line on stderr.

use std::io::{self, Write};
use std::process::ExitCode;

use pgfence::Error;

/// How the process ends when a command fails: the exit code and the one line for stderr.
#[derive(Debug)]
pub(crate) struct Exit {
    pub(crate) code: u8,
    pub(crate) message: String,
}

impl Exit {
    pub(crate) fn usage(message: impl Into<String>) -> Exit {
        Exit { code: 2, message: message.into() }
    }

    pub(crate) fn other(context: &str, error: &(dyn std::error::Error + 'static)) -> Exit {
        Exit { code: 1, message: format!("{context}: {}", chain(error)) }
    }

    /// Exit 6: the database or table the command names does not exist.
    pub(crate) fn missing(message: impl Into<String>) -> Exit {
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
pub(crate) static ROLE: std::sync::OnceLock<String> = std::sync::OnceLock::new();

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
pub(crate) fn chain(error: &(dyn std::error::Error + 'static)) -> String {
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

pub(crate) fn fail(exit: Exit) -> ExitCode {
    ExitCode::from(fail_code(exit))
}

/// Prints the error line and returns the exit code.
pub(crate) fn fail_code(exit: Exit) -> u8 {
    // Nowhere left to report a failing stderr; the exit code still tells.
    let _ = writeln!(io::stderr(), "pgfence: {}", exit.message);
    exit.code
}
