//! The contents of the index, packed: one 20-byte record (align 1) per key slot, in a flat
//! arena parallel to the key arena. A key's content lives in the record of the key's own id
//! (no content id per key: the usual block is stored under one key). A second key mapped
//! onto it (dedup) holds a redirect to that id in its record instead; a content whose own key
//! went while other keys or readers still hold it stays in its record until they let go (the
//! key slot is reused only then: `Index` frees a slot when both halves are free).
//!
//! A content record holds the content tag, where it lies in 4 KiB pages, its stored length
//! (u24), the write's seq (u40), a shape id and flags, and is found by tag through an
//! `IdTable`. The tag is the first 6 bytes of the content hash (the full hash is in the
//! extent's header page; tags are masked on the way in, so a v3 journal's 8-byte ones match):
//! two contents may share one, so a content is named by its id, and found by tag *and*
//! location. The shape id names (directory, raw length) in a small table
//! (a store holds blocks of a few sizes in a few directories; an uncompressed block's raw
//! length is its stored length). Readers pin contents only while a read is in flight, so their
//! counts live in a small side map; so does a location that does not fit the packed fields (an
//! extent past 16 TiB of one file, a block of 16 MiB or more, an offset off the page grid, a
//! seq past 2^40, a 256th distinct shape).

use std::collections::HashMap;

use super::arena::Interned;
use super::probe::IdTable;
use crate::format::journal::{ContentTag, Location, TAG_MASK};
use crate::format::PAGE;

const COMPRESSED: u8 = 1;
const POISONED: u8 = 2;
/// The location is in `wide`, not in the packed fields.
const WIDE: u8 = 4;
/// One key maps to this content (the usual case: no count stored).
const ONE_REF: u8 = 8;
/// Several keys map to it: their count is in `shared`.
const SHARED: u8 = 16;
/// No content of its own: `page` is the id of the content this slot's key maps to.
const REDIRECT: u8 = 32;
/// No content and no redirect (a free slot, or a key slot past the contents written so far).
const FREE_MARK: u8 = 0x80;

/// Stored lengths held packed (below 16 MiB: larger blocks go wide).
const STORED_MAX: u64 = (1 << 24) - 1;
/// Distinct (directory, raw length) shapes named by a u8 (the rest go wide).
const MAX_SHAPES: usize = u8::MAX as usize + 1;

#[derive(Clone, Copy)]
#[repr(C, packed)]
struct ContentRecord {
    /// The content tag's 6 bytes (little-endian).
    tag: [u8; 6],
    /// First page of the extent; for a redirect, the content's id.
    page: u32,
    stored_len: [u8; 3],
    /// The write's seq: low 32 and high 8 bits (2^40 puts: 35 years at a thousand a second;
    /// a later seq goes wide).
    seq_lo: u32,
    seq_hi: u8,
    /// Index in `shapes`: the directory and the raw length (None: the stored length).
    shape: u8,
    flags: u8,
}

const FREE_RECORD: ContentRecord = ContentRecord {
    tag: [0; 6],
    page: 0,
    stored_len: [0; 3],
    seq_lo: 0,
    seq_hi: 0,
    shape: 0,
    flags: FREE_MARK,
};

/// A directory and a raw length (None: the raw length is the stored length).
type Shape = (u16, Option<u32>);

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
/// pass small numbers; unmixed, they would all land in one probe run). Masked tags only.
fn hash_content(tag: &ContentTag) -> u32 {
    (tag.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) as u32
}

fn tag_of(r: &ContentRecord) -> ContentTag {
    let [a, b, c, d, e, f] = r.tag;
    u64::from_le_bytes([a, b, c, d, e, f, 0, 0])
}

fn tag_bytes(tag: ContentTag) -> [u8; 6] {
    let [a, b, c, d, e, f, _, _] = tag.to_le_bytes();
    [a, b, c, d, e, f]
}

