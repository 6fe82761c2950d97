//! Least privilege: tables that one role created and owns, used by roles that hold exactly the
//! grants docs/deployments.md lists, read from that file.

use crate::common;

use std::time::Duration;

use common::{admin, server, table, within};
use pgfence::{Error, PgKvStore, StandbyState};

/// The SQL block of docs/deployments.md under the heading `heading`, one statement a line,
/// for schema `schema`, table `kv` and role `role`. The docs write them for schema `app`, table
/// `node_state` and roles `svc` and `reader`.
pub(crate) fn documented_grants(heading: &str, schema: &str, kv: &str, role: &str) -> Vec<String> {
    let docs = include_str!("../../docs/deployments.md");
    let section = docs.split(heading).nth(1).unwrap_or_else(|| panic!("no {heading:?}"));
    let block = section.split("```sql\n").nth(1).and_then(|rest| rest.split("```").next());
    let block = block.unwrap_or_else(|| panic!("no SQL block under {heading:?}"));
    block
        .lines()
        .map(|line| {
            line.replace("app.node_state", &format!("{schema}.{kv}"))
                .replace("SCHEMA app ", &format!("SCHEMA {schema} "))
                .replace(" TO svc;", &format!(" TO {role};"))
                .replace(" TO reader;", &format!(" TO {role};"))
        })
        .collect()
}

/// A connection configuration of the test server for `role` (which logs in without a
/// password, as the test cluster trusts local connections).
fn as_role(role: &str) -> tokio_postgres::Config {
    let mut config = server().config();
    config.user(role);
    config
}

/// A schema owned by a role of its own, which created the tables of `kv` in it by opening a
/// store; and a second role, which holds nothing yet. Returns the schema, the qualified table
/// and the second role.
async fn owned_tables(prefix: &str) -> (String, String, String) {
    let (schema, owner, user) = (
        table(&format!("{prefix}_s")),
        table(&format!("{prefix}_owner")),
        table(&format!("{prefix}_user")),
    );
    admin()
        .await
        .batch_execute(&format!(
            "CREATE ROLE {owner} LOGIN; CREATE ROLE {user} LOGIN; \
             CREATE SCHEMA {schema} AUTHORIZATION {owner}"
        ))
        .await
        .unwrap();
    let kv = format!("{schema}.kv");
    let store = PgKvStore::builder_from_config(as_role(&owner)).table(&kv).open().await.unwrap();
    store.write("app", "cfg", "greeting", b"hello".to_vec()).await.unwrap();
    store.close().await.unwrap();
    (schema, kv, user)
}

/// The application's role: only the documented grants, on tables another role created. It
/// opens, writes, reads, removes, renews, releases, and waits as a standby that takes over at
/// the release. It may create nothing, which the first check shows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_application_role_with_the_documented_grants_uses_tables_it_did_not_create() {
    let (schema, kv, app) = owned_tables("priv_app").await;
    let admin = admin().await;
    for grant in documented_grants("### Tables an administrator created", &schema, "kv", &app) {
        admin.batch_execute(&grant).await.unwrap_or_else(|e| panic!("{grant}: {e}"));
    }
    let builder = || {
        PgKvStore::builder_from_config(as_role(&app))
            .table(&kv)
            .pool_size(2)
            .lease_ttl(Duration::from_secs(6))
            .renew_interval(Duration::from_secs(1))
    };
    // No CREATE on the schema: a table of its own is refused, and names the grant.
    let other = format!("{schema}.other");
    let refused = builder().table(&other).open().await.unwrap_err();
    assert!(matches!(refused, Error::PermissionDenied { .. }), "{refused}");
    assert!(refused.to_string().contains(&format!("ON SCHEMA {schema} TO {app}")), "{refused}");

    let store = within("open", builder().open()).await.unwrap();
    assert_eq!(store.read("app", "cfg", "greeting").await.unwrap(), b"hello");
    store.write("app", "cfg", "k", b"v".to_vec()).await.unwrap();
    store
        .batch()
        .put("app", "cfg", "b", b"1".to_vec())
        .remove("app", "cfg", "k")
        .commit()
        .await
        .unwrap();
    assert_eq!(store.list("app", "cfg").await.unwrap(), ["b", "greeting"]);
    store.remove("app", "cfg", "b", false).await.unwrap();
    let page = store.list_paginated("app", "cfg", None).await.unwrap();
    assert_eq!(page.keys, ["greeting"]);
    // Renewal: two confirmed, at 1 s intervals.
    within("two renewals", async {
        while store.stats().renewals.ok < 2 {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    })
    .await;
    assert_eq!(store.stats().renewals.failed, 0);

    // A standby of the same role waits, then takes over at the release (not by expiry).
    let standby = builder().standby().timeout(Duration::from_secs(60));
    let mut progress = standby.progress();
    let waiting = tokio::spawn(standby.open());
    within("the standby waits", async {
        while !matches!(*progress.borrow_and_update(), StandbyState::Waiting { .. }) {
            progress.changed().await.unwrap();
        }
    })
    .await;
    let epoch = store.fencing_token();
    store.close().await.unwrap();
    let next = within("the standby takes over", waiting).await.unwrap().unwrap();
    assert_eq!(next.fencing_token(), epoch + 1);
    next.write("app", "cfg", "after", b"2".to_vec()).await.unwrap();
    next.close().await.unwrap();
}

