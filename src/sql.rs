//! Every SQL statement pgfence runs, in one place, readable and pasteable into `psql`.
//!
//! `{kv}`, `{lease}` and `{version}` stand for the quoted names of the KV table, the lease
//! table and the schema-version table, `{write_fn}` and `{remove_fn}` for those of the fenced
//! functions (migration 6); [`Statements::new`] substitutes them once per store.
//! Table names are validated to `[A-Za-z_][A-Za-z0-9_]*` before they get here, so the
//! substitution can never escape the quotes. Every value is a bind parameter.
//!
//! All expiry arithmetic uses the database clock (`clock_timestamp()`), never the local one.
//!
//! Each statement with parameters has a `*_TYPES` constant beside it: the types of `$1`, `$2`,
//! ... in order. Behind a transaction pooler a statement runs unnamed, and the driver must then
//! send those types itself (see `PoolMode::Transaction`, in src/session.rs).

use tokio_postgres::types::Type;

use crate::keys::TableName;

/// Class key for `pg_advisory_xact_lock(class, object)`: the ASCII bytes "pgfe".
///
/// The two-key form keeps pgfence's locks apart from an application's one-key advisory locks.
/// The object key is `hashtext` of the table name, so setups of different tables never wait on
/// each other.
pub(crate) const SETUP_LOCK_CLASS: i32 = 0x7067_6665;

/// Serializes concurrent setups of one table. Transaction-scoped: released at commit or
/// rollback, on the connection that took it. So it is safe on a pooled connection. A
/// session-scoped lock is not: see the design notes. `$2` is the schema (NULL: the schema an
/// unqualified name is created in), so `t` and `public.t` take the same lock.
pub(crate) const SETUP_LOCK: &str = r#"
SELECT pg_advisory_xact_lock($1::int,
    hashtext(coalesce($2::text, current_schema()) || '.' || $3::text))"#;
pub(crate) const SETUP_LOCK_TYPES: &[Type] = &[Type::INT4, Type::TEXT, Type::TEXT];

/// The schema a table name resolves to, by the rule of [`SETUP_LOCK`]. That is the one given
/// (`$1`). For an unqualified name, it is the one the table is created in, `current_schema()`.
/// That is the first existing schema on the session's `search_path`, not always `public`. It
/// is NULL when the `search_path` names no existing schema. The NOTIFY channel is named from it
/// (see [`notify_channel`]).
pub(crate) const TABLE_SCHEMA: &str = "SELECT coalesce($1::text, current_schema())";
pub(crate) const TABLE_SCHEMA_TYPES: &[Type] = &[Type::TEXT];

/// First in the setup transaction. A `statement_timeout` or `lock_timeout` in the connection's
/// options is meant for the application's operations, not the setup. See docs/design.md,
/// section "Statement timeouts". Its commit is durable as a write's is (see [`WRITE`]): an
/// acquisition lost in a crash would hand its fencing token out again.
pub(crate) const SETUP_TIMEOUTS: &str = "SET LOCAL statement_timeout = 0; \
     SET LOCAL lock_timeout = 0; \
     SELECT set_config('synchronous_commit', CASE current_setting('synchronous_commit') \
         WHEN 'remote_apply' THEN 'remote_apply' ELSE 'on' END, true)";

/// Next in the setup transaction. The server ends the session if it is left idle in the
/// transaction for one TTL (`$1`, in milliseconds, as text).
///
/// Its client may be paused, or gone without a trace, cut off by a partition. The server
/// notices a vanished client only through TCP keepalives, after hours by default (see
/// docs/design.md, section "A partition"). Meanwhile the session would hold the setup lock,
/// which every `open()` of the table waits for. Once it has taken the lease, it would hold the
/// lease row too. So it holds up a failover at most about one TTL, as a holder cut off does.
pub(crate) const SETUP_IDLE_TIMEOUT: &str =
    "SELECT set_config('idle_in_transaction_session_timeout', $1, true)";
pub(crate) const SETUP_IDLE_TIMEOUT_TYPES: &[Type] = &[Type::TEXT];

/// Around the migrations, which may lock the KV table (`ACCESS EXCLUSIVE`). While they wait for
/// that lock, every other reader of the table queues behind them. So the connection's own
/// `lock_timeout`, if it has one, bounds that wait again, as the application asked. `DEFAULT`
/// is the session's value before any `SET`, i.e. the one from the connection's options.
pub(crate) const MIGRATION_TIMEOUTS: &str = "SET LOCAL lock_timeout TO DEFAULT";

/// Run once on every connection the store opens itself, right after connecting: pool, lease
/// renewal, a standby's LISTEN. Not behind a transaction pooler (`PoolMode::Transaction`).
/// Every later statement on it runs at read committed. That holds whatever
/// `default_transaction_isolation` the database, the role or the connection's options set.
///
/// Each fenced mutation and renewal is a transaction of one statement. Only read committed
/// re-reads the lease row when it was changed after the statement's snapshot. Under
/// repeatable read or serializable, a serialization failure (SQLSTATE 40001) comes instead. The
/// store cannot tell that from any other database error. See docs/design.md, section
/// "Isolation".
///
/// It is a `SET` rather than a `-c` startup option. By default, PgBouncer refuses startup
/// options it does not track, this one included.
///
/// It also makes every commit on the session wait for its WAL flush: `synchronous_commit` is
/// `on` for the session, whatever the role, the database or the connection's options say. A
/// stronger `remote_apply` is kept. A session setting, not one per statement: on the store's
/// own session nobody else can change it, so it is made once and costs nothing per write.
pub(crate) const READ_COMMITTED: &str = "SET SESSION CHARACTERISTICS AS TRANSACTION ISOLATION LEVEL READ COMMITTED; \
     SELECT set_config('synchronous_commit', CASE current_setting('synchronous_commit') \
         WHEN 'remote_apply' THEN 'remote_apply' ELSE 'on' END, false)";

