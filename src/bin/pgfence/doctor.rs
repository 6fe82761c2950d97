//! `pgfence doctor`: checks a deployment before it is trusted.

use std::io::{self, Write};
use std::time::Duration;

use pgfence::Builder;
use serde_json::{Value, json};
use tokio_postgres::types::Type;

use crate::exit::{Exit, chain};
use crate::output::{print_line, secs};
use crate::privileges::{TABLES, Use, and_list, grant_name, ident};
use crate::target::{ConnectError, Target, quote_table};

/// One check of `doctor`.
pub(crate) struct Check {
    name: &'static str,
    status: Status,
    /// What was found and, for a warning or a failure, what to change.
    detail: String,
}

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum Status {
    Pass,
    Warn,
    Fail,
}

impl Status {
    fn as_str(self) -> &'static str {
        match self {
            Status::Pass => "pass",
            Status::Warn => "warn",
            Status::Fail => "fail",
        }
    }
}

fn check(name: &'static str, status: Status, detail: impl Into<String>) -> Check {
    Check { name, status, detail: detail.into() }
}

/// Where a session default comes from, strongest first: PostgreSQL applies `pg_db_role_setting`
/// from the role in the database down to all roles, and the connection's options and a `SET`
/// above them all.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Level {
    Session,
    Connection,
    RoleInDatabase,
    Role,
    Database,
    AllRoles,
}

impl Level {
    /// The level a `pg_settings.source` names; `None` for the server's own configuration.
    fn of_source(source: &str) -> Option<Level> {
        match source {
            "session" => Some(Level::Session),
            "client" => Some(Level::Connection),
            "database user" => Some(Level::RoleInDatabase),
            "user" => Some(Level::Role),
            "database" => Some(Level::Database),
            "global" => Some(Level::AllRoles),
            _ => None,
        }
    }

    /// The level of a row of `pg_db_role_setting`. A row of neither is `ALTER ROLE ALL SET`;
    /// `ALTER ROLE ALL IN DATABASE` is stored as `ALTER DATABASE` is.
    fn of_row(database: bool, role: bool) -> Level {
        match (database, role) {
            (true, true) => Level::RoleInDatabase,
            (false, true) => Level::Role,
            (true, false) => Level::Database,
            (false, false) => Level::AllRoles,
        }
    }

    /// Whose value it is, for the one that hides another.
    fn owner(self) -> &'static str {
        match self {
            Level::Session => "a SET in this session",
            Level::Connection => "the connection's options",
            Level::RoleInDatabase => "the role's value in this database",
            Level::Role => "the role's value",
            Level::Database => "the database's value",
            Level::AllRoles => "the value for all roles",
        }
    }
}

/// One level's value of `synchronous_commit` or `default_transaction_isolation`.
struct SessionDefault {
    level: Level,
    name: String,
    value: String,
}

/// The two settings, in the order they are reported, and what pgfence does to a value it
/// overrides. It raises `off`, `local` and `remote_write` to `on` and keeps `remote_apply`; it
/// runs at read committed, which `read uncommitted` is in PostgreSQL.
const OVERRIDDEN: [(&str, &str); 2] = [
    ("synchronous_commit", "pgfence commits its own writes with on"),
    ("default_transaction_isolation", "pgfence runs its own transactions at read committed"),
];

/// Whether pgfence overrides `value` of setting `name`. PostgreSQL reads an enum's value
/// without regard to case, and takes `synchronous_commit`'s boolean spellings.
fn overridden(name: &str, value: &str) -> bool {
    let value = value.trim().to_ascii_lowercase();
    match name {
        "synchronous_commit" => {
            matches!(value.as_str(), "off" | "false" | "no" | "0" | "local" | "remote_write")
        }
        _ => matches!(value.as_str(), "repeatable read" | "serializable"),
    }
}

/// `value` as SQL: quoted unless it is one plain word.
fn literal(value: &str) -> String {
    let plain = !value.is_empty()
        && value.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    match plain {
        true => value.to_owned(),
        false => format!("'{}'", value.replace('\'', "''")),
    }
}

