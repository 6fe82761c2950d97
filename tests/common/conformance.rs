//! The conformance suite: the store's whole contract as reusable checks, run against every
//! facade (the async `PgKvStore`, its batches, `pgfence::blocking`, the LDK adapter's async and
//! sync traits) in every configuration that matters (pool sizes, custom schema and table, an
//! existing pool, each kind of runtime context).
//!
//! A configuration is a [`Setup`]: a [`Facade`] (how to open a store and reach its API) and a
//! builder for fresh tables. One test per configuration calls [`check_contract`]. What differs
//! between facades is a parameter ([`Caps`]), never a forked copy of a check.
//!
//! Errors are compared as `std::io::Error` kinds, the common language of every facade; the
//! `pgfence::Error` inside is checked too where the contract names it.
//!
//! The checks run anywhere a facade does: in a tokio runtime of either flavor, and (for the
//! blocking facades) on a plain thread with no runtime. So they use no tokio timer or task of
//! their own; probes of the database run on a thread of their own ([`on_own_runtime`]).

use std::collections::BTreeSet;
use std::future::Future;
use std::io::{self, ErrorKind};
use std::panic::{self, AssertUnwindSafe};
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use pgfence::Builder;
use rand::seq::SliceRandom;

/// A boxed future, so facades of any shape (async, blocking inside the future, LDK) fit.
pub type BoxFut<'a, T> = Pin<Box<dyn Future<Output = io::Result<T>> + Send + 'a>>;

/// One page of a paginated listing: keys and the next token.
pub type PageOut = (Vec<String>, Option<String>);

/// What differs between facades, as parameters of the checks.
#[derive(Debug, Clone, Copy)]
pub struct Caps {
    /// `write` and `remove` return futures that take the key's place in its order when
    /// called, so futures awaited in another order still take effect in call order. True for
    /// the async facades (whose futures need a tokio runtime); a blocking facade's call takes
    /// its place when it runs, and its future blocks when polled.
    pub ordered_at_call: bool,
    /// A returned future does nothing until polled (the inherent async API and batches). LDK's
    /// async traits start the operation at once instead.
    pub lazy: bool,
    /// Keys per page the store was opened with.
    pub page_size: usize,
}

/// The contract under test, as one open store of a facade exposes it.
///
/// `write` and `remove` return `'static` futures that own what they need, so a check can call
/// many, then await them in any order or hand them to another thread.
pub trait Kv: Send + Sync {
    fn caps(&self) -> Caps;
    fn read<'a>(&'a self, p: &'a str, s: &'a str, k: &'a str) -> BoxFut<'a, Vec<u8>>;
    fn write(&self, p: &str, s: &str, k: &str, v: Vec<u8>) -> BoxFut<'static, ()>;
    fn remove(&self, p: &str, s: &str, k: &str) -> BoxFut<'static, ()>;
    fn list<'a>(&'a self, p: &'a str, s: &'a str) -> BoxFut<'a, Vec<String>>;
    fn list_page<'a>(
        &'a self,
        p: &'a str,
        s: &'a str,
        token: Option<String>,
    ) -> BoxFut<'a, PageOut>;
    fn list_all(&self) -> BoxFut<'_, Vec<(String, String, String)>>;
    /// The lease epoch the store holds.
    fn fencing_token(&self) -> i64;
    fn close(&self) -> BoxFut<'_, ()>;
}

/// A way of opening a store and reaching its API.
pub trait Facade: Send + Sync {
    /// Opens a store with `builder`, which was given `page_size`. Dropping the returned value
    /// drops the store's last handle.
    fn open(&self, builder: Builder, page_size: usize) -> BoxFut<'static, Box<dyn Kv>>;
}

/// One configuration: a facade, and where and how its stores are made.
pub struct Setup {
    pub facade: Box<dyn Facade>,
    /// A builder of this configuration for the table named `table` (as [`Table::name`]).
    pub builder: Box<dyn Fn(&str) -> Builder + Send + Sync>,
    /// The schema of the tables, if not the default one.
    pub schema: Option<String>,
    /// Keys per page, set on every builder; `None` leaves the builder's default,
    /// [`DEFAULT_PAGE_SIZE`].
    pub page_size: Option<usize>,
}

/// The page size of a builder that was given none.
pub const DEFAULT_PAGE_SIZE: usize = 100;

/// A fresh table of a [`Setup`]: its name for the builder and its quoted SQL names.
#[derive(Debug, Clone)]
pub struct Table {
    pub name: String,
    pub kv: String,
    pub lease: String,
}

impl Setup {
    /// A configuration of `facade` on [`super::builder`] with `configure` applied.
    pub fn new(
        facade: impl Facade + 'static,
        page_size: Option<usize>,
        configure: fn(Builder) -> Builder,
    ) -> Setup {
        Setup {
            facade: Box::new(facade),
            builder: Box::new(move |table| configure(super::builder(table))),
            schema: None,
            page_size,
        }
    }

    /// A fresh table, never used by another check or test.
    pub fn table(&self, prefix: &str) -> Table {
        match &self.schema {
            None => {
                let name = super::table(prefix);
                Table { kv: format!("\"{name}\""), lease: format!("\"{name}_lease\""), name }
            }
            Some(schema) => {
                // Mixed case: the name is kept as given, quoted.
                let base = format!("Kv_{}", super::table(prefix));
                Table {
                    name: format!("{schema}.{base}"),
                    kv: format!("\"{schema}\".\"{base}\""),
                    lease: format!("\"{schema}\".\"{base}_lease\""),
                }
            }
        }
    }

