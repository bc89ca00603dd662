//! The block-tier seam: what any tier that stores whole blocks by key offers the layers above
//! (the Python binding, the coordinator through it), and the types every tier shares: batches
//! and their per-block results (`batch`), stats (`stats`). The SSD block store and the object
//! tier implement it over these same types, so the caller never knows which tier it has; each
//! keeps its own error type (`StoreError`, `ObjectError`), and the Python layer maps both onto
//! one exception hierarchy. Tier-specific extras (verify, checkpoint, io engine) stay on the type.

pub mod batch;
pub mod stats;

use std::sync::Arc;

pub use batch::{Batch, BlockResult, Keepalive, RawBuf, Status, TimedOut};
pub use stats::{StatValue, StatsSnapshot};

pub trait BlockTier: Send + Sync {
    /// The tier's own error type; a batch wait's `TimedOut` converts into it.
    type Error: std::error::Error + From<TimedOut> + Send + Sync + 'static;

    /// The tier's name in stats and messages ("ssd", "object", ...).
    fn tier_name(&self) -> &'static str;

    /// Store blocks; the batch completes when every block is durable per the tier's rules (or
    /// failed). `keepalive` owns the memory behind the `RawBuf`s until completion.
    fn submit_put(
        &self,
        items: Vec<(Vec<u8>, RawBuf)>,
        keepalive: Option<Keepalive>,
    ) -> Result<Arc<Batch>, Self::Error>;

    /// Read blocks into caller buffers (each at least the block's length).
    fn submit_get(
        &self,
        items: Vec<(Vec<u8>, RawBuf)>,
        keepalive: Option<Keepalive>,
    ) -> Result<Arc<Batch>, Self::Error>;

    /// Delete keys; returns how many were stored.
    fn delete_many(&self, keys: &[Vec<u8>]) -> Result<usize, Self::Error>;

    fn contains(&self, key: &[u8]) -> bool;

    /// How many leading keys are stored (stops at the first miss).
    fn match_prefix(&self, keys: &mut dyn Iterator<Item = &[u8]>) -> usize {
        keys.take_while(|k| self.contains(k)).count()
    }

    /// Keys the tier dropped on its own (capacity pressure) since the last call.
    fn drain_evicted(&self) -> Vec<Vec<u8>>;

    fn stats(&self) -> StatsSnapshot;

    /// Finish in-flight batches and release the tier's resources; later submits fail with
    /// the tier's "closed" error.
    fn close(&self) -> Result<(), Self::Error>;
}
