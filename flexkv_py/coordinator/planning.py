"""Sizing shared by the scheduler-side manager and every worker: both must agree on slot counts;
and the rounds of a store streamed through fewer host slots than it has blocks (both read them
from the job's `host_slots`)."""

from __future__ import annotations

from collections.abc import Sequence

from flexkv_py.config import FlexKVConfig
from flexkv_py.errors import ConfigError
from flexkv_py.index.namespace import Namespace
from flexkv_py.tiers.alignment import SLOT_ALIGN

# From this size per rank, host_pool_init=auto prepares the pool in the background: touching and
# pinning it would hold up start-up by about a second or more.
BACKGROUND_POOL_MIN_BYTES = 4 << 30


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


def host_pool_in_background(
    config: FlexKVConfig, namespace: Namespace, page_bytes: int, *, serving: bool
) -> bool:
    """Is each rank's host pool touched and pinned in the background (usable slots growing from
    0)? The scheduler and every worker decide alike, from the configuration alone. `auto` picks
    it only when `serving` (the vLLM connector, where start-up time matters); in-process engines
    (benches, replay) want every slot at once."""
    if config.host_pool_init != "auto":
        return config.host_pool_init == "background"
    if not serving:
        return False
    pool_bytes = host_slots_for(config, namespace, page_bytes) * slot_nbytes_for(page_bytes)
    return pool_bytes >= BACKGROUND_POOL_MIN_BYTES


def store_rounds(host_slots: Sequence[int]) -> list[list[int]]:
    """A store job's positions in rounds: round r holds each slot's (r+1)-th use, in job order.
    A store larger than the free host slots streams through them (stores.py): a slot is filled,
    written to the lower tier, and filled again by the next round. One round: no slot repeats."""
    if len(set(host_slots)) == len(host_slots):  # the common case, in C: one round
        return [list(range(len(host_slots)))] if host_slots else []
    uses: dict[int, int] = {}
    rounds: list[list[int]] = []
    for i, slot in enumerate(host_slots):
        r = uses.get(slot, 0)
        uses[slot] = r + 1
        if r == len(rounds):
            rounds.append([])
        rounds[r].append(i)
    return rounds
