//! `pgfence doctor`: checks a deployment before it is trusted.

use std::io::{self, Write};
use std::time::Duration;

use pgfence::Builder;
use serde_json::{Value, json};
use tokio_postgres::types::Type;

use crate::exit::{Exit, chain};
use crate::output::{print_line, secs};
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

/// The server-side facts `doctor` reads, in one statement: nothing is created or changed.
/// (`has_table_privilege` with a list is true if any one is held, hence one call each.)
const DOCTOR_FACTS: &str = "SELECT
    current_setting('server_version_num')::int,
    current_setting('server_version'),
    current_setting('synchronous_commit'),
    current_setting('synchronous_standby_names'),
    current_setting('idle_in_transaction_session_timeout'),
    current_setting('statement_timeout'),
    coalesce((SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()), false),
    extract(epoch FROM clock_timestamp())::float8,
    current_user::text,
    (SELECT rolsuper FROM pg_roles WHERE rolname = current_user),
    current_user = session_user,
    to_regclass($1::text) IS NOT NULL,
    to_regclass($2::text) IS NOT NULL,
    to_regclass($3::text) IS NOT NULL,
    coalesce(to_regnamespace($4::text)::text, ''),
    CASE WHEN to_regnamespace($4::text) IS NULL THEN false
         ELSE has_schema_privilege(to_regnamespace($4::text), 'CREATE') END,
    CASE WHEN to_regclass($1::text) IS NULL THEN true
         ELSE has_table_privilege($1::text, 'SELECT') AND has_table_privilege($1::text, 'INSERT')
          AND has_table_privilege($1::text, 'UPDATE') AND has_table_privilege($1::text, 'DELETE')
    END,
    CASE WHEN to_regclass($2::text) IS NULL THEN true
         ELSE has_table_privilege($2::text, 'SELECT') AND has_table_privilege($2::text, 'UPDATE')
    END,
    host(inet_server_addr()),
    inet_server_port()";

/// The timeline of the current WAL position, as acquisition reads it for its epoch floor.
const WAL_TIMELINE: &str =
    "SELECT ('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::bigint";

