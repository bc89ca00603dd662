//! A compact presence set of block keys in LRU order: what the scheduler needs for blocks that
//! live only in a lower tier (SSD, later an object store) — "is it there" and who goes first.
//!
//! A key is `head || hash` (namespace head + the engine's block hash) kept only as an 8-byte
//! fingerprint (the first 8 bytes of its xxh3-128), so every entry costs the same whatever the
//! key length. A clash (two keys, one fingerprint: ~2^-64 per pair, so ~1 pair in 130 000 sets
//! of 16 M keys) answers a false "present": the load then goes to a worker whose store looks the
//! full key up (and checks the block header) and answers `not_found`, and the block is
//! recomputed (tests/test_fingerprint_clash.py). Never a wrong page, only a wasted read.
//!
//! Layout, chosen for bytes per entry: a `Vec` arena of nodes (fingerprint + u32 prev/next links
//! of the LRU list, 16 bytes) and an open-addressing table of 4-byte slots (`block_set_slots.rs`,
//! 64-87.5 % load: ~5 bytes per key). 21-26 bytes per entry; `hashlink`'s `LinkedHashMap` would
//! spend ~66 (a boxed node per entry plus 8-byte table slots). Removal swaps the last node into
//! the hole, so the arena stays dense and shrinks with the set. Both arrays ask for huge pages
//! once they span some: at millions of keys, lookups are otherwise dominated by page walks. A
//! set made `with_chains` also keeps a 7-byte chain link per node (block_set_chains.rs) and two
//! LRU lists, chain tails and inner blocks; `pop_front` takes tails only.

use std::collections::HashMap;
use std::ops::Range;

use xxhash_rust::xxh3::{xxh3_128, Xxh3};

use slots::Slots;

/// A key's fingerprint: the first 8 bytes of xxh3-128 of `head || hash`.
pub type Digest = [u8; 8];

const NIL: u32 = u32::MAX;
/// Arena indexes are u32 with one value reserved for "no link".
pub const MAX_LEN: usize = (u32::MAX - 1) as usize;
/// Keys up to this length are digested from a stack copy: one-shot xxh3 is cheaper than
/// setting up the streaming state, and the result is the same (tested).
const STACK_KEY: usize = 128;

/// Why a set could not take more digests.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum SetError {
    #[error("a BlockSet holds at most {MAX_LEN} digests")]
    Full,
    #[error("cannot allocate room for {0} more digests")]
    NoMemory(usize),
}

