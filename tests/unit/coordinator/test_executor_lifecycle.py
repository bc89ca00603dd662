"""JobExecutor: bounded waits, abandoned stores and shutdown with jobs still running.

Real parts throughout: the host pool, the native SSD store and the CPU transfer engine. A job is
held in flight deterministically with a threading.Event: either inside the job's own `fill` hook
(runs on the job thread) or ahead of its copy on the CPU transfer engine's single d2h thread,
which runs copies in submission order (what a stuck copy engine does to the copies behind it).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers.store_util import block

from flexkv_py.config import FlexKVConfig, load_config
from flexkv_py.coordinator import ExecutorOptions, JobExecutor, JobResult, store_job
from flexkv_py.coordinator.jobs import TRANSFER_ERROR, WRITE_NONE, WRITE_SSD, load_job
from flexkv_py.coordinator.legs import Blocks, write_out
from flexkv_py.errors import ClosedError
from flexkv_py.index import Namespace
from flexkv_py.index.tier_names import Tier
from flexkv_py.tiers.host_pool import HostPool
from flexkv_py.transfer import describe_kv_caches

GIB = 1 << 30
NUM_BLOCKS = 8
SLOTS = 6
HELD_S = 0.05  # how long a wait on a job held by a closed gate runs before it must give up


def _caches() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return {
        f"layers.{i}": torch.randn((2, NUM_BLOCKS, 16, 2, 64), generator=gen).to(torch.float16)
        for i in range(2)
    }


def _gpu_block(caches: dict[str, torch.Tensor], b: int) -> list[torch.Tensor]:
    return [t[:, b].clone() for t in caches.values()]


def _setup(tmp_path: Path, caches: dict[str, torch.Tensor]) -> tuple[FlexKVConfig, Namespace]:
    geom = describe_kv_caches(caches)
    ns = Namespace(
        "test/model",
        revision="r1",
        kv_dtype="float16",
        kv_layout=geom.layout,
        block_size=16,
        page_bytes=geom.page_nbytes,
    )
    (tmp_path / "ssd").mkdir()
    cfg = load_config(
        {
            "cpu_cache_gb": SLOTS * geom.slot_nbytes / GIB,
            "ssd_cache_gb": 64 * (geom.slot_nbytes + 4096) / GIB,
            "ssd_cache_dir": str(tmp_path / "ssd"),
        },
        env={},
    )
    return cfg, ns


def _keys(ns: Namespace, n: int, tag: str) -> list[bytes]:
    return ns.keys([f"{tag}-{i}".encode().ljust(32, b".") for i in range(n)])


@pytest.fixture
def gpu_executor(tmp_path: Path) -> Iterator[tuple[JobExecutor, dict[str, torch.Tensor]]]:
    caches = _caches()
    cfg, ns = _setup(tmp_path, caches)
    ex = JobExecutor.from_kv_caches(cfg, ns, caches)
    assert Tier.SSD in ex.tiers and ex.num_host_slots == SLOTS
    yield ex, caches
    assert ex.shutdown(timeout=30)


def _hold_d2h(ex: JobExecutor) -> threading.Event:
    """Every GPU->host copy submitted after this waits until the returned gate is set."""
    gate = threading.Event()
    ex.transfer._executors["d2h"].submit(gate.wait)  # type: ignore[union-attr]
    return gate


def _slot_bytes(ex: JobExecutor, slot: int) -> bytes:
    return ex.pool.tensor[slot].numpy().tobytes()  # type: ignore[attr-defined]


def _read_back(ex: JobExecutor, job_id: int, key: bytes, slot: int) -> bytes | None:
    """The key's bytes from the SSD tier (through a real load job), or None if it is absent."""
    result = ex.submit(load_job(job_id, (key,), None, (slot,), (Tier.SSD,))).wait(timeout=30)
    assert ex.wait([job_id]) == [result]
    return None if result.failed else _slot_bytes(ex, slot)


# ---------------------------------------------------------------- wait
def test_wait_timeout_consumes_no_result(tmp_path: Path) -> None:
    caches = _caches()
    cfg, ns = _setup(tmp_path, caches)
    pool = HostPool(SLOTS, describe_kv_caches(caches).slot_nbytes, pin=False)
    ex = JobExecutor(cfg, ns, pool, options=ExecutorOptions(tiers={}), owns=(pool,))
    gate = threading.Event()
    k = _keys(ns, 2, "w")
    try:
        done = ex.submit(
            store_job(1, Blocks((k[0],)), None, (0,), (WRITE_NONE,)), fill=lambda: None
        )
        held = ex.submit(store_job(2, Blocks((k[1],)), None, (1,), (WRITE_NONE,)), fill=gate.wait)
        first = done.wait(timeout=30)
        with pytest.raises(TimeoutError):
            ex.wait([1, 2], timeout=HELD_S)
        assert ex.poll() == [first]  # the finished job's result was not lost by the timeout
        gate.set()
        second = held.wait(timeout=30)
        assert ex.wait([1, 2], timeout=30) == [second] and second.ok
        assert ex.pending() == 0
    finally:
        gate.set()
        assert ex.shutdown(timeout=30)


