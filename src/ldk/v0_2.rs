//! The `lightning` 0.2 line (feature `ldk-0_2`), the one ldk-node 0.7 uses. Its traits are thin
//! adapters over the shared operations of [`super::LdkStore`]. In 0.2 the async trait returns
//! boxed futures, and `MigratableKVStore` is sync. 0.2 has no paginated traits.

use lightning_0_2::io;
use lightning_0_2::util::async_poll::AsyncResult;
use lightning_0_2::util::persist::{KVStore, KVStoreSync, MigratableKVStore};

use super::LdkStore;

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

impl MigratableKVStore for LdkStore {
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
    ) -> AsyncResult<'static, Vec<u8>, io::Error> {
        Box::pin(self.read_async(primary, secondary, key))
    }

    fn write(
        &self,
        primary: &str,
        secondary: &str,
        key: &str,
        buf: Vec<u8>,
    ) -> AsyncResult<'static, (), io::Error> {
        // The shared operation takes the key's place in its order now, in the call, as 0.2's
        // `KVStore::write` requires; boxing the future changes nothing about that.
        Box::pin(self.write_async(primary, secondary, key, buf))
    }

    fn remove(
        &self,
        primary: &str,
        secondary: &str,
        key: &str,
        lazy: bool,
    ) -> AsyncResult<'static, (), io::Error> {
        Box::pin(self.remove_async(primary, secondary, key, lazy))
    }

    fn list(&self, primary: &str, secondary: &str) -> AsyncResult<'static, Vec<String>, io::Error> {
        Box::pin(self.list_async(primary, secondary))
    }
}
