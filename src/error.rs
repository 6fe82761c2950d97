//! The one error type of the crate.

use std::fmt;
use std::time::Duration;

/// A `Result` with [`Error`] as its error type.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The error of the pool's read-committed hook (`connect::read_committed`) when the server did
/// not answer in time (retryable). Here, not in `connect`, because [`Error::is_retryable`]
/// recognises it.
pub(crate) const HOOK_TIMED_OUT: &str =
    "no answer to setting read committed within connect_timeout";

/// Everything that can go wrong in `pgfence`.
///
/// Match on the variant to react: [`Error::LeaseHeld`] at open means another live store owns
/// the table (stand by or give up); [`Error::LeaseLost`] means this store may no longer write,
/// ever (stop, and rebuild state from the store in the process that owns the lease next).
///
/// Converts into [`std::io::Error`] with meaningful kinds: `NotFound`, `AlreadyExists` (lease
/// held), `PermissionDenied` (lease lost), `InvalidInput` (bad key, value or configuration).
///
/// `{:?}` shows the message and its causes, as a person reads them: `main` returning
/// `Result<(), pgfence::Error>` prints that. `{:#?}` shows the variant and its fields.
#[derive(thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// Another live store holds the lease; nothing was changed.
    #[error("lease on {table} is held by {holder} (epoch {epoch}, expires in {expires_in:?})")]
    LeaseHeld {
        /// The table whose lease is held.
        table: String,
        /// Who holds it, as the holder described itself: `app pid@host`.
        holder: String,
        /// The holder's fencing token.
        epoch: i64,
        /// Time left until the holder's lease expires, by the database clock.
        expires_in: Duration,
    },

    /// This store no longer owns the lease. Permanent: every later operation fails the same way.
    ///
    /// The statement that found the loss wrote nothing. But a connection may have broken under
    /// an earlier attempt of the same call. That attempt may have committed while the lease was
    /// still held: read the key back. The reason is [`LossReason::WriteOutcomeUnknown`] when
    /// the store failed closed because of that attempt. If the lease was lost meanwhile for
    /// another reason, `Fenced` say, that reason is given. The same holds for a mutation still
    /// waiting for the server's answer at the local deadline (reason `DeadlinePassed`). It was
    /// sent, and may still commit. It is never reordered against other calls of the key.
    #[error("lease lost (epoch {epoch}): {reason}")]
    LeaseLost {
        /// The epoch this store held.
        epoch: i64,
        /// Why the lease is considered lost.
        reason: LossReason,
    },

    /// The key does not exist.
    #[error("key not found: {0}")]
    NotFound(Box<KeyPath>),

    /// A key or namespace is not acceptable; no statement was run.
    #[error("invalid {what} {value:?}: {reason}")]
    InvalidKey {
        /// Which part: `key`, `primary namespace` or `secondary namespace`.
        what: &'static str,
        /// The rejected value (keys and namespaces are never secret).
        value: String,
        /// What is wrong with it.
        reason: &'static str,
    },

    /// The configuration is not acceptable; nothing was connected or changed.
    #[error("invalid configuration: {field}: {reason}")]
    InvalidConfig {
        /// The setting at fault.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },

    /// A value is larger than the configured maximum; nothing was written.
    #[error("value of {len} bytes exceeds the maximum of {max} bytes")]
    ValueTooLarge {
        /// The value's length.
        len: usize,
        /// The configured maximum ([`crate::Builder::max_value_size`]).
        max: usize,
    },

    /// A batch's keys and values add up to more than [`crate::MAX_BATCH_BYTES`]; nothing was
    /// written.
    #[error("batch of {len} bytes (keys and values) exceeds the maximum of {max} bytes")]
    BatchTooLarge {
        /// The batch's size: the bytes of its keys, namespaces and values, and 16 for each
        /// operation.
        len: usize,
        /// [`crate::MAX_BATCH_BYTES`].
        max: usize,
    },

    /// The database was migrated by a newer version of this library; it is refused unchanged.
    #[error("schema of {table} is at version {found}, newer than this library's {supported}")]
    SchemaTooNew {
        /// The table.
        table: String,
        /// The schema version found in the database.
        found: i32,
        /// The newest version this library knows.
        supported: i32,
    },

    /// The server crashed, or failed over to a standby, after deferred writes of this store
    /// returned `Ok` and before they were flushed. They may be lost, all of them or a later part
    /// of them (what survives a crash is a prefix).
    ///
    /// [`crate::PgKvStore::flush`] returns it, and so does a durable `write`, `remove` or
    /// `commit` called while such deferred writes were pending: the store found its crash
    /// marker gone (docs/design.md, "Deferred writes and flush"). A deferred call that was in
    /// flight across the loss returns it too: it committed, but maybe before the crash.
    ///
    /// The lease is still held and the store still works: this call reported the loss, and the
    /// next flush vouches again for deferred writes made after it. What the caller should do:
    /// treat every deferred write since the last `flush` or durable call that returned `Ok` as
    /// possibly missing. Read those keys back, and write again what must be there. A durable
    /// call that returned this error did not run; call it again.
    #[error(
        "the server crashed or failed over: {writes} deferred calls since the last flush may be \
         lost"
    )]
    DeferredWritesLost {
        /// How many deferred calls returned `Ok` since the last flush that vouched for them (1
        /// for the deferred call that returns this error itself).
        writes: u64,
    },

    /// The store was closed with [`crate::PgKvStore::close`].
    #[error("store is closed")]
    Closed,

    /// A statement failed or the connection broke.
    #[error("database error during {operation}")]
    Database {
        /// What the store was doing.
        operation: &'static str,
        /// The driver's error.
        #[source]
        source: tokio_postgres::Error,
    },

    /// A connection to the server could not be made. It names the server and the step that
    /// failed; the driver's error is the source. Never the password.
    #[error("connection to {server} failed at step {step} during {operation}")]
    Connect {
        /// What the store was doing.
        operation: &'static str,
        /// The server, as psql names it: `host:port`, or a Unix socket's path. Several are
        /// joined with commas.
        server: String,
        /// The step that failed.
        step: ConnectStep,
        /// The driver's error, or the time limit that passed.
        #[source]
        source: Box<dyn std::error::Error + Send + Sync>,
    },

    /// The role lacks a privilege (SQLSTATE 42501). It names the privilege and the `GRANT`
    /// that gives it; the server's error is the source.
    #[error("permission denied during {operation}: the role needs {privilege}; fix: {grant}")]
    PermissionDenied {
        /// What the store was doing.
        operation: &'static str,
        /// The privilege missing, such as `USAGE and CREATE on schema public`.
        privilege: Box<str>,
        /// The statement an administrator runs to fix it. It names the role when the store
        /// knows it, else `<role>`.
        grant: Box<str>,
        /// The server's error.
        #[source]
        source: tokio_postgres::Error,
    },

    /// No connection could be had from the pool for a reason of the pool's own: none free in
    /// time, or the pool closed. A failure to connect is [`Error::Connect`].
    #[error("connection pool error during {operation}")]
    Pool {
        /// What the store was doing.
        operation: &'static str,
        /// The pool's error.
        #[source]
        source: Box<deadpool_postgres::PoolError>,
    },

    /// The renewal thread or its runtime could not be started. Or the renewal thread panicked
    /// before it released the lease, with the lease not lost; that is a bug of this crate. The
    /// lease is then no longer renewed and expires by TTL. (The renewal thread's panic of
    /// [`crate::LeaseLossPolicy::Panic`] is reported as [`Error::LeaseLost`].)
    #[error("the lease renewal thread could not be started, or it failed")]
    Runtime {
        /// The operating system's error, or what became of the thread.
        #[source]
        source: std::io::Error,
    },

    /// An operation did not finish within its time limit.
    #[error("timed out during {operation} after {after:?}")]
    Timeout {
        /// What the store was doing.
        operation: &'static str,
        /// The limit that passed.
        after: Duration,
    },

    /// The connection goes through a pooler that hands server sessions out per transaction
    /// (PgBouncer's `pool_mode = transaction` or `statement`), and the store was opened in
    /// [`PoolMode::Session`](crate::PoolMode::Session), which needs a session of its own.
    /// `open()` refuses before it runs anything that could end another client's session. A
    /// busy pooler can hide its mode from that check. A statement then finds its prepared
    /// statement missing on the server session, or taken by another client. That statement
    /// ran nothing, and it fails with this error too, not the server's message. Set
    /// [`Builder::pool_mode`](crate::Builder::pool_mode) to
    /// [`PoolMode::Transaction`](crate::PoolMode::Transaction) for such a pooler.
    #[error(
        "the connection goes through a pooler in {pool_mode} mode: for a transaction pooler, \
         set Builder::pool_mode(PoolMode::Transaction) (or connect through a pooler in \
         session mode, or directly to PostgreSQL)"
    )]
    PoolerModeUnsupported {
        /// The pool mode detected: `"transaction"` (PgBouncer's `statement` mode looks alike).
        pool_mode: &'static str,
    },
}

