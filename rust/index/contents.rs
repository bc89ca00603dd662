//! The contents of the index, packed: one fixed 24-byte record per stored extent (content
//! tag, where it lies in 4 KiB pages, its stored length, the write's seq and how many keys map
//! to it) in a flat arena, found by content tag through an `IdTable`. The tag is the first 8
//! bytes of the content hash (the full hash is in the extent's header page): two contents may
//! share one, so a content is named by its id, and found by tag *and* location. The raw length is not
//! stored per record: it equals the stored length unless the block is compressed, and a
//! compressed block names it by a u8 into a small table of the store's raw lengths (a store holds
//! blocks of a few sizes). Readers pin contents only while a read is in flight, so their counts
//! live in a small side map; so does a location that does not fit the packed fields (an extent
//! past 16 TiB of one file, a block over 4 GiB, an offset off the page grid, a directory past the
//! 256th, a seq past 2^40, a 256th distinct raw length of compressed blocks).

use std::collections::HashMap;

use super::arena::{Interned, NIL};
use super::probe::IdTable;
use crate::format::journal::{ContentTag, Location};
use crate::format::PAGE;

const COMPRESSED: u8 = 1;
const POISONED: u8 = 2;
/// The location is in `wide`, not in the packed fields.
const WIDE: u8 = 4;
/// One key maps to this content (the usual case: no count stored).
const ONE_REF: u8 = 8;
/// Several keys map to it: their count is in `shared`.
const SHARED: u8 = 16;

/// `raw_id` of a block whose raw length is its stored length (every uncompressed block).
const RAW_IS_STORED: u8 = u8::MAX;
/// Distinct raw lengths of compressed blocks named by `raw_id` (the rest go wide).
const MAX_RAW_LENS: usize = RAW_IS_STORED as usize;

#[derive(Clone, Copy)]
#[repr(C)]
struct ContentRecord {
    tag: ContentTag,
    /// First page of the extent; on the free list, the next free id.
    page: u32,
    stored_len: u32,
    /// The write's seq: low 32 and high 8 bits (2^40 puts: 35 years at a thousand a second;
    /// a later seq goes wide).
    seq_lo: u32,
    seq_hi: u8,
    /// The raw length: `RAW_IS_STORED`, or its index in `raw_lens`.
    raw_id: u8,
    dir: u8,
    flags: u8,
}

/// What the index knows about one content (a copy: the arena holds it packed).
#[derive(Clone, Debug)]
pub struct ContentEntry {
    pub tag: ContentTag,
    pub loc: Location,
    pub refs: u32,
    pub readers: u32,
    /// Failed verification: kept only until its last reader unpins; never deduped onto.
    pub poisoned: bool,
}

/// A tag's table hash: a multiplicative mix (a tag is already a hash, but tests and tools may
/// pass small numbers; unmixed, they would all land in one probe run).
fn hash_content(tag: &ContentTag) -> u32 {
    (tag.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) as u32
}

#[derive(Default)]
pub(crate) struct ContentArena {
    records: Vec<ContentRecord>,
    free: Option<u32>,
    len: usize,
    table: IdTable,
    readers: HashMap<u32, u32>,
    shared: HashMap<u32, u32>,
    wide: HashMap<u32, Location>,
    /// Raw lengths of compressed blocks, named by `raw_id` (never shrinks: a few entries).
    raw_lens: Interned<u32>,
}

impl ContentArena {
    pub fn len(&self) -> usize {
        self.len
    }

    pub fn nbytes(&self) -> usize {
        use std::mem::size_of;
        self.records.capacity() * size_of::<ContentRecord>()
            + self.table.heap_bytes()
            + (self.readers.capacity() + self.shared.capacity()) * 9
            + self.wide.capacity() * (4 + size_of::<Location>() + 1)
            + self.raw_lens.heap_bytes()
    }

    pub fn reserve(&mut self, additional: usize) {
        super::arena::reserve(&mut self.records, self.len, additional);
        if self.table.full_for(self.len + additional) {
            self.rebuild_table(self.len + additional);
        }
    }

    fn rebuild_table(&mut self, len: usize) {
        let live = self.records.iter().enumerate().filter(|(_, r)| r.flags & FREE_MARK == 0);
        let ids: Vec<(u32, u32)> = live.map(|(i, r)| (hash_content(&r.tag), i as u32)).collect();
        self.table.rebuild(len, ids.into_iter());
    }

    pub fn prefetch(&self, tag: &ContentTag) {
        self.table.prefetch(hash_content(tag));
    }

    /// A content tagged `tag` (the first found: a dedup candidate to confirm).
    pub fn find(&self, tag: &ContentTag) -> Option<u32> {
        self.table.find(hash_content(tag), |id| self.records[id as usize].tag == *tag)
    }

    /// The content tagged `tag` that lies at `loc` (seq included): that write's content.
    pub fn find_at(&self, tag: &ContentTag, loc: &Location) -> Option<u32> {
        self.table.find(hash_content(tag), |id| self.records[id as usize].tag == *tag && self.loc(id) == *loc)
    }

    /// Whether `id` names a live content (not a freed record).
    pub fn is_live(&self, id: u32) -> bool {
        self.records.get(id as usize).is_some_and(|r| r.flags & FREE_MARK == 0)
    }

