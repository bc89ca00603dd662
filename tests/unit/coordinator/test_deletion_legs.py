"""Deletes are legs: blocks named by key leave a lower tier by a leg from the tier to `Gone`,
run through the handler registered for (OnTier, Gone), in a `LegJob`, a `DropJob` or a job's
`drop_first` alike. The SSD tier is the real native store in tmp_path; a refused delete (its
journal failing, by fault injection) is counted, never raised."""

from __future__ import annotations

import contextlib
import pickle
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.store_util import block

from flexkv_py.config import FlexKVConfig, load_config
from flexkv_py.coordinator import DropJob, Drops, ExecutorOptions, JobExecutor, store_job
from flexkv_py.coordinator.jobs import NOT_FOUND, LegJob, load_job
from flexkv_py.coordinator.leg_handlers import Moved
from flexkv_py.coordinator.legs import Blocks, Gone, Host, Leg, OnTier, deletion
from flexkv_py.coordinator.tier_handlers import TierDelete
from flexkv_py.errors import FlexKVError
from flexkv_py.index import Namespace
from flexkv_py.index.tier_names import Tier
from flexkv_py.tiers.host_pool import HostPool
from flexkv_py.tiers.protocol import LowerTier
from flexkv_py.tiers.ssd.tier import SsdTier

GIB = 1 << 30
SLOT = 8192
SLOTS = 8
NS = Namespace(
    "test/deletes",
    revision="r1",
    kv_dtype="float16",
    kv_layout="NHD",
    block_size=16,
    page_bytes=SLOT,
)


def _config(tmp_path: Path) -> FlexKVConfig:
    (tmp_path / "ssd").mkdir(exist_ok=True)
    return load_config(
        {
            "cpu_cache_gb": SLOTS * SLOT / GIB,
            "ssd_cache_gb": 64 * (SLOT + 4096) / GIB,
            "ssd_cache_dir": str(tmp_path / "ssd"),
        },
        env={},
    )


def _executor(cfg: FlexKVConfig) -> JobExecutor:
    pool = HostPool(SLOTS, SLOT, pin=False)
    tiers: dict[Tier, LowerTier] = {Tier.SSD: SsdTier(cfg, NS)}
    return JobExecutor(cfg, NS, pool, options=ExecutorOptions(tiers=tiers), owns=(pool,))


@pytest.fixture
def ex(tmp_path: Path) -> Iterator[JobExecutor]:
    ex = _executor(_config(tmp_path))
    yield ex
    assert ex.shutdown(timeout=30)


def _keys(n: int, tag: str) -> tuple[bytes, ...]:
    return tuple(NS.keys([f"{tag}-{i}".encode().ljust(32, b".") for i in range(n)]))


def _fill(ex: JobExecutor, keys: tuple[bytes, ...]) -> tuple[int, ...]:
    """Each key's page in host slots 0.. (the slots, in order)."""
    slots = tuple(range(len(keys)))
    for s, key in zip(slots, keys, strict=True):
        ex.pool.tensor[s].numpy()[:] = memoryview(block(key, SLOT))  # type: ignore[attr-defined]
    return slots


def _run(ex: JobExecutor, job: Any) -> Any:
    result = ex.submit(job).wait(timeout=30)
    assert ex.wait([job.job_id]) == [result]
    return result


def _write(ex: JobExecutor, job_id: int, keys: tuple[bytes, ...]) -> None:
    slots = _fill(ex, keys)
    assert _run(ex, LegJob(job_id, (Leg(Blocks(keys), Host(slots), OnTier(Tier.SSD)),))).ok
    assert all(ex.tiers[Tier.SSD].contains(k) for k in keys)


def test_a_leg_job_writes_blocks_to_the_ssd_then_deletes_them(ex: JobExecutor) -> None:
    keys = _keys(3, "legs")
    slots = _fill(ex, keys)
    ssd = OnTier(Tier.SSD)
    assert isinstance(ex.handlers.handler_for(deletion(keys, Tier.SSD)), TierDelete)
    job = LegJob(1, (Leg(Blocks(keys), Host(slots), ssd), Leg(Blocks(keys), ssd, Gone())))
    result = _run(ex, job)
    assert result.ok and result.nbytes == 3 * SLOT  # a delete moves no bytes
    assert not any(ex.tiers[Tier.SSD].contains(k) for k in keys)
    stats = ex.stats()
    assert stats["ssd_write_blocks"] == 3 and stats["ssd_deleted_blocks"] == 3


