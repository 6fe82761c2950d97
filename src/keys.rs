//! Validation of keys, namespaces and table names, done before any SQL runs.

use crate::error::{Error, Result};

/// Longest key or namespace accepted (LDK's limit too).
pub const MAX_KEY_LEN: usize = 120;

/// The most a [`Batch`](crate::Batch) may carry: 512 MiB.
///
/// It counts the bytes of its keys, namespaces and values. Each operation counts 16 bytes
/// more, for the lengths that go with them on the wire. A batch is one statement. PostgreSQL
/// refuses a protocol message, or an array of values, of 1 GiB or more by closing the
/// connection. This bound keeps every batch well below that. A larger batch gets a typed error
/// ([`Error::BatchTooLarge`]) before any SQL instead.
pub const MAX_BATCH_BYTES: usize = 512 << 20;

/// Longest table name part accepted. PostgreSQL truncates identifiers at 63 bytes; the longest
/// derived name is `<table>_schema_version` (15 more bytes), so 48 keeps every name exact.
pub(crate) const MAX_TABLE_NAME_LEN: usize = 48;

/// The endings of the names a store derives from its table name `t`, in the table's schema:
/// its tables `t_lease`, `t_schema_version` and `t_crash_marker`, the explicitly named index
/// `t_created_idx`,
/// and the names PostgreSQL gives the keys and the identity sequence (`t_pkey`,
/// `t_lease_owner_id_key`, `t_created_seq_seq`). Tables, indexes and sequences share one
/// namespace. The functions `t_fenced_write` and `t_fenced_remove` live in another one, so
/// no table can collide with them. They are reserved all the same, so that every name a store
/// derives is one no other store's table bears: one name, one store, in `\d` and `\df` alike.
/// A table name with one of these endings would be a name another store derives:
/// `t_lease` is store `t`'s lease table. Refusing them keeps every two stores apart, since
/// each longer derived ending that ends in a shorter one (`_lease_pkey`) starts with one of
/// these (`_lease`).
const DERIVED_ENDINGS: &[&str] = &[
    "_lease",
    "_schema_version",
    "_crash_marker",
    "_created_idx",
    "_pkey",
    "_lease_owner_id_key",
    "_created_seq_seq",
    "_fenced_write",
    "_fenced_remove",
];

fn is_key_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_' || c == '-'
}

fn check_part(what: &'static str, value: &str, allow_empty: bool) -> Result<()> {
    let reason = if value.is_empty() && !allow_empty {
        "must not be empty"
    } else if value.len() > MAX_KEY_LEN {
        "longer than 120 characters"
    } else if !value.chars().all(is_key_char) {
        "only ASCII letters, digits, '_' and '-' are allowed"
    } else {
        return Ok(());
    };
    Err(Error::InvalidKey { what, value: value.to_owned(), reason })
}

/// Checks a namespace pair: each 0..=120 characters of `[A-Za-z0-9_-]`, and an empty primary
/// namespace only with an empty secondary one.
pub(crate) fn check_namespaces(primary: &str, secondary: &str) -> Result<()> {
    check_part("primary namespace", primary, true)?;
    check_part("secondary namespace", secondary, true)?;
    if primary.is_empty() && !secondary.is_empty() {
        return Err(Error::InvalidKey {
            what: "secondary namespace",
            value: secondary.to_owned(),
            reason: "must be empty when the primary namespace is empty",
        });
    }
    Ok(())
}

/// Checks a full key path without touching the database.
///
/// - Namespaces have 0..=120 characters of `[A-Za-z0-9_-]`.
/// - An empty primary namespace is allowed only with an empty secondary one.
/// - A key has 1..=120 such characters.
///
/// Every operation does this itself; tools can check input up front.
pub fn check_key(primary: &str, secondary: &str, key: &str) -> Result<()> {
    check_namespaces(primary, secondary)?;
    check_part("key", key, false)
}

/// A validated table name, optionally schema-qualified, with every derived name pre-quoted.
///
/// Only `[A-Za-z_][A-Za-z0-9_]*` parts are accepted, so quoting can never be escaped; names are
/// always quoted, so case is kept as given.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct TableName {
    /// The schema, if the name was qualified.
    pub(crate) schema: Option<String>,
    /// The KV table's own name (unqualified, unquoted).
    pub(crate) name: String,
}

