//! TLS (`Builder::tls`): every connection the store opens is encrypted and the server verified,
//! on a private cluster that rejects plain TCP connections; contradictory options are refused
//! before any connection.

use crate::common;

use std::time::Duration;

use common::{HANG_GUARD, table, table_exists, within};
use pgfence::{
    ConnectStep, Error, LeaseState, PgKvStore, StandbyState, tls_client_config,
    tls_client_config_with_cert,
};
use pgfence_testing::{CERT_ROLE, Proxy, TestCluster, unique_name};

fn tls_cluster() -> TestCluster {
    TestCluster::start_tls().expect("a private cluster with TLS")
}

/// `(application_name, ssl)` of every session whose application name starts with `prefix`.
async fn sessions(admin: &tokio_postgres::Client, prefix: &str) -> Vec<(String, bool)> {
    let sql = "SELECT a.application_name, s.ssl
                 FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid)
                WHERE starts_with(a.application_name, $1)
                ORDER BY 1";
    common::pairs(admin, sql, &[&prefix]).await
}

/// Every kind of connection a store opens goes over verified TLS: the pool's (which here also
/// creates the missing database, on a connection of its own), the lease renewal's, and a
/// standby's LISTEN connection. The cluster rejects plain TCP, so none of them could have been
/// plain (a plain renewal or LISTEN connection would fail, and its session never appear);
/// `pg_stat_ssl` shows each one encrypted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_connection_of_a_store_goes_over_tls() {
    let cluster = tls_cluster();
    let tls = cluster.tls_client_config().expect("a TLS cluster");
    let admin = cluster.connect().await.expect("an admin connection over TLS");
    let (db, t) = (unique_name("tls_db"), table("tls"));
    let mut config = cluster.config();
    config.dbname(&db);
    let builder = |app: &str| {
        PgKvStore::builder_from_config(config.clone())
            .tls(tls.clone())
            .table(&t)
            .pool_size(1)
            .lease_ttl(Duration::from_secs(6))
            .application_name(app)
    };

    let active = builder("tls-active").open().await.expect("open over TLS");
    active.write("ns", "sub", "k", b"v".to_vec()).await.unwrap();
    assert_eq!(active.read("ns", "sub", "k").await.unwrap(), b"v");

    let standby = builder("tls-standby").standby();
    let mut progress = standby.progress();
    let waiting = tokio::spawn(standby.open());
    within("standby waiting", progress.wait_for(|s| matches!(s, StandbyState::Waiting { .. })))
        .await
        .unwrap();
    // The pool's one connection and the renewal's (opened at the first renewal, two seconds
    // in), and the standby's LISTEN connection.
    let listening = "SELECT count(*) FROM pg_stat_activity
                      WHERE application_name = 'pgfence tls-standby' AND query LIKE 'LISTEN%'";
    let deadline = tokio::time::Instant::now() + HANG_GUARD;
    let seen = loop {
        let seen = sessions(&admin, "pgfence tls-").await;
        let active_sessions = seen.iter().filter(|(app, _)| app == "pgfence tls-active").count();
        let listeners: i64 = admin.query_one(listening, &[]).await.unwrap().get(0);
        if active_sessions >= 2 && listeners == 1 {
            break seen;
        }
        assert!(tokio::time::Instant::now() < deadline, "sessions never all appeared: {seen:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(seen.iter().all(|(_, ssl)| *ssl), "every session encrypted: {seen:?}");

    active.close().await.unwrap();
    let successor = within("standby acquires", waiting).await.unwrap().unwrap();
    assert_eq!(successor.fencing_token(), 2);
    assert_eq!(successor.read("ns", "sub", "k").await.unwrap(), b"v");
    successor.close().await.unwrap();
}

/// The server must prove itself: a certificate from an authority the configuration does not
/// trust fails `open()` with a connection error, before any SQL, and not a retryable one: a
/// standby gives up at once instead of waiting forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn server_certificate_from_an_untrusted_authority_is_refused() {
    let cluster = tls_cluster();
    let untrusting = tls_client_config(pgfence::rustls::RootCertStore::empty());
    let t = table("tls_untrusted");
    let e = PgKvStore::builder_from_config(cluster.config())
        .tls(untrusting.clone())
        .table(&t)
        .connect_timeout(Duration::from_secs(10))
        .open()
        .await
        .unwrap_err();
    assert!(matches!(e, Error::Connect { step: ConnectStep::Tls, .. }), "{e:?}");
    let chain = format!("{:?}", std::error::Error::source(&e));
    assert!(chain.contains("UnknownIssuer"), "a certificate error: {chain}");
    assert!(!e.is_retryable(), "no retry mends a certificate");
    // So a standby (whose wait has no time limit by default) gives up at once, too.
    let standby =
        PgKvStore::builder_from_config(cluster.config()).tls(untrusting).table(&t).standby();
    let e = within("the standby gives up", standby.open()).await.unwrap_err();
    assert!(matches!(e, Error::Connect { step: ConnectStep::Tls, .. }), "{e:?}");
    assert!(!e.is_retryable(), "{e:?}");
    let admin = cluster.connect().await.unwrap();
    assert!(!table_exists(&admin, &t).await, "nothing was created");
}