/// Where `d` comes from, as the statement or option that set it.
fn set_by(d: &SessionDefault, role: &str, database: &str) -> String {
    let (name, value, role, database) = (&d.name, literal(&d.value), ident(role), ident(database));
    match d.level {
        Level::Session => format!("SET {name} = {value} in this session"),
        Level::Connection => format!("{name} = {value} in the connection's options"),
        Level::RoleInDatabase => {
            format!("ALTER ROLE {role} IN DATABASE {database} SET {name} = {value}")
        }
        Level::Role => format!("ALTER ROLE {role} SET {name} = {value}"),
        Level::Database => format!("ALTER DATABASE {database} SET {name} = {value}"),
        Level::AllRoles => format!("ALTER ROLE ALL SET {name} = {value}"),
    }
}

/// The `session overrides` check: every level that sets a value pgfence overrides, for the
/// connecting role in its database. They weaken nothing of pgfence's (docs/design.md,
/// "Durability of `Ok`"), but still apply to every other client. A value a stronger level hides
/// is named too: dropping that one brings it back. `in_effect` is each setting's level from
/// `pg_settings`; `unread` says why only those were read, if so.
fn overrides_check(
    found: &[SessionDefault],
    in_effect: &[(String, Option<Level>)],
    (role, database): (&str, &str),
    unread: Option<&str>,
) -> Check {
    let mut groups = Vec::new();
    for (name, action) in OVERRIDDEN {
        let winner = in_effect.iter().find(|(n, _)| n == name).and_then(|(_, level)| *level);
        let mut levels: Vec<&SessionDefault> =
            found.iter().filter(|d| d.name == name && overridden(name, &d.value)).collect();
        levels.sort_by_key(|d| d.level);
        let items: Vec<String> = levels
            .iter()
            .map(|d| match winner {
                Some(winner) if winner < d.level => {
                    format!("{} (hidden here by {})", set_by(d, role, database), winner.owner())
                }
                _ => set_by(d, role, database),
            })
            .collect();
        if !items.is_empty() {
            groups.push(format!("{}: {action}", items.join(", ")));
        }
    }
    let mut detail = match groups.is_empty() {
        true => "none".to_owned(),
        false => format!("{}; other clients keep them", groups.join("; ")),
    };
    if let Some(unread) = unread {
        // Only the winning level shows in pg_settings.
        detail.push_str(&format!("; only the values in effect are shown: {unread}"));
    }
    check("session overrides", Status::Pass, detail)
}

/// Reads what [`overrides_check`] reports: each setting's value and level in this session,
/// then every role and database level from `pg_db_role_setting`. A role that may not read that
/// catalog (it is readable by all unless an administrator revoked it) gets the levels in effect.
async fn session_overrides(client: &tokio_postgres::Client) -> Check {
    let rows = match client.query_typed(SESSION_DEFAULTS, &[]).await {
        Ok(rows) => rows,
        Err(e) => return check("session overrides", Status::Warn, chain(&e)),
    };
    let Some(first) = rows.first() else {
        return check("session overrides", Status::Warn, "pg_settings lists neither setting");
    };
    let (role, database): (String, String) = (first.get(3), first.get(4));
    let in_session: Vec<SessionDefault> = rows
        .iter()
        .filter_map(|row| {
            let level = Level::of_source(row.get::<_, &str>(2))?;
            Some(SessionDefault { level, name: row.get(0), value: row.get(1) })
        })
        .collect();
    let in_effect: Vec<(String, Option<Level>)> =
        in_session.iter().map(|d| (d.name.clone(), Some(d.level))).collect();
    let (found, unread) = match client.query_typed(ROLE_DATABASE_DEFAULTS, &[]).await {
        Ok(rows) => {
            let mut found: Vec<SessionDefault> = rows
                .iter()
                .map(|row| SessionDefault {
                    level: Level::of_row(row.get(0), row.get(1)),
                    name: row.get(2),
                    value: row.get(3),
                })
                .collect();
            // The catalog holds no connection's options nor a SET.
            found.extend(in_session.into_iter().filter(|d| d.level <= Level::Connection));
            (found, None)
        }
        Err(e) if e.code() == Some(&tokio_postgres::error::SqlState::INSUFFICIENT_PRIVILEGE) => {
            (in_session, Some("this role may not read pg_db_role_setting".to_owned()))
        }
        Err(e) => (in_session, Some(format!("pg_db_role_setting: {}", chain(&e)))),
    };
    overrides_check(&found, &in_effect, (&role, &database), unread.as_deref())
}