def test_a_drop_jobs_keyed_delete_removes_the_blocks(ex: JobExecutor) -> None:
    keys = _keys(4, "drop")
    _write(ex, 1, keys)
    job = DropJob(2, Drops.of({Tier.SSD: keys[:2]}))
    assert job.legs == (deletion(keys[:2], Tier.SSD),) and job.keys == keys[:2]
    assert pickle.loads(pickle.dumps(job)) == job  # plain data: it crosses processes
    result = _run(ex, job)
    assert result.ok and result.kind == "drop" and result.dropped == {}  # keys: nothing to name
    assert sorted(ex.stored_keys()) == sorted(keys[2:])
    # A lookup on the tier misses the deleted blocks; the others still read.
    load = _run(ex, load_job(3, keys, None, (4, 5, 6, 7), (Tier.SSD,) * 4))
    assert load.failed == dict.fromkeys(keys[:2], NOT_FOUND)
    assert ex.stats()["ssd_deleted_blocks"] == 2


class Recording:
    """A stand-in deletion handler: the legs it was given, deleting nothing."""

    def __init__(self) -> None:
        self.legs: list[Leg] = []

    def move(self, leg: Leg) -> Moved:
        self.legs.append(leg)
        return Moved()


def test_drop_jobs_and_drop_first_delete_through_the_registry(ex: JobExecutor) -> None:
    keys = _keys(3, "reg")
    _write(ex, 1, keys)
    recording = Recording()
    ex.handlers.register(OnTier, Gone, recording)
    _run(ex, DropJob(2, Drops.of({Tier.SSD: keys[:1], Tier.OBJECT: keys[1:2]})))
    store = store_job(3, Blocks(()), None, (), (), drop_first=Drops.of({Tier.SSD: keys[2:]}))
    assert _run(ex, store).ok
    assert recording.legs == [
        deletion(keys[:1], Tier.SSD),
        deletion(keys[1:2], Tier.OBJECT),
        deletion(keys[2:], Tier.SSD),
    ]
    assert all(ex.tiers[Tier.SSD].contains(k) for k in keys)  # the stand-in deleted nothing


def test_a_refused_delete_is_counted_not_raised(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = _config(tmp_path)
    keys = _keys(3, "refused")
    ex = _executor(cfg)
    _write(ex, 1, keys)
    assert ex.shutdown(timeout=30)
    monkeypatch.setenv("FLEXKV_FAULT_INJECTION", "journal:EIO:1")  # every journal write fails
    ex = _executor(cfg)  # the blocks come back from the store's journal
    try:
        ssd = ex.tiers[Tier.SSD]
        assert all(ssd.contains(k) for k in keys)
        dropped = _run(ex, DropJob(2, Drops.of({Tier.SSD: keys[:1]})))
        moved = _run(ex, LegJob(3, (deletion(keys[1:], Tier.SSD),)))
        assert dropped.ok and moved.ok  # neither raised nor failed a block
        assert ex.stats()["ssd_delete_errors"] == 2  # one per refused batch
        # A refusal stops none of the batch's other keys: each is gone from the store.
        assert not any(ssd.contains(k) for k in keys)
    finally:
        with contextlib.suppress(FlexKVError):  # nor can its clean-shutdown record be written
            ex.shutdown(timeout=30)


def test_drops_hold_only_deletion_legs_one_per_tier() -> None:
    keys = _keys(2, "shape")
    with pytest.raises(ValueError, match="not a lower tier -> Gone"):
        Drops((Leg(Blocks(keys), OnTier(Tier.SSD), Host((0, 1))),))
    with pytest.raises(ValueError, match="two keyed deletes on one tier"):
        Drops((deletion(keys[:1], Tier.SSD), deletion(keys[1:], Tier.SSD)))
    drops = Drops.of({Tier.SSD: keys, Tier.OBJECT: ()}, {Tier.SSD: b"\0" * 8})
    assert drops.legs == (deletion(keys, Tier.SSD),)  # a tier with no keys gets no leg
    assert drops.keys_on(Tier.SSD) == keys and drops.keys_on(Tier.OBJECT) == ()
    assert bool(drops) and not Drops.of({Tier.SSD: ()})