/// Written by hand, not derived: `main` returning `Err` prints the `Debug` form, and the
/// derived one buries the message in nested structs. The alternate form, `{:#?}`, is what
/// the derive would print.
impl fmt::Debug for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if !f.alternate() {
            // Like anyhow's: the message, then each cause whose text is not already shown
            // (the driver's errors repeat their cause in their own message). A server's error
            // also shows its SQLSTATE, which its message leaves out.
            let mut shown = self.to_string();
            f.write_str(&shown)?;
            let mut source = std::error::Error::source(self);
            let mut n = 0;
            while let Some(cause) = source {
                let text = cause.to_string();
                if !shown.contains(&text) {
                    if n == 0 {
                        f.write_str("\n\nCaused by:")?;
                    }
                    write!(f, "\n    {n}: {}", text.replace('\n', "\n       "))?;
                    let driver = cause.downcast_ref::<tokio_postgres::Error>();
                    if let Some(code) = driver.and_then(tokio_postgres::Error::code) {
                        write!(f, " (SQLSTATE {})", code.code())?;
                    }
                    n += 1;
                    shown.push_str(&text);
                }
                source = cause.source();
            }
            return Ok(());
        }
        match self {
            Error::LeaseHeld { table, holder, epoch, expires_in } => f
                .debug_struct("LeaseHeld")
                .field("table", table)
                .field("holder", holder)
                .field("epoch", epoch)
                .field("expires_in", expires_in)
                .finish(),
            Error::LeaseLost { epoch, reason } => {
                f.debug_struct("LeaseLost").field("epoch", epoch).field("reason", reason).finish()
            }
            Error::NotFound(key) => f.debug_tuple("NotFound").field(key).finish(),
            Error::InvalidKey { what, value, reason } => f
                .debug_struct("InvalidKey")
                .field("what", what)
                .field("value", value)
                .field("reason", reason)
                .finish(),
            Error::InvalidConfig { field, reason } => f
                .debug_struct("InvalidConfig")
                .field("field", field)
                .field("reason", reason)
                .finish(),
            Error::ValueTooLarge { len, max } => {
                f.debug_struct("ValueTooLarge").field("len", len).field("max", max).finish()
            }
            Error::BatchTooLarge { len, max } => {
                f.debug_struct("BatchTooLarge").field("len", len).field("max", max).finish()
            }
            Error::SchemaTooNew { table, found, supported } => f
                .debug_struct("SchemaTooNew")
                .field("table", table)
                .field("found", found)
                .field("supported", supported)
                .finish(),
            Error::DeferredWritesLost { writes } => {
                f.debug_struct("DeferredWritesLost").field("writes", writes).finish()
            }
            Error::Closed => f.write_str("Closed"),
            Error::Database { operation, source } => f
                .debug_struct("Database")
                .field("operation", operation)
                .field("source", source)
                .finish(),
            Error::Connect { operation, server, step, source } => f
                .debug_struct("Connect")
                .field("operation", operation)
                .field("server", server)
                .field("step", step)
                .field("source", source)
                .finish(),
            Error::PermissionDenied { operation, privilege, grant, source } => f
                .debug_struct("PermissionDenied")
                .field("operation", operation)
                .field("privilege", privilege)
                .field("grant", grant)
                .field("source", source)
                .finish(),
            Error::Pool { operation, source } => f
                .debug_struct("Pool")
                .field("operation", operation)
                .field("source", source)
                .finish(),
            Error::Runtime { source } => f.debug_struct("Runtime").field("source", source).finish(),
            Error::Timeout { operation, after } => f
                .debug_struct("Timeout")
                .field("operation", operation)
                .field("after", after)
                .finish(),
            Error::PoolerModeUnsupported { pool_mode } => {
                f.debug_struct("PoolerModeUnsupported").field("pool_mode", pool_mode).finish()
            }
            // A variant added without an arm here still shows its message.
            #[allow(unreachable_patterns)]
            _ => f.debug_tuple("Error").field(&format_args!("{self}")).finish(),
        }
    }
}