/// The server-side facts `doctor` reads, in one statement: nothing is created or changed.
const DOCTOR_FACTS: &str = "SELECT
    current_setting('server_version_num')::int,
    current_setting('server_version'),
    current_setting('synchronous_commit'),
    current_setting('synchronous_standby_names'),
    current_setting('idle_in_transaction_session_timeout'),
    current_setting('statement_timeout'),
    coalesce((SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()), false),
    extract(epoch FROM clock_timestamp())::float8,
    host(inet_server_addr()),
    inet_server_port()";

/// The value of each setting pgfence overrides for its own transactions (docs/design.md,
/// "Durability of `Ok`"), and where it comes from; the role's name and the database's.
/// `session_user`: the role whose settings PostgreSQL applied at login.
const SESSION_DEFAULTS: &str = "SELECT name, setting, source, session_user::text,
    current_database()::text
  FROM pg_settings
 WHERE name IN ('synchronous_commit', 'default_transaction_isolation')";

/// Every value of the two settings that the role and database levels store, for this role in
/// this database: whether the row names the database, whether it names the role, the name and
/// the value as written. `pg_settings` shows only the strongest.
const ROLE_DATABASE_DEFAULTS: &str = "SELECT s.setdatabase <> 0, s.setrole <> 0,
    lower(split_part(c, '=', 1)), substr(c, strpos(c, '=') + 1)
  FROM pg_db_role_setting s, unnest(s.setconfig) AS c
 WHERE s.setdatabase IN (0, (SELECT oid FROM pg_database WHERE datname = current_database()))
   AND s.setrole IN (0, (SELECT oid FROM pg_roles WHERE rolname = session_user))
   AND lower(split_part(c, '=', 1)) IN ('synchronous_commit', 'default_transaction_isolation')";

/// The role and the table's schema: `$1` is the schema given with the table, NULL for an
/// unqualified name. That one lives in the schema the store creates it in, `current_schema()`
/// (NULL when no schema of the `search_path` exists).
const SCHEMA_FACTS: &str = "SELECT
    current_user::text,
    current_database()::text,
    coalesce($1::text, current_schema()),
    n.oid IS NOT NULL,
    coalesce(has_schema_privilege(n.oid, 'USAGE'), false),
    coalesce(has_schema_privilege(n.oid, 'CREATE'), false),
    has_database_privilege(current_database(), 'CREATE')
  FROM (SELECT 1) AS one
  LEFT JOIN pg_namespace n ON n.nspname = coalesce($1::text, current_schema())";

/// For each table of `$1` (quoted names, in the order of `privileges::TABLES`): whether it
/// exists and the rights the role has on it. Only run with `USAGE` on the schema: without it,
/// `to_regclass` fails.
const TABLE_FACTS: &str = "SELECT
    r IS NOT NULL,
    coalesce(has_table_privilege(r, 'SELECT'), false),
    coalesce(has_table_privilege(r, 'INSERT'), false),
    coalesce(has_table_privilege(r, 'UPDATE'), false),
    coalesce(has_table_privilege(r, 'DELETE'), false)
  FROM unnest($1::text[]) WITH ORDINALITY AS t (name, i), to_regclass(t.name) AS r
 ORDER BY t.i";

/// The timeline of the current WAL position, as acquisition reads it for its epoch floor.
const WAL_TIMELINE: &str =
    "SELECT ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::bigint";

