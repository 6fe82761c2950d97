//! Bad input and bad configuration get typed errors before any SQL runs; nothing is changed.

use crate::common;

use std::io::ErrorKind;
use std::time::Duration;

use common::{admin, builder, table};
use pgfence::{ConnectStep, Error, PgKvStore};
use pgfence_testing::{PASSWORD_ROLE, PASSWORD_ROLE_PASSWORD};

/// Tables whose name starts with `prefix` (other tests create tables concurrently, so only a
/// test's own names can be counted).
async fn tables_like(prefix: &str) -> i64 {
    admin()
        .await
        .query_one(
            "SELECT count(*) FROM pg_class WHERE relkind = 'r' AND starts_with(relname, $1)",
            &[&prefix],
        )
        .await
        .unwrap()
        .get(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_table_names_are_rejected_before_any_sql() {
    let long = "t".repeat(49);
    let injection = format!("{}\"; DROP TABLE y; --", table("inj"));
    for name in
        ["", "a.b.c", ".t", "t.", "1t", "t-1", "t t", "é", long.as_str(), injection.as_str()]
    {
        let e = builder(name).open().await.unwrap_err();
        assert!(matches!(e, Error::InvalidConfig { field: "table", .. }), "{name:?}: {e:?}");
        assert_eq!(std::io::Error::from(e).kind(), ErrorKind::InvalidInput);
    }
}

/// A table name another store derives (`t_lease` is store `t`'s lease table) is refused
/// before any statement, naming that store. Before, the second `open()` failed with a raw
/// database error (`column "owner_id" does not exist`), or took the other store's table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn table_names_that_collide_with_another_stores_are_refused_before_any_sql() {
    let t = table("derived");
    let store = builder(&t).open().await.unwrap();
    let suffixes = [
        "_lease",
        "_schema_version",
        "_crash_marker",
        "_created_idx",
        "_pkey",
        "_lease_owner_id_key",
    ];
    for suffix in suffixes.into_iter().chain(["_fenced_write", "_fenced_remove"]) {
        let name = format!("{t}{suffix}");
        let e = builder(&name).open().await.unwrap_err();
        let Error::InvalidConfig { field: "table", reason } = &e else { panic!("{name}: {e:?}") };
        assert!(reason.contains(&format!("the store of table \"{t}\"")), "{reason}");
    }
    // Nothing was created for the refused names, and the first store is unharmed.
    assert_eq!(tables_like(&format!("{t}_lease_")).await, 0);
    assert_eq!(tables_like(&format!("{t}_schema_version_")).await, 0);
    store.write("a", "b", "k", b"v".to_vec()).await.unwrap();
    store.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quote_injection_in_the_table_name_is_harmless() {
    // A victim table that an injection would drop.
    let db = admin().await;
    let victim = table("victim");
    db.batch_execute(&format!("CREATE TABLE \"{victim}\" (x int)")).await.unwrap();
    let e = builder(&format!("x\"; DROP TABLE \"{victim}\"; --")).open().await.unwrap_err();
    assert!(matches!(e, Error::InvalidConfig { .. }), "{e:?}");
    assert_eq!(tables_like("x\"").await, 0, "no table created");
    db.batch_execute(&format!("SELECT * FROM \"{victim}\"")).await.expect("victim intact");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inconsistent_timings_and_sizes_are_rejected() {
    let t = table("cfg");
    let cases: Vec<(pgfence::Builder, &str)> = vec![
        (
            builder(&t).lease_ttl(Duration::from_secs(10)).renew_interval(Duration::from_secs(10)),
            "renew_interval",
        ),
        (
            builder(&t).lease_ttl(Duration::from_secs(3)).renew_interval(Duration::from_secs(5)),
            "renew_interval",
        ),
        (builder(&t).renew_interval(Duration::ZERO), "renew_interval"),
        (builder(&t).lease_ttl(Duration::ZERO), "lease_ttl"),
        (builder(&t).local_deadline(Duration::from_secs(20)), "local_deadline"),
        (builder(&t).pool_size(0), "pool_size"),
        (builder(&t).page_size(0), "page_size"),
        (builder(&t).max_value_size(pgfence::MAX_BATCH_BYTES + 1), "max_value_size"),
        (builder(&t).write_concurrency(0), "write_concurrency"),
        (builder(&t).write_concurrency(usize::MAX), "write_concurrency"),
        (PgKvStore::builder("postgres://u@h:notaport/db"), "connection string"),
    ];
    for (b, field) in cases {
        let e = b.open().await.unwrap_err();
        match e {
            Error::InvalidConfig { field: f, .. } => assert_eq!(f, field, "{e}"),
            other => panic!("{field}: expected InvalidConfig, got {other:?}"),
        }
    }
    assert_eq!(tables_like(&t).await, 0, "nothing created");
}

/// The default `max_value_size` is 64 MiB: one byte more is refused (`ValueTooLarge`, naming
/// that limit) before any statement runs, by `write` and by a batch's `put` alike, and nothing
/// is written.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn default_max_value_size_is_64_mib() {
    const MIB_64: usize = 64 << 20;
    let store = builder(&table("defaultmax")).open().await.unwrap();
    let e = store.write("v", "s", "k", vec![0; MIB_64 + 1]).await.unwrap_err();
    assert!(matches!(e, Error::ValueTooLarge { len, max: MIB_64 } if len == MIB_64 + 1), "{e:?}");
    let batch = store.batch().put("v", "s", "ok", b"small".to_vec());
    let e = batch.put("v", "s", "k", vec![0; MIB_64 + 1]).commit().await.unwrap_err();
    assert!(matches!(e, Error::ValueTooLarge { max: MIB_64, .. }), "{e:?}");
    assert!(store.list("v", "s").await.unwrap().is_empty(), "nothing written");
    store.close().await.unwrap();
}

/// docs/design.md, "Fail closed":
/// the local deadline defaults to "⅔ of the TTL after the start of the
/// last confirmed renewal". Exact, seen where the effective deadline is checked: a renewal
/// interval must be below it. Without a deadline set, at the default TTL (30 s) a renewal
/// every 19.999 s opens and one every 20 s is refused, naming a deadline of 20,000 ms; at a
/// TTL of 3,001 ms (⅔: 2,000.67 ms) 2,000 ms opens and 2,001 ms is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn default_local_deadline_is_two_thirds_of_the_ttl() {
    let ms = Duration::from_millis;
    let store = |ttl: Option<Duration>, renew: Duration| {
        let b = PgKvStore::builder_from_config(common::server().config())
            .table(table("deadline23"))
            .pool_size(1)
            .renew_interval(renew);
        match ttl {
            Some(ttl) => b.lease_ttl(ttl),
            None => b, // The default TTL, 30 s.
        }
    };
    for (ttl, below, at, deadline) in [
        (None, ms(19_999), ms(20_000), "20000 ms (TTL 30000 ms)"),
        (Some(ms(3001)), ms(2000), ms(2001), "2000 ms (TTL 3001 ms)"),
    ] {
        let opened = store(ttl, below).open().await.expect("a renewal below the deadline opens");
        opened.close().await.unwrap();
        match store(ttl, at).open().await.unwrap_err() {
            Error::InvalidConfig { field: "renew_interval", reason } => {
                assert!(
                    reason.contains(&format!("below the local deadline of {deadline}")),
                    "{reason}"
                )
            }
            other => panic!("{ttl:?}, {at:?}: expected InvalidConfig, got {other:?}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn too_large_value_is_rejected_and_nothing_written() {
    let store = builder(&table("big")).max_value_size(1024).open().await.unwrap();
    let e = store.write("v", "s", "k", vec![0; 1025]).await.unwrap_err();
    assert!(matches!(e, Error::ValueTooLarge { len: 1025, max: 1024 }), "{e:?}");
    store.write("v", "s", "k", vec![0; 1024]).await.unwrap();
    assert!(store.list("v", "s").await.unwrap() == vec!["k".to_owned()]);
    store.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_host_is_a_typed_error() {
    // Port 1 on loopback: nothing listens there, the connection is refused at once.
    let e = PgKvStore::builder("postgres://nobody@127.0.0.1:1/db")
        .connect_timeout(Duration::from_secs(5))
        .open()
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Connect { step: ConnectStep::Connect, .. }), "{e:?}");
    assert!(e.is_retryable(), "a refused connection may work later");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_password_is_a_typed_error_that_never_shows_the_password() {
    let server = common::server();
    server.ensure_password_role().await.unwrap();
    let secret = "wrong-secret-5f2c";
    let url = format!("postgres://{PASSWORD_ROLE}:{secret}@127.0.0.1:{}/postgres", server.port());
    let b = PgKvStore::builder(&url).table(table("pw"));
    assert!(!format!("{b:?}").contains(secret), "Debug of the builder hides the password");
    let e = b.open().await.unwrap_err();
    assert!(matches!(e, Error::Connect { step: ConnectStep::Authentication, .. }), "{e:?}");
    assert!(!e.is_retryable(), "a wrong password will not fix itself");
    let shown = format!(
        "{e} {e:?} {}",
        std::error::Error::source(&e).map(|s| s.to_string()).unwrap_or_default()
    );
    assert!(!shown.contains(secret), "errors never show the password: {shown}");
    // The right password works: the error above really was the password.
    let url = format!(
        "postgres://{PASSWORD_ROLE}:{PASSWORD_ROLE_PASSWORD}@127.0.0.1:{}/postgres",
        server.port()
    );
    admin()
        .await
        .batch_execute(&format!("GRANT CREATE ON SCHEMA public TO {PASSWORD_ROLE}"))
        .await
        .unwrap();
    let store = PgKvStore::builder(&url).table(table("pw")).pool_size(1).open().await.unwrap();
    store.close().await.unwrap();
}

/// A connection whose current role (after `SET ROLE`) cannot see or end its login role's
/// sessions opens and writes: the store needs neither (it fences off its own statements
/// through the lease row). What it creates belongs to the current role.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn role_set_on_a_connection_needs_no_view_of_its_login_sessions() {
    let login = table("login");
    let owner = table("owner");
    admin()
        .await
        .batch_execute(&format!(
            "CREATE ROLE {owner} NOLOGIN; CREATE ROLE {login} LOGIN IN ROLE {owner};
             GRANT CREATE ON SCHEMA public TO {owner};"
        ))
        .await
        .unwrap();
    let mut config = common::server().config();
    config.user(&login).options(format!("-c role={owner}"));
    let t = table("setrole");
    let store = PgKvStore::builder_from_config(config).table(&t).open().await.unwrap();
    store.write("r", "s", "k", b"v".to_vec()).await.unwrap();
    assert_eq!(store.read("r", "s", "k").await.unwrap(), b"v");
    store.close().await.unwrap();
    let sql = "SELECT tableowner::text FROM pg_tables WHERE tablename = $1";
    let row = admin().await.query_one(sql, &[&t]).await.unwrap();
    assert_eq!(row.get::<_, String>(0), owner);
}

/// A role that may not execute `pg_terminate_backend` (a hardened database revokes it from
/// PUBLIC) opens and writes: the store ends no server process. It fences off a write whose
/// connection broke by changing its owner id in the lease row (see the hazards tests of an
/// orphaned statement).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn role_that_may_not_terminate_sessions_opens_and_writes() {
    let (config, superuser) = common::own_database("noterm").await;
    common::revoke_terminate(&superuser).await;
    let t = table("noterm");
    let store = PgKvStore::builder_from_config(config).table(&t).open().await.unwrap();
    store.write("r", "s", "k", b"one".to_vec()).await.unwrap();
    assert_eq!(store.read("r", "s", "k").await.unwrap(), b"one");
    store.close().await.unwrap();
}

/// An application name with a NUL byte cannot be sent to PostgreSQL (neither in the startup
/// message nor as a text value of the lease row): a configuration error, typed as such before
/// any connection, and not a connection error on which a standby would wait forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn application_name_with_a_nul_byte_is_invalid_config() {
    let t = table("nulapp");
    let e = builder(&t).application_name("node\0a").open().await.unwrap_err();
    assert!(matches!(e, Error::InvalidConfig { field: "application_name", .. }), "{e:?}");
    let standby = builder(&t).application_name("node\0a").standby().timeout(Duration::from_secs(5));
    let e = common::within("standby", standby.open()).await.unwrap_err();
    assert!(matches!(e, Error::InvalidConfig { field: "application_name", .. }), "{e:?}");
    assert_eq!(tables_like(&t).await, 0, "nothing created");
}

/// A password with an unescaped `@` in a URL (`postgres://app:hunter2@s3cr3t@host/db`): the
/// parser takes the rest of the password for part of the host. Such a URL is refused at open
/// (`InvalidConfig`, no SQL, no connection), and neither the builder's `Debug` nor the error
/// shows that part of the password. A host given in a `Config` is checked the same way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_password_with_an_unescaped_at_sign_is_refused_and_never_shown() {
    let secret = "s3cr3t";
    let server = common::server();
    let t = table("atpw");
    let url = format!("postgres://app:hunter2@{secret}@127.0.0.1:{}/postgres", server.port());
    let mut config = tokio_postgres::Config::new();
    config.user("app").password("hunter2").host(format!("{secret}@127.0.0.1")).port(server.port());
    for b in [PgKvStore::builder(&url), PgKvStore::builder_from_config(config)] {
        let b = b.table(&t).connect_timeout(Duration::from_secs(1));
        let debug = format!("{b:?}");
        assert!(!debug.contains(secret), "Debug of the builder hides it: {debug}");
        let e = b.open().await.unwrap_err();
        let shown = format!(
            "{e} {e:?} {}",
            std::error::Error::source(&e).map(|s| s.to_string()).unwrap_or_default()
        );
        assert!(matches!(e, Error::InvalidConfig { field: "connection string", .. }), "{shown}");
        assert!(!shown.contains(secret), "errors never show it: {shown}");
        assert!(shown.contains("'@'"), "the error says what is wrong: {shown}");
    }
    assert_eq!(tables_like(&t).await, 0, "nothing created");
}