/// The renewal thread's session: [`READ_COMMITTED`], with its synchronous commit. It is set
/// also on a connection taken from a pool passed to `builder_from_pool`. The renewal thread
/// keeps that connection for good, so its session is the store's own. Not behind a transaction
/// pooler, where no session is.
///
/// Renewals commit synchronously. They once committed with `synchronous_commit = off`, to keep
/// their latency off the writers' WAL flushes. But under Patroni's synchronous mode, an old
/// leader cut off from its cluster (its Patroni killed) kept confirming renewals while every
/// write there waited for a synchronous standby that was gone: the store reported `Held` beside
/// its successor. A renewal that waits like the writes lets the local deadline pass, and the
/// store fails closed (tests/patroni.rs, the synchronous split brain).
pub(crate) const RENEWAL_SESSION: &str = READ_COMMITTED;

/// Whether a (quoted, possibly qualified) table exists: its name, or NULL.
pub(crate) const TABLE_EXISTS: &str = "SELECT to_regclass($1)::text";
pub(crate) const TABLE_EXISTS_TYPES: &[Type] = &[Type::TEXT];

/// Whether the schema named `$1` (as given, case kept) exists.
///
/// The setup creates a table's schema only when it does not. PostgreSQL checks the privilege to
/// create schemas in the database before it looks whether one exists. So `CREATE SCHEMA IF NOT
/// EXISTS` of an existing schema fails for a role that may use the schema but not create
/// schemas. That is the usual least-privilege setup, with the schema made by an administrator.
pub(crate) const SCHEMA_EXISTS: &str =
    "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_namespace WHERE nspname = $1)";
pub(crate) const SCHEMA_EXISTS_TYPES: &[Type] = &[Type::TEXT];

pub(crate) const CREATE_SCHEMA: &str = "CREATE SCHEMA IF NOT EXISTS {schema}";

pub(crate) const CREATE_VERSION_TABLE: &str = r#"
CREATE TABLE IF NOT EXISTS {version} (
    version    INT         PRIMARY KEY,
    applied_at TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp()
)"#;

pub(crate) const SCHEMA_VERSION: &str = "SELECT coalesce(max(version), 0) FROM {version}";

pub(crate) const RECORD_VERSION: &str = "INSERT INTO {version} (version) VALUES ($1)";
pub(crate) const RECORD_VERSION_TYPES: &[Type] = &[Type::INT4];

/// Takes the lease if the row is absent or expired; returns the new epoch, or no row when the
/// lease is held.
///
/// Two steps in one statement, sharing one snapshot. `created` inserts the row if there is
/// none; `DO NOTHING` never locks an existing row. Otherwise `taken` updates it if expired.
///
/// A plain UPDATE locks only rows that pass its WHERE, so a failed attempt leaves the holder's
/// row unlocked. `ON CONFLICT DO UPDATE ... WHERE` would lock the row even when the WHERE
/// fails. A paused standby would then block the holder's writes and renewal until its
/// transaction ended.
///
/// Changing `owner_id`, a key column, takes a FOR UPDATE row lock. So the update waits for
/// every in-flight mutation of the previous owner (FOR KEY SHARE) to commit: that is the fence.
/// After that wait, PostgreSQL re-checks the WHERE against the latest row version. But it keeps
/// the new row it computed before the wait, since a lock alone does not change the row. The
/// expiry is then short by the wait, and already past if the wait was longer than the TTL.
/// [`RESTART_EXPIRY`] follows in the same transaction.
///
/// The new epoch is the old one plus one, but at least `floor`: the server's timeline minus one,
/// times 2^40. A promoted replica starts a new timeline. Under asynchronous replication it may
/// have lost the last acquisitions of the old primary, and with them their epochs. Those were
/// all below the new floor, so no epoch is ever given out twice. On timeline 1 the floor is 0,
/// and epochs count 1, 2, 3. The timeline is the first 8 hex digits of the current WAL file's
/// name; any role may call both functions. See docs/deployments.md, section "Replication".
pub(crate) const ACQUIRE: &str = r#"
WITH timeline AS (
    SELECT (('x' || substr(pg_walfile_name(pg_current_wal_lsn()), 1, 8))::bit(32)::bigint - 1)
           << 40 AS floor
), created AS (
    INSERT INTO {lease}
           (id, owner_id, epoch, expires_at, acquired_at, holder_host, holder_pid, holder_app)
    VALUES (1, $1, greatest(1, (SELECT floor FROM timeline)),
            clock_timestamp() + $2::bigint * interval '1 millisecond',
            clock_timestamp(), $3, $4, $5)
    ON CONFLICT (id) DO NOTHING
    RETURNING epoch
), taken AS (
    UPDATE {lease}
       SET owner_id    = $1,
           epoch       = greatest(epoch + 1, (SELECT floor FROM timeline)),
           expires_at  = clock_timestamp() + $2::bigint * interval '1 millisecond',
           acquired_at = clock_timestamp(),
           holder_host = $3,
           holder_pid  = $4,
           holder_app  = $5
     WHERE id = 1 AND expires_at <= clock_timestamp() AND NOT EXISTS (SELECT 1 FROM created)
    RETURNING epoch
)
SELECT epoch FROM created UNION ALL SELECT epoch FROM taken"#;
pub(crate) const ACQUIRE_TYPES: &[Type] =
    &[Type::UUID, Type::INT8, Type::TEXT, Type::INT4, Type::TEXT];

/// Right after [`ACQUIRE`], in its transaction: counts the new lease's TTL (and its
/// acquisition time) from now, after any wait at the fence. The row is ours and locked by the
/// uncommitted acquisition, so this never waits, and no one else can have seen the short expiry.
pub(crate) const RESTART_EXPIRY: &str = r#"
UPDATE {lease}
   SET expires_at  = clock_timestamp() + $2::bigint * interval '1 millisecond',
       acquired_at = clock_timestamp()
 WHERE id = 1 AND owner_id = $1
