//! [`Gate`]: holds one chosen statement, or its answer, at a [`Proxy`](crate::Proxy) until the
//! test releases it.
//!
//! The proxy reads the PostgreSQL frontend protocol of every connection it forwards
//! ([`FrontendParser`]), to know which statement each message runs. It never changes a byte.

use std::collections::HashMap;
use std::fmt;
use std::sync::{Arc, Mutex, PoisonError};

use tokio::sync::{Notify, watch};

/// Which statement a [`Gate`] holds: the first one run whose SQL text matches.
///
/// A statement runs when the client sends a simple query (`Q`) or binds a prepared statement
/// (`B`). A prepared statement is known by the SQL its `Parse` gave it, on the same
/// connection. So a statement prepared once and run many times matches every time it runs.
/// A `Parse` on its own runs nothing and is never held.
pub struct GateMatch {
    description: String,
    matches: Box<dyn Fn(&str) -> bool + Send + Sync>,
}

impl GateMatch {
    /// Statements whose SQL text contains `text`.
    pub fn sql_contains(text: impl Into<String>) -> GateMatch {
        let text = text.into();
        let description = format!("SQL containing {text:?}");
        GateMatch { description, matches: Box::new(move |sql| sql.contains(&text)) }
    }

    /// Statements whose SQL text `matches` accepts. `description` names them in `Debug`.
    pub fn sql_where(
        description: impl Into<String>,
        matches: impl Fn(&str) -> bool + Send + Sync + 'static,
    ) -> GateMatch {
        GateMatch { description: description.into(), matches: Box::new(matches) }
    }
}

impl fmt::Debug for GateMatch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_tuple("GateMatch").field(&self.description).finish()
    }
}

/// What a [`Gate`] holds back once its statement runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Hold {
    /// The statement itself: what its client sends, from the message that runs it onward, is
    /// not forwarded until the gate is released. The server has not seen it. Its parameters
    /// are fixed already: they travel in that message.
    Statement,
    /// Its answer: the statement goes to the server and runs, but what the server sends to
    /// that client from then on is not forwarded until the gate is released. The client
    /// cannot tell a committed statement from one still running.
    Answer,
}

/// The statement a [`Gate`] holds.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Held {
    /// The port of the proxy's side of the connection: the server session's
    /// `pg_stat_activity.client_port`, as [`Proxy::stall`](crate::Proxy::stall) takes it.
    pub client_port: u16,
    /// The statement's SQL text.
    pub sql: String,
}

/// A gate's life: armed, then holding one statement, then released or cut.
#[derive(Debug, Clone)]
enum State {
    Armed,
    Holding {
        held: Held,
        cut: Arc<Notify>,
    },
    /// Released. `held`: what it held, if anything (a gate released while armed holds nothing
    /// any more).
    Released {
        held: Option<Held>,
    },
    Cut {
        held: Held,
    },
}

/// The state of one gate, shared by its [`Gate`] handle and the proxy's connection tasks.
pub(crate) struct GateInner {
    matching: GateMatch,
    hold: Hold,
    state: watch::Sender<State>,
}

impl fmt::Debug for GateInner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("GateInner")
            .field("matching", &self.matching)
            .field("hold", &self.hold)
            .field("state", &*self.state.borrow())
            .finish()
    }
}

impl GateInner {
    /// Holds the statement `sql` of the connection at `port` if this gate is armed and matches
    /// it. `cut` ends that connection.
    fn try_hold(&self, sql: &str, port: u16, cut: &Arc<Notify>) -> bool {
        self.state.send_if_modified(|state| {
            if !matches!(state, State::Armed) || !(self.matching.matches)(sql) {
                return false;
            }
            let held = Held { client_port: port, sql: sql.to_owned() };
            *state = State::Holding { held, cut: Arc::clone(cut) };
            true
        })
    }

    fn is_armed(&self) -> bool {
        matches!(*self.state.borrow(), State::Armed)
    }

