"""Sizing shared by the scheduler-side manager and every worker: both must agree on slot counts."""

from __future__ import annotations

from flexkv_py.config import FlexKVConfig
from flexkv_py.errors import ConfigError
from flexkv_py.index.namespace import Namespace

SLOT_ALIGN = 4096  # O_DIRECT alignment: slots (and SSD blocks) are whole 4 KiB pages


def slot_nbytes_for(page_bytes: int) -> int:
    return -(-page_bytes // SLOT_ALIGN) * SLOT_ALIGN


def host_slots_for(config: FlexKVConfig, namespace: Namespace, page_bytes: int) -> int:
    """Host slots per rank: this rank's share of cpu_cache_gb divided by the slot size."""
    if page_bytes <= 0:
        raise ConfigError(f"page_bytes: must be > 0, got {page_bytes}")
    slots = namespace.rank_share(config.cpu_cache_bytes) // slot_nbytes_for(page_bytes)
    if slots < 1:
        raise ConfigError(
            f"cpu_cache_gb: {config.cpu_cache_gb:g} GiB over {namespace.world_size} rank(s) holds "
            f"no block of {page_bytes} bytes; raise it"
        )
    return slots