#[derive(Default)]
pub(crate) struct ContentArena {
    /// One per key slot (indexed by key id); grown lazily as key slots are written.
    records: Vec<ContentRecord>,
    /// Contents held (records that are neither free nor redirects).
    len: usize,
    table: IdTable,
    readers: HashMap<u32, u32>,
    shared: HashMap<u32, u32>,
    wide: HashMap<u32, Location>,
    /// (directory, raw length) pairs named by `shape` (never shrinks: a few entries).
    shapes: Interned<Shape>,
    /// The shape used last: nearly every block of a store has it (no map lookup per add).
    last_shape: u8,
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
            + self.shapes.heap_bytes()
    }

    /// Room for `slots` key slots in all and `additional` more contents.
    pub fn reserve(&mut self, slots: usize, additional: usize) {
        self.records.reserve_exact(slots.saturating_sub(self.records.len()));
        let len = (self.len + additional).max(slots);
        if self.table.full_for(self.len + additional) || !self.table.holds(len.saturating_sub(1) as u32) {
            self.rebuild_table(len);
        }
    }

    fn rebuild_table(&mut self, len: usize) {
        let ids: Vec<(u32, u32)> = (0..self.records.len() as u32)
            .filter(|&i| self.is_live(i))
            .map(|i| (self.hash_of(i), i))
            .collect();
        self.table.rebuild(len, ids.into_iter());
    }

    fn hash_of(&self, id: u32) -> u32 {
        hash_content(&self.tag(id))
    }

    pub fn prefetch(&self, tag: &ContentTag) {
        self.table.prefetch(hash_content(&(tag & TAG_MASK)));
    }

    /// A content tagged `tag` (the first found: a dedup candidate to confirm).
    pub fn find(&self, tag: &ContentTag) -> Option<u32> {
        let tag = tag & TAG_MASK;
        self.table.find(hash_content(&tag), |id| self.tag(id) == tag)
    }

    /// The content tagged `tag` that lies at `loc` (seq included): that write's content.
    pub fn find_at(&self, tag: &ContentTag, loc: &Location) -> Option<u32> {
        let tag = tag & TAG_MASK;
        self.table.find(hash_content(&tag), |id| self.tag(id) == tag && self.loc(id) == *loc)
    }

    fn flags(&self, id: u32) -> u8 {
        self.records.get(id as usize).map_or(FREE_MARK, |r| r.flags)
    }

    /// Whether `id` names a live content (not a free slot, not a redirect).
    pub fn is_live(&self, id: u32) -> bool {
        self.flags(id) & (FREE_MARK | REDIRECT) == 0
    }

    /// The content key slot `id` maps to: its own, or the one its redirect names.
    pub fn resolve(&self, id: u32) -> u32 {
        let r = &self.records[id as usize];
        if r.flags & REDIRECT != 0 {
            r.page
        } else {
            id
        }
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
        tag_of(&self.records[id as usize])
    }

    pub fn loc(&self, id: u32) -> Location {
        let r = self.records[id as usize];
        if r.flags & WIDE != 0 {
            if let Some(loc) = self.wide.get(&id) {
                return loc.clone();
            }
        }
        let [a, b, c] = r.stored_len;
        let stored_len = u32::from_le_bytes([a, b, c, 0]);
        let (dir, raw) = self.shapes.values().get(r.shape as usize).copied().unwrap_or((0, None));
        Location {
            dir,
            offset: r.page as u64 * PAGE as u64,
            stored_len: stored_len as u64,
            raw_len: raw.unwrap_or(stored_len) as u64,
            compressed: r.flags & COMPRESSED != 0,
            seq: r.seq_lo as u64 | (r.seq_hi as u64) << 32,
        }
    }

    pub fn entry(&self, id: u32) -> ContentEntry {
        ContentEntry {
            tag: self.tag(id),
            loc: self.loc(id),
            refs: self.refs(id),
            readers: self.readers(id),
            poisoned: self.flags(id) & POISONED != 0,
        }
    }

    pub fn refs(&self, id: u32) -> u32 {
        let flags = self.flags(id);
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

    /// The record of slot `id` (free), growing the arena in 1.25x steps as the key arena does.
    fn slot(&mut self, id: u32) -> &mut ContentRecord {
        let id = id as usize;
        if id >= self.records.len() {
            let more = id + 1 - self.records.len();
            if self.records.len() + more > self.records.capacity() {
                self.records.reserve_exact(more.max(self.records.len() / 4 + 16));
            }
            self.records.resize(id + 1, FREE_RECORD);
        }
        debug_assert!(self.records[id].flags & FREE_MARK != 0, "slot {id} is taken");
        &mut self.records[id]
    }

    /// The packed fields of `loc`, None when it must go wide.
    fn packed(&mut self, loc: &Location) -> Option<(u32, [u8; 3], u8)> {
        if loc.offset % PAGE as u64 != 0 || loc.seq >> 40 != 0 || loc.stored_len > STORED_MAX {
            return None;
        }
        let raw = match loc.raw_len == loc.stored_len {
            true => None,
            false => Some(u32::try_from(loc.raw_len).ok()?),
        };
        let shape = if self.shapes.values().get(self.last_shape as usize) == Some(&(loc.dir, raw)) {
            self.last_shape
        } else {
            self.last_shape = self.shapes.id_of((loc.dir, raw), MAX_SHAPES)? as u8;
            self.last_shape
        };
        let [a, b, c, _] = (loc.stored_len as u32).to_le_bytes();
        Some((u32::try_from(loc.offset / PAGE as u64).ok()?, [a, b, c], shape))
    }

    /// Add a content tagged `tag` at `loc` (absent there) in slot `id` (free), with no keys yet.
    pub fn add_at(&mut self, id: u32, tag: ContentTag, loc: &Location) {
        if self.table.full_for(self.len + 1) || !self.table.holds(id) {
            self.rebuild_table((self.len + 1 + self.len / 4).max(id as usize + 1));
        }
        let (page, stored_len, shape, wide) = match self.packed(loc) {
            Some((p, s, sh)) => (p, s, sh, 0),
            None => (0, [0; 3], 0, WIDE),
        };
        let tag = tag & TAG_MASK;
        *self.slot(id) = ContentRecord {
            tag: tag_bytes(tag),
            page,
            stored_len,
            seq_lo: loc.seq as u32,
            seq_hi: (loc.seq >> 32) as u8,
            shape,
            flags: if loc.compressed { COMPRESSED } else { 0 } | wide,
        };
        if wide != 0 {
            self.wide.insert(id, loc.clone());
        }
        self.table.insert_new(hash_content(&tag), id);
        self.len += 1;
    }

    /// Point slot `id` (free) at content `target` (live): its key maps there.
    pub fn redirect(&mut self, id: u32, target: u32) {
        *self.slot(id) = ContentRecord { page: target, flags: REDIRECT, ..FREE_RECORD };
    }

    /// Free slot `id`'s redirect (its key is gone).
    pub fn clear(&mut self, id: u32) {
        debug_assert!(self.flags(id) & REDIRECT != 0);
        self.records[id as usize] = FREE_RECORD;
    }

    fn set_refs(&mut self, id: u32, refs: u32) {
        let r = &mut self.records[id as usize];
        r.flags = r.flags & !(ONE_REF | SHARED)
            | match refs {
                0 => 0,
                1 => ONE_REF,
                _ => SHARED,
            };
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
        let hash = self.hash_of(id);
        let records = &self.records;
        self.table.remove(hash, id, |i| hash_content(&tag_of(&records[i as usize])));
        self.wide.remove(&id);
        self.readers.remove(&id);
        self.shared.remove(&id);
        self.records[id as usize] = FREE_RECORD;
        self.len -= 1;
        loc
    }
}

const _: () = assert!(std::mem::size_of::<ContentRecord>() == 20);