    /// A builder for `table` with a lease far longer than any check: a store that opens soon
    /// after another one let go proves a release (or a takeover), never an expiry.
    pub fn long_lease(&self, table: &Table) -> Builder {
        let builder = (self.builder)(&table.name)
            .lease_ttl(Duration::from_secs(600))
            .renew_interval(Duration::from_secs(60));
        match self.page_size {
            Some(keys) => builder.page_size(keys),
            None => builder,
        }
    }

    /// Opens a store of this configuration with `builder` (made by [`Setup::long_lease`]).
    pub fn open_with(&self, builder: Builder) -> BoxFut<'static, Box<dyn Kv>> {
        self.facade.open(builder, self.page_size.unwrap_or(DEFAULT_PAGE_SIZE))
    }

    pub async fn open(&self, table: &Table) -> Box<dyn Kv> {
        self.open_with(self.long_lease(table)).await.expect("open store")
    }
}

/// Generous bound on one whole contract run (many hundreds of statements on a busy 2-core
/// machine). A bound against hangs, never a measurement.
pub const SUITE_LIMIT: Duration = Duration::from_secs(300);

/// Runs every check against the configuration `setup`.
pub async fn check_contract(setup: &Setup) {
    let table = setup.table("conf");
    let kv = setup.open(&table).await;
    check_data(&*kv).await;
    check_write_order(&*kv).await;
    kv.close().await.unwrap();
    check_lease_held_at_open(setup).await;
    check_close_releases(setup).await;
    check_drop_releases(setup).await;
    check_fencing_after_takeover(setup).await;
    check_fail_closed_after_loss(setup).await;
    check_superseded_calls_fail_closed(setup).await;
    check_fencing_of_a_write_in_flight(setup).await;
}

/// Every check of reads, writes, lists and input on one store. Each uses its own namespace, so
/// they do not see each other's keys; `list_all` is checked last, against everything the
/// others left behind.
pub async fn check_data(kv: &dyn Kv) {
    check_round_trip(kv).await;
    check_not_found(kv).await;
    check_overwrite(kv).await;
    check_empty_namespaces(kv).await;
    check_max_length_names(kv).await;
    check_values(kv).await;
    check_remove(kv).await;
    check_list(kv).await;
    check_pagination(kv).await;
    check_pagination_with_deletions(kv).await;
    check_invalid_input(kv).await;
    check_list_all_keys(kv).await;
}

pub async fn check_round_trip(kv: &dyn Kv) {
    kv.write("rt", "sub", "k1", b"hello".to_vec()).await.unwrap();
    assert_eq!(kv.read("rt", "sub", "k1").await.unwrap(), b"hello");
    // Same key name in another namespace is another key.
    kv.write("rt", "other", "k1", b"world".to_vec()).await.unwrap();
    assert_eq!(kv.read("rt", "sub", "k1").await.unwrap(), b"hello");
    assert_eq!(kv.read("rt", "other", "k1").await.unwrap(), b"world");
}

pub async fn check_not_found(kv: &dyn Kv) {
    let e = kv.read("nf", "sub", "missing").await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");
    let e = kv.read("nf-never-used", "", "missing").await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");
}

pub async fn check_overwrite(kv: &dyn Kv) {
    kv.write("ow", "sub", "k", b"one".to_vec()).await.unwrap();
    kv.write("ow", "sub", "k", b"two".to_vec()).await.unwrap();
    assert_eq!(kv.read("ow", "sub", "k").await.unwrap(), b"two");
    assert_eq!(kv.list("ow", "sub").await.unwrap(), vec!["k".to_owned()]);
}

pub async fn check_empty_namespaces(kv: &dyn Kv) {
    kv.write("", "", "top", b"t".to_vec()).await.unwrap();
    kv.write("en", "", "mid", b"m".to_vec()).await.unwrap();
    assert_eq!(kv.read("", "", "top").await.unwrap(), b"t");
    assert_eq!(kv.read("en", "", "mid").await.unwrap(), b"m");
    assert!(kv.list("", "").await.unwrap().contains(&"top".to_owned()));
    assert_eq!(kv.list("en", "").await.unwrap(), vec!["mid".to_owned()]);
    let e = kv.write("", "sub", "k", vec![]).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidInput, "secondary without primary: {e}");
}

pub async fn check_max_length_names(kv: &dyn Kv) {
    let (p, s, k) = ("p".repeat(120), "s".repeat(120), "k".repeat(120));
    kv.write(&p, &s, &k, b"long".to_vec()).await.unwrap();
    assert_eq!(kv.read(&p, &s, &k).await.unwrap(), b"long");
    assert_eq!(kv.list(&p, &s).await.unwrap(), vec![k.clone()]);
    let all = "A-z_09".repeat(20);
    kv.write("ml", "sub", &all, b"alphabet".to_vec()).await.unwrap();
    assert_eq!(kv.read("ml", "sub", &all).await.unwrap(), b"alphabet");
}

pub async fn check_values(kv: &dyn Kv) {
    kv.write("val", "sub", "empty", Vec::new()).await.unwrap();
    assert_eq!(kv.read("val", "sub", "empty").await.unwrap(), Vec::<u8>::new());
    let big: Vec<u8> = (0..5 * 1024 * 1024 + 7).map(|i| (i * 31 % 251) as u8).collect();
    kv.write("val", "sub", "big", big.clone()).await.unwrap();
    assert!(kv.read("val", "sub", "big").await.unwrap() == big, "multi-MiB value round trip");
    let binary: Vec<u8> = (0..=255).collect();
    kv.write("val", "sub", "binary", binary.clone()).await.unwrap();
    assert_eq!(kv.read("val", "sub", "binary").await.unwrap(), binary);
}

