//! Atomic batches: all-or-nothing, one fence check, and per-key call order shared with the
//! single-key `write`/`remove`.

use crate::common;

use std::collections::BTreeMap;

use common::within;
use pgfence::{Error, PgKvStore};
use rand::seq::SliceRandom;

const NS: &str = "ns";
const SUB: &str = "sub";

/// Every `(key, value)` of `(NS, SUB)`, read straight from the table by an administrator
/// connection (not through the store, which may have failed closed).
async fn rows(table: &str) -> BTreeMap<String, Vec<u8>> {
    let admin = common::admin().await;
    admin
        .query(
            &format!(
                "SELECT key, value FROM \"{table}\" WHERE primary_namespace = $1 AND secondary_namespace = $2"
            ),
            &[&NS, &SUB],
        )
        .await
        .expect("read rows")
        .iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect()
}

async fn value(store: &PgKvStore, key: &str) -> Option<Vec<u8>> {
    match store.read(NS, SUB, key).await {
        Ok(v) => Some(v),
        Err(e) if e.is_not_found() => None,
        Err(e) => panic!("read {key}: {e}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn puts_and_removes_commit_together() {
    let table = common::table("batch_basic");
    let store = common::open(&table).await;
    store.write(NS, SUB, "old", b"old".to_vec()).await.unwrap();

    let batch = store
        .batch()
        .put(NS, SUB, "a", b"a1".to_vec())
        .put(NS, SUB, "b", b"b".to_vec())
        .remove(NS, SUB, "old")
        .put(NS, "other", "c", b"c".to_vec())
        .put("", "", "d", vec![])
        // The same key twice: the last operation wins.
        .put(NS, SUB, "a", b"a2".to_vec())
        .put(NS, SUB, "gone", b"x".to_vec())
        .remove(NS, SUB, "gone")
        // Removing a missing key is not an error.
        .remove(NS, SUB, "never");
    assert_eq!(batch.len(), 7);
    within("commit", batch.commit()).await.unwrap();

    assert_eq!(value(&store, "a").await.as_deref(), Some(&b"a2"[..]));
    assert_eq!(value(&store, "b").await.as_deref(), Some(&b"b"[..]));
    assert_eq!(value(&store, "old").await, None);
    assert_eq!(value(&store, "gone").await, None);
    assert_eq!(store.read(NS, "other", "c").await.unwrap(), b"c");
    assert_eq!(store.read("", "", "d").await.unwrap(), b"");
    assert_eq!(store.list(NS, SUB).await.unwrap(), ["a", "b"]);

    // Every row records the epoch that wrote it, as single writes do.
    let admin = common::admin().await;
    let epochs: Vec<i64> = admin
        .query(&format!("SELECT DISTINCT epoch FROM \"{table}\""), &[])
        .await
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect();
    assert_eq!(epochs, [store.fencing_token()]);

    // An empty batch is a no-op that succeeds.
    let empty = store.batch();
    assert!(empty.is_empty());
    empty.commit().await.unwrap();
    store.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn invalid_operation_writes_nothing() {
    let table = common::table("batch_invalid");
    let store = common::builder(&table).max_value_size(16).open().await.unwrap();
    store.write(NS, SUB, "keep", b"before".to_vec()).await.unwrap();

    let bad_key = store
        .batch()
        .put(NS, SUB, "a", b"a".to_vec())
        .remove(NS, SUB, "keep")
        .put(NS, SUB, "bad/key", b"x".to_vec())
        .put(NS, SUB, "b", b"b".to_vec());
    let e = bad_key.commit().await.unwrap_err();
    assert!(matches!(e, Error::InvalidKey { what: "key", .. }), "{e}");

    let bad_namespace = store.batch().put(NS, SUB, "a", b"a".to_vec()).remove("", SUB, "keep");
    let e = bad_namespace.commit().await.unwrap_err();
    assert!(matches!(e, Error::InvalidKey { .. }), "{e}");

    let too_large = store.batch().put(NS, SUB, "a", b"a".to_vec()).remove(NS, SUB, "keep");
    let too_large = too_large.put(NS, SUB, "big", vec![0; 17]);
    let e = too_large.commit().await.unwrap_err();
    assert!(matches!(e, Error::ValueTooLarge { len: 17, max: 16 }), "{e}");

    // Nothing of any of them reached the table.
    let expected = BTreeMap::from([("keep".to_owned(), b"before".to_vec())]);
    assert_eq!(rows(&table).await, expected);
    // A validation error is the caller's, not the lease's: the store still works.
    store.batch().put(NS, SUB, "a", b"a".to_vec()).commit().await.unwrap();
    assert_eq!(value(&store, "a").await.as_deref(), Some(&b"a"[..]));
    store.close().await.unwrap();
}

/// Every value within `max_value_size`, but together more than one statement may carry
/// (`MAX_BATCH_BYTES`, counting keys and namespaces too, and 16 bytes per operation): a typed error before any SQL, nothing
/// written, and the store goes on. (Zeroed allocations: their pages are never touched.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_larger_than_one_statement_may_carry_writes_nothing() {
    let table = common::table("batch_huge");
    let store = common::open(&table).await;
    store.write(NS, SUB, "keep", b"before".to_vec()).await.unwrap();
    let mut batch = store.batch().remove(NS, SUB, "keep");
    let value_len = pgfence::MAX_BATCH_BYTES / 16 + 1;
    for i in 0..16 {
        batch = batch.put(NS, SUB, &format!("v{i:02}"), vec![0; value_len]);
    }
    let e = batch.commit().await.unwrap_err();
    let names = NS.len() + SUB.len();
    let expected = 16 * (names + 3 + value_len) + names + "keep".len() + 17 * 16;
    match e {
        Error::BatchTooLarge { len, max } => {
            assert_eq!((len, max), (expected, pgfence::MAX_BATCH_BYTES));
        }
        other => panic!("expected BatchTooLarge, got {other:?}"),
    }
    let expected = BTreeMap::from([("keep".to_owned(), b"before".to_vec())]);
    assert_eq!(rows(&table).await, expected);
    store.batch().put(NS, SUB, "a", b"a".to_vec()).commit().await.unwrap();
    store.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stolen_lease_writes_nothing_and_fails_closed() {
    let table = common::table("batch_fenced");
    let store = common::open(&table).await;
    store.write(NS, SUB, "keep", b"before".to_vec()).await.unwrap();

    let admin = common::admin().await;
    let epoch = common::steal_lease(&admin, &table).await;
    assert_eq!(epoch, store.fencing_token() + 1);

    let batch = store
        .batch()
        .put(NS, SUB, "a", b"a".to_vec())
        .put(NS, SUB, "keep", b"after".to_vec())
        .remove(NS, SUB, "keep");
    let e = within("fenced commit", batch.commit()).await.unwrap_err();
    assert!(e.is_lease_lost(), "{e}");
    let expected = BTreeMap::from([("keep".to_owned(), b"before".to_vec())]);
    assert_eq!(rows(&table).await, expected);

    // Failed closed, permanently: later batches (empty ones included) and writes fail too.
    let e = store.batch().put(NS, SUB, "b", b"b".to_vec()).commit().await.unwrap_err();
    assert!(e.is_lease_lost(), "{e}");
    assert!(store.batch().commit().await.unwrap_err().is_lease_lost());
    assert!(store.write(NS, SUB, "c", b"c".to_vec()).await.unwrap_err().is_lease_lost());
    assert_eq!(rows(&table).await, expected);
}

/// A database error in one operation (a trigger refuses one key) fails the whole batch:
/// none of its other puts and removes is applied, and the store goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn database_error_in_one_operation_applies_none() {
    let table = common::table("batch_dberr");
    let store = common::open(&table).await;
    store.write(NS, SUB, "old", b"old".to_vec()).await.unwrap();
    store.write(NS, SUB, "a", b"a0".to_vec()).await.unwrap();
    common::refuse_key(&table, "bad").await;
    let before = rows(&table).await;

    let batch = store
        .batch()
        .put(NS, SUB, "a", b"a1".to_vec())
        .put(NS, SUB, "new", b"n".to_vec())
        .put(NS, SUB, "bad", b"x".to_vec())
        .remove(NS, SUB, "old");
    let err = batch.commit().await.unwrap_err();
    assert!(matches!(err, Error::Database { .. }), "{err:?}");
    assert_eq!(rows(&table).await, before, "nothing of the batch was applied");

    store.write(NS, SUB, "a", b"a2".to_vec()).await.expect("the store goes on");
    store.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn closed_store_refuses_batches() {
    let store = common::open(&common::table("batch_closed")).await;
    let pending = store.batch().put(NS, SUB, "a", b"a".to_vec());
    store.close().await.unwrap();
    assert!(matches!(pending.commit().await, Err(Error::Closed)));
    assert!(matches!(store.batch().commit().await, Err(Error::Closed)));
}

/// Futures created in one order and awaited in the reverse order: every key ends with the value
/// of the last *call* that touched it, batch or single.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ordered_with_single_writes_by_call_time() {
    let store = common::open(&common::table("batch_order")).await;

    // Calls, in this order:
    let w_before = store.write(NS, SUB, "k1", b"single before".to_vec());
    let r_before = store.remove(NS, SUB, "k3", false);
    let batch = store
        .batch()
        .put(NS, SUB, "k1", b"batch".to_vec())
        .put(NS, SUB, "k2", b"batch".to_vec())
        .put(NS, SUB, "k3", b"batch".to_vec())
        .put(NS, SUB, "k4", b"batch".to_vec())
        .commit();
    let w_after = store.write(NS, SUB, "k2", b"single after".to_vec());
    let r_after = store.remove(NS, SUB, "k4", false);

    // Awaited newest first: the later single calls run before the batch, so the batch must drop
    // k2 and k4 (superseded) yet still apply k1 and k3; the earlier calls then run last and
    // must not overwrite the batch.
    within("r_after", r_after).await.unwrap();
    within("w_after", w_after).await.unwrap();
    within("batch", batch).await.unwrap();
    within("r_before", r_before).await.unwrap();
    within("w_before", w_before).await.unwrap();

    assert_eq!(value(&store, "k1").await.as_deref(), Some(&b"batch"[..]));
    assert_eq!(value(&store, "k2").await.as_deref(), Some(&b"single after"[..]));
    assert_eq!(value(&store, "k3").await.as_deref(), Some(&b"batch"[..]));
    assert_eq!(value(&store, "k4").await, None);

    // Two overlapping batches, the later one awaited first.
    let first = store.batch().put(NS, SUB, "k1", b"first".to_vec()).remove(NS, SUB, "k2").commit();
    let second =
        store.batch().put(NS, SUB, "k2", b"second".to_vec()).put(NS, SUB, "k5", b"5".to_vec());
    let second = second.commit();
    within("second", second).await.unwrap();
    within("first", first).await.unwrap();
    assert_eq!(value(&store, "k1").await.as_deref(), Some(&b"first"[..]));
    assert_eq!(value(&store, "k2").await.as_deref(), Some(&b"second"[..]));
    assert_eq!(value(&store, "k5").await.as_deref(), Some(&b"5"[..]));
    store.close().await.unwrap();
}

/// Many writes, removes and batches over a few keys, all running at once on spawned tasks
/// (batches taking their keys in every order): no deadlock, and every key ends with the value of
/// the last call that touched it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_mix_ends_in_call_order() {
    let store = common::open(&common::table("batch_mix")).await;
    let keys = ["a", "b", "c", "d", "e", "f"];
    let mut rng = rand::rng();
    // The expected final state: the last call per key. None = removed.
    let mut expected: BTreeMap<&str, Option<Vec<u8>>> = BTreeMap::new();
    let mut tasks = Vec::new();
    for call in 0..300u32 {
        let value = format!("v{call}").into_bytes();
        let fut: std::pin::Pin<Box<dyn std::future::Future<Output = _> + Send>> = match call % 4 {
            0 => {
                let key = keys[call as usize % keys.len()];
                expected.insert(key, Some(value.clone()));
                Box::pin(store.write(NS, SUB, key, value))
            }
            1 => {
                let key = keys[(call as usize / 4) % keys.len()];
                expected.insert(key, None);
                Box::pin(store.remove(NS, SUB, key, false))
            }
            _ => {
                let mut chosen = keys.to_vec();
                chosen.shuffle(&mut rng);
                let mut batch = store.batch();
                for (i, key) in chosen.iter().take(1 + call as usize % 4).enumerate() {
                    if i % 3 == 2 {
                        expected.insert(key, None);
                        batch = batch.remove(NS, SUB, key);
                    } else {
                        expected.insert(key, Some(value.clone()));
                        batch = batch.put(NS, SUB, key, value.clone());
                    }
                }
                Box::pin(batch.commit())
            }
        };
        tasks.push(fut);
    }
    // Run them all at once, started in a random order.
    tasks.shuffle(&mut rng);
    let handles: Vec<_> = tasks.into_iter().map(tokio::spawn).collect();
    for handle in handles {
        within("mixed operation", handle).await.expect("task").expect("operation");
    }
    for (key, want) in expected {
        assert_eq!(value(&store, key).await, want, "key {key}");
    }
    store.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ten_thousand_operations_in_one_batch() {
    let table = common::table("batch_10k");
    let store = common::open(&table).await;
    let value = |i: usize| format!("{i:05}").repeat(200).into_bytes(); // 1000 bytes

    let mut batch = store.batch();
    for i in 0..10_000 {
        batch = batch.put(NS, SUB, &format!("k{i:05}"), value(i));
    }
    assert_eq!(batch.len(), 10_000);
    within("10k puts", batch.commit()).await.unwrap();
    let keys = store.list(NS, SUB).await.unwrap();
    assert_eq!(keys.len(), 10_000);
    assert_eq!(keys[0], "k00000");
    assert_eq!(keys[9_999], "k09999");

    // 5,000 removes and 5,000 overwrites in one batch.
    let mut batch = store.batch();
    for i in 0..10_000 {
        let key = format!("k{i:05}");
        batch = if i % 2 == 0 {
            batch.remove(NS, SUB, &key)
        } else {
            batch.put(NS, SUB, &key, b"updated".to_vec())
        };
    }
    within("10k mixed", batch.commit()).await.unwrap();
    let all = rows(&table).await;
    assert_eq!(all.len(), 5_000);
    assert!(all.iter().all(|(k, v)| {
        let i: usize = k[1..].parse().unwrap();
        i % 2 == 1 && v == b"updated"
    }));
    store.close().await.unwrap();
}

/// Every batch statement is planned once per connection, not on every execution: PostgreSQL
/// switches a prepared statement to its generic plan after five executions when that plan does
/// not look costlier than the custom ones, and the statements are written so that it does not
/// (see `sql::BATCH`). Checked on the one connection of a one-connection pool, from
/// `pg_prepared_statements`, after small batches of every shape. (Before `sql::BATCH` read its
/// removes through subqueries, all 24 batches with removes here were planned afresh.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_statements_are_planned_once_per_connection() {
    use pgfence::deadpool_postgres::{Manager, Pool};
    let manager = Manager::new(common::server().config(), pgfence::tokio_postgres::NoTls);
    let pool = Pool::builder(manager).max_size(1).build().unwrap();
    let table = common::table("batch_plans");
    // Renewal takes its connection out of the pool at its first renewal, and the pool makes a
    // new one: not due before the batches below are done, however slow the machine, so that
    // they all run on one connection.
    let store = PgKvStore::builder_from_pool(pool.clone())
        .table(&table)
        .lease_ttl(std::time::Duration::from_secs(300))
        .renew_interval(std::time::Duration::from_secs(100))
        .open()
        .await
        .unwrap();

    // A table of some size, with statistics: on a near-empty one every plan looks cheap.
    let admin = common::admin().await;
    admin
        .batch_execute(&format!(
            "INSERT INTO \"{table}\" (primary_namespace, secondary_namespace, key, value, epoch) \
             SELECT 'other', '', 'k' || g, '\\x00', 0 FROM generate_series(1, 100000) g; \
             ANALYZE \"{table}\""
        ))
        .await
        .unwrap();

    const ROUNDS: i64 = 12;
    for i in 0..ROUNDS {
        let (a, b) = (format!("a{i}"), format!("b{i}"));
        // Puts only.
        store
            .batch()
            .put(NS, SUB, &a, b"1".to_vec())
            .put(NS, SUB, &b, b"2".to_vec())
            .commit()
            .await
            .unwrap();
        // Puts and a remove.
        let c = format!("c{i}");
        store
            .batch()
            .put(NS, SUB, &c, b"3".to_vec())
            .put(NS, SUB, &a, b"4".to_vec())
            .remove(NS, SUB, &b)
            .commit()
            .await
            .unwrap();
        // A remove only.
        store.batch().remove(NS, SUB, &c).commit().await.unwrap();
    }

    let client = pool.get().await.unwrap();
    // The statements, by the name the driver prepared them under on this connection.
    let statements: Vec<(String, String, i32)> = client
        .query(
            "SELECT name, statement, cardinality(parameter_types) FROM pg_prepared_statements \
              WHERE statement LIKE '%unnest%' AND strpos(statement, $1) > 0",
            &[&table],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| (row.get(0), row.get(1), row.get(2)))
        .collect();
    let statement = |with_removes: bool| {
        let found: Vec<_> = statements
            .iter()
            .filter(|(_, sql, _)| sql.contains("DELETE") == with_removes)
            .collect();
        assert_eq!(
            found.len(),
            1,
            "one batch statement with removes={with_removes}: {statements:?}"
        );
        found[0].clone()
    };
    let (puts, with_removes) = (statement(false), statement(true));

    // PostgreSQL 14 counts each statement's plans (`generic_plans`, `custom_plans`): five
    // custom plans, then the one generic plan for every later execution.
    if common::server_version_num(&client).await >= 14_00_00 {
        let plans = |name: &str| {
            let client = &client;
            let name = name.to_owned();
            async move {
                let row = client
                    .query_one(
                        "SELECT generic_plans, custom_plans FROM pg_prepared_statements \
                          WHERE name = $1",
                        &[&name],
                    )
                    .await
                    .unwrap();
                (row.get::<_, i64>(0), row.get::<_, i64>(1))
            }
        };
        // Puts only: one statement, run ROUNDS times.
        let (generic, custom) = plans(&puts.0).await;
        assert_eq!((generic + custom, custom), (ROUNDS, 5), "puts-only batches");
        // With removes: one statement, run twice per round.
        let (generic, custom) = plans(&with_removes.0).await;
        assert_eq!((generic + custom, custom), (2 * ROUNDS, 5), "batches with removes");
    }

    // On every version (13 has no counters): the statement now runs its generic plan, which
    // leaves the parameters unresolved (`$1`); a custom plan shows their values instead.
    // `EXPLAIN EXECUTE` of the driver's statement, on its connection, plans the next execution
    // as the statement would and runs nothing.
    for (name, sql, parameters) in [&puts, &with_removes] {
        let mut arguments = vec!["'00000000-0000-0000-0000-000000000000'"];
        arguments.resize(*parameters as usize, "'{}'");
        let explain = format!("EXPLAIN EXECUTE {name}({})", arguments.join(", "));
        let plan: Vec<String> =
            client.query(&explain, &[]).await.unwrap().iter().map(|row| row.get(0)).collect();
        assert!(
            plan.iter().any(|line| line.contains("owner_id = $1")),
            "the generic plan of {sql}: {plan:#?}"
        );
    }
    drop(client);
    store.close().await.unwrap();
}

/// An uncommitted batch does not keep the store alive: dropping the last store handle releases
/// the lease at once (another store opens long before the TTL), and committing the batch
/// afterwards fails with `Closed`, as any operation of a closed store does, writing nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_uncommitted_batch_does_not_keep_the_lease() {
    let table = common::table("batch_drop");
    let long = || {
        common::builder(&table)
            .lease_ttl(std::time::Duration::from_secs(600))
            .renew_interval(std::time::Duration::from_secs(60))
    };
    let store = long().open().await.unwrap();
    let batch = store.batch().put(NS, SUB, "k", b"v".to_vec());
    drop(store);
    // Opening fails fast with `LeaseHeld` while the first store still holds the lease.
    let next = within("open after the drop", long().open()).await.expect("the lease was released");
    let e = batch.commit().await.unwrap_err();
    assert!(matches!(e, Error::Closed), "{e:?}");
    assert!(rows(&table).await.is_empty(), "nothing written");
    next.close().await.unwrap();
}
