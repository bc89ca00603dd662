//! Placing a fixed-size record in a flat arena: freed records form a list threaded through
//! the records themselves (no side vector), and the arena grows in 1.25x steps (a doubling
//! would leave up to half of it unused: at millions of records, that is the index's size).

/// "No next free record".
pub const NIL: u32 = u32::MAX;

/// Put `record` in the first free slot of `records` (`free` heads the list, `next_free`
/// reads a free record's link), else at the end. Returns its id.
pub fn place<T>(
    records: &mut Vec<T>,
    free: &mut Option<u32>,
    record: T,
    next_free: impl Fn(&T) -> u32,
) -> u32 {
    if let Some(id) = *free {
        let next = next_free(&records[id as usize]);
        *free = (next != NIL).then_some(next);
        records[id as usize] = record;
        return id;
    }
    if records.len() == records.capacity() {
        records.reserve_exact(records.len() / 4 + 16);
    }
    records.push(record);
    (records.len() - 1) as u32
}

/// Room in `records` (of which `live` are in use) for `additional` more live ones: free
/// records are reused first, the rest is one exact allocation.
pub fn reserve<T>(records: &mut Vec<T>, live: usize, additional: usize) {
    records.reserve_exact((live + additional).saturating_sub(records.len()));
}

/// A few distinct values (key heads, raw lengths) kept once each and named by their position,
/// so a record holds a small id instead of the value.
#[derive(Default)]
pub struct Interned<T> {
    values: Vec<T>,
    ids: std::collections::HashMap<T, usize>,
}

impl<T: Copy + Eq + std::hash::Hash> Interned<T> {
    pub fn values(&self) -> &[T] {
        &self.values
    }

    /// The id of `v`, added if new; None once `max` values are held.
    pub fn id_of(&mut self, v: T, max: usize) -> Option<usize> {
        if let Some(&id) = self.ids.get(&v) {
            return Some(id);
        }
        if self.values.len() >= max {
            return None;
        }
        self.values.push(v);
        self.ids.insert(v, self.values.len() - 1);
        Some(self.values.len() - 1)
    }

    /// Bytes held (capacities; a map entry estimated as key + id + one control byte).
    pub fn heap_bytes(&self) -> usize {
        let size = std::mem::size_of::<T>();
        self.values.capacity() * size + self.ids.capacity() * (size + std::mem::size_of::<usize>() + 1)
    }
}