pub async fn check_remove(kv: &dyn Kv) {
    kv.write("rm", "sub", "k", b"x".to_vec()).await.unwrap();
    kv.remove("rm", "sub", "k").await.unwrap();
    let e = kv.read("rm", "sub", "k").await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::NotFound, "{e}");
    // Removing a missing key, or one in an unknown namespace, is Ok.
    kv.remove("rm", "sub", "k").await.unwrap();
    kv.remove("rm-never-used", "x", "y").await.unwrap();
    assert!(kv.list("rm", "sub").await.unwrap().is_empty());
}

pub async fn check_list(kv: &dyn Kv) {
    assert!(kv.list("ls-unknown", "none").await.unwrap().is_empty());
    for k in ["b", "a", "c"] {
        kv.write("ls", "sub", k, k.as_bytes().to_vec()).await.unwrap();
    }
    kv.write("ls", "other", "z", vec![]).await.unwrap();
    let keys: BTreeSet<String> = kv.list("ls", "sub").await.unwrap().into_iter().collect();
    assert_eq!(keys, ["a", "b", "c"].map(String::from).into());
}

/// Pages are newest-created first; an overwrite keeps the key's place; every key comes exactly
/// once, in pages of the configured size.
pub async fn check_pagination(kv: &dyn Kv) {
    let page = kv.caps().page_size;
    let n = page * 2 + 3;
    let (p, empty) = kv.list_page("pg-unknown", "x", None).await.unwrap();
    assert!(p.is_empty() && empty.is_none());
    for i in 0..n {
        kv.write("pg", "sub", &format!("k{i:04}"), vec![i as u8]).await.unwrap();
    }
    kv.write("pg", "sub", "k0000", b"overwritten".to_vec()).await.unwrap();
    let mut seen = Vec::new();
    let mut token = None;
    let mut pages = 0;
    loop {
        let (keys, next) = kv.list_page("pg", "sub", token).await.unwrap();
        assert!(keys.len() <= page);
        seen.extend(keys);
        pages += 1;
        match next {
            Some(next) => token = Some(next),
            None => break,
        }
        assert!(pages <= n, "pagination does not end");
    }
    let expected: Vec<String> = (0..n).rev().map(|i| format!("k{i:04}")).collect();
    assert_eq!(seen, expected, "newest-created first, each key once");
    assert_eq!(pages, 3);
}

/// Deleting keys between pages neither repeats nor skips a surviving key, and keys created
/// after the listing started do not appear in its later pages.
pub async fn check_pagination_with_deletions(kv: &dyn Kv) {
    let page = kv.caps().page_size;
    let n = page * 3;
    for i in 0..n {
        kv.write("pgd", "sub", &format!("k{i:04}"), vec![]).await.unwrap();
    }
    let (first, token) = kv.list_page("pgd", "sub", None).await.unwrap();
    let mut token = token.expect("more pages");
    // Delete the last key of the first page (the token's anchor) and some keys ahead.
    kv.remove("pgd", "sub", first.last().unwrap()).await.unwrap();
    let mut deleted: BTreeSet<String> = BTreeSet::new();
    for i in (0..n - page).step_by(3) {
        let k = format!("k{i:04}");
        kv.remove("pgd", "sub", &k).await.unwrap();
        deleted.insert(k);
    }
    for i in 0..3 {
        kv.write("pgd", "sub", &format!("new{i}"), vec![]).await.unwrap();
    }
    let mut rest = Vec::new();
    loop {
        let (keys, next) = kv.list_page("pgd", "sub", Some(token)).await.unwrap();
        rest.extend(keys);
        match next {
            Some(next) => token = next,
            None => break,
        }
    }
    let expected: Vec<String> =
        (0..n - page).rev().map(|i| format!("k{i:04}")).filter(|k| !deleted.contains(k)).collect();
    assert_eq!(rest, expected);
}

/// Invalid keys, namespaces and page tokens get `InvalidInput` (a `pgfence::Error::InvalidKey`
/// inside for names), from every operation, and nothing is written.
pub async fn check_invalid_input(kv: &dyn Kv) {
    let long = "k".repeat(121);
    for key in ["", long.as_str(), "é", "a/b", "a\0b", "a'b", "a\"b", "a b"] {
        let e = kv.write("inv", "sub", key, vec![1]).await.unwrap_err();
        assert_invalid_key(&e, &format!("write {key:?}"));
        let e = kv.read("inv", "sub", key).await.unwrap_err();
        assert_invalid_key(&e, &format!("read {key:?}"));
        let e = kv.remove("inv", "sub", key).await.unwrap_err();
        assert_invalid_key(&e, &format!("remove {key:?}"));
    }
    for (p, s) in [("inv/", "sub"), ("inv", "s b"), (long.as_str(), "sub"), ("inv", long.as_str())]
    {
        let e = kv.write(p, s, "k", vec![1]).await.unwrap_err();
        assert_invalid_key(&e, &format!("write in {p:?}/{s:?}"));
        let e = kv.list(p, s).await.unwrap_err();
        assert_invalid_key(&e, &format!("list {p:?}/{s:?}"));
        let e = kv.list_page(p, s, None).await.unwrap_err();
        assert_invalid_key(&e, &format!("list_page {p:?}/{s:?}"));
    }
    let e = kv.list_page("inv", "sub", Some("not-a-token".into())).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
    assert!(kv.list("inv", "sub").await.unwrap().is_empty(), "nothing was written");
}

fn assert_invalid_key(e: &io::Error, what: &str) {
    assert_eq!(e.kind(), ErrorKind::InvalidInput, "{what}: {e}");
    let inner = pgfence_error(e);
    assert!(matches!(inner, Some(pgfence::Error::InvalidKey { .. })), "{what}: {e:?}");
}

