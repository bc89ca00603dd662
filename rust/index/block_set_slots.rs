//! The hash index of a `BlockSet`: digest -> arena position, by open addressing with linear
//! probing over u64 slots (`tag << 32 | position + 1`, 0 = empty; tag = the digest's first 4
//! bytes). One slot is 8 bytes at 64-80 % load (~11 bytes per key), a probe compares tags
//! within one cache line and touches the arena only on a tag match, and the memory is ours to
//! back with huge pages: at millions of keys a lookup is one TLB-covered cache miss instead of
//! three page walks. The home slot is the tag scaled to the table (`tag * n >> 32`), so a
//! slot's home is known from the slot alone and deletion shifts entries back (no tombstones).

use std::collections::TryReserveError;

use super::Digest;

/// Grow past 80 % load; a new table is sized for 64 % (1.25x steps, like the arena).
const MAX_LOAD_NUM: usize = 4;
const MAX_LOAD_DEN: usize = 5;
const MIN_SLOTS: usize = 16;

fn tag_of(d: &Digest) -> u32 {
    u32::from_le_bytes([d[0], d[1], d[2], d[3]])
}

fn home(tag: u32, n: usize) -> usize {
    ((tag as u64 * n as u64) >> 32) as usize
}

fn pack(tag: u32, pos: u32) -> u64 {
    (tag as u64) << 32 | (pos as u64 + 1)
}

fn position(slot: u64) -> u32 {
    (slot as u32).wrapping_sub(1)
}

/// Slots that hold `len` keys at 64 % load.
fn slots_for(len: usize) -> usize {
    (len + len / 2 + len / 16 + 1).max(MIN_SLOTS)
}

pub(super) struct Slots {
    slots: Vec<u64>,
}

impl Slots {
    pub fn new() -> Self {
        Slots { slots: Vec::new() }
    }

    pub fn heap_bytes(&self) -> usize {
        self.slots.capacity() * std::mem::size_of::<u64>()
    }

    fn next(&self, pos: usize) -> usize {
        if pos + 1 == self.slots.len() {
            0
        } else {
            pos + 1
        }
    }

    /// The arena position of `d`. `digest_at` reads the digest at an arena position.
    pub fn find(&self, d: &Digest, digest_at: impl Fn(u32) -> Digest) -> Option<u32> {
        if self.slots.is_empty() {
            return None;
        }
        let tag = tag_of(d);
        let mut at = home(tag, self.slots.len());
        loop {
            let slot = self.slots[at];
            if slot == 0 {
                return None;
            }
            if (slot >> 32) as u32 == tag && digest_at(position(slot)) == *d {
                return Some(position(slot));
            }
            at = self.next(at);
        }
    }

    /// The slot index holding arena position `pos` (whose digest is `d`).
    fn slot_of(&self, d: &Digest, pos: u32) -> Option<usize> {
        if self.slots.is_empty() {
            return None;
        }
        let mut at = home(tag_of(d), self.slots.len());
        loop {
            match self.slots[at] {
                0 => return None,
                slot if position(slot) == pos => return Some(at),
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
        let tag = tag_of(d);
        let mut at = home(tag, self.slots.len());
        while self.slots[at] != 0 {
            at = self.next(at);
        }
        self.slots[at] = pack(tag, pos);
    }

    /// Forget the slot of arena position `pos` (digest `d`), shifting later entries back so
    /// every probe chain stays unbroken.
    pub fn remove(&mut self, d: &Digest, pos: u32) {
        let Some(mut hole) = self.slot_of(d, pos) else { return };
        let n = self.slots.len();
        let mut at = hole;
        loop {
            at = self.next(at);
            let slot = self.slots[at];
            if slot == 0 {
                break;
            }
            // An entry may fill the hole unless its home lies cyclically in (hole, at].
            let h = home((slot >> 32) as u32, n);
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
            self.slots[at] = pack(tag_of(d), to);
        }
    }

    /// A fresh table sized for `len` keys at 64 % load, holding `digests` (arena order).
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
