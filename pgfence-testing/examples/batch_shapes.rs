//! Why `batch_100` costs more than 3 single writes on a fast link: raw SQL, no pgfence code in
//! the timed path.
//!
//! On a table made by pgfence (its schema, 1,024 keys of 1 KiB), each round runs, on one plain
//! connection with prepared statements, one single-row upsert and 100-row updates of existing
//! keys in three statement shapes: `INSERT .. SELECT FROM unnest .. ON CONFLICT DO UPDATE` (the
//! store's batch statement without its lease check), `UPDATE .. FROM unnest`, and `MERGE`
//! (PostgreSQL 15 and later). Each runs twice per round: on its own (one round trip, committed at
//! once, as the store runs its statements), and in an explicit transaction, so that the
//! statement and its commit (the WAL flush) are timed apart. Every value differs from the key's
//! previous one in every byte, as in the benches. The variants take turns within each round;
//! medians are printed.
//!
//! `cargo run --release -p pgfence-testing --example batch_shapes -- [ROUNDS]` (default 300).
//! Uses `DATABASE_URL` when set, otherwise a temporary cluster that is stopped on exit.

use std::time::{Duration, Instant};

use pgfence::PgKvStore;
use pgfence_testing::{TestServer, unique_name};
use tokio_postgres::types::ToSql;
use tokio_postgres::{Client, Statement};

const KEYS: usize = 1024;
const BATCH: usize = 100;
const VALUE_SIZE: usize = 1024;
const WARMUP: usize = 10;

type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// The statement shapes; `$1..$4` are namespaces, keys and values (arrays for the batches).
const SHAPES: [(&str, &str); 4] = [
    (
        "single upsert",
        r#"INSERT INTO {kv} (primary_namespace, secondary_namespace, key, value, epoch)
           VALUES ($1, $2, $3, $4, 1)
           ON CONFLICT (primary_namespace, secondary_namespace, key)
           DO UPDATE SET value = EXCLUDED.value, epoch = EXCLUDED.epoch"#,
    ),
    (
        "100 rows: INSERT .. ON CONFLICT",
        r#"INSERT INTO {kv} (primary_namespace, secondary_namespace, key, value, epoch)
           SELECT p.ns, p.sub, p.key, p.value, 1
             FROM unnest($1::text[], $2::text[], $3::text[], $4::bytea[]) AS p (ns, sub, key, value)
           ON CONFLICT (primary_namespace, secondary_namespace, key)
           DO UPDATE SET value = EXCLUDED.value, epoch = EXCLUDED.epoch"#,
    ),
    (
        "100 rows: UPDATE .. FROM",
        r#"UPDATE {kv} AS kv SET value = p.value, epoch = 1
             FROM unnest($1::text[], $2::text[], $3::text[], $4::bytea[]) AS p (ns, sub, key, value)
            WHERE kv.primary_namespace = p.ns AND kv.secondary_namespace = p.sub
              AND kv.key = p.key"#,
    ),
    (
        "100 rows: MERGE",
        r#"MERGE INTO {kv} AS kv
           USING unnest($1::text[], $2::text[], $3::text[], $4::bytea[]) AS p (ns, sub, key, value)
              ON kv.primary_namespace = p.ns AND kv.secondary_namespace = p.sub AND kv.key = p.key
            WHEN MATCHED THEN UPDATE SET value = p.value, epoch = 1
            WHEN NOT MATCHED THEN INSERT (primary_namespace, secondary_namespace, key, value, epoch)
                 VALUES (p.ns, p.sub, p.key, p.value, 1)"#,
    ),
];

const USAGE: &str =
    "usage: batch_shapes [ROUNDS] (default 300; DATABASE_URL or a temporary cluster)";