    /// The seq of content `id`'s write (`loc().seq`, without building the location).
    pub fn seq(&self, id: u32) -> u64 {
        let r = &self.records[id as usize];
        if r.flags & WIDE != 0 {
            return self.loc(id).seq;
        }
        r.seq_lo as u64 | (r.seq_hi as u64) << 32
    }

    pub fn tag(&self, id: u32) -> ContentTag {
        self.records[id as usize].tag
    }

    pub fn loc(&self, id: u32) -> Location {
        let r = &self.records[id as usize];
        if r.flags & WIDE != 0 {
            if let Some(loc) = self.wide.get(&id) {
                return loc.clone();
            }
        }
        let raw_len = match r.raw_id {
            RAW_IS_STORED => r.stored_len,
            id => self.raw_lens.values().get(id as usize).copied().unwrap_or(0),
        };
        Location {
            dir: r.dir as u16,
            offset: r.page as u64 * PAGE as u64,
            stored_len: r.stored_len as u64,
            raw_len: raw_len as u64,
            compressed: r.flags & COMPRESSED != 0,
            seq: r.seq_lo as u64 | (r.seq_hi as u64) << 32,
        }
    }

    pub fn entry(&self, id: u32) -> ContentEntry {
        let r = &self.records[id as usize];
        ContentEntry {
            tag: r.tag,
            loc: self.loc(id),
            refs: self.refs(id),
            readers: self.readers(id),
            poisoned: r.flags & POISONED != 0,
        }
    }

    pub fn refs(&self, id: u32) -> u32 {
        let flags = self.records[id as usize].flags;
        if flags & SHARED != 0 {
            self.shared.get(&id).copied().unwrap_or(0)
        } else {
            (flags & ONE_REF != 0) as u32
        }
    }

    pub fn readers(&self, id: u32) -> u32 {
        if self.readers.is_empty() {
            return 0;
        }
        self.readers.get(&id).copied().unwrap_or(0)
    }

    /// Add a content tagged `tag` at `loc` (absent there), with no keys yet; returns its id.
    pub fn add(&mut self, tag: ContentTag, loc: &Location) -> u32 {
        if self.table.full_for(self.len + 1) {
            self.rebuild_table(self.len + 1 + self.len / 4);
        }
        let fits = loc.offset % PAGE as u64 == 0 && loc.seq >> 40 == 0 && loc.dir <= u8::MAX as u16;
        let packed = fits.then(|| {
            let stored_len = u32::try_from(loc.stored_len).ok()?;
            let raw_id = if loc.raw_len == loc.stored_len {
                RAW_IS_STORED
            } else {
                self.raw_lens.id_of(u32::try_from(loc.raw_len).ok()?, MAX_RAW_LENS)? as u8
            };
            Some((u32::try_from(loc.offset / PAGE as u64).ok()?, stored_len, raw_id))
        });
        let (page, stored_len, raw_id, wide) = match packed.flatten() {
            Some((p, s, r)) => (p, s, r, 0),
            None => (0, 0, RAW_IS_STORED, WIDE),
        };
        let record = ContentRecord {
            tag,
            page,
            stored_len,
            seq_lo: loc.seq as u32,
            seq_hi: (loc.seq >> 32) as u8,
            raw_id,
            dir: loc.dir as u8,
            flags: if loc.compressed { COMPRESSED } else { 0 } | wide,
        };
        let id = super::arena::place(&mut self.records, &mut self.free, record, |r| r.page);
        if wide != 0 {
            self.wide.insert(id, loc.clone());
        }
        self.table.insert_new(hash_content(&tag), id);
        self.len += 1;
        id
    }

    fn set_refs(&mut self, id: u32, refs: u32) {
        let flags = &mut self.records[id as usize].flags;
        *flags &= !(ONE_REF | SHARED);
        match refs {
            0 => {}
            1 => *flags |= ONE_REF,
            _ => *flags |= SHARED,
        }
        if refs > 1 {
            self.shared.insert(id, refs);
        } else if !self.shared.is_empty() {
            self.shared.remove(&id);
        }
    }

    pub fn add_ref(&mut self, id: u32) {
        self.set_refs(id, self.refs(id) + 1);
    }

    pub fn drop_ref(&mut self, id: u32) {
        self.set_refs(id, self.refs(id).saturating_sub(1));
    }

    pub fn pin(&mut self, id: u32) {
        *self.readers.entry(id).or_insert(0) += 1;
    }

    pub fn unpin(&mut self, id: u32) {
        if let Some(n) = self.readers.get_mut(&id) {
            *n -= 1;
            if *n == 0 {
                self.readers.remove(&id);
            }
        }
    }

    pub fn poison(&mut self, id: u32) {
        self.records[id as usize].flags |= POISONED;
    }

    /// Forget content `id` (live); returns where it was.
    pub fn remove(&mut self, id: u32) -> Location {
        let loc = self.loc(id);
        let tag = self.records[id as usize].tag;
        let records = &self.records;
        self.table.remove(hash_content(&tag), id, |i| hash_content(&records[i as usize].tag));
        self.wide.remove(&id);
        self.readers.remove(&id);
        self.shared.remove(&id);
        let r = &mut self.records[id as usize];
        r.flags = FREE_MARK;
        r.page = self.free.unwrap_or(NIL);
        self.free = Some(id);
        self.len -= 1;
        loc
    }
}

/// `flags` of a record on the free list.
const FREE_MARK: u8 = 0x80;

const _: () = assert!(std::mem::size_of::<ContentRecord>() == 24);