    /// Waits until the gate no longer holds: true once released, false once cut.
    pub(crate) async fn opened(&self) -> bool {
        let mut state = self.state.subscribe();
        // The sender lives in `self`: the wait cannot fail.
        let open = state.wait_for(|s| matches!(s, State::Released { .. } | State::Cut { .. }));
        matches!(*open.await.expect("the gate's sender lives in it"), State::Released { .. })
    }
}

/// A hold on one statement at a [`Proxy`](crate::Proxy), made by
/// [`Proxy::gate`](crate::Proxy::gate): the test decides when it goes on.
///
/// A gate is one-shot. It holds the first statement that matches, on whichever connection
/// runs it first, and no later one. Arm another gate for the next. Several gates may be armed
/// at once; they hold independently.
///
/// The statement is held where the proxy forwards it, so nothing of it is on the server yet
/// ([`Hold::Statement`]), or its answer is not on the client yet ([`Hold::Answer`]). Everything
/// after it on that connection, in that direction, waits behind it: the connection keeps its
/// order. The other connections go on.
///
/// Dropping the gate releases it.
///
/// # Limits
///
/// A connection that turns to TLS (its `SSLRequest` answered `S`) or to GSS encryption is
/// passed through unparsed: no gate ever matches a statement on it. A gate on a connection
/// that the proxy cuts, stalls or delays is cut, stalled or delayed with it.
#[derive(Debug)]
pub struct Gate {
    inner: Arc<GateInner>,
}

impl Gate {
    pub(crate) fn new(matching: GateMatch, hold: Hold) -> (Gate, Arc<GateInner>) {
        let (state, _) = watch::channel(State::Armed);
        let inner = Arc::new(GateInner { matching, hold, state });
        (Gate { inner: Arc::clone(&inner) }, inner)
    }

    /// Waits until the gate holds a statement (returns at once if it did), and returns it.
    /// Also returns a statement that was released or cut since.
    ///
    /// # Panics
    ///
    /// If the gate was released before it held anything: it never will.
    pub async fn held(&self) -> Held {
        let mut state = self.inner.state.subscribe();
        let state = state.wait_for(|s| !matches!(s, State::Armed)).await;
        match &*state.expect("the gate's sender lives in it") {
            State::Holding { held, .. } | State::Cut { held } => held.clone(),
            State::Released { held: Some(held) } => held.clone(),
            State::Released { held: None } | State::Armed => {
                panic!("gate ({:?}) released before it held a statement", self.inner.matching)
            }
        }
    }

    /// The statement it holds now, if any; not one released or cut.
    pub fn holding(&self) -> Option<Held> {
        match &*self.inner.state.borrow() {
            State::Holding { held, .. } => Some(held.clone()),
            _ => None,
        }
    }

    /// Lets the held statement (or answer) go on, with everything that waited behind it. A gate
    /// that holds nothing yet is disarmed: it will hold nothing. Releasing again does nothing.
    pub fn release(&self) {
        self.inner.state.send_if_modified(|state| {
            let held = match state {
                State::Armed => None,
                State::Holding { held, .. } => Some(held.clone()),
                State::Released { .. } | State::Cut { .. } => return false,
            };
            *state = State::Released { held };
            true
        });
    }

    /// Abruptly closes the connection of the held statement, in both directions, as
    /// [`Proxy::cut_all`](crate::Proxy::cut_all) would, and only that one. What it held is
    /// dropped. Returns whether it held a statement; a gate that held nothing yet is disarmed
    /// instead, and one released already cuts nothing.
    pub fn cut(&self) -> bool {
        let mut cut = None;
        self.inner.state.send_if_modified(|state| match state {
            State::Armed => {
                *state = State::Released { held: None };
                true
            }
            State::Holding { held, cut: signal } => {
                cut = Some(Arc::clone(signal));
                *state = State::Cut { held: held.clone() };
                true
            }
            State::Released { .. } | State::Cut { .. } => false,
        });
        // After the state change: the writers waiting at the gate see it cut, not released.
        cut.inspect(|signal| signal.notify_one()).is_some()
    }
}

impl Drop for Gate {
    fn drop(&mut self) {
        self.release();
    }
}

