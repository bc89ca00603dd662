//! A hash table of arena ids: open addressing with linear probing over plain `u32` slots. It
//! stores no keys: the owner answers "is id `i` the one I look for" and "what is id `i`'s
//! hash" from its arena, so a key costs 4 bytes here at 80-87.5 % load (~5 bytes per key)
//! instead of a node with pointers. A slot is `tag << id_bits | (id + 1)` (0 = empty): ids
//! are below the slot count, so the bits above them carry a tag of the hash, and a probe
//! touches the arena (a cache miss) only on a tag match. The home slot is the
//! hash scaled to the table (`hash * n >> 32`); deletion shifts later entries back, so there
//! are no tombstones and probe chains stay short.

/// Grow past 87.5 % load (tags keep long probe runs inside the table's own cache lines); a
/// table is sized for 80 % (a reopen's `reserve` sizes it for exactly the keys it replays:
/// 5 bytes a key; 70 % was 5.7). Growth steps are 1.25x of the length.
const MAX_LOAD_NUM: usize = 7;
const MAX_LOAD_DEN: usize = 8;
const MIN_SLOTS: usize = 16;

fn home(hash: u32, n: usize) -> usize {
    ((hash as u64 * n as u64) >> 32) as usize
}

/// Slots that hold `len` ids at about 80 % load.
fn slots_for(len: usize) -> usize {
    (len + len / 4 + 1).max(MIN_SLOTS)
}

#[derive(Default)]
pub(crate) struct IdTable {
    slots: Vec<u32>,
    /// Bits of a slot that hold `id + 1` (the rest hold the tag).
    id_bits: u32,
}

impl IdTable {
    pub fn heap_bytes(&self) -> usize {
        self.slots.capacity() * std::mem::size_of::<u32>()
    }

    /// Whether `id` fits a slot (ids must stay below the slot count; `rebuild` for more).
    pub fn holds(&self, id: u32) -> bool {
        (id as usize) < self.slots.len()
    }

    /// The slot after `at`, wrapping to 0 past the end (branch-free).
    fn next(&self, at: usize) -> usize {
        (at + 1) * usize::from(at + 1 < self.slots.len())
    }

    fn id_mask(&self) -> u32 {
        if self.id_bits >= 32 {
            u32::MAX
        } else {
            (1 << self.id_bits) - 1
        }
    }

    /// The slot for `id` with the tag of `hash`.
    fn pack(&self, hash: u32, id: u32) -> u32 {
        (hash.checked_shl(self.id_bits).unwrap_or(0) & !self.id_mask()) | (id + 1)
    }

    /// The id whose hash is `hash` and for which `is_it` holds.
    pub fn find(&self, hash: u32, is_it: impl Fn(u32) -> bool) -> Option<u32> {
        if self.slots.is_empty() {
            return None;
        }
        let mask = self.id_mask();
        let tag = self.pack(hash, 0) & !mask;
        let mut at = home(hash, self.slots.len());
        loop {
            match self.slots[at] {
                0 => return None,
                s if s & !mask == tag && is_it((s & mask) - 1) => return Some((s & mask) - 1),
                _ => at = self.next(at),
            }
        }
    }

    /// Start loading the home slot of `hash` into the cache (a hint: nothing changes), so
    /// that a `find` issued a few records later does not wait for memory.
    pub fn prefetch(&self, hash: u32) {
        if self.slots.is_empty() {
            return;
        }
        #[cfg(target_arch = "x86_64")]
        {
            let at = &self.slots[home(hash, self.slots.len())] as *const u32 as *const i8;
            // SAFETY: a prefetch of an address inside our own slice; it reads nothing.
            #[allow(unused_unsafe)]
            unsafe {
                std::arch::x86_64::_mm_prefetch(at, std::arch::x86_64::_MM_HINT_T0)
            };
        }
    }

    /// True when holding `len_after` ids would pass the load limit (`rebuild` first).
    pub fn full_for(&self, len_after: usize) -> bool {
        len_after * MAX_LOAD_DEN > self.slots.len() * MAX_LOAD_NUM
    }

    /// Record `id` (hash `hash`): the caller checked that it is absent and that there is room.
    pub fn insert_new(&mut self, hash: u32, id: u32) {
        let mut at = home(hash, self.slots.len());
        while self.slots[at] != 0 {
            at = self.next(at);
        }
        debug_assert!((id as usize) < self.slots.len());
        self.slots[at] = self.pack(hash, id);
    }

    /// Forget `id` (hash `hash`), shifting later entries back so every probe chain stays
    /// unbroken; `hash_of` gives the hash of an id still in the table.
    pub fn remove(&mut self, hash: u32, id: u32, hash_of: impl Fn(u32) -> u32) {
        if self.slots.is_empty() {
            return;
        }
        let n = self.slots.len();
        let mask = self.id_mask();
        let mut hole = home(hash, n);
        loop {
            match self.slots[hole] {
                0 => return,
                s if s & mask == id + 1 => break,
                _ => hole = self.next(hole),
            }
        }
        let mut at = self.next(hole);
        while self.slots[at] != 0 {
            let s = self.slots[at];
            // An entry may fill the hole unless its home lies cyclically in (hole, at].
            let h = home(hash_of((s & mask) - 1), n);
            let stays = if hole <= at { hole < h && h <= at } else { hole < h || h <= at };
            if !stays {
                self.slots[hole] = s;
                hole = at;
            }
            at = self.next(at);
        }
        self.slots[hole] = 0;
    }

    /// A fresh table for `len` ids at 80 % load (room to grow to 87.5 %), holding `ids`. Ids
    /// must stay below `len`'s slot count: arenas never outgrow the table they reserve.
    pub fn rebuild(&mut self, len: usize, ids: impl Iterator<Item = (u32, u32)>) {
        let n = slots_for(len);
        self.slots = vec![0; n];
        self.id_bits = usize::BITS - n.leading_zeros();
        for (hash, id) in ids {
            self.insert_new(hash, id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn insert_find_remove_keep_chains_whole() {
        // Every id hashes to one of three homes: long, overlapping chains.
        let hash_of = |id: u32| (id % 3).wrapping_mul(0x5555_5555);
        let mut t = IdTable::default();
        t.rebuild(100, std::iter::empty());
        for id in 0..100 {
            assert!(!t.full_for(id as usize + 1));
            t.insert_new(hash_of(id), id);
        }
        for id in (0..100).step_by(2) {
            t.remove(hash_of(id), id, hash_of);
        }
        for id in 0..100 {
            let found = t.find(hash_of(id), |x| x == id);
            assert_eq!(found, (id % 2 == 1).then_some(id), "id {id}");
        }
        assert!(t.full_for(130));
    }
}