/// Options that contradict each other are refused by `open()` before it connects: asking
/// for `sslmode=require` without a TLS configuration (the store would otherwise have to
/// connect in plain text, or fail later), `sslmode=disable` with one, TLS for a store on a
/// pool, whose own connector decides, and TLS to a Unix socket, where PostgreSQL offers none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn contradictory_tls_options_are_refused_before_connecting() {
    let tls = tls_client_config(pgfence::rustls::RootCertStore::empty());
    // Port 1: nothing listens, so any attempt to connect would be a different error.
    let require = PgKvStore::builder("postgres://nobody@127.0.0.1:1/db?sslmode=require");
    let disable = PgKvStore::builder("postgres://nobody@127.0.0.1:1/db?sslmode=disable");
    let pool = pgfence::deadpool_postgres::Pool::builder(pgfence::deadpool_postgres::Manager::new(
        "postgres://nobody@127.0.0.1:1/db".parse().unwrap(),
        pgfence::tokio_postgres::NoTls,
    ))
    .max_size(1)
    .build()
    .unwrap();
    let unix_socket = PgKvStore::builder("host=/tmp user=nobody dbname=db");
    for builder in [
        require,
        disable.tls(tls.clone()),
        PgKvStore::builder_from_pool(pool).tls(tls.clone()),
        unix_socket.tls(tls.clone()),
    ] {
        match builder.open().await {
            Err(Error::InvalidConfig { field: "tls", .. }) => {}
            other => panic!("expected InvalidConfig for tls, got {:?}", other.map(|_| "a store")),
        }
    }
}

/// A server that asks for a client certificate (`pg_hba.conf` method `cert`) lets a store in
/// with `tls_client_config_with_cert`: every connection presents it (the one creating the
/// missing database, the pool's, the renewal's), and `pg_stat_ssl` shows it on each session.
/// Without it, `open()` fails, not retryably, and creates nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_certificate_logs_in_where_the_server_asks_for_one() {
    let cluster = tls_cluster();
    let admin = cluster.connect().await.expect("an admin connection over TLS");
    let (db, t) = (unique_name("tls_cert_db"), table("tls_cert"));
    let mut config = cluster.cert_role_config();
    config.dbname(&db);
    let builder = || {
        PgKvStore::builder_from_config(config.clone())
            .table(&t)
            .pool_size(1)
            .lease_ttl(Duration::from_secs(6))
            .application_name("tls-cert")
    };

    let e = builder().tls(cluster.tls_client_config().unwrap()).open().await.unwrap_err();
    let chain = format!("{:?}", std::error::Error::source(&e));
    assert!(chain.contains("28000"), "refused for want of a certificate: {e:?}");
    assert!(!e.is_retryable(), "no retry brings a certificate: {e:?}");
    let databases = "SELECT count(*) FROM pg_database WHERE datname = $1";
    let found: i64 = admin.query_one(databases, &[&db]).await.unwrap().get(0);
    assert_eq!(found, 0, "nothing was created");

    let store = builder()
        .tls(cluster.tls_client_config_with_cert().unwrap())
        .open()
        .await
        .expect("open with a client certificate");
    store.write("ns", "sub", "k", b"v".to_vec()).await.unwrap();
    assert_eq!(store.read("ns", "sub", "k").await.unwrap(), b"v");
    // The pool's one connection and the renewal's (opened at the first renewal, two seconds
    // in).
    let sql = "SELECT a.usename::text, s.client_dn
                 FROM pg_stat_activity a JOIN pg_stat_ssl s USING (pid)
                WHERE a.application_name = 'pgfence tls-cert'";
    let deadline = tokio::time::Instant::now() + HANG_GUARD;
    let seen = loop {
        let seen: Vec<(String, Option<String>)> = common::pairs(&admin, sql, &[]).await;
        if seen.len() >= 2 {
            break seen;
        }
        assert!(tokio::time::Instant::now() < deadline, "sessions never all appeared: {seen:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    let expected = (CERT_ROLE.to_owned(), Some(format!("/CN={CERT_ROLE}")));
    assert!(seen.iter().all(|session| *session == expected), "{seen:?}");
    store.close().await.unwrap();
}

/// `tls_client_config_with_cert` refuses what rustls cannot use, as a configuration error: no
/// certificate, or a key that is not one.
#[test]
fn an_unusable_client_certificate_or_key_is_a_configuration_error() {
    use pgfence::rustls::RootCertStore;
    use pgfence::rustls::pki_types::{PrivateKeyDer, PrivatePkcs8KeyDer};
    let cluster_free_cert = pgfence::rustls::pki_types::CertificateDer::from(vec![0x30, 0x00]);
    let garbage = || PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(vec![1, 2, 3]));
    for (chain, what) in [(vec![], "empty chain"), (vec![cluster_free_cert], "garbage key")] {
        match tls_client_config_with_cert(RootCertStore::empty(), chain, garbage()) {
            Err(Error::InvalidConfig { field: "tls", reason }) => println!("{what}: {reason}"),
            other => panic!("{what}: expected InvalidConfig for tls, got {:?}", other.err()),
        }
    }
}

