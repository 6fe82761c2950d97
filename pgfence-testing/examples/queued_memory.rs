//! Memory of many concurrent writes queued behind a slow server (issue 21, item 3).
//!
//! Spawns `PGFENCE_WRITES` (default 100,000) writes of `PGFENCE_VALUE` bytes (default 1,024)
//! at once, each a distinct key, on a store behind a proxy that delays every message by
//! 5 ms each way. It prints the peak resident memory (VmHWM) above the baseline, the values'
//! own bytes, the overhead per write, and the size of one write's future (held by its task
//! here, on top of the store's own task per write). `PGFENCE_MAX_QUEUED` sets
//! `Builder::max_queued_bytes`. Run: `cargo run --release -p pgfence-testing --example
//! queued_memory`.

use std::time::{Duration, Instant};

use pgfence::PgKvStore;
use pgfence_testing::{Proxy, TestServer, unique_name};

fn env(name: &str, default: usize) -> usize {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

/// The peak resident set of this process, in bytes.
fn peak_rss() -> usize {
    let status = std::fs::read_to_string("/proc/self/status").expect("/proc/self/status");
    let line = status.lines().find(|l| l.starts_with("VmHWM:")).expect("VmHWM");
    let kib: usize = line.split_whitespace().nth(1).and_then(|v| v.parse().ok()).expect("kB");
    kib * 1024
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let (writes, value, bound) =
        (env("PGFENCE_WRITES", 100_000), env("PGFENCE_VALUE", 1024), env("PGFENCE_MAX_QUEUED", 0));
    let server = TestServer::shared().expect("a PostgreSQL server");
    let proxy = Proxy::start(server.tcp_addr().expect("tcp")).await.expect("proxy");
    let mut builder = PgKvStore::builder_from_config(server.config_via(proxy.addr()))
        .table(unique_name("qmem"))
        // 100,000 writes behind the delay take a while on a loaded machine: no deadline.
        .lease_ttl(Duration::from_secs(300));
    if bound > 0 {
        builder = builder.max_queued_bytes(bound);
    }
    let store = builder.open().await.expect("open");
    // Warm up: every pooled connection open and its statements prepared.
    let mut warm = tokio::task::JoinSet::new();
    for i in 0..64 {
        warm.spawn(store.write("bench", "warm", &format!("w{i}"), vec![0; value]));
    }
    while let Some(done) = warm.join_next().await {
        done.unwrap().unwrap();
    }
    proxy.set_delay(Duration::from_millis(5));
    let baseline = peak_rss();
    let started = Instant::now();
    let mut set = tokio::task::JoinSet::new();
    let mut future_size = 0;
    for i in 0..writes {
        let write = store.write("bench", "q", &format!("key{i:07}"), vec![i as u8; value]);
        future_size = std::mem::size_of_val(&write);
        set.spawn(write);
    }
    let mut queued_peak = 0;
    let mut done = 0;
    while let Some(result) = set.join_next().await {
        result.unwrap().unwrap();
        done += 1;
        if done % 1000 == 0 {
            queued_peak = queued_peak.max(store.queued_bytes());
        }
    }
    let elapsed = started.elapsed();
    let peak = peak_rss();
    let above = peak.saturating_sub(baseline);
    let values = writes * value;
    println!(
        "{writes} writes of {value} B, max_queued_bytes {}: {elapsed:.1?}; peak RSS {:.1} MiB \
         above a baseline of {:.1} MiB; values {:.1} MiB; overhead {} B per write; \
         queued bytes seen up to {:.1} MiB; a write's future {future_size} B",
        if bound > 0 { bound.to_string() } else { "default".into() },
        above as f64 / 1048576.0,
        baseline as f64 / 1048576.0,
        values as f64 / 1048576.0,
        above.saturating_sub(values) / writes,
        queued_peak as f64 / 1048576.0,
    );
    proxy.set_delay(Duration::ZERO);
    store.close().await.expect("close");
}
