"""A new path is a new leg handler, not a new job class: GPU <-> SSD with no host slot.

The stand-in "GPU KV cache" is a CPU tensor (one 4096-aligned row per block, as the host pool's
slots are) and the SSD is the real native store. The test registers a handler for
(Gpu, OnTier) and (OnTier, Gpu) on the executor, builds `LegJob`s from the existing leg and
media types, and round-trips blocks bit-exact; the job and leg modules know nothing of it.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from flexkv_py.config import load_config
from flexkv_py.coordinator import jobs as jobs_module
from flexkv_py.coordinator import legs as legs_module
from flexkv_py.coordinator.executor import ExecutorOptions, JobExecutor
from flexkv_py.coordinator.jobs import NOT_FOUND, LegJob, reason_for_status
from flexkv_py.coordinator.leg_handlers import Moved
from flexkv_py.coordinator.legs import Blocks, Gpu, Host, Leg, OnTier
from flexkv_py.index import Namespace
from flexkv_py.index.tier_names import Tier
from flexkv_py.tiers.host_pool import HostPool
from flexkv_py.tiers.protocol import LowerTier
from flexkv_py.tiers.ssd.tier import SsdTier

GIB = 1 << 30
PAGE = 8192
GPU_BLOCKS = 6
SLOTS = 4


class CpuKvCache:
    """A stand-in GPU KV cache: `blocks` rows of `page` bytes, each 4096-aligned (O_DIRECT)."""

    def __init__(self, blocks: int, page: int) -> None:
        raw = torch.zeros(blocks * page + 4096, dtype=torch.uint8)
        skip = -raw.data_ptr() % 4096
        self._raw = raw  # keeps the memory alive
        self.rows = raw[skip : skip + blocks * page].view(blocks, page)
        self.page = page

    def address(self, block: int) -> int:
        return int(self.rows[block].data_ptr())


class DirectTierHandler:
    """GPU <-> lower tier straight on the KV cache's memory: the tier's batch reads or writes
    each block's row by address; no host slot is involved."""

    def __init__(self, kv: CpuKvCache, tiers: dict[Tier, LowerTier]) -> None:
        self.kv = kv
        self.tiers = tiers
        self.calls = 0

    def move(self, leg: Leg) -> Moved:
        self.calls += 1
        put = isinstance(leg.src, Gpu)
        gpu, lower = (leg.src, leg.dst) if put else (leg.dst, leg.src)
        assert isinstance(gpu, Gpu) and isinstance(lower, OnTier)
        tier = self.tiers.get(lower.tier)
        if tier is None:
            return Moved(dict.fromkeys(leg.keys, NOT_FOUND))
        items = [
            (k, (self.kv.address(b), self.kv.page)) for k, b in zip(leg.keys, gpu.ids, strict=True)
        ]
        batch = tier.submit_put(items) if put else tier.submit_get(items)
        failed = {}
        for key, r in zip(leg.keys, batch.wait(30), strict=True):
            reason = reason_for_status(r.status)
            if reason is not None:
                failed[key] = reason
        return Moved(failed, (len(leg.keys) - len(failed)) * self.kv.page)


@pytest.fixture
def direct(
    tmp_path: Path,
) -> Iterator[tuple[JobExecutor, CpuKvCache, DirectTierHandler, Namespace]]:
    (tmp_path / "ssd").mkdir()
    cfg = load_config(
        {
            "cpu_cache_gb": SLOTS * PAGE / GIB,
            "ssd_cache_gb": 64 * (PAGE + 4096) / GIB,
            "ssd_cache_dir": str(tmp_path / "ssd"),
        },
        env={},
    )
    ns = Namespace(
        "test/direct",
        revision="r1",
        kv_dtype="float16",
        kv_layout="NHD",
        block_size=16,
        page_bytes=PAGE,
    )
    pool = HostPool(SLOTS, PAGE, pin=False)
    tiers: dict[Tier, LowerTier] = {Tier.SSD: SsdTier(cfg, ns)}
    ex = JobExecutor(cfg, ns, pool, options=ExecutorOptions(tiers=tiers), owns=(pool,))
    kv = CpuKvCache(GPU_BLOCKS, PAGE)
    handler = DirectTierHandler(kv, tiers)
    ex.handlers.register(Gpu, OnTier, handler)
    ex.handlers.register(OnTier, Gpu, handler)
    yield ex, kv, handler, ns
    assert ex.shutdown(timeout=30)


