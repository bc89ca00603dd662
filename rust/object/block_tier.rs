//! The object tier behind the crate's block-tier seam (`tier::BlockTier`).

use std::sync::Arc;

use super::error::Result;
use super::ObjectTier;
use crate::tier::batch::{Batch, Keepalive, RawBuf};
use crate::tier::BlockTier;
use crate::tier::StatsSnapshot;

impl BlockTier for ObjectTier {
    type Error = super::ObjectError;

    fn tier_name(&self) -> &'static str {
        "object"
    }

    fn submit_put(&self, items: Vec<(Vec<u8>, RawBuf)>, keepalive: Option<Keepalive>) -> Result<Arc<Batch>> {
        ObjectTier::submit_put(self, items, keepalive)
    }

    fn submit_get(&self, items: Vec<(Vec<u8>, RawBuf)>, keepalive: Option<Keepalive>) -> Result<Arc<Batch>> {
        ObjectTier::submit_get(self, items, keepalive)
    }

    /// S3 does not say whether a deleted key existed: the count is of keys now absent.
    fn delete_many(&self, keys: &[Vec<u8>]) -> Result<usize> {
        ObjectTier::delete(self, keys)
    }

    /// A lookup that could not be answered (server down, closed tier) is a miss.
    fn contains(&self, key: &[u8]) -> bool {
        self.contains_many(&[key.to_vec()]).is_ok_and(|found| found.first() == Some(&true))
    }

    /// Asked `concurrency` keys at a time, stopping after the chunk with the first miss.
    fn match_prefix(&self, keys: &mut dyn Iterator<Item = &[u8]>) -> usize {
        let width = self.config().concurrency.max(1);
        let mut matched = 0;
        loop {
            let chunk: Vec<Vec<u8>> = (&mut *keys).take(width).map(<[u8]>::to_vec).collect();
            if chunk.is_empty() {
                return matched;
            }
            let Ok(found) = self.contains_many(&chunk) else { return matched };
            let hits = found.iter().take_while(|&&f| f).count();
            matched += hits;
            if hits < chunk.len() {
                return matched;
            }
        }
    }

    fn drain_evicted(&self) -> Vec<Vec<u8>> {
        ObjectTier::drain_evicted(self)
    }

    fn stats(&self) -> StatsSnapshot {
        ObjectTier::stats(self)
    }

    fn close(&self) -> Result<()> {
        ObjectTier::close(self);
        Ok(())
    }
}
