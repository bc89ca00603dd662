"""The tier seam on the worker side: the executor runs every job "for each lower tier the job
names", through the `LowerTier` protocol, with one status vocabulary.

The SSD tier is the real native store. The second tier is an in-memory `LowerTier` standing in
for the object tier (the thing under test is the executor, not the tier): it copies
bytes to and from host-pool memory by address exactly as a real tier's batches do, can refuse
puts ("rejected") and can evict on its own.
"""

from __future__ import annotations

import ctypes
import re
import sys
import threading
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.store_util import block

from flexkv_py.config import load_config
from flexkv_py.coordinator import (
    DropJob,
    Drops,
    ExecutorOptions,
    JobExecutor,
    SpillJob,
    store_job,
)
from flexkv_py.coordinator import jobs as jobs_module
from flexkv_py.coordinator.counters import Counters
from flexkv_py.coordinator.jobs import (
    INTERNAL,
    NO_DROPS,
    NO_SPACE,
    NOT_FOUND,
    REJECTED,
    STATUS_REASON,
    load_job,
    reason_for_status,
)
from flexkv_py.coordinator.legs import Blocks, write_out
from flexkv_py.errors import ClosedError, InternalStateError
from flexkv_py.index import Namespace
from flexkv_py.index.tier_names import Tier
from flexkv_py.tiers.host_pool import HostPool
from flexkv_py.tiers.node.shards import FinishedBatch as _Finished
from flexkv_py.tiers.node.shards import MadeResult as _Result
from flexkv_py.tiers.protocol import Item, LowerTier
from flexkv_py.tiers.ssd.tier import SsdTier
from flexkv_py.transfer.stream_order import OrderedTransfer

GIB = 1 << 30
SLOT = 8192
SLOTS = 8
REPO = Path(__file__).resolve().parents[3]


class MemoryTier:
    """A `LowerTier` in process memory."""

    def __init__(self, name: Tier, reject: Iterable[bytes] = ()) -> None:
        self._name = name
        self.blocks: dict[bytes, bytes] = {}
        self.reject = set(reject)
        self._evicted: list[bytes] = []
        self.closed = False

    @property
    def name(self) -> Tier:
        return self._name

    def submit_put(self, items: Iterable[Item]) -> _Finished:
        out = []
        for key, (addr, n) in items:
            if key in self.reject:
                out.append(_Result("rejected", n))
                continue
            self.blocks[key] = ctypes.string_at(addr, n)
            out.append(_Result("ok", n))
        return _Finished(out)

    def submit_get(self, items: Iterable[Item]) -> _Finished:
        out = []
        for key, (addr, n) in items:
            data = self.blocks.get(key)
            if data is None:
                out.append(_Result("not_found"))
                continue
            ctypes.memmove(addr, data, min(n, len(data)))
            out.append(_Result("ok", len(data)))
        return _Finished(out)

    def delete(self, keys: Iterable[bytes]) -> int:
        return sum(self.blocks.pop(k, None) is not None for k in keys)

    def contains(self, key: bytes) -> bool:
        return key in self.blocks

    def evict(self, keys: Iterable[bytes]) -> None:
        for k in keys:
            if self.blocks.pop(k, None) is not None:
                self._evicted.append(k)

    def drain_evicted(self) -> list[bytes]:
        out, self._evicted = self._evicted, []
        return out

    def keys(self) -> list[bytes]:
        return list(self.blocks)

    def stats(self) -> dict[str, int | float | str]:
        return {"blocks": len(self.blocks)}

    def close(self) -> None:
        self.closed = True


def _ns() -> Namespace:
    return Namespace(
        "test/seam",
        revision="r1",
        kv_dtype="float16",
        kv_layout="NHD",
        block_size=16,
        page_bytes=SLOT,
    )


def _keys(ns: Namespace, n: int, tag: str) -> list[bytes]:
    return ns.keys([f"{tag}-{i}".encode().ljust(32, b".") for i in range(n)])


@pytest.fixture
def two_tiers(tmp_path: Path) -> Iterator[tuple[JobExecutor, HostPool, MemoryTier]]:
    """An executor over the real SSD tier and an in-memory object tier."""
    (tmp_path / "ssd").mkdir()
    cfg = load_config(
        {
            "cpu_cache_gb": SLOTS * SLOT / GIB,
            "ssd_cache_gb": 64 * (SLOT + 4096) / GIB,
            "ssd_cache_dir": str(tmp_path / "ssd"),
        },
        env={},
    )
    ns = _ns()
    pool = HostPool(SLOTS, SLOT, pin=False)
    obj = MemoryTier(Tier.OBJECT)
    tiers: dict[Tier, LowerTier] = {Tier.SSD: SsdTier(cfg, ns), Tier.OBJECT: obj}
    ex = JobExecutor(
        cfg, ns, pool, options=ExecutorOptions(tiers=tiers, max_workers=2), owns=(pool,)
    )
    yield ex, pool, obj
    assert ex.shutdown(timeout=30)