/// A variable reader over `pairs`, standing in for the process's environment.
fn vars(pairs: &[(&str, String)]) -> impl Fn(&str) -> Option<String> + use<> {
    let pairs: Vec<(String, String)> =
        pairs.iter().map(|(k, v)| ((*k).to_owned(), v.clone())).collect();
    move |name: &str| pairs.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone())
}

/// libpq's precedence: the connection string's parameters win; the environment fills only
/// what the string leaves out; an empty variable counts as unset.
#[test]
fn libpq_environment_fills_only_what_the_connection_string_leaves_out() {
    use pgfence::env::{TlsOptions, resolve};
    use pgfence::tokio_postgres::config::Host;
    let env = vars(&[
        ("PGHOST", "db.example".to_owned()),
        ("PGPORT", "6543".to_owned()),
        ("PGUSER", "envuser".to_owned()),
        ("PGDATABASE", "envdb".to_owned()),
        ("PGPASSWORD", "envsecret".to_owned()),
        ("PGAPPNAME", "".to_owned()),
        ("PGCONNECT_TIMEOUT", "1".to_owned()),
    ]);
    let r = resolve(Some("postgres://urluser@urlhost:7000"), TlsOptions::default(), &env).unwrap();
    assert_eq!(r.config.get_hosts(), [Host::Tcp("urlhost".to_owned())]);
    assert_eq!(r.config.get_ports(), [7000]);
    assert_eq!(r.config.get_user(), Some("urluser"));
    assert_eq!(r.config.get_dbname(), Some("envdb"), "the string names no database");
    assert_eq!(r.config.get_password(), Some(&b"envsecret"[..]));
    assert_eq!(r.config.get_application_name(), None, "an empty variable is unset");
    assert_eq!(r.connect_timeout, Some(Duration::from_secs(2)), "libpq's minimum is 2 s");

    let r = resolve(None, TlsOptions::default(), &env).unwrap();
    assert_eq!(r.config.get_hosts(), [Host::Tcp("db.example".to_owned())]);
    assert_eq!(r.config.get_ports(), [6543]);
    assert_eq!(r.config.get_user(), Some("envuser"));
}

