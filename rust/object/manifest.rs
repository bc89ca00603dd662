//! A chain segment's manifest: the block keys one segment of a prefix chain holds, so a lookup
//! learns up to `SEGMENT` blocks per request. Segments cut the chain at fixed positions (every
//! `SEGMENT` blocks, counted from the root); a chain's last block closes a shorter "end"
//! segment. A manifest is named by its segment's last key (`<prefix>/m/<hex key>`), holds the
//! previous boundary's key (its parent: GC keeps a live manifest's ancestors), and is written
//! only after every block of the segment and every ancestor segment is stored.
//!
//! Body: `FKM1`, u8 version, u64 start position, u16 + parent key, u32 count, per key u16 +
//! bytes, then a CRC32 of everything before it.

pub const SEGMENT: usize = 64;
const MAGIC: &[u8; 4] = b"FKM1";
const VERSION: u8 = 1;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Manifest {
    /// Chain position of `keys[0]`.
    pub start: u64,
    /// The last key of the previous segment (empty for the chain's first segment).
    pub parent: Vec<u8>,
    pub keys: Vec<Vec<u8>>,
}

/// Chain positions (inclusive ends) whose manifests a chain of `len` blocks has: every full
/// segment's last block, then the chain's last block when it ends inside a segment.
pub fn segment_ends(len: usize) -> Vec<usize> {
    let mut ends: Vec<usize> = (1..=len / SEGMENT).map(|s| s * SEGMENT - 1).collect();
    if len % SEGMENT != 0 {
        ends.push(len - 1);
    }
    ends
}

/// The manifest of the segment of `chain` ending at position `end`.
pub fn for_segment(chain: &[Vec<u8>], end: usize) -> Manifest {
    let start = end / SEGMENT * SEGMENT;
    Manifest {
        start: start as u64,
        parent: if start == 0 { Vec::new() } else { chain[start - 1].clone() },
        keys: chain[start..=end].to_vec(),
    }
}

impl Manifest {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Vec::with_capacity(24 + self.keys.iter().map(|k| k.len() + 2).sum::<usize>());
        w.extend_from_slice(MAGIC);
        w.push(VERSION);
        w.extend_from_slice(&self.start.to_le_bytes());
        w.extend_from_slice(&(self.parent.len() as u16).to_le_bytes());
        w.extend_from_slice(&self.parent);
        write_keys(&mut w, &self.keys);
        seal(w)
    }

    /// `None` for anything but an intact manifest of this version (a lookup then treats the
    /// segment as absent: a miss, never a wrong match).
    pub fn decode(body: &[u8]) -> Option<Manifest> {
        let mut r = unseal(body, MAGIC, VERSION)?;
        let start = r.u64()?;
        let parent = r.short()?.to_vec();
        let keys = r.keys()?;
        r.0.is_empty().then_some(Manifest { start, parent, keys })
    }

    /// Whether this manifest describes positions `start..start + keys.len()` of `chain`.
    pub fn matches(&self, chain: &[Vec<u8>]) -> bool {
        let start = self.start as usize;
        let parent_ok = match start {
            0 => self.parent.is_empty(),
            s => chain.get(s - 1) == Some(&self.parent),
        };
        parent_ok && chain.get(start..start + self.keys.len()) == Some(&self.keys[..])
    }

    /// Whether this manifest vouches for `chain`'s blocks from its start up to (not
    /// including) position `upto`: same parent, same keys (it may list more after them).
    pub fn lists(&self, chain: &[Vec<u8>], upto: usize) -> bool {
        let start = self.start as usize;
        let parent_ok = match start {
            0 => self.parent.is_empty(),
            s => chain.get(s - 1) == Some(&self.parent),
        };
        upto > start
            && parent_ok
            && self.keys.get(..upto - start).is_some_and(|ks| chain.get(start..upto) == Some(ks))
    }
}

/// A key list as the tier's small objects write it: u32 count, per key u16 length + bytes.
pub(super) fn write_keys(w: &mut Vec<u8>, keys: &[Vec<u8>]) {
    w.extend_from_slice(&(keys.len() as u32).to_le_bytes());
    for k in keys {
        w.extend_from_slice(&(k.len() as u16).to_le_bytes());
        w.extend_from_slice(k);
    }
}

/// The body with the CRC32 of everything in it appended.
pub(super) fn seal(mut w: Vec<u8>) -> Vec<u8> {
    let crc = crc32fast::hash(&w);
    w.extend_from_slice(&crc.to_le_bytes());
    w
}

/// A reader past `magic` and `version`, if the CRC matches and they are there.
pub(super) fn unseal<'a>(body: &'a [u8], magic: &[u8; 4], version: u8) -> Option<Reader<'a>> {
    let (data, crc) = body.split_at_checked(body.len().checked_sub(4)?)?;
    if crc32fast::hash(data) != u32::from_le_bytes(crc.try_into().ok()?) {
        return None;
    }
    let mut r = Reader(data);
    (r.take(4)? == magic && r.take(1)? == [version]).then_some(r)
}

pub(super) struct Reader<'a>(pub(super) &'a [u8]);

impl<'a> Reader<'a> {
    pub(super) fn u64(&mut self) -> Option<u64> {
        Some(u64::from_le_bytes(self.take(8)?.try_into().ok()?))
    }

    pub(super) fn keys(&mut self) -> Option<Vec<Vec<u8>>> {
        let n = u32::from_le_bytes(self.take(4)?.try_into().ok()?) as usize;
        let mut keys = Vec::with_capacity(n.min(SEGMENT));
        for _ in 0..n {
            keys.push(self.short()?.to_vec());
        }
        Some(keys)
    }

    pub(super) fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        let (head, rest) = self.0.split_at_checked(n)?;
        self.0 = rest;
        Some(head)
    }

    pub(super) fn short(&mut self) -> Option<&'a [u8]> {
        let n = u16::from_le_bytes(self.take(2)?.try_into().ok()?) as usize;
        self.take(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chain(n: usize) -> Vec<Vec<u8>> {
        (0..n).map(|i| format!("k{i}").into_bytes()).collect()
    }

    #[test]
    fn segment_ends_cover_full_and_end_segments() {
        assert_eq!(segment_ends(0), Vec::<usize>::new());
        assert_eq!(segment_ends(1), vec![0]);
        assert_eq!(segment_ends(SEGMENT), vec![SEGMENT - 1]);
        assert_eq!(segment_ends(SEGMENT * 2 + 5), vec![SEGMENT - 1, 2 * SEGMENT - 1, 2 * SEGMENT + 4]);
    }

    #[test]
    fn round_trip_match_and_damage() {
        let c = chain(SEGMENT * 2 + 3);
        let m = for_segment(&c, SEGMENT * 2 + 2);
        assert_eq!(m.start, 2 * SEGMENT as u64);
        assert_eq!(m.parent, c[2 * SEGMENT - 1]);
        let body = m.encode();
        assert_eq!(Manifest::decode(&body), Some(m.clone()));
        assert!(m.matches(&c));
        let mut other = c.clone();
        other[2 * SEGMENT - 1] = b"x".to_vec();
        assert!(!m.matches(&other), "a different parent is a different chain");
        assert!(!m.matches(&c[..SEGMENT * 2 + 1]), "a shorter chain does not hold the segment");
        for pos in [0, 5, body.len() / 2, body.len() - 1] {
            let mut bad = body.clone();
            bad[pos] ^= 1;
            assert_eq!(Manifest::decode(&bad), None, "{pos}");
        }
        assert_eq!(Manifest::decode(&body[..body.len() - 1]), None);
        assert_eq!(Manifest::decode(&[]), None);
    }
}