impl TableName {
    pub(crate) fn parse(input: &str) -> Result<TableName> {
        let bad = |reason: String| Error::config("table", reason);
        let parts: Vec<&str> = input.split('.').collect();
        let (schema, name) = match parts.as_slice() {
            [name] => (None, *name),
            [schema, name] => (Some(*schema), *name),
            _ => return Err(bad(format!("{input:?}: expected `table` or `schema.table`"))),
        };
        for part in schema.iter().chain([&name]) {
            let mut chars = part.chars();
            let first_ok = chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_');
            if !first_ok || !chars.all(|c| c.is_ascii_alphanumeric() || c == '_') {
                return Err(bad(format!("{input:?}: each part must match [A-Za-z_][A-Za-z0-9_]*")));
            }
            if part.len() > MAX_TABLE_NAME_LEN {
                return Err(bad(format!("{input:?}: a part is longer than 48 characters")));
            }
        }
        let derived = |e: &&&str| name.len() > e.len() && name.ends_with(**e);
        if let Some(ending) = DERIVED_ENDINGS.iter().find(derived) {
            let other = &name[..name.len() - ending.len()];
            return Err(bad(format!(
                "{input:?} ends in {ending:?}: the store of table {other:?} names a table, index, \
                 sequence or function {name:?} in that schema. Choose a name that does not end \
                 in any of {DERIVED_ENDINGS:?}"
            )));
        }
        Ok(TableName { schema: schema.map(str::to_owned), name: name.to_owned() })
    }

    /// The quoted, qualified identifier of `<table><suffix>`, e.g. `"app"."kv_lease"`.
    pub(crate) fn quoted(&self, suffix: &str) -> String {
        match &self.schema {
            Some(schema) => format!("\"{schema}\".\"{}{suffix}\"", self.name),
            None => format!("\"{}{suffix}\"", self.name),
        }
    }

    /// The name as given (`schema.table` or `table`), for messages and lock keys.
    pub(crate) fn display(&self) -> String {
        match &self.schema {
            Some(schema) => format!("{schema}.{}", self.name),
            None => self.name.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys() {
        assert!(check_key("ns", "sub", "k").is_ok());
        assert!(check_key("", "", "k").is_ok());
        assert!(check_key("ns", "", "k").is_ok());
        assert!(check_key(&"a".repeat(120), &"b".repeat(120), &"c".repeat(120)).is_ok());
        assert!(check_key("A-z_0", "9", "-_").is_ok());
        for bad in ["", &"c".repeat(121), "é", "a/b", "a\0", "a'b", "a\"b", "a b", "a.b"] {
            let e = check_key("ns", "sub", bad).unwrap_err();
            assert!(matches!(e, Error::InvalidKey { what: "key", .. }), "{bad:?}: {e}");
        }
        assert!(check_key("", "sub", "k").is_err());
        assert!(check_key(&"a".repeat(121), "", "k").is_err());
        assert!(check_namespaces("ns", "bad/").is_err());
    }

    #[test]
    fn tables() {
        let t = TableName::parse("node_state").unwrap();
        assert_eq!(t.quoted("_lease"), "\"node_state_lease\"");
        let t = TableName::parse("App.Kv").unwrap();
        assert_eq!(t.quoted(""), "\"App\".\"Kv\"");
        assert_eq!(t.display(), "App.Kv");
        for bad in ["", "a.b.c", ".a", "a.", "1abc", "x\"; DROP TABLE y; --", "a-b", "é", " a"] {
            assert!(TableName::parse(bad).is_err(), "{bad:?}");
        }
        assert!(TableName::parse(&"a".repeat(48)).is_ok());
        // Names another store derives: refused, naming that store's table.
        for (bad, other) in [
            ("t_lease", "\"t\""),
            ("app.t_schema_version", "\"t\""),
            ("t_lease_pkey", "\"t_lease\""),
            ("kv_created_idx", "\"kv\""),
            ("kv_created_seq_seq", "\"kv\""),
            ("kv_lease_owner_id_key", "\"kv\""),
            ("kv_crash_marker", "\"kv\""),
            ("kv_fenced_write", "\"kv\""),
            ("app.kv_fenced_remove", "\"kv\""),
        ] {
            let e = TableName::parse(bad).unwrap_err();
            let Error::InvalidConfig { field: "table", reason } = &e else { panic!("{e}") };
            assert!(reason.contains(&format!("the store of table {other}")), "{reason}");
        }
        for fine in ["_lease", "lease", "t_leases", "T_LEASE", "t_lease_history", "leased"] {
            assert!(TableName::parse(fine).is_ok(), "{fine:?}");
        }
        assert!(TableName::parse(&"a".repeat(49)).is_err());
    }
}
