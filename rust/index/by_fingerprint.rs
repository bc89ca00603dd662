//! The store's keys found by the scheduler's name for a block: its 8-byte fingerprint
//! (`BlockSet.digest` of the logical key, i.e. the stored key past its rank tag).
//!
//! The scheduler keeps cold blocks as fingerprints only (flexkv_py/index/cold_blocks.py), so
//! the drops it decides name fingerprints, and the worker's store turns them back into its
//! keys here. The key table is hashed by that fingerprint (`keys::fingerprint`), so a lookup
//! costs one probe, and no byte per key is added. A clash (two stored keys, one fingerprint:
//! ~2^-64 per pair) returns both: the drop loses one more copy, never serves a wrong block.

use std::collections::HashSet;

use super::block_set::Digest;
use super::Index;

impl Index {
    /// The stored keys that start with `tag` (this rank's) and whose fingerprint is one of
    /// `fps`, each once.
    pub fn keys_by_fingerprint(&self, tag: &[u8], fps: &[Digest]) -> Vec<Vec<u8>> {
        let mut seen = HashSet::new();
        let mut out = Vec::new();
        for fp in fps {
            for id in self.keys.find_by_fingerprint(fp) {
                let key = self.keys.key(id);
                if key.starts_with(tag) && seen.insert(id) {
                    out.push(key);
                }
            }
        }
        out
    }

    /// The stored keys that start with one of `prefixes`, coldest first.
    pub fn keys_with_prefix(&self, prefixes: &[Vec<u8>]) -> Vec<Vec<u8>> {
        self.keys_in_order().map(|(k, _)| k).filter(|k| prefixes.iter().any(|p| k.starts_with(p))).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::super::block_set::digest;
    use super::super::keys::fingerprint;
    use super::*;
    use crate::format::journal::{ContentTag, Location};

    fn loc(i: u64) -> Location {
        Location {
            dir: 0,
            offset: (i + 1) * 8192,
            stored_len: 4096,
            raw_len: 4096,
            seq: i,
            compressed: false,
        }
    }

    fn content(i: u64) -> ContentTag {
        i + 1
    }

    /// A stored key: rank tag + head (prefix + variant) + block hash.
    fn key(tag: u8, hash: u64) -> Vec<u8> {
        let mut k = vec![0, tag, 0, 0];
        k.extend_from_slice(&[7u8; 24]);
        k.extend_from_slice(&[0u8; 24]);
        k.extend_from_slice(&hash.to_be_bytes());
        k
    }

    #[test]
    fn every_ranks_key_has_the_schedulers_fingerprint() {
        let k0 = key(0, 5);
        let k1 = key(1, 5);
        let logical = &k0[4..];
        assert_eq!(fingerprint(&k0), digest(&logical[..24], &logical[24..]));
        assert_eq!(fingerprint(&k0), fingerprint(&k1));
    }

    #[test]
    fn fingerprints_resolve_to_this_ranks_keys_and_prefixes_select_a_namespace() {
        let mut ix = Index::new();
        for i in 0..1000u64 {
            ix.insert(&key(0, i), content(i), &loc(i));
            ix.insert(&key(1, i), content(1000 + i), &loc(1000 + i));
        }
        let fps: Vec<Digest> = [3u64, 500, 999, 5000].iter().map(|&i| fingerprint(&key(0, i))).collect();
        let got = ix.keys_by_fingerprint(&[0, 0, 0, 0], &fps);
        assert_eq!(got, vec![key(0, 3), key(0, 500), key(0, 999)]);
        let twice = ix.keys_by_fingerprint(&[0, 1, 0, 0], &[fps[0], fps[0]]);
        assert_eq!(twice, vec![key(1, 3)]);
        assert_eq!(ix.keys_with_prefix(&[vec![0, 1, 0, 0]]).len(), 1000);
        ix.remove(&key(0, 500));
        assert_eq!(ix.keys_by_fingerprint(&[0, 0, 0, 0], &fps[1..2]), Vec::<Vec<u8>>::new());
    }
}
