//! The conformance suite against the inherent async API, one test per configuration.

mod common;

use common::conformance::{Native, check_all};

const PAGE: usize = 7;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_pool_size_1() {
    let store =
        common::builder(&common::table("conf1")).pool_size(1).page_size(PAGE).open().await.unwrap();
    check_all(&Native(store.clone(), PAGE)).await;
    store.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_pool_size_8() {
    let store =
        common::builder(&common::table("conf8")).pool_size(8).page_size(PAGE).open().await.unwrap();
    check_all(&Native(store.clone(), PAGE)).await;
    store.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_schema_qualified_table() {
    let schema = common::table("schema");
    let table = format!("{schema}.Node_State");
    let store = common::builder(&table).page_size(PAGE).open().await.unwrap();
    check_all(&Native(store.clone(), PAGE)).await;
    // The rows really live in the named schema, under the case-preserved quoted name.
    let admin = common::admin().await;
    let n: i64 = admin
        .query_one(&format!("SELECT count(*) FROM \"{schema}\".\"Node_State\""), &[])
        .await
        .unwrap()
        .get(0);
    assert!(n > 0);
    store.close().await.unwrap();
}

#[tokio::test(flavor = "current_thread")]
async fn conformance_current_thread_runtime() {
    let store = common::builder(&common::table("confct")).page_size(PAGE).open().await.unwrap();
    check_all(&Native(store.clone(), PAGE)).await;
    store.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_existing_pool() {
    use pgfence::deadpool_postgres::{Manager, Pool};
    let manager = Manager::new(common::server().config(), pgfence::tokio_postgres::NoTls);
    let pool = Pool::builder(manager).max_size(3).build().unwrap();
    let store = pgfence::PgKvStore::builder_from_pool(pool.clone())
        .table(common::table("confpool"))
        .page_size(PAGE)
        .lease_ttl(std::time::Duration::from_secs(15))
        .renew_interval(std::time::Duration::from_secs(3))
        .open()
        .await
        .unwrap();
    check_all(&Native(store.clone(), PAGE)).await;
    store.close().await.unwrap();
    // The application's pool is still usable after the store closed.
    let client = pool.get().await.expect("the application's pool stays open");
    client.query_one("SELECT 1", &[]).await.unwrap();
}