pub async fn check_list_all_keys(kv: &dyn Kv) {
    let all = kv.list_all().await.unwrap();
    let set: BTreeSet<(String, String, String)> = all.iter().cloned().collect();
    assert_eq!(set.len(), all.len(), "no duplicates");
    for (p, s, k) in
        [("rt", "sub", "k1"), ("rt", "other", "k1"), ("", "", "top"), ("en", "", "mid")]
    {
        assert!(set.contains(&(p.into(), s.into(), k.into())), "{p}/{s}/{k} listed");
    }
    assert!(!set.contains(&("rm".into(), "sub".into(), "k".into())), "removed keys are gone");
    assert!(!all.iter().any(|(p, _, _)| p.starts_with("inv")), "invalid input wrote nothing");
    // Every listed key reads back.
    for (p, s, k) in all.iter().take(50) {
        kv.read(p, s, k).await.unwrap();
    }
}

/// Per-key order. Where futures take their place at the call ([`Caps::ordered_at_call`]):
/// a thousand writes of one key, awaited in random order (some at once, some one by one), end
/// with the last call's value, and writes and removes awaited latest-called first end in the
/// last call's state. Elsewhere, calls in sequence end in the last call's state.
pub async fn check_write_order(kv: &dyn Kv) {
    if kv.caps().ordered_at_call {
        let mut futures: Vec<_> = (0..1000u32)
            .map(|i| (i, kv.write("ord", "sub", "k", i.to_be_bytes().to_vec())))
            .collect();
        futures.shuffle(&mut rand::rng());
        let mut joins = Vec::new();
        for (n, (_, fut)) in futures.into_iter().enumerate() {
            if n % 2 == 0 {
                joins.push(tokio::spawn(fut));
            } else {
                fut.await.unwrap();
            }
        }
        for join in joins {
            join.await.unwrap().unwrap();
        }
        let value = kv.read("ord", "sub", "k").await.unwrap();
        assert_eq!(value, 999u32.to_be_bytes().to_vec(), "the last call's value wins");
    }
    for round in 0..12u32 {
        let key = format!("k{round}");
        // Alternate write/remove; the last call is a remove on even rounds, a write on odd.
        let calls = 6 + (round % 2);
        let call = |c: u32| match c % 2 {
            0 => kv.write("ordrm", "s", &key, vec![c as u8]),
            _ => kv.remove("ordrm", "s", &key),
        };
        if kv.caps().ordered_at_call {
            let mut futures: Vec<_> = (0..calls).map(call).collect();
            futures.reverse(); // Poll the latest call first: the worst case for ordering.
            if round % 2 == 0 {
                for fut in futures {
                    fut.await.unwrap();
                }
            } else {
                let joins: Vec<_> = futures.into_iter().map(tokio::spawn).collect();
                for join in joins {
                    join.await.unwrap().unwrap();
                }
            }
        } else {
            for c in 0..calls {
                call(c).await.unwrap();
            }
        }
        let last = calls - 1;
        let got = kv.read("ordrm", "s", &key).await;
        match last % 2 {
            0 => assert_eq!(got.unwrap(), vec![last as u8], "round {round}: last call a write"),
            _ => {
                let e = got.unwrap_err();
                assert_eq!(e.kind(), ErrorKind::NotFound, "round {round}: last call a remove");
            }
        }
    }
}

/// While one store holds the lease, opening another on the table fails with `LeaseHeld`
/// (`AlreadyExists`), and the holder is unaffected.
pub async fn check_lease_held_at_open(setup: &Setup) {
    let table = setup.table("held");
    let first = setup.open(&table).await;
    first.write("h", "s", "k", b"v".to_vec()).await.unwrap();
    let e = setup.open_with(setup.long_lease(&table)).await.err().expect("lease held");
    assert_eq!(e.kind(), ErrorKind::AlreadyExists, "{e}");
    assert!(pgfence_error(&e).is_some_and(pgfence::Error::is_lease_held), "{e:?}");
    first.write("h", "s", "k", b"still mine".to_vec()).await.unwrap();
    assert_eq!(first.read("h", "s", "k").await.unwrap(), b"still mine");
    first.close().await.unwrap();
}

/// A closed store refuses every operation with `Closed` (`NotConnected`), also for futures made
/// before the close and awaited after it, closing again is `Ok`, and the lease was released: a
/// successor opens at once with the next epoch and reads what the store wrote.
pub async fn check_close_releases(setup: &Setup) {
    let table = setup.table("close");
    let kv = setup.open(&table).await;
    let epoch = kv.fencing_token();
    kv.write("c", "s", "k", b"v".to_vec()).await.unwrap();
    let early = kv.caps().lazy.then(|| kv.write("c", "s", "early", vec![]));
    kv.close().await.expect("close returns the release's result");
    if let Some(early) = early {
        assert_closed(early.await, "a write called before close, awaited after it");
    }
    assert_closed(kv.write("c", "s", "k", b"w".to_vec()).await, "write");
    assert_closed(kv.remove("c", "s", "k").await, "remove");
    assert_closed(kv.read("c", "s", "k").await, "read");
    assert_closed(kv.list("c", "s").await, "list");
    assert_closed(kv.list_page("c", "s", None).await, "list_page");
    assert_closed(kv.list_all().await, "list_all");
    kv.close().await.expect("closing again is Ok");
    let next = setup.open(&table).await;
    assert_eq!(next.fencing_token(), epoch + 1);
    assert_eq!(next.read("c", "s", "k").await.unwrap(), b"v");
    assert!(next.list("c", "s").await.unwrap() == ["k"], "nothing written after close");
    next.close().await.unwrap();
}

