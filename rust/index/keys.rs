//! The keys of the index, packed: one fixed 39-byte record (align 1) per key in a flat arena,
//! found through an `IdTable` of u32 ids. A key's id is also its content's slot in the
//! parallel content arena (contents.rs), so a record names no content; a removed key's slot
//! is reused only once `release`d (its content may outlive it: `Index` decides). No eviction
//! order is kept: the store's owner decides evictions, and when the store must evict on its
//! own (a full device) it sweeps the arena like a clock.
//!
//! A connector key is a 28-byte head shared by every block of one model and rank (rank tag,
//! namespace prefix, variant) and the engine's block hash (32 bytes for sha256). Heads are
//! interned once with the tail's length in a small table and a record holds a u16 id of that
//! (head, length) pair and the hash inline, so the
//! full key is rebuilt from head + tail whenever it is needed (`keys()`, evicted keys, journal
//! records). Keys of any other shape (shorter, longer, or past the head table's limit) keep
//! their bytes in a side map: slower and bigger, never refused.

use std::collections::HashMap;

use super::arena::{Interned, NIL};
use super::block_set::{digest, Digest};
use super::probe::IdTable;

/// Bytes of the interned head: rank tag (4) + namespace prefix (16) + variant (8).
pub const HEAD_LEN: usize = 28;
/// Longest tail held inline (a sha256 block hash).
pub const TAIL_MAX: usize = 32;
/// `head` of a record whose key lives in the side map.
const SPILLED: u16 = u16::MAX;
/// `head` of a record with no key (free, or its content outlives it).
const FREE: u16 = u16::MAX - 1;
/// (head, tail length) pairs beyond this many go to the side map (keys not shaped like the
/// connector's).
const MAX_HEADS: usize = FREE as usize;

#[derive(Clone, Copy)]
#[repr(C, packed)]
struct KeyRecord {
    tail: [u8; TAIL_MAX],
    /// The previous block of this key's prefix chain: its record id (low 28 bits; all ones:
    /// none) and 4 bits of its key's table hash (the top bits), with 8 more in `parent_tag`,
    /// so a parent removed and its record reused by another key matches only 1 time in 4096.
    /// The journal names the parent by key: a reopen resolves it exactly. On the free list:
    /// the next free record.
    parent: u32,
    parent_tag: u8,
    /// The interned (head, tail length) pair; `SPILLED` or `FREE`.
    head: u16,
}

/// Record ids a parent link can name (the arena's ids stay far below: 2^28 keys is ~27 GB).
const PARENT_ID_MASK: u32 = (1 << 28) - 1;

/// The 12 bits of a key's table hash a parent link checks, split as stored.
fn parent_tag_of(hash: u32) -> (u32, u8) {
    ((hash >> 8 & 0xF) << 28, hash as u8)
}

const EMPTY: KeyRecord = KeyRecord { tail: [0; TAIL_MAX], parent: NIL, parent_tag: 0, head: FREE };

/// A key's interned head with the length of its tail.
type Head = ([u8; HEAD_LEN], u8);

/// Bytes of the rank tag in front of a stored key (`Namespace.storage_key`).
pub const TAG_LEN: usize = 4;

/// A stored key's fingerprint as the scheduler names the block (`BlockSet.digest`): the first 8
/// bytes of xxh3-128 of the key past its rank tag, so every rank's copy has the same one. The
/// table is hashed by it, so the worker resolves a scheduler's fingerprint (by_fingerprint.rs).
pub fn fingerprint(key: &[u8]) -> Digest {
    digest(&key[TAG_LEN.min(key.len())..], &[])
}

fn fingerprint_hash(fp: &Digest) -> u32 {
    u32::from_le_bytes([fp[0], fp[1], fp[2], fp[3]])
}

fn hash_key(key: &[u8]) -> u32 {
    fingerprint_hash(&fingerprint(key))
}

