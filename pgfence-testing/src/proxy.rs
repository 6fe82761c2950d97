//! [`Proxy`]: a fault-injecting TCP proxy between clients and a server.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::io;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError, mpsc as std_mpsc};
use std::thread;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{mpsc, oneshot};
use tokio::task::AbortHandle;

use crate::gate::{ConnectionGates, FrontendParser, Gate, GateInner, GateMatch, Hold};

/// A fault-injecting TCP proxy between clients and a server, on loopback (or on the address
/// given to [`Proxy::start_on`]).
///
/// Each accepted connection is forwarded to the upstream address. While it runs, a test can
/// delay every chunk of data ([`Proxy::set_delay`]), refuse new connections
/// ([`Proxy::set_refuse`]), abruptly close every current connection ([`Proxy::cut_all`]),
/// corrupt what the server sends on one of them ([`Proxy::corrupt_next_reply`]), or hold back
/// the data of one connection ([`Proxy::stall`]), of all ([`Proxy::hang`]), what the clients
/// send ([`Proxy::hang_requests`]), or what new sessions send after their startup
/// ([`Proxy::hang_after_client_chunks`]). It can also hold one chosen statement, or its
/// answer, until the test releases it ([`Proxy::gate`]).
///
/// The accept loop and one task per connection run on the tokio runtime that called
/// [`Proxy::start`] (multi-thread or current-thread; it must have time enabled, as
/// `#[tokio::test]` runtimes do). Delays are timed by one thread of the proxy's own (for
/// sub-millisecond accuracy; tokio timers tick in milliseconds). Dropping the proxy aborts the
/// tasks and stops and joins that thread: nothing keeps running, and every proxied connection is
/// closed.
#[derive(Debug)]
pub struct Proxy {
    addr: SocketAddr,
    upstream: SocketAddr,
    shared: Arc<ProxyShared>,
    accept_task: AbortHandle,
    /// The timer thread, joined on drop.
    timer_thread: Option<thread::JoinHandle<()>>,
}

#[derive(Debug)]
struct ProxyShared {
    /// One-way delay in nanoseconds.
    delay_nanos: AtomicU64,
    refuse: AtomicBool,
    /// The upstream-side local port of the connection whose next chunk from the server is to be
    /// corrupted; 0 for none.
    corrupt_port: AtomicU32,
    /// Upstream-side local ports of the connections whose data is held back.
    stalled_ports: Mutex<HashSet<u32>>,
    /// Set when every connection's data is held back ([`Proxy::hang`]).
    hung: AtomicBool,
    /// Set when what every client sends is held back ([`Proxy::hang_requests`]).
    requests_hung: AtomicBool,
    /// Chunks held back so far, for good ([`Proxy::held`]).
    held: AtomicU64,
    /// How many chunks a new connection's client may send before the rest is held back
    /// ([`Proxy::hang_after_client_chunks`]); `u32::MAX` for no limit.
    client_chunks: AtomicU32,
    /// Gates armed and not yet holding ([`Proxy::gate`]).
    gates: Mutex<Vec<Arc<GateInner>>>,
    connections: Mutex<Connections>,
    timer: DelayTimer,
}

#[derive(Debug, Default)]
struct Connections {
    next_id: u64,
    tasks: HashMap<u64, AbortHandle>,
    /// Set when the proxy is dropped. Aborting the accept task takes effect only at its next
    /// await, so it may still be about to register a connection: it checks this first.
    closed: bool,
}

impl ProxyShared {
    fn delay(&self) -> Duration {
        Duration::from_nanos(self.delay_nanos.load(Ordering::Relaxed))
    }

    fn connections(&self) -> std::sync::MutexGuard<'_, Connections> {
        self.connections.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

impl Proxy {
    /// Starts a proxy listening on `127.0.0.1` (a free port) that forwards to `upstream`.
    ///
    /// Must be called within a tokio runtime.
    pub async fn start(upstream: SocketAddr) -> io::Result<Proxy> {
        Proxy::start_on(Ipv4Addr::LOCALHOST.into(), upstream).await
    }