/// Why a store considers its lease lost. Carried by [`Error::LeaseLost`] and
/// [`crate::LeaseState::Lost`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum LossReason {
    /// A mutation's fence check found the lease owned by someone else or expired: the database
    /// refused the write.
    Fenced,
    /// Renewal found the lease row no longer ours (taken over or released by an operator).
    TakenOver,
    /// Renewal could not be confirmed before the local deadline, which comes before the
    /// database-side expiry. Operations still waiting for the server's answer then return with
    /// it too (a server or network that stopped answering, with the connection still up).
    DeadlinePassed,
    /// A write's statement may still commit and its outcome cannot be learned. There are three
    /// causes. Its connection broke and the server session running it could not be confirmed
    /// ended. Or its retries ended in an error, so it may have committed, or not. Or the task
    /// running it was dropped mid-statement (its runtime shut down). The store stops rather
    /// than risk that write landing after a later call of the same key, or an earlier call
    /// overwriting it.
    WriteOutcomeUnknown,
}

impl fmt::Display for LossReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            LossReason::Fenced => "the database refused a mutation: lease expired or taken over",
            LossReason::TakenOver => "renewal found the lease owned by another store",
            LossReason::DeadlinePassed => {
                "renewal not confirmed before the local deadline (fail closed before DB expiry)"
            }
            LossReason::WriteOutcomeUnknown => {
                "a write's outcome could not be resolved (its connection broke, its retries ended \
                    in an error, or its task was dropped)"
            }
        })
    }
}