/// A TLS failure in the middle of a session after a write's statement was sent (here the
/// server's reply is corrupted on its way, so the client cannot decrypt it): unlike a
/// certificate refused at connect time, the driver reports it to the statement as a closed
/// connection, so the store handles it like any broken connection: it ends the old session
/// (where the write had in fact committed) and retries under the key's turn. The write is
/// applied, `Ok`, and the store keeps its lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tls_failure_after_a_write_was_sent_is_a_broken_connection() {
    let cluster = tls_cluster();
    let proxy = Proxy::start(cluster.tcp_addr()).await.unwrap();
    let t = table("tls_corrupt");
    let store = PgKvStore::builder_from_config(cluster.config_via(proxy.addr()))
        .tls(cluster.tls_client_config().unwrap())
        .table(&t)
        .pool_size(2)
        .lease_ttl(Duration::from_secs(60))
        .open()
        .await
        .unwrap();
    store.write("ns", "sub", "k", b"old".to_vec()).await.unwrap();
    let mut blocker = cluster.connect().await.unwrap();
    let tx = common::lock_key_row(&mut blocker, &t, "k").await;
    let write = tokio::spawn(store.write("ns", "sub", "k", b"new".to_vec()));

    // The write's session waits for the row lock; its client port is the proxy's side.
    let admin = cluster.connect().await.unwrap();
    let waiting = "SELECT client_port, pid FROM pg_stat_activity
                    WHERE wait_event_type = 'Lock' AND query LIKE $1";
    let pattern = format!("%INSERT INTO \"{t}\"%");
    let (port, pid): (i32, i32) = within("the write waits", async {
        loop {
            if let Some(row) = admin.query_opt(waiting, &[&pattern]).await.unwrap() {
                break (row.get(0), row.get(1));
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await;
    proxy.corrupt_next_reply(u16::try_from(port).unwrap());
    tx.commit().await.unwrap();

    within("the write", write).await.unwrap().expect("retried on a fresh connection");
    let sql = format!("SELECT value FROM \"{t}\" WHERE key = 'k'");
    let value: Vec<u8> = admin.query_one(&sql, &[]).await.unwrap().get(0);
    assert_eq!(value, b"new");
    assert_eq!(*store.lease_state().borrow(), LeaseState::Held { epoch: 1 });
    let sessions = "SELECT count(*) FROM pg_stat_activity WHERE pid = $1";
    let old_session: i64 = admin.query_one(sessions, &[&pid]).await.unwrap().get(0);
    assert_eq!(old_session, 0, "the old session was ended");
    store.write("ns", "sub", "k", b"after".to_vec()).await.unwrap();
    store.close().await.unwrap();
}