/// `doctor`: each check a row of a pass/warn/fail table (or `--json`); exit 1 if one fails.
/// `read_only`: the role is meant to read only, so only the rights of reading are checked.
pub(crate) async fn doctor(
    builder: Builder,
    target: &Target,
    read_only: bool,
    json: bool,
) -> Result<(), Exit> {
    let checks = doctor_checks(builder, target, read_only).await;
    let worst = checks.iter().map(|c| c.status).max().unwrap_or(Status::Pass);
    if json {
        let rows: Vec<Value> = checks
            .iter()
            .map(|c| json!({ "check": c.name, "status": c.status.as_str(), "detail": c.detail }))
            .collect();
        print_line(&json!({ "status": worst.as_str(), "checks": rows }))?;
    } else {
        let width = checks.iter().map(|c| c.name.len()).max().unwrap_or(0);
        let mut out = io::stdout().lock();
        for c in &checks {
            writeln!(out, "{:<width$}  {:<4}  {}", c.name, c.status.as_str(), c.detail)
                .map_err(|e| Exit::other("stdout", &e))?;
        }
    }
    match worst {
        Status::Fail => Err(Exit { code: 1, message: "doctor: a check failed".to_owned() }),
        _ => Ok(()),
    }
}

/// The versions pgfence supports, as `server_version_num` ranges: 13 to 18. CI tests each
/// (docs/deployments.md).
const SUPPORTED: std::ops::Range<i32> = 130_000..190_000;

fn version_check(number: i32, shown: &str) -> Check {
    const NAME: &str = "server version";
    match number {
        n if SUPPORTED.contains(&n) => check(NAME, Status::Pass, format!("PostgreSQL {shown}")),
        // The KV table's identity column needs 10.
        n if n < 100_000 => check(
            NAME,
            Status::Fail,
            format!("PostgreSQL {shown}: pgfence needs 10 or later, and supports 13 to 18"),
        ),
        n if n < SUPPORTED.start => check(
            NAME,
            Status::Warn,
            format!(
                "PostgreSQL {shown}: pgfence supports 13 to 18, and is not tested on this \
                 version; upgrade the server"
            ),
        ),
        _ => check(
            NAME,
            Status::Warn,
            format!(
                "PostgreSQL {shown}: newer than the versions pgfence supports (13 to 18); run \
                 its tests against this server (docs/deployments.md)"
            ),
        ),
    }
}

