//! The 4 KiB header page written in front of every stored block (same write as the payload).
//! It lets a reader prove that the extent it read is the block the index promised. Since v2 it
//! also carries the writing key's opaque metadata (token ids, extra keys): the page is mostly
//! empty, so the metadata costs no extra I/O to write and no RAM to keep.

use super::{Reader, MAX_KEY_LEN, PAGE};
use crate::hashing::ContentHash;

const MAGIC: &[u8; 8] = b"FLXKVBLK";
const VERSION: u16 = 2;
/// Fixed bytes of an encoded header besides the key and the metadata (with the CRC).
const FIXED_LEN: usize = 8 + 2 + 2 + 1 + 8 + 8 + 8 + 16 + 2 + 4 + 4;

/// Longest metadata that fits in the header page beside a key of `key_len` bytes.
pub fn max_meta_len(key_len: usize) -> usize {
    PAGE.saturating_sub(FIXED_LEN + key_len)
}
pub const FLAG_COMPRESSED: u16 = 1;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockHeader {
    pub flags: u16,
    pub hash_algo: u8,
    pub raw_len: u64,
    pub stored_len: u64,
    pub seq: u64,
    pub content_hash: ContentHash,
    /// The key that first wrote this content (diagnostics; dedup maps more keys to it).
    pub key: Vec<u8>,
}

#[derive(Debug, PartialEq, Eq)]
pub enum HeaderError {
    BadMagic,
    BadChecksum,
    Malformed,
}

impl BlockHeader {
    pub fn compressed(&self) -> bool {
        self.flags & FLAG_COMPRESSED != 0
    }

    /// Encode into exactly one page (`out.len() == PAGE`), with no metadata.
    pub fn encode_into(&self, out: &mut [u8]) {
        self.encode_with_meta(&[], out)
    }

    /// Encode with `meta` (at most `max_meta_len(key.len())` bytes) into exactly one page.
    pub fn encode_with_meta(&self, meta: &[u8], out: &mut [u8]) {
        debug_assert_eq!(out.len(), PAGE);
        debug_assert!(self.key.len() <= MAX_KEY_LEN);
        debug_assert!(meta.len() <= max_meta_len(self.key.len()));
        out.fill(0);
        let mut w = Vec::with_capacity(64 + self.key.len() + meta.len());
        w.extend_from_slice(MAGIC);
        w.extend_from_slice(&VERSION.to_le_bytes());
        w.extend_from_slice(&self.flags.to_le_bytes());
        w.push(self.hash_algo);
        w.extend_from_slice(&self.raw_len.to_le_bytes());
        w.extend_from_slice(&self.stored_len.to_le_bytes());
        w.extend_from_slice(&self.seq.to_le_bytes());
        w.extend_from_slice(&self.content_hash);
        w.extend_from_slice(&(self.key.len() as u16).to_le_bytes());
        w.extend_from_slice(&self.key);
        w.extend_from_slice(&(meta.len() as u32).to_le_bytes());
        w.extend_from_slice(meta);
        let crc = crc32fast::hash(&w);
        w.extend_from_slice(&crc.to_le_bytes());
        out[..w.len()].copy_from_slice(&w);
    }

    pub fn decode(page: &[u8]) -> Result<Self, HeaderError> {
        Self::decode_with_meta(page).map(|(h, _)| h)
    }

    /// Decode a header and borrow its metadata (empty for a v1 header, which had none).
    pub fn decode_with_meta(page: &[u8]) -> Result<(Self, &[u8]), HeaderError> {
        let mut r = Reader::new(page);
        if r.bytes(8) != Some(MAGIC.as_slice()) {
            return Err(HeaderError::BadMagic);
        }
        let parse = |r: &mut Reader<'_>| -> Option<(BlockHeader, u16)> {
            let version = r.u16()?;
            let flags = r.u16()?;
            let hash_algo = r.u8()?;
            let raw_len = r.u64()?;
            let stored_len = r.u64()?;
            let seq = r.u64()?;
            let content_hash = r.hash()?;
            let key_len = r.u16()? as usize;
            if key_len > MAX_KEY_LEN {
                return None;
            }
            let key = r.bytes(key_len)?.to_vec();
            Some((BlockHeader { flags, hash_algo, raw_len, stored_len, seq, content_hash, key }, version))
        };
        let (header, version) = parse(&mut r).ok_or(HeaderError::Malformed)?;
        let meta = match version {
            1 => &[][..],
            _ => {
                let n = r.u32().ok_or(HeaderError::Malformed)? as usize;
                r.bytes(n).ok_or(HeaderError::Malformed)?
            }
        };
        let body_len = r.pos();
        let crc = r.u32().ok_or(HeaderError::Malformed)?;
        if crc32fast::hash(&page[..body_len]) != crc {
            return Err(HeaderError::BadChecksum);
        }
        Ok((header, meta))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn roundtrip(flags in 0u16..2, raw in any::<u64>(), stored in any::<u64>(), seq in any::<u64>(),
                     hash in any::<[u8; 16]>(), key in proptest::collection::vec(any::<u8>(), 0..300)) {
            let h = BlockHeader { flags, hash_algo: 1, raw_len: raw, stored_len: stored, seq, content_hash: hash, key };
            let mut page = vec![0u8; PAGE];
            h.encode_into(&mut page);
            prop_assert_eq!(BlockHeader::decode(&page).unwrap(), h);
        }

        #[test]
        fn meta_roundtrip(key in proptest::collection::vec(any::<u8>(), 0..300),
                          meta in proptest::collection::vec(any::<u8>(), 0..4096)) {
            let h = BlockHeader { flags: 0, hash_algo: 1, raw_len: 1, stored_len: 1, seq: 2, content_hash: [3; 16], key };
            let meta = &meta[..meta.len().min(max_meta_len(h.key.len()))];
            let mut page = vec![0u8; PAGE];
            h.encode_with_meta(meta, &mut page);
            let (decoded, got) = BlockHeader::decode_with_meta(&page).unwrap();
            prop_assert_eq!(decoded, h);
            prop_assert_eq!(got, meta);
        }

        #[test]
        fn any_flipped_byte_is_detected(pos in 0usize..67, bit in 0u8..8) {
            let h = BlockHeader { flags: 0, hash_algo: 1, raw_len: 65536, stored_len: 65536, seq: 7,
                                  content_hash: [9; 16], key: b"ns/key-1".to_vec() };
            let mut page = vec![0u8; PAGE];
            h.encode_into(&mut page);
            page[pos] ^= 1 << bit;
            prop_assert!(BlockHeader::decode(&page) != Ok(h));
        }
    }
}