fn assert_closed<T: std::fmt::Debug>(result: io::Result<T>, what: &str) {
    let e = result.expect_err(what);
    assert_eq!(e.kind(), ErrorKind::NotConnected, "{what}: {e}");
    assert!(matches!(pgfence_error(&e), Some(pgfence::Error::Closed)), "{what}: {e:?}");
}

/// Dropping the last handle releases the lease: a successor opens at once and reads the data.
pub async fn check_drop_releases(setup: &Setup) {
    let table = setup.table("drop");
    let kv = setup.open(&table).await;
    let epoch = kv.fencing_token();
    kv.write("d", "s", "k", b"v".to_vec()).await.unwrap();
    drop(kv);
    let next = setup.open_with(setup.long_lease(&table)).await.expect("released on drop");
    assert_eq!(next.fencing_token(), epoch + 1);
    assert_eq!(next.read("d", "s", "k").await.unwrap(), b"v");
    next.close().await.unwrap();
}

/// A store whose lease expired and was taken over by a successor of the same facade can no
/// longer change anything: its writes, removes and reads fail with `LeaseLost`
/// (`PermissionDenied`), and the successor sees only its own and the earlier writes.
pub async fn check_fencing_after_takeover(setup: &Setup) {
    let table = setup.table("fence");
    let old = setup.open(&table).await;
    old.write("f", "s", "k", b"before".to_vec()).await.unwrap();
    old.write("f", "s", "gone", b"x".to_vec()).await.unwrap();
    expire_lease(&table).await;
    let successor = setup.open(&table).await;
    assert!(successor.fencing_token() > old.fencing_token());
    assert_lease_lost(old.write("f", "s", "k", b"late".to_vec()).await, "write after takeover");
    assert_lease_lost(old.remove("f", "s", "gone").await, "remove after takeover");
    assert_lease_lost(old.write("f", "s", "new", vec![]).await, "write of a new key");
    assert_eq!(successor.read("f", "s", "k").await.unwrap(), b"before");
    successor.write("f", "s", "k", b"successor".to_vec()).await.unwrap();
    assert_lease_lost(old.write("f", "s", "k", b"later".to_vec()).await, "write after that");
    assert_eq!(
        rows(&table, "f").await,
        [("gone".to_owned(), b"x".to_vec()), ("k".to_owned(), b"successor".to_vec())],
        "only the successor's and the earlier writes are in the table"
    );
    drop(old); // Releases by owner id: it cannot touch the successor's lease.
    successor.write("f", "s", "k", b"still held".to_vec()).await.unwrap();
    successor.close().await.unwrap();
}

/// Fail closed: once the lease is lost, every operation (reads and lists too) returns
/// `LeaseLost`, permanently: also after the lease is free again and nobody holds it.
pub async fn check_fail_closed_after_loss(setup: &Setup) {
    let table = setup.table("lost");
    let kv = setup.open(&table).await;
    kv.write("l", "s", "k", b"v".to_vec()).await.unwrap();
    expire_lease(&table).await;
    let successor = setup.open(&table).await;
    for round in ["while a successor holds the lease", "after the successor closed"] {
        assert_lease_lost(kv.write("l", "s", "k", b"late".to_vec()).await, round);
        assert_lease_lost(kv.remove("l", "s", "k").await, round);
        assert_lease_lost(kv.read("l", "s", "k").await, round);
        assert_lease_lost(kv.list("l", "s").await, round);
        assert_lease_lost(kv.list_page("l", "s", None).await, round);
        assert_lease_lost(kv.list_all().await, round);
        if round.starts_with("while") {
            successor.close().await.unwrap();
        }
    }
    assert_eq!(rows(&table, "l").await, [("k".to_owned(), b"v".to_vec())]);
    // Closing a store that lost its lease releases nothing of anyone else's.
    let _ = kv.close().await;
    let next = setup.open(&table).await;
    assert_eq!(next.read("l", "s", "k").await.unwrap(), b"v");
    next.close().await.unwrap();
}

/// Where futures are lazy ([`Caps::lazy`]): a call superseded by a later call of its key skips
/// the database, but once the lease is lost it still fails with `LeaseLost`. `Ok` would tell
/// the caller that its change (or its own later one) stands, when a successor may already
/// have overwritten the key.
pub async fn check_superseded_calls_fail_closed(setup: &Setup) {
    let table = setup.table("super");
    let kv = setup.open(&table).await;
    if !kv.caps().lazy {
        kv.close().await.unwrap();
        return;
    }
    // Calls, in this order; only the last one is awaited before the loss.
    let earlier_write = kv.write("o", "s", "k", b"earlier".to_vec());
    let earlier_remove = kv.remove("o", "s", "k");
    kv.write("o", "s", "k", b"later".to_vec()).await.unwrap();
    expire_lease(&table).await;
    let successor = setup.open(&table).await;
    assert_lease_lost(kv.write("o", "s", "other", vec![]).await, "write after the takeover");
    assert_lease_lost(earlier_write.await, "superseded write");
    assert_lease_lost(earlier_remove.await, "superseded remove");
    assert_eq!(successor.read("o", "s", "k").await.unwrap(), b"later");
    successor.close().await.unwrap();
}

