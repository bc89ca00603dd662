//! A compact presence set of block keys in LRU order: what the scheduler needs for blocks that
//! live only in a lower tier (SSD, later an object store) — "is it there" and who goes first.
//!
//! A key is `head || hash` (namespace head + the engine's block hash) kept only as its 16-byte
//! xxh3-128 digest, so every entry costs the same whatever the key length. A collision (two keys,
//! one digest; ~2^-64 at 2^32 keys) answers a false "present": the load then goes to a worker whose
//! store verifies the full key in the block header and answers `not_found`, and the block is
//! recomputed. Never a wrong page, only a wasted read.
//!
//! Layout, chosen for bytes per entry: a `Vec` arena of nodes (digest + u32 prev/next links of
//! the LRU list, 24 bytes) and a SwissTable of u32 arena indexes (4 bytes + 1 control byte per
//! bucket, at most 7/8 full). 30-48 bytes per entry, ~36 at 2 M; `hashlink`'s
//! `LinkedHashMap` would spend ~66 (a boxed node per entry plus 8-byte table slots). The
//! digest is already uniform, so its low 64 bits are the table hash. Removal swaps the last
//! node into the hole, so the arena stays dense and shrinks with the set.

use hashbrown::hash_table::Entry;
use hashbrown::HashTable;
use xxhash_rust::xxh3::{xxh3_128, Xxh3};

pub type Digest = [u8; 16];

const NIL: u32 = u32::MAX;
/// Arena indexes are u32 with one value reserved for "no link".
pub const MAX_LEN: usize = (u32::MAX - 1) as usize;
/// Keys up to this length are digested from a stack copy: one-shot xxh3 is cheaper than
/// setting up the streaming state, and the result is the same (tested).
const STACK_KEY: usize = 128;

/// The set already holds `MAX_LEN` digests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("a BlockSet holds at most {MAX_LEN} digests")]
pub struct SetFull;

/// xxh3-128 of `head || hash`, little-endian (as `HashAlgo::Xxh3_128` writes content hashes).
pub fn digest(head: &[u8], hash: &[u8]) -> Digest {
    let n = head.len() + hash.len();
    if n <= STACK_KEY {
        let mut buf = [0u8; STACK_KEY];
        buf[..head.len()].copy_from_slice(head);
        buf[head.len()..n].copy_from_slice(hash);
        return xxh3_128(&buf[..n]).to_le_bytes();
    }
    let mut h = Xxh3::new();
    h.update(head);
    h.update(hash);
    h.digest128().to_le_bytes()
}

fn bucket_hash(d: &Digest) -> u64 {
    let mut low = [0u8; 8];
    low.copy_from_slice(&d[..8]);
    u64::from_le_bytes(low)
}

#[derive(Clone, Copy)]
struct Node {
    digest: Digest,
    prev: u32,
    next: u32,
}

pub struct BlockSet {
    table: HashTable<u32>,
    nodes: Vec<Node>,
    /// Least recently used end of the list (the next `pop_front`).
    front: u32,
    /// Most recently used end.
    back: u32,
}

impl Default for BlockSet {
    fn default() -> Self {
        Self::new()
    }
}

impl BlockSet {
    pub fn new() -> Self {
        BlockSet { table: HashTable::new(), nodes: Vec::new(), front: NIL, back: NIL }
    }

    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// Heap bytes held, from capacities (what the allocator really gave), not from `len`.
    pub fn heap_bytes(&self) -> usize {
        self.table.allocation_size() + self.nodes.capacity() * std::mem::size_of::<Node>()
    }

    /// Room for `additional` more digests without regrowing (a restart adopting a known count).
    pub fn reserve(&mut self, additional: usize) {
        let nodes = &self.nodes;
        self.table.reserve(additional, |&i| bucket_hash(&nodes[i as usize].digest));
        self.nodes.reserve_exact(additional);
    }

    fn find(&self, d: &Digest) -> Option<u32> {
        let nodes = &self.nodes;
        self.table.find(bucket_hash(d), |&i| nodes[i as usize].digest == *d).copied()
    }

    pub fn contains(&self, d: &Digest) -> bool {
        self.find(d).is_some()
    }