RETURNING epoch"#;
pub(crate) const RESTART_EXPIRY_TYPES: &[Type] = &[Type::UUID, Type::INT8];

/// Who holds the lease and for how long still (milliseconds, by the database clock; negative
/// when expired). No row: the lease was never taken.
pub(crate) const HOLDER: &str = r#"
SELECT owner_id, epoch, holder_host, holder_pid, holder_app,
       (extract(epoch FROM expires_at - clock_timestamp()) * 1000)::bigint AS expires_in_ms,
       expires_at > clock_timestamp() AS active
  FROM {lease}
 WHERE id = 1"#;

/// Extends our lease. It changes only `expires_at`, not a key column. So it takes a FOR NO KEY
/// UPDATE row lock, which does not conflict with the writers' FOR KEY SHARE. Heavy write traffic
/// therefore cannot starve renewal. No row means the lease is no longer ours, or already
/// expired, which must not be resurrected. `$1` is every owner id of this store (see
/// [`CHANGE_OWNER`]).
pub(crate) const RENEW: &str = r#"
UPDATE {lease}
   SET expires_at = clock_timestamp() + $2::bigint * interval '1 millisecond'
 WHERE id = 1 AND owner_id = ANY($1::uuid[]) AND expires_at > clock_timestamp()
RETURNING epoch"#;
pub(crate) const RENEW_TYPES: &[Type] = &[Type::UUID_ARRAY, Type::INT8];

/// Gives the lease up by owner id (`$1`: every owner id of this store): a stale store can never
/// release its successor's lease. Expires the row now and keeps the epoch counter. `pg_notify`
/// (delivered at commit) wakes standbys listening on the table's channel.
pub(crate) const RELEASE: &str = r#"
WITH released AS (
    UPDATE {lease}
       SET expires_at = clock_timestamp()
     WHERE id = 1 AND owner_id = ANY($1::uuid[]) AND expires_at > clock_timestamp()
    RETURNING epoch
)
SELECT epoch, pg_notify($2, epoch::text) FROM released"#;
pub(crate) const RELEASE_TYPES: &[Type] = &[Type::UUID_ARRAY, Type::TEXT];

/// The store's self-fence: writes a new owner id (`$2`) in place of any of the store's own
/// (`$1`), keeping the epoch. No row: the lease is no longer ours.
///
/// A statement whose connection broke may still be running on the server, or still be on its
/// way there, and commit after a retry. Changing `owner_id`, a key column, does to it what a
/// takeover does to a former holder's writes. It waits for every statement that holds the
/// lease row FOR KEY SHARE, so those have committed or rolled back when it commits. Any
/// statement that locks the row after that re-reads it (read committed), finds another owner
/// id, and writes nothing. So after this, nothing sent with an earlier id can land. That needs
/// no server process id, so it holds behind a transaction pooler too.
pub(crate) const CHANGE_OWNER: &str = r#"
UPDATE {lease}
   SET owner_id = $2
 WHERE id = 1 AND owner_id = ANY($1::uuid[]) AND expires_at > clock_timestamp()
RETURNING epoch"#;
pub(crate) const CHANGE_OWNER_TYPES: &[Type] = &[Type::UUID_ARRAY, Type::UUID];

/// Makes every deferred mutation committed before it durable ([`deferred`]), and says
/// whether the server lost any since the crash marker was written. `$1`: every owner id of this
/// store. `$2`: the store's token in the crash marker. `$3`: the token to write if it is gone.
///
/// `flushed` is a fenced no-op update of the lease row by owner id, committed durably. Its
/// commit waits for the WAL flush up to its own commit record, like any durable commit. That
/// record follows the commit record of every transaction that committed before it began. So once
/// it is flushed, they are too. Under synchronous replication it waits for the standby up to
/// there as well. A transaction that wrote no WAL would not do: PostgreSQL commits it without
/// waiting for any flush, whatever `synchronous_commit` says. This one writes a new version of
/// the row, so it does.
///
/// `marker` reads the crash marker, an UNLOGGED table (migrations/0005_crash_marker.sql). Every
/// crash recovery empties it, and a promoted standby starts with it empty. The store wrote `$2`
/// into it when it took the lease ([`SET_CRASH_MARKER`]), before any deferred commit of its own.
/// So `kept` false means the server crashed or failed over since: deferred commits before that
/// may be lost, and this flush cannot vouch for them. `renewed` then writes `$3`, in this
/// transaction, so that deferred commits after it are covered again. A retry of this statement
/// after a lost answer still carries `$2`, so it still sees the loss.
///
/// It returns one row: `held` (the lease is ours; if not, nothing was written) and `kept`. All
/// CTEs share one snapshot, so `marker` reads the row as it was before `renewed`.
///
/// It needs `SELECT, UPDATE` on the lease table and `SELECT, INSERT, UPDATE` on the crash
/// marker, unlike `pg_logical_emit_message`, which is for superusers by default. It changes no
/// key column of the lease row, so it takes a FOR NO KEY UPDATE row lock, like [`RENEW`]: the
/// writers' FOR KEY SHARE does not block it. It writes `expires_at` back unchanged: it neither
/// extends nor shortens the lease.
pub(crate) const FLUSH: &str = r#"
WITH flushed AS (
    UPDATE {lease}
       SET expires_at = expires_at
     WHERE id = 1 AND owner_id = ANY($1::uuid[]) AND expires_at > clock_timestamp()
    RETURNING epoch
), marker AS (
    SELECT EXISTS (SELECT 1 FROM {crash_marker} WHERE id = 1 AND token = $2) AS kept
), renewed AS (
    INSERT INTO {crash_marker} (id, token)
    SELECT 1, $3 FROM flushed, marker WHERE NOT marker.kept
    ON CONFLICT (id) DO UPDATE SET token = EXCLUDED.token
)
SELECT EXISTS (SELECT 1 FROM flushed) AS held, marker.kept FROM marker"#;
pub(crate) const FLUSH_TYPES: &[Type] = &[Type::UUID_ARRAY, Type::UUID, Type::UUID];

