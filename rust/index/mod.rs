//! The in-memory index: logical key -> content (tag) -> extent. No eviction order is kept:
//! the store's owner (the scheduler's index) decides evictions and deletes what it evicts;
//! content is refcounted by keys and pinned by in-flight reads, and its extent is released
//! only when both counts reach zero.
//!
//! Memory is the design constraint (a 4 TB tier of 256 KiB blocks is ~16 M keys), so both
//! sides are packed arenas of fixed-size records behind u32-id hash tables (`keys.rs`,
//! `contents.rs`, `probe.rs`) instead of maps of boxed keys and per-entry structs. The two
//! arenas are parallel: slot `i` holds a key and, in the usual case, that key's own content
//! (content id = key id); a deduplicated key's slot redirects to the content it shares. A
//! slot is freed when both halves are: a content outlives its key while other keys or readers
//! hold it.

mod arena;
pub mod block_set;
mod by_fingerprint;
mod contents;
mod keys;
mod probe;

pub use contents::ContentEntry;

use contents::ContentArena;
use keys::KeyArena;

use crate::format::journal::{ContentTag, Location};
use crate::format::PAGE;

/// A content's id in the index: what a key record names and a reader pins.
pub type ContentId = u32;

pub use crate::format::layout::extent_pages;

/// An extent whose last reference went away: the caller returns it to the allocator.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FreedExtent {
    pub dir: u16,
    pub first_page: u64,
    pub pages: u64,
}

fn freed(loc: &Location) -> FreedExtent {
    FreedExtent { dir: loc.dir, first_page: loc.offset / PAGE as u64, pages: extent_pages(loc.stored_len) }
}

#[derive(Default)]
pub struct Index {
    keys: KeyArena,
    contents: ContentArena,
    logical_bytes: u64,
    physical_bytes: u64,
    content_raw_bytes: u64,
    content_stored_bytes: u64,
}

impl Index {
    pub fn new() -> Self {
        Self::default()
    }

    /// Make room for `additional` more keys (and as many contents) at once, so that a replay
    /// does not grow its way up.
    pub fn reserve(&mut self, additional: usize) {
        self.keys.reserve(additional);
        self.contents.reserve(self.keys.capacity(), additional);
    }

    pub fn len(&self) -> usize {
        self.keys.len()
    }

    pub fn is_empty(&self) -> bool {
        self.keys.len() == 0
    }

    /// Bytes held (capacities of the arenas and tables; side maps estimated).
    pub fn nbytes(&self) -> usize {
        std::mem::size_of::<Self>() + self.keys.nbytes() + self.contents.nbytes()
    }

    pub fn content_count(&self) -> usize {
        self.contents.len()
    }

    /// Sum of the raw lengths of all keys (what callers think is stored).
    pub fn logical_bytes(&self) -> u64 {
        self.logical_bytes
    }

    /// Bytes of extents on disk, headers included (what is really stored).
    pub fn physical_bytes(&self) -> u64 {
        self.physical_bytes
    }

    /// (raw, stored) bytes summed over unique contents: dedup and compression ratios.
    pub fn content_totals(&self) -> (u64, u64) {
        (self.content_raw_bytes, self.content_stored_bytes)
    }

    pub fn contains(&self, key: &[u8]) -> bool {
        self.keys.find(key).is_some()
    }

    /// A stored content tagged `tag`: a dedup candidate, to be confirmed against the full hash
    /// in its header page before a key is mapped onto it (tags of different blocks clash
    /// ~2^-48 of the time).
    pub fn candidate(&self, tag: ContentTag) -> Option<(ContentId, ContentEntry)> {
        self.contents.find(&tag).map(|id| (id, self.contents.entry(id)))
    }

    /// Content `id`, if it is still live.
    pub fn content(&self, id: ContentId) -> Option<ContentEntry> {
        self.contents.is_live(id).then(|| self.contents.entry(id))
    }

