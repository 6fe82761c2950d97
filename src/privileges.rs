//! What each use of a store needs of its role: the table privileges docs/deployments.md
//! (section "Privileges") lists, and that `pgfence doctor` checks. A permission error of the
//! store ([`crate::Error::PermissionDenied`]) names the rights of the operation that failed,
//! from this table, and the `GRANT` that gives them.
//!
//! Each set was checked against PostgreSQL: the fenced upsert's `ON CONFLICT` reads the table
//! (`SELECT`), and every fenced statement locks the lease row `FOR KEY SHARE`, which needs
//! `UPDATE` on the lease table besides `SELECT`.

/// The tables of a pgfence table name, by the ending of their name: the entries, the lease
/// row, the schema version, and the UNLOGGED crash marker that tells a flush of deferred writes
/// whether the server crashed since they were written.
pub const TABLES: [&str; 4] = ["", "_lease", "_schema_version", "_crash_marker"];

/// The two functions of a pgfence table name, by the ending of their name: the fenced write
/// and the fenced remove (schema version 6). A single write or remove calls them where the
/// store does not own its sessions: behind a transaction pooler, or on a pool passed in. They
/// run with the caller's privileges on the tables, and need `EXECUTE`, which PostgreSQL grants
/// to `PUBLIC` by default.
pub const FUNCTIONS: [&str; 2] = ["_fenced_write", "_fenced_remove"];

/// What a role does with a store's tables.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Use {
    /// Reads entries: `read`, `list`, the [`crate::Inspector`]'s reads.
    Read,
    /// Reads the lease row: [`crate::PgKvStore::lease_info`], `pgfence status`.
    Status,
    /// What [`Use::Read`] and [`Use::Status`] need together: a read-only role.
    Reader,
    /// Renews, releases or expires the lease row.
    Release,
    /// A `flush`: a no-op update of the lease row, and a check (and renewal) of the crash
    /// marker.
    Flush,
    /// One fenced `write`.
    Put,
    /// One fenced `remove`.
    Remove,
    /// A fenced batch, or writes and removes coalesced into one statement.
    Batch,
    /// Opens a store and writes: acquiring the lease (inserting its row the first time), the
    /// schema check, and every mutation. What an application role needs.
    Write,
}

impl Use {
    /// The rights this use needs on the table whose name ends in `ending` (one of [`TABLES`]).
    /// Empty when it does not touch that table.
    pub fn rights(self, ending: &str) -> &'static [&'static str] {
        const S: &[&str] = &["SELECT"];
        const SU: &[&str] = &["SELECT", "UPDATE"];
        const SIU: &[&str] = &["SELECT", "INSERT", "UPDATE"];
        match (self, ending) {
            (Use::Read | Use::Reader, "") => S,
            (Use::Status | Use::Reader, "_lease") => S,
            (Use::Release | Use::Flush | Use::Put | Use::Remove | Use::Batch, "_lease") => SU,
            (Use::Flush | Use::Write, "_crash_marker") => SIU,
            (Use::Put, "") => SIU,
            (Use::Remove, "") => &["SELECT", "DELETE"],
            (Use::Batch | Use::Write, "") => &["SELECT", "INSERT", "UPDATE", "DELETE"],
            (Use::Write, "_lease") => SIU,
            (Use::Write, "_schema_version") => S,
            _ => &[],
        }
    }

    /// The use of a statement of the store's, by the operation its errors name.
    pub(crate) fn of_operation(operation: &str) -> Use {
        match operation {
            "write" => Use::Put,
            "remove" => Use::Remove,
            "batch" => Use::Batch,
            "read" | "list" | "list a page" | "list all keys" | "read entries" => Use::Read,
            "read lease" => Use::Status,
            "renew lease" | "release lease" | "prepare renewal" => Use::Release,
            "flush" => Use::Flush,
            _ => Use::Write,
        }
    }
}

/// Whether the operation creates tables, so that a schema's `CREATE` is what it lacks.
fn creates(operation: &str) -> bool {
    matches!(operation, "create version table" | "migrate schema" | "create schema")
}

