//! The conformance suite: reusable checks of the store contract, run against every way of
//! reaching a store (inherent async API, pool sizes, schema-qualified tables, and the other
//! facades). Each configuration wraps its store in a [`Kv`] and calls [`check_all`].
//!
//! Errors are compared as `std::io::Error` kinds, the common language of every facade.

use std::collections::BTreeSet;
use std::future::Future;
use std::io::{self, ErrorKind};
use std::pin::Pin;

/// A boxed future, so facades of any shape (async, blocking-in-spawn_blocking, LDK) fit.
pub type BoxFut<'a, T> = Pin<Box<dyn Future<Output = io::Result<T>> + Send + 'a>>;

/// One page of a paginated listing: keys and the next token.
pub type PageOut = (Vec<String>, Option<String>);

/// The contract under test, as each facade exposes it.
pub trait Kv: Send + Sync {
    fn read<'a>(&'a self, p: &'a str, s: &'a str, k: &'a str) -> BoxFut<'a, Vec<u8>>;
    fn write<'a>(&'a self, p: &'a str, s: &'a str, k: &'a str, v: Vec<u8>) -> BoxFut<'a, ()>;
    fn remove<'a>(&'a self, p: &'a str, s: &'a str, k: &'a str) -> BoxFut<'a, ()>;
    fn list<'a>(&'a self, p: &'a str, s: &'a str) -> BoxFut<'a, Vec<String>>;
    fn list_page<'a>(
        &'a self,
        p: &'a str,
        s: &'a str,
        token: Option<String>,
    ) -> BoxFut<'a, PageOut>;
    fn list_all<'a>(&'a self) -> BoxFut<'a, Vec<(String, String, String)>>;
    /// Keys per page the store was configured with.
    fn page_size(&self) -> usize;
}

/// The inherent async API of `PgKvStore`.
pub struct Native(pub pgfence::PgKvStore, pub usize);

impl Kv for Native {
    fn read<'a>(&'a self, p: &'a str, s: &'a str, k: &'a str) -> BoxFut<'a, Vec<u8>> {
        Box::pin(async move { Ok(self.0.read(p, s, k).await?) })
    }
    fn write<'a>(&'a self, p: &'a str, s: &'a str, k: &'a str, v: Vec<u8>) -> BoxFut<'a, ()> {
        let fut = self.0.write(p, s, k, v);
        Box::pin(async move { Ok(fut.await?) })
    }
    fn remove<'a>(&'a self, p: &'a str, s: &'a str, k: &'a str) -> BoxFut<'a, ()> {
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
    fn list_all<'a>(&'a self) -> BoxFut<'a, Vec<(String, String, String)>> {
        Box::pin(async move { Ok(self.0.list_all_keys().await?) })
    }
    fn page_size(&self) -> usize {
        self.1
    }
}

/// Runs every check. Each check uses its own namespace, so they do not see each other's keys;
/// `list_all` is checked last, against everything the others left behind.
pub async fn check_all(kv: &dyn Kv) {
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

/// Pages are newest-created first; an overwrite keeps the key's place.
pub async fn check_pagination(kv: &dyn Kv) {
    let n = kv.page_size() * 2 + 3;
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
        assert!(keys.len() <= kv.page_size());
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
    let n = kv.page_size() * 3;
    for i in 0..n {
        kv.write("pgd", "sub", &format!("k{i:04}"), vec![]).await.unwrap();
    }
    let (first, token) = kv.list_page("pgd", "sub", None).await.unwrap();
    let mut token = token.expect("more pages");
    // Delete the last key of the first page (the token's anchor) and some keys ahead.
    kv.remove("pgd", "sub", first.last().unwrap()).await.unwrap();
    let mut deleted: BTreeSet<String> = BTreeSet::new();
    for i in (0..n - kv.page_size()).step_by(3) {
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
    let expected: Vec<String> = (0..n - kv.page_size())
        .rev()
        .map(|i| format!("k{i:04}"))
        .filter(|k| !deleted.contains(k))
        .collect();
    assert_eq!(rest, expected);
}

pub async fn check_invalid_input(kv: &dyn Kv) {
    let long = "k".repeat(121);
    for key in ["", long.as_str(), "é", "a/b", "a\0b", "a'b", "a\"b", "a b"] {
        let e = kv.write("inv", "sub", key, vec![1]).await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidInput, "write {key:?}: {e}");
        let e = kv.read("inv", "sub", key).await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidInput, "read {key:?}: {e}");
        let e = kv.remove("inv", "sub", key).await.unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidInput, "remove {key:?}: {e}");
    }
    let e = kv.list("inv/", "sub").await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
    let e = kv.list_page("inv", "sub", Some("not-a-token".into())).await.unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidInput, "{e}");
    assert!(kv.list("inv", "sub").await.unwrap().is_empty(), "nothing was written");
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
    // Every listed key reads back.
    for (p, s, k) in all.iter().take(50) {
        kv.read(p, s, k).await.unwrap();
    }
}