def _run(ex: JobExecutor, job: LegJob) -> object:
    result = ex.submit(job).wait(timeout=30)
    assert ex.wait([job.job_id]) == [result]
    return result


def test_gpu_to_ssd_and_back_with_no_host_slot(
    direct: tuple[JobExecutor, CpuKvCache, DirectTierHandler, Namespace],
) -> None:
    ex, kv, handler, ns = direct
    keys = tuple(ns.keys([f"direct-{i}".encode().ljust(32, b".") for i in range(3)]))
    gen = torch.Generator().manual_seed(11)
    kv.rows[:3] = torch.randint(0, 256, (3, PAGE), generator=gen, dtype=torch.uint8)
    want = kv.rows[:3].clone()
    pool_before = bytes(ex.pool.tensor.numpy().tobytes())  # type: ignore[attr-defined]

    ssd = OnTier(Tier.SSD)
    stored = _run(ex, LegJob(1, (Leg(Blocks(keys), Gpu((0, 1, 2)), ssd),)))
    assert stored.failed == {} and stored.nbytes == 3 * PAGE  # type: ignore[attr-defined]
    assert all(ex.tiers[Tier.SSD].contains(k) for k in keys)

    # Back into other GPU blocks, in another order.
    loaded = _run(ex, LegJob(2, (Leg(Blocks(keys[::-1]), ssd, Gpu((3, 4, 5))),)))
    assert loaded.failed == {} and loaded.nbytes == 3 * PAGE  # type: ignore[attr-defined]
    assert torch.equal(kv.rows[3:6], want.flip(0))
    assert handler.calls == 2
    # No host slot was touched on the way.
    assert ex.pool.tensor.numpy().tobytes() == pool_before  # type: ignore[attr-defined]

    # A key the SSD does not have fails by the status table, as on any other path.
    ghost = ns.keys([b"ghost".ljust(32, b".")])[0]
    missing = _run(ex, LegJob(3, (Leg(Blocks((ghost,)), ssd, Gpu((0,))),)))
    assert missing.failed == {ghost: NOT_FOUND}  # type: ignore[attr-defined]


def test_direct_legs_compose_with_the_built_in_handlers(
    direct: tuple[JobExecutor, CpuKvCache, DirectTierHandler, Namespace],
) -> None:
    """GPU -> SSD directly, then SSD -> host slot through the built-in handler: one job."""
    ex, kv, _, ns = direct
    keys = tuple(ns.keys([f"mixed-{i}".encode().ljust(32, b".") for i in range(2)]))
    kv.rows[0].fill_(0xA5)
    kv.rows[1].fill_(0x3C)
    ssd = OnTier(Tier.SSD)
    job = LegJob(
        7,
        (
            Leg(Blocks(keys), Gpu((0, 1)), ssd),
            Leg(Blocks(keys), ssd, Host((2, 3))),
        ),
    )
    result = _run(ex, job)
    assert result.failed == {}  # type: ignore[attr-defined]
    pool = ex.pool.tensor.numpy()  # type: ignore[attr-defined]
    assert pool[2].tobytes() == kv.rows[0].numpy().tobytes()
    assert pool[3].tobytes() == kv.rows[1].numpy().tobytes()


def test_the_new_path_needs_no_change_to_jobs_or_legs() -> None:
    """The handler lives in this test only: the job and leg modules name no such path."""
    for module in (jobs_module, legs_module):
        source = inspect.getsource(module)
        assert "DirectTierHandler" not in source and "CpuKvCache" not in source
    # The job is the generic leg job; its legs are the existing media.
    assert {f for f in LegJob.__dataclass_fields__} == {
        "job_id",
        "legs",
        "kind",
        "gpu_block_ids",
        "drop_first",
    }
    assert Gpu.__module__ == Host.__module__ == OnTier.__module__ == legs_module.__name__


def test_a_leg_keeps_its_columns_aligned() -> None:
    with pytest.raises(ValueError, match="2 keys but 1 parents"):
        Blocks((b"a", b"b"), parents=(None,))
    with pytest.raises(ValueError, match="2 blocks but 1 places"):
        Leg(Blocks((b"a", b"b")), Gpu((0,)), OnTier(Tier.SSD))
    leg = Leg(Blocks((b"a", b"b", b"c"), metas=(b"1", b"2", b"3")), Host((5, 6, 7)), Gpu((1, 2, 3)))
    part = leg.take([2, 0])
    assert part.keys == (b"c", b"a") and part.blocks.metas == (b"3", b"1")
    assert part.src == Host((7, 5)) and part.dst == Gpu((3, 1))