/// The gates of one connection: its cut signal, and the answer holds for what the server
/// sends next.
#[derive(Debug)]
pub(crate) struct ConnectionGates {
    port: u16,
    /// Ends the connection ([`Gate::cut`]).
    pub(crate) cut: Arc<Notify>,
    /// [`Hold::Answer`] gates that held a statement on this connection: the next chunk the
    /// server sends waits for them.
    answers: Mutex<Vec<Arc<GateInner>>>,
}

/// One part of a chunk of data, and the gates it waits for before it is forwarded.
pub(crate) type Segment = (Vec<u8>, Vec<Arc<GateInner>>);

impl ConnectionGates {
    pub(crate) fn new(port: u16) -> ConnectionGates {
        ConnectionGates { port, cut: Arc::new(Notify::new()), answers: Mutex::new(Vec::new()) }
    }

    /// Splits a chunk the client sent at the statements that `armed` gates hold.
    ///
    /// An answer hold is set here, before the chunk is queued. So the statement's answer,
    /// which comes only after the statement is forwarded, waits for it.
    pub(crate) fn client_chunk(
        &self,
        parser: &mut FrontendParser,
        armed: &Mutex<Vec<Arc<GateInner>>>,
        chunk: Vec<u8>,
    ) -> Vec<Segment> {
        let runs = parser.feed(&chunk);
        if runs.is_empty() {
            return vec![(chunk, Vec::new())];
        }
        // Where the chunk is split, and the gates the part from there waits for.
        let mut splits: Vec<(usize, Arc<GateInner>)> = Vec::new();
        {
            let mut armed = armed.lock().unwrap_or_else(PoisonError::into_inner);
            for (start, sql) in &runs {
                armed.retain(|gate| {
                    if !gate.try_hold(sql, self.port, &self.cut) {
                        return gate.is_armed(); // Forget gates released unused.
                    }
                    match gate.hold {
                        Hold::Statement => splits.push((*start, Arc::clone(gate))),
                        Hold::Answer => self.lock_answers().push(Arc::clone(gate)),
                    }
                    false
                });
            }
        }
        let mut segments: Vec<Segment> = Vec::new();
        let mut rest = chunk;
        let mut offset = 0;
        let mut gates = Vec::new();
        for (start, gate) in splits {
            if start > offset {
                let tail = rest.split_off(start - offset);
                segments.push((std::mem::replace(&mut rest, tail), std::mem::take(&mut gates)));
                offset = start;
            }
            gates.push(gate);
        }
        segments.push((rest, gates));
        segments
    }

    /// The gates a chunk the server sent waits for.
    pub(crate) fn server_chunk(&self) -> Vec<Arc<GateInner>> {
        std::mem::take(&mut *self.lock_answers())
    }

    fn lock_answers(&self) -> std::sync::MutexGuard<'_, Vec<Arc<GateInner>>> {
        self.answers.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// `SSLRequest`'s and `GSSENCRequest`'s codes, in place of a protocol version.
const SSL_REQUEST: u32 = 80_877_103;
const GSSENC_REQUEST: u32 = 80_877_104;

/// How much of a `Bind` is kept: its portal and statement names come first.
const BIND_PREFIX: usize = 1024;

/// Where the parser is in a connection's frontend stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Expecting a message without a type byte: a startup packet, `SSLRequest`,
    /// `GSSENCRequest` or `CancelRequest`.
    Untyped,
    /// After an `SSLRequest` or `GSSENCRequest`. A refusal (`N`) is followed by an untyped
    /// message, whose length starts with a zero byte. Anything else starts a TLS (or GSS)
    /// handshake.
    AfterEncryptionRequest,
    /// Typed messages: a type byte, then a length.
    Typed,
    /// Encrypted, or not understood: passed through unparsed.
    Opaque,
}

