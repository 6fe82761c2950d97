//! Errors that say what to do (issue 18). A failed connection names the server and the step
//! that failed, never the password nor the pool's internals. A missing privilege names the
//! `GRANT` that gives it.

use std::time::Duration;

use pgfence::{ConnectStep, Error, PgKvStore};
use pgfence_testing::{PASSWORD_ROLE, PASSWORD_ROLE_PASSWORD, unique_name};
use tokio_postgres::config::Host;

use crate::common::{server, table};

/// The error and all its sources, as one line.
fn chain(e: &Error) -> String {
    let mut line = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(cause) = source {
        line.push_str(": ");
        line.push_str(&cause.to_string());
        source = cause.source();
    }
    line
}

/// A TCP port on 127.0.0.1 that nothing listens on: bound, then freed.
fn closed_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
    listener.local_addr().expect("its address").port()
}

/// `host:port` of the first host of `config`, as the error names it.
fn server_of(config: &tokio_postgres::Config) -> String {
    let port = config.get_ports().first().copied().unwrap_or(5432);
    match &config.get_hosts()[0] {
        Host::Tcp(name) => format!("{name}:{port}"),
        Host::Unix(dir) => format!("{}/.s.PGSQL.{port}", dir.display()),
    }
}

fn assert_connect_step(e: &Error, step: ConnectStep, server: &str) {
    let text = chain(e);
    match e {
        Error::Connect { step: found, server: named, .. } => {
            assert_eq!((*found, named.as_str()), (step, server), "{text}");
        }
        other => panic!("expected Error::Connect at {step}, got {other:?}"),
    }
    assert!(text.contains(server) && text.contains(&format!("step {step}")), "{text}");
    assert!(!text.contains("pool") && !text.contains("creating a new object"), "{text}");
}

/// A wrong port: the message names `host:port` and the connect step, with no pool internals.
/// Both for `open()` and for the inspector's read of `pgfence status`.
#[tokio::test]
async fn a_wrong_port_names_the_server_and_the_connect_step() {
    let port = closed_port();
    let url = format!("postgres://postgres@127.0.0.1:{port}/postgres");
    let builder = || {
        PgKvStore::builder(&url).table(table("err_port")).connect_timeout(Duration::from_secs(5))
    };
    let read = builder().inspect().await.expect("no connection yet").lease_info().await;
    let open = builder().open().await;
    for e in [read.expect_err("nothing listens"), open.expect_err("nothing listens")] {
        assert_connect_step(&e, ConnectStep::Connect, &format!("127.0.0.1:{port}"));
        assert!(chain(&e).contains("onnection refused"), "{}", chain(&e));
        assert!(e.is_retryable() && e.is_connect(), "{e:?}");
    }
}

/// A Unix socket host names the socket's path.
#[tokio::test]
async fn a_missing_unix_socket_names_its_path() {
    let dir = format!("/nonexistent-{}", unique_name("sock"));
    let mut config = tokio_postgres::Config::new();
    config.host_path(&dir).port(5999).user("postgres").dbname("postgres");
    let e = PgKvStore::builder_from_config(config)
        .table(table("err_sock"))
        .open()
        .await
        .expect_err("no such socket");
    assert_connect_step(&e, ConnectStep::Connect, &format!("{dir}/.s.PGSQL.5999"));
}

/// A wrong password: the authentication step, the server, and never the password. Not
/// retryable: waiting mends nothing.
#[tokio::test]
async fn a_wrong_password_names_the_authentication_step() {
    server().ensure_password_role().await.expect("the password role");
    let secret = "wrong-secret-5c1e";
    let config = server().password_role_config(secret);
    let e = PgKvStore::builder_from_config(config.clone())
        .table(table("err_auth"))
        .open()
        .await
        .expect_err("a wrong password");
    assert_connect_step(&e, ConnectStep::Authentication, &server_of(&config));
    let text = chain(&e);
    assert!(text.contains("authentication") && !text.contains(secret), "{text}");
    assert!(!e.is_retryable(), "{e:?}");
}

/// A role without CREATE on the schema (as on `public` since PostgreSQL 15) gets
/// `PermissionDenied`: the privilege, and the `GRANT` with the role's name. Once that is run,
/// the same open succeeds.
#[tokio::test]
async fn a_missing_privilege_names_the_grant() {
    server().ensure_password_role().await.expect("the password role");
    let schema = unique_name("err_grant");
    let admin = server().connect().await.expect("admin connection");
    admin.batch_execute(&format!("CREATE SCHEMA {schema}")).await.expect("create schema");
    let open = || {
        PgKvStore::builder_from_config(server().password_role_config(PASSWORD_ROLE_PASSWORD))
            .table(format!("{schema}.kv"))
            .open()
    };
    let e = open().await.expect_err("no CREATE on the schema");
    let grant = format!("GRANT USAGE, CREATE ON SCHEMA {schema} TO {PASSWORD_ROLE}");
    match &e {
        Error::PermissionDenied { privilege, grant: named, .. } => {
            let needed = format!("USAGE on schema {schema}, and CREATE on it while the tables");
            assert!(privilege.starts_with(&needed), "{privilege}");
            assert_eq!(&**named, grant);
        }
        other => panic!("expected PermissionDenied, got {other:?}"),
    }
    assert!(e.to_string().contains(&grant) && e.is_permission_denied(), "{e}");
    assert_eq!(std::io::Error::from(e).kind(), std::io::ErrorKind::PermissionDenied);

    admin.batch_execute(&grant).await.expect("the GRANT the error names");
    let store = open().await.expect("open once granted");
    store.close().await.expect("close");
}