/// Variables that do not parse, and TLS that pgfence cannot verify, are typed configuration
/// errors naming the variable; nothing connects.
#[test]
fn libpq_environment_errors_name_the_variable() {
    use pgfence::env::{TlsOptions, resolve};
    let field = |pairs: &[(&str, String)]| match resolve(None, TlsOptions::default(), &vars(pairs))
    {
        Err(Error::InvalidConfig { field, .. }) => field,
        other => panic!("{pairs:?}: {other:?}"),
    };
    assert_eq!(field(&[("PGPORT", "54x".to_owned())]), "PGPORT");
    assert_eq!(field(&[("PGCONNECT_TIMEOUT", "soon".to_owned())]), "PGCONNECT_TIMEOUT");
    assert_eq!(field(&[("PGSSLMODE", "sometimes".to_owned())]), "PGSSLMODE");
    // `require` is verified TLS in pgfence: without certificate authorities it is refused.
    let home = tempdir("pgfence-env-nohome");
    let require = [("PGSSLMODE", "require".to_owned()), ("HOME", home.display().to_string())];
    assert_eq!(field(&require), "tls");
    match resolve(Some("not a url"), TlsOptions::default(), &vars(&[])) {
        Err(Error::InvalidConfig { field: "connection string", .. }) => {}
        other => panic!("{other:?}"),
    }
}

