//! Best-fit extent allocator over a data file, in 4 KiB pages. Free ranges are kept both by
//! start (to coalesce neighbours on free) and by (length, start) (to find the best fit).

use std::collections::{BTreeMap, BTreeSet};

#[derive(Debug, Clone)]
pub struct ExtentAllocator {
    total_pages: u64,
    free_by_start: BTreeMap<u64, u64>,
    free_by_len: BTreeSet<(u64, u64)>,
    free_pages: u64,
}

impl ExtentAllocator {
    /// Pages `[first_page, total_pages)` are allocatable (page 0 holds the superblock).
    pub fn new(first_page: u64, total_pages: u64) -> Self {
        let mut a = ExtentAllocator {
            total_pages,
            free_by_start: BTreeMap::new(),
            free_by_len: BTreeSet::new(),
            free_pages: 0,
        };
        if total_pages > first_page {
            a.insert_free(first_page, total_pages - first_page);
        }
        a
    }

    pub fn total_pages(&self) -> u64 {
        self.total_pages
    }

    pub fn free_pages(&self) -> u64 {
        self.free_pages
    }

    pub fn largest_free(&self) -> u64 {
        self.free_by_len.iter().next_back().map_or(0, |&(len, _)| len)
    }

    fn insert_free(&mut self, start: u64, len: u64) {
        self.free_by_start.insert(start, len);
        self.free_by_len.insert((len, start));
        self.free_pages += len;
    }

    fn remove_free(&mut self, start: u64, len: u64) {
        self.free_by_start.remove(&start);
        self.free_by_len.remove(&(len, start));
        self.free_pages -= len;
    }

    /// Smallest free range that fits; returns its first page.
    pub fn alloc(&mut self, pages: u64) -> Option<u64> {
        if pages == 0 {
            return None;
        }
        let &(len, start) = self.free_by_len.range((pages, 0)..).next()?;
        self.remove_free(start, len);
        if len > pages {
            self.insert_free(start + pages, len - pages);
        }
        Some(start)
    }

    /// Return a range; merges with free neighbours.
    pub fn free(&mut self, start: u64, pages: u64) {
        debug_assert!(!self.overlaps_free(start, pages), "double free of {start}+{pages}");
        let (mut start, mut pages) = (start, pages);
        if let Some((&prev_start, &prev_len)) = self.free_by_start.range(..start).next_back() {
            if prev_start + prev_len == start {
                self.remove_free(prev_start, prev_len);
                start = prev_start;
                pages += prev_len;
            }
        }
        if let Some(&next_len) = self.free_by_start.get(&(start + pages)) {
            self.remove_free(start + pages, next_len);
            pages += next_len;
        }
        self.insert_free(start, pages);
    }

    /// Mark a range used during recovery. False if any page of it is not free (a conflict
    /// between two journal records, which the caller resolves by dropping one of them).
    pub fn reserve(&mut self, start: u64, pages: u64) -> bool {
        let Some((&free_start, &free_len)) = self.free_by_start.range(..=start).next_back() else {
            return false;
        };
        if pages == 0 || start + pages > free_start + free_len {
            return false;
        }
        self.remove_free(free_start, free_len);
        if start > free_start {
            self.insert_free(free_start, start - free_start);
        }
        let tail = free_start + free_len - (start + pages);
        if tail > 0 {
            self.insert_free(start + pages, tail);
        }
        true
    }

    fn overlaps_free(&self, start: u64, pages: u64) -> bool {
        self.free_by_start.range(..start + pages).next_back().is_some_and(|(&s, &l)| s + l > start)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn alloc_free_coalesce() {
        let mut a = ExtentAllocator::new(1, 101);
        let x = a.alloc(10).unwrap();
        let y = a.alloc(20).unwrap();
        assert_eq!(a.free_pages(), 70);
        a.free(x, 10);
        a.free(y, 20);
        assert_eq!(a.free_pages(), 100);
        assert_eq!(a.largest_free(), 100);
        assert!(a.alloc(101).is_none());
    }

    #[test]
    fn reserve_splits_and_detects_conflicts() {
        let mut a = ExtentAllocator::new(1, 11);
        assert!(a.reserve(4, 3));
        assert!(!a.reserve(5, 1));
        assert_eq!(a.free_pages(), 7);
        a.free(4, 3);
        assert_eq!(a.largest_free(), 10);
    }

    proptest! {
        // Model: a bitmap of used pages. Allocations never overlap, never leave the file,
        // and free + used always equals the allocatable total.
        #[test]
        fn never_overlaps(ops in proptest::collection::vec((any::<bool>(), 1u64..9, any::<prop::sample::Index>()), 1..200)) {
            let total = 64u64;
            let mut a = ExtentAllocator::new(1, total);
            let mut used = vec![false; total as usize];
            let mut live: Vec<(u64, u64)> = Vec::new();
            for (is_alloc, n, pick) in ops {
                if is_alloc || live.is_empty() {
                    if let Some(s) = a.alloc(n) {
                        prop_assert!(s >= 1 && s + n <= total);
                        for p in s..s + n { prop_assert!(!used[p as usize]); used[p as usize] = true; }
                        live.push((s, n));
                    }
                } else {
                    let (s, n) = live.swap_remove(pick.index(live.len()));
                    for p in s..s + n { used[p as usize] = false; }
                    a.free(s, n);
                }
                let used_count = used.iter().filter(|u| **u).count() as u64;
                prop_assert_eq!(a.free_pages() + used_count, total - 1);
            }
        }
    }
}
