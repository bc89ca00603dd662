//! Content hashes: 128-bit digests of a block's uncompressed bytes. They address content for
//! dedup and double as the end-to-end checksum verified on every read.

use crate::error::{Result, StoreError};

pub type ContentHash = [u8; 16];

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HashAlgo {
    /// xxh3-128: ~28 GiB/s per core, not cryptographic. Default: accidental collisions are
    /// ~2^-64 at 2^32 blocks, and KV bytes are produced by the model, not chosen by a client.
    Xxh3_128,
    /// blake3 truncated to 128 bits: cryptographic, ~4x more CPU per byte.
    Blake3,
}

impl HashAlgo {
    /// The names `parse` accepts (aliases aside), exported to Python as `CONTENT_HASHES`.
    pub const NAMES: &'static [&'static str] = &["xxh3-128", "blake3"];

    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "xxh3-128" | "xxh3" => Ok(HashAlgo::Xxh3_128),
            "blake3" => Ok(HashAlgo::Blake3),
            other => Err(StoreError::Config(format!(
                "content_hash: unknown algorithm {other:?} (expected \"xxh3-128\" or \"blake3\")"
            ))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            HashAlgo::Xxh3_128 => "xxh3-128",
            HashAlgo::Blake3 => "blake3",
        }
    }

    pub fn code(self) -> u8 {
        match self {
            HashAlgo::Xxh3_128 => 1,
            HashAlgo::Blake3 => 2,
        }
    }

    pub fn from_code(code: u8) -> Option<Self> {
        match code {
            1 => Some(HashAlgo::Xxh3_128),
            2 => Some(HashAlgo::Blake3),
            _ => None,
        }
    }

    pub fn digest(self, data: &[u8]) -> ContentHash {
        match self {
            HashAlgo::Xxh3_128 => xxhash_rust::xxh3::xxh3_128(data).to_le_bytes(),
            HashAlgo::Blake3 => {
                let full = blake3::hash(data);
                let mut out = [0u8; 16];
                out.copy_from_slice(&full.as_bytes()[..16]);
                out
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digests_differ_by_content_and_algorithm() {
        let a = HashAlgo::Xxh3_128.digest(b"block-a");
        let b = HashAlgo::Xxh3_128.digest(b"block-b");
        assert_ne!(a, b);
        assert_ne!(a, HashAlgo::Blake3.digest(b"block-a"));
        assert_eq!(a, HashAlgo::Xxh3_128.digest(b"block-a"));
    }

    #[test]
    fn parse_rejects_unknown() {
        assert!(HashAlgo::parse("md5").is_err());
        assert_eq!(HashAlgo::parse("blake3").unwrap(), HashAlgo::Blake3);
        for algo in [HashAlgo::Xxh3_128, HashAlgo::Blake3] {
            assert_eq!(HashAlgo::from_code(algo.code()), Some(algo));
        }
    }
}
