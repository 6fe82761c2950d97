//! The two fenced statements of the write path: one key alone, or many keys in one batch
//! statement. Each checks the lease in the same statement as the change (see [`crate::sql`]).

use tokio_postgres::types::ToSql;

use crate::error::{KeyPath, Result};
use crate::exec::{Executor, Unowned};

/// A change of one key: by `write`, `remove`, or as part of a batch.
#[derive(Debug)]
pub(crate) enum Mutation {
    Write(Vec<u8>),
    Remove,
}

/// When a mutation's commit returns: after its WAL flush, or before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Durability {
    /// After the flush, with at least `synchronous_commit = on` (`write`, `remove`, `commit`).
    Durable,
    /// Before it, with `synchronous_commit = off` for its transaction only (`write_deferred`,
    /// `remove_deferred`, `commit_deferred`). A later durable commit or `flush()` makes it
    /// durable.
    Deferred,
}

impl Durability {
    /// The durability of one statement that carries mutations of each of `all`: durable if any
    /// of them is. A durable commit is never weaker for a deferred mutation, only slower.
    pub(crate) fn of_group(mut all: impl Iterator<Item = Durability>) -> Durability {
        match all.all(|d| d == Durability::Deferred) {
            true => Durability::Deferred,
            false => Durability::Durable,
        }
    }
}

/// Runs one mutation in its own fenced statement, while the caller holds its key's turn.
pub(crate) async fn apply_alone(
    exec: &Executor,
    path: &KeyPath,
    mutation: &Mutation,
    durability: Durability,
) -> Result<()> {
    let (pn, sn, key) = (&path.primary_namespace, &path.secondary_namespace, &path.key);
    let s = &exec.statements;
    // Off the store's own sessions: a durable mutation calls its function, or pins its commit
    // itself. A deferred one keeps the pipelined transaction (the functions commit durably),
    // and sets its commit `off` itself.
    let unowned = |pinned, call| Unowned { pinned, call: Some(call) };
    let ((write, write_unowned), (remove, remove_unowned)) = match durability {
        Durability::Durable => (
            (&s.write, unowned(&s.write_pinned, &s.write_call)),
            (&s.remove, unowned(&s.remove_pinned, &s.remove_call)),
        ),
        Durability::Deferred => (
            (&s.write_deferred, Unowned { pinned: &s.write_deferred, call: None }),
            (&s.remove_deferred, Unowned { pinned: &s.remove_deferred, call: None }),
        ),
    };
    match mutation {
        Mutation::Write(value) => {
            exec.fenced("write", write, write_unowned, &[pn, sn, key, value]).await
        }
        Mutation::Remove => exec.fenced("remove", remove, remove_unowned, &[pn, sn, key]).await,
    }
}

/// Runs the one fenced batch statement for `ops` (each key at most once), while the caller
/// holds every key's turn. `Ok` means all of them committed.
pub(crate) async fn apply_fenced<'a>(
    exec: &Executor,
    ops: impl IntoIterator<Item = (&'a KeyPath, &'a Mutation)>,
    durability: Durability,
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
    let s = &exec.statements;
    // Off the store's own sessions, the pinned forms (a deferred one sets `off` itself).
    let ((batch, batch_pinned), (batch_put, batch_put_pinned)) = match durability {
        Durability::Durable => ((&s.batch, &s.batch_pinned), (&s.batch_put, &s.batch_put_pinned)),
        Durability::Deferred => {
            ((&s.batch_deferred, &s.batch_deferred), (&s.batch_put_deferred, &s.batch_put_deferred))
        }
    };
    let unowned = |pinned| Unowned { pinned, call: None };
    let puts = [&puts.primary as &(dyn ToSql + Sync), &puts.secondary, &puts.key, &values];
    if removes.key.is_empty() {
        return exec.fenced("batch", batch_put, unowned(batch_put_pinned), &puts).await;
    }
    let removes = [&removes.primary as &(dyn ToSql + Sync), &removes.secondary, &removes.key];
    let params = [&puts[..], &removes[..]].concat();
    exec.fenced("batch", batch, unowned(batch_pinned), &params).await
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