# ---------------------------------------------------------------- abandon
def test_abandoned_store_fails_every_block_and_writes_none_to_ssd(
    gpu_executor: tuple[JobExecutor, dict[str, torch.Tensor]],
) -> None:
    ex, caches = gpu_executor
    keys = _keys(ex.namespace, 2, "a")
    gate = _hold_d2h(ex)
    try:
        job = store_job(1, Blocks(tuple(keys)), (1, 2), (0, 1), (WRITE_SSD, WRITE_SSD))
        handle = ex.submit(job)
        assert ex.abandon([job.job_id, 99]) == [job.job_id]  # 99: unknown, ignored
        for t in caches.values():  # vLLM reuses the blocks before the copy ran
            t[:, 1:3].fill_(-7.0)
    finally:
        gate.set()
    result = handle.wait(timeout=30)
    assert result.failed == dict.fromkeys(keys, TRANSFER_ERROR)
    assert ex.wait([job.job_id]) == [result]
    assert Tier.SSD in ex.tiers and not any(ex.tiers[Tier.SSD].contains(k) for k in keys)
    assert ex.stats()["abandoned_store_blocks"] == 2


def test_abandon_after_the_copy_finished_keeps_the_store(
    gpu_executor: tuple[JobExecutor, dict[str, torch.Tensor]],
) -> None:
    ex, caches = gpu_executor
    (key,) = _keys(ex.namespace, 1, "b")
    job = store_job(1, Blocks((key,)), (3,), (0,), (WRITE_SSD,))
    result = ex.submit(job).wait(timeout=30)  # the copy is done: nothing left to distrust
    assert ex.abandon([job.job_id]) == []
    assert ex.wait([job.job_id]) == [result] and result.ok
    # The SSD copy is block 3: load it into GPU block 5 through another host slot.
    load = load_job(2, (key,), (5,), (1,), (Tier.SSD,))
    assert ex.submit(load).wait(timeout=30).ok and ex.wait([2])
    for got, want in zip(_gpu_block(caches, 5), _gpu_block(caches, 3), strict=True):
        assert torch.equal(got.view(torch.int16), want.view(torch.int16))


def test_store_abandoned_before_its_chained_copy_issues_no_copy(
    gpu_executor: tuple[JobExecutor, dict[str, torch.Tensor]],
) -> None:
    """A store reusing an evicted block's slot writes that block to SSD first and only then
    issues its GPU->host copy; abandoned in between, it must not issue the copy at all."""
    ex, _ = gpu_executor
    victim, key = _keys(ex.namespace, 2, "c")
    page = block(victim, ex.pool.slot_nbytes)
    ex.pool.tensor[0].numpy()[:] = memoryview(page)  # type: ignore[attr-defined]
    gate = threading.Event()
    job = store_job(
        1,
        Blocks((key,)),
        (4,),
        (0,),
        (WRITE_NONE,),
        spill=write_out(Blocks((victim,)), (0,), Tier.SSD),
    )
    # `fill` runs on the job thread after the spill and before the copy is issued.
    handle = ex.submit(job, fill=gate.wait)
    try:
        assert ex.abandon([job.job_id]) == [job.job_id]
    finally:
        gate.set()
    result = handle.wait(timeout=30)
    assert result.failed == {key: TRANSFER_ERROR} and not result.spill_failed
    assert ex.wait([job.job_id]) == [result]
    assert _slot_bytes(ex, 0) == page  # no GPU->host copy touched the slot
    assert _read_back(ex, 2, victim, 1) == page  # the spill itself went through


# ---------------------------------------------------------------- shutdown
def test_shutdown_timeout_leaks_pool_and_store_instead_of_closing_them(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caches = _caches()
    cfg, ns = _setup(tmp_path, caches)
    pool = HostPool(SLOTS, describe_kv_caches(caches).slot_nbytes, pin=False)
    ex = JobExecutor(cfg, ns, pool, owns=(pool,))
    (key,) = _keys(ns, 1, "s")
    page = block(key, pool.slot_nbytes)
    gate = threading.Event()

    def fill() -> None:  # a job still running at shutdown (e.g. a slow device)
        gate.wait()
        pool.tensor[2].numpy()[:] = memoryview(page)

    handle = ex.submit(store_job(1, Blocks((key,)), None, (2,), (WRITE_SSD,)), fill=fill)
    try:
        with caplog.at_level(logging.ERROR, logger="flexkv_py.coordinator.executor"):
            closed = ex.shutdown(timeout=HELD_S)
        assert not pool.closed  # leaked, not unmapped under the running job
        assert closed is False
        assert any("still running" in r.getMessage() for r in caplog.records)
        with pytest.raises(ClosedError, match="shut down"):
            ex.submit(store_job(2, Blocks((key,)), None, (3,), (WRITE_NONE,)), fill=lambda: None)
    finally:
        gate.set()
    result: JobResult = handle.wait(timeout=30)
    assert result.ok and not result.write_failed  # the SSD store was still open for its write
    assert Tier.SSD in ex.tiers  # still open: read the block back from it directly
    (got,) = (
        ex.tiers[Tier.SSD].submit_get([(key, (pool.slot_address(4), pool.slot_nbytes))]).wait(30)
    )
    assert got.ok and _slot_bytes(ex, 4) == page
    assert ex.shutdown(timeout=30) is True  # nothing running any more: now it closes
    assert pool.closed