def _fill(pool: HostPool, slots: list[int], pages: list[bytes]) -> None:
    for s, page in zip(slots, pages, strict=True):
        pool.tensor[s].numpy()[:] = memoryview(page)


def _slot(pool: HostPool, s: int) -> bytes:
    return pool.tensor[s].numpy().tobytes()


def _run(ex: JobExecutor, job: Any, fill: Any = None) -> Any:
    result = ex.submit(job, fill).wait(timeout=30)
    assert ex.wait([job.job_id]) == [result]
    return result


# ---------------------------------------------------------------- jobs over two tiers
def test_store_load_drop_run_for_every_tier_the_job_names(
    two_tiers: tuple[JobExecutor, HostPool, MemoryTier],
) -> None:
    ex, pool, obj = two_tiers
    ssd = ex.tiers[Tier.SSD]
    k = _keys(ex.namespace, 3, "s")
    pages = [block(key, SLOT) for key in k]
    write = ((Tier.SSD, Tier.OBJECT), (Tier.OBJECT,), ())
    store = store_job(1, Blocks(tuple(k)), None, (0, 1, 2), write)
    result = _run(ex, store, lambda: _fill(pool, [0, 1, 2], pages))
    assert result.ok and result.write_failed == {}
    assert [ssd.contains(key) for key in k] == [True, False, False]
    assert obj.blocks == {k[0]: pages[0], k[1]: pages[1]}  # the bytes of the host slots
    assert result.nbytes == 3 * SLOT  # three blocks written through, once each per tier

    # Each block back from the tier the load names, into fresh slots.
    _fill(pool, [3, 4], [bytes(SLOT)] * 2)
    load = load_job(2, (k[0], k[1]), None, (3, 4), (Tier.SSD, Tier.OBJECT))
    result = _run(ex, load)
    assert result.ok and _slot(pool, 3) == pages[0] and _slot(pool, 4) == pages[1]
    stats = ex.stats()
    assert stats["ssd_write_blocks"] == 1 and stats["object_write_blocks"] == 2
    assert stats["ssd_read_blocks"] == 1 and stats["object_read_blocks"] == 1
    assert stats["object"] == {"blocks": 2} and "ssd" in stats
    assert ex.stored_keys(Tier.SSD) == [k[0]]  # each tier's own inventory
    assert sorted(ex.stored_keys(Tier.OBJECT)) == sorted([k[0], k[1]])

    # A drop deletes from the tiers it names only.
    _run(ex, DropJob(3, Drops.of({Tier.OBJECT: (k[0],)})))
    assert not obj.contains(k[0]) and ssd.contains(k[0])
    assert ex.stats()["object_deleted_blocks"] == 1


def test_rejected_put_is_its_own_reason_not_no_space(
    two_tiers: tuple[JobExecutor, HostPool, MemoryTier],
) -> None:
    ex, pool, obj = two_tiers
    k = _keys(ex.namespace, 2, "r")
    obj.reject = {k[1]}
    pages = [block(key, SLOT) for key in k]
    _fill(pool, [0, 1], pages)
    spill = _run(ex, SpillJob(1, write_out(Blocks(tuple(k)), (0, 1), Tier.OBJECT)))
    assert spill.failed == {k[1]: REJECTED} and REJECTED != NO_SPACE
    assert ex.stats()["failed_spill_rejected"] == 1
    store = store_job(2, Blocks(tuple(k)), None, (2, 3), ((Tier.OBJECT,),) * 2)
    result = _run(ex, store, lambda: _fill(pool, [2, 3], pages))
    assert result.ok and result.write_failed == {Tier.OBJECT: frozenset({k[1]})}


def test_each_tier_reports_its_own_evictions(
    two_tiers: tuple[JobExecutor, HostPool, MemoryTier],
) -> None:
    ex, pool, obj = two_tiers
    k = _keys(ex.namespace, 2, "e")
    _fill(pool, [0, 1], [block(key, SLOT) for key in k])
    _run(ex, SpillJob(1, write_out(Blocks(tuple(k)), (0, 1), Tier.OBJECT)))
    obj.evict([k[0]])
    result = _run(ex, DropJob(2, NO_DROPS))
    assert result.evicted == {Tier.OBJECT: (k[0],)}
    assert _run(ex, DropJob(3, NO_DROPS)).evicted == {}  # drained: reported once


