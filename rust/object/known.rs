//! Keys this process knows are in the store (it wrote them, read them or looked them up). A
//! put of a known key sends nothing. Bounded: past `cap` keys the oldest learned is forgotten,
//! which only costs requests (a forgotten key is asked about or conditionally created again).
//! Knowledge also ages: GC in another process may delete what this one learned, so the set
//! starts over once it is older than the tier's `touch_interval` (GC's TTL must be longer
//! than that).

use std::time::{Duration, Instant};

use hashlink::LinkedHashSet;

/// Keys remembered by default (a million 32-byte keys: ~100 MiB at most).
pub const CAP: usize = 1 << 20;

pub struct KnownKeys {
    /// Oldest learned first.
    keys: LinkedHashSet<Vec<u8>>,
    cap: usize,
    since: Instant,
}

impl Default for KnownKeys {
    fn default() -> Self {
        KnownKeys::with_cap(CAP)
    }
}

impl KnownKeys {
    pub fn with_cap(cap: usize) -> Self {
        KnownKeys { keys: LinkedHashSet::new(), cap, since: Instant::now() }
    }

    pub fn contains(&self, key: &[u8]) -> bool {
        self.keys.contains(key)
    }

    /// `key` is stored: remembered as the newest, the oldest forgotten past the cap.
    pub fn insert(&mut self, key: Vec<u8>) {
        self.keys.insert(key); // a key present already moves to the back
        while self.keys.len() > self.cap {
            self.keys.pop_front();
        }
    }

    pub fn remove(&mut self, key: &[u8]) {
        self.keys.remove(key);
    }

    pub fn len(&self) -> usize {
        self.keys.len()
    }

    /// Forget everything once the set is older than `max_age`.
    pub fn expire(&mut self, max_age: Duration) {
        if self.since.elapsed() > max_age {
            self.keys.clear();
            self.since = Instant::now();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_oldest_learned_goes_first_past_the_cap() {
        let mut k = KnownKeys::with_cap(3);
        for key in [b"a", b"b", b"c"] {
            k.insert(key.to_vec());
        }
        k.insert(b"a".to_vec()); // learned again: the newest now
        k.insert(b"d".to_vec());
        assert_eq!(k.len(), 3);
        assert!(!k.contains(b"b") && k.contains(b"a") && k.contains(b"c") && k.contains(b"d"));
        k.insert(b"e".to_vec());
        assert!(!k.contains(b"c") && k.contains(b"a"));
        k.remove(b"a");
        assert_eq!(k.len(), 2);
    }
}