async fn doctor_checks(builder: Builder, target: &Target, read_only: bool) -> Vec<Check> {
    let mut checks = Vec::new();
    let started = std::time::SystemTime::now();
    let client = match target.connect().await {
        Ok(client) => client,
        Err(ConnectError::NoDatabase(message)) => {
            checks.push(check(
                "connection",
                Status::Fail,
                format!("{message}: create it (CREATE DATABASE) or fix the connection string"),
            ));
            return checks;
        }
        Err(ConnectError::Other(exit)) => {
            checks.push(check("connection", Status::Fail, exit.message));
            return checks;
        }
    };
    checks.push(check("connection", Status::Pass, format!("connected to {}", target.servers())));
    let facts = match client.query_typed_one(DOCTOR_FACTS, &[]).await {
        Ok(row) => row,
        Err(e) => {
            checks.push(check("server facts", Status::Fail, chain(&e)));
            return checks;
        }
    };
    let rtt = started.elapsed().unwrap_or_default();
    checks.push(version_check(facts.get(0), facts.get(1)));
    let (sync_commit, standbys): (String, String) = (facts.get(2), facts.get(3));
    checks.push(check(
        "synchronous_commit",
        Status::Pass,
        match sync_commit.as_str() {
            "on" => sync_commit.clone(),
            "remote_apply" => "remote_apply: pgfence keeps it".to_owned(),
            weaker => format!("{weaker}; pgfence commits its own writes with on"),
        },
    ));
    checks.push(session_overrides(&client).await);
    checks.push(if standbys.trim().is_empty() {
        check(
            "synchronous_standby_names",
            Status::Warn,
            "empty: acknowledged writes are on this server only, and a failover to a replica \
             may lose them; list the replicas in synchronous_standby_names",
        )
    } else {
        check("synchronous_standby_names", Status::Pass, standbys.clone())
    });
    let (idle, statement): (String, String) = (facts.get(4), facts.get(5));
    checks.push(if idle == "0" {
        check(
            "idle_in_transaction_session_timeout",
            Status::Warn,
            "0 (none): a session left idle in a transaction keeps its locks for good; ALTER \
             ROLE ... SET idle_in_transaction_session_timeout = '1min'",
        )
    } else {
        check("idle_in_transaction_session_timeout", Status::Pass, idle)
    });
    checks.push(if statement == "0" {
        check(
            "statement_timeout",
            Status::Warn,
            "0 (none): a stuck statement runs for good; ALTER ROLE ... SET statement_timeout = \
             '1min' (above your longest batch)",
        )
    } else {
        check("statement_timeout", Status::Pass, statement)
    });
    let ssl: bool = facts.get(6);
    checks.push(if ssl {
        check("tls", Status::Pass, "the connection is encrypted")
    } else {
        check(
            "tls",
            Status::Warn,
            "plain text: pass --tls-root-cert (or PGSSLMODE=verify-full with PGSSLROOTCERT)",
        )
    });
    let server_clock: f64 = facts.get(7);
    let local_clock = started.duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
    let difference = (server_clock - (local_clock + rtt / 2).as_secs_f64()).abs();
    let difference = Duration::from_secs_f64(difference);
    checks.push(if difference > Duration::from_secs(1) {
        check(
            "clock",
            Status::Warn,
            format!(
                "this machine and the server differ by {}: leases go by the server's clock, but \
                 logs will not line up; run NTP on both",
                secs(difference)
            ),
        )
    } else {
        check("clock", Status::Pass, format!("within {} of the server", secs(difference.max(rtt))))
    });
    let usage = if read_only { Use::Reader } else { Use::Write };
    let (privileges, tables) = privileges_check(&client, &target.table, usage).await;
    let role = privileges.role.clone();
    checks.push(privileges.check);
    // Acquisition takes its epoch floor from the WAL timeline (src/sql.rs, ACQUIRE). A role
    // whose EXECUTE on these functions was revoked could never acquire the lease. Reading
    // needs neither.
    if !read_only {
        checks.push(match client.query_typed_one(WAL_TIMELINE, &[]).await {
            Ok(row) => check(
                "wal timeline",
                Status::Pass,
                format!("{role} may read the WAL position (timeline {})", row.get::<_, i64>(0)),
            ),
            Err(e) => check(
                "wal timeline",
                Status::Fail,
                format!(
                    "{role} cannot read the WAL position, which acquiring the lease needs ({}): \
                     GRANT EXECUTE ON FUNCTION pg_walfile_name(pg_lsn), pg_current_wal_lsn() TO \
                     {}, or connect to the primary",
                    chain(&e),
                    ident(&role)
                ),
            ),
        });
    }
    drop(client);
    let server_end: (Option<String>, Option<i32>) = (facts.get(8), facts.get(9));
    let session = match builder.clone().inspect().await {
        Ok(inspector) => inspector.check_session().await,
        Err(e) => Err(e),
    };
    checks.push(pooler_check(target, server_end, session));
    let [has_kv, has_lease, has_version, _] = tables.map(|t| t.is_some_and(|t| t.exists));
    if !(has_kv && has_lease) {
        let detail = match tables[0] {
            None => format!("{} cannot look for table {} (see privileges)", role, target.table),
            Some(_) if read_only => {
                format!("no table {} yet: a write command creates it", target.table)
            }
            Some(_) => format!("no table {} yet: put, import or hold creates it", target.table),
        };
        checks.push(check("table", Status::Warn, detail));
        return checks;
    }
    // A reader need not read the version table; only opening a store does.
    if !read_only {
        let version = quote_table(&target.table, "_schema_version");
        let schema_version = if has_version {
            match target.connect().await {
                Ok(client) => {
                    let sql = format!("SELECT coalesce(max(version), 0) FROM {version}");
                    client.query_typed_one(&sql, &[]).await.map(|row| row.get::<_, i32>(0)).ok()
                }
                Err(_) => None,
            }
        } else {
            None
        };
        checks.push(match schema_version {
            Some(v) => check("schema version", Status::Pass, format!("{v}")),
            None => check(
                "schema version",
                Status::Warn,
                format!("no readable {version}: opening a store creates it"),
            ),
        });
    }
    let lease_state = match builder.inspect().await {
        Ok(inspector) => inspector.lease_info().await,
        Err(e) => Err(e),
    };
    checks.push(match lease_state {
        Ok(Some(i)) if i.active => check(
            "lease",
            Status::Pass,
            format!("held by {} (epoch {}, expires in {})", i.holder, i.epoch, secs(i.expires_in)),
        ),
        Ok(Some(i)) => check(
            "lease",
            Status::Pass,
            format!("free (last epoch {}, last holder {})", i.epoch, i.holder),
        ),
        Ok(None) => check("lease", Status::Pass, "free (never held)"),
        Err(e) => check("lease", Status::Fail, chain(&e)),
    });
    checks
}