/// The fence: a write in flight when its store's lease expires either commits before a
/// successor acquires the lease (and the successor reads it) or fails with `LeaseLost`; it
/// never commits after. The successor's open waits for the write's statement to end.
pub async fn check_fencing_of_a_write_in_flight(setup: &Setup) {
    let table = setup.table("flight");
    let kv = setup.open(&table).await;
    kv.write("f", "s", "k", b"old".to_vec()).await.unwrap();
    // Hold the key's row so the write waits inside its statement, after its lease check.
    let blocker = Blocker::lock_key(&table, "k").await;
    let write = start(kv.caps(), kv.write("f", "s", "k", b"in-flight".to_vec()));
    // Any statement on the table (a single write or a batch) waiting for a lock is this one.
    // Where the store does not own its sessions, a single write is a call of the table's
    // function, whose quoted name starts like the table's.
    wait_for_lock_wait(format!("%{}%", table.kv.trim_end_matches('"'))).await;
    expire_lease(&table).await;
    let successor = start(kv.caps(), setup.open_with(setup.long_lease(&table)));
    wait_for_the_takeover_at_the_fence(&table).await;
    blocker.release().await;
    let written = write.await;
    let successor = successor.await.expect("the successor opens once the write ended");
    let seen = successor.read("f", "s", "k").await.unwrap();
    match written {
        Ok(()) => assert_eq!(seen, b"in-flight", "an Ok write committed before the takeover"),
        Err(e) => {
            assert_lease_lost::<()>(Err(e), "a write in flight that did not commit");
            assert_eq!(seen, b"old", "a failed write changed nothing");
        }
    }
    assert_lease_lost(kv.write("f", "s", "k", b"late".to_vec()).await, "write after takeover");
    assert_eq!(successor.read("f", "s", "k").await.unwrap(), seen);
    successor.close().await.unwrap();
}

/// Runs `fut` without blocking the caller: on the current tokio runtime for an async facade
/// ([`Caps::ordered_at_call`]), on a thread of its own for a blocking one.
fn start<T: Send + 'static>(caps: Caps, fut: BoxFut<'static, T>) -> BoxFut<'static, T> {
    if caps.ordered_at_call {
        let task = tokio::spawn(fut);
        Box::pin(async move { task.await.expect("task") })
    } else {
        on_own_thread(fut)
    }
}

/// Polls `fut` to the end on a fresh thread with no runtime; the returned future awaits it.
fn on_own_thread<T: Send + 'static>(fut: BoxFut<'static, T>) -> BoxFut<'static, T> {
    let (done, result) = tokio::sync::oneshot::channel();
    std::thread::spawn(move || {
        let output = panic::catch_unwind(AssertUnwindSafe(|| block_on(fut)));
        let _ = done.send(output);
    });
    Box::pin(async move {
        match result.await.expect("the thread sends before it ends") {
            Ok(output) => output,
            Err(panic) => panic::resume_unwind(panic),
        }
    })
}

/// Runs the future made by `make` on a fresh thread with a current-thread runtime of its own,
/// for probes of the database from any context (a plain thread, either kind of runtime). The
/// returned future awaits it, resuming its panic.
pub fn on_own_runtime<F, T>(
    make: impl FnOnce() -> F + Send + 'static,
) -> impl Future<Output = T> + Send + 'static
where
    F: Future<Output = T> + 'static,
    T: Send + 'static,
{
    let (done, result) = tokio::sync::oneshot::channel();
    std::thread::spawn(move || {
        let output = panic::catch_unwind(AssertUnwindSafe(|| {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("probe runtime");
            runtime.block_on(make())
        }));
        let _ = done.send(output);
    });
    async move {
        match result.await.expect("the thread sends before it ends") {
            Ok(output) => output,
            Err(panic) => panic::resume_unwind(panic),
        }
    }
}