    /// The content `key` maps to: its id (for pins) and what is known of it.
    pub fn lookup(&self, key: &[u8]) -> Option<(ContentId, ContentEntry)> {
        let c = self.contents.resolve(self.keys.find(key)?);
        Some((c, self.contents.entry(c)))
    }

    /// Map `key` to the content tagged `tag` that lies at `loc`, adding it when no content is
    /// there yet (the caller owns the extent then). Returns the extent of content that lost
    /// its last reference (when `key` was remapped).
    pub fn insert(&mut self, key: &[u8], tag: ContentTag, loc: &Location) -> Option<FreedExtent> {
        let known = self.contents.find_at(&tag, loc);
        self.insert_at(key, tag, loc, known)
    }

    /// Map `key` onto the stored content tagged `tag` at `loc` (a confirmed duplicate); None
    /// when no such content is stored any more (nothing changed).
    pub fn share(&mut self, key: &[u8], tag: ContentTag, loc: &Location) -> Option<Option<FreedExtent>> {
        let known = self.contents.find_at(&tag, loc)?;
        Some(self.insert_at(key, tag, loc, Some(known)))
    }

    /// `insert` once the content at `loc` was looked up (`known`: its id, if any).
    fn insert_at(
        &mut self,
        key: &[u8],
        tag: ContentTag,
        loc: &Location,
        known: Option<u32>,
    ) -> Option<FreedExtent> {
        let mut released = None;
        if let Some(id) = self.keys.find(key) {
            if Some(self.contents.resolve(id)) == known {
                return None;
            }
            released = self.remove(key);
        }
        // The remove above released only the old content (not `known`): `known` stays valid,
        // and its slot is not free, so the key gets another.
        let id = self.keys.insert(key);
        let content = match known {
            Some(c) => {
                self.contents.redirect(id, c);
                c
            }
            None => {
                self.physical_bytes += extent_pages(loc.stored_len) * PAGE as u64;
                self.content_raw_bytes += loc.raw_len;
                self.content_stored_bytes += loc.stored_len;
                self.contents.add_at(id, tag, loc);
                id
            }
        };
        self.contents.add_ref(content);
        self.logical_bytes += self.contents.loc(content).raw_len;
        released
    }

    /// Start loading what a `replay_put` of `key` / `tag` will probe (a cache hint).
    pub fn prefetch(&self, key: &[u8], tag: ContentTag) {
        self.keys.prefetch(key);
        self.contents.prefetch(&tag);
    }

    /// Replay's put: `insert` with one content lookup. A content already at `loc` is shared;
    /// a new one is added only when `admit` (the allocator taking its extent: it refuses one
    /// that overlaps a live extent, i.e. a stale record) agrees. None: the record was dropped.
    pub fn replay_put(
        &mut self,
        key: &[u8],
        tag: ContentTag,
        loc: &Location,
        admit: impl FnOnce() -> bool,
    ) -> Option<Option<FreedExtent>> {
        let known = self.contents.find_at(&tag, loc);
        if known.is_none() && !admit() {
            return None;
        }
        Some(self.insert_at(key, tag, loc, known))
    }

    pub fn remove(&mut self, key: &[u8]) -> Option<FreedExtent> {
        let id = self.keys.find(key)?;
        let content = self.contents.resolve(id);
        self.keys.remove(id);
        if content != id {
            // A shared content's other key: the slot held only the redirect.
            self.contents.clear(id);
            self.keys.release(id);
        }
        self.contents.drop_ref(content);
        self.logical_bytes -= self.contents.loc(content).raw_len;
        self.release_if_unused(content)
    }

    /// Mark content as damaged (see `ContentEntry::poisoned`).
    pub fn poison(&mut self, id: ContentId) {
        if self.contents.is_live(id) {
            self.contents.poison(id);
        }
    }

    /// Pin content `id` (live: just looked up) for an in-flight read so its extent cannot be
    /// reused under the reader.
    pub fn pin(&mut self, id: ContentId) {
        if self.contents.is_live(id) {
            self.contents.pin(id);
        }
    }

