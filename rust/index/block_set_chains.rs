//! Chain links in a `BlockSet`: which block each one extends, and how many cached children
//! depend on it, so that the set's eviction order is prefix-aware.
//!
//! A prefix match stops at the first miss, so a block must outlive its children (vLLM's prefix
//! cache frees tail-first for the same reason). Each node keeps its parent's name (the parent's
//! 8-byte fingerprint: robust to the arena's swap-removal, unlike an index, and it names a
//! parent outside the set too) and a count of children counted against it by the owner (the
//! tier index counts every cached child, in whatever tier or set it lives). Two blocks whose
//! names collide (~2^-64 per pair) could only swap places in the eviction order: a name never
//! decides what is read.
//! Nodes with no counted child are chain tails: they form the LRU list that `pop_front` /
//! `pop_tail` evict from. The others sit on a second list and become tails, at the front (they
//! were used with the child that just left), when their last child goes. A node whose parent is
//! not in this set keeps the name anyway: the owner resolves it (the parent may be warm).

use std::collections::HashSet;

use super::{digest, BlockSet, Digest, Link, SetError, TAILS};

/// A chain parent's name: its fingerprint.
pub type ParentName = Digest;

/// The parent name of a node that extends no known block.
pub const NO_PARENT: ParentName = [0u8; 8];

/// The name chain links call the block with digest `d` by (the digest itself since digests
/// are 8 bytes; kept as a function so callers name what they mean).
pub fn parent_name(d: &Digest) -> ParentName {
    *d
}

impl BlockSet {
    /// Add `d` as a block extending the one named `parent` with `kids` cached children counted
    /// against it. `Ok(false)` if present (its links are kept).
    pub fn insert_chained(&mut self, d: Digest, parent: ParentName, kids: u32) -> Result<bool, SetError> {
        self.insert_node(d, parent, kids)
    }

    /// One more cached child depends on the block named `parent`; false if it is not here.
    pub fn add_kid(&mut self, parent: &ParentName) -> bool {
        let Some(idx) = self.find(parent).filter(|_| self.chained) else { return false };
        let kids = self.links[idx as usize].kids;
        if kids == 0 {
            self.unlink(idx); // from the tails
            self.links[idx as usize].kids = 1;
            self.link_back(idx);
        } else {
            self.links[idx as usize].kids = kids.saturating_add(1);
        }
        true
    }

    /// A cached child of `parent` left; false if `parent` is not in this set. Its last child
    /// gone, the parent is a tail and goes next.
    pub fn drop_kid(&mut self, parent: &ParentName) -> bool {
        let Some(idx) = self.find(parent).filter(|_| self.chained) else { return false };
        match self.links[idx as usize].kids {
            0 => {}
            1 => {
                self.unlink(idx);
                self.links[idx as usize].kids = 0;
                self.link_end(idx, false);
            }
            k => self.links[idx as usize].kids = k - 1,
        }
        true
    }

    /// Remove `d`; its (parent, kids), for the owner to keep while the block is elsewhere.
    pub fn take_chained(&mut self, d: &Digest) -> Option<(ParentName, u32)> {
        let idx = self.find(d)?;
        let link = self.link_at(idx);
        self.remove_at(idx);
        Some((link.parent, link.kids))
    }

    /// Evict the least recently used chain tail: (its digest, its parent's name, whether
    /// that parent is in this set). A parent here has the child's count dropped already (so
    /// it may be the next tail); one elsewhere is the owner's to update.
    pub fn pop_tail(&mut self) -> Option<(Digest, ParentName, bool)> {
        let idx = self.ends[TAILS].0;
        if idx == u32::MAX {
            return None;
        }
        let (d, link) = (self.nodes[idx as usize].digest, self.link_at(idx));
        self.remove_at(idx);
        let here = link.parent != NO_PARENT && self.drop_kid(&link.parent);
        Some((d, link.parent, here))
    }

    /// Is the block named `name` in this set?
    pub fn contains_name(&self, name: &ParentName) -> bool {
        self.find(name).is_some()
    }

    /// Children counted against `d` (None: not in this set).
    pub fn kids(&self, d: &Digest) -> Option<u32> {
        self.find(d).map(|idx| self.link_at(idx).kids)
    }

    fn link_at(&self, idx: u32) -> Link {
        self.links.get(idx as usize).copied().unwrap_or(Link { parent: NO_PARENT, kids: 0 })
    }

    /// Make present `child` extend present `parent` (a restart linking what it adopted): sets
    /// the child's parent and counts it against the parent. False if either is absent or the
    /// child is linked already.
    pub fn link(&mut self, child: &Digest, parent: &Digest) -> bool {
        let Some(idx) = self.find(child).filter(|_| self.chained) else { return false };
        if self.links[idx as usize].parent != NO_PARENT || child == parent || !self.contains(parent) {
            return false;
        }
        let name = parent_name(parent);
        self.links[idx as usize].parent = name;
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
        let (a, mut b) = (d(7), d(7));
        b[7] = 8; // another fingerprint: another block
        s.insert_chained(a, NO_PARENT, 0).unwrap();
        assert!(s.contains_name(&parent_name(&a)));
        assert!(!s.contains_name(&parent_name(&b)));
        assert!(!s.contains(&b));
        assert!(!s.contains_name(&n(9)));
        assert!(s.add_kid(&parent_name(&a)));
        assert_eq!(s.kids(&a), Some(1));
    }

    #[test]
    fn records_are_found_by_digest() {
        let head = b"head";
        let hashes = b"aabbcc".to_vec();
        let wanted: HashSet<Digest> = [digest(head, b"cc"), digest(head, b"aa")].into();
        assert_eq!(find_records(head, &hashes, 2, &wanted), vec![0, 2]);
    }
}