/// One table's facts: whether it exists, and the rights of the role on it.
#[derive(Clone, Copy)]
struct TableFacts {
    exists: bool,
    /// SELECT, INSERT, UPDATE, DELETE, in the order of [`RIGHTS`].
    has: [bool; 4],
}

const RIGHTS: [&str; 4] = ["SELECT", "INSERT", "UPDATE", "DELETE"];

/// The `privileges` check, and its role.
struct Privileges {
    check: Check,
    role: String,
}

/// The `privileges` check for `usage`: the rights on the schema and on each table that the
/// commands of that use need ([`Use::rights`]), as docs/deployments.md lists them. Also the
/// facts of the three tables, `None` when the role may not look for them.
async fn privileges_check(
    client: &tokio_postgres::Client,
    table: &str,
    usage: Use,
) -> (Privileges, [Option<TableFacts>; TABLES.len()]) {
    const NAME: &str = "privileges";
    let given = table.split_once('.').map(|(schema, _)| schema.to_owned());
    let unknown = [None; TABLES.len()];
    let facts = match client.query_typed_one(SCHEMA_FACTS, &[(&given, Type::TEXT)]).await {
        Ok(row) => row,
        Err(e) => {
            let check = check(NAME, Status::Fail, chain(&e));
            return (Privileges { check, role: "<role>".to_owned() }, unknown);
        }
    };
    let (role, database, schema): (String, String, Option<String>) =
        (facts.get(0), facts.get(1), facts.get(2));
    let (schema_exists, usage_on_schema, create_on_schema, create_on_database): (
        bool,
        bool,
        bool,
        bool,
    ) = (facts.get(3), facts.get(4), facts.get(5), facts.get(6));
    let done = |status, detail: String| {
        let role = role.clone();
        (Privileges { check: check(NAME, status, detail), role }, unknown)
    };
    let who = ident(&role);
    let Some(schema) = schema else {
        return done(
            Status::Fail,
            format!(
                "no schema of {role}'s search_path exists, so the tables have none to live in: \
                 name one with --table SCHEMA.TABLE, or ALTER ROLE {who} SET search_path = ..."
            ),
        );
    };
    let shown = ident(&schema);
    let writes = usage == Use::Write;
    if !schema_exists {
        // Only a qualified name gets here: current_schema() names an existing schema.
        return match (writes, create_on_database) {
            (false, _) => done(
                Status::Fail,
                format!("schema {shown} does not exist: nothing to read (check --table)"),
            ),
            (true, true) => {
                done(Status::Pass, format!("{role} may create schema {shown} and the tables in it"))
            }
            (true, false) => done(
                Status::Fail,
                format!(
                    "schema {shown} does not exist and {role} may not create it: CREATE SCHEMA \
                     {shown} AUTHORIZATION {who} as an administrator, or GRANT CREATE ON \
                     DATABASE {} TO {who}",
                    ident(&database)
                ),
            ),
        };
    }
    if !usage_on_schema {
        let also = if writes { " (and CREATE, if pgfence is to create the tables)" } else { "" };
        return done(
            Status::Fail,
            format!(
                "{role} may not use schema {shown}: GRANT USAGE ON SCHEMA {shown} TO \
                 {who}{also}"
            ),
        );
    }
    let names: Vec<String> = TABLES.iter().map(|suffix| quote_table(table, suffix)).collect();
    let rows = match client.query_typed(TABLE_FACTS, &[(&names, Type::TEXT_ARRAY)]).await {
        Ok(rows) => rows,
        Err(e) => return done(Status::Fail, chain(&e)),
    };
    let mut tables = unknown;
    for (slot, row) in tables.iter_mut().zip(&rows) {
        *slot = Some(TableFacts {
            exists: row.get(0),
            has: [row.get(1), row.get(2), row.get(3), row.get(4)],
        });
    }
    let privileges = |status, detail: String| {
        let role = role.clone();
        Privileges { check: check(NAME, status, detail), role }
    };
    let found = tables.map(|t| t.unwrap_or(TableFacts { exists: false, has: [false; 4] }));
    // A write command creates what is missing, in the same schema. A reader needs only the
    // tables it reads.
    let missing: Vec<String> = TABLES
        .iter()
        .zip(&found)
        .filter(|(suffix, facts)| !facts.exists && (writes || !usage.rights(suffix).is_empty()))
        .map(|(suffix, _)| grant_name(table, suffix))
        .collect();
    if !missing.is_empty() {
        let check = match (writes, create_on_schema) {
            (false, _) => privileges(
                Status::Warn,
                format!("no {} to read yet (see table)", and_list(&as_strs(&missing))),
            ),
            (true, true) => privileges(
                Status::Pass,
                format!("{role} may create {} in schema {shown}", and_list(&as_strs(&missing))),
            ),
            (true, false) => privileges(
                Status::Fail,
                format!(
                    "{role} cannot create {} in schema {shown}: GRANT CREATE ON SCHEMA {shown} \
                     TO {who}, or create them as the owner (docs/deployments.md, \
                     \"Privileges\")",
                    and_list(&as_strs(&missing))
                ),
            ),
        };
        return (check, tables);
    }
    // What each table lacks of what `usage` needs.
    let mut grants = Vec::new();
    for (suffix, facts) in TABLES.iter().zip(&found).filter(|(_, facts)| facts.exists) {
        let lacking: Vec<&str> = usage
            .rights(suffix)
            .iter()
            .copied()
            .filter(|right| {
                let at = RIGHTS.iter().position(|r| r == right).expect("a known right");
                !facts.has[at]
            })
            .collect();
        if !lacking.is_empty() {
            grants.push(format!(
                "GRANT {} ON {} TO {who}",
                lacking.join(", "),
                grant_name(table, suffix)
            ));
        }
    }
    let check = match (grants.is_empty(), usage) {
        (true, Use::Write) => privileges(
            Status::Pass,
            format!("{role} may use the tables (SELECT, INSERT, UPDATE, DELETE on the KV table)"),
        ),
        (true, _) => privileges(
            Status::Pass,
            format!("{role} may read the tables (status, get, ls, export)"),
        ),
        (false, Use::Write) => {
            let reads = [Use::Read, Use::Status].iter().all(|u| {
                TABLES.iter().zip(&found).all(|(suffix, facts)| {
                    u.rights(suffix).iter().all(|right| {
                        let at = RIGHTS.iter().position(|r| r == right).expect("a known right");
                        facts.has[at]
                    })
                })
            });
            let reader = match reads {
                true => {
                    "; it may read (status, get, ls, export: doctor --read-only checks only \
                     that)"
                }
                false => "",
            };
            privileges(
                Status::Fail,
                format!(
                    "{role} cannot open a store (put, rm, import, hold){reader}: {}",
                    grants.join("; ")
                ),
            )
        }
        (false, _) => privileges(
            Status::Fail,
            format!("{role} cannot read the tables: {}", grants.join("; ")),
        ),
    };
    (check, tables)
}

