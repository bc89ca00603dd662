//! Admission by frequency: a block goes to the device only once its key was offered at
//! least `min_hits` times. Counts live in a small count-min sketch (bounded memory, no key
//! storage) that halves itself periodically so old popularity fades.

pub struct FrequencySketch {
    min_hits: u8,
    rows: [Vec<u8>; 4],
    mask: usize,
    increments: usize,
}

const WIDTH: usize = 1 << 16;

impl FrequencySketch {
    pub fn new(min_hits: u32) -> Self {
        let min_hits = min_hits.clamp(1, 255) as u8;
        FrequencySketch {
            min_hits,
            rows: std::array::from_fn(|_| if min_hits > 1 { vec![0u8; WIDTH] } else { Vec::new() }),
            mask: WIDTH - 1,
            increments: 0,
        }
    }

    /// Count one offer of `key`; true when it may be admitted.
    pub fn offer(&mut self, key: &[u8]) -> bool {
        if self.min_hits <= 1 {
            return true;
        }
        let h = xxhash_rust::xxh3::xxh3_128(key);
        let mut estimate = u8::MAX;
        for (i, row) in self.rows.iter_mut().enumerate() {
            let slot = ((h >> (i * 32)) as usize) & self.mask;
            row[slot] = row[slot].saturating_add(1);
            estimate = estimate.min(row[slot]);
        }
        self.increments += 1;
        if self.increments >= WIDTH * 8 {
            self.increments = 0;
            for row in self.rows.iter_mut() {
                row.iter_mut().for_each(|c| *c /= 2);
            }
        }
        estimate >= self.min_hits
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn admits_on_the_nth_offer() {
        let mut s = FrequencySketch::new(3);
        assert!(!s.offer(b"x"));
        assert!(!s.offer(b"x"));
        assert!(s.offer(b"x"));
        assert!(!s.offer(b"y"));
        assert!(FrequencySketch::new(1).offer(b"z"));
    }
}