/// A fresh directory under the system's temporary directory.
fn tempdir(prefix: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("{prefix}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// The password file, libpq's way: the first matching line wins, `*` matches anything, `\:`
/// is a colon; a file others may read is ignored with a warning. The server then accepts the
/// file's password.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn password_file_supplies_the_password_by_libpq_rules() {
    use std::os::unix::fs::PermissionsExt;

    use pgfence::env::{TlsOptions, resolve};
    let server = common::server();
    server.ensure_password_role().await.unwrap();
    let dir = tempdir("pgfence-passfile");
    let file = dir.join("pgpass");
    let port = server.port();
    let escaped = PASSWORD_ROLE_PASSWORD.replace('\\', "\\\\").replace(':', "\\:");
    std::fs::write(
        &file,
        format!(
            "# a comment\nother:*:*:*:nope\n127.0.0.1:{port}:*:{PASSWORD_ROLE}:{escaped}\n\
             *:*:*:*:too-late\n"
        ),
    )
    .unwrap();
    let env = |mode: u32| {
        std::fs::set_permissions(&file, std::fs::Permissions::from_mode(mode)).unwrap();
        vars(&[
            ("PGHOST", "127.0.0.1".to_owned()),
            ("PGPORT", port.to_string()),
            ("PGUSER", PASSWORD_ROLE.to_owned()),
            ("PGDATABASE", "postgres".to_owned()),
            ("PGPASSFILE", file.display().to_string()),
        ])
    };

    let open = resolve(None, TlsOptions::default(), &env(0o644)).unwrap();
    assert_eq!(open.config.get_password(), None, "group or world access: ignored");
    assert!(open.warnings.iter().any(|w| w.contains("group or world access")), "{open:?}");

    let r = resolve(None, TlsOptions::default(), &env(0o600)).unwrap();
    assert!(r.warnings.is_empty(), "{:?}", r.warnings);
    assert_eq!(r.config.get_password(), Some(PASSWORD_ROLE_PASSWORD.as_bytes()));
    // The server accepts it: connect directly (no GRANT on `public`, which would race the
    // other tests' GRANTs: "tuple concurrently updated").
    let (client, connection) = r.config.connect(pgfence::tokio_postgres::NoTls).await.unwrap();
    let connection = tokio::spawn(connection);
    let user: String = client.query_one("SELECT current_user::text", &[]).await.unwrap().get(0);
    assert_eq!(user, PASSWORD_ROLE);
    drop(client);
    connection.await.unwrap().unwrap();
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `Builder::from_env` itself, as an application calls it. libpq's variables, set for a child
/// process only, name the server, the password role and its password. The child (this binary,
/// running the ignored test below) opens a store there and writes. A wrong `PGPASSWORD` fails
/// it with the server's refusal, so the password came from the variable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn builder_from_env_opens_a_store_with_libpq_variables() {
    let server = common::server();
    server.ensure_password_role().await.unwrap();
    let addr = server.tcp_addr().expect("the test server's TCP address");
    let dbname = server.config().get_dbname().unwrap_or("postgres").to_owned();
    // A schema of the password role's own: it may not create tables in `public`.
    let schema = table("fromenv");
    let admin = admin().await;
    admin
        .batch_execute(&format!("CREATE SCHEMA \"{schema}\" AUTHORIZATION {PASSWORD_ROLE}"))
        .await
        .unwrap();
    let home = tempdir("pgfence-from-env-home"); // No ~/.pgpass, no ~/.postgresql.
    let child = |password: &str| {
        let mut command = std::process::Command::new(std::env::current_exe().unwrap());
        for name in ["PGPASSFILE", "PGSSLMODE", "PGSSLROOTCERT", "PGSSLCERT", "PGSSLKEY"] {
            command.env_remove(name);
        }
        command
            .args(["--exact", &common::test_path(module_path!(), "builder_from_env_child")])
            .args(["--include-ignored", "--nocapture"])
            .env_remove("DATABASE_URL")
            .env("HOME", &home)
            .env("PGHOST", addr.ip().to_string())
            .env("PGPORT", addr.port().to_string())
            .env("PGUSER", PASSWORD_ROLE)
            .env("PGDATABASE", &dbname)
            .env("PGPASSWORD", password)
            .env("PGCONNECT_TIMEOUT", "10")
            .env("PGFENCE_FROM_ENV_TABLE", format!("{schema}.kv"))
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap()
    };
    let refused = child("wrong-password");
    let stderr = String::from_utf8_lossy(&refused.stderr);
    let stdout = String::from_utf8_lossy(&refused.stdout);
    assert!(!refused.status.success(), "a wrong PGPASSWORD: {stdout}\n{stderr}");
    assert!(
        stdout.contains("password authentication failed")
            || stderr.contains("password authentication failed"),
        "the server refused the variable's password: {stdout}\n{stderr}"
    );

    let opened = child(PASSWORD_ROLE_PASSWORD);
    assert!(
        opened.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&opened.stdout),
        String::from_utf8_lossy(&opened.stderr)
    );
    let row = admin
        .query_one(&format!("SELECT value FROM \"{schema}\".kv WHERE key = 'k'"), &[])
        .await
        .unwrap();
    assert_eq!(row.get::<_, Vec<u8>>(0), b"from the environment");
    admin.batch_execute(&format!("DROP SCHEMA \"{schema}\" CASCADE")).await.unwrap();
    std::fs::remove_dir_all(&home).unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "run in a child process by builder_from_env_opens_a_store_with_libpq_variables"]