/// For a permission error (SQLSTATE 42501) of `operation`: the privilege missing, and the
/// statement an administrator runs to give it to `role`, from the server's message. The
/// server names a table without its schema, so the `GRANT` does too.
pub(crate) fn advice(message: &str, operation: &str, role: &str) -> (String, String) {
    let usage = Use::of_operation(operation);
    if let Some(table) = message.strip_prefix("permission denied for table ") {
        let ending = TABLES.iter().rev().find(|ending| table.ends_with(*ending)).unwrap_or(&"");
        let rights = usage.rights(ending);
        if !rights.is_empty() {
            let rights = rights.join(", ");
            return (
                format!("{rights} on table {table}"),
                format!("GRANT {rights} ON {table} TO {role}"),
            );
        }
    } else if let Some(schema) = message.strip_prefix("permission denied for schema ") {
        return match (creates(operation), usage) {
            (true, _) => (
                format!("USAGE and CREATE on schema {schema}, to create the tables"),
                format!("GRANT USAGE, CREATE ON SCHEMA {schema} TO {role}"),
            ),
            // Without USAGE the store cannot see whether the tables exist: the GRANT covers
            // creating them, which a first open does.
            (false, Use::Write) => (
                format!("USAGE on schema {schema}, and CREATE on it while the tables do not exist"),
                format!("GRANT USAGE, CREATE ON SCHEMA {schema} TO {role}"),
            ),
            (false, _) => (
                format!("USAGE on schema {schema}"),
                format!("GRANT USAGE ON SCHEMA {schema} TO {role}"),
            ),
        };
    } else if let Some(database) = message.strip_prefix("permission denied for database ") {
        return (
            format!("CREATE on database {database}, to create the table's schema"),
            format!(
                "create the schema as an administrator (CREATE SCHEMA ... AUTHORIZATION {role}), \
                 or GRANT CREATE ON DATABASE {database} TO {role}"
            ),
        );
    } else if message.starts_with("permission denied to create database") {
        return (
            "CREATEDB".to_owned(),
            format!("ALTER ROLE {role} CREATEDB, or create the database as an administrator"),
        );
    } else if let Some(function) = message.strip_prefix("permission denied for function ") {
        if FUNCTIONS.iter().any(|ending| function.ends_with(ending)) {
            return (
                format!("EXECUTE on function {function}, which a write or remove calls"),
                format!("GRANT EXECUTE ON FUNCTION {function} TO {role}"),
            );
        }
        return (
            format!("EXECUTE on function {function}, which acquiring the lease calls"),
            format!(
                "GRANT EXECUTE ON FUNCTION pg_walfile_name(pg_lsn), pg_current_wal_lsn() TO {role}"
            ),
        );
    }
    (
        format!("a privilege the server names: {message}"),
        "run `pgfence doctor`, which names the privileges the role lacks".to_owned(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_operation_is_advised_its_own_rights() {
        let advised = |message: &str, operation: &str| advice(message, operation, "app").1;
        assert_eq!(
            advised("permission denied for table kv", "write"),
            "GRANT SELECT, INSERT, UPDATE ON kv TO app"
        );
        assert_eq!(
            advised("permission denied for table kv", "remove"),
            "GRANT SELECT, DELETE ON kv TO app"
        );
        assert_eq!(
            advised("permission denied for table kv", "list all keys"),
            "GRANT SELECT ON kv TO app"
        );
        assert_eq!(
            advised("permission denied for table kv_lease", "write"),
            "GRANT SELECT, UPDATE ON kv_lease TO app"
        );
        assert_eq!(
            advised("permission denied for table kv_lease", "acquire lease"),
            "GRANT SELECT, INSERT, UPDATE ON kv_lease TO app"
        );
        assert_eq!(
            advised("permission denied for table kv_schema_version", "read schema version"),
            "GRANT SELECT ON kv_schema_version TO app"
        );
        assert_eq!(
            advised("permission denied for table kv_lease", "read lease"),
            "GRANT SELECT ON kv_lease TO app"
        );
        assert_eq!(
            advised("permission denied for schema app", "create version table"),
            "GRANT USAGE, CREATE ON SCHEMA app TO app"
        );
        assert_eq!(
            advised("permission denied for schema app", "read"),
            "GRANT USAGE ON SCHEMA app TO app"
        );
        assert_eq!(
            advised("permission denied for function kv_fenced_write", "write"),
            "GRANT EXECUTE ON FUNCTION kv_fenced_write TO app"
        );
        assert_eq!(
            advised("permission denied for function pg_walfile_name", "acquire lease"),
            "GRANT EXECUTE ON FUNCTION pg_walfile_name(pg_lsn), pg_current_wal_lsn() TO app"
        );
    }

    #[test]
    fn every_operation_of_the_store_is_placed() {
        // A read that fell through to `Write` would be advised a writer's rights.
        for read in ["read", "list", "list a page", "list all keys", "read entries"] {
            assert_eq!(Use::of_operation(read), Use::Read, "{read}");
        }
    }
}