/// The first 8 bytes of xxh3-128 of `head || hash`, little-endian (as `HashAlgo::Xxh3_128`
/// writes content hashes).
pub fn digest(head: &[u8], hash: &[u8]) -> Digest {
    let n = head.len() + hash.len();
    let full = if n <= STACK_KEY {
        let mut buf = [0u8; STACK_KEY];
        buf[..head.len()].copy_from_slice(head);
        buf[head.len()..n].copy_from_slice(hash);
        xxh3_128(&buf[..n])
    } else {
        let mut h = Xxh3::new();
        h.update(head);
        h.update(hash);
        h.digest128()
    };
    let mut d = [0u8; 8];
    d.copy_from_slice(&full.to_le_bytes()[..8]);
    d
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

/// Ask the kernel to back a vector's memory with transparent huge pages (advice only: it
/// changes no byte, and a refusal changes nothing). Only whole 2 MiB pages inside it count.
fn advise_huge_pages<T>(v: &Vec<T>) {
    const HUGE: usize = 2 << 20;
    let begin = v.as_ptr() as usize;
    let start = begin.next_multiple_of(HUGE);
    let end = (begin + v.capacity() * std::mem::size_of::<T>()) / HUGE * HUGE;
    if end > start {
        // SAFETY: the range lies inside the vector's own allocation; MADV_HUGEPAGE does not
        // change its contents or mapping, only how the kernel may back it.
        unsafe {
            libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
        }
    }
}

#[derive(Clone, Copy)]
struct Node {
    digest: Digest,
    prev: u32,
    next: u32,
}

/// Which of the two LRU lists a node is on: tails (no counted child, the eviction order) or
/// inner chain blocks (kept while a child is). Sets without chains use the first only.
const TAILS: usize = 0;
const INNER: usize = 1;

pub struct BlockSet {
    table: Slots,
    nodes: Vec<Node>,
    /// Empty, or one per node (same positions) when the set keeps chain links.
    links: Vec<Link>,
    /// Child counts too big for a link's u16 (the link holds `MANY_KIDS`), by digest.
    many_kids: HashMap<Digest, u32>,
    chained: bool,
    /// Per list (TAILS, INNER): (least recently used end, the next `pop_front`; most recent).
    ends: [(u32, u32); 2],
}

impl Default for BlockSet {
    fn default() -> Self {
        Self::new()
    }
}

impl BlockSet {
    pub fn new() -> Self {
        BlockSet {
            table: Slots::new(),
            nodes: Vec::new(),
            links: Vec::new(),
            many_kids: HashMap::new(),
            chained: false,
            ends: [(NIL, NIL); 2],
        }
    }

    /// A set whose nodes keep chain links (block_set_chains.rs): 7 bytes more per node.
    pub fn with_chains() -> Self {
        BlockSet { chained: true, ..Self::new() }
    }

    fn list_of(&self, idx: u32) -> usize {
        match self.links.get(idx as usize) {
            Some(l) if l.kids() > 0 => INNER,
            _ => TAILS,
        }
    }

    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// Heap bytes held, from capacities (what the allocator really gave), not from `len`.
    pub fn heap_bytes(&self) -> usize {
        self.table.heap_bytes()
            + self.nodes.capacity() * std::mem::size_of::<Node>()
            + self.links.capacity() * std::mem::size_of::<Link>()
            + self.many_kids.capacity() * (std::mem::size_of::<(Digest, u32)>() + 1)
    }

    /// Room for `additional` more digests without regrowing (a restart adopting a known
    /// count). Refuses what could never fit instead of aborting on a failed allocation.
    pub fn reserve(&mut self, additional: usize) -> Result<(), SetError> {
        if additional > MAX_LEN - self.len() {
            return Err(SetError::Full);
        }
        let no_memory = |_| SetError::NoMemory(additional);
        let want = self.len() + additional;
        if self.table.full_for(want) {
            self.table.rebuild(want, self.nodes.iter().map(|n| &n.digest)).map_err(no_memory)?;
        }
        self.nodes.try_reserve_exact(additional).map_err(no_memory)?;
        advise_huge_pages(&self.nodes);
        if self.chained {
            self.links.try_reserve_exact(additional).map_err(no_memory)?;
        }
        Ok(())
    }

    fn find(&self, d: &Digest) -> Option<u32> {
        let nodes = &self.nodes;
        self.table.find(d, |pos| nodes[pos as usize].digest)
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
    pub fn insert(&mut self, d: Digest) -> Result<bool, SetError> {
        self.insert_node(d, &NO_PARENT, 0)
    }

    fn insert_node(&mut self, d: Digest, parent: &ParentName, kids: u32) -> Result<bool, SetError> {
        if self.find(&d).is_some() {
            return Ok(false);
        }
        let idx = self.nodes.len();
        if idx >= MAX_LEN {
            return Err(SetError::Full);
        }
        if self.table.full_for(idx + 1) {
            // Room for 1.25x: sized for 80 % of that, the table is 64 % full after growing.
            let digests = self.nodes.iter().map(|n| &n.digest);
            self.table.rebuild(idx + 1 + idx / 4, digests).map_err(|_| SetError::NoMemory(1))?;
        }
        if idx == self.nodes.capacity() {
            // 1.25x, not Vec's 2x: the arena is most of the bytes, and a doubled one is half
            // empty just after growing (big reallocs are page remaps anyway).
            self.nodes.reserve_exact((idx / 4).max(16));
            advise_huge_pages(&self.nodes);
        }
        if self.chained {
            if idx == self.links.capacity() {
                self.links.reserve_exact((idx / 4).max(16));
            }
            self.push_link(&d, parent, kids);
        }
        self.table.insert_new(&d, idx as u32);
        self.nodes.push(Node { digest: d, prev: NIL, next: NIL });
        self.link_back(idx as u32);
        Ok(true)
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
        if self.ends[self.list_of(idx)].1 != idx {
            self.unlink(idx);
            self.link_back(idx);
        }
        true
    }

    /// Remove and return the least recently used digest of a chain tail (a block no counted
    /// child depends on); None when there is none.
    pub fn pop_front(&mut self) -> Option<Digest> {
        let idx = self.ends[TAILS].0;
        if idx == NIL {
            return None;
        }
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
        *self = if self.chained { Self::with_chains() } else { Self::new() };
    }

    /// Digests from least to most recently used: chain tails first, then inner blocks.
    pub fn iter(&self) -> impl Iterator<Item = &Digest> + '_ {
        let mut list = TAILS;
        let mut at = self.ends[TAILS].0;
        std::iter::from_fn(move || loop {
            if at != NIL {
                let node = &self.nodes[at as usize];
                at = node.next;
                return Some(&node.digest);
            }
            if list == INNER {
                return None;
            }
            list = INNER;
            at = self.ends[INNER].0;
        })
    }

    /// Put `idx` at one end of its list (per its `kids`): the most recent (`back`), or the
    /// least recent, the next to go.
    fn link_end(&mut self, idx: u32, back: bool) {
        let list = self.list_of(idx);
        let old = if back { self.ends[list].1 } else { self.ends[list].0 };
        let node = &mut self.nodes[idx as usize];
        (node.prev, node.next) = if back { (old, NIL) } else { (NIL, old) };
        match (old, back) {
            (NIL, _) => self.ends[list] = (idx, idx),
            (o, true) => (self.nodes[o as usize].next, self.ends[list].1) = (idx, idx),
            (o, false) => (self.nodes[o as usize].prev, self.ends[list].0) = (idx, idx),
        }
    }

    fn link_back(&mut self, idx: u32) {
        self.link_end(idx, true);
    }

    fn unlink(&mut self, idx: u32) {
        let node = self.nodes[idx as usize];
        let list = self.list_of(idx);
        match node.prev {
            NIL => self.ends[list].0 = node.next,
            p => self.nodes[p as usize].next = node.next,
        }
        match node.next {
            NIL => self.ends[list].1 = node.prev,
            n => self.nodes[n as usize].prev = node.prev,
        }
    }

    fn remove_at(&mut self, idx: u32) {
        let d = self.nodes[idx as usize].digest;
        self.forget_many_kids(idx);
        let nodes = &self.nodes;
        self.table.remove(&d, idx, |pos| nodes[pos as usize].digest);
        self.unlink(idx);
        let last = (self.nodes.len() - 1) as u32;
        if idx != last {
            // The last node moves into the hole: repoint its neighbours and its table slot.
            let moved = self.nodes[last as usize];
            self.nodes[idx as usize] = moved;
            if self.chained {
                self.links[idx as usize] = self.links[last as usize];
            }
            let list = self.list_of(idx);
            match moved.prev {
                NIL => self.ends[list].0 = idx,
                p => self.nodes[p as usize].next = idx,
            }
            match moved.next {
                NIL => self.ends[list].1 = idx,
                n => self.nodes[n as usize].prev = idx,
            }
            self.table.repoint(&moved.digest, last, idx);
        }
        self.nodes.pop();
        self.links.pop();
        self.shrink_if_sparse();
    }

    /// After mass removal (pop_lru, intersect) give memory back, keeping room to grow 2x.
    fn shrink_if_sparse(&mut self) {
        let (len, cap) = (self.nodes.len(), self.nodes.capacity());
        if cap > 1024 && len < cap / 4 {
            self.nodes.shrink_to(len * 2);
            self.links.shrink_to(len * 2);
        }
        if self.table.sparse_for(len) {
            // A smaller table always fits: if even that allocation fails, keep the big one.
            let mut smaller = Slots::new();
            if smaller.rebuild(len, self.nodes.iter().map(|n| &n.digest)).is_ok() {
                self.table = smaller;
            }
        }
    }
}

#[path = "block_set_slots.rs"]
mod slots;

#[path = "block_set_chains.rs"]
mod chains;
use chains::Link;
pub use chains::{find_records, parent_name, ParentName, NAME_LEN, NO_PARENT};

#[cfg(test)]
#[path = "block_set_tests.rs"]
mod tests;
