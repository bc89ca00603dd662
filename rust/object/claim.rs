//! Upload claims: racing writers of one chain segment send its block bodies once.
//!
//! Before uploading a segment's blocks, a chain put creates `<prefix>/c/<hex key>` (named by
//! the first block it would upload in that segment) with a conditional create. The winner
//! uploads; a loser reads the claim (the winner's keys for the segment, its lease), uploads
//! only the blocks the winner does not cover, and waits for the winner's manifest (written
//! after its blocks) before reporting the covered blocks stored. A loser whose wait runs past
//! the lease (the winner died, or its uploads failed) uploads them itself: a block is never
//! skipped on the word of a claim alone, only on a manifest that lists it. Cost: one small
//! PUT per uploaded segment for the winner, one PUT + one GET + a few manifest polls per
//! segment for a loser, never a request per block.
//!
//! Body: `FKC1`, u8 version, u64 creation time (unix ms), u64 lease (ms), u64 chain position
//! of `keys[0]`, u32 count, per key u16 + bytes, then a CRC32 of everything before it.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use object_store::path::Path;

use super::hex_name;
use super::manifest::{seal, unseal, write_keys};

const MAGIC: &[u8; 4] = b"FKC1";
const VERSION: u8 = 1;

pub fn claim_path(prefix: &Path, first_key: &[u8]) -> Path {
    prefix.clone().join("c").join(hex_name(first_key))
}

pub fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Claim {
    pub created_ms: u64,
    pub lease_ms: u64,
    /// Chain position of `keys[0]`.
    pub first: u64,
    /// The blocks the holder uploads, through the end of its segment (its manifest's name is
    /// the last of them).
    pub keys: Vec<Vec<u8>>,
}

impl Claim {
    pub fn new(first: usize, keys: Vec<Vec<u8>>, lease: Duration) -> Claim {
        Claim { created_ms: now_ms(), lease_ms: lease.as_millis() as u64, first: first as u64, keys }
    }

    /// How long a loser who just read this claim should wait for the holder's manifest: the
    /// rest of the lease by the holder's clock (hosts in NTP sync, as for GC), never more
    /// than a whole lease from now (a clock ahead of ours cannot stretch the wait).
    pub fn wait_left(&self) -> Duration {
        let until = self.created_ms.saturating_add(self.lease_ms);
        Duration::from_millis(until.saturating_sub(now_ms()).min(self.lease_ms))
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut w = Vec::with_capacity(40 + self.keys.iter().map(|k| k.len() + 2).sum::<usize>());
        w.extend_from_slice(MAGIC);
        w.push(VERSION);
        for v in [self.created_ms, self.lease_ms, self.first] {
            w.extend_from_slice(&v.to_le_bytes());
        }
        write_keys(&mut w, &self.keys);
        seal(w)
    }

    /// `None` for anything but an intact claim of this version (the loser then uploads).
    pub fn decode(body: &[u8]) -> Option<Claim> {
        let mut r = unseal(body, MAGIC, VERSION)?;
        let (created_ms, lease_ms, first) = (r.u64()?, r.u64()?, r.u64()?);
        let keys = r.keys()?;
        (r.0.is_empty() && !keys.is_empty()).then_some(Claim { created_ms, lease_ms, first, keys })
    }

    /// How many of `chain`'s blocks from position `first` on the holder covers (the leading
    /// keys both name; 0 when the claim is for another position).
    pub fn covers(&self, chain: &[Vec<u8>], first: usize) -> usize {
        if self.first as usize != first {
            return 0;
        }
        let ours = chain.get(first..).unwrap_or(&[]);
        self.keys.iter().zip(ours).take_while(|(a, b)| a == b).count()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_cover_and_damage() {
        let chain: Vec<Vec<u8>> = (0..10).map(|i| format!("k{i}").into_bytes()).collect();
        let c = Claim::new(3, chain[3..8].to_vec(), Duration::from_secs(5));
        let body = c.encode();
        assert_eq!(Claim::decode(&body), Some(c.clone()));
        assert_eq!(c.covers(&chain, 3), 5);
        assert_eq!(c.covers(&chain[..6], 3), 3, "a shorter chain: the keys it has");
        assert_eq!(c.covers(&chain, 4), 0, "another position");
        let mut other = chain.clone();
        other[5] = b"x".to_vec();
        assert_eq!(c.covers(&other, 3), 2, "a different continuation: up to where they part");
        assert!(c.wait_left() <= Duration::from_secs(5) && c.wait_left() > Duration::from_secs(4));
        let old = Claim { created_ms: now_ms() - 10_000, ..c.clone() };
        assert_eq!(old.wait_left(), Duration::ZERO, "an expired lease: no wait");
        let ahead = Claim { created_ms: now_ms() + 3_600_000, ..c };
        assert!(ahead.wait_left() <= Duration::from_secs(5), "a clock ahead never stretches it");
        for pos in [0, 5, body.len() / 2, body.len() - 1] {
            let mut bad = body.clone();
            bad[pos] ^= 1;
            assert_eq!(Claim::decode(&bad), None, "{pos}");
        }
        assert_eq!(Claim::decode(&[]), None);
    }
}