    /// [`Proxy::start`], listening on `ip` (a free port) instead: an address of another
    /// interface, for clients on the far side of it.
    pub async fn start_on(ip: IpAddr, upstream: SocketAddr) -> io::Result<Proxy> {
        let listener = TcpListener::bind((ip, 0)).await?;
        let addr = listener.local_addr()?;
        let (timer, timer_thread) = DelayTimer::start()?;
        let shared = Arc::new(ProxyShared {
            delay_nanos: AtomicU64::new(0),
            refuse: AtomicBool::new(false),
            corrupt_port: AtomicU32::new(0),
            stalled_ports: Mutex::new(HashSet::new()),
            hung: AtomicBool::new(false),
            requests_hung: AtomicBool::new(false),
            held: AtomicU64::new(0),
            client_chunks: AtomicU32::new(u32::MAX),
            gates: Mutex::new(Vec::new()),
            connections: Mutex::new(Connections::default()),
            timer,
        });
        let accept_task =
            tokio::spawn(accept_loop(listener, upstream, Arc::clone(&shared))).abort_handle();
        Ok(Proxy { addr, upstream, shared, accept_task, timer_thread: Some(timer_thread) })
    }

    /// The address clients connect to.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The address connections are forwarded to.
    pub fn upstream(&self) -> SocketAddr {
        self.upstream
    }

    /// Delays every chunk forwarded in either direction by `one_way` (so a request and its
    /// answer take at least twice that). Order is kept and throughput is not limited: chunks
    /// are read as they arrive, and each is written out when its own delay has passed. Applies
    /// to data read from now on, also on existing connections. Zero (the default) turns it off.
    ///
    /// The delay is a lower bound, and it holds to a fraction of a millisecond also below a
    /// millisecond: a chunk goes out typically 0.1–0.2 ms after it is due (the kernel's timer
    /// slack and two thread wake-ups; more on a loaded machine or a virtual one), on top of the
    /// ~50 µs the extra hop costs anyway. Measure the round trip rather than assume it.
    pub fn set_delay(&self, one_way: Duration) {
        let nanos = u64::try_from(one_way.as_nanos()).unwrap_or(u64::MAX);
        self.shared.delay_nanos.store(nanos, Ordering::Relaxed);
    }

    /// Abruptly closes every current connection, in both directions, dropping data in flight.
    /// New connections are accepted as usual.
    pub fn cut_all(&self) {
        let tasks = std::mem::take(&mut self.shared.connections().tasks);
        for task in tasks.values() {
            task.abort();
        }
    }

    /// While `refuse` is true, new connections are accepted and closed at once, without
    /// contacting the upstream. Existing connections are not affected.
    pub fn set_refuse(&self, refuse: bool) {
        self.shared.refuse.store(refuse, Ordering::Relaxed);
    }

    /// Flips one bit of the next chunk of data the server sends on one connection: the one
    /// whose server session reports `client_port` as its `pg_stat_activity.client_port` (the
    /// proxy's side of that connection). Over TLS the client's decryption of it fails.
    pub fn corrupt_next_reply(&self, client_port: u16) {
        self.shared.corrupt_port.store(u32::from(client_port), Ordering::SeqCst);
    }

    /// Holds back everything either side sends from now on, on one connection: the one whose
    /// server session reports `client_port` as its `pg_stat_activity.client_port`. The
    /// connection stays up and nothing is refused, as through a NAT or firewall that silently
    /// dropped it, or a middlebox that hangs.
    pub fn stall(&self, client_port: u16) {
        let mut stalled = self.shared.stalled_ports.lock().unwrap_or_else(PoisonError::into_inner);
        stalled.insert(u32::from(client_port));
    }

