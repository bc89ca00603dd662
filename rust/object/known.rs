//! Keys this process knows are in the store (it wrote them, read them or looked them up). A
//! put of a known key sends nothing. Bounded: past `CAP` keys the set starts over, which only
//! costs requests (a forgotten key is asked about or conditionally created again).

use std::collections::HashSet;

const CAP: usize = 1 << 20;

#[derive(Default)]
pub struct KnownKeys {
    keys: HashSet<Vec<u8>>,
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
}
