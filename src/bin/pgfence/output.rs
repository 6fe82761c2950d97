//! What commands print: lines on stdout, JSON rows, durations.

use std::io::{self, Write};
use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use serde_json::{Value, json};

use crate::KeyArgs;
use crate::exit::Exit;

/// One line on stdout.
pub(crate) fn print_line(line: &dyn std::fmt::Display) -> Result<(), Exit> {
    writeln!(io::stdout(), "{line}").map_err(|e| Exit::other("stdout", &e))
}

/// A row as `export` writes it (`value` in base64); also `get --json`.
pub(crate) fn row_json(primary: &str, secondary: &str, key: &str, value: &[u8]) -> Value {
    json!({
        "primary_namespace": primary,
        "secondary_namespace": secondary,
        "key": key,
        "value": BASE64.encode(value),
    })
}

/// What `put --json` and `rm --json` print once done: the command, the key and the epoch of
/// the lease it was done under. Nothing without `--json`.
pub(crate) fn done_json(json: bool, command: &str, k: &KeyArgs, epoch: i64) -> Result<(), Exit> {
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

/// A duration as people read it: `4.0 s`, the one format of every human line.
pub(crate) fn secs(duration: Duration) -> String {
    format!("{:.1} s", duration.as_secs_f64())
}
