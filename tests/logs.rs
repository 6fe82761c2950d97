//! What the library logs: never a password, and under the documented targets. In a test
//! binary of its own, because the log subscriber it installs is global to the process.

mod common;

use std::io::Write;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use common::table;
use pgfence::{LossReason, PgKvStore};
use pgfence_testing::{PASSWORD_ROLE, PASSWORD_ROLE_PASSWORD};

/// Everything logged, from every thread (the renewal thread included).
#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(bytes);
        Ok(bytes.len())
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Everything logged since the first call, at every level, with each event's target. Installs
/// the process's subscriber once: the tests of this binary share it.
fn captured() -> &'static Captured {
    static CAPTURED: OnceLock<Captured> = OnceLock::new();
    CAPTURED.get_or_init(|| {
        let captured = Captured::default();
        let writer = captured.clone();
        tracing_subscriber::fmt()
            .with_max_level(tracing::Level::TRACE)
            .with_target(true)
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .try_init()
            .expect("the only log subscriber of this test binary");
        captured
    })
}

/// A store opened with a password in its connection string, used, closed, and opened again
/// with a wrong password, with every log event of every level (the driver's included) captured:
/// neither password appears.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn passwords_never_appear_in_logs() {
    let captured = captured();
    let server = common::server();
    server.ensure_password_role().await.unwrap();
    common::admin()
        .await
        .batch_execute(&format!("GRANT CREATE ON SCHEMA public TO {PASSWORD_ROLE}"))
        .await
        .unwrap();
    // From here on: the setup above logs its own `CREATE ROLE ... PASSWORD` (the driver logs
    // every statement it runs at debug level); only what the store logs counts. The other
    // test, which may run meanwhile, logs no password.
    let start = captured.0.lock().unwrap().len();
    let url = |password: &str| {
        format!("postgres://{PASSWORD_ROLE}:{password}@127.0.0.1:{}/postgres", server.port())
    };
    let t = table("logs");
    let store = PgKvStore::builder(&url(PASSWORD_ROLE_PASSWORD)).table(&t).open().await.unwrap();
    store.write("l", "s", "k", b"v".to_vec()).await.unwrap();
    store.read("l", "s", "k").await.unwrap();
    let held = PgKvStore::builder(&url(PASSWORD_ROLE_PASSWORD)).table(&t).open().await;
    assert!(held.unwrap_err().is_lease_held());
    store.close().await.unwrap();
    let wrong = "wrong-secret-7d41";
    assert!(PgKvStore::builder(&url(wrong)).table(&t).open().await.is_err());

    let logs = String::from_utf8(captured.0.lock().unwrap()[start..].to_vec()).unwrap();
    assert!(logs.contains("pgfence"), "the library's events were captured:\n{logs}");
    assert!(!logs.contains(PASSWORD_ROLE_PASSWORD), "the password was logged:\n{logs}");
    assert!(!logs.contains(wrong), "the wrong password was logged:\n{logs}");
}

/// The events the CLI recognises carry the targets docs/design.md ("Logging") documents,
/// whatever module logs them: a standby's retry under `pgfence::standby`, an operator's force
/// release under `pgfence::inspect`, the loss it causes under `pgfence::lease`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn events_carry_their_documented_targets() {
    let captured = captured();
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let nowhere = format!("postgres://postgres@127.0.0.1:{closed}/postgres");
    let standby = PgKvStore::builder(&nowhere).table(table("logs_targets")).standby();
    let waited = standby.timeout(Duration::from_millis(1500)).open().await;
    assert!(matches!(waited, Err(pgfence::Error::Timeout { .. })), "{:?}", waited.err());

    let t = table("logs_targets");
    let store = common::builder(&t).open().await.unwrap();
    common::builder(&t).inspect().await.unwrap().force_release().await.unwrap();
    let lost = store.write("l", "s", "k", b"v".to_vec()).await.unwrap_err();
    assert!(matches!(lost, pgfence::Error::LeaseLost { reason: LossReason::Fenced, .. }), "{lost}");

    let logs = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
    let line = |target: &str, message: &str| {
        logs.lines().any(|l| l.contains(&format!(" {target}: ")) && l.contains(message))
    };
    assert!(line("pgfence::standby", "pgfence standby retrying"), "{logs}");
    assert!(line("pgfence::inspect", "force"), "{logs}");
    assert!(line("pgfence::lease", "pgfence lease lost"), "{logs}");
}
