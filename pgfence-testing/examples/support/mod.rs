//! What the criterion bench (`benches/write_latency.rs` of pgfence) and the bench commands
//! (`examples/bench.rs`, `examples/scale.rs`) share; each includes this file by `#[path]`. The
//! baselines the fenced write is compared with, as raw SQL on the store's own table, over a
//! pool configured like the store's.
#![allow(dead_code)] // Each user needs a different subset.

use std::fmt::Write as _;
use std::time::Duration;

use pgfence::PgKvStore;
use pgfence::deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use pgfence_testing::TestCluster;
use tokio_postgres::NoTls;

/// A boxed error: the benches only report failures, they do not recover from them.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The unfenced baseline: the same upsert as the fenced write, without the lease CTE.
pub const UNFENCED_UPSERT: &str = r#"
INSERT INTO {kv} (primary_namespace, secondary_namespace, key, value, epoch)
VALUES ($1, $2, $3, $4, $5)
ON CONFLICT (primary_namespace, secondary_namespace, key)
DO UPDATE SET value = EXCLUDED.value, epoch = EXCLUDED.epoch"#;

/// The unfenced baseline of a batch of puts: the store's batch statement for puts
/// (pgfence's `sql::BATCH_PUT`) without the lease CTE.
pub const UNFENCED_BATCH_PUT: &str = r#"
INSERT INTO {kv} (primary_namespace, secondary_namespace, key, value, epoch)
SELECT p.primary_namespace, p.secondary_namespace, p.key, p.value, $5
  FROM unnest($1::text[], $2::text[], $3::text[], $4::bytea[])
           AS p (primary_namespace, secondary_namespace, key, value)
ON CONFLICT (primary_namespace, secondary_namespace, key)
DO UPDATE SET value = EXCLUDED.value, epoch = EXCLUDED.epoch"#;

/// The store's fenced single-key write, exactly as `PgKvStore::write` runs it when its statement
/// is not shared (pgfence's `sql::WRITE`): the `solo` variant of the bench command.
pub const FENCED_WRITE: &str = r#"
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

