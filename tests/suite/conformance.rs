//! The conformance suite (tests/common/conformance.rs) against the inherent async API and its
//! batches, one test per configuration: pool size 1 and N, a custom schema and mixed-case
//! table, a current-thread runtime, and an application's existing pool.

use crate::common;

use std::time::Duration;

use common::conformance::{Batches, Facade, Native, SUITE_LIMIT, Setup, check_contract};
use pgfence::Builder;

const PAGE: usize = 7;

async fn run(setup: Setup) {
    let run = tokio::time::timeout(SUITE_LIMIT, check_contract(&setup));
    run.await.unwrap_or_else(|_| panic!("the conformance suite hung for {SUITE_LIMIT:?}"));
}

fn pool_1(builder: Builder) -> Builder {
    builder.pool_size(1)
}

fn pool_8(builder: Builder) -> Builder {
    builder.pool_size(8)
}

/// A configuration whose tables live in a schema of their own, under mixed-case quoted names
/// (every probe of the suite reads them by their qualified names).
fn in_own_schema(facade: impl Facade + 'static) -> Setup {
    let mut setup = Setup::new(facade, Some(PAGE), |b| b);
    setup.schema = Some(common::table("schema"));
    setup
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_pool_size_1() {
    run(Setup::new(Native, Some(PAGE), pool_1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_pool_size_8() {
    run(Setup::new(Native, Some(PAGE), pool_8)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_schema_qualified_table() {
    run(in_own_schema(Native)).await;
}

#[tokio::test(flavor = "current_thread")]
async fn conformance_current_thread_runtime() {
    run(Setup::new(Native, Some(PAGE), |b| b)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_existing_pool() {
    use pgfence::deadpool_postgres::{Manager, Pool};
    let manager = Manager::new(common::server().config(), pgfence::tokio_postgres::NoTls);
    // Room for the two stores some checks hold at once.
    let pool = Pool::builder(manager).max_size(6).build().unwrap();
    let application_pool = pool.clone();
    let setup = Setup {
        facade: Box::new(Native),
        builder: Box::new(move |table| {
            pgfence::PgKvStore::builder_from_pool(application_pool.clone())
                .table(table)
                .lease_ttl(Duration::from_secs(15))
                .renew_interval(Duration::from_secs(3))
        }),
        schema: None,
        page_size: Some(PAGE),
    };
    run(setup).await;
    // The application's pool is still usable after every store closed.
    let client = pool.get().await.expect("the application's pool stays open");
    client.query_one("SELECT 1", &[]).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_batches_pool_size_1() {
    run(Setup::new(Batches, Some(PAGE), pool_1)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conformance_batches_pool_size_8() {
    run(Setup::new(Batches, Some(PAGE), pool_8)).await;
}

#[tokio::test(flavor = "current_thread")]
async fn conformance_batches_schema_qualified_table_current_thread_runtime() {
    run(in_own_schema(Batches)).await;
}