def test_a_tier_the_rank_lacks_fails_fast_without_a_device(tmp_path: Path) -> None:
    cfg = load_config({"cpu_cache_gb": SLOTS * SLOT / GIB}, env={})
    pool = HostPool(SLOTS, SLOT, pin=False)
    ex = JobExecutor(cfg, _ns(), pool, options=ExecutorOptions(tiers={}), owns=(pool,))
    try:
        k = _keys(ex.namespace, 2, "n")
        spill = _run(ex, SpillJob(1, write_out(Blocks(tuple(k)), (0, 1), Tier.OBJECT)))
        assert spill.failed == dict.fromkeys(k, NOT_FOUND)
        load = _run(ex, load_job(2, tuple(k), None, (2, 3), (Tier.SSD, Tier.HOST)))
        assert load.failed == {k[0]: NOT_FOUND}
    finally:
        assert ex.shutdown(timeout=30)


def test_shutdown_closes_every_lower_tier(tmp_path: Path) -> None:
    cfg = load_config({"cpu_cache_gb": SLOTS * SLOT / GIB}, env={})
    pool = HostPool(SLOTS, SLOT, pin=False)
    a, b = MemoryTier(Tier.SSD), MemoryTier(Tier.OBJECT)
    ex = JobExecutor(cfg, _ns(), pool, options=ExecutorOptions(tiers={Tier.SSD: a, Tier.OBJECT: b}))
    assert ex.shutdown(timeout=30) and a.closed and b.closed
    pool.close()
    with pytest.raises(ClosedError, match="shut down"):
        ex.submit(DropJob(1, NO_DROPS))


# ---------------------------------------------------------------- one status vocabulary
def test_every_store_status_maps_through_the_one_table() -> None:
    pyi = (REPO / "flexkv_py" / "_native.pyi").read_text()
    literal = re.search(r"BlockStatus = Literal\[(.*?)\]", pyi, re.S)
    assert literal is not None
    statuses = re.findall(r'"(\w+)"', literal.group(1))
    assert set(statuses) == set(STATUS_REASON), "a store status without a failure reason"
    reasons = {v for k, v in vars(jobs_module).items() if k.isupper() and isinstance(v, str)}
    for status in statuses:
        reason = reason_for_status(status)
        assert (reason is None) == (status in ("ok", "deduped"))
        assert reason is None or reason in reasons  # a reason jobs.py defines
    assert reason_for_status("rejected") == REJECTED
    assert reason_for_status("no_space") == NO_SPACE
    assert reason_for_status("bad_buffer") == INTERNAL
    assert reason_for_status("something_new") == INTERNAL  # never silently "ok"


# ---------------------------------------------------------------- stats, errors, imports
def test_counters_lose_no_update_and_show_no_torn_snapshot() -> None:
    """Job threads add a job's counters as one unit while `stats` reads them: an unlocked
    Counter.update (a Python loop) loses updates and shows half of one under thread switches."""
    counters = Counters()
    writers, per_writer = 4, 5000
    stop = threading.Event()
    torn: list[dict[str, int]] = []

    def write() -> None:
        for _ in range(per_writer):
            counters.add_many(Counter(a=1, b=1))
            counters.add("n")

    def read() -> None:
        while not stop.is_set():
            snap = counters.snapshot()
            if snap.get("a", 0) != snap.get("b", 0):
                torn.append(snap)

    threads = [threading.Thread(target=write) for _ in range(writers)]
    reader = threading.Thread(target=read)
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: races show up
    try:
        reader.start()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        stop.set()
        reader.join()
        sys.setswitchinterval(old)
    total = writers * per_writer
    assert not torn[:1] and counters.snapshot() == {"a": total, "b": total, "n": total}


def test_a_copy_without_a_transfer_engine_is_an_internal_state_error() -> None:
    with pytest.raises(InternalStateError, match="no transfer engine"):
        OrderedTransfer(None).submit("d2h", [0], [0])


def test_a_closed_transfer_engine_is_a_closed_error() -> None:
    import torch

    from flexkv_py.transfer import TransferEngine, describe_kv_caches

    caches = {"layers.0": torch.zeros((2, 4, 16, 2, 64), dtype=torch.float16)}
    pool = HostPool(4, describe_kv_caches(caches).slot_nbytes, pin=False)
    engine = TransferEngine(caches, pool)
    engine.submit_d2h([0, 1], [0, 1]).wait(30)
    engine.close()
    try:
        with pytest.raises(ClosedError, match="closed"):
            engine.submit_d2h([0], [0])
    finally:
        pool.close()