/// [`FENCED_WRITE`] with a CTE that sets `synchronous_commit` for its transaction: the
/// `pinned` variant. The store pins it per session instead (pgfence's `sql::READ_COMMITTED`);
/// `pinned` against `solo` is what a pin in every statement would cost.
pub const FENCED_WRITE_PINNED: &str = r#"
WITH durable AS (
    SELECT set_config('synchronous_commit', CASE current_setting('synchronous_commit')
        WHEN 'remote_apply' THEN 'remote_apply' ELSE 'on' END, true)
), lease AS (
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
SELECT EXISTS (SELECT 1 FROM valid) FROM durable"#;

/// The naive design the fenced CTE replaced, first statement: check the lease by renewing it
/// (an `UPDATE` of the lease row that returns nothing when it is not ours), inside the
/// transaction of the write.
pub const NAIVE_RENEW: &str = r#"
UPDATE {lease}
   SET expires_at = clock_timestamp() + $2::bigint * interval '1 millisecond'
 WHERE id = 1 AND owner_id = $1 AND expires_at > clock_timestamp()
RETURNING epoch"#;

/// The naive design, second statement: the upsert, in the same transaction.
pub const NAIVE_UPSERT: &str = UNFENCED_UPSERT;

/// The lease renewal, exactly as the store's renewal task runs it (pgfence's `sql::RENEW`),
/// for timing renewals from outside while writers load the store.
pub const RENEW: &str = r#"
UPDATE {lease}
   SET expires_at = clock_timestamp() + $2::bigint * interval '1 millisecond'
 WHERE id = 1 AND owner_id = $1 AND expires_at > clock_timestamp()
RETURNING epoch"#;

/// The primary namespace every bench key lives in.
pub const NS: &str = "bench";
/// The secondary namespace every bench key lives in.
pub const SUB: &str = "kv";

/// A pool like the one the store builds for itself: same driver, same recycling, same size.
pub fn pool(config: tokio_postgres::Config, size: usize) -> Pool {
    let manager = Manager::from_config(
        config,
        NoTls,
        ManagerConfig { recycling_method: RecyclingMethod::Fast },
    );
    Pool::builder(manager)
        .max_size(size)
        .runtime(Runtime::Tokio1)
        .build()
        .expect("a pool from a valid configuration")
}

/// Substitutes the store's quoted table names (unqualified table names only).
pub fn sql(template: &str, table: &str) -> String {
    template
        .replace("{kv}", &format!("\"{table}\""))
        .replace("{lease}", &format!("\"{table}_lease\""))
}

/// The baselines on the store's table, through their own pool of the store's kind, with every
/// statement prepared once per connection (`prepare_cached`), as the store does.
#[derive(Debug, Clone)]
pub struct Baseline {
    pub pool: Pool,
    owner: uuid::Uuid,
    epoch: i64,
    ttl_ms: i64,
    unfenced: String,
    unfenced_batch: String,
    naive_renew: String,
    naive_upsert: String,
    renew: String,
    fenced: String,
    fenced_pinned: String,
}

impl Baseline {
    /// Baselines for `store` (whose table is `table`), over `pool`.
    pub fn new(store: &PgKvStore, table: &str, pool: Pool, ttl: Duration) -> Baseline {
        Baseline {
            pool,
            owner: store.owner_id(),
            epoch: store.fencing_token(),
            ttl_ms: ttl.as_millis() as i64,
            unfenced: sql(UNFENCED_UPSERT, table),
            unfenced_batch: sql(UNFENCED_BATCH_PUT, table),
            naive_renew: sql(NAIVE_RENEW, table),
            naive_upsert: sql(NAIVE_UPSERT, table),
            renew: sql(RENEW, table),
            fenced: sql(FENCED_WRITE, table),
            fenced_pinned: sql(FENCED_WRITE_PINNED, table),
        }
    }

    /// One unfenced upsert: a pooled connection, one prepared statement, one round trip.
    pub async fn unfenced(&self, key: &str, value: &[u8]) -> Result<(), BoxError> {
        let client = self.pool.get().await?;
        let statement = client.prepare_cached(&self.unfenced).await?;
        client.execute(&statement, &[&NS, &SUB, &key, &value, &self.epoch]).await?;
        Ok(())
    }

    /// One unfenced batch of puts (keys sorted, each at most once), like the store's batch
    /// statement without the lease check: one pooled connection, one round trip.
    pub async fn unfenced_batch(&self, puts: &[(String, Vec<u8>)]) -> Result<(), BoxError> {
        let client = self.pool.get().await?;
        let statement = client.prepare_cached(&self.unfenced_batch).await?;
        let (ns, sub) = (vec![NS; puts.len()], vec![SUB; puts.len()]);
        let keys: Vec<&str> = puts.iter().map(|(key, _)| key.as_str()).collect();
        let values: Vec<&[u8]> = puts.iter().map(|(_, value)| value.as_slice()).collect();
        client.execute(&statement, &[&ns, &sub, &keys, &values, &self.epoch]).await?;
        Ok(())
    }

    /// One fenced write in a statement of its own (the store's `WRITE`), with the store's owner
    /// id: one pooled connection, one prepared statement, one round trip.
    pub async fn fenced(&self, key: &str, value: &[u8]) -> Result<(), BoxError> {
        self.fenced_with(&self.fenced, key, value).await
    }

    /// [`Baseline::fenced`] with `synchronous_commit` pinned in the statement
    /// ([`FENCED_WRITE_PINNED`]).
    pub async fn fenced_pinned(&self, key: &str, value: &[u8]) -> Result<(), BoxError> {
        self.fenced_with(&self.fenced_pinned, key, value).await
    }

    async fn fenced_with(&self, sql: &str, key: &str, value: &[u8]) -> Result<(), BoxError> {
        let client = self.pool.get().await?;
        let statement = client.prepare_cached(sql).await?;
        let row = client.query_one(&statement, &[&self.owner, &NS, &SUB, &key, &value]).await?;
        if !row.get::<_, bool>(0) {
            return Err("fenced write: the lease is not ours".into());
        }
        Ok(())
    }

    /// One naive fenced write: `BEGIN`, renew-as-check, upsert, `COMMIT`: four round trips with
    /// prepared statements (six when each statement is also parsed, as in the design notes'
    /// measurement), and every writer serialized on the lease row's row lock.
    pub async fn naive(&self, key: &str, value: &[u8]) -> Result<(), BoxError> {
        let mut client = self.pool.get().await?;
        let renew = client.prepare_cached(&self.naive_renew).await?;
        let upsert = client.prepare_cached(&self.naive_upsert).await?;
        let tx = client.transaction().await?;
        let rows = tx.query(&renew, &[&self.owner, &self.ttl_ms]).await?;
        let Some(row) = rows.first() else {
            return Err("naive write: the lease is not ours".into());
        };
        let epoch: i64 = row.get(0);
        tx.execute(&upsert, &[&NS, &SUB, &key, &value, &epoch]).await?;
        tx.commit().await?;
        Ok(())
    }

    /// One lease renewal, as the store's renewal task does it, on a pooled connection of its
    /// own. Extends the store's lease by its own TTL, so it never changes what the store holds.
    pub async fn renew(&self) -> Result<(), BoxError> {
        let client = self.pool.get().await?;
        let statement = client.prepare_cached(&self.renew).await?;
        let rows = client.query(&statement, &[&self.owner, &self.ttl_ms]).await?;
        if rows.is_empty() {
            return Err("renewal: the lease is not ours".into());
        }
        Ok(())
    }
}

/// ldk-node's pattern: every operation on one connection behind a mutex, with the fenced
/// statement ([`FENCED_WRITE`]) sent as a SQL string. tokio-postgres then prepares it on every
/// call (Parse and Describe, one round trip) before it runs it (Bind and Execute, another): two
/// round trips, and a parse and plan on the server, per write. The `ldk-node` variant of the
/// bench command.
#[derive(Debug)]
pub struct OneConnection {
    client: tokio::sync::Mutex<tokio_postgres::Client>,
    owner: uuid::Uuid,
    fenced: String,
}

impl OneConnection {
    /// Connects to `config` and spawns the connection's task, which ends when this is dropped.
    pub async fn connect(
        config: &tokio_postgres::Config,
        store: &PgKvStore,
        table: &str,
    ) -> Result<OneConnection, BoxError> {
        let (client, connection) = config.connect(NoTls).await?;
        tokio::spawn(connection);
        Ok(OneConnection {
            client: tokio::sync::Mutex::new(client),
            owner: store.owner_id(),
            fenced: sql(FENCED_WRITE, table),
        })
    }

    /// One fenced write, unprepared, while holding the one connection.
    pub async fn fenced_unprepared(&self, key: &str, value: &[u8]) -> Result<(), BoxError> {
        let client = self.client.lock().await;
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 5] =
            [&self.owner, &NS, &SUB, &key, &value];
        let row = client.query_one(self.fenced.as_str(), &params).await?;
        if !row.get::<_, bool>(0) {
            return Err("fenced write: the lease is not ours".into());
        }
        Ok(())
    }

    /// Whether an operation holds the connection now (a statement is in flight).
    pub fn busy(&self) -> bool {
        self.client.try_lock().is_err()
    }
}

