//! `hold --metrics-addr`: the store's [`Stats`] as Prometheus text, over a minimal HTTP/1.1
//! responder.
//!
//! The names and labels are those of the library's `metrics` feature (docs/metrics.md). They
//! are rendered here from `PgKvStore::stats()`, so the CLI needs no metrics crate. The
//! responder answers `GET /metrics` and closes each connection after one answer. That is all a
//! Prometheus scrape needs, and it keeps the CLI free of an HTTP server crate.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::time::Duration;

use pgfence::{Histogram, LeaseState, PgKvStore, Stats};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use crate::exit::Exit;

/// The longest a scrape may take to send its request: a client that sends nothing does not
/// keep a task forever.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// The most bytes of a request read: a scrape's request is a few hundred.
const MAX_REQUEST: usize = 8 << 10;

/// Binds the address before anything else happens. An address in use is a usage error at
/// once, not after the lease was taken.
pub(crate) async fn bind(addr: SocketAddr) -> Result<TcpListener, Exit> {
    TcpListener::bind(addr)
        .await
        .map_err(|e| Exit::usage(format!("--metrics-addr {addr}: cannot listen: {e}")))
}

/// Serves scrapes until the process exits. Until the store is open (a standby waiting),
/// `store` holds `None`: the scrape then shows `pgfence_lease_held` 0.
pub(crate) fn serve(
    listener: TcpListener,
    table: String,
    store: watch::Receiver<Option<PgKvStore>>,
) {
    tokio::spawn(async move {
        loop {
            let (stream, _) = match listener.accept().await {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of file descriptors, say: back off rather than spin.
                    tracing::warn!(error = %e, "metrics endpoint cannot accept");
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue;
                }
            };
            let (table, store) = (table.clone(), store.clone());
            tokio::spawn(async move {
                if let Err(e) = answer(stream, &table, &store).await {
                    tracing::debug!(error = %e, "metrics scrape failed");
                }
            });
        }
    });
}

/// Reads one request and answers it.
async fn answer(
    mut stream: TcpStream,
    table: &str,
    store: &watch::Receiver<Option<PgKvStore>>,
) -> std::io::Result<()> {
    let mut request = Vec::with_capacity(512);
    let read = async {
        let mut buf = [0u8; 1024];
        while !request.windows(4).any(|w| w == b"\r\n\r\n") && request.len() < MAX_REQUEST {
            let n = stream.read(&mut buf).await?;
            if n == 0 {
                break;
            }
            request.extend_from_slice(&buf[..n]);
        }
        Ok::<_, std::io::Error>(())
    };
    tokio::time::timeout(REQUEST_TIMEOUT, read)
        .await
        .map_err(|_| std::io::Error::other("request timed out"))??;
    let line = request.split(|&b| b == b'\r').next().unwrap_or_default();
    let mut parts = line.split(|&b| b == b' ');
    let (method, path) = (parts.next().unwrap_or_default(), parts.next().unwrap_or_default());
    let path = path.split(|&b| b == b'?').next().unwrap_or_default();
    let (status, body) = match (method, path) {
        (b"GET", b"/metrics") => {
            let stats = store.borrow().as_ref().map(PgKvStore::stats);
            ("200 OK", render(table, stats.as_ref()))
        }
        (b"GET", _) => ("404 Not Found", "only /metrics is served\n".to_owned()),
        _ => ("405 Method Not Allowed", "only GET is served\n".to_owned()),
    };
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4; charset=utf-8\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    stream.write_all(head.as_bytes()).await?;
    stream.write_all(body.as_bytes()).await?;
    stream.shutdown().await
}