/// Writes the store's token into the crash marker ([`FLUSH`] has what it is for). Run in the
/// setup transaction, after the lease is taken: so it is fenced like the acquisition, and it
/// precedes every deferred commit of the store. `$1`: the token.
pub(crate) const SET_CRASH_MARKER: &str = r#"
INSERT INTO {crash_marker} (id, token) VALUES (1, $1)
ON CONFLICT (id) DO UPDATE SET token = EXCLUDED.token"#;
pub(crate) const SET_CRASH_MARKER_TYPES: &[Type] = &[Type::UUID];

/// Begins the transaction of a statement that writes the lease row where the store does not own
/// the session: behind a transaction pooler, or on a pool passed in. A session setting there is
/// a neighbour's, or the application's: `default_transaction_isolation` may say serializable.
/// Sent in one round trip with the statement and [`COMMIT`] (pipelined). See [`WRITE`] for why
/// read committed.
///
/// It also sets `synchronous_commit` to `on` for the transaction only (`set_config(..., true)`),
/// which its `COMMIT` then obeys: `Ok` means durable whatever the session says. A stronger
/// `remote_apply` is kept. Its `SELECT` is parsed and planned every time (a simple query): about
/// 45 µs of server time, measured by `scripts/pin_cost.sh`. So fenced mutations, which run
/// often, use [`BEGIN_READ_COMMITTED_ONLY`] and pin their commit themselves ([`pinned`]); the
/// renewal, the release, the fence's change of owner id and the flush use this.
pub(crate) const BEGIN_READ_COMMITTED: &str = "BEGIN ISOLATION LEVEL READ COMMITTED; \
     SELECT set_config('synchronous_commit', CASE current_setting('synchronous_commit') \
         WHEN 'remote_apply' THEN 'remote_apply' ELSE 'on' END, true)";

/// [`BEGIN_READ_COMMITTED`] without its `SELECT`: for a fenced mutation that sets
/// `synchronous_commit` for its transaction itself ([`pinned`], [`deferred`]). A utility
/// statement, not planned.
pub(crate) const BEGIN_READ_COMMITTED_ONLY: &str = "BEGIN ISOLATION LEVEL READ COMMITTED";

pub(crate) const COMMIT: &str = "COMMIT";

/// The fenced write: one statement, one round trip. The `lease` CTE share-locks our lease row
/// (FOR KEY SHARE) only if we own it and it has not expired. The lock is held until commit, so
/// a takeover waits for this statement. `valid` checks the expiry again once the lock is
/// granted. The lock may have waited for a transaction that then rolled back, leaving the row
/// unchanged. PostgreSQL then does not re-evaluate `lease`'s WHERE, and the lease may have
/// expired meanwhile. The insert reads from `valid`, so it writes nothing when the lease is gone.
/// Returns whether the lease was held (false: nothing was written).
///
/// It commits with at least `synchronous_commit = on`, whatever the role, the database or the
/// connection's options say: the store's own sessions are set so ([`READ_COMMITTED`]).
/// Elsewhere its [`pinned`] form sets it for the transaction, after
/// [`BEGIN_READ_COMMITTED_ONLY`], or its function ([`WRITE_CALL`]) sets it. So does every
/// fenced mutation ([`REMOVE`], [`BATCH`], [`BATCH_PUT`]).
///
/// It runs at read committed: only that level re-reads the lease row after waiting for its
/// lock. Under repeatable read or serializable the lock fails with a serialization error
/// (40001) when a renewal changed the row since the snapshot, and the store cannot tell that
/// from any other error. The store's own sessions are set to read committed
/// ([`READ_COMMITTED`]); elsewhere the statement runs after [`BEGIN_READ_COMMITTED_ONLY`], or
/// its function ([`WRITE_CALL`]) checks the level first.
pub(crate) const WRITE: &str = r#"
WITH lease AS (
    SELECT epoch, expires_at FROM {lease}
     WHERE id = 1 AND owner_id = $1 AND expires_at > clock_timestamp()
       FOR KEY SHARE
), valid AS (
    SELECT epoch FROM lease WHERE expires_at > clock_timestamp()
), written AS (
    INSERT INTO {kv} (primary_namespace, secondary_namespace, key, value, epoch)
    SELECT $2, $3, $4, $5, valid.epoch FROM valid
    ON CONFLICT (primary_namespace, secondary_namespace, key)
    DO UPDATE SET value = EXCLUDED.value, epoch = EXCLUDED.epoch
)
SELECT EXISTS (SELECT 1 FROM valid)"#;
pub(crate) const WRITE_TYPES: &[Type] =
    &[Type::UUID, Type::TEXT, Type::TEXT, Type::TEXT, Type::BYTEA];

/// A fenced mutation ([`WRITE`], [`REMOVE`], [`BATCH`], [`BATCH_PUT`]) committed without waiting
/// for its WAL flush (`write_deferred`, `remove_deferred`, `Batch::commit_deferred`, and
/// coalesced groups of deferred mutations only): the statement with one more CTE, [`DEFERRED`].
///
/// It sets `synchronous_commit` to `off` for this transaction only (`set_config(..., true)`):
/// the commit then returns before its WAL reaches the disk. The setting ends with the
/// transaction, so the session's next statement commits durably again. Where the store does not
/// own the session, it runs after [`BEGIN_READ_COMMITTED_ONLY`], which sets nothing.
///
/// PostgreSQL does not run a `SELECT` CTE that nothing reads. So the final `SELECT` reads from
/// `deferred`: its one row must be computed, and with it the `set_config`. When in the statement
/// that happens does not matter: the commit reads the setting after the statement.
///
/// Fencing is unchanged: the lease CTEs are the statement's own. So is the order of commits: the
/// WAL is replayed in order, so after a crash the commits that survive are the first ones. A later
/// durable commit, or [`FLUSH`], makes every earlier one durable.
pub(crate) fn deferred(mutation: &str) -> String {
    ending(mutation, DEFERRED)
}

