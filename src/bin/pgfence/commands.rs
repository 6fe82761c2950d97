//! The one-shot commands that need more than one call: `status`, `release`, `export`, `import`.

use std::fs::File;
use std::io::{self, BufRead, BufReader, BufWriter, Write};
use std::path::PathBuf;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use pgfence::{Builder, PgKvStore, check_key};
use serde_json::{Value, json};

use crate::exit::{Exit, chain};
use crate::output::{print_line, row_json, secs};

/// Closes a store after a one-shot mutation, releasing the lease at once. The mutation's
/// error, if any, is the one reported. A failed release after a successful mutation is an
/// error too. The change is committed, but the lease now expires only by its TTL.
pub(crate) async fn finish(store: PgKvStore, result: pgfence::Result<()>) -> Result<(), Exit> {
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

pub(crate) async fn status(builder: Builder, json: bool) -> Result<(), Exit> {
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

pub(crate) async fn release(builder: Builder, confirmed: bool, json: bool) -> Result<(), Exit> {
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

pub(crate) async fn export(builder: Builder, out: Option<PathBuf>) -> Result<(), Exit> {
    let inspector = builder.inspect().await?;
    let writer: Box<dyn Write> = match &out {
        Some(path) => Box::new(
            File::create(path).map_err(|e| Exit::other(&format!("{}", path.display()), &e))?,
        ),
        None => Box::new(io::stdout().lock()),
    };
    let mut writer = BufWriter::new(writer);
    let target = out.as_ref().map_or_else(|| "stdout".to_owned(), |p| p.display().to_string());
    // One statement, streamed: a consistent snapshot in bounded memory, whatever the size.
    let mut entries = inspector.entries().await?;
    while let Some(entry) = entries.next().await {
        let (primary, secondary, key, value) = entry?;
        let line = row_json(&primary, &secondary, &key, &value);
        writeln!(writer, "{line}").map_err(|e| Exit::other(&target, &e))?;
    }
    writer.flush().map_err(|e| Exit::other(&target, &e))
}

pub(crate) async fn import(
    builder: Builder,
    input: Option<PathBuf>,
    allow_empty: bool,
    json: bool,
) -> Result<(), Exit> {
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
    if rows.is_empty() && !allow_empty {
        return Err(Exit::usage(format!(
            "{source} holds no rows: refusing to take the lease for nothing (pass --allow-empty \
             to import an empty export)"
        )));
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
