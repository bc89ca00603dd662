"""Host-side construction for one worker rank: the host pool and the transfer engine over
vLLM's registered KV caches, sized as the scheduler-side manager plans them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from typing_extensions import Buffer

from flexkv_py.config import FlexKVConfig
from flexkv_py.coordinator.jobs import StoreJob
from flexkv_py.coordinator.planning import host_pool_in_background, host_slots_for
from flexkv_py.errors import ConfigError
from flexkv_py.index.namespace import Namespace
from flexkv_py.tiers.memory_limit import check_host_pool_fits


class HostSlots(Protocol):
    """What the executor needs from the host pool (flexkv_py.tiers.host_pool.HostPool)."""

    num_slots: int
    slot_nbytes: int

    def slot_address(self, slot: int) -> int: ...
    @property
    def ready_slots(self) -> int: ...  # leading slots usable now (a background pool grows)
    def allow_registration(self) -> None: ...


def build_host_side(
    config: FlexKVConfig,
    namespace: Namespace,
    kv_caches: Mapping[str, Any],
    *,
    serving: bool = False,
) -> tuple[Any, Any]:
    """This rank's (HostPool, TransferEngine) for vLLM's registered KV caches. The pool has
    `host_slots_for(config, namespace, page)` slots, the count the scheduler-side manager plans."""
    from flexkv_py.tiers.host_pool import HostPool
    from flexkv_py.transfer import TransferEngine, describe_kv_caches

    geom = describe_kv_caches(kv_caches)
    if namespace.page_bytes and namespace.page_bytes != geom.page_nbytes:
        raise ConfigError(
            f"namespace.page_bytes: {namespace.page_bytes} does not match the KV cache page "
            f"of {geom.page_nbytes} bytes ({geom.fingerprint})"
        )
    num_slots = host_slots_for(config, namespace, geom.page_nbytes)
    # Here, in the process that allocates the pool: over the container's memory limit it would
    # be OOM-killed once the pool is touched, so refuse at start instead.
    check_host_pool_fits(config.cpu_cache_gb, num_slots * geom.slot_nbytes, namespace.world_size)
    pool = HostPool(
        num_slots,
        geom.slot_nbytes,
        huge_pages=config.host_huge_pages,
        background=host_pool_in_background(config, namespace, geom.page_nbytes, serving=serving),
    )
    try:
        engine = TransferEngine(kv_caches, pool, backend=config.transfer_engine)
    except BaseException:
        pool.close()
        raise
    return pool, engine


def write_pages(pool: Any, job: StoreJob, pages: Mapping[bytes, Buffer]) -> None:
    """A host-only store's fill (CacheEngine.store_pages): each job block's page into its slot,
    zero-padded (equal pages stay byte-equal: SSD dedup)."""
    tensor = pool.tensor
    for key, slot in zip(job.keys, job.host_slots, strict=True):
        data = memoryview(pages[key]).cast("B")
        if len(data) > pool.slot_nbytes:
            raise ValueError(f"page of {len(data)} bytes exceeds the slot size")
        row = tensor[slot].numpy()
        row[: len(data)] = data
        row[len(data) :] = 0
