//! The in-memory index: logical key -> content hash -> extent. Keys are kept in eviction
//! order (LRU or FIFO); content is refcounted by keys and pinned by in-flight reads, and its
//! extent is released only when both counts reach zero.

pub mod admission;

use std::collections::hash_map::Entry;
use std::collections::HashMap;

use hashlink::LinkedHashMap;

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

#[derive(Clone, Debug)]
pub struct ContentEntry {
    pub loc: Location,
    pub refs: u32,
    pub readers: u32,
    /// Failed verification: kept only until its last reader unpins; never deduped onto.
    pub poisoned: bool,
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
    keys: LinkedHashMap<Box<[u8]>, ContentHash>,
    contents: HashMap<ContentHash, ContentEntry>,
    policy: EvictionPolicy,
    logical_bytes: u64,
    physical_bytes: u64,
    content_raw_bytes: u64,
    content_stored_bytes: u64,
}

impl Index {
    pub fn new(policy: EvictionPolicy) -> Self {
        Index {
            keys: LinkedHashMap::new(),
            contents: HashMap::new(),
            policy,
            logical_bytes: 0,
            physical_bytes: 0,
            content_raw_bytes: 0,
            content_stored_bytes: 0,
        }
    }

    /// Make room for `additional` more keys (and as many contents) at once, so that a replay
    /// does not rehash its way up.
    pub fn reserve(&mut self, additional: usize) {
        self.keys.reserve(additional);
        self.contents.reserve(additional);
    }

    pub fn len(&self) -> usize {
        self.keys.len()
    }

    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// Bytes held (estimated from capacities and allocation sizes, allocator overhead included).
    pub fn nbytes(&self) -> usize {
        use std::mem::size_of;
        // A heap allocation costs its size rounded up to 16 plus about 16 bytes of bookkeeping.
        let heap = |n: usize| n.div_ceil(16) * 16 + 16;
        let key_node = heap(size_of::<Box<[u8]>>() + size_of::<ContentHash>() + 2 * size_of::<usize>());
        let key_bytes: usize = self.keys.keys().map(|k| heap(k.len())).sum();
        let keys = self.keys.capacity() * (size_of::<usize>() + 1) + self.keys.len() * key_node + key_bytes;
        let contents = self.contents.capacity() * (size_of::<(ContentHash, ContentEntry)>() + 1);
        keys + contents
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
        self.keys.contains_key(key)
    }

    pub fn content(&self, hash: &ContentHash) -> Option<&ContentEntry> {
        self.contents.get(hash)
    }

    pub fn lookup(&self, key: &[u8]) -> Option<(ContentHash, &ContentEntry)> {
        let hash = self.keys.get(key)?;
        self.contents.get(hash).map(|c| (*hash, c))
    }

    /// Record an access for the eviction order.
    pub fn touch(&mut self, key: &[u8]) {
        if self.policy == EvictionPolicy::Lru {
            self.keys.to_back(key);
        }
    }

    /// Map `key` to content `hash`. `loc` is used only when the content is new. Returns the
    /// extent of content that lost its last reference (when `key` was remapped).
    pub fn insert(&mut self, key: &[u8], hash: ContentHash, loc: &Location) -> Option<FreedExtent> {
        let mut released = None;
        if let Some(old) = self.keys.get(key).copied() {
            if old == hash {
                self.touch(key);
                return None;
            }
            released = self.remove(key);
        }
        let entry = match self.contents.entry(hash) {
            Entry::Occupied(o) => o.into_mut(),
            Entry::Vacant(v) => {
                self.physical_bytes += extent_pages(loc.stored_len) * PAGE as u64;
                self.content_raw_bytes += loc.raw_len;
                self.content_stored_bytes += loc.stored_len;
                v.insert(ContentEntry { loc: loc.clone(), refs: 0, readers: 0, poisoned: false })
            }
        };
        entry.refs += 1;
        self.logical_bytes += entry.loc.raw_len;
        self.keys.insert(key.into(), hash);
        released
    }

