//! Chain links in a `BlockSet`: which block each one extends, and how many cached children
//! depend on it, so that the set's eviction order is prefix-aware.
//!
//! A prefix match stops at the first miss, so a block must outlive its children (vLLM's prefix
//! cache frees tail-first for the same reason). Each node keeps its parent's name and a count
//! of children counted against it by the owner (the tier index counts every cached child, in
//! whatever tier or set it lives): a 7-byte link, byte arrays (align 1: no padding).
//!
//! The name is the first `NAME_LEN` = 5 bytes of the parent's fingerprint (`parent_name`:
//! zero-padded to 8 for callers), robust to the arena's swap-removal, unlike an index, and it
//! names a parent outside the set too. Names of two blocks collide at ~2^-40 per pair: ~n^2/2^41
//! pairs in a set of n (~2 at 2 M blocks, ~120 at 16 M). A clash can only misorder evictions: a
//! child counted against the wrong one of the two holds that one (and its ancestors) and lets
//! the other go before its child. The counts of one name stay exact in total (a drop takes a
//! child off a node of that name that has one, `drop_kid`, and says "here" only then, so the
//! owner's count of a warm block of that name is dropped otherwise): once the children of both
//! are gone, both are tails; no clash holds a block forever. A name never decides what is
//! read: reads go by full digest, and the worker's store checks the full key.
//!
//! The count is a u16 in the link; a count that reaches `MANY_KIDS` (a shared prefix block
//! with 65 535 cached continuations) moves, exact, to a side map keyed by digest, and comes
//! back when it drops below. So it never saturates: no node is held by a count that can never
//! reach 0, and a drop at 0 stays 0 (a drop the owner counts twice is no underflow).
//!
//! Nodes with no counted child are chain tails: they form the LRU list that `pop_front` /
//! `pop_tail` evict from. The others sit on a second list and become tails, at the front (they
//! were used with the child that just left), when their last child goes. A node whose parent is
//! not in this set keeps the name anyway: the owner resolves it (the parent may be warm).

use std::collections::HashSet;

use super::{digest, BlockSet, Digest, SetError, TAILS};

/// A chain parent's name as callers hold it: 8 bytes, of which the first `NAME_LEN` count
/// (the rest are zero in names this module makes, and ignored in names given to it).
pub type ParentName = Digest;

/// Bytes of a fingerprint a chain link keeps to name the parent (at least the 4 the table's
/// home and tag come from).
pub const NAME_LEN: usize = 5;

/// The parent name of a node that extends no known block.
pub const NO_PARENT: ParentName = [0u8; 8];

/// A link's count that means "in `many_kids`": counts from here on do not fit the u16.
const MANY_KIDS: u16 = u16::MAX;

/// The name chain links call the block with digest `d` by: its first `NAME_LEN` bytes,
/// zero-padded to 8.
pub fn parent_name(d: &Digest) -> ParentName {
    let mut name = NO_PARENT;
    name[..NAME_LEN].copy_from_slice(&d[..NAME_LEN]);
    name
}

/// A node's chain link, beside it in `links` in sets made `with_chains`: 7 bytes.
#[derive(Clone, Copy)]
pub(super) struct Link {
    /// The chain parent's name (all zero: none known).
    parent: [u8; NAME_LEN],
    /// Cached children counted against this block (a little-endian u16: align 1); 0: a chain
    /// tail; `MANY_KIDS`: see `BlockSet::many_kids`.
    kids: [u8; 2],
}

const _: () = assert!(std::mem::size_of::<Link>() == NAME_LEN + 2);
const _: () = assert!(NAME_LEN >= 4 && NAME_LEN <= 8);

impl Link {
    const NONE: Link = Link { parent: [0; NAME_LEN], kids: [0; 2] };

    pub(super) fn kids(&self) -> u16 {
        u16::from_le_bytes(self.kids)
    }

    fn parent(&self) -> ParentName {
        let mut name = NO_PARENT;
        name[..NAME_LEN].copy_from_slice(&self.parent);
        name
    }
}

impl BlockSet {
    /// Add `d` as a block extending the one named `parent` with `kids` cached children counted
    /// against it. `Ok(false)` if present (its links are kept).
    pub fn insert_chained(&mut self, d: Digest, parent: ParentName, kids: u32) -> Result<bool, SetError> {
        self.insert_node(d, &parent, kids)
    }

    /// The link of a node about to be pushed at the arena's end (`insert_node`).
    pub(super) fn push_link(&mut self, d: &Digest, parent: &ParentName, kids: u32) {
        let mut link = Link::NONE;
        link.parent.copy_from_slice(&parent[..NAME_LEN]);
        self.links.push(link);
        self.store_kids(self.links.len() - 1, d, kids);
    }

