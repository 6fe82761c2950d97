//! The `lightning` 0.3 line (feature `ldk`): thin adapters over the shared operations of
//! [`super::LdkStore`], plus the paginated traits, which only this line has.

use std::future::Future;

use lightning::io;
use lightning::util::persist::{
    KVStore, KVStoreSync, MigratableKVStore, MigratableKVStoreSync, PageToken as LdkPageToken,
    PaginatedKVStore, PaginatedKVStoreSync, PaginatedListResponse,
};

use super::LdkStore;
use crate::{Page, PageToken};

fn to_ldk(page: Page) -> PaginatedListResponse {
    PaginatedListResponse {
        keys: page.keys,
        next_page_token: page.next_page_token.map(|t| LdkPageToken::new(t.as_str().to_owned())),
    }
}

fn from_ldk(token: Option<LdkPageToken>) -> Option<PageToken> {
    token.map(|t| PageToken::new(t.as_str()))
}

impl KVStoreSync for LdkStore {
    fn read(&self, primary: &str, secondary: &str, key: &str) -> io::Result<Vec<u8>> {
        self.read_sync(primary, secondary, key)
    }

    fn write(&self, primary: &str, secondary: &str, key: &str, buf: Vec<u8>) -> io::Result<()> {
        self.write_sync(primary, secondary, key, buf)
    }

    fn remove(&self, primary: &str, secondary: &str, key: &str, lazy: bool) -> io::Result<()> {
        self.remove_sync(primary, secondary, key, lazy)
    }

    fn list(&self, primary: &str, secondary: &str) -> io::Result<Vec<String>> {
        self.list_sync(primary, secondary)
    }
}

impl PaginatedKVStoreSync for LdkStore {
    fn list_paginated(
        &self,
        primary: &str,
        secondary: &str,
        page_token: Option<LdkPageToken>,
    ) -> io::Result<PaginatedListResponse> {
        self.list_page_sync(primary, secondary, from_ldk(page_token)).map(to_ldk)
    }
}

impl MigratableKVStoreSync for LdkStore {
    fn list_all_keys(&self) -> io::Result<Vec<(String, String, String)>> {
        self.list_all_keys_sync()
    }
}

impl KVStore for LdkStore {
    fn read(
        &self,
        primary: &str,
        secondary: &str,
        key: &str,
    ) -> impl Future<Output = io::Result<Vec<u8>>> + 'static + Send {
        self.read_async(primary, secondary, key)
    }

    fn write(
        &self,
        primary: &str,
        secondary: &str,
        key: &str,
        buf: Vec<u8>,
    ) -> impl Future<Output = io::Result<()>> + 'static + Send {
        self.write_async(primary, secondary, key, buf)
    }

    fn remove(
        &self,
        primary: &str,
        secondary: &str,
        key: &str,
        lazy: bool,
    ) -> impl Future<Output = io::Result<()>> + 'static + Send {
        self.remove_async(primary, secondary, key, lazy)
    }

    fn list(
        &self,
        primary: &str,
        secondary: &str,
    ) -> impl Future<Output = io::Result<Vec<String>>> + 'static + Send {
        self.list_async(primary, secondary)
    }
}

impl PaginatedKVStore for LdkStore {
    fn list_paginated(
        &self,
        primary: &str,
        secondary: &str,
        page_token: Option<LdkPageToken>,
    ) -> impl Future<Output = io::Result<PaginatedListResponse>> + 'static + Send {
        let page = self.list_page_async(primary, secondary, from_ldk(page_token));
        async move { page.await.map(to_ldk) }
    }
}

impl MigratableKVStore for LdkStore {
    fn list_all_keys(
        &self,
    ) -> impl Future<Output = io::Result<Vec<(String, String, String)>>> + 'static + Send {
        self.list_all_keys_async()
    }
}
