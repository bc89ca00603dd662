//! The in-memory index: logical key -> content hash -> extent. Keys are kept in eviction
//! order (LRU or FIFO); content is refcounted by keys and pinned by in-flight reads, and its
//! extent is released only when both counts reach zero.
//!
//! Memory is the design constraint (a 4 TB tier of 256 KiB blocks is ~16 M keys), so both
//! sides are packed arenas of fixed-size records behind u32-id hash tables (`keys.rs`,
//! `contents.rs`, `probe.rs`) instead of maps of boxed keys and per-entry structs.

pub mod admission;
mod arena;
pub mod block_set;
mod by_fingerprint;
mod contents;
mod keys;
mod probe;

pub use contents::ContentEntry;

use contents::ContentArena;
use keys::KeyArena;

use crate::error::{Result, StoreError};
use crate::format::journal::Location;
use crate::format::{round_up_to_page, PAGE};
use crate::hashing::ContentHash;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum EvictionPolicy {
    /// Least recently used: reads move a key to the back.
    Lru,
    /// First in, first out: reads do not change the order.
    Fifo,
}

impl EvictionPolicy {
    /// The names `parse` accepts, exported to Python as `EVICTIONS`.
    pub const NAMES: &'static [&'static str] = &["lru", "fifo"];

    pub fn parse(name: &str) -> Result<Self> {
        match name {
            "lru" => Ok(EvictionPolicy::Lru),
            "fifo" => Ok(EvictionPolicy::Fifo),
            other => Err(StoreError::Config(format!(
                "eviction: unknown policy {other:?} (expected \"lru\" or \"fifo\")"
            ))),
        }
    }
}

/// Pages an extent occupies: the header page plus the payload rounded up.
pub fn extent_pages(stored_len: u64) -> u64 {
    1 + (round_up_to_page(stored_len as usize) / PAGE) as u64
}

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

pub struct Index {
    keys: KeyArena,
    contents: ContentArena,
    policy: EvictionPolicy,
    logical_bytes: u64,
    physical_bytes: u64,
    content_raw_bytes: u64,
    content_stored_bytes: u64,
}

impl Index {
    pub fn new(policy: EvictionPolicy) -> Self {
        Index {
            keys: KeyArena::default(),
            contents: ContentArena::default(),
            policy,
            logical_bytes: 0,
            physical_bytes: 0,
            content_raw_bytes: 0,
            content_stored_bytes: 0,
        }
    }