/// A fenced mutation ([`WRITE`], [`REMOVE`], [`BATCH`], [`BATCH_PUT`]) for a session the store
/// does not own, run after [`BEGIN_READ_COMMITTED_ONLY`]: the statement with one more CTE,
/// [`PINNED`]. It sets `synchronous_commit` for its transaction as [`BEGIN_READ_COMMITTED`]
/// does: at least `on`, a session's `remote_apply` kept. Its commit obeys it.
///
/// Inside the statement the pin costs next to nothing: planned with the statement (once per
/// connection where statements are prepared). As a `SELECT` of its own in the `BEGIN` message it
/// cost about 45 µs of server time per statement, 3.5% of a write at a 1.2 ms round trip
/// (`scripts/pin_cost.sh`, `simple-pinned` against `simple-cte`). Read by the final `SELECT`, as
/// [`deferred`]'s CTE is, or PostgreSQL would not run it.
pub(crate) fn pinned(mutation: &str) -> String {
    ending(mutation, PINNED)
}

/// `mutation` with `end` in place of its [`FENCED_END`].
fn ending(mutation: &str, end: &str) -> String {
    let tail = mutation.rfind(FENCED_END).filter(|at| at + FENCED_END.len() == mutation.len());
    let at = tail.expect("a fenced mutation ends in its lease check");
    format!("{}{end}", &mutation[..at])
}

/// How every fenced mutation ends: the last CTE closes, and the statement answers whether the
/// lease was valid.
const FENCED_END: &str = "\n)\nSELECT EXISTS (SELECT 1 FROM valid)";

/// What [`deferred`] puts in place of [`FENCED_END`].
const DEFERRED: &str = r#"
), deferred AS (
    SELECT set_config('synchronous_commit', 'off', true)
)
SELECT EXISTS (SELECT 1 FROM valid) FROM deferred"#;

/// What [`pinned`] puts in place of [`FENCED_END`].
const PINNED: &str = r#"
), pinned AS (
    SELECT set_config('synchronous_commit', CASE current_setting('synchronous_commit')
        WHEN 'remote_apply' THEN 'remote_apply' ELSE 'on' END, true)
)
SELECT EXISTS (SELECT 1 FROM valid) FROM pinned"#;

/// The fenced remove, shaped like [`WRITE`]: the delete joins the `valid` CTE, so it removes
/// nothing when the lease is gone. Removing a missing key is not an error.
pub(crate) const REMOVE: &str = r#"
WITH lease AS (
    SELECT epoch, expires_at FROM {lease}
     WHERE id = 1 AND owner_id = $1 AND expires_at > clock_timestamp()
       FOR KEY SHARE
), valid AS (
    SELECT epoch FROM lease WHERE expires_at > clock_timestamp()
), removed AS (
    DELETE FROM {kv} USING valid
     WHERE primary_namespace = $2 AND secondary_namespace = $3 AND key = $4
)
SELECT EXISTS (SELECT 1 FROM valid)"#;
pub(crate) const REMOVE_TYPES: &[Type] = &[Type::UUID, Type::TEXT, Type::TEXT, Type::TEXT];

/// [`WRITE`] as one call of the table's function (migration 6), for a store that does not own
/// its server sessions: behind a transaction pooler, or on a pool passed in. Unnamed there, a
/// plain [`WRITE`] is parsed and planned on every execution. The function's statements are
/// planned once per server session instead, across the clients a pooler hands it to.
///
/// One statement, no `BEGIN` or `COMMIT`: its implicit transaction commits when it ends. The
/// function pins what [`BEGIN_READ_COMMITTED`] pins. It sets `synchronous_commit` for the
/// transaction, from its last argument: `'on'` keeps a session's `remote_apply` as
/// [`BEGIN_READ_COMMITTED`] does; `'off'` would commit asynchronously. It cannot set the
/// isolation level of the transaction it runs in. So it fails with [`NOT_READ_COMMITTED`] at
/// any other level, before it changes anything, and the store runs [`WRITE`] in
/// [`BEGIN_READ_COMMITTED`] instead. Otherwise it returns what [`WRITE`] returns.
pub(crate) const WRITE_CALL: &str = "SELECT {write_fn}($1, $2, $3, $4, $5, 'on')";

/// [`REMOVE`] as one call of the table's function: see [`WRITE_CALL`].
pub(crate) const REMOVE_CALL: &str = "SELECT {remove_fn}($1, $2, $3, $4, 'on')";

/// The SQLSTATE of the functions of [`WRITE_CALL`] and [`REMOVE_CALL`] in a transaction that
/// is not at read committed (class `PF`, which PostgreSQL does not use). They raise it before
/// they change anything.
pub(crate) const NOT_READ_COMMITTED: &str = "PF001";

