//! flexkv-py's native core: a crash-safe, content-deduplicated block store for KV-cache
//! pages over io_uring + O_DIRECT, and an aligned host pool. The data path, module by module:
//! `tier` (the seam and the batch types every tier shares) → `store` (the SSD tier's batches)
//! → `index` (key → content → extent) → `device` (directories, files,
//! allocation) → `io` (engines, queues) with `format` defining every on-disk byte.

pub mod compression;
pub mod device;
pub mod error;
pub mod format;
pub mod hashing;
pub mod host_pool;
pub mod index;
pub mod io;
pub mod object;
pub mod store;
pub mod tier;

#[cfg(feature = "python")]
mod python;

pub use error::{Result, StoreError};
pub use store::{BlockStore, StoreConfig};
pub use tier::{BlockResult, BlockTier, RawBuf, Status};