    /// The node at `idx` leaves: its count leaves the side map with it.
    pub(super) fn forget_many_kids(&mut self, idx: u32) {
        if self.links.get(idx as usize).is_some_and(|l| l.kids() == MANY_KIDS) {
            self.many_kids.remove(&self.nodes[idx as usize].digest);
        }
    }

    fn kids_at(&self, idx: u32) -> u32 {
        match self.links.get(idx as usize) {
            None => 0,
            Some(l) if l.kids() == MANY_KIDS => {
                let d = &self.nodes[idx as usize].digest;
                self.many_kids.get(d).copied().unwrap_or(MANY_KIDS as u32)
            }
            Some(l) => l.kids() as u32,
        }
    }

    /// Set the count of the link at `idx` (node digest `d`): in the link, or past it the map.
    fn store_kids(&mut self, idx: usize, d: &Digest, kids: u32) {
        let was = self.links[idx].kids();
        let small = if kids >= MANY_KIDS as u32 {
            self.many_kids.insert(*d, kids);
            MANY_KIDS
        } else {
            if was == MANY_KIDS {
                self.many_kids.remove(d);
            }
            kids as u16
        };
        self.links[idx].kids = small.to_le_bytes();
    }

    fn set_kids(&mut self, idx: u32, kids: u32) {
        let d = self.nodes[idx as usize].digest;
        self.store_kids(idx as usize, &d, kids);
    }

    /// The node named `name` (its first `NAME_LEN` bytes) for which `also` holds: home and tag
    /// come from those bytes only, so the name probes the slots its full digest would.
    fn find_name_where(&self, name: &ParentName, also: impl Fn(u32) -> bool) -> Option<u32> {
        let nodes = &self.nodes;
        let named = |pos: u32| nodes[pos as usize].digest[..NAME_LEN] == name[..NAME_LEN] && also(pos);
        self.table.find_where(name, named)
    }

    fn find_name(&self, name: &ParentName) -> Option<u32> {
        self.find_name_where(name, |_| true)
    }

    /// One more cached child depends on the block named `parent`; false if it is not here.
    pub fn add_kid(&mut self, parent: &ParentName) -> bool {
        let Some(idx) = self.find_name(parent).filter(|_| self.chained) else { return false };
        let kids = self.kids_at(idx);
        if kids == 0 {
            self.unlink(idx); // from the tails
            self.set_kids(idx, 1);
            self.link_back(idx);
        } else {
            self.set_kids(idx, kids.saturating_add(1));
        }
        true
    }

    /// A cached child of `parent` left: taken off a node of that name with a child counted
    /// (false if there is none here: the owner's count, if any, is the one to drop; on a name
    /// clash this keeps the name's total exact). Its last child gone, the parent is a tail and
    /// goes next.
    pub fn drop_kid(&mut self, parent: &ParentName) -> bool {
        let counted = |pos: u32| self.kids_at(pos) > 0;
        let Some(idx) = self.find_name_where(parent, counted).filter(|_| self.chained) else { return false };
        match self.kids_at(idx) {
            0 => {}
            1 => {
                self.unlink(idx);
                self.set_kids(idx, 0);
                self.link_end(idx, false);
            }
            k => self.set_kids(idx, k - 1),
        }
        true
    }

    /// Remove `d`; its (parent, kids), for the owner to keep while the block is elsewhere.
    pub fn take_chained(&mut self, d: &Digest) -> Option<(ParentName, u32)> {
        let idx = self.find(d)?;
        let (parent, kids) = (self.link_at(idx).parent(), self.kids_at(idx));
        self.remove_at(idx);
        Some((parent, kids))
    }

    /// Evict the least recently used chain tail: (its digest, its parent's name, whether the
    /// child was counted off a parent here, `drop_kid`). Such a parent may be the next tail;
    /// otherwise the count is the owner's to drop.
    pub fn pop_tail(&mut self) -> Option<(Digest, ParentName, bool)> {
        let idx = self.ends[TAILS].0;
        if idx == u32::MAX {
            return None;
        }
        let (d, parent) = (self.nodes[idx as usize].digest, self.link_at(idx).parent());
        self.remove_at(idx);
        let here = parent != NO_PARENT && self.drop_kid(&parent);
        Some((d, parent, here))
    }

    /// Is the block named `name` in this set?
    pub fn contains_name(&self, name: &ParentName) -> bool {
        self.find_name(name).is_some()
    }

