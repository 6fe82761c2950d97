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

use crate::ImportAsked;
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

/// The keys LDK itself writes: a node that ever ran has its ChannelManager, and one with
/// channels has their monitors (`lightning::util::persist`).
fn is_ldk_key((primary, secondary, key): &(String, String, String)) -> bool {
    let monitors = ["monitors", "archived_monitors", "monitor_updates"];
    (primary.is_empty() && secondary.is_empty() && key == "manager")
        || monitors.contains(&primary.as_str())
}

/// A node's secret, which has no business in a table unasked: `keys_seed` (LDK's sample node and
/// ldk-node keep the seed in that file, beside or in the store), or anything named like a seed
/// or a signer's secret.
fn is_secret((_, _, key): &(String, String, String)) -> bool {
    key == "keys_seed" || key.ends_with("_seed") || key == "seed" || key == "hsm_secret"
}

/// Refuses a directory that cannot be an LDK store before LDK lists it: LDK's listing panics
/// on a directory nested deeper than its two namespace levels. A node's storage directory is
/// such a one: it holds the store in `fs_store`.
fn check_layout(dir: &Path) -> Result<(), Exit> {
    let shown = dir.display();
    if dir.join("fs_store").is_dir() {
        return Err(Exit::usage(format!(
            "--from-ldk-fs {shown}: this looks like a node's storage directory, which keeps its \
             FilesystemStore in fs_store; pass --from-ldk-fs {}",
            dir.join("fs_store").display()
        )));
    }
    let subdirectories = |dir: &Path| -> Result<Vec<PathBuf>, Exit> {
        let entries = std::fs::read_dir(dir).map_err(|e| Exit::other(&shown.to_string(), &e))?;
        Ok(entries.filter_map(Result::ok).map(|e| e.path()).filter(|p| p.is_dir()).collect())
    };
    for primary in subdirectories(dir)? {
        for secondary in subdirectories(&primary)? {
            if let Some(deeper) = subdirectories(&secondary)?.first() {
                return Err(Exit::usage(format!(
                    "--from-ldk-fs {shown}: not an LDK store: {} is nested deeper than LDK's two \
                     namespace levels",
                    deeper.display()
                )));
            }
        }
    }
    Ok(())
}

/// Refuses, before the lease is taken, what the import must not do unasked: read a directory
/// that is not an LDK store, move a node's secrets, or import nothing.
fn check_source(
    dir: &Path,
    keys: &[(String, String, String)],
    asked: &ImportAsked,
) -> Result<(), Exit> {
    let shown = dir.display();
    if keys.is_empty() {
        return match asked.allow_empty {
            true => Ok(()),
            false => Err(Exit::usage(format!(
                "--from-ldk-fs {shown}: no keys; refusing to import nothing (check the \
                 directory, or pass --allow-empty)"
            ))),
        };
    }
    if !keys.iter().any(is_ldk_key) {
        return Err(Exit::usage(format!(
            "--from-ldk-fs {shown}: not an LDK store: no ChannelManager (key \"manager\") and no \
             channel monitors among its {} keys",
            keys.len()
        )));
    }
    let secrets: Vec<String> =
        keys.iter().filter(|k| is_secret(k)).map(|(p, s, k)| format!("{p}/{s}/{k}")).collect();
    if !secrets.is_empty() && !asked.include_secrets {
        return Err(Exit::usage(format!(
            "--from-ldk-fs {shown}: holds the node's secret {}; refusing to copy it into the \
             table unasked (the node reads it from its file; pass --include-secrets to copy it \
             all the same)",
            secrets.join(", ")
        )));
    }
    Ok(())
}

/// The keys of the store in `dir`.
fn source_keys(source: &Source, shown: &str) -> Result<Vec<(String, String, String)>, Exit> {
    match source {
        Source::V1(fs) => fs.list_all_keys(),
        Source::V2(fs) => fs.list_all_keys(),
    }
    .map_err(from_ldk(shown))
}

/// Copies every key of the store in `dir` into the table, then reads every one back and
/// compares. It refuses, before anything is taken, a directory that is not an LDK store, one
/// with a node's secret unless asked, an empty one unless asked, and a table with keys unless
/// `force`.
pub(crate) async fn import_ldk_fs(
    builder: Builder,
    dir: PathBuf,
    asked: ImportAsked,
    json: bool,
) -> Result<(), Exit> {
    let shown = dir.display().to_string();
    if !dir.is_dir() {
        return Err(Exit::usage(format!("--from-ldk-fs {shown}: not a directory")));
    }
    check_layout(&dir)?;
    let source = Source::open(&dir)?;
    // A listing of the directory, on this thread: nothing else runs meanwhile.
    check_source(&dir, &source_keys(&source, &shown)?, &asked)?;
    let force = asked.force;
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
