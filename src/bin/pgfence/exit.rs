//! How a failed command ends: its exit code and its one line on stderr.

use std::io::{self, Write};
use std::process::ExitCode;
use std::sync::atomic::{AtomicBool, Ordering};

use pgfence::Error;
use serde_json::json;
use tokio_postgres::error::SqlState;

use crate::privileges::advice;

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
        // The library's text names the server and the failed step of a connection. Two are
        // said in the CLI's own words: what the command needs of the role, and the option for
        // a transaction pooler.
        let role = ROLE.get().map_or("<role>", String::as_str);
        let message = match &e {
            Error::PermissionDenied { operation, source, .. } => source
                .as_db_error()
                .and_then(|db| advice(db.message(), Some(operation), role))
                .unwrap_or_else(|| chain(&e).replace("<role>", role)),
            Error::PoolerModeUnsupported { pool_mode } => format!(
                "the connection goes through a pooler in {pool_mode} mode (PgBouncer's \
                 transaction or statement mode): pass --pool-mode transaction (or set \
                 PGFENCE_POOL_MODE=transaction), or connect through a pooler in session mode, \
                 or directly to PostgreSQL"
            ),
            _ => chain(&e),
        };
        Exit { code, message }
    }
}

/// A permission error of a statement of the CLI's own, as [`advice`] words it.
pub(crate) fn denied(context: &str, e: &tokio_postgres::Error) -> Option<Exit> {
    let db = e.as_db_error().filter(|db| db.code() == &SqlState::INSUFFICIENT_PRIVILEGE)?;
    let role = ROLE.get().map_or("<role>", String::as_str);
    let message =
        advice(db.message(), None, role).unwrap_or_else(|| format!("{context}: {}", chain(e)));
    Some(Exit { code: 1, message })
}

/// The role the command connects as. The library names it in the `GRANT` of a permission
/// error when it knows it; this fills in the `<role>` it writes otherwise.
pub(crate) static ROLE: std::sync::OnceLock<String> = std::sync::OnceLock::new();

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

/// Whether errors are printed as JSON (`--json`).
pub(crate) static JSON: AtomicBool = AtomicBool::new(false);

/// Prints the error line and returns the exit code. Under `--json` the line is a JSON object,
/// `{"error": "...", "exit_code": N}`, still on stderr: stdout keeps the command's own output.
pub(crate) fn fail_code(exit: Exit) -> u8 {
    let line = match JSON.load(Ordering::Relaxed) {
        true => json!({ "error": exit.message, "exit_code": exit.code }).to_string(),
        false => format!("pgfence: {}", exit.message),
    };
    // Nowhere left to report a failing stderr; the exit code still tells.
    let _ = writeln!(io::stderr(), "{line}");
    exit.code
}