    /// Make room for `additional` more keys (and as many contents) at once, so that a replay
    /// does not grow its way up.
    pub fn reserve(&mut self, additional: usize) {
        self.keys.reserve(additional);
        self.contents.reserve(additional);
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

    pub fn content(&self, hash: &ContentHash) -> Option<ContentEntry> {
        self.contents.find(hash).map(|id| self.contents.entry(id))
    }

    /// Where content `hash` lies, if it is known (replay's cheaper `content`).
    pub fn content_loc(&self, hash: &ContentHash) -> Option<Location> {
        self.contents.find(hash).map(|id| self.contents.loc(id))
    }

    pub fn lookup(&self, key: &[u8]) -> Option<(ContentHash, ContentEntry)> {
        let c = self.keys.content(self.keys.find(key)?);
        Some((self.contents.hash(c), self.contents.entry(c)))
    }

    /// Record an access for the eviction order.
    pub fn touch(&mut self, key: &[u8]) {
        if self.policy == EvictionPolicy::Lru {
            if let Some(id) = self.keys.find(key) {
                self.keys.move_to_back(id);
            }
        }
    }

    fn touch_id(&mut self, id: u32) {
        if self.policy == EvictionPolicy::Lru {
            self.keys.move_to_back(id);
        }
    }

    /// Map `key` to content `hash`. `loc` is used only when the content is new. Returns the
    /// extent of content that lost its last reference (when `key` was remapped).
    pub fn insert(&mut self, key: &[u8], hash: ContentHash, loc: &Location) -> Option<FreedExtent> {
        let known = self.contents.find(&hash);
        self.insert_at(key, hash, loc, known)
    }

    /// `insert` once content `hash` was looked up (`known`: its id, if any).
    fn insert_at(
        &mut self,
        key: &[u8],
        hash: ContentHash,
        loc: &Location,
        known: Option<u32>,
    ) -> Option<FreedExtent> {
        let mut released = None;
        if let Some(id) = self.keys.find(key) {
            if self.contents.hash(self.keys.content(id)) == hash {
                self.touch_id(id);
                return None;
            }
            released = self.remove(key);
        }
        // The remove above released only the old content (not `hash`'s): `known` stays valid.
        let content = match known {
            Some(c) => c,
            None => {
                self.physical_bytes += extent_pages(loc.stored_len) * PAGE as u64;
                self.content_raw_bytes += loc.raw_len;
                self.content_stored_bytes += loc.stored_len;
                self.contents.add(hash, loc)
            }
        };
        self.contents.add_ref(content);
        self.logical_bytes += self.contents.loc(content).raw_len;
        self.keys.insert(key, content);
        released
    }

    /// Start loading what a `replay_put` of `key` / `hash` will probe (a cache hint).
    pub fn prefetch(&self, key: &[u8], hash: &ContentHash) {
        self.keys.prefetch(key);
        self.contents.prefetch(hash);
    }

    /// Replay's put: `insert` with one content lookup. A content already known elsewhere is
    /// not mapped (the record is stale); a new one only when `admit` (the allocator taking
    /// its extent) agrees. None: the record was dropped.
    pub fn replay_put(
        &mut self,
        key: &[u8],
        hash: ContentHash,
        loc: &Location,
        admit: impl FnOnce() -> bool,
    ) -> Option<Option<FreedExtent>> {
        let known = self.contents.find(&hash);
        if let Some(c) = known {
            if self.contents.loc(c) != *loc {
                return None;
            }
        } else if !admit() {
            return None;
        }
        Some(self.insert_at(key, hash, loc, known))
    }

    pub fn remove(&mut self, key: &[u8]) -> Option<FreedExtent> {
        let id = self.keys.find(key)?;
        let content = self.keys.content(id);
        self.keys.remove(id);
        self.contents.drop_ref(content);
        self.logical_bytes -= self.contents.loc(content).raw_len;
        self.release_if_unused(content)
    }

    /// Mark content as damaged (see `ContentEntry::poisoned`).
    pub fn poison(&mut self, hash: &ContentHash) {
        if let Some(id) = self.contents.find(hash) {
            self.contents.poison(id);
        }
    }

    /// Pin content for an in-flight read so its extent cannot be reused under the reader.
    pub fn pin(&mut self, hash: &ContentHash) {
        if let Some(id) = self.contents.find(hash) {
            self.contents.pin(id);
        }
    }

    pub fn unpin(&mut self, hash: &ContentHash) -> Option<FreedExtent> {
        let id = self.contents.find(hash)?;
        self.contents.unpin(id);
        self.release_if_unused(id)
    }

    fn release_if_unused(&mut self, content: u32) -> Option<FreedExtent> {
        if self.contents.refs(content) > 0 || self.contents.readers(content) > 0 {
            return None;
        }
        let loc = self.contents.remove(content);
        self.physical_bytes -= extent_pages(loc.stored_len) * PAGE as u64;
        self.content_raw_bytes -= loc.raw_len;
        self.content_stored_bytes -= loc.stored_len;
        Some(freed(&loc))
    }

    /// The next key to evict (front of the order).
    pub fn victim(&self) -> Option<Vec<u8>> {
        self.keys.front().map(|id| self.keys.key(id))
    }

    /// Keys (rebuilt from the packed arena) with their content hash, coldest to hottest.
    pub fn keys_in_order(&self) -> impl Iterator<Item = (Vec<u8>, ContentHash)> + '_ {
        self.keys.order().map(|id| (self.keys.key(id), self.contents.hash(self.keys.content(id))))
    }

    /// Visit every key with its content and its chain parent (if stored), coldest first,
    /// through reused key buffers.
    pub fn for_each_in_order(&self, mut f: impl FnMut(&[u8], &ContentHash, Location, Option<&[u8]>)) {
        let mut key = Vec::with_capacity(keys::HEAD_LEN + keys::TAIL_MAX);
        let mut parent = Vec::with_capacity(keys::HEAD_LEN + keys::TAIL_MAX);
        for id in self.keys.order() {
            self.keys.key_into(id, &mut key);
            let p = self.keys.parent(id).map(|p| {
                self.keys.key_into(p, &mut parent);
                parent.as_slice()
            });
            let c = self.keys.content(id);
            f(&key, &self.contents.hash(c), self.contents.loc(c), p);
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
