//! The block-tier seam: what any tier that stores whole blocks by key offers the layers above
//! (the Python binding, the coordinator through it). The SSD block store implements it; an
//! object-store tier implements the same calls over the same tier-neutral batch types
//! (`store::batch`: `Batch`, `BlockResult`, `Status`, `RawBuf`), so the caller never knows
//! which tier it has. Tier-specific extras (verify, checkpoint, io engine) stay on the type.

use std::sync::Arc;

use crate::error::Result;
use crate::store::batch::{Batch, Keepalive, RawBuf};
use crate::store::stats::StatsSnapshot;

pub trait BlockTier: Send + Sync {
    /// The tier's name in stats and messages ("ssd", "object", ...).
    fn tier_name(&self) -> &'static str;

    /// Store blocks; the batch completes when every block is durable per the tier's rules (or
    /// failed). `keepalive` owns the memory behind the `RawBuf`s until completion.
    fn submit_put(&self, items: Vec<(Vec<u8>, RawBuf)>, keepalive: Option<Keepalive>) -> Result<Arc<Batch>>;

    /// Read blocks into caller buffers (each at least the block's length).
    fn submit_get(&self, items: Vec<(Vec<u8>, RawBuf)>, keepalive: Option<Keepalive>) -> Result<Arc<Batch>>;

    /// Delete keys; returns how many were stored.
    fn delete_many(&self, keys: &[Vec<u8>]) -> Result<usize>;

    fn contains(&self, key: &[u8]) -> bool;

    /// How many leading keys are stored (stops at the first miss).
    fn match_prefix(&self, keys: &mut dyn Iterator<Item = &[u8]>) -> usize {
        keys.take_while(|k| self.contains(k)).count()
    }

    /// Keys the tier dropped on its own (capacity pressure) since the last call.
    fn drain_evicted(&self) -> Vec<Vec<u8>>;

    fn stats(&self) -> StatsSnapshot;

    /// Finish in-flight batches and release the tier's resources; later submits fail with
    /// `StoreError::Closed`.
    fn close(&self) -> Result<()>;
}