fn as_strs(items: &[String]) -> Vec<&str> {
    items.iter().map(String::as_str).collect()
}

/// Whether something sits between this machine and the server, and whether it keeps a server
/// session per client. A pooler or proxy shows as a server port other than the one connected
/// to. A transaction pooler shows in the library's own check (`session`), which `open()` makes.
fn pooler_check(
    target: &Target,
    (server_addr, server_port): (Option<String>, Option<i32>),
    session: pgfence::Result<()>,
) -> Check {
    use tokio_postgres::config::Host;
    const NAME: &str = "pooler";
    match session {
        Err(pgfence::Error::PoolerModeUnsupported { pool_mode }) => {
            return check(
                NAME,
                Status::Fail,
                format!(
                    "a pooler hands server sessions out per {pool_mode} (PgBouncer transaction or \
                 statement mode): pass --pool-mode transaction, or set pool_mode = session \
                 for this database, or connect to the server directly"
                ),
            );
        }
        Err(e) => {
            return check(
                NAME,
                Status::Warn,
                format!(
                    "could not check for a transaction pooler: {}; run doctor again",
                    chain(&e)
                ),
            );
        }
        Ok(()) => {}
    }
    let hosts = target.config.get_hosts();
    let ports = target.config.get_ports();
    let port_of = |i: usize| ports.get(i).or(ports.first()).copied().unwrap_or(5432);
    let tcp_ports: Vec<u16> = hosts
        .iter()
        .enumerate()
        .filter(|(_, host)| matches!(host, Host::Tcp(_)))
        .map(|(i, _)| port_of(i))
        .collect();
    // The server's end of this connection: its address and port, or a Unix socket (NULL).
    let (server, direct) = match server_port {
        Some(port) => {
            let addr = server_addr.unwrap_or_default();
            let direct = u16::try_from(port).is_ok_and(|p| tcp_ports.contains(&p));
            (format!("{addr}:{port}"), direct)
        }
        None => ("a Unix socket".to_owned(), tcp_ports.len() < hosts.len()),
    };
    let connected = target.servers();
    if target.pool_mode == pgfence::PoolMode::Transaction {
        // The library's check is skipped in this mode: nothing tells the two modes apart.
        let seen = match direct {
            true => format!("none seen: the server's end is {server}, as connected"),
            false => format!("connected to {connected}, the server's end is {server}"),
        };
        return check(
            NAME,
            Status::Pass,
            format!("{seen}; --pool-mode transaction: pgfence keeps nothing in a server session"),
        );
    }
    if direct {
        check(NAME, Status::Pass, format!("none seen: the server's end is {server}, as connected"))
    } else {
        // A pooler or proxy in session mode, or a NAT: what pgfence needs.
        check(
            NAME,
            Status::Pass,
            format!(
                "a pooler or proxy sits between: connected to {connected}, the server's end is \
             {server}; it keeps one server session per client (session mode), as pgfence needs"
            ),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 13 to 18 pass, as the README and docs/deployments.md say; 10 to 12 and newer ones warn;
    /// below 10 fails.
    #[test]
    fn supported_versions_pass() {
        let status = |n| version_check(n, "x").status;
        for n in [130_023, 150_018, 160_014, 170_010, 180_004] {
            assert!(status(n) == Status::Pass, "{n}");
        }
        for n in [100_023, 120_022, 190_000] {
            assert!(status(n) == Status::Warn, "{n}");
        }
        assert!(status(90_624) == Status::Fail);
    }

    /// Only the values pgfence changes are overridden, in any spelling PostgreSQL takes.
    #[test]
    fn overridden_values() {
        for value in ["off", "FALSE", "no", "0", "local", "remote_write"] {
            assert!(overridden("synchronous_commit", value), "{value}");
        }
        for value in ["on", "true", "remote_apply"] {
            assert!(!overridden("synchronous_commit", value), "{value}");
        }
        for value in ["serializable", "Repeatable Read"] {
            assert!(overridden("default_transaction_isolation", value), "{value}");
        }
        for value in ["read committed", "read uncommitted"] {
            assert!(!overridden("default_transaction_isolation", value), "{value}");
        }
    }

    /// A role that may not read `pg_db_role_setting` gets the levels in effect, and is told so.
    #[test]
    fn without_the_catalog_only_the_values_in_effect_show() {
        let found = [SessionDefault {
            level: Level::Database,
            name: "synchronous_commit".to_owned(),
            value: "off".to_owned(),
        }];
        let in_effect = [("synchronous_commit".to_owned(), Some(Level::Database))];
        let unread = Some("this role may not read pg_db_role_setting");
        let c = overrides_check(&found, &in_effect, ("svc", "App"), unread);
        assert_eq!(
            c.detail,
            "ALTER DATABASE \"App\" SET synchronous_commit = off: pgfence commits its own writes \
             with on; other clients keep them; only the values in effect are shown: this role \
             may not read pg_db_role_setting"
        );
        assert_eq!(overrides_check(&[], &[], ("svc", "app"), None).detail, "none", "nothing set");
    }
}
