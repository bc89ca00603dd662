"""How many blocks a lower tier holds: the SSD store's on-disk footprint of one block.

The index decides every SSD eviction (lower_room.py `make_room`), so it must know the store's
room in blocks exactly as the store counts it (rust/store/open.rs, rust/index/mod.rs
`extent_pages`): each directory gets `capacity / dirs` bytes rounded down to 4 KiB pages, page 0
holds the superblock, and a block takes one header page plus its data rounded up to pages. The
store is handed whole host slots. With dedup or compression it holds less than this per block,
so the count is conservative: the store's own eviction (a safety net) never has to fire.
"""

from __future__ import annotations

STORE_PAGE = 4096  # rust/format PAGE: the store's allocation unit
SUPERBLOCK_PAGES = 1  # page 0 of every data file
HEADER_PAGES = 1  # one header page before each block's data


def block_pages(stored_bytes: int) -> int:
    """Pages one block of `stored_bytes` takes on disk (header + data rounded up)."""
    return HEADER_PAGES + -(-stored_bytes // STORE_PAGE)


def store_capacity_blocks(capacity_bytes: int, dirs: int, stored_bytes: int) -> int:
    """Blocks of `stored_bytes` a store of `capacity_bytes` over `dirs` directories holds."""
    if dirs < 1 or stored_bytes < 1:
        raise ValueError(f"need >= 1 directory and block byte, got {dirs}, {stored_bytes}")
    pages = (capacity_bytes // dirs) // STORE_PAGE - SUPERBLOCK_PAGES
    return dirs * max(0, pages // block_pages(stored_bytes))