/// `doctor`: each check a row of a pass/warn/fail table (or `--json`); exit 1 if one fails.
pub(crate) async fn doctor(builder: Builder, target: &Target, json: bool) -> Result<(), Exit> {
    let checks = doctor_checks(builder, target).await;
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

async fn doctor_checks(builder: Builder, target: &Target) -> Vec<Check> {
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
    let kv = quote_table(&target.table, "");
    let lease = quote_table(&target.table, "_lease");
    let version = quote_table(&target.table, "_schema_version");
    let schema = match target.table.split_once('.') {
        Some((schema, _)) => schema.to_owned(),
        None => String::new(),
    };
    // Unqualified: the first schema of the search path that exists, where the store creates.
    let schema_sql = if schema.is_empty() { "current_schema()".to_owned() } else { schema.clone() };
    let params = [&kv, &lease, &version, &schema_sql].map(|p| (p as _, Type::TEXT));
    let facts = match client.query_typed_one(DOCTOR_FACTS, &params).await {
        Ok(row) => row,
        Err(e) => {
            checks.push(check("server facts", Status::Fail, chain(&e)));
            return checks;
        }
    };
    let rtt = started.elapsed().unwrap_or_default();
    let number: i32 = facts.get(0);
    let shown: String = facts.get(1);
    checks.push(match number {
        n if n < 100_000 => check("server version", Status::Fail, format!(
            "PostgreSQL {shown}: pgfence needs 10 or later; upgrade the server"
        )),
        n if (150_000..160_000).contains(&n) => {
            check("server version", Status::Pass, format!("PostgreSQL {shown}"))
        }
        _ => check("server version", Status::Warn, format!(
            "PostgreSQL {shown}: pgfence is tested on 15 only; run its tests against this server"
        )),
    });
    let (sync_commit, standbys): (String, String) = (facts.get(2), facts.get(3));
    checks.push(match sync_commit.as_str() {
        "off" | "local" => check("synchronous_commit", Status::Warn, format!(
            "{sync_commit}: an acknowledged write may be lost in a crash;              ALTER ROLE ... SET synchronous_commit = on"
        )),
        _ => check("synchronous_commit", Status::Pass, sync_commit.clone()),
    });
    checks.push(if standbys.trim().is_empty() {
        check("synchronous_standby_names", Status::Warn,
            "empty: acknowledged writes are on this server only, and a failover to a replica may              lose them; list the replicas in synchronous_standby_names")
    } else {
        check("synchronous_standby_names", Status::Pass, standbys.clone())
    });
    let (idle, statement): (String, String) = (facts.get(4), facts.get(5));
    checks.push(if idle == "0" {
        check("idle_in_transaction_session_timeout", Status::Warn,
            "0 (none): a session left idle in a transaction keeps its locks for good;              ALTER ROLE ... SET idle_in_transaction_session_timeout = '1min'")
    } else {
        check("idle_in_transaction_session_timeout", Status::Pass, idle)
    });
    checks.push(if statement == "0" {
        check("statement_timeout", Status::Warn,
            "0 (none): a stuck statement runs for good;              ALTER ROLE ... SET statement_timeout = '1min' (above your longest batch)")
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
        check("clock", Status::Warn, format!(
            "this machine and the server differ by {}: leases go by the server's clock, but              logs will not line up; run NTP on both", secs(difference)
        ))
    } else {
        check("clock", Status::Pass, format!("within {} of the server", secs(difference.max(rtt))))
    });
    let (role, superuser, own_role): (String, Option<bool>, bool) =
        (facts.get(8), facts.get(9), facts.get(10));
    let (has_kv, has_lease, has_version): (bool, bool, bool) =
        (facts.get(11), facts.get(12), facts.get(13));
    let (schema_name, can_create, kv_rights, lease_rights): (String, bool, bool, bool) =
        (facts.get(14), facts.get(15), facts.get(16), facts.get(17));
    let superuser = superuser.unwrap_or(false);
    checks.push(match (has_kv, can_create || superuser) {
        (true, _) if kv_rights && lease_rights => {
            check("privileges", Status::Pass, format!("{role} may use the tables"))
        }
        (true, _) => check("privileges", Status::Fail, format!(
            "{role} lacks rights on the tables: GRANT SELECT, INSERT, UPDATE, DELETE ON {kv}, {lease} TO {role}"
        )),
        (false, true) => check("privileges", Status::Pass, format!(
            "{role} may create the tables in schema {schema_name}"
        )),
        (false, false) if schema_name.is_empty() => check("privileges", Status::Fail, format!(
            "schema {} does not exist: CREATE SCHEMA {} AUTHORIZATION {role}",
            if schema.is_empty() { "(search path)" } else { &schema },
            if schema.is_empty() { "..." } else { &schema }
        )),
        (false, false) => check("privileges", Status::Fail, format!(
            "{role} cannot create the tables: GRANT CREATE ON SCHEMA {schema_name} TO {role}"
        )),
    });
    checks.push(if own_role || superuser {
        check("session control", Status::Pass, format!("{role} can end its own sessions"))
    } else {
        check("session control", Status::Fail,
            "current_user differs from the login role (SET ROLE): pgfence could not end a              session whose write may still commit; log in as the role that owns the tables")
    });
    // Acquisition takes its epoch floor from the WAL timeline (src/sql.rs, ACQUIRE). A role
    // whose EXECUTE on these functions was revoked could never acquire the lease.
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
                "{role} cannot read the WAL position, which acquiring the lease needs ({}): GRANT \
             EXECUTE ON FUNCTION pg_walfile_name(pg_lsn), pg_current_wal_lsn() TO {role}, or \
             connect to the primary",
                chain(&e)
            ),
        ),
    });
    drop(client);
    let server_end: (Option<String>, Option<i32>) = (facts.get(18), facts.get(19));
    let session = match builder.clone().inspect().await {
        Ok(inspector) => inspector.check_session().await,
        Err(e) => Err(e),
    };
    checks.push(pooler_check(target, server_end, session));
    if !(has_kv && has_lease) {
        checks.push(check(
            "table",
            Status::Warn,
            format!("no table {} yet: put, import or hold creates it", target.table),
        ));
        return checks;
    }
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
            format!("no readable {version}: opening a store migrates it"),
        ),
    });
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
