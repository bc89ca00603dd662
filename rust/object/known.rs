//! Keys this process knows are in the store (it wrote them, read them or looked them up). A
//! put of a known key sends nothing. Bounded: past `CAP` keys the set starts over, which only
//! costs requests (a forgotten key is asked about or conditionally created again). Knowledge
//! also ages: GC in another process may delete what this one learned, so the set starts over
//! once it is older than the tier's `touch_interval` (GC's TTL must be longer than that).

use std::collections::HashSet;
use std::time::{Duration, Instant};

const CAP: usize = 1 << 20;

pub struct KnownKeys {
    keys: HashSet<Vec<u8>>,
    since: Instant,
}

impl Default for KnownKeys {
    fn default() -> Self {
        KnownKeys { keys: HashSet::new(), since: Instant::now() }
    }
}

impl KnownKeys {
    pub fn contains(&self, key: &[u8]) -> bool {
        self.keys.contains(key)
    }

    pub fn insert(&mut self, key: Vec<u8>) {
        if self.keys.len() >= CAP {
            self.keys.clear();
        }
        self.keys.insert(key);
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