    /// Holds back everything either side sends from now on, on every connection, current and
    /// new ones alike: as a server that hung (its kernel still accepts connections and
    /// acknowledges data, but nothing answers), or a middlebox that did. Nothing is refused or
    /// closed.
    pub fn hang(&self) {
        self.shared.hung.store(true, Ordering::SeqCst);
    }

    /// Holds back everything the clients send from now on, on every connection, current and
    /// new ones alike, while what the server sends still passes: a server that answered what
    /// it had and then hung, as its clients see it.
    pub fn hang_requests(&self) {
        self.shared.requests_hung.store(true, Ordering::SeqCst);
    }

    /// How many chunks of data (as read, in either direction) the proxy has held back for good
    /// so far: by [`Proxy::stall`], [`Proxy::hang`], [`Proxy::hang_requests`] or
    /// [`Proxy::hang_after_client_chunks`].
    pub fn held(&self) -> u64 {
        self.shared.held.load(Ordering::SeqCst)
    }

    /// On connections made from now on, forwards only the first `n` chunks of data the client
    /// sends (read as they arrive) and holds back the rest; what the server sends passes. With
    /// `n = 1` and a role that needs no password, the server answers the startup and nothing
    /// after it: a session that hangs right after it began.
    pub fn hang_after_client_chunks(&self, n: u32) {
        self.shared.client_chunks.store(n, Ordering::SeqCst);
    }

    /// Arms a [`Gate`]: the first statement that runs from now on, on any connection, whose SQL
    /// `matching` accepts is held (`hold`) until the gate is released, cut or dropped.
    ///
    /// The proxy reads each connection's frontend protocol to tell which statement a message
    /// runs: a simple query, or the `Bind` of a statement prepared on that connection (its SQL
    /// known from its `Parse`). See [`Gate`] for what is held, and its limits (TLS).
    ///
    /// ```no_run
    /// # async fn example(proxy: &pgfence_testing::Proxy) {
    /// use pgfence_testing::{GateMatch, Hold};
    ///
    /// let gate = proxy.gate(GateMatch::sql_contains("SET expires_at"), Hold::Statement);
    /// let held = gate.held().await; // A renewal is on its way, not at the server yet.
    /// println!("held on port {}: {}", held.client_port, held.sql);
    /// gate.release(); // Or `gate.cut()`, to break that connection only.
    /// # }
    /// ```
    pub fn gate(&self, matching: GateMatch, hold: Hold) -> Gate {
        let (gate, inner) = Gate::new(matching, hold);
        self.shared.gates.lock().unwrap_or_else(PoisonError::into_inner).push(inner);
        gate
    }

    /// The number of connections currently being forwarded.
    pub fn connection_count(&self) -> usize {
        self.shared.connections().tasks.len()
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept_task.abort();
        self.shared.connections().closed = true;
        self.cut_all();
        self.shared.timer.stop();
        if let Some(timer_thread) = self.timer_thread.take() {
            // Prompt: the thread wakes for the stop request and never blocks on anything else.
            let _ = timer_thread.join();
        }
    }
}

/// Wakes the proxy's writers when their chunks are due, from a thread of its own.
///
/// Why not tokio timers: they have a resolution of 1 ms and round every deadline up to the
/// next tick, so a 100 µs delay became about 1.1 ms per direction and a round trip below ~2.5 ms
/// could not be emulated. A plain thread blocking with a timeout (a futex wait, like
/// `std::thread::sleep`) is woken by a high-resolution kernel timer, typically 50–100 µs late
/// (the default timer slack is 50 µs; a hypervisor adds to it), and uses no CPU while it waits:
/// unlike spinning out the last sub-millisecond on the runtime, this costs nothing on a machine
/// whose few cores the server and the client share (a spin per chunk in flight would take a
/// core from the server the benches measure). Waking the writer's task from this thread adds
/// one more thread wake-up. One thread serves every connection of a proxy; it only times, the
/// tokio tasks still do all the I/O, so it works the same on current-thread and multi-thread
/// runtimes.
#[derive(Debug)]
struct DelayTimer {
    requests: std_mpsc::Sender<TimerRequest>,
}

#[derive(Debug)]
enum TimerRequest {
    /// Send on `waker` once `due` has passed.
    Wake { due: Instant, waker: oneshot::Sender<()> },
    /// End the thread (the proxy is dropped). Pending wakers are dropped, which their waiting
    /// tasks (aborted by then) would see as an error.
    Stop,
}

impl DelayTimer {
    fn start() -> io::Result<(DelayTimer, thread::JoinHandle<()>)> {
        let (requests, incoming) = std_mpsc::channel();
        let thread = thread::Builder::new()
            .name("pgfence-proxy-timer".to_owned())
            .spawn(move || DelayTimer::run(incoming))?;
        Ok((DelayTimer { requests }, thread))
    }