fn hash_parts(records: &[KeyRecord], heads: &[Head], spilled: &HashMap<u32, Box<[u8]>>, id: u32) -> u32 {
    let r = &records[id as usize];
    if r.head == SPILLED {
        return spilled.get(&id).map_or(0, |k| hash_key(k));
    }
    let (head, t) = heads[r.head as usize];
    let mut buf = [0u8; HEAD_LEN + TAIL_MAX];
    let n = HEAD_LEN + t as usize;
    buf[..HEAD_LEN].copy_from_slice(&head);
    buf[HEAD_LEN..n].copy_from_slice(&r.tail[..t as usize]);
    hash_key(&buf[..n])
}

#[derive(Default)]
pub(crate) struct KeyArena {
    records: Vec<KeyRecord>,
    /// Where the next clock sweep starts.
    sweep: u32,
    free: Option<u32>,
    len: usize,
    table: IdTable,
    heads: Interned<Head>,
    /// The head used last: nearly every key of a batch (or a replay) shares it.
    last_head: u16,
    spilled: HashMap<u32, Box<[u8]>>,
}

impl KeyArena {
    pub fn len(&self) -> usize {
        self.len
    }

    /// Slots the arena holds without growing (the content arena matches it).
    pub fn capacity(&self) -> usize {
        self.records.capacity()
    }

    /// Bytes held (capacities; allocator bookkeeping estimated for the side maps).
    pub fn nbytes(&self) -> usize {
        use std::mem::size_of;
        let map_entry = |k: usize, v: usize| k + v + 1;
        let spilled: usize = self.spilled.values().map(|k| k.len().div_ceil(16) * 16 + 16).sum();
        self.records.capacity() * size_of::<KeyRecord>()
            + self.table.heap_bytes()
            + self.heads.heap_bytes()
            + self.spilled.capacity() * map_entry(4, size_of::<Box<[u8]>>())
            + spilled
    }

    /// Room for `additional` more keys without growing the arena or the table.
    pub fn reserve(&mut self, additional: usize) {
        super::arena::reserve(&mut self.records, self.len, additional);
        if self.table.full_for(self.len + additional) {
            self.rebuild_table(self.len + additional);
        }
    }

    fn rebuild_table(&mut self, len: usize) {
        let mut table = IdTable::default();
        let live: Vec<u32> = self.order().collect();
        table.rebuild(len, live.iter().map(|&id| (self.hash_of(id), id)));
        self.table = table;
    }

    fn matches(&self, id: u32, key: &[u8]) -> bool {
        let r = &self.records[id as usize];
        if r.head == SPILLED {
            return self.spilled.get(&id).is_some_and(|k| **k == *key);
        }
        let (head, t) = &self.heads.values()[r.head as usize];
        let t = *t as usize;
        key.len() == HEAD_LEN + t && r.tail[..t] == key[HEAD_LEN..] && head[..] == key[..HEAD_LEN]
    }

    /// Write the key of `id` into `out` (cleared first).
    pub fn key_into(&self, id: u32, out: &mut Vec<u8>) {
        out.clear();
        let r = &self.records[id as usize];
        if r.head == SPILLED {
            out.extend_from_slice(self.spilled.get(&id).map_or(&[][..], |k| k));
        } else {
            let (head, t) = &self.heads.values()[r.head as usize];
            out.extend_from_slice(head);
            out.extend_from_slice(&r.tail[..*t as usize]);
        }
    }

    pub fn key(&self, id: u32) -> Vec<u8> {
        let mut out = Vec::with_capacity(HEAD_LEN + TAIL_MAX);
        self.key_into(id, &mut out);
        out
    }

    fn hash_of(&self, id: u32) -> u32 {
        hash_parts(&self.records, self.heads.values(), &self.spilled, id)
    }

    pub fn prefetch(&self, key: &[u8]) {
        self.table.prefetch(hash_key(key));
    }

    pub fn find(&self, key: &[u8]) -> Option<u32> {
        self.table.find(hash_key(key), |id| self.matches(id, key))
    }

    /// Ids of the keys whose `fingerprint` is `fp`: usually one, more only on a clash.
    pub fn find_by_fingerprint(&self, fp: &Digest) -> Vec<u32> {
        let hash = fingerprint_hash(fp);
        let mut found = Vec::new();
        // A probe rebuilds a key only on a tag match of the table's slot (rare past the one).
        while let Some(id) =
            self.table.find(hash, |id| !found.contains(&id) && fingerprint(&self.key(id)) == *fp)
        {
            found.push(id);
        }
        found
    }

