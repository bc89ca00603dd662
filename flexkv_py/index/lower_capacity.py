"""How many blocks a lower tier holds: the SSD store's on-disk footprint of one block.

The index decides every SSD eviction (lower_room.py `make_room`), so it must know the store's
room in blocks exactly as the store counts it. The arithmetic is the store's own (rust/format/
layout.rs, exported by the native module): each directory gets `capacity / dirs` bytes rounded
down to 4 KiB pages, page 0 holds the superblock, and a block takes one header page plus its
data rounded up to pages. The store is handed whole host slots. With dedup or compression it
holds less than this per block, so the count is conservative: the store's own eviction (a
safety net) never has to fire.
"""

from __future__ import annotations

from flexkv_py._native import STORE_PAGE, SUPERBLOCK_PAGES, block_pages, store_capacity_blocks

__all__ = ["STORE_PAGE", "SUPERBLOCK_PAGES", "block_pages", "store_capacity_blocks"]
