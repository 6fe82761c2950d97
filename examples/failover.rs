//! Failover: run this program twice against one table. The first becomes active; the second
//! stands by and takes over when the first stops. On Ctrl-C or SIGTERM (what systemd, Docker and
//! Kubernetes send) it releases the lease: the standby takes over in about 0.1 s. After a
//! crash it takes over once the lease expires, one TTL later.
//!
//! `DATABASE_URL=postgres://app@db.example/appdb cargo run --example failover [TABLE]`
//!
//! docs/design.md, section "Failover", shows this program; tests/cli.rs checks that the two
//! agree and runs it.

use std::time::Duration;

use pgfence::{LeaseState, PgKvStore, StandbyState};
use tokio::signal::unix::{SignalKind, signal};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let url = std::env::var("DATABASE_URL")?;
    let table = std::env::args().nth(1).unwrap_or_else(|| "node_state".to_owned());

    // First: from here on Ctrl-C and SIGTERM mean "release the lease and exit", whether this
    // process stands by or is active. Without a handler, SIGTERM ends the process before
    // close(), and the standby waits out the whole TTL.
    let mut terminate = signal(SignalKind::terminate())?;
    let shutdown = async move {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = terminate.recv() => {}
        }
    };
    tokio::pin!(shutdown);

    let standby = PgKvStore::builder(&url)
        .table(table)
        .lease_ttl(Duration::from_secs(30))
        .renew_interval(Duration::from_secs(10))
        .standby(); // .timeout(..) to give up after a while
    let mut progress = standby.progress(); // Starting / Waiting { holder, .. } / Acquired
    tokio::spawn(async move {
        while progress.changed().await.is_ok() {
            if let StandbyState::Waiting { holder, epoch, expires_in } = &*progress.borrow() {
                println!("standing by: {holder} holds epoch {epoch}, {expires_in:?} left");
            }
        }
    });
    // Returns once this process holds the lease; `None` if the shutdown came first.
    let Some(store) = standby.open_until(&mut shutdown).await? else {
        return Ok(());
    };
    println!("active: this process holds the lease, epoch {}", store.fencing_token());

    // Rebuild in-memory state from the store, then serve, until shutdown or loss.
    let mut lease = store.lease_state();
    tokio::select! {
        _ = lease.wait_for(|s| matches!(s, LeaseState::Lost { .. })) => {
            // Lost: stop serving now. Do not retry; exit, or start over as a standby.
            eprintln!("lease lost: stopped serving");
        }
        _ = &mut shutdown => println!("shutting down: releasing the lease"),
    }
    Ok(store.close().await?) // graceful: a standby takes over at once
}