/// A read-only role: SELECT on the two tables, as documented, is all the reads of an
/// `Inspector` need. It cannot write: opening a store is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_only_role_with_the_documented_grants_reads_everything() {
    let (schema, kv, reader) = owned_tables("priv_read").await;
    let admin = admin().await;
    for grant in documented_grants("### Read-only roles", &schema, "kv", &reader) {
        admin.batch_execute(&grant).await.unwrap_or_else(|e| panic!("{grant}: {e}"));
    }
    let builder = || PgKvStore::builder_from_config(as_role(&reader)).table(&kv).pool_size(2);
    let inspector = builder().inspect().await.unwrap();
    let lease = inspector.lease_info().await.unwrap().expect("a lease row");
    assert!(!lease.active, "released by the owner: {lease:?}");
    assert_eq!(inspector.read("app", "cfg", "greeting").await.unwrap(), b"hello");
    assert_eq!(inspector.list("app", "cfg").await.unwrap(), ["greeting"]);
    let all = inspector.list_all_keys().await.unwrap();
    assert_eq!(all, [("app".to_owned(), "cfg".to_owned(), "greeting".to_owned())]);
    let mut entries = inspector.entries().await.unwrap();
    assert!(entries.next().await.unwrap().is_ok());
    assert!(entries.next().await.is_none());
    drop(entries);
    let refused = builder().open().await.unwrap_err();
    assert!(refused.is_permission_denied(), "{refused}");
}

/// Each operation's permission error names exactly the rights that operation needs, on the
/// table the server names. A role with the documented grants but one is refused where that
/// right is needed, and only there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_operation_names_the_rights_it_needs() {
    let (schema, kv, role) = owned_tables("priv_each").await;
    let admin = admin().await;
    for grant in documented_grants("### Tables an administrator created", &schema, "kv", &role) {
        admin.batch_execute(&grant).await.unwrap_or_else(|e| panic!("{grant}: {e}"));
    }
    let grant_of = |e: Error| match e {
        Error::PermissionDenied { grant, .. } => grant.to_string(),
        other => panic!("expected PermissionDenied, got {other:?}"),
    };
    admin.batch_execute(&format!("REVOKE DELETE ON {kv} FROM {role}")).await.unwrap();
    let builder = || PgKvStore::builder_from_config(as_role(&role)).table(&kv).pool_size(2);
    let store = within("open", builder().open()).await.unwrap();
    store.write("app", "cfg", "k", b"v".to_vec()).await.expect("a write needs no DELETE");
    let refused = store.remove("app", "cfg", "k", false).await.unwrap_err();
    assert_eq!(grant_of(refused), format!("GRANT SELECT, DELETE ON kv TO {role}"));
    store.close().await.unwrap();

    admin.batch_execute(&format!("REVOKE SELECT ON {kv} FROM {role}")).await.unwrap();
    let inspector = builder().inspect().await.unwrap();
    let refused = inspector.list_all_keys().await.unwrap_err();
    let text = refused.to_string();
    assert!(text.contains("during list all keys"), "a name a person reads: {text}");
    assert_eq!(grant_of(refused), format!("GRANT SELECT ON kv TO {role}"));

    let (lease, grant) = (format!("{schema}.kv_lease"), format!("GRANT SELECT ON {kv} TO {role}"));
    admin.batch_execute(&grant).await.unwrap();
    admin.batch_execute(&format!("REVOKE INSERT ON {lease} FROM {role}")).await.unwrap();
    // Without its row, the lease is inserted: the first open of a table needs INSERT.
    admin.batch_execute(&format!("DELETE FROM {lease}")).await.unwrap();
    let refused = builder().open().await.unwrap_err();
    assert_eq!(grant_of(refused), format!("GRANT SELECT, INSERT, UPDATE ON kv_lease TO {role}"));
}