    fn run(incoming: std_mpsc::Receiver<TimerRequest>) {
        // Keyed by due time, then arrival (equal due times are kept, in order).
        let mut pending: BTreeMap<(Instant, u64), oneshot::Sender<()>> = BTreeMap::new();
        let mut arrivals: u64 = 0;
        loop {
            let now = Instant::now();
            while let Some(entry) = pending.first_entry() {
                if entry.key().0 > now {
                    break;
                }
                // The task may have gone (its connection cut): nothing to wake then.
                let _ = entry.remove().send(());
            }
            let request = match pending.first_key_value() {
                Some((&(next_due, _), _)) => {
                    match incoming.recv_timeout(next_due.saturating_duration_since(now)) {
                        Ok(request) => request,
                        Err(std_mpsc::RecvTimeoutError::Timeout) => continue,
                        Err(std_mpsc::RecvTimeoutError::Disconnected) => return,
                    }
                }
                None => match incoming.recv() {
                    Ok(request) => request,
                    Err(std_mpsc::RecvError) => return,
                },
            };
            match request {
                TimerRequest::Wake { due, waker } => {
                    pending.insert((due, arrivals), waker);
                    arrivals += 1;
                }
                TimerRequest::Stop => return,
            }
        }
    }

    /// Returns once `due` has passed.
    async fn sleep_until(&self, due: Instant) {
        if due <= Instant::now() {
            return;
        }
        let (waker, woken) = oneshot::channel();
        let sent = self.requests.send(TimerRequest::Wake { due, waker }).is_ok();
        if !sent || woken.await.is_err() {
            // The timer thread has stopped: the proxy is being dropped and this task is about
            // to be aborted. Never shorten a delay, even then.
            tokio::time::sleep_until(due.into()).await;
        }
    }

