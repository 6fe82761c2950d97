//! `import --from-ldk-fs DIR`: moves an LDK node's `FilesystemStore` into the table.
//!
//! The copy is LDK's own `migrate_kv_store_data`, into a `pgfence::ldk::LdkStore` under the
//! lease. Both directory layouts of `lightning-persister` are read: v1 (`FilesystemStore`, what
//! ldk-node 0.7 and LDK 0.2 nodes write) and v2 (`FilesystemStoreV2`). The node must be stopped
//! first: a node still writing to DIR would change it under the copy.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use lightning::util::persist::{KVStoreSync, MigratableKVStoreSync, migrate_kv_store_data};
use lightning_persister::fs_store::v1::FilesystemStore;
use lightning_persister::fs_store::v2::{FilesystemStoreV2, FilesystemStoreV2Error};
use pgfence::Builder;
use pgfence::ldk::LdkStore;
use serde_json::json;

use crate::exit::Exit;
use crate::output::print_line;

/// The store found in DIR, by its layout.
enum Source {
    V1(FilesystemStore),
    V2(FilesystemStoreV2),
}

impl Source {
    /// v2 keeps every key two directory levels down. A file higher up is v1's layout:
    /// `FilesystemStoreV2::new` refuses such a directory, and then v1 reads it.
    fn open(dir: &Path) -> Result<Source, Exit> {
        match FilesystemStoreV2::new(dir.to_owned()) {
            Ok(store) => Ok(Source::V2(store)),
            Err(FilesystemStoreV2Error::V1DataDetected(_)) => {
                Ok(Source::V1(FilesystemStore::new(dir.to_owned())))
            }
            Err(FilesystemStoreV2Error::Io(e)) => Err(Exit::other(&dir.display().to_string(), &e)),
        }
    }

    fn layout(&self) -> &'static str {
        match self {
            Source::V1(_) => "v1",
            Source::V2(_) => "v2",
        }
    }
}

/// Copies every key of the store in `dir` into the table, then reads every one back and
/// compares. A table with keys is refused unless `force`.
pub(crate) async fn import_ldk_fs(
    builder: Builder,
    dir: PathBuf,
    force: bool,
    json: bool,
) -> Result<(), Exit> {
    let shown = dir.display().to_string();
    if !dir.is_dir() {
        return Err(Exit::usage(format!("--from-ldk-fs {shown}: not a directory")));
    }
    let source = Source::open(&dir)?;
    let store = LdkStore::open_async(builder).await?;
    // The copy and the checks use LDK's sync traits: off the CLI's runtime. The LdkStore runs
    // its statements on a runtime of its own.
    let worker_store = store.clone();
    let copied = tokio::task::spawn_blocking(move || copy(source, worker_store, force, &shown))
        .await
        .map_err(|e| Exit::other("import", &e))?;
    // The lease is released whatever happened; the copy's error is the one reported.
    let closed = store.close_async().await;
    let (count, layout) = copied?;
    closed?;
    if json {
        return print_line(
            &json!({ "command": "import", "imported": count, "layout": layout, "verified": true }),
        );
    }
    let keys = if count == 1 { "key" } else { "keys" };
    print_line(&format_args!(
        "imported {count} {keys} from an LDK FilesystemStore ({layout} layout), all verified"
    ))
}

fn copy(
    source: Source,
    mut target: LdkStore,
    force: bool,
    shown: &str,
) -> Result<(usize, &'static str), Exit> {
    let existing = MigratableKVStoreSync::list_all_keys(&target).map_err(from_ldk("the table"))?;
    if !existing.is_empty() && !force {
        return Err(Exit::usage(format!(
            "the table already holds {} keys; refusing to import into it without --force",
            existing.len()
        )));
    }
    let layout = source.layout();
    let count = match source {
        Source::V1(mut fs) => migrate_and_verify(&mut fs, &mut target, shown)?,
        Source::V2(mut fs) => migrate_and_verify(&mut fs, &mut target, shown)?,
    };
    Ok((count, layout))
}

/// LDK's migration, then every key of the source read from both stores and compared.
fn migrate_and_verify<S: MigratableKVStoreSync>(
    source: &mut S,
    target: &mut LdkStore,
    shown: &str,
) -> Result<usize, Exit> {
    migrate_kv_store_data(source, target).map_err(from_ldk("copying"))?;
    let keys = source.list_all_keys().map_err(from_ldk(shown))?;
    let in_table: BTreeSet<(String, String, String)> = MigratableKVStoreSync::list_all_keys(target)
        .map_err(from_ldk("the table"))?
        .into_iter()
        .collect();
    for (primary, secondary, key) in &keys {
        let name = format!("{primary}/{secondary}/{key}");
        if !in_table.contains(&(primary.clone(), secondary.clone(), key.clone())) {
            return Err(Exit::other("verify", &missing(&name)));
        }
        let expected = source.read(primary, secondary, key).map_err(from_ldk(shown))?;
        let copied =
            KVStoreSync::read(target, primary, secondary, key).map_err(from_ldk("the table"))?;
        if copied != expected {
            return Err(Exit::other("verify", &differs(&name)));
        }
    }
    Ok(keys.len())
}

fn missing(name: &str) -> std::io::Error {
    std::io::Error::other(format!("{name} is missing from the table after the copy"))
}

fn differs(name: &str) -> std::io::Error {
    std::io::Error::other(format!("{name} differs between the directory and the table"))
}

/// An LDK I/O error as an exit: pgfence's own error keeps its exit code (3 for a held lease,
/// 5 for a lost one); any other is exit 1, named by `context`.
fn from_ldk(context: &str) -> impl Fn(lightning::io::Error) -> Exit + '_ {
    move |e| {
        let e = std::io::Error::from(e);
        if !e.get_ref().is_some_and(|inner| inner.is::<pgfence::Error>()) {
            return Exit::other(context, &e);
        }
        match e.into_inner().map(|inner| inner.downcast::<pgfence::Error>()) {
            Some(Ok(error)) => Exit::from(*error),
            // Not reached: the inner error was checked to be pgfence's above.
            _ => Exit::other(context, &std::io::Error::other("unknown error")),
        }
    }
}
