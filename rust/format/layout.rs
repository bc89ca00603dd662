//! Where blocks go in a data file, in pages: page 0 holds the superblock, then each block is
//! one extent (its header page plus its payload rounded up). The store opens and allocates by
//! these functions, and the Python index sizes the SSD tier by the same ones (exported as
//! `store_capacity_blocks`), so the two never disagree on how many blocks fit.

use super::{round_up_to_page, PAGE};

/// Pages before the first extent of every data file (the superblock).
pub const SUPERBLOCK_PAGES: u64 = 1;

/// Pages an extent occupies: the header page plus the payload rounded up.
pub fn extent_pages(stored_len: u64) -> u64 {
    1 + (round_up_to_page(stored_len as usize) / PAGE) as u64
}

/// Length of each directory's data file: an even share of the budget, whole pages.
pub fn data_file_len(capacity_bytes: u64, dirs: usize) -> u64 {
    let dirs = dirs.max(1) as u64;
    (capacity_bytes / dirs) / PAGE as u64 * PAGE as u64
}

/// Blocks of `stored_len` bytes a store of `capacity_bytes` over `dirs` directories holds
/// when no two share content: whole extents after each file's superblock. Dedup and
/// compression only make room, so this is what the store holds at least.
pub fn capacity_blocks(capacity_bytes: u64, dirs: usize, stored_len: u64) -> u64 {
    if dirs == 0 {
        return 0;
    }
    let pages = data_file_len(capacity_bytes, dirs) / PAGE as u64;
    dirs as u64 * (pages.saturating_sub(SUPERBLOCK_PAGES) / extent_pages(stored_len))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_whole_extents_after_the_superblock() {
        let page = PAGE as u64;
        assert_eq!(extent_pages(1), 2);
        assert_eq!(extent_pages(page), 2);
        assert_eq!(extent_pages(page + 1), 3);
        assert_eq!(capacity_blocks(10 * 2 * page, 1, page), 9);
        assert_eq!(capacity_blocks(10 * 2 * page + page, 1, page), 10);
        assert_eq!(capacity_blocks(2 * (5 * 2 + 1) * page, 2, page), 10);
        assert_eq!(capacity_blocks(page / 2, 1, page), 0);
        assert_eq!(data_file_len(3 * page + 100, 2), page);
    }
}