/// A minimal executor for one future on the calling thread, with no runtime of any kind: the
/// "plain thread" of an application without async. Also used by tests/suite/sync_support.rs.
pub fn block_on<F: Future>(future: F) -> F::Output {
    struct Unparker(std::thread::Thread);
    impl std::task::Wake for Unparker {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let mut future = std::pin::pin!(future);
    let waker = std::task::Waker::from(Arc::new(Unparker(std::thread::current())));
    let mut cx = std::task::Context::from_waker(&waker);
    loop {
        if let std::task::Poll::Ready(output) = future.as_mut().poll(&mut cx) {
            return output;
        }
        std::thread::park();
    }
}

/// Ends the lease of `table`'s holder now, as an expiry would (only `expires_at` changes: the
/// holder's renewal then finds it lost, and a successor may acquire it).
pub async fn expire_lease(table: &Table) {
    let sql = format!("UPDATE {} SET expires_at = clock_timestamp() WHERE id = 1", table.lease);
    on_own_runtime(move || async move {
        let n = super::admin().await.execute(&sql, &[]).await.expect("expire the lease");
        assert_eq!(n, 1, "the lease row exists");
    })
    .await
}

/// Every `(key, value)` of the primary namespace `p` of `table`, sorted by key, read by an
/// administrator connection.
pub async fn rows(table: &Table, p: &str) -> Vec<(String, Vec<u8>)> {
    let sql =
        format!("SELECT key, value FROM {} WHERE primary_namespace = $1 ORDER BY key", table.kv);
    let p = p.to_owned();
    on_own_runtime(move || async move {
        let admin = super::admin().await;
        let rows = admin.query(&sql, &[&p]).await.expect("read rows");
        rows.iter().map(|row| (row.get(0), row.get(1))).collect()
    })
    .await
}

async fn wait_for_lock_wait(query_like: String) {
    on_own_runtime(move || async move { super::wait_for_query_lock_wait(&query_like).await }).await
}

/// Waits until a statement on the lease table of `table` alone (an acquisition, not a
/// mutation, which names the KV table too) waits for a lock.
async fn wait_for_the_takeover_at_the_fence(table: &Table) {
    let (lease, kv) = (format!("%{}%", table.lease), format!("%{}%", table.kv));
    on_own_runtime(move || async move {
        let sql = "SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock'
                    AND query LIKE $1 AND query NOT LIKE $2";
        super::wait_for_row("the takeover waiting at the fence", sql, &[&lease, &kv]).await
    })
    .await
}

/// A transaction of an administrator that holds a row lock, on a thread of its own, until
/// [`Blocker::release`].
struct Blocker {
    release: tokio::sync::oneshot::Sender<()>,
    done: Pin<Box<dyn Future<Output = ()> + Send>>,
}

impl Blocker {
    /// Holds the row of `key` in `table` `FOR UPDATE`: a write of the key waits inside its
    /// statement, after its lease check, holding its `FOR KEY SHARE` lock on the lease row.
    async fn lock_key(table: &Table, key: &str) -> Blocker {
        let sql = format!("SELECT 1 FROM {} WHERE key = $1 FOR UPDATE", table.kv);
        let key = key.to_owned();
        let (locked, is_locked) = tokio::sync::oneshot::channel();
        let (release, released) = tokio::sync::oneshot::channel::<()>();
        let done = on_own_runtime(move || async move {
            let mut admin = super::admin().await;
            let tx = admin.transaction().await.unwrap();
            tx.query_one(&sql, &[&key]).await.expect("lock the key's row");
            let _ = locked.send(());
            let _ = released.await;
            tx.rollback().await.unwrap();
        });
        let done: Pin<Box<dyn Future<Output = ()> + Send>> = Box::pin(done);
        is_locked.await.expect("the blocker locked the row");
        Blocker { release, done }
    }

    async fn release(self) {
        let _ = self.release.send(());
        self.done.await;
    }
}

/// The `pgfence::Error` inside an `io::Error` of any facade.
pub fn pgfence_error(e: &io::Error) -> Option<&pgfence::Error> {
    e.get_ref().and_then(|inner| inner.downcast_ref::<pgfence::Error>())
}

fn assert_lease_lost<T: std::fmt::Debug>(result: io::Result<T>, what: &str) {
    let e = result.expect_err(what);
    assert_eq!(e.kind(), ErrorKind::PermissionDenied, "{what}: {e}");
    assert!(pgfence_error(&e).is_some_and(pgfence::Error::is_lease_lost), "{what}: {e:?}");
}

/// The inherent async API of `PgKvStore`.
pub struct Native;

/// An open store of [`Native`].
pub struct NativeKv(pub pgfence::PgKvStore, pub usize);

impl Facade for Native {
    fn open(&self, builder: Builder, page: usize) -> BoxFut<'static, Box<dyn Kv>> {
        Box::pin(async move {
            let store = builder.open().await?;
            Ok(Box::new(NativeKv(store, page)) as Box<dyn Kv>)
        })
    }
}

impl Kv for NativeKv {
    fn caps(&self) -> Caps {
        Caps { ordered_at_call: true, lazy: true, page_size: self.1 }
    }
    fn read<'a>(&'a self, p: &'a str, s: &'a str, k: &'a str) -> BoxFut<'a, Vec<u8>> {
        Box::pin(async move { Ok(self.0.read(p, s, k).await?) })
    }
    fn write(&self, p: &str, s: &str, k: &str, v: Vec<u8>) -> BoxFut<'static, ()> {
        let fut = self.0.write(p, s, k, v);
        Box::pin(async move { Ok(fut.await?) })
    }
    fn remove(&self, p: &str, s: &str, k: &str) -> BoxFut<'static, ()> {
        let fut = self.0.remove(p, s, k, false);
        Box::pin(async move { Ok(fut.await?) })
    }
    fn list<'a>(&'a self, p: &'a str, s: &'a str) -> BoxFut<'a, Vec<String>> {
        Box::pin(async move { Ok(self.0.list(p, s).await?) })
    }
    fn list_page<'a>(
        &'a self,
        p: &'a str,
        s: &'a str,
        token: Option<String>,
    ) -> BoxFut<'a, PageOut> {
        Box::pin(async move {
            let page = self.0.list_paginated(p, s, token.map(pgfence::PageToken::new)).await?;
            Ok((page.keys, page.next_page_token.map(|t| t.as_str().to_owned())))
        })
    }
    fn list_all(&self) -> BoxFut<'_, Vec<(String, String, String)>> {
        Box::pin(async move { Ok(self.0.list_all_keys().await?) })
    }
    fn fencing_token(&self) -> i64 {
        self.0.fencing_token()
    }
    fn close(&self) -> BoxFut<'_, ()> {
        Box::pin(async move { Ok(self.0.close().await?) })
    }
}

/// `PgKvStore`'s atomic batches: `write` and `remove` calls cycle through three shapes, a
/// `Batch` of the key alone, a `Batch` of the key and a put of a scratch key, and the plain
/// single-key call, so both batch statements run every check and the order checks mix batches
/// with single calls of the same key. Reads and lists are the inherent API's.
pub struct Batches;

/// An open store of [`Batches`].
pub struct BatchKv {
    native: NativeKv,
    calls: AtomicUsize,
}

impl Facade for Batches {
    fn open(&self, builder: Builder, page: usize) -> BoxFut<'static, Box<dyn Kv>> {
        Box::pin(async move {
            let native = NativeKv(builder.open().await?, page);
            Ok(Box::new(BatchKv { native, calls: AtomicUsize::new(0) }) as Box<dyn Kv>)
        })
    }
}

/// The scratch namespace of [`Batches`]: the second key of its two-key batches.
const SCRATCH: &str = "batch-scratch";