/// The step of making a connection that failed, in [`Error::Connect`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ConnectStep {
    /// Reaching the server: the name lookup, the TCP or Unix socket connect, or its time limit.
    Connect,
    /// The TLS handshake, or a server that offers no TLS.
    Tls,
    /// Authentication: a wrong password, no password, or no `pg_hba.conf` entry.
    Authentication,
    /// The role may not connect to the database (no `CONNECT` privilege).
    Permission,
    /// The server refused the session: no such database, too many connections, or starting up.
    ServerRefused,
}

impl fmt::Display for ConnectStep {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            ConnectStep::Connect => "connect",
            ConnectStep::Tls => "TLS",
            ConnectStep::Authentication => "authentication",
            ConnectStep::Permission => "permission",
            ConnectStep::ServerRefused => "server refused",
        })
    }
}

impl ConnectStep {
    /// The step at which `e`, an error of making a connection, failed.
    fn of(e: &tokio_postgres::Error) -> ConnectStep {
        if let Some(db) = e.as_db_error() {
            return match db.code().code() {
                // invalid_password, invalid_authorization_specification (pg_hba.conf).
                "28P01" | "28000" => ConnectStep::Authentication,
                "42501" => ConnectStep::Permission,
                _ => ConnectStep::ServerRefused,
            };
        }
        // The driver's error kinds are private; its messages name them.
        let text = e.to_string();
        if text.starts_with("error performing TLS handshake") || has_rustls_error(e) {
            ConnectStep::Tls
        } else if text.starts_with("authentication error") {
            ConnectStep::Authentication
        } else {
            ConnectStep::Connect
        }
    }
}