/// The fenced atomic batch, shaped like [`WRITE`]: one statement, one round trip, one fence
/// check for every operation. `$2..$5` are the puts (namespaces, keys, values) and `$6..$8` the
/// removes, as parallel arrays; `unnest` zips them into rows.
///
/// Both data-modifying CTEs read the one `valid` CTE. `lease` is materialized once, so the
/// lease row is share-locked once. `valid` re-checks the expiry after the lock. So nothing is
/// written or deleted when the lease is gone. The caller passes each key at most once across
/// both lists, since a row may be changed only once per statement.
///
/// The removes' arrays are read through scalar subqueries, `(SELECT $6::text[])`, so that
/// PostgreSQL cannot see their length while planning. It estimates `unnest` of a plain
/// parameter at the array's real length in a custom plan, and at 10 rows in the generic one.
/// The delete's join costs in proportion. Take a table of 100,000 keys and fewer than
/// about ten removes. The generic plan then always looked costlier, and the statement was
/// planned afresh on every execution. That cost 0.15-0.25 ms each time, measured with three
/// puts and one remove.
/// Behind the subqueries both estimates are the same, so after five executions the statement
/// is planned once per connection. That plan looks up each remove in the primary key, which
/// is what the custom plans of small remove lists did too.
pub(crate) const BATCH: &str = r#"
WITH lease AS (
    SELECT epoch, expires_at FROM {lease}
     WHERE id = 1 AND owner_id = $1 AND expires_at > clock_timestamp()
       FOR KEY SHARE
), valid AS (
    SELECT epoch FROM lease WHERE expires_at > clock_timestamp()
), written AS (
    INSERT INTO {kv} (primary_namespace, secondary_namespace, key, value, epoch)
    SELECT p.primary_namespace, p.secondary_namespace, p.key, p.value, valid.epoch
      FROM valid,
           unnest($2::text[], $3::text[], $4::text[], $5::bytea[])
               AS p (primary_namespace, secondary_namespace, key, value)
    ON CONFLICT (primary_namespace, secondary_namespace, key)
    DO UPDATE SET value = EXCLUDED.value, epoch = EXCLUDED.epoch
), removed AS (
    DELETE FROM {kv} AS kv
     USING valid,
           unnest((SELECT $6::text[]), (SELECT $7::text[]), (SELECT $8::text[]))
               AS r (primary_namespace, secondary_namespace, key)
     WHERE kv.primary_namespace = r.primary_namespace
       AND kv.secondary_namespace = r.secondary_namespace
       AND kv.key = r.key
)
SELECT EXISTS (SELECT 1 FROM valid)"#;
pub(crate) const BATCH_TYPES: &[Type] = &[
    Type::UUID,
    Type::TEXT_ARRAY,
    Type::TEXT_ARRAY,
    Type::TEXT_ARRAY,
    Type::BYTEA_ARRAY,
    Type::TEXT_ARRAY,
    Type::TEXT_ARRAY,
    Type::TEXT_ARRAY,
];

/// [`BATCH`] without removes, for batches of puts only. That is the common case, and every
/// group of coalesced writes without a remove.
///
/// `BATCH` with empty remove arrays still sets up its delete on every execution. Measured side
/// by side on one connection, it took 10-120 µs longer per statement (medians, 8 and 100 puts
/// of 1 KiB). This statement's generic plan costs the same as its custom plans. So it is
/// planned once per connection after five executions.
pub(crate) const BATCH_PUT: &str = r#"
WITH lease AS (
    SELECT epoch, expires_at FROM {lease}
     WHERE id = 1 AND owner_id = $1 AND expires_at > clock_timestamp()
       FOR KEY SHARE
), valid AS (
    SELECT epoch FROM lease WHERE expires_at > clock_timestamp()
), written AS (
    INSERT INTO {kv} (primary_namespace, secondary_namespace, key, value, epoch)
    SELECT p.primary_namespace, p.secondary_namespace, p.key, p.value, valid.epoch
      FROM valid,
           unnest($2::text[], $3::text[], $4::text[], $5::bytea[])
               AS p (primary_namespace, secondary_namespace, key, value)
    ON CONFLICT (primary_namespace, secondary_namespace, key)
    DO UPDATE SET value = EXCLUDED.value, epoch = EXCLUDED.epoch
)
SELECT EXISTS (SELECT 1 FROM valid)"#;
pub(crate) const BATCH_PUT_TYPES: &[Type] =
    &[Type::UUID, Type::TEXT_ARRAY, Type::TEXT_ARRAY, Type::TEXT_ARRAY, Type::BYTEA_ARRAY];

pub(crate) const READ: &str = r#"
SELECT value FROM {kv}
 WHERE primary_namespace = $1 AND secondary_namespace = $2 AND key = $3"#;
pub(crate) const READ_TYPES: &[Type] = &[Type::TEXT, Type::TEXT, Type::TEXT];

pub(crate) const LIST: &str = r#"
SELECT key FROM {kv}
 WHERE primary_namespace = $1 AND secondary_namespace = $2
 ORDER BY key"#;
pub(crate) const LIST_TYPES: &[Type] = &[Type::TEXT, Type::TEXT];

/// One page, newest-created first. `$3` is the page token (the `created_seq` of the last key
/// of the previous page; `i64::MAX` for the first page), so deleting keys between pages never
/// shifts or repeats a page. Asks for one row more than a page to know whether another follows.
pub(crate) const LIST_PAGE: &str = r#"
SELECT key, created_seq FROM {kv}
 WHERE primary_namespace = $1 AND secondary_namespace = $2 AND created_seq < $3
 ORDER BY created_seq DESC
 LIMIT $4"#;
pub(crate) const LIST_PAGE_TYPES: &[Type] = &[Type::TEXT, Type::TEXT, Type::INT8, Type::INT8];

/// Whether the KV table has never had planner statistics (`$1`: its quoted name).
pub(crate) const NEVER_ANALYZED: &str = r#"
SELECT coalesce((SELECT last_analyze IS NULL AND last_autoanalyze IS NULL
                   FROM pg_stat_user_tables WHERE relid = to_regclass($1)), false)"#;
pub(crate) const NEVER_ANALYZED_TYPES: &[Type] = &[Type::TEXT];

/// Gathers the planner's statistics of the KV table.
pub(crate) const ANALYZE: &str = "ANALYZE {kv}";