/// Reads the frontend side of one connection and reports each statement it runs.
///
/// It keeps only what it needs: headers, the SQL of `Q` and `P`, the names in `B` and `C`.
/// Other messages, a large `Bind`'s values included, are skipped as they pass.
#[derive(Debug)]
pub(crate) struct FrontendParser {
    phase: Phase,
    /// The header read so far: 8 bytes (length and code) untyped, 5 (type and length) typed.
    header: Vec<u8>,
    /// The message being read: its type (0 untyped), body bytes still to come, how many more
    /// of them to keep, and the ones kept.
    kind: u8,
    remaining: usize,
    keep: usize,
    body: Vec<u8>,
    /// Prepared statements by name (`""`: the unnamed one), with their SQL.
    statements: HashMap<Vec<u8>, String>,
}

impl Default for FrontendParser {
    fn default() -> FrontendParser {
        FrontendParser {
            phase: Phase::Untyped,
            header: Vec::with_capacity(8),
            kind: 0,
            remaining: 0,
            keep: 0,
            body: Vec::new(),
            statements: HashMap::new(),
        }
    }
}

impl FrontendParser {
    /// Reads the next chunk of the stream. Returns the statements that messages completed in it
    /// run, in order: the offset in `chunk` where that message began (0 if it began in an
    /// earlier chunk), and its SQL.
    pub(crate) fn feed(&mut self, chunk: &[u8]) -> Vec<(usize, String)> {
        let mut runs = Vec::new();
        let mut at = 0;
        // Where the current message began in this chunk.
        let mut began = 0;
        while at < chunk.len() {
            match self.phase {
                Phase::Opaque => break,
                Phase::AfterEncryptionRequest => {
                    self.phase = if chunk[at] == 0 { Phase::Untyped } else { Phase::Opaque };
                }
                // Between messages, or in a header.
                Phase::Untyped | Phase::Typed if self.remaining == 0 => {
                    if self.header.is_empty() {
                        began = at;
                    }
                    let want = if self.phase == Phase::Untyped { 8 } else { 5 };
                    let take = (want - self.header.len()).min(chunk.len() - at);
                    self.header.extend_from_slice(&chunk[at..at + take]);
                    at += take;
                    if self.header.len() == want {
                        self.start_body();
                        if self.remaining == 0 {
                            self.finish(began, &mut runs);
                        }
                    }
                }
                Phase::Untyped | Phase::Typed => {
                    let take = self.remaining.min(chunk.len() - at);
                    let kept = take.min(self.keep);
                    self.body.extend_from_slice(&chunk[at..at + kept]);
                    self.keep -= kept;
                    self.remaining -= take;
                    at += take;
                    if self.remaining == 0 {
                        self.finish(began, &mut runs);
                    }
                }
            }
        }
        runs
    }

    /// The header is complete: sets up reading the body.
    fn start_body(&mut self) {
        let be32 = |b: &[u8]| u32::from_be_bytes([b[0], b[1], b[2], b[3]]);
        let (kind, length, consumed) = match self.phase {
            // The length counts itself and the code.
            Phase::Untyped => (0, be32(&self.header[0..4]), 8),
            // The length counts itself, not the type byte.
            _ => (self.header[0], be32(&self.header[1..5]), 4),
        };
        let Some(rest) = (length as usize).checked_sub(consumed) else {
            self.phase = Phase::Opaque; // Not the protocol this reads.
            return;
        };
        self.kind = kind;
        self.remaining = rest;
        self.keep = match kind {
            b'Q' | b'P' => rest,
            b'B' | b'C' => rest.min(BIND_PREFIX),
            _ => 0,
        };
        self.body.clear();
    }

