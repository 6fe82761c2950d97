//! What the library logs: never a password. In a test binary of its own, because the log
//! subscriber it installs is global to the process.

mod common;

use std::io::Write;
use std::sync::{Arc, Mutex};

use common::table;
use pgfence::PgKvStore;
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

/// A store opened with a password in its connection string, used, closed, and opened again
/// with a wrong password, with every log event of every level (the driver's included) captured:
/// neither password appears.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn passwords_never_appear_in_logs() {
    let captured = Captured::default();
    let writer = captured.clone();
    tracing_subscriber::fmt()
        .with_max_level(tracing::Level::TRACE)
        .with_writer(move || writer.clone())
        .try_init()
        .expect("the only log subscriber of this test binary");

    let server = common::server();
    server.ensure_password_role().await.unwrap();
    common::admin()
        .await
        .batch_execute(&format!("GRANT CREATE ON SCHEMA public TO {PASSWORD_ROLE}"))
        .await
        .unwrap();
    // From here on: the setup above logs its own `CREATE ROLE ... PASSWORD` (the driver logs
    // every statement it runs at debug level); only what the store logs counts.
    captured.0.lock().unwrap().clear();
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

    let logs = String::from_utf8(captured.0.lock().unwrap().clone()).unwrap();
    assert!(logs.contains("pgfence"), "the library's events were captured:\n{logs}");
    assert!(!logs.contains(PASSWORD_ROLE_PASSWORD), "the password was logged:\n{logs}");
    assert!(!logs.contains(wrong), "the wrong password was logged:\n{logs}");
}
