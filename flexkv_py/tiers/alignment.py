"""The one alignment rule of the data path, below every layer that needs it."""

# O_DIRECT needs page-aligned buffers and lengths: host slots, SSD blocks and the per-block page
# size planned for them are whole 4 KiB pages.
SLOT_ALIGN = 4096


def round_up_to_slot(nbytes: int) -> int:
    """`nbytes` rounded up to a whole number of aligned pages."""
    return -(-nbytes // SLOT_ALIGN) * SLOT_ALIGN
