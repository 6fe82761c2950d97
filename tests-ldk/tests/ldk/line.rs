//! `LdkStore` through one `lightning` line's traits, for the conformance suite: its facades and
//! the tests that run the suite through them, and a migration round trip through LDK's
//! `FilesystemStore`, written once for both lines
//! ([`ldk_line_conformance`]). ldk.rs (0.3) and ldk_0_2.rs (0.2) each
//! expand it with their line's traits in scope.

/// The conformance facades and tests of `LdkStore` through one `lightning` line.
///
/// Expanded in a module of tests/ldk that imports its line's `KVStore`, `KVStoreSync` and
/// `KVStoreSyncWrapper`, and defines the two listings whose traits differ between the lines:
/// `fn page(&LdkStore, &str, &str, Option<String>) -> BoxFut<'_, PageOut>` with its blocking
/// twin `page_sync` (`io::Result<PageOut>`), and `fn all_keys(&LdkStore) -> BoxFut<'_, Keys>`
/// with `all_keys_sync`. For the migration round trip it imports its line's `FilesystemStore`,
/// `migrate_kv_store_data`, and its sync `MigratableKVStore` as `MigratableSync`. The module must
/// not import what the expansion imports itself.
#[macro_export]
macro_rules! ldk_line_conformance {
    () => {
        use std::io;
        use std::sync::Arc;
        use std::time::Duration;

        use pgfence::ldk::LdkStore;
        use $crate::common::conformance::{
            Blocking, BlockingStore, BoxFut, Caps, Facade, Kv, PageOut, SUITE_LIMIT, Setup,
            check_contract,
        };
        use $crate::sync_support::{Where, run_in};

        /// Keys per page of most runs: small, so the paging checks turn many pages.
        const PAGE: usize = 7;

        /// The suite through the line's async traits: every call goes through a trait method,
        /// never the inherent API.
        struct AsyncTraits;

        struct AsyncTraitsKv(LdkStore, usize);

        impl Facade for AsyncTraits {
            fn open(&self, builder: pgfence::Builder, page: usize) -> BoxFut<'static, Box<dyn Kv>> {
                Box::pin(async move {
                    Ok(Box::new(AsyncTraitsKv(LdkStore::open_async(builder).await?, page)) as _)
                })
            }
        }

        impl Kv for AsyncTraitsKv {
            fn caps(&self) -> Caps {
                // Ordered at the call, but started at once on the store's runtime: not lazy.
                Caps { ordered_at_call: true, lazy: false, page_size: self.1 }
            }
            fn read<'a>(&'a self, p: &'a str, s: &'a str, k: &'a str) -> BoxFut<'a, Vec<u8>> {
                let fut = KVStore::read(&self.0, p, s, k);
                Box::pin(async move { Ok(fut.await?) })
            }
            fn write(&self, p: &str, s: &str, k: &str, v: Vec<u8>) -> BoxFut<'static, ()> {
                let fut = KVStore::write(&self.0, p, s, k, v);
                Box::pin(async move { Ok(fut.await?) })
            }
            fn remove(&self, p: &str, s: &str, k: &str) -> BoxFut<'static, ()> {
                let fut = KVStore::remove(&self.0, p, s, k, false);
                Box::pin(async move { Ok(fut.await?) })
            }
            fn list<'a>(&'a self, p: &'a str, s: &'a str) -> BoxFut<'a, Vec<String>> {
                let fut = KVStore::list(&self.0, p, s);
                Box::pin(async move { Ok(fut.await?) })
            }
            fn list_page<'a>(
                &'a self,
                p: &'a str,
                s: &'a str,
                token: Option<String>,
            ) -> BoxFut<'a, PageOut> {
                page(&self.0, p, s, token)
            }
            fn list_all(&self) -> BoxFut<'_, Vec<(String, String, String)>> {
                all_keys(&self.0)
            }
            fn fencing_token(&self) -> i64 {
                self.0.fencing_token()
            }
            fn close(&self) -> BoxFut<'_, ()> {
                Box::pin(async move { Ok(self.0.close_async().await?) })
            }
        }

        /// The suite through the line's sync traits. Opened with the blocking `open`.
        #[derive(Clone)]
        struct SyncTraits(LdkStore);

        impl BlockingStore for SyncTraits {
            fn read(&self, p: &str, s: &str, k: &str) -> io::Result<Vec<u8>> {
                Ok(KVStoreSync::read(&self.0, p, s, k)?)
            }
            fn write(&self, p: &str, s: &str, k: &str, v: Vec<u8>) -> io::Result<()> {
                Ok(KVStoreSync::write(&self.0, p, s, k, v)?)
            }
            fn remove(&self, p: &str, s: &str, k: &str) -> io::Result<()> {
                Ok(KVStoreSync::remove(&self.0, p, s, k, false)?)
            }
            fn list(&self, p: &str, s: &str) -> io::Result<Vec<String>> {
                Ok(KVStoreSync::list(&self.0, p, s)?)
            }
            fn list_page(&self, p: &str, s: &str, token: Option<String>) -> io::Result<PageOut> {
                page_sync(&self.0, p, s, token)
            }
            fn list_all(&self) -> io::Result<Vec<(String, String, String)>> {
                all_keys_sync(&self.0)
            }
            fn fencing_token(&self) -> i64 {
                self.0.fencing_token()
            }
            fn close(&self) -> io::Result<()> {
                Ok(self.0.close()?)
            }
        }

        fn open_sync(builder: pgfence::Builder) -> pgfence::Result<SyncTraits> {
            LdkStore::open(builder).map(SyncTraits)
        }

        async fn run_async(setup: Setup) {
            let run = tokio::time::timeout(SUITE_LIMIT, check_contract(&setup));
            run.await.unwrap_or_else(|_| panic!("the conformance suite hung for {SUITE_LIMIT:?}"));
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn conformance_async_traits_multi_thread_runtime() {
            run_async(Setup::new(AsyncTraits, Some(PAGE), |b| b)).await;
        }

        /// The builder's default page size (100) and a pool of one.
        #[tokio::test(flavor = "current_thread")]
        async fn conformance_async_traits_current_thread_runtime_default_page_size() {
            run_async(Setup::new(AsyncTraits, None, |b| b.pool_size(1))).await;
        }

        /// Runs the whole suite through the sync traits in `place`: every store is opened with
        /// the blocking `open`, used, closed or dropped there.
        fn sync_conformance_in(place: Where) {
            run_in(place, "LDK sync conformance", || async {
                check_contract(&Setup::new(Blocking(open_sync), Some(PAGE), |b| b)).await;
            });
        }

        #[test]
        fn conformance_sync_traits_plain_thread() {
            sync_conformance_in(Where::PlainThread);
        }

        #[test]
        fn conformance_sync_traits_inside_multi_thread_runtime() {
            sync_conformance_in(Where::MultiThreadRuntime);
        }

        #[test]
        fn conformance_sync_traits_inside_current_thread_runtime() {
            sync_conformance_in(Where::CurrentThreadRuntime);
        }

        /// The line's `KVStoreSyncWrapper` turns the sync impl into an async store that blocks
        /// inside `poll`: the way LDK itself calls sync persistence from async code. Interleaved
        /// with a task of the same current-thread runtime that must keep running between the
        /// calls.
        #[test]
        fn sync_store_wrapped_for_async_ldk_code_in_a_current_thread_runtime() {
            run_in(Where::CurrentThreadRuntime, "wrapper", || async {
                let table = $crate::common::table("ldkwrap");
                let store = Arc::new(LdkStore::open($crate::common::builder(&table)).unwrap());
                let wrapped = KVStoreSyncWrapper(Arc::clone(&store));
                let ticker = tokio::spawn(async {
                    for _ in 0..20 {
                        tokio::time::sleep(Duration::from_millis(5)).await;
                    }
                });
                for i in 0..20u8 {
                    KVStore::write(&wrapped, "wrap", "", &format!("k{i}"), vec![i]).await.unwrap();
                    tokio::task::yield_now().await;
                }
                assert_eq!(KVStore::list(&wrapped, "wrap", "").await.unwrap().len(), 20);
                assert_eq!(KVStore::read(&wrapped, "wrap", "", "k7").await.unwrap(), vec![7]);
                $crate::common::within("ticker", ticker).await.unwrap();
                store.close().unwrap();
            });
        }

        /// Everything in a store, read through the line's sync traits.
        fn contents<S: MigratableSync>(
            store: &S,
        ) -> std::collections::BTreeMap<(String, String, String), Vec<u8>> {
            let keys = MigratableSync::list_all_keys(store).unwrap();
            let n = keys.len();
            let map: std::collections::BTreeMap<_, _> = keys
                .into_iter()
                .map(|(p, s, k)| {
                    let value = KVStoreSync::read(store, &p, &s, &k).unwrap();
                    ((p, s, k), value)
                })
                .collect();
            assert_eq!(map.len(), n, "list_all_keys returned no duplicates");
            map
        }

        /// The line's migration helper, FilesystemStore → LdkStore → fresh FilesystemStore, with a few
        /// thousand keys across the namespaces an LDK node uses; every key and value compared.
        #[test]
        fn migration_round_trip_through_filesystem_stores() {
            $crate::sync_support::guarded("migration", || {
                let (dir_a, dir_b) = (
                    $crate::common::TempDir::new("ldkfs-a"),
                    $crate::common::TempDir::new("ldkfs-b"),
                );
                let mut source = FilesystemStore::new(dir_a.0.clone());
                let mut value_seed: u32 = 7;
                let mut value = |len: usize| -> Vec<u8> {
                    (0..len)
                        .map(|_| {
                            value_seed =
                                value_seed.wrapping_mul(1_103_515_245).wrapping_add(12_345);
                            (value_seed >> 16) as u8
                        })
                        .collect()
                };
                let mut written = 0;
                KVStoreSync::write(&source, "", "", "manager", value(40_000)).unwrap();
                KVStoreSync::write(&source, "", "", "network_graph", value(100_000)).unwrap();
                KVStoreSync::write(&source, "", "", "scorer", Vec::new()).unwrap();
                written += 3;
                for i in 0..600 {
                    KVStoreSync::write(
                        &source,
                        "monitors",
                        "",
                        &format!("{i:064x}_{}", i % 3),
                        value(i % 900),
                    )
                    .unwrap();
                    written += 1;
                }
                for chan in 0..24 {
                    for update in 0..100 {
                        let ns = format!("{chan:064x}_0");
                        KVStoreSync::write(
                            &source,
                            "monitor_updates",
                            &ns,
                            &update.to_string(),
                            value(64),
                        )
                        .unwrap();
                        written += 1;
                    }
                }
                for i in 0..200 {
                    KVStoreSync::write(
                        &source,
                        "archived_monitors",
                        "",
                        &format!("arch-{i}"),
                        value(300),
                    )
                    .unwrap();
                    KVStoreSync::write(
                        &source,
                        "payments",
                        "outbound",
                        &format!("p_{i}"),
                        value(i),
                    )
                    .unwrap();
                    written += 2;
                }
                assert!(written >= 3000, "{written}");
                let original = contents(&source);
                assert_eq!(original.len(), written, "the filesystem store holds every key");

                let table = $crate::common::table("ldkmig");
                let mut pg = LdkStore::open($crate::common::builder(&table)).unwrap();
                migrate_kv_store_data(&mut source, &mut pg).expect("filesystem -> pgfence");
                assert_eq!(contents(&pg), original, "pgfence holds every key and value");

                let mut target = FilesystemStore::new(dir_b.0.clone());
                migrate_kv_store_data(&mut pg, &mut target).expect("pgfence -> filesystem");
                let round_tripped = contents(&target);
                assert_eq!(round_tripped.len(), original.len());
                for (key, value) in &original {
                    assert!(
                        round_tripped.get(key) == Some(value),
                        "{key:?} survives the round trip"
                    );
                }
                pg.close().unwrap();
            });
        }
    };
}
