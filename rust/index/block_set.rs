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

use std::ops::Range;

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

#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum ReserveError {
    #[error(transparent)]
    Full(#[from] SetFull),
    #[error("cannot allocate room for {0} more digests")]
    NoMemory(usize),
}

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

/// A `[start, stop)` range over a sequence that `check_span` refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SpanError {
    #[error("start and stop must be >= 0, got {0}, {1}")]
    Negative(i64, i64),
    #[error("start {0} is past stop {1}")]
    Reversed(i64, i64),
    #[error("stop {0} is past the end of hashes (len {1})")]
    PastEnd(i64, usize),
}

/// `start..stop` over a sequence of `len`, checked, not clamped: a bad range is a caller's bug
/// that clamping would turn into a silent miss.
pub fn check_span(start: i64, stop: i64, len: usize) -> Result<Range<usize>, SpanError> {
    if start < 0 || stop < 0 {
        return Err(SpanError::Negative(start, stop));
    }
    if start > stop {
        return Err(SpanError::Reversed(start, stop));
    }
    if stop as u64 > len as u64 {
        return Err(SpanError::PastEnd(stop, len));
    }
    Ok(start as usize..stop as usize)
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

    /// Room for `additional` more digests without regrowing (a restart adopting a known
    /// count). Refuses what could never fit instead of aborting on a failed allocation.
    pub fn reserve(&mut self, additional: usize) -> Result<(), ReserveError> {
        if additional > MAX_LEN - self.len() {
            return Err(ReserveError::Full(SetFull));
        }
        let nodes = &self.nodes;
        let no_memory = |_| ReserveError::NoMemory(additional);
        self.table.try_reserve(additional, |&i| bucket_hash(&nodes[i as usize].digest)).map_err(no_memory)?;
        self.nodes.try_reserve_exact(additional).map_err(|_| ReserveError::NoMemory(additional))
    }

    fn find(&self, d: &Digest) -> Option<u32> {
        let nodes = &self.nodes;
        self.table.find(bucket_hash(d), |&i| nodes[i as usize].digest == *d).copied()
    }

    pub fn contains(&self, d: &Digest) -> bool {
        self.find(d).is_some()
    }

    /// How many leading `hashes` are present under `head` (stops at the first absent one).
    pub fn prefix_run(&self, head: &[u8], hashes: &[&[u8]]) -> usize {
        hashes.iter().take_while(|h| self.contains(&digest(head, h))).count()
    }

    /// One byte per hash: 1 if present under `head`, 0 if not.
    pub fn present_mask(&self, head: &[u8], hashes: &[&[u8]]) -> Vec<u8> {
        hashes.iter().map(|h| self.contains(&digest(head, h)) as u8).collect()
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
#[path = "block_set_tests.rs"]
mod tests;