pub(crate) const LIST_ALL: &str = r#"
SELECT primary_namespace, secondary_namespace, key FROM {kv}
 ORDER BY primary_namespace, secondary_namespace, key"#;

/// Every entry with its value, in the order of [`LIST_ALL`]: one statement, so one snapshot.
pub(crate) const ENTRIES: &str = r#"
SELECT primary_namespace, secondary_namespace, key, value FROM {kv}
 ORDER BY primary_namespace, secondary_namespace, key"#;

/// The server process serving this statement. Sent with the simple query protocol: it names
/// no prepared statement, which a pooler in transaction mode may not keep.
pub(crate) const BACKEND_PID: &str = "SELECT pg_backend_pid()";

/// A round trip and nothing else: whether a connection that was idle still answers. Simple
/// protocol, so no prepared statement.
pub(crate) const PING: &str = "SELECT 1";

/// Migrations, numbered from 1, embedded at build time. `{kv_created_index}` names an index
/// (unqualified: PostgreSQL puts it in the table's schema).
pub(crate) const MIGRATIONS: &[(i32, &str)] = &[
    (1, include_str!("../migrations/0001_init.sql")),
    (2, include_str!("../migrations/0002_pagination_index.sql")),
    (3, include_str!("../migrations/0003_kv_fillfactor.sql")),
    (4, include_str!("../migrations/0004_kv_key_collation.sql")),
    (5, include_str!("../migrations/0005_crash_marker.sql")),
    (6, include_str!("../migrations/0006_fenced_functions.sql")),
];

/// One statement of a store: its SQL, with the table names substituted, and the types of its
/// parameters (the `*_TYPES` constant beside its SQL).
#[derive(Debug, Clone)]
pub(crate) struct Statement {
    pub(crate) sql: String,
    pub(crate) types: &'static [Type],
}

/// The statements of one store, with its table names substituted.
#[derive(Debug, Clone)]
pub(crate) struct Statements {
    pub(crate) create_version_table: Statement,
    pub(crate) schema_version: Statement,
    pub(crate) record_version: Statement,
    pub(crate) acquire: Statement,
    pub(crate) restart_expiry: Statement,
    pub(crate) holder: Statement,
    pub(crate) renew: Statement,
    pub(crate) release: Statement,
    pub(crate) change_owner: Statement,
    pub(crate) flush: Statement,
    pub(crate) set_crash_marker: Statement,
    pub(crate) write: Statement,
    pub(crate) remove: Statement,
    pub(crate) write_call: Statement,
    pub(crate) remove_call: Statement,
    pub(crate) batch: Statement,
    pub(crate) batch_put: Statement,
    pub(crate) write_pinned: Statement,
    pub(crate) remove_pinned: Statement,
    pub(crate) batch_pinned: Statement,
    pub(crate) batch_put_pinned: Statement,
    pub(crate) write_deferred: Statement,
    pub(crate) remove_deferred: Statement,
    pub(crate) batch_deferred: Statement,
    pub(crate) batch_put_deferred: Statement,
    pub(crate) read: Statement,
    pub(crate) list: Statement,
    pub(crate) list_page: Statement,
    pub(crate) list_all: Statement,
    pub(crate) entries: Statement,
    pub(crate) analyze: Statement,
}

impl Statements {
    pub(crate) fn new(table: &TableName) -> Statements {
        let s = |sql: &str, types| Statement { sql: substitute(sql, table), types };
        Statements {
            create_version_table: s(CREATE_VERSION_TABLE, &[]),
            schema_version: s(SCHEMA_VERSION, &[]),
            record_version: s(RECORD_VERSION, RECORD_VERSION_TYPES),
            acquire: s(ACQUIRE, ACQUIRE_TYPES),
            restart_expiry: s(RESTART_EXPIRY, RESTART_EXPIRY_TYPES),
            holder: s(HOLDER, &[]),
            renew: s(RENEW, RENEW_TYPES),
            release: s(RELEASE, RELEASE_TYPES),
            change_owner: s(CHANGE_OWNER, CHANGE_OWNER_TYPES),
            flush: s(FLUSH, FLUSH_TYPES),
            set_crash_marker: s(SET_CRASH_MARKER, SET_CRASH_MARKER_TYPES),
            write: s(WRITE, WRITE_TYPES),
            remove: s(REMOVE, REMOVE_TYPES),
            write_call: s(WRITE_CALL, WRITE_TYPES),
            remove_call: s(REMOVE_CALL, REMOVE_TYPES),
            batch: s(BATCH, BATCH_TYPES),
            batch_put: s(BATCH_PUT, BATCH_PUT_TYPES),
            write_pinned: s(&pinned(WRITE), WRITE_TYPES),
            remove_pinned: s(&pinned(REMOVE), REMOVE_TYPES),
            batch_pinned: s(&pinned(BATCH), BATCH_TYPES),
            batch_put_pinned: s(&pinned(BATCH_PUT), BATCH_PUT_TYPES),
            write_deferred: s(&deferred(WRITE), WRITE_TYPES),
            remove_deferred: s(&deferred(REMOVE), REMOVE_TYPES),
            batch_deferred: s(&deferred(BATCH), BATCH_TYPES),
            batch_put_deferred: s(&deferred(BATCH_PUT), BATCH_PUT_TYPES),
            read: s(READ, READ_TYPES),
            list: s(LIST, LIST_TYPES),
            list_page: s(LIST_PAGE, LIST_PAGE_TYPES),
            list_all: s(LIST_ALL, &[]),
            entries: s(ENTRIES, &[]),
            analyze: s(ANALYZE, &[]),
        }
    }
}