    fn stop(&self) {
        let _ = self.requests.send(TimerRequest::Stop);
    }
}

async fn accept_loop(listener: TcpListener, upstream: SocketAddr, shared: Arc<ProxyShared>) {
    loop {
        let client = match listener.accept().await {
            Ok((client, _)) => client,
            Err(_) => {
                // E.g. out of file descriptors: back off instead of spinning.
                tokio::time::sleep(Duration::from_millis(10)).await;
                continue;
            }
        };
        if shared.refuse.load(Ordering::Relaxed) {
            drop(client);
            continue;
        }
        let mut connections = shared.connections();
        if connections.closed {
            return;
        }
        let id = connections.next_id;
        connections.next_id += 1;
        let task_shared = Arc::clone(&shared);
        // The lock is held across the spawn, so the task's removal of its entry (if it ends at
        // once, on another worker) waits until the entry is there.
        let task = tokio::spawn(async move {
            let _ = forward(client, upstream, &task_shared).await;
            task_shared.connections().tasks.remove(&id);
        });
        connections.tasks.insert(id, task.abort_handle());
    }
}

/// Forwards one connection until both directions have ended, or until either fails (then the
/// whole connection is dropped, closing both sockets).
async fn forward(client: TcpStream, upstream: SocketAddr, shared: &ProxyShared) -> io::Result<()> {
    let server = TcpStream::connect(upstream).await?;
    client.set_nodelay(true)?;
    server.set_nodelay(true)?;
    let local_port = server.local_addr()?.port();
    let port = u32::from(local_port);
    let client_chunks = shared.client_chunks.load(Ordering::SeqCst);
    let gates = ConnectionGates::new(local_port);
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    let pumps = async {
        tokio::try_join!(
            pump(client_read, server_write, shared, &gates, port, false, client_chunks),
            pump(server_read, client_write, shared, &gates, port, true, u32::MAX),
        )
    };
    // A gate's cut ends this connection only, as `cut_all` does: both sockets are dropped.
    tokio::select! {
        result = pumps => result.map(drop),
        () = gates.cut.notified() => Ok(()),
    }
}

/// One direction of a connection. The reader stamps each chunk with its due time and queues
/// it; the writer writes each chunk once it is due (woken by the proxy's [`DelayTimer`]). The
/// two run concurrently, so a delay adds latency without limiting throughput, and the queue
/// keeps the order. `port`: the connection's port on the server side (see
/// [`Proxy::corrupt_next_reply`] and [`Proxy::stall`]); `from_server`: the direction;
/// `passing`: how many chunks pass before the rest is held back
/// ([`Proxy::hang_after_client_chunks`]; `u32::MAX`: all).
///
/// What the client sends is read as the protocol it is ([`FrontendParser`]), and split at a
/// statement that a gate holds ([`Proxy::gate`]). Each part is queued with the gates it waits
/// for, so the writer stops there, and everything queued after it waits too.
async fn pump(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    shared: &ProxyShared,
    gates: &ConnectionGates,
    port: u32,
    from_server: bool,
    mut passing: u32,
) -> io::Result<()> {
    let (tx, mut rx) = mpsc::unbounded_channel::<(Instant, Vec<u8>, Vec<Arc<GateInner>>)>();
    let read = async move {
        // Owned by this block, so end-of-file drops it and the writer sees the queue end.
        let tx = tx;
        let mut parser = FrontendParser::default();
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            let n = from.read(&mut buf).await?;
            if n == 0 {
                return Ok::<(), io::Error>(());
            }
            let stalled = shared.hung.load(Ordering::SeqCst)
                || passing == 0
                || (!from_server && shared.requests_hung.load(Ordering::SeqCst))
                || shared
                    .stalled_ports
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .contains(&port);
            if stalled {
                shared.held.fetch_add(1, Ordering::SeqCst);
            }
            if passing != u32::MAX {
                passing = passing.saturating_sub(1);
            }
            // Held back for a day: in effect never, as the proxy is dropped long before.
            let delay = if stalled { Duration::from_secs(86_400) } else { shared.delay() };
            let due = Instant::now() + delay;
            let mut chunk = buf[..n].to_vec();
            if from_server {
                let corrupt = &shared.corrupt_port;
                if corrupt.compare_exchange(port, 0, Ordering::SeqCst, Ordering::SeqCst).is_ok() {
                    chunk[n - 1] ^= 1;
                }
            }
            let segments = if from_server {
                vec![(chunk, gates.server_chunk())]
            } else {
                gates.client_chunk(&mut parser, &shared.gates, chunk)
            };
            for (segment, holds) in segments {
                if tx.send((due, segment, holds)).is_err() {
                    // The writer has failed; `try_join!` reports its error.
                    return Ok(());
                }
            }
        }
    };
    let write = async move {
        while let Some((due, chunk, holds)) = rx.recv().await {
            for gate in &holds {
                if !gate.opened().await {
                    return Err(io::Error::other("connection cut at a gate"));
                }
            }
            shared.timer.sleep_until(due).await;
            to.write_all(&chunk).await?;
        }
        // Pass the half-close on: the peer sees end-of-file after the last chunk.
        to.shutdown().await
    };
    tokio::try_join!(read, write)?;
    Ok(())
}