#[tokio::main(flavor = "current_thread")]
async fn main() -> Result<(), BoxError> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let rounds: usize = match args.as_slice() {
        [] => 300,
        [flag] if flag == "-h" || flag == "--help" => {
            println!("{USAGE}");
            return Ok(());
        }
        [n] if n.parse::<usize>().is_ok_and(|n| n > 0) => n.parse()?,
        _ => {
            eprintln!("{USAGE}");
            std::process::exit(2);
        }
    };
    let server = TestServer::shared()?;
    let table = unique_name("shapes");
    // The store makes the table (every migration applied) and its keys, then steps aside.
    let store = PgKvStore::builder_from_config(server.config()).table(&table).open().await?;
    let mut batch = store.batch();
    for i in 0..KEYS {
        batch = batch.put("ns", "sub", &key(i), vec![0; VALUE_SIZE]);
    }
    batch.commit().await?;
    store.close().await?;

    let client = server.connect().await?;
    client.batch_execute(&format!("ANALYZE \"{table}\"")).await?;
    let mut statements = Vec::new();
    for (name, sql) in SHAPES {
        statements
            .push((name, client.prepare(&sql.replace("{kv}", &format!("\"{table}\""))).await?));
    }

    let mut samples = vec![Samples::default(); SHAPES.len()];
    let mut fill = 0u8;
    for round in 0..rounds + WARMUP {
        for (shape, (name, statement)) in statements.iter().enumerate() {
            let rows = if shape == 0 { 1 } else { BATCH };
            let first = (round * BATCH + shape) % KEYS;
            let mut keys: Vec<String> = (0..rows).map(|i| key((first + i) % KEYS)).collect();
            keys.sort();
            let (ns, sub) = (vec!["ns"; rows], vec!["sub"; rows]);
            let mut next_values = || {
                fill = fill.wrapping_add(1);
                vec![vec![fill; VALUE_SIZE]; rows]
            };
            let (first_values, second_values) = (next_values(), next_values());
            let sample = timed(
                &client,
                statement,
                &params(&ns, &sub, &keys, &first_values),
                &params(&ns, &sub, &keys, &second_values),
            )
            .await
            .map_err(|e| format!("{name}: {e}"))?;
            if round >= WARMUP {
                samples[shape].push(sample);
            }
        }
    }

    let single = median(&mut samples[0].alone);
    println!("{rounds} rounds, medians in µs. alone: one round trip, committed at once.");
    println!("In a transaction: the statement, then its COMMIT (a round trip each).");
    println!(
        "{:<34} {:>8} {:>10} {:>14} {:>10}",
        "shape", "alone", "÷ single", "in a tx: stmt", "commit"
    );
    for ((name, _), s) in statements.iter().zip(samples.iter_mut()) {
        let alone = median(&mut s.alone);
        println!(
            "{name:<34} {alone:>8.0} {:>9.2}x {:>14.0} {:>10.0}",
            alone / single,
            median(&mut s.statement),
            median(&mut s.commit)
        );
    }
    client
        .batch_execute(&format!(
            "DROP TABLE \"{table}\", \"{table}_lease\", \
             \"{table}_schema_version\", \"{table}_crash_marker\""
        ))
        .await?;
    Ok(())
}

#[derive(Debug, Clone, Default)]
struct Samples {
    alone: Vec<Duration>,
    statement: Vec<Duration>,
    commit: Vec<Duration>,
}

impl Samples {
    fn push(&mut self, (alone, statement, commit): (Duration, Duration, Duration)) {
        self.alone.push(alone);
        self.statement.push(statement);
        self.commit.push(commit);
    }
}

/// The four parameters: scalars for a single row, arrays for more.
fn params<'a>(
    ns: &'a Vec<&'static str>,
    sub: &'a Vec<&'static str>,
    keys: &'a Vec<String>,
    values: &'a Vec<Vec<u8>>,
) -> [&'a (dyn ToSql + Sync); 4] {
    if keys.len() == 1 { [&ns[0], &sub[0], &keys[0], &values[0]] } else { [ns, sub, keys, values] }
}

fn median(samples: &mut [Duration]) -> f64 {
    samples.sort();
    samples[samples.len() / 2].as_secs_f64() * 1e6
}

fn key(i: usize) -> String {
    format!("k{i:04}")
}

/// Runs `statement` alone (committed at once) with `first`, then in a transaction with `second`
/// (new values again): the first run's time, the second statement's and its commit's.
async fn timed(
    client: &Client,
    statement: &Statement,
    first: &[&(dyn ToSql + Sync)],
    second: &[&(dyn ToSql + Sync)],
) -> Result<(Duration, Duration, Duration), tokio_postgres::Error> {
    let started = Instant::now();
    client.execute(statement, first).await?;
    let alone = started.elapsed();
    client.batch_execute("BEGIN").await?;
    let started = Instant::now();
    client.execute(statement, second).await?;
    let executed = Instant::now();
    client.batch_execute("COMMIT").await?;
    Ok((alone, executed - started, executed.elapsed()))
}