async fn builder_from_env_child() {
    let kv = std::env::var("PGFENCE_FROM_ENV_TABLE").expect("only as a child process");
    let builder = pgfence::Builder::from_env(None).expect("libpq's variables");
    let store = builder.table(kv).open().await.expect("open with libpq's variables");
    store.write("env", "s", "k", b"from the environment".to_vec()).await.unwrap();
    store.close().await.unwrap();
}

/// `main` returning `Result<(), pgfence::Error>` prints the error's `Debug` form: the message and
/// its causes, one a line, with the server's SQLSTATE, not nested structs. `{:#?}` still shows
/// the variant and its fields.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn debug_of_an_error_reads_like_its_message() {
    let mut config = tokio_postgres::Config::new();
    config.host("127.0.0.1").port(1).user("app").dbname("app");
    let b = PgKvStore::builder_from_config(config).connect_timeout(Duration::from_secs(2));
    let e = b.open().await.unwrap_err();
    let debug = format!("{e:?}");
    assert!(debug.starts_with(&e.to_string()), "{debug}");
    assert!(
        debug.contains("\n\nCaused by:\n    0: ") && debug.contains("onnection refused"),
        "{debug}"
    );
    assert!(!debug.contains("Connect {") && !debug.contains("kind:"), "{debug}");
    let structure = format!("{e:#?}");
    assert!(structure.starts_with("Connect {") && structure.contains("operation:"), "{structure}");

    // A server's error shows its SQLSTATE; a cause already in the message is not repeated.
    let (t, role, schema) = (table("dbg"), table("dbg_role"), table("dbg_s"));
    let created = format!("CREATE ROLE {role} LOGIN; CREATE SCHEMA {schema}");
    admin().await.batch_execute(&created).await.unwrap();
    let mut config = common::server().config();
    config.user(&role);
    let e = PgKvStore::builder_from_config(config)
        .table(format!("{schema}.{t}"))
        .open()
        .await
        .unwrap_err();
    let debug = format!("{e:?}");
    assert!(debug.contains("(SQLSTATE 42501)"), "{debug}");
    assert_eq!(debug.matches("permission denied for schema").count(), 1, "{debug}");
}