/// Whether a rustls error is among the sources of `e`.
fn has_rustls_error(e: &(dyn std::error::Error + 'static)) -> bool {
    let mut source = Some(e);
    while let Some(current) = source {
        if current.is::<rustls::Error>() {
            return true;
        }
        if let Some(io) = current.downcast_ref::<std::io::Error>() {
            if io.get_ref().is_some_and(|inner| inner.is::<rustls::Error>()) {
                return true;
            }
        }
        source = current.source();
    }
    false
}

/// The three names of a key, for error reporting.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct KeyPath {
    /// Primary namespace.
    pub primary_namespace: String,
    /// Secondary namespace.
    pub secondary_namespace: String,
    /// Key.
    pub key: String,
}

impl KeyPath {
    /// The three names of a key.
    pub fn new(primary_namespace: &str, secondary_namespace: &str, key: &str) -> KeyPath {
        KeyPath {
            primary_namespace: primary_namespace.to_owned(),
            secondary_namespace: secondary_namespace.to_owned(),
            key: key.to_owned(),
        }
    }
}

impl fmt::Display for KeyPath {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}/{}", self.primary_namespace, self.secondary_namespace, self.key)
    }
}

impl Error {
    /// True for [`Error::LeaseHeld`].
    pub fn is_lease_held(&self) -> bool {
        matches!(self, Error::LeaseHeld { .. })
    }

    /// True for [`Error::LeaseLost`].
    pub fn is_lease_lost(&self) -> bool {
        matches!(self, Error::LeaseLost { .. })
    }

    /// True for [`Error::DeferredWritesLost`].
    pub fn is_deferred_writes_lost(&self) -> bool {
        matches!(self, Error::DeferredWritesLost { .. })
    }

    /// True for [`Error::NotFound`].
    pub fn is_not_found(&self) -> bool {
        matches!(self, Error::NotFound(_))
    }

    /// True when the same call may succeed if tried again. That covers a broken connection,
    /// and a server that refuses connections for now (restarting, or too many connections). It
    /// also covers a pool that had no connection in time, and a timeout. Never true for lease
    /// loss or invalid input.
    pub fn is_retryable(&self) -> bool {
        match self {
            Error::Database { source, .. } => is_connection_error(source),
            // A time limit that passed has no driver error.
            Error::Connect { source, .. } => {
                source.downcast_ref::<tokio_postgres::Error>().is_none_or(is_connection_error)
            }
            Error::Pool { source, .. } => {
                matches!(&**source, deadpool_postgres::PoolError::Timeout(_))
            }
            Error::Timeout { .. } => true,
            _ => false,
        }
    }

    /// True for [`Error::Connect`]: no connection to the server could be made.
    pub fn is_connect(&self) -> bool {
        matches!(self, Error::Connect { .. })
    }

    /// True for [`Error::PermissionDenied`], and for a connection the role may not make.
    pub fn is_permission_denied(&self) -> bool {
        matches!(
            self,
            Error::PermissionDenied { .. } | Error::Connect { step: ConnectStep::Permission, .. }
        )
    }

    /// A statement's error: [`Error::PermissionDenied`] for a missing privilege,
    /// [`Error::PoolerModeUnsupported`] for a prepared statement the server session lacks or
    /// already has under another text, else [`Error::Database`].
    pub(crate) fn db(operation: &'static str) -> impl FnOnce(tokio_postgres::Error) -> Error {
        move |source| {
            if is_foreign_session(&source) {
                return Error::PoolerModeUnsupported { pool_mode: "transaction" };
            }
            match grant_for(&source, operation, "<role>") {
                Some((privilege, grant)) => {
                    Error::PermissionDenied { operation, privilege, grant, source }
                }
                None => Error::Database { operation, source },
            }
        }
    }

    /// A failure to connect to `server`.
    pub(crate) fn connect(
        operation: &'static str,
        server: &str,
        e: tokio_postgres::Error,
    ) -> Error {
        Error::Connect {
            operation,
            server: server.to_owned(),
            step: ConnectStep::of(&e),
            source: Box::new(e),
        }
    }