    /// A message is complete: records what it prepares, and reports what it runs.
    fn finish(&mut self, began: usize, runs: &mut Vec<(usize, String)>) {
        let header = std::mem::take(&mut self.header);
        let body = std::mem::take(&mut self.body);
        if self.phase == Phase::Opaque {
            return;
        }
        if self.phase == Phase::Untyped {
            let code = u32::from_be_bytes([header[4], header[5], header[6], header[7]]);
            self.phase = match code {
                SSL_REQUEST | GSSENC_REQUEST => Phase::AfterEncryptionRequest,
                // A startup packet (protocol 3.x); a CancelRequest has nothing after it.
                _ => Phase::Typed,
            };
            return;
        }
        let mut fields = body.split(|&b| b == 0);
        let mut next = || fields.next().unwrap_or_default();
        let text = |bytes: &[u8]| String::from_utf8_lossy(bytes).into_owned();
        match self.kind {
            b'Q' => runs.push((began, text(next()))),
            b'P' => {
                let name = next().to_vec();
                let sql = text(next());
                self.statements.insert(name, sql);
            }
            b'B' => {
                let _portal = next();
                if let Some(sql) = self.statements.get(next()) {
                    runs.push((began, sql.clone()));
                }
            }
            // Close of a prepared statement ('S'; 'P' closes a portal).
            b'C' => {
                if let Some((b'S', name)) = body.split_first() {
                    self.statements.remove(name.split(|&b| b == 0).next().unwrap_or_default());
                }
            }
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use tokio_postgres::{Client, NoTls};

    use super::*;
    use crate::{Proxy, TestServer, unique_name};

    /// A typed message: its type, its length, its body.
    fn message(kind: u8, body: &[u8]) -> Vec<u8> {
        let mut out = vec![kind];
        out.extend_from_slice(&(body.len() as u32 + 4).to_be_bytes());
        out.extend_from_slice(body);
        out
    }

    fn cstrings(parts: &[&str]) -> Vec<u8> {
        parts.iter().flat_map(|p| p.bytes().chain([0])).collect()
    }

    fn untyped(code: u32, rest: &[u8]) -> Vec<u8> {
        let mut out = (rest.len() as u32 + 8).to_be_bytes().to_vec();
        out.extend_from_slice(&code.to_be_bytes());
        out.extend_from_slice(rest);
        out
    }

    /// A session: startup, a prepare of `s1`, a run of it, an unnamed statement parsed and
    /// run, a simple query, a close of `s1` and a run of the closed name. With the offset of
    /// each message that runs something.
    fn session() -> (Vec<u8>, Vec<(usize, String)>) {
        let mut stream = untyped(196_608, &cstrings(&["user", "u", ""]));
        let mut runs = Vec::new();
        stream.extend(message(b'P', &[cstrings(&["s1", "SELECT $1"]), vec![0, 0]].concat()));
        stream.extend(message(b'D', b"Ss1\0"));
        stream.extend(message(b'S', b""));
        runs.push((stream.len(), "SELECT $1".to_owned()));
        // A Bind with a large value: only its names are kept.
        let value = vec![7u8; 100_000];
        let bind =
            [cstrings(&["", "s1"]), vec![0, 0, 0, 1, 0, 1, 0, 1, 0x86, 0xa0], value].concat();
        stream.extend(message(b'B', &[bind, vec![0, 0]].concat()));
        stream.extend(message(b'E', b"\0\0\0\0\0"));
        stream.extend(message(b'S', b""));
        stream.extend(message(b'P', &[cstrings(&["", "SELECT 2"]), vec![0, 0]].concat()));
        runs.push((stream.len(), "SELECT 2".to_owned()));
        stream.extend(message(b'B', &[cstrings(&["", ""]), vec![0; 6]].concat()));
        stream.extend(message(b'E', b"\0\0\0\0\0"));
        stream.extend(message(b'S', b""));
        runs.push((stream.len(), "SELECT 3; SELECT 4".to_owned()));
        stream.extend(message(b'Q', &cstrings(&["SELECT 3; SELECT 4"])));
        stream.extend(message(b'C', b"Ss1\0"));
        stream.extend(message(b'B', &[cstrings(&["", "s1"]), vec![0; 6]].concat()));
        stream.extend(message(b'X', b""));
        (stream, runs)
    }

    /// Every statement run is reported once, at the message that runs it, however the stream
    /// is cut into chunks: whole, byte by byte, and in chunks of 1000.
    #[test]
    fn parser_reports_each_statement_run_wherever_the_chunks_split() {
        let (stream, runs) = session();
        let mut parser = FrontendParser::default();
        assert_eq!(parser.feed(&stream), runs);
        for size in [1, 1000] {
            let mut parser = FrontendParser::default();
            let mut found = Vec::new();
            for (i, chunk) in stream.chunks(size).enumerate() {
                for (start, sql) in parser.feed(chunk) {
                    let at = i * size + start;
                    // A message that began in an earlier chunk is reported at this one's start.
                    let run = runs.iter().find(|(s, q)| *q == sql && *s <= at && at < s + 200_000);
                    found.push(run.expect("a statement that runs").clone());
                }
            }
            assert_eq!(found, runs, "chunks of {size}");
        }
    }

    /// After an SSLRequest refused (`N`), the startup packet follows and is read. After one
    /// accepted, a TLS handshake follows: nothing of it is read as messages.
    #[test]
    fn parser_passes_tls_through_unread() {
        let (stream, runs) = session();
        let refused = [untyped(SSL_REQUEST, b""), stream.clone()].concat();
        let mut parser = FrontendParser::default();
        let found: Vec<String> = parser.feed(&refused).into_iter().map(|r| r.1).collect();
        assert_eq!(found, runs.iter().map(|r| r.1.clone()).collect::<Vec<_>>());

        // A TLS record starts with 0x16; then anything, even what looks like a query.
        let accepted = [untyped(SSL_REQUEST, b""), vec![0x16, 3, 1], message(b'Q', b"x\0")];
        let mut parser = FrontendParser::default();
        assert!(parser.feed(&accepted.concat()).is_empty());
        assert!(parser.feed(&stream).is_empty());
    }

    async fn connect_via(proxy: &Proxy) -> Client {
        let config = TestServer::shared().unwrap().config_via(proxy.addr());
        let (client, connection) = config.connect(NoTls).await.unwrap();
        tokio::spawn(connection);
        client
    }

    async fn admin() -> Client {
        TestServer::shared().unwrap().connect().await.unwrap()
    }

    /// The text of the last query of the session on `port`, and its state.
    async fn activity(admin: &Client, port: u16) -> (String, String) {
        let sql = "SELECT query, state FROM pg_stat_activity WHERE client_port = $1";
        let row = admin.query_one(sql, &[&i32::from(port)]).await.unwrap();
        (row.get(0), row.get(1))
    }

    async fn within<F: std::future::Future>(what: &str, fut: F) -> F::Output {
        let guard = Duration::from_secs(60); // Against hangs; never a measurement.
        tokio::time::timeout(guard, fut).await.unwrap_or_else(|_| panic!("{what} hung"))
    }

    /// A prepared statement is held when it runs, not when it is prepared. It is known by its
    /// SQL also when it runs again later. Held, it has not reached the server (it inserted no
    /// row); released, it runs and answers. The other connections go on meanwhile.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn gate_holds_a_prepared_statement_each_time_it_runs() {
        let proxy = Proxy::start(TestServer::shared().unwrap().tcp_addr().unwrap()).await.unwrap();
        let client = Arc::new(connect_via(&proxy).await);
        let other = connect_via(&proxy).await;
        let admin = admin().await;
        let table = unique_name("gate_prepared");
        admin.batch_execute(&format!("CREATE TABLE {table} (n int4)")).await.unwrap();
        let sql = format!("INSERT INTO {table} VALUES ($1) RETURNING n + 1");
        let rows = format!("SELECT count(*) FROM {table}");

        let gate = proxy.gate(GateMatch::sql_contains(&table), Hold::Statement);
        let statement = within("prepare", client.prepare(&sql)).await.unwrap();
        assert_eq!(gate.holding(), None, "a Parse alone is not held");
        let run = |n: i32| {
            let (client, statement) = (Arc::clone(&client), statement.clone());
            tokio::spawn(async move {
                client.query_one(&statement, &[&n]).await.map(|r| r.get::<_, i32>(0))
            })
        };
        let first = run(1);
        let held = within("held", gate.held()).await;
        assert_eq!(held.sql, sql);
        let one: i32 = within("other", other.query_one("SELECT 1", &[])).await.unwrap().get(0);
        assert_eq!(one, 1, "another connection goes on");
        let n: i64 = admin.query_one(&rows, &[]).await.unwrap().get(0);
        assert_eq!(n, 0, "the server has not run it");
        assert!(!first.is_finished());
        gate.release();
        assert_eq!(within("first", first).await.unwrap().unwrap(), 2);

        // Run again later: the same statement, by its name, held by a new gate.
        let again = proxy.gate(GateMatch::sql_contains(&table), Hold::Statement);
        let second = run(5);
        assert_eq!(within("held again", again.held()).await.sql, sql);
        let n: i64 = admin.query_one(&rows, &[]).await.unwrap().get(0);
        assert_eq!(n, 1, "the server has not run it again");
        drop(again); // Dropping releases.
        assert_eq!(within("second", second).await.unwrap().unwrap(), 6);
        assert_eq!(gate.holding(), None, "one-shot: the first gate held only the first run");
        admin.batch_execute(&format!("DROP TABLE {table}")).await.unwrap();
    }

    /// A simple query is held too. Its answer can be held instead: the statement runs and
    /// commits, its client waits. Cutting the gate breaks that connection only.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn gate_holds_a_simple_query_or_its_answer_and_cuts_its_connection() {
        let proxy = Proxy::start(TestServer::shared().unwrap().tcp_addr().unwrap()).await.unwrap();
        let client = Arc::new(connect_via(&proxy).await);
        let other = connect_via(&proxy).await;
        let admin = admin().await;
        let table = unique_name("gate_simple");
        admin.batch_execute(&format!("CREATE TABLE {table} (n int)")).await.unwrap();
        let insert = format!("INSERT INTO {table} VALUES (1)");
        let count = format!("SELECT count(*) FROM {table}");

        let gate = proxy.gate(GateMatch::sql_contains(&insert), Hold::Statement);
        let c = Arc::clone(&client);
        let sql = insert.clone();
        let held_insert = tokio::spawn(async move { c.batch_execute(&sql).await });
        let held = within("held", gate.held()).await;
        assert_eq!(held.sql, insert);
        assert_ne!(activity(&admin, held.client_port).await.0, insert, "not on the server");
        gate.release();
        within("insert", held_insert).await.unwrap().unwrap();

        // The answer held: the insert commits, its client still waits; then cut.
        let answer = proxy.gate(GateMatch::sql_contains(&insert), Hold::Answer);
        let c = Arc::clone(&client);
        let sql = insert.clone();
        let unanswered = tokio::spawn(async move { c.batch_execute(&sql).await });
        let held = within("answer held", answer.held()).await;
        within("committed", async {
            loop {
                let n: i64 = admin.query_one(&count, &[]).await.unwrap().get(0);
                if n == 2 {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await;
        assert_eq!(activity(&admin, held.client_port).await, (insert.clone(), "idle".to_owned()));
        assert!(!unanswered.is_finished(), "the client has no answer");
        assert!(answer.cut());
        let result = within("cut", unanswered).await.unwrap();
        assert!(result.is_err(), "the connection was cut: {result:?}");
        let one: i32 = within("other", other.query_one("SELECT 1", &[])).await.unwrap().get(0);
        assert_eq!(one, 1, "the other connection is not cut");
        admin.batch_execute(&format!("DROP TABLE {table}")).await.unwrap();
    }

    /// A gate released before it held anything holds nothing; `cut` then cuts nothing.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn gate_released_unused_is_disarmed() {
        let proxy = Proxy::start(TestServer::shared().unwrap().tcp_addr().unwrap()).await.unwrap();
        let client = connect_via(&proxy).await;
        let gate = proxy.gate(GateMatch::sql_contains("SELECT 41"), Hold::Statement);
        gate.release();
        let n: i32 = within("query", client.query_one("SELECT 41", &[])).await.unwrap().get(0);
        assert_eq!(n, 41);
        assert_eq!(gate.holding(), None);
        let other = proxy.gate(GateMatch::sql_where("never", |_| false), Hold::Answer);
        assert!(!other.cut(), "nothing held, nothing cut");
    }
}
