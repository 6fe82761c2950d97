//! The audit's in-process TCP proxy: one per holder slot, in front of the user's server. A cut
//! closes every connection through it at once, as a broken network path or a restarted pooler
//! would. New connections are forwarded again right after.

use std::io;
use std::net::SocketAddr;
use std::path::PathBuf;

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, TcpStream, UnixStream};
use tokio::sync::watch;
use tokio::task::JoinHandle;

/// Where the proxy forwards to: the server's TCP address or its Unix socket.
#[derive(Debug, Clone)]
pub(super) enum Upstream {
    Tcp(String, u16),
    Unix(PathBuf),
}

impl Upstream {
    /// The one server a connection config names, if it names exactly one. The proxy takes no
    /// part in choosing among several hosts.
    pub(super) fn of(config: &tokio_postgres::Config) -> Option<Upstream> {
        use tokio_postgres::config::Host;
        let port = config.get_ports().first().copied().unwrap_or(5432);
        match (config.get_hosts(), config.get_hostaddrs()) {
            ([Host::Tcp(host)], []) => Some(Upstream::Tcp(host.clone(), port)),
            ([Host::Unix(dir)], []) => Some(Upstream::Unix(dir.join(format!(".s.PGSQL.{port}")))),
            ([], [addr]) => Some(Upstream::Tcp(addr.to_string(), port)),
            _ => None,
        }
    }
}

/// A listening proxy; dropping it stops accepting and closes its connections.
#[derive(Debug)]
pub(super) struct Proxy {
    pub(super) addr: SocketAddr,
    cuts: watch::Sender<u64>,
    accepting: JoinHandle<()>,
}

impl Proxy {
    pub(super) async fn start(upstream: Upstream) -> io::Result<Proxy> {
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        let (cuts, _) = watch::channel(0u64);
        let subscribe = cuts.clone();
        let accepting = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let _ = client.set_nodelay(true);
                let cut = subscribe.subscribe();
                tokio::spawn(forward(client, upstream.clone(), cut));
            }
        });
        Ok(Proxy { addr, cuts, accepting })
    }

    /// Closes every connection open through the proxy now.
    pub(super) fn cut(&self) {
        self.cuts.send_modify(|generation| *generation += 1);
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accepting.abort();
        self.cut();
    }
}

async fn forward(client: TcpStream, upstream: Upstream, cut: watch::Receiver<u64>) {
    match upstream {
        Upstream::Tcp(host, port) => {
            if let Ok(server) = TcpStream::connect((host.as_str(), port)).await {
                let _ = server.set_nodelay(true);
                pipe(client, server, cut).await;
            }
        }
        Upstream::Unix(path) => {
            if let Ok(server) = UnixStream::connect(path).await {
                pipe(client, server, cut).await;
            }
        }
    }
}

/// Copies both ways until either side closes or the proxy cuts. Returning drops both streams,
/// which closes them: the client sees its connection end, the server its session.
async fn pipe<S: AsyncRead + AsyncWrite + Unpin>(
    mut client: TcpStream,
    mut server: S,
    mut cut: watch::Receiver<u64>,
) {
    tokio::select! {
        _ = tokio::io::copy_bidirectional(&mut client, &mut server) => {}
        _ = cut.changed() => {}
    }
}