    /// A pool's error, for a pool that connects to `server`. A failure to connect, or a
    /// connection's setup that timed out, is [`Error::Connect`].
    pub(crate) fn from_pool(
        operation: &'static str,
        server: &str,
        e: deadpool_postgres::PoolError,
    ) -> Error {
        use deadpool_postgres::{HookError, PoolError, TimeoutType};
        let timed_out = |what: &str| Error::Connect {
            operation,
            server: server.to_owned(),
            step: ConnectStep::Connect,
            source: Box::new(std::io::Error::new(std::io::ErrorKind::TimedOut, what.to_owned())),
        };
        match e {
            PoolError::Backend(e) | PoolError::PostCreateHook(HookError::Backend(e)) => {
                Error::connect(operation, server, e)
            }
            PoolError::Timeout(TimeoutType::Create) => {
                timed_out("no answer within connect_timeout")
            }
            PoolError::PostCreateHook(HookError::Message(message)) if message == HOOK_TIMED_OUT => {
                timed_out(HOOK_TIMED_OUT)
            }
            e => Error::Pool { operation, source: Box::new(e) },
        }
    }

    /// This error with `role` in the `GRANT` of a permission error.
    pub(crate) fn for_role(self, role: Option<&str>) -> Error {
        match (self, role) {
            (Error::PermissionDenied { operation, source, .. }, Some(role)) => {
                let (privilege, grant) =
                    grant_for(&source, operation, role).expect("a permission error");
                Error::PermissionDenied { operation, privilege, grant, source }
            }
            (e, _) => e,
        }
    }

    pub(crate) fn config(field: &'static str, reason: impl Into<String>) -> Error {
        Error::InvalidConfig { field, reason: reason.into() }
    }
}

/// Whether the server refused a prepared statement of the driver's: "prepared statement
/// \"s3\" does not exist" (26000) or "already exists" (42P05). The driver names its statements
/// uniquely per process and prepares each once per connection. So either means another
/// session than the one it was prepared on: a pooler moved the connection between server
/// sessions, as in transaction mode. Nothing of the statement ran.
fn is_foreign_session(e: &tokio_postgres::Error) -> bool {
    use tokio_postgres::error::SqlState;
    e.as_db_error().is_some_and(|db| {
        matches!(db.code(), &SqlState::INVALID_SQL_STATEMENT_NAME | &SqlState::DUPLICATE_PSTATEMENT)
            && db.message().starts_with("prepared statement")
    })
}

/// For a permission error (SQLSTATE 42501): the privilege missing and the statement an
/// administrator runs to give it to `role`, from the server's message and the
/// rights of `operation` ([`crate::privileges`]).
fn grant_for(
    e: &tokio_postgres::Error,
    operation: &str,
    role: &str,
) -> Option<(Box<str>, Box<str>)> {
    let db = e.as_db_error()?;
    if db.code() != &tokio_postgres::error::SqlState::INSUFFICIENT_PRIVILEGE {
        return None;
    }
    let (privilege, grant) = crate::privileges::advice(db.message(), operation, role);
    Some((privilege.into(), grant.into()))
}

/// True when the error means the connection is gone (so a statement's outcome may be unknown),
/// as opposed to the server rejecting the statement.
pub(crate) fn is_connection_error(e: &tokio_postgres::Error) -> bool {
    if e.is_closed() {
        return true;
    }
    if let Some(db) = e.as_db_error() {
        // - Class 08: connection exception.
        // - 57P01..57P03: admin shutdown, crash shutdown, cannot connect now (server
        //   restarting).
        // - 53300: too many connections. It is refused at connection start, before any
        //   statement, for the server, the database or the role.
        // - 25P03: the server ended a session left idle in a transaction (the setup's
        //   `idle_in_transaction_session_timeout`). This FATAL error may reach the client as
        //   the answer to the statement it sent meanwhile, when the link was slow. The
        //   session is gone, as after a broken connection, and a standby must keep waiting.
        let code = db.code().code();
        return code.starts_with("08")
            || matches!(code, "57P01" | "57P02" | "57P03" | "53300" | "25P03");
    }
    // No server error attached: I/O, connect or protocol failure on our side of the socket.
    // A TLS failure is the exception: a certificate not trusted or not for this host, or no
    // common protocol. That is a configuration error that no retry mends, so a standby must
    // not wait on it.
    std::error::Error::source(e)
        .and_then(|s| s.downcast_ref::<std::io::Error>())
        .is_some_and(|io| !io.get_ref().is_some_and(|inner| inner.is::<rustls::Error>()))
}