impl BatchKv {
    /// The batch of the next call, or `None` for a plain single-key call.
    fn batch(&self) -> Option<pgfence::Batch> {
        let batch = self.native.0.batch();
        match self.calls.fetch_add(1, Ordering::Relaxed) % 3 {
            0 => Some(batch),
            1 => Some(batch.put(SCRATCH, "", "k", vec![])),
            _ => None,
        }
    }
}

impl Kv for BatchKv {
    fn caps(&self) -> Caps {
        self.native.caps()
    }
    fn read<'a>(&'a self, p: &'a str, s: &'a str, k: &'a str) -> BoxFut<'a, Vec<u8>> {
        self.native.read(p, s, k)
    }
    fn write(&self, p: &str, s: &str, k: &str, v: Vec<u8>) -> BoxFut<'static, ()> {
        match self.batch() {
            Some(batch) => {
                let fut = batch.put(p, s, k, v).commit();
                Box::pin(async move { Ok(fut.await?) })
            }
            None => self.native.write(p, s, k, v),
        }
    }
    fn remove(&self, p: &str, s: &str, k: &str) -> BoxFut<'static, ()> {
        match self.batch() {
            Some(batch) => {
                let fut = batch.remove(p, s, k).commit();
                Box::pin(async move { Ok(fut.await?) })
            }
            None => self.native.remove(p, s, k),
        }
    }
    fn list<'a>(&'a self, p: &'a str, s: &'a str) -> BoxFut<'a, Vec<String>> {
        self.native.list(p, s)
    }
    fn list_page<'a>(
        &'a self,
        p: &'a str,
        s: &'a str,
        token: Option<String>,
    ) -> BoxFut<'a, PageOut> {
        self.native.list_page(p, s, token)
    }
    fn list_all(&self) -> BoxFut<'_, Vec<(String, String, String)>> {
        // The scratch key is the facade's, not the checks': leave it out.
        Box::pin(async move {
            let mut all = self.native.list_all().await?;
            all.retain(|(p, _, _)| p != SCRATCH);
            Ok(all)
        })
    }
    fn fencing_token(&self) -> i64 {
        self.native.fencing_token()
    }
    fn close(&self) -> BoxFut<'_, ()> {
        self.native.close()
    }
}

/// A store whose calls block until done: `pgfence::blocking::PgKvStore`, and `LdkStore` through
/// the sync traits of either `lightning` line. [`Blocking`] makes any of them a [`Facade`].
pub trait BlockingStore: Clone + Send + Sync + 'static {
    fn read(&self, p: &str, s: &str, k: &str) -> io::Result<Vec<u8>>;
    fn write(&self, p: &str, s: &str, k: &str, v: Vec<u8>) -> io::Result<()>;
    fn remove(&self, p: &str, s: &str, k: &str) -> io::Result<()>;
    fn list(&self, p: &str, s: &str) -> io::Result<Vec<String>>;
    fn list_page(&self, p: &str, s: &str, token: Option<String>) -> io::Result<PageOut>;
    fn list_all(&self) -> io::Result<Vec<(String, String, String)>>;
    fn fencing_token(&self) -> i64;
    fn close(&self) -> io::Result<()>;
}

/// The facade of a [`BlockingStore`], opened with the blocking function it holds. Every call,
/// the opening included, blocks inside its future, in whatever context polls it.
pub struct Blocking<S>(pub fn(Builder) -> pgfence::Result<S>);

/// An open store of [`Blocking`].
pub struct BlockingKv<S>(S, usize);

impl<S: BlockingStore> Facade for Blocking<S> {
    fn open(&self, builder: Builder, page: usize) -> BoxFut<'static, Box<dyn Kv>> {
        let open = self.0;
        Box::pin(async move { Ok(Box::new(BlockingKv(open(builder)?, page)) as Box<dyn Kv>) })
    }
}

impl<S: BlockingStore> Kv for BlockingKv<S> {
    fn caps(&self) -> Caps {
        // A call takes its place in the key's order when it runs: when its future is polled.
        Caps { ordered_at_call: false, lazy: false, page_size: self.1 }
    }
    fn read<'a>(&'a self, p: &'a str, s: &'a str, k: &'a str) -> BoxFut<'a, Vec<u8>> {
        Box::pin(async move { self.0.read(p, s, k) })
    }
    fn write(&self, p: &str, s: &str, k: &str, v: Vec<u8>) -> BoxFut<'static, ()> {
        let (store, p, s, k) = (self.0.clone(), p.to_owned(), s.to_owned(), k.to_owned());
        Box::pin(async move { store.write(&p, &s, &k, v) })
    }
    fn remove(&self, p: &str, s: &str, k: &str) -> BoxFut<'static, ()> {
        let (store, p, s, k) = (self.0.clone(), p.to_owned(), s.to_owned(), k.to_owned());
        Box::pin(async move { store.remove(&p, &s, &k) })
    }
    fn list<'a>(&'a self, p: &'a str, s: &'a str) -> BoxFut<'a, Vec<String>> {
        Box::pin(async move { self.0.list(p, s) })
    }
    fn list_page<'a>(
        &'a self,
        p: &'a str,
        s: &'a str,
        token: Option<String>,
    ) -> BoxFut<'a, PageOut> {
        Box::pin(async move { self.0.list_page(p, s, token) })
    }
    fn list_all(&self) -> BoxFut<'_, Vec<(String, String, String)>> {
        Box::pin(async move { self.0.list_all() })
    }
    fn fencing_token(&self) -> i64 {
        self.0.fencing_token()
    }
    fn close(&self) -> BoxFut<'_, ()> {
        Box::pin(async move { self.0.close() })
    }
}