    /// Link `id` to its chain parent `parent` (a live id) or to none.
    pub fn set_parent(&mut self, id: u32, parent: Option<u32>) {
        let link = parent.filter(|&p| p < PARENT_ID_MASK).map(|p| (p, parent_tag_of(self.hash_of(p))));
        let r = &mut self.records[id as usize];
        (r.parent, r.parent_tag) = match link {
            Some((p, (hi, lo))) => (p | hi, lo),
            None => (NIL, 0),
        };
    }

    /// The chain parent of `id`, if it is still stored.
    pub fn parent(&self, id: u32) -> Option<u32> {
        let r = &self.records[id as usize];
        let p = r.parent & PARENT_ID_MASK;
        if p == PARENT_ID_MASK || !self.records.get(p as usize).is_some_and(|pr| pr.head != FREE) {
            return None;
        }
        let (hi, lo) = parent_tag_of(self.hash_of(p));
        (r.parent & !PARENT_ID_MASK == hi && r.parent_tag == lo).then_some(p)
    }

    fn head_id(&mut self, head: &[u8], tail_len: usize) -> Option<u16> {
        let head: Head = (head.try_into().ok()?, tail_len as u8);
        if self.heads.values().get(self.last_head as usize) == Some(&head) {
            return Some(self.last_head);
        }
        let id = self.heads.id_of(head, MAX_HEADS)? as u16;
        self.last_head = id;
        Some(id)
    }

    /// Add `key` (absent); returns its id (a slot whose content half
    /// is free).
    pub fn insert(&mut self, key: &[u8]) -> u32 {
        // Ids must fit the table: a slot held by a content that outlived its key is not free.
        let next = self.free.unwrap_or(self.records.len() as u32);
        if self.table.full_for(self.len + 1) || !self.table.holds(next) {
            self.rebuild_table((self.len + 1 + self.len / 4).max(next as usize + 1));
        }
        let mut r = EMPTY;
        let t = key.len().wrapping_sub(HEAD_LEN);
        let packed = (t <= TAIL_MAX).then(|| self.head_id(&key[..HEAD_LEN], t)).flatten();
        match packed {
            Some(head) => {
                r.head = head;
                r.tail[..t].copy_from_slice(&key[HEAD_LEN..]);
            }
            None => r.head = SPILLED,
        }
        let id = super::arena::place(&mut self.records, &mut self.free, r, |r| r.parent);
        if r.head == SPILLED {
            self.spilled.insert(id, key.into());
        }
        self.table.insert_new(hash_key(key), id);
        self.len += 1;
        id
    }

    /// Forget key `id` (live). Its slot is reused only once `release`d.
    pub fn remove(&mut self, id: u32) {
        let hash = self.hash_of(id);
        let KeyArena { records, heads, spilled, table, .. } = self;
        table.remove(hash, id, |i| hash_parts(records, heads.values(), spilled, i));
        if self.records[id as usize].head == SPILLED {
            self.spilled.remove(&id);
        }
        self.records[id as usize] = EMPTY;
        self.len -= 1;
    }

    /// Put slot `id` (removed, its content gone too) on the free list.
    pub fn release(&mut self, id: u32) {
        debug_assert!(self.records[id as usize].head == FREE);
        self.records[id as usize].parent = self.free.unwrap_or(NIL);
        self.free = Some(id);
    }

    /// The key to evict: the next live one of a clock sweep over the arena (a last resort:
    /// the owner decides evictions).
    pub fn victim(&mut self) -> Option<u32> {
        let n = self.records.len() as u32;
        let start = self.sweep.min(n);
        let id = (start..n).chain(0..start).find(|&i| self.records[i as usize].head != FREE)?;
        self.sweep = id + 1;
        Some(id)
    }

    /// Live ids in arena order.
    pub fn order(&self) -> impl Iterator<Item = u32> + '_ {
        (0..self.records.len() as u32).filter(|&i| self.records[i as usize].head != FREE)
    }
}

const _: () = assert!(std::mem::size_of::<KeyRecord>() == 39);