    /// Children counted against `d` (None: not in this set).
    pub fn kids(&self, d: &Digest) -> Option<u32> {
        self.find(d).map(|idx| self.kids_at(idx))
    }

    fn link_at(&self, idx: u32) -> Link {
        self.links.get(idx as usize).copied().unwrap_or(Link::NONE)
    }

    /// Make present `child` extend present `parent` (a restart linking what it adopted): sets
    /// the child's parent and counts it against the parent. False if either is absent or the
    /// child is linked already.
    pub fn link(&mut self, child: &Digest, parent: &Digest) -> bool {
        let Some(idx) = self.find(child).filter(|_| self.chained) else { return false };
        if self.link_at(idx).parent() != NO_PARENT || child == parent || !self.contains(parent) {
            return false;
        }
        let name = parent_name(parent);
        self.links[idx as usize].parent.copy_from_slice(&name[..NAME_LEN]);
        self.add_kid(&name)
    }
}

/// Positions of the records in `hashes` (concatenated, `hash_len` bytes each) whose digest
/// under `head` is in `wanted`: turns digests the set evicted back into full keys from the
/// owner's key arena.
pub fn find_records(head: &[u8], hashes: &[u8], hash_len: usize, wanted: &HashSet<Digest>) -> Vec<usize> {
    if hash_len == 0 || wanted.is_empty() {
        return Vec::new();
    }
    hashes
        .chunks_exact(hash_len)
        .enumerate()
        .filter(|(_, h)| wanted.contains(&digest(head, h)))
        .map(|(i, _)| i)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn d(i: u8) -> Digest {
        [i; 8]
    }

    fn n(i: u8) -> ParentName {
        parent_name(&d(i))
    }

    /// A chain 1 <- 2 <- 3 (3 extends 2 extends 1), as the owner builds it.
    fn chain() -> BlockSet {
        let mut s = BlockSet::with_chains();
        s.insert_chained(d(1), NO_PARENT, 0).unwrap();
        for i in 2..=3 {
            s.insert_chained(d(i), n(i - 1), 0).unwrap();
            assert!(s.add_kid(&n(i - 1)));
        }
        s
    }

    #[test]
    fn tails_go_first_and_their_parents_follow() {
        let mut s = chain();
        assert_eq!(s.kids(&d(1)), Some(1));
        assert_eq!(s.pop_tail(), Some((d(3), n(2), true)));
        assert_eq!(s.pop_tail(), Some((d(2), n(1), true)));
        assert_eq!(s.pop_tail(), Some((d(1), NO_PARENT, false)));
        assert_eq!(s.pop_tail(), None);
    }

    #[test]
    fn a_block_held_by_a_child_elsewhere_is_never_a_tail() {
        let mut s = BlockSet::with_chains();
        s.insert_chained(d(1), NO_PARENT, 1).unwrap(); // its child lives outside the set
        s.insert_chained(d(2), NO_PARENT, 0).unwrap();
        assert_eq!(s.pop_front(), Some(d(2)));
        assert_eq!(s.pop_front(), None);
        assert!(s.drop_kid(&n(1)));
        assert_eq!(s.pop_front(), Some(d(1)));
    }

    #[test]
    fn links_survive_the_swap_removal() {
        let mut s = chain();
        s.insert_chained(d(9), NO_PARENT, 0).unwrap();
        assert_eq!(s.take_chained(&d(1)), Some((NO_PARENT, 1))); // d(9) moves into its place
        assert_eq!(s.take_chained(&d(2)), Some((n(1), 1)));
        assert_eq!(s.kids(&d(9)), Some(0));
        assert_eq!(s.take_chained(&d(3)), Some((n(2), 0)));
        assert!(!s.link(&d(9), &d(3))); // the parent is gone
    }

    #[test]
    fn plain_sets_keep_no_links() {
        let mut s = BlockSet::new();
        s.insert_chained(d(1), n(2), 3).unwrap();
        assert!(!s.add_kid(&n(1)));
        assert_eq!(s.kids(&d(1)), Some(0));
        assert_eq!(s.pop_front(), Some(d(1)));
    }

    #[test]
    fn a_parent_is_found_by_its_name_only() {
        let mut s = BlockSet::with_chains();
        let (a, mut b, mut c) = (d(7), d(7), d(7));
        b[NAME_LEN - 1] = 8; // another name: another block
        c[NAME_LEN] = 8; // another fingerprint, the same name: the clash names allow
        s.insert_chained(a, NO_PARENT, 0).unwrap();
        assert_eq!(parent_name(&a), [7, 7, 7, 7, 7, 0, 0, 0]);
        assert!(s.contains_name(&parent_name(&a)) && s.contains_name(&a));
        assert!(!s.contains_name(&parent_name(&b)));
        assert!(!s.contains(&b));
        assert!(s.contains_name(&parent_name(&c)) && !s.contains(&c));
        assert!(!s.contains_name(&n(9)));
        assert!(s.add_kid(&parent_name(&a)));
        assert_eq!(s.kids(&a), Some(1));
    }

    #[test]
    fn a_link_is_7_bytes_and_a_chained_node_23() {
        assert_eq!(std::mem::size_of::<Link>(), 7);
        let n = 10_000;
        let mut s = BlockSet::with_chains();
        s.reserve(n).unwrap();
        for i in 0..n as u32 {
            let mut k = [0u8; 8];
            k[..4].copy_from_slice(&i.wrapping_mul(0x9E37_79B9).to_le_bytes());
            k[4..].copy_from_slice(&i.to_le_bytes());
            s.insert_chained(k, NO_PARENT, 0).unwrap();
        }
        // 16-byte node + 7-byte link + 4-byte slots at 80 % load.
        assert!(s.heap_bytes() <= 23 * n + 4 * (n + n / 4 + 1), "{}", s.heap_bytes() as f64 / n as f64);
    }

    #[test]
    fn counts_past_a_u16_stay_exact() {
        let many = u16::MAX as u32 + 10;
        let mut s = BlockSet::with_chains();
        s.insert_chained(d(1), NO_PARENT, 0).unwrap();
        s.insert_chained(d(2), NO_PARENT, many).unwrap(); // a warm parent's count comes in
        for _ in 0..many {
            assert!(s.add_kid(&n(1)));
        }
        assert_eq!((s.kids(&d(1)), s.kids(&d(2))), (Some(many), Some(many)));
        let big = s.heap_bytes();
        // d(1) leaves: d(2) moves into its arena place, its count (keyed by digest) with it.
        assert_eq!(s.take_chained(&d(1)), Some((NO_PARENT, many)));
        assert_eq!(s.kids(&d(2)), Some(many));
        for left in (1..many).rev() {
            assert!(s.drop_kid(&n(2)));
            assert_eq!(s.pop_front(), None, "held with {left} children");
        }
        assert_eq!(s.kids(&d(2)), Some(1));
        assert!(s.drop_kid(&n(2)));
        assert!(!s.drop_kid(&n(2)), "no child counted here: the owner's count is the one");
        assert_eq!(s.kids(&d(2)), Some(0), "and no underflow");
        assert_eq!(s.pop_front(), Some(d(2)));
        assert!(s.many_kids.is_empty() && s.heap_bytes() <= big);
    }

    #[test]
    fn a_name_clash_only_moves_a_count() {
        // Two blocks whose fingerprints differ past the name: a child counted against the name
        // holds one of them; its drop frees the same one, and both can go.
        let (a, mut b) = (d(5), d(5));
        b[NAME_LEN] = 6;
        let mut s = BlockSet::with_chains();
        s.insert_chained(a, NO_PARENT, 0).unwrap();
        s.insert_chained(b, NO_PARENT, 0).unwrap();
        assert!(s.add_kid(&parent_name(&a)));
        assert_eq!(s.kids(&a).unwrap() + s.kids(&b).unwrap(), 1);
        assert!(s.drop_kid(&parent_name(&b)));
        assert_eq!((s.kids(&a), s.kids(&b)), (Some(0), Some(0)));
        assert!(s.pop_front().is_some() && s.pop_front().is_some() && s.is_empty());
        // The count sits on the one found second (it came with it): a drop finds it there,
        // not on the first one without a child, which would hold `b` forever.
        s.insert_chained(a, NO_PARENT, 0).unwrap();
        s.insert_chained(b, NO_PARENT, 1).unwrap();
        assert_eq!(s.pop_front(), Some(a));
        s.insert_chained(a, NO_PARENT, 0).unwrap();
        assert!(s.drop_kid(&parent_name(&a)));
        assert_eq!((s.kids(&a), s.kids(&b)), (Some(0), Some(0)));
        assert!(!s.drop_kid(&parent_name(&a)), "no child of that name is counted here");
        assert_eq!(s.pop_front(), Some(b), "b left the inner list at the front");
    }

    #[test]
    fn records_are_found_by_digest() {
        let head = b"head";
        let hashes = b"aabbcc".to_vec();
        let wanted: HashSet<Digest> = [digest(head, b"cc"), digest(head, b"aa")].into();
        assert_eq!(find_records(head, &hashes, 2, &wanted), vec![0, 2]);
    }
}