    pub fn remove(&mut self, key: &[u8]) -> Option<FreedExtent> {
        let hash = self.keys.remove(key)?;
        let entry = self.contents.get_mut(&hash)?;
        entry.refs -= 1;
        self.logical_bytes -= entry.loc.raw_len;
        self.release_if_unused(&hash)
    }

    /// Mark content as damaged (see `ContentEntry::poisoned`).
    pub fn poison(&mut self, hash: &ContentHash) {
        if let Some(e) = self.contents.get_mut(hash) {
            e.poisoned = true;
        }
    }

    /// Pin content for an in-flight read so its extent cannot be reused under the reader.
    pub fn pin(&mut self, hash: &ContentHash) {
        if let Some(e) = self.contents.get_mut(hash) {
            e.readers += 1;
        }
    }

    pub fn unpin(&mut self, hash: &ContentHash) -> Option<FreedExtent> {
        let e = self.contents.get_mut(hash)?;
        e.readers = e.readers.saturating_sub(1);
        self.release_if_unused(hash)
    }

    fn release_if_unused(&mut self, hash: &ContentHash) -> Option<FreedExtent> {
        let e = self.contents.get(hash)?;
        if e.refs > 0 || e.readers > 0 {
            return None;
        }
        let e = self.contents.remove(hash)?;
        self.physical_bytes -= extent_pages(e.loc.stored_len) * PAGE as u64;
        self.content_raw_bytes -= e.loc.raw_len;
        self.content_stored_bytes -= e.loc.stored_len;
        Some(freed(&e.loc))
    }

    /// The next key to evict (front of the order).
    pub fn victim(&self) -> Option<Vec<u8>> {
        self.keys.front().map(|(k, _)| k.to_vec())
    }

    /// Keys from coldest to hottest.
    pub fn keys_in_order(&self) -> impl Iterator<Item = (&[u8], &ContentHash)> {
        self.keys.iter().map(|(k, h)| (&**k, h))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn loc(offset: u64, len: u64) -> Location {
        Location { dir: 0, offset, stored_len: len, raw_len: len, compressed: false, seq: 1 }
    }

    #[test]
    fn dedup_refcounts_free_at_zero() {
        let mut ix = Index::new(EvictionPolicy::Lru);
        assert_eq!(ix.insert(b"a", [1; 16], &loc(4096, 8192)), None);
        assert_eq!(ix.insert(b"b", [1; 16], &loc(999, 8192)), None);
        assert_eq!(ix.content_count(), 1);
        assert_eq!(ix.logical_bytes(), 16384);
        assert_eq!(ix.physical_bytes(), 3 * 4096);
        assert_eq!(ix.remove(b"a"), None);
        let f = ix.remove(b"b").expect("last ref frees");
        assert_eq!(f, FreedExtent { dir: 0, first_page: 1, pages: 3 });
        assert_eq!(ix.physical_bytes(), 0);
    }

    #[test]
    fn pinned_content_is_freed_by_the_last_reader() {
        let mut ix = Index::new(EvictionPolicy::Lru);
        ix.insert(b"a", [2; 16], &loc(8192, 4096));
        ix.pin(&[2; 16]);
        assert_eq!(ix.remove(b"a"), None);
        assert!(ix.unpin(&[2; 16]).is_some());
    }

    #[test]
    fn lru_and_fifo_orders() {
        for (policy, expect) in [(EvictionPolicy::Lru, b"b"), (EvictionPolicy::Fifo, b"a")] {
            let mut ix = Index::new(policy);
            ix.insert(b"a", [1; 16], &loc(4096, 4096));
            ix.insert(b"b", [2; 16], &loc(12288, 4096));
            ix.touch(b"a");
            assert_eq!(ix.victim().unwrap(), expect.to_vec());
        }
    }

    #[test]
    fn remap_releases_old_content() {
        let mut ix = Index::new(EvictionPolicy::Lru);
        ix.insert(b"k", [1; 16], &loc(4096, 4096));
        let f = ix.insert(b"k", [2; 16], &loc(12288, 4096));
        assert_eq!(f.map(|f| f.first_page), Some(1));
        assert_eq!(ix.len(), 1);
        assert_eq!(ix.lookup(b"k").unwrap().0, [2; 16]);
    }
}