/// A Prometheus text exposition (format 0.0.4) of `stats`, or of a lease not held yet.
pub(crate) fn render(table: &str, stats: Option<&Stats>) -> String {
    let mut out = Text { out: String::with_capacity(8 << 10), table: escape(table) };
    let Some(s) = stats else {
        out.head("pgfence_lease_held", "gauge", "1 while this process holds the lease.");
        out.sample("pgfence_lease_held", "", 0.0);
        return out.out;
    };
    let held = matches!(s.lease, LeaseState::Held { .. });
    out.head("pgfence_lease_held", "gauge", "1 while this process holds the lease.");
    out.sample("pgfence_lease_held", "", if held { 1.0 } else { 0.0 });
    out.head("pgfence_lease_epoch", "gauge", "The epoch (fencing token) held or last held.");
    out.sample("pgfence_lease_epoch", "", s.epoch as f64);
    let help = "Seconds left until the local deadline, when the store fails closed.";
    out.head("pgfence_lease_deadline_seconds", "gauge", help);
    out.sample("pgfence_lease_deadline_seconds", "", s.deadline_in.as_secs_f64());

    out.head("pgfence_renewals_total", "counter", "Lease renewal attempts, by outcome.");
    out.sample("pgfence_renewals_total", "outcome=\"ok\"", s.renewals.ok as f64);
    out.sample("pgfence_renewals_total", "outcome=\"failed\"", s.renewals.failed as f64);
    let help = "Round trip of the last confirmed renewal.";
    out.head("pgfence_renewal_last_seconds", "gauge", help);
    let last = s.renewals.last_latency.unwrap_or_default();
    out.sample("pgfence_renewal_last_seconds", "", last.as_secs_f64());
    let help = "Round trips of the confirmed renewals.";
    out.head("pgfence_renewal_duration_seconds", "histogram", help);
    out.histogram("pgfence_renewal_duration_seconds", "", &s.renewals.latency);

    let ops = [
        ("write", &s.writes),
        ("remove", &s.removes),
        ("batch", &s.batches),
        ("read", &s.reads),
        ("list", &s.lists),
    ];
    out.head("pgfence_operations_total", "counter", "Operations that ran, by kind.");
    for (op, o) in ops {
        out.sample("pgfence_operations_total", &format!("op=\"{op}\""), o.count as f64);
    }
    let help = "Operations that returned an error, by kind (a key not found is none).";
    out.head("pgfence_operation_errors_total", "counter", help);
    for (op, o) in ops {
        out.sample("pgfence_operation_errors_total", &format!("op=\"{op}\""), o.errors as f64);
    }
    let help = "Operation latency from first poll to result, by kind.";
    out.head("pgfence_operation_duration_seconds", "histogram", help);
    for (op, o) in ops {
        out.histogram("pgfence_operation_duration_seconds", &format!("op=\"{op}\""), &o.latency);
    }

    let help = "Statements shared by concurrent mutations.";
    out.head("pgfence_shared_statements_total", "counter", help);
    out.sample("pgfence_shared_statements_total", "", s.shared.statements as f64);
    let help = "Mutations carried by shared statements.";
    out.head("pgfence_shared_mutations_total", "counter", help);
    out.sample("pgfence_shared_mutations_total", "", s.shared.mutations as f64);
    let help = "Statements retried on a fresh connection.";
    out.head("pgfence_retries_total", "counter", help);
    out.sample("pgfence_retries_total", "", s.retries as f64);
    let help = "Times the store failed closed, by reason.";
    out.head("pgfence_fail_closed_total", "counter", help);
    let f = &s.fail_closed;
    for (reason, n) in [
        ("fenced", f.fenced),
        ("taken_over", f.taken_over),
        ("deadline_passed", f.deadline_passed),
        ("write_outcome_unknown", f.write_outcome_unknown),
    ] {
        out.sample("pgfence_fail_closed_total", &format!("reason=\"{reason}\""), n as f64);
    }
    let help = "The store's connection pool, by state.";
    out.head("pgfence_pool_connections", "gauge", help);
    let p = &s.pool;
    for (state, n) in
        [("max", p.max_size), ("open", p.size), ("in_use", p.in_use), ("waiting", p.waiting)]
    {
        out.sample("pgfence_pool_connections", &format!("state=\"{state}\""), n as f64);
    }
    out.out
}

/// The exposition being written; every sample gets the `table` label first.
struct Text {
    out: String,
    table: String,
}

impl Text {
    fn head(&mut self, name: &str, kind: &str, help: &str) {
        let _ = write!(self.out, "# HELP {name} {help}\n# TYPE {name} {kind}\n");
    }

    fn sample(&mut self, name: &str, labels: &str, value: f64) {
        let sep = if labels.is_empty() { "" } else { "," };
        let _ = writeln!(self.out, "{name}{{table=\"{}\"{sep}{labels}}} {value}", self.table);
    }

    /// Cumulative `_bucket` samples with `le`, then `_sum` and `_count`.
    fn histogram(&mut self, name: &str, labels: &str, h: &Histogram) {
        let sep = if labels.is_empty() { "" } else { "," };
        let mut seen = 0;
        let bounds = Histogram::bounds().map(|b| b.as_secs_f64().to_string());
        for (le, n) in bounds.chain(["+Inf".to_owned()]).zip(&h.counts) {
            seen += n;
            self.sample(
                &format!("{name}_bucket"),
                &format!("{labels}{sep}le=\"{le}\""),
                seen as f64,
            );
        }
        self.sample(&format!("{name}_sum"), labels, h.sum.as_secs_f64());
        self.sample(&format!("{name}_count"), labels, h.count as f64);
    }
}

/// A label value as the text format wants it: backslash, quote and newline escaped.
fn escape(value: &str) -> String {
    value.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn before_the_lease_only_held_0_is_shown() {
        let text = render("a\"b", None);
        assert!(text.ends_with("pgfence_lease_held{table=\"a\\\"b\"} 0\n"), "{text}");
    }
}
