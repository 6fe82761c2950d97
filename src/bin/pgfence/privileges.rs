//! What each command needs of the role, and the `GRANT` that gives it. docs/deployments.md,
//! section "Privileges", lists the same rights; `doctor` checks them.
//!
//! The library's permission error names the privilege from the server's message alone. The
//! CLI knows the command, so it names exactly what that command needs, in its own words.

use std::sync::OnceLock;

/// What a command does with the tables, for the rights it needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Use {
    /// `get`, `ls`, `export`: the KV table.
    Read,
    /// `status`: the lease table.
    Status,
    /// `doctor --read-only`: what `Read` and `Status` need together.
    Reader,
    /// `release --force`: reads and expires the lease row.
    Release,
    /// `put`, `rm`, `import`, `hold`, `audit`: opens a store, creating the tables if missing.
    Write,
}

/// The tables of a pgfence table name, by the suffix of their name. `_crash_marker` is the
/// UNLOGGED table that tells a flush of deferred writes whether the server crashed since.
pub(crate) const TABLES: [&str; 4] = ["", "_lease", "_schema_version", "_crash_marker"];

impl Use {
    /// The rights this use needs on the table with `suffix` (one of [`TABLES`]).
    pub(crate) fn rights(self, suffix: &str) -> &'static [&'static str] {
        match (self, suffix) {
            (Use::Read | Use::Reader, "") => &["SELECT"],
            (Use::Status | Use::Reader, "_lease") => &["SELECT"],
            (Use::Release, "_lease") => &["SELECT", "UPDATE"],
            (Use::Write, "") => &["SELECT", "INSERT", "UPDATE", "DELETE"],
            (Use::Write, "_lease") => &["SELECT", "INSERT", "UPDATE"],
            (Use::Write, "_schema_version") => &["SELECT"],
            (Use::Write, "_crash_marker") => &["SELECT", "INSERT", "UPDATE"],
            _ => &[],
        }
    }
}

/// The command running and its table, for [`advice`]. Set once, before the command runs.
pub(crate) static COMMAND: OnceLock<(&'static str, Use, String)> = OnceLock::new();

/// An identifier as `psql` would need it: quoted unless plain lower case.
pub(crate) fn ident(name: &str) -> String {
    let plain = name.starts_with(|c: char| c.is_ascii_lowercase() || c == '_')
        && name.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    match plain {
        true => name.to_owned(),
        false => format!("\"{}\"", name.replace('"', "\"\"")),
    }
}

/// `table` (`name` or `schema.name`) with `suffix` added to the name, for a `GRANT`.
pub(crate) fn grant_name(table: &str, suffix: &str) -> String {
    match table.split_once('.') {
        Some((schema, name)) => format!("{}.{}", ident(schema), ident(&format!("{name}{suffix}"))),
        None => ident(&format!("{table}{suffix}")),
    }
}

/// `a`, `a and b`, `a, b and c`.
pub(crate) fn and_list(items: &[&str]) -> String {
    match items {
        [] => String::new(),
        [one] => (*one).to_owned(),
        [init @ .., last] => format!("{} and {last}", init.join(", ")),
    }
}

/// The line of a permission error of the running command: what it needs and the `GRANT`. `message`
/// is the server's (`permission denied for table x`); `operation` the library's step, if
/// known. `None` when the server names something this cannot place.
pub(crate) fn advice(message: &str, operation: Option<&str>, role: &str) -> Option<String> {
    let (command, usage, table) = COMMAND.get()?;
    let schema = table.split_once('.').map(|(schema, _)| schema);
    let role = ident(role);
    let needs = |what: String, grant: String| {
        Some(format!(
            "permission denied: {command} needs {what}; fix: {grant} (`pgfence doctor` lists \
             every right the role lacks)"
        ))
    };
    if let Some(denied) = message.strip_prefix("permission denied for table ") {
        // The server names the table without its schema.
        let name = table.split_once('.').map_or(table.as_str(), |(_, name)| name);
        let suffix = TABLES.iter().find(|suffix| denied == format!("{name}{suffix}"))?;
        let rights = usage.rights(suffix);
        if rights.is_empty() {
            return None;
        }
        let object = grant_name(table, suffix);
        return needs(
            format!("{} on table {object}", and_list(rights)),
            format!("GRANT {} ON {object} TO {role}", rights.join(", ")),
        );
    }
    if let Some(denied) = message.strip_prefix("permission denied for schema ") {
        let schema = ident(denied);
        // Only creating the tables needs CREATE; looking for them needs USAGE.
        let creating = matches!(operation, Some("create version table" | "migrate schema"));
        return match (creating, usage) {
            (true, _) => needs(
                format!("USAGE and CREATE on schema {schema}, to create the tables"),
                format!("GRANT USAGE, CREATE ON SCHEMA {schema} TO {role}"),
            ),
            // Without USAGE the role cannot see whether the tables exist.
            (false, Use::Write) => needs(
                format!(
                    "USAGE on schema {schema}, and CREATE on it too while the tables do not \
                     exist"
                ),
                format!(
                    "GRANT USAGE ON SCHEMA {schema} TO {role}, and GRANT CREATE ON SCHEMA \
                     {schema} TO {role} for pgfence to create the tables"
                ),
            ),
            (false, _) => needs(
                format!("USAGE on schema {schema}"),
                format!("GRANT USAGE ON SCHEMA {schema} TO {role}"),
            ),
        };
    }
    if let Some(database) = message.strip_prefix("permission denied for database ") {
        let schema = ident(schema.unwrap_or("public"));
        return needs(
            format!("CREATE on database {}, to create schema {schema}", ident(database)),
            format!(
                "CREATE SCHEMA {schema} AUTHORIZATION {role} as an administrator, or GRANT \
                 CREATE ON DATABASE {} TO {role}",
                ident(database)
            ),
        );
    }
    if let Some(owned) = message.strip_prefix("must be owner of table ") {
        return Some(format!(
            "permission denied: {command} would migrate the tables to this pgfence's schema, \
             which needs their owner; fix: run it once as the owner of {owned}, then again as \
             {role}"
        ));
    }
    if let Some(function) = message.strip_prefix("permission denied for function ") {
        return needs(
            format!("EXECUTE on function {function}, which acquiring the lease calls"),
            "GRANT EXECUTE ON FUNCTION pg_walfile_name(pg_lsn), pg_current_wal_lsn() TO "
                .to_owned()
                + &role,
        );
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identifiers_are_quoted_only_when_needed() {
        assert_eq!(ident("app_1"), "app_1");
        assert_eq!(ident("App"), "\"App\"");
        assert_eq!(ident("svc-app"), "\"svc-app\"");
        assert_eq!(grant_name("app.node_state", "_lease"), "app.node_state_lease");
        assert_eq!(grant_name("Kv", ""), "\"Kv\"");
        assert_eq!(and_list(&["SELECT", "INSERT", "UPDATE"]), "SELECT, INSERT and UPDATE");
    }
}
