//! The hash index of a `BlockSet`: digest -> arena position, by open addressing with linear
//! probing over u32 slots (`tag << id_bits | position + 1`, 0 = empty). Positions are below
//! the slot count, so the bits above them carry a tag and a probe touches the arena only on a
//! tag match (1 in 2^10 non-matching slots at 2 M keys). Home and tag both come from the
//! digest's first 4 bytes (the home from their high bits, the tag from their low ones, as in
//! `IdTable`), so a chain parent's 5-byte name (block_set_chains.rs) probes the same slots as
//! its full digest. One slot is 4 bytes; a table is sized for 80 % load and grown past 87.5 %,
//! as the store's `IdTable` (probe.rs): ~5 bytes per key (64-80 % spent ~6.3), the tags keeping
//! long probe runs inside the table's own cache lines. The memory
//! is ours to back with huge pages: at millions of keys a lookup is one TLB-covered cache miss
//! instead of three page walks. The home slot is the digest's first 4 bytes scaled to the
//! table (`h * n >> 32`); deletion shifts entries back (no tombstones), reading a shifted
//! entry's home from its digest in the arena.

use std::collections::TryReserveError;

use super::Digest;

/// Grow past 87.5 % load; a table is sized for 80 % of what the caller asks room for (the
/// set asks 1.25x its length when it grows, like the arena).
const MAX_LOAD_NUM: usize = 7;
const MAX_LOAD_DEN: usize = 8;
const MIN_SLOTS: usize = 16;

fn home_hash(d: &Digest) -> u32 {
    u32::from_le_bytes([d[0], d[1], d[2], d[3]])
}

/// The low 32 - id_bits bits of the home hash: `home` reads its high ones (`h * n >> 32`,
/// n < 2^id_bits), so the two are independent, and a parent's name holds both.
fn tag_hash(d: &Digest) -> u32 {
    home_hash(d)
}

fn home(d: &Digest, n: usize) -> usize {
    ((home_hash(d) as u64 * n as u64) >> 32) as usize
}

/// Slots that hold `len` keys at 80 % load.
fn slots_for(len: usize) -> usize {
    (len + len / 4 + 1).max(MIN_SLOTS)
}

pub(super) struct Slots {
    slots: Vec<u32>,
    /// Low bits of a slot that hold `position + 1`; the rest hold the tag.
    id_bits: u32,
}

impl Slots {
    pub fn new() -> Self {
        Slots { slots: Vec::new(), id_bits: 0 }
    }

    pub fn heap_bytes(&self) -> usize {
        self.slots.capacity() * std::mem::size_of::<u32>()
    }

    fn next(&self, pos: usize) -> usize {
        if pos + 1 == self.slots.len() {
            0
        } else {
            pos + 1
        }
    }

    fn id_mask(&self) -> u32 {
        if self.id_bits >= 32 {
            u32::MAX
        } else {
            (1 << self.id_bits) - 1
        }
    }

    fn tag(&self, d: &Digest) -> u32 {
        tag_hash(d).checked_shl(self.id_bits).unwrap_or(0)
    }

    fn pack(&self, d: &Digest, pos: u32) -> u32 {
        self.tag(d) | (pos + 1)
    }

    /// The arena position of `d`. `digest_at` reads the digest at an arena position.
    pub fn find(&self, d: &Digest, digest_at: impl Fn(u32) -> Digest) -> Option<u32> {
        self.find_where(d, |pos| digest_at(pos) == *d)
    }

    /// The arena position, among those filed under `d`'s first 4 bytes (home and tag come
    /// from nothing else), for which `is_it` holds.
    pub fn find_where(&self, d: &Digest, is_it: impl Fn(u32) -> bool) -> Option<u32> {
        if self.slots.is_empty() {
            return None;
        }
        let mask = self.id_mask();
        let tag = self.tag(d);
        let mut at = home(d, self.slots.len());
        loop {
            let slot = self.slots[at];
            if slot == 0 {
                return None;
            }
            if slot & !mask == tag && is_it((slot & mask) - 1) {
                return Some((slot & mask) - 1);
            }
            at = self.next(at);
        }
    }

    /// The slot index holding arena position `pos` (whose digest is `d`).
    fn slot_of(&self, d: &Digest, pos: u32) -> Option<usize> {
        if self.slots.is_empty() {
            return None;
        }
        let mask = self.id_mask();
        let mut at = home(d, self.slots.len());
        loop {
            match self.slots[at] {
                0 => return None,
                slot if slot & mask == pos + 1 => return Some(at),
                _ => at = self.next(at),
            }
        }
    }

    /// True when one more key would pass the load limit (`rebuild` first).
    pub fn full_for(&self, len_after: usize) -> bool {
        len_after * MAX_LOAD_DEN > self.slots.len() * MAX_LOAD_NUM
    }

    /// Record `d` at arena position `pos`: the caller checked it is absent and there is room.
    pub fn insert_new(&mut self, d: &Digest, pos: u32) {
        debug_assert!((pos as usize) < self.slots.len());
        let mut at = home(d, self.slots.len());
        while self.slots[at] != 0 {
            at = self.next(at);
        }
        self.slots[at] = self.pack(d, pos);
    }

    /// Forget the slot of arena position `pos` (digest `d`), shifting later entries back so
    /// every probe chain stays unbroken (`digest_at`: a shifted entry's digest, for its home).
    pub fn remove(&mut self, d: &Digest, pos: u32, digest_at: impl Fn(u32) -> Digest) {
        let Some(mut hole) = self.slot_of(d, pos) else { return };
        let (n, mask) = (self.slots.len(), self.id_mask());
        let mut at = hole;
        loop {
            at = self.next(at);
            let slot = self.slots[at];
            if slot == 0 {
                break;
            }
            // An entry may fill the hole unless its home lies cyclically in (hole, at].
            let h = home(&digest_at((slot & mask) - 1), n);
            let stays = if hole <= at { hole < h && h <= at } else { hole < h || h <= at };
            if !stays {
                self.slots[hole] = slot;
                hole = at;
            }
        }
        self.slots[hole] = 0;
    }

    /// The arena moved `d` from position `from` to `to`.
    pub fn repoint(&mut self, d: &Digest, from: u32, to: u32) {
        if let Some(at) = self.slot_of(d, from) {
            self.slots[at] = self.pack(d, to);
        }
    }

    /// A fresh table sized for `len` keys at 80 % load, holding `digests` (arena order).
    pub fn rebuild<'a>(
        &mut self,
        len: usize,
        digests: impl Iterator<Item = &'a Digest>,
    ) -> Result<(), TryReserveError> {
        let n = slots_for(len);
        let mut slots = Vec::new();
        slots.try_reserve_exact(n)?;
        super::advise_huge_pages(&slots);
        slots.resize(n, 0);
        self.slots = slots;
        // Positions stay below the slot count (the arena never outgrows its table), so these
        // bits always hold one; a u32 position needs at most 32.
        self.id_bits = (usize::BITS - n.leading_zeros()).min(32);
        for (pos, d) in digests.enumerate() {
            self.insert_new(d, pos as u32);
        }
        Ok(())
    }

    /// True when the table is so empty (under 20 % load) that a rebuild gives memory back.
    pub fn sparse_for(&self, len: usize) -> bool {
        self.slots.len() > MIN_SLOTS && len * 5 < self.slots.len()
    }
}
