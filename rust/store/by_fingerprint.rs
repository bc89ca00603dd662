//! Deletes the scheduler names without full keys: cold blocks by fingerprint (its evictions,
//! `index/by_fingerprint.rs`) and a whole namespace (its reset). Each resolves the keys under
//! the state lock, then deletes them as `delete_many` does, journal records by full key as
//! always, and returns the keys it deleted (the scheduler announces them: KV events).

use super::BlockStore;
use crate::error::Result;
use crate::index::block_set::Digest;

impl BlockStore {
    /// Delete the stored keys that start with `tag` (this rank's) and whose fingerprint is one
    /// of `fps`; returns them.
    pub fn delete_by_fingerprint(&self, tag: &[u8], fps: &[Digest]) -> Result<Vec<Vec<u8>>> {
        let keys = self.shared.state.lock().index.keys_by_fingerprint(tag, fps);
        self.delete_resolved(keys)
    }

    /// Delete every stored key that starts with one of `prefixes`; returns them, oldest write first.
    pub fn delete_with_prefix(&self, prefixes: &[Vec<u8>]) -> Result<Vec<Vec<u8>>> {
        let keys = self.shared.state.lock().index.keys_with_prefix(prefixes);
        self.delete_resolved(keys)
    }

    fn delete_resolved(&self, keys: Vec<Vec<u8>>) -> Result<Vec<Vec<u8>>> {
        if !keys.is_empty() {
            self.delete_many(&keys)?;
        }
        Ok(keys)
    }
}