    /// Add `d` at the most recent end; `Ok(false)` if it was present (its place is kept: a
    /// use is recorded by `touch`, not by adding again).
    pub fn insert(&mut self, d: Digest) -> Result<bool, SetFull> {
        let idx = self.nodes.len();
        let nodes = &self.nodes;
        let hash = bucket_hash(&d);
        let entry = self.table.entry(
            hash,
            |&i| nodes[i as usize].digest == d,
            |&i| bucket_hash(&nodes[i as usize].digest),
        );
        match entry {
            Entry::Occupied(_) => Ok(false),
            Entry::Vacant(v) => {
                if idx >= MAX_LEN {
                    return Err(SetFull);
                }
                v.insert(idx as u32);
                if self.nodes.len() == self.nodes.capacity() {
                    // 1.25x, not Vec's 2x: the arena is most of the bytes, and a doubled one
                    // is half empty just after growing (big reallocs are page remaps anyway).
                    self.nodes.reserve_exact((self.nodes.len() / 4).max(16));
                }
                self.nodes.push(Node { digest: d, prev: NIL, next: NIL });
                self.link_back(idx as u32);
                Ok(true)
            }
        }
    }

    pub fn remove(&mut self, d: &Digest) -> bool {
        match self.find(d) {
            Some(idx) => {
                self.remove_at(idx);
                true
            }
            None => false,
        }
    }

    /// Move `d` to the most recent end; false if absent.
    pub fn touch(&mut self, d: &Digest) -> bool {
        let Some(idx) = self.find(d) else { return false };
        if self.back != idx {
            self.unlink(idx);
            self.link_back(idx);
        }
        true
    }

    /// Remove and return the least recently used digest.
    pub fn pop_front(&mut self) -> Option<Digest> {
        if self.front == NIL {
            return None;
        }
        let idx = self.front;
        let d = self.nodes[idx as usize].digest;
        self.remove_at(idx);
        Some(d)
    }

    /// Keep only the digests for which `keep` is true; the order of the kept ones is unchanged.
    pub fn retain(&mut self, mut keep: impl FnMut(&Digest) -> bool) {
        // Backwards: remove_at fills the hole with the last node, which was already visited.
        for idx in (0..self.nodes.len()).rev() {
            if !keep(&self.nodes[idx].digest) {
                self.remove_at(idx as u32);
            }
        }
    }

    /// Forget everything and give the memory back.
    pub fn clear(&mut self) {
        *self = Self::new();
    }

