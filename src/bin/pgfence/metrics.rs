//! `hold --metrics-addr`: the store's [`Stats`] as Prometheus text, over a minimal HTTP/1.1
//! responder.
//!
//! The text is the library's [`Stats::prometheus`], with the names and labels of its `metrics`
//! feature (docs/metrics.md), so the CLI needs no metrics crate. The
//! responder answers `GET /metrics` and closes each connection after one answer. That is all a
//! Prometheus scrape needs, and it keeps the CLI free of an HTTP server crate.

use std::net::SocketAddr;
use std::time::Duration;

use pgfence::{PgKvStore, Stats};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

use crate::exit::Exit;

/// The longest a scrape may take to send its request: a client that sends nothing does not
/// keep a task forever.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);

/// The most bytes of a request read: a scrape's request is a few hundred.
const MAX_REQUEST: usize = 8 << 10;

/// `--metrics-addr`: `HOST:PORT`, with a host name or an address (`[::1]:9187` for IPv6), or
/// `:PORT` for every interface, as Prometheus exporters take it.
#[derive(Debug, Clone)]
pub(crate) struct ListenAddr {
    /// `None`: every interface.
    host: Option<String>,
    port: u16,
    /// As given, for messages.
    shown: String,
}

impl ListenAddr {
    /// Checks the form only; a host name is resolved when bound.
    pub(crate) fn parse(s: &str) -> Result<ListenAddr, String> {
        let expected = || format!("{s:?}: expected HOST:PORT or :PORT (127.0.0.1:9187, :9187)");
        let (host, port) = s.rsplit_once(':').ok_or_else(expected)?;
        let port: u16 = port.parse().map_err(|_| expected())?;
        let host = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')).unwrap_or(host);
        if host.contains(':') && host.parse::<std::net::Ipv6Addr>().is_err() {
            return Err(format!("{s:?}: an IPv6 address goes in brackets, [::1]:9187"));
        }
        let host = (!host.is_empty()).then(|| host.to_owned());
        Ok(ListenAddr { host, port, shown: s.to_owned() })
    }
}

/// Binds the address before anything else happens. An address in use is a usage error at
/// once, not after the lease was taken. `:PORT` listens on every IPv6 and IPv4 interface,
/// or on every IPv4 one where IPv6 is off. A host name is bound at its first address that
/// works.
pub(crate) async fn bind(addr: &ListenAddr) -> Result<TcpListener, Exit> {
    let bound = match &addr.host {
        Some(host) => TcpListener::bind((host.as_str(), addr.port)).await,
        None => match TcpListener::bind(SocketAddr::from(([0u16; 8], addr.port))).await {
            Err(e) if e.kind() != std::io::ErrorKind::AddrInUse => {
                TcpListener::bind(SocketAddr::from(([0u8; 4], addr.port))).await
            }
            other => other,
        },
    };
    bound.map_err(|e| Exit::usage(format!("--metrics-addr {}: cannot listen: {e}", addr.shown)))
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
            let text = stats.map_or_else(|| Stats::prometheus_not_open(table), |s| s.prometheus());
            ("200 OK", text)
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