/// A value of `len` bytes (not all equal, so nothing compresses it away).
pub fn value(len: usize, seed: u64) -> Vec<u8> {
    (0..len as u64).map(|i| (i.wrapping_mul(31).wrapping_add(seed) % 251) as u8).collect()
}

/// Median and 99th percentile of sorted samples.
pub fn percentile(sorted: &[Duration], p: f64) -> Duration {
    if sorted.is_empty() {
        return Duration::ZERO;
    }
    let rank = ((p / 100.0) * (sorted.len() - 1) as f64).round() as usize;
    sorted[rank.min(sorted.len() - 1)]
}

/// The `main` of a bench command: `args` parsed (`None`: print the usage), then `run`.
/// Exits with 2 on bad arguments and 1 when `run` fails.
pub fn main<A>(
    name: &str,
    usage: &str,
    args: Result<Option<A>, String>,
    run: impl FnOnce(A) -> Result<(), BoxError>,
) {
    let args = match args {
        Ok(Some(args)) => args,
        Ok(None) => {
            println!("{usage}");
            return;
        }
        Err(message) => {
            eprintln!("{message}");
            std::process::exit(2);
        }
    };
    if cfg!(debug_assertions) {
        // A debug build's client-side overhead is many times a release build's.
        eprintln!("warning: a debug build; its figures are not the library's: use --release");
    }
    if let Err(e) = run(args) {
        eprintln!("{name} failed: {e}");
        std::process::exit(1);
    }
}

/// `s` as a JSON string literal, quoted and escaped.
pub fn json_str(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// The server a command measures: `database_url` if given, else a private cluster started
/// here. The cluster runs until the returned handle is dropped.
pub fn server(
    database_url: Option<&str>,
) -> Result<(tokio_postgres::Config, Option<TestCluster>), BoxError> {
    match database_url {
        Some(url) => Ok((url.parse::<tokio_postgres::Config>()?, None)),
        None => {
            eprintln!("starting a private PostgreSQL cluster ...");
            let cluster = TestCluster::start()?;
            Ok((cluster.config(), Some(cluster)))
        }
    }
}