    /// Digests from least to most recently used.
    pub fn iter(&self) -> impl Iterator<Item = &Digest> + '_ {
        let mut at = self.front;
        std::iter::from_fn(move || {
            if at == NIL {
                return None;
            }
            let node = &self.nodes[at as usize];
            at = node.next;
            Some(&node.digest)
        })
    }

    fn link_back(&mut self, idx: u32) {
        let old = self.back;
        {
            let node = &mut self.nodes[idx as usize];
            node.prev = old;
            node.next = NIL;
        }
        match old {
            NIL => self.front = idx,
            o => self.nodes[o as usize].next = idx,
        }
        self.back = idx;
    }

    fn unlink(&mut self, idx: u32) {
        let Node { prev, next, .. } = self.nodes[idx as usize];
        match prev {
            NIL => self.front = next,
            p => self.nodes[p as usize].next = next,
        }
        match next {
            NIL => self.back = prev,
            n => self.nodes[n as usize].prev = prev,
        }
    }

    fn remove_at(&mut self, idx: u32) {
        let d = self.nodes[idx as usize].digest;
        if let Ok(slot) = self.table.find_entry(bucket_hash(&d), |&i| i == idx) {
            slot.remove();
        }
        self.unlink(idx);
        let last = (self.nodes.len() - 1) as u32;
        if idx != last {
            // The last node moves into the hole: repoint its neighbours and its table slot.
            let moved = self.nodes[last as usize];
            self.nodes[idx as usize] = moved;
            match moved.prev {
                NIL => self.front = idx,
                p => self.nodes[p as usize].next = idx,
            }
            match moved.next {
                NIL => self.back = idx,
                n => self.nodes[n as usize].prev = idx,
            }
            if let Some(slot) = self.table.find_mut(bucket_hash(&moved.digest), |&i| i == last) {
                *slot = idx;
            }
        }
        self.nodes.pop();
        self.shrink_if_sparse();
    }

    /// After mass removal (pop_lru, intersect) give memory back, keeping room to grow 2x.
    fn shrink_if_sparse(&mut self) {
        let (len, cap) = (self.nodes.len(), self.nodes.capacity());
        if cap > 1024 && len < cap / 4 {
            self.nodes.shrink_to(len * 2);
            let nodes = &self.nodes;
            self.table.shrink_to(len * 2, |&i| bucket_hash(&nodes[i as usize].digest));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(n: u32) -> Digest {
        digest(b"head", &n.to_le_bytes())
    }

    fn order(s: &BlockSet) -> Vec<Digest> {
        s.iter().copied().collect()
    }

    #[test]
    fn digest_of_parts_is_digest_of_concatenation() {
        for (head, hash) in
            [(&b""[..], &b""[..]), (&[7u8; 24][..], &[9u8; 32][..]), (&[1u8; 24][..], &[2u8; 300][..])]
        {
            let whole = [head, hash].concat();
            assert_eq!(digest(head, hash), xxh3_128(&whole).to_le_bytes());
            assert_eq!(digest(&whole, b""), digest(head, hash));
            assert_eq!(digest(b"", &whole), digest(head, hash));
        }
        // Both paths (stack copy, streaming) agree where they meet.
        let long = [3u8; STACK_KEY + 1];
        assert_eq!(digest(&long[..STACK_KEY], &long[STACK_KEY..]), xxh3_128(&long).to_le_bytes());
        assert_ne!(digest(b"ab", b"c"), digest(b"a", b"bd"));
    }

    #[test]
    fn lru_order_add_touch_pop() {
        let mut s = BlockSet::new();
        for n in 0..5 {
            assert_eq!(s.insert(d(n)), Ok(true));
        }
        assert_eq!(s.insert(d(2)), Ok(false), "re-adding keeps its place");
        assert!(s.touch(&d(1)));
        assert!(s.touch(&d(0)));
        assert!(!s.touch(&d(99)));
        assert_eq!(order(&s), [d(2), d(3), d(4), d(1), d(0)]);
        assert_eq!(s.pop_front(), Some(d(2)));
        assert_eq!(s.pop_front(), Some(d(3)));
        assert_eq!(s.len(), 3);
        assert!(!s.contains(&d(2)));
        assert_eq!(order(&s), [d(4), d(1), d(0)]);
    }

    #[test]
    fn removal_anywhere_keeps_links_and_table_consistent() {
        let mut s = BlockSet::new();
        for n in 0..100 {
            s.insert(d(n)).unwrap();
        }
        // Front, back, middle, and the arena's last node (the one that gets moved).
        for n in [0, 99, 50, 98, 1] {
            assert!(s.remove(&d(n)));
            assert!(!s.remove(&d(n)));
        }
        let expect: Vec<Digest> = (2..98).filter(|&n| n != 50).map(d).collect();
        assert_eq!(order(&s), expect);
        for n in 0..100 {
            assert_eq!(s.contains(&d(n)), expect.contains(&d(n)), "{n}");
        }
        while s.pop_front().is_some() {}
        assert!(s.is_empty());
        assert_eq!(order(&s), Vec::<Digest>::new());
        assert_eq!(s.insert(d(7)), Ok(true));
        assert_eq!(order(&s), [d(7)]);
    }

    #[test]
    fn retain_is_an_intersection_in_order() {
        let mut a = BlockSet::new();
        let mut b = BlockSet::new();
        for n in 0..1000 {
            a.insert(d(n)).unwrap();
        }
        for n in (0..2000).step_by(3) {
            b.insert(d(n)).unwrap();
        }
        a.touch(&d(0));
        a.retain(|x| b.contains(x));
        let mut expect: Vec<Digest> = (3..1000).step_by(3).map(d).collect();
        expect.push(d(0));
        assert_eq!(order(&a), expect);
        assert_eq!(a.len(), expect.len());
        for n in 0..1000 {
            assert_eq!(a.contains(&d(n)), n % 3 == 0, "{n}");
        }
    }

    #[test]
    fn memory_follows_the_set() {
        let mut s = BlockSet::new();
        assert_eq!(s.heap_bytes(), 0);
        for n in 0..100_000 {
            s.insert(d(n)).unwrap();
        }
        let full = s.heap_bytes();
        assert!(full >= 100_000 * 29, "{full}");
        assert!(full <= 100_000 * 48, "{full} bytes for 100k digests");
        for _ in 0..99_000 {
            s.pop_front();
        }
        assert!(s.heap_bytes() < full / 8, "shrinks after mass removal: {}", s.heap_bytes());
        assert_eq!(s.len(), 1000);
        assert_eq!(order(&s), (99_000..100_000).map(d).collect::<Vec<_>>());
        s.clear();
        assert_eq!((s.len(), s.heap_bytes()), (0, 0));
    }

    #[test]
    fn reserve_then_fill_does_not_regrow() {
        let mut s = BlockSet::new();
        s.reserve(5000);
        let before = s.heap_bytes();
        for n in 0..5000 {
            s.insert(d(n)).unwrap();
        }
        assert_eq!(s.heap_bytes(), before);
    }
}
