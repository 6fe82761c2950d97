//! The two fenced statements of the write path: one key alone, or many keys in one batch
//! statement. Each checks the lease in the same statement as the change (see [`crate::sql`]).

use tokio_postgres::types::ToSql;

use crate::error::{KeyPath, Result};
use crate::exec::Executor;

/// A change of one key: by `write`, `remove`, or as part of a batch.
#[derive(Debug)]
pub(crate) enum Mutation {
    Write(Vec<u8>),
    Remove,
}

/// Runs one mutation in its own fenced statement, while the caller holds its key's turn.
pub(crate) async fn apply_alone(
    exec: &Executor,
    path: &KeyPath,
    mutation: &Mutation,
) -> Result<()> {
    let (pn, sn, key) = (&path.primary_namespace, &path.secondary_namespace, &path.key);
    let s = &exec.statements;
    match mutation {
        Mutation::Write(value) => {
            exec.fenced("write", (&s.write, Some(&s.write_call)), &[pn, sn, key, value]).await
        }
        Mutation::Remove => {
            exec.fenced("remove", (&s.remove, Some(&s.remove_call)), &[pn, sn, key]).await
        }
    }
}

/// Runs the one fenced batch statement for `ops` (each key at most once), while the caller
/// holds every key's turn. `Ok` means all of them committed.
pub(crate) async fn apply_fenced<'a>(
    exec: &Executor,
    ops: impl IntoIterator<Item = (&'a KeyPath, &'a Mutation)>,
) -> Result<()> {
    let mut puts = Columns::default();
    let mut removes = Columns::default();
    let mut values: Vec<&[u8]> = Vec::new();
    for (path, op) in ops {
        match op {
            Mutation::Write(value) => {
                puts.push(path);
                values.push(value);
            }
            Mutation::Remove => removes.push(path),
        }
    }
    let statements = &exec.statements;
    let puts = [&puts.primary as &(dyn ToSql + Sync), &puts.secondary, &puts.key, &values];
    if removes.key.is_empty() {
        return exec.fenced("batch", (&statements.batch_put, None), &puts).await;
    }
    let removes = [&removes.primary as &(dyn ToSql + Sync), &removes.secondary, &removes.key];
    let params = [&puts[..], &removes[..]].concat();
    exec.fenced("batch", (&statements.batch, None), &params).await
}

/// The name columns of a batch's puts or removes, bound as three `text[]` parameters.
#[derive(Default)]
struct Columns<'a> {
    primary: Vec<&'a str>,
    secondary: Vec<&'a str>,
    key: Vec<&'a str>,
}

impl<'a> Columns<'a> {
    fn push(&mut self, path: &'a KeyPath) {
        self.primary.push(&path.primary_namespace);
        self.secondary.push(&path.secondary_namespace);
        self.key.push(&path.key);
    }
}