impl From<Error> for std::io::Error {
    fn from(e: Error) -> Self {
        use std::io::ErrorKind;
        let kind = match &e {
            Error::NotFound(_) => ErrorKind::NotFound,
            Error::LeaseHeld { .. } => ErrorKind::AlreadyExists,
            Error::LeaseLost { .. } | Error::PermissionDenied { .. } => ErrorKind::PermissionDenied,
            Error::Connect { step, .. } => match step {
                ConnectStep::Authentication | ConnectStep::Permission => {
                    ErrorKind::PermissionDenied
                }
                ConnectStep::Connect | ConnectStep::ServerRefused => ErrorKind::ConnectionRefused,
                _ => ErrorKind::Other,
            },
            Error::InvalidKey { .. }
            | Error::InvalidConfig { .. }
            | Error::ValueTooLarge { .. }
            | Error::BatchTooLarge { .. }
            | Error::PoolerModeUnsupported { .. } => ErrorKind::InvalidInput,
            Error::Closed => ErrorKind::NotConnected,
            Error::Timeout { .. } => ErrorKind::TimedOut,
            Error::SchemaTooNew { .. }
            | Error::DeferredWritesLost { .. }
            | Error::Database { .. }
            | Error::Pool { .. }
            | Error::Runtime { .. } => ErrorKind::Other,
        };
        std::io::Error::new(kind, e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn io_error_kinds_are_meaningful() {
        use std::io::ErrorKind;
        let path = KeyPath {
            primary_namespace: "a".into(),
            secondary_namespace: "b".into(),
            key: "c".into(),
        };
        let connect = |step| Error::Connect {
            operation: "connect",
            server: "db.internal:5432".into(),
            step,
            source: Box::new(std::io::Error::other("refused")),
        };
        let cases = [
            (Error::NotFound(Box::new(path)), ErrorKind::NotFound),
            (
                Error::LeaseHeld {
                    table: "t".into(),
                    holder: "h".into(),
                    epoch: 1,
                    expires_in: Duration::from_secs(1),
                },
                ErrorKind::AlreadyExists,
            ),
            (
                Error::LeaseLost { epoch: 1, reason: LossReason::Fenced },
                ErrorKind::PermissionDenied,
            ),
            (
                Error::InvalidKey { what: "key", value: String::new(), reason: "empty" },
                ErrorKind::InvalidInput,
            ),
            (Error::config("table", "bad"), ErrorKind::InvalidInput),
            (Error::ValueTooLarge { len: 2, max: 1 }, ErrorKind::InvalidInput),
            (Error::BatchTooLarge { len: 2, max: 1 }, ErrorKind::InvalidInput),
            (Error::Closed, ErrorKind::NotConnected),
            (connect(ConnectStep::Connect), ErrorKind::ConnectionRefused),
            (connect(ConnectStep::Authentication), ErrorKind::PermissionDenied),
            (connect(ConnectStep::Tls), ErrorKind::Other),
            (
                Error::Timeout { operation: "close", after: Duration::from_secs(1) },
                ErrorKind::TimedOut,
            ),
        ];
        for (e, kind) in cases {
            let msg = e.to_string();
            let io: std::io::Error = e.into();
            assert_eq!(io.kind(), kind, "{msg}");
            assert!(io.get_ref().is_some(), "the pgfence error is kept as the source");
        }
    }

    #[test]
    fn result_stays_small() {
        assert!(std::mem::size_of::<Error>() <= 72, "{}", std::mem::size_of::<Error>());
    }
}