    pub fn unpin(&mut self, id: ContentId) -> Option<FreedExtent> {
        if !self.contents.is_live(id) {
            return None;
        }
        self.contents.unpin(id);
        self.release_if_unused(id)
    }

    fn release_if_unused(&mut self, content: u32) -> Option<FreedExtent> {
        if self.contents.refs(content) > 0 || self.contents.readers(content) > 0 {
            return None;
        }
        let loc = self.contents.remove(content);
        // No key maps here, its own included: the whole slot is free now.
        self.keys.release(content);
        self.physical_bytes -= extent_pages(loc.stored_len) * PAGE as u64;
        self.content_raw_bytes -= loc.raw_len;
        self.content_stored_bytes -= loc.stored_len;
        Some(freed(&loc))
    }

    /// The next key to evict when the device is full (a clock sweep: a last resort).
    pub fn victim(&mut self) -> Option<Vec<u8>> {
        self.keys.victim().map(|id| self.keys.key(id))
    }

    /// Key ids oldest write first (by their contents' write seq).
    fn order(&self) -> impl Iterator<Item = u32> {
        let mut by_seq: Vec<(u64, u32)> =
            self.keys.order().map(|id| (self.contents.seq(self.contents.resolve(id)), id)).collect();
        by_seq.sort_unstable();
        by_seq.into_iter().map(|(_, id)| id)
    }

    /// Keys (rebuilt from the packed arena) with their content id, oldest write first.
    pub fn keys_in_order(&self) -> impl Iterator<Item = (Vec<u8>, ContentId)> + '_ {
        self.order().map(|id| (self.keys.key(id), self.contents.resolve(id)))
    }

    /// `keys_in_order` without the sort (scans under the state lock).
    pub fn keys_any_order(&self) -> impl Iterator<Item = (Vec<u8>, ContentId)> + '_ {
        self.keys.order().map(|id| (self.keys.key(id), self.contents.resolve(id)))
    }

    /// Visit every key with its content's tag and location and its chain parent (if stored),
    /// oldest write first, through reused key buffers.
    pub fn for_each_in_order(&self, f: impl FnMut(&[u8], ContentTag, Location, Option<&[u8]>)) {
        self.visit(self.order(), f)
    }

    /// `for_each_in_order` in arena order, for a compacted journal (no sort under the state
    /// lock: listings sort by seq, which the records carry).
    pub fn for_each(&self, f: impl FnMut(&[u8], ContentTag, Location, Option<&[u8]>)) {
        self.visit(self.keys.order(), f)
    }

    fn visit(
        &self,
        ids: impl Iterator<Item = u32>,
        mut f: impl FnMut(&[u8], ContentTag, Location, Option<&[u8]>),
    ) {
        let mut key = Vec::with_capacity(keys::HEAD_LEN + keys::TAIL_MAX);
        let mut parent = Vec::with_capacity(keys::HEAD_LEN + keys::TAIL_MAX);
        for id in ids {
            self.keys.key_into(id, &mut key);
            let p = self.keys.parent(id).map(|p| {
                self.keys.key_into(p, &mut parent);
                parent.as_slice()
            });
            let c = self.contents.resolve(id);
            f(&key, self.contents.tag(c), self.contents.loc(c), p);
        }
    }

    /// Link `key` (stored) to the previous block of its chain; a parent that is not stored
    /// (or None) clears the link.
    pub fn set_parent(&mut self, key: &[u8], parent: Option<&[u8]>) {
        let Some(id) = self.keys.find(key) else { return };
        let p = parent.and_then(|p| self.keys.find(p)).filter(|&p| p != id);
        self.keys.set_parent(id, p);
    }

    /// `key`'s chain parent, if both are stored.
    pub fn parent(&self, key: &[u8]) -> Option<Vec<u8>> {
        let id = self.keys.find(key)?;
        self.keys.parent(id).map(|p| self.keys.key(p))
    }
}

#[cfg(test)]
mod tests;
