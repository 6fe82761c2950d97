//! The pgfence demo: two stores contend for one table's lease, and a stale handle is fenced.
//!
//! `cargo run --example demo`. Uses `DATABASE_URL` when set; otherwise starts a temporary
//! PostgreSQL cluster from the binaries on this machine and stops it on exit.

use std::time::Duration;

use pgfence::{Error, PgKvStore};
use pgfence_testing::{TestServer, unique_name};

type BoxError = Box<dyn std::error::Error>;

const USAGE: &str =
    "usage: demo (no arguments; DATABASE_URL when set, else a temporary PostgreSQL)";

#[tokio::main]
async fn main() -> Result<(), BoxError> {
    match std::env::args().nth(1).as_deref() {
        None => {}
        Some("-h" | "--help") => {
            println!("{USAGE}");
            return Ok(());
        }
        Some(other) => {
            eprintln!("unknown argument {other:?}\n{USAGE}");
            std::process::exit(2);
        }
    }
    let server = TestServer::shared()?;
    if server.is_private() {
        println!("Started a temporary PostgreSQL on port {} (stopped on exit).", server.port());
    } else {
        println!("Using DATABASE_URL.");
    }
    let table = unique_name("demo");
    let demo = demo(server, &table).await;
    // Dropped however the demo ended: on the server of DATABASE_URL they would stay for good.
    let dropped = match server.connect().await {
        Ok(admin) => admin.batch_execute(&drop_tables(&table)).await.map_err(BoxError::from),
        Err(e) => Err(e.into()),
    };
    demo.and(dropped)
}

/// Drops the demo's four tables (the store's KV, lease, schema version and crash marker
/// tables).
fn drop_tables(table: &str) -> String {
    format!(
        "DROP TABLE IF EXISTS \"{table}\", \"{table}_lease\", \"{table}_schema_version\", \
         \"{table}_crash_marker\""
    )
}

async fn demo(server: &TestServer, table: &str) -> Result<(), BoxError> {
    let open = |name: &'static str| {
        PgKvStore::builder_from_config(server.config())
            .table(table)
            .application_name(name)
            .lease_ttl(Duration::from_secs(30))
            .renew_interval(Duration::from_secs(10))
            .pool_size(2)
            .open()
    };

    println!("\n1. Store A opens table {table:?}: schema created, lease acquired.");
    let a = open("store-a").await?;
    println!("   A holds the lease with epoch {} (the fencing token).", a.fencing_token());
    a.write("channels", "chan-1", "state", b"balance=100".to_vec()).await?;
    println!("   A wrote channels/chan-1/state = \"balance=100\".");

    println!("\n2. Store B tries to open the same table while A is alive:");
    match open("store-b").await {
        Err(Error::LeaseHeld { holder, epoch, expires_in, .. }) => println!(
            "   refused: LeaseHeld by {holder:?} (epoch {epoch}, {:.1} s left).",
            expires_in.as_secs_f64()
        ),
        Ok(_) => return Err("B must not get the lease while A holds it".into()),
        Err(e) => return Err(e.into()),
    }

    println!("\n3. A is dropped: it releases the lease by its owner id.");
    drop(a);
    let started = std::time::Instant::now();
    let b = open("store-b").await?;
    println!(
        "   B opens at once ({} ms, no TTL wait) and holds epoch {}.",
        started.elapsed().as_millis(),
        b.fencing_token()
    );
    let value = b.read("channels", "chan-1", "state").await?;
    println!("   B reads chan-1/state = {:?}.", String::from_utf8(value)?);

    println!(
        "\n4. B's process freezes for longer than its TTL (simulated: its lease expires in the"
    );
    println!("   database), and store C takes over while B's handle is still alive.");
    let admin = server.connect().await?;
    admin
        .execute(
            &format!("UPDATE \"{table}_lease\" SET expires_at = clock_timestamp() WHERE id = 1"),
            &[],
        )
        .await?;
    let c = open("store-c").await?;
    println!("   C holds epoch {} and writes.", c.fencing_token());
    c.write("channels", "chan-1", "state", b"balance=90 (C)".to_vec()).await?;

    println!("\n5. B, the stale handle from before, wakes up and writes:");
    match b.write("channels", "chan-1", "state", b"balance=0 (stale B)".to_vec()).await {
        Err(e @ Error::LeaseLost { .. }) => println!("   fenced by PostgreSQL: {e}"),
        other => return Err(format!("the stale write must be fenced, got {other:?}").into()),
    }
    match b.remove("channels", "chan-1", "state", false).await {
        Err(e) if e.is_lease_lost() => println!("   its remove too: {e}"),
        other => return Err(format!("the stale remove must be fenced, got {other:?}").into()),
    }
    match b.read("channels", "chan-1", "state").await {
        Err(e) if e.is_lease_lost() => {
            println!("   and from now on every call fails closed, reads included.")
        }
        other => return Err(format!("a lost store must fail closed, got {other:?}").into()),
    }
    println!("   B's lease_state: {:?}", *b.lease_state().borrow());
    drop(b);
    let value = c.read("channels", "chan-1", "state").await?;
    println!("   Nothing B tried was written: chan-1/state = {:?}.", String::from_utf8(value)?);
    let info = c.lease_info().await?.ok_or("lease row")?;
    println!(
        "   Dropping B left C's lease alone: held by {:?}, epoch {}.",
        info.holder, info.epoch
    );

    c.close().await?;
    println!("\n6. C closed and released the lease. Done.");
    Ok(())
}