/// Replaces the name placeholders with the quoted table names.
pub(crate) fn substitute(sql: &str, table: &TableName) -> String {
    let schema = table.schema.as_deref().unwrap_or("public");
    sql.replace("{kv_created_index}", &format!("\"{}_created_idx\"", table.name))
        .replace("{kv}", &table.quoted(""))
        .replace("{lease}", &table.quoted("_lease"))
        .replace("{version}", &table.quoted("_schema_version"))
        .replace("{crash_marker}", &table.quoted("_crash_marker"))
        .replace("{write_fn}", &table.quoted("_fenced_write"))
        .replace("{remove_fn}", &table.quoted("_fenced_remove"))
        .replace("{schema}", &format!("\"{schema}\""))
}

/// The NOTIFY channel a release signals on, for standbys to LISTEN to.
///
/// `schema` is the schema the table name resolved to ([`TABLE_SCHEMA`]). It is asked on the
/// session that notifies or listens. So every spelling of one table uses one channel:
///
/// - `t` and `public.t` both name `pgfence_t`, with `public` first on the `search_path`;
/// - `t` and `app.t` both name `pgfence_app.t`, with `app` first.
///
/// `public` is left out so that the channel of the common case, an unqualified name in
/// `public`, is the one earlier versions used too.
///
/// Channel names are identifiers, at most 63 bytes. A long name is shortened with a stable
/// hash. So is one with a character other than `[A-Za-z0-9_.]`. That is possible only in a
/// schema that a `search_path` named, never in a validated table name. This keeps the channel
/// safe to quote in `LISTEN "..."`.
pub(crate) fn notify_channel(table: &TableName, schema: Option<&str>) -> String {
    let name = match schema {
        Some(schema) if schema != "public" => format!("{schema}.{}", table.name),
        _ => table.name.clone(),
    };
    let plain = |c: char| c.is_ascii_alphanumeric() || c == '_' || c == '.';
    if name.len() <= 55 && name.chars().all(plain) {
        return format!("pgfence_{name}");
    }
    // FNV-1a: stable across builds and platforms (std's hasher is not).
    let hash = name.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    let prefix: String = name.chars().filter(|&c| plain(c)).take(38).collect();
    format!("pgfence_{prefix}_{hash:016x}")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The highest `$n` in `sql`: how many parameters it takes.
    fn parameters(sql: &str) -> usize {
        let mut highest = 0;
        for (i, _) in sql.match_indices('$') {
            let digits: String = sql[i + 1..].chars().take_while(|c| c.is_ascii_digit()).collect();
            highest = highest.max(digits.parse().unwrap_or(0));
        }
        highest
    }

    /// Each statement declares one type per parameter: an unnamed statement sends them all.
    #[test]
    fn every_parameter_has_a_type() {
        let fixed = [
            (SETUP_LOCK, SETUP_LOCK_TYPES),
            (TABLE_SCHEMA, TABLE_SCHEMA_TYPES),
            (SETUP_IDLE_TIMEOUT, SETUP_IDLE_TIMEOUT_TYPES),
            (TABLE_EXISTS, TABLE_EXISTS_TYPES),
            (SCHEMA_EXISTS, SCHEMA_EXISTS_TYPES),
            (NEVER_ANALYZED, NEVER_ANALYZED_TYPES),
        ];
        for (sql, types) in fixed {
            assert_eq!(parameters(sql), types.len(), "{sql}");
        }
        let s = Statements::new(&TableName::parse("t").unwrap());
        for statement in [
            &s.create_version_table,
            &s.schema_version,
            &s.record_version,
            &s.acquire,
            &s.restart_expiry,
            &s.holder,
            &s.renew,
            &s.release,
            &s.change_owner,
            &s.flush,
            &s.set_crash_marker,
            &s.write,
            &s.remove,
            &s.write_call,
            &s.remove_call,
            &s.batch,
            &s.batch_put,
            &s.write_pinned,
            &s.remove_pinned,
            &s.batch_pinned,
            &s.batch_put_pinned,
            &s.write_deferred,
            &s.remove_deferred,
            &s.batch_deferred,
            &s.batch_put_deferred,
            &s.read,
            &s.list,
            &s.list_page,
            &s.list_all,
            &s.entries,
            &s.analyze,
        ] {
            assert_eq!(parameters(&statement.sql), statement.types.len(), "{}", statement.sql);
        }
    }

    #[test]
    fn notify_channels() {
        let t = TableName::parse("node_state").unwrap();
        let public_t = TableName::parse("public.node_state").unwrap();
        let app_t = TableName::parse("app.node_state").unwrap();
        // Resolved to one schema, every spelling names one channel.
        for table in [&t, &public_t] {
            assert_eq!(notify_channel(table, Some("public")), "pgfence_node_state");
        }
        for table in [&t, &app_t] {
            assert_eq!(notify_channel(table, Some("app")), "pgfence_app.node_state");
        }
        assert_eq!(notify_channel(&t, None), "pgfence_node_state");
        // A long name: a prefix and a hash, as before resolution; 63 bytes, and distinct.
        let long = TableName::parse(&format!("{}.{}", "s".repeat(48), "t".repeat(48))).unwrap();
        let channel = notify_channel(&long, long.schema.as_deref());
        assert!(channel.starts_with(&format!("pgfence_{}_", &long.display()[..38])), "{channel}");
        assert_eq!(channel.len(), 63);
        assert_ne!(channel, notify_channel(&long, Some(&"s".repeat(47))));
        // Schema names a search_path may resolve to, which a channel must not carry as they are.
        for schema in ["my\"schema", "sch\u{e9}ma", &"\u{e9}".repeat(60)] {
            let channel = notify_channel(&t, Some(schema));
            assert!(channel.len() <= 63, "{channel}");
            assert!(channel.chars().all(|c| c.is_ascii_alphanumeric() || "_.".contains(c)));
            assert_ne!(channel, notify_channel(&t, Some("public")));
        }
    }
}
