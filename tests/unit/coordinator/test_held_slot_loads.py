"""Loads and host slots a late lower-tier read still holds (coordinator/late_io.py,
job_bodies.py `JobBodies._stage_round`): a read that timed out may still land in its slots, so
they stay fenced until it does; a load never reads into a fenced slot (its block fails as
io_timeout, the device is not asked for it), the load's other blocks still arrive bit-exact, and
once the late read lands the slots are free and the load succeeds again.

The executor, its job bodies and the SSD tier are real (tmp_path, CPU "GPU" tensors); the device
is made late by `SlowSsd`, which holds back the reads of chosen blocks (or all of them) until the
test lets them land: the real read into the batch's slots happens only then, as a late device's
would."""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.coordinator_util import _ns

from flexkv_py.config import load_config
from flexkv_py.coordinator import ExecutorOptions, JobExecutor, JobResult, store_job
from flexkv_py.coordinator.jobs import IO_TIMEOUT, WRITE_SSD, LoadJob, load_job
from flexkv_py.coordinator.legs import Blocks
from flexkv_py.coordinator.staged_load import load_rounds
from flexkv_py.index.tier_names import Tier
from flexkv_py.tiers.protocol import Item
from flexkv_py.tiers.ssd.tier import SsdTier
from flexkv_py.transfer import describe_kv_caches

TIMEOUT_S = 0.25  # ssd_io_timeout_s: a held read times out after this
WAIT_S = 30.0  # bound on waiting for what must complete: only a hang reaches it
SLOTS = 8
NUM_BLOCKS = 32
DST = 16  # GPU blocks DST.. are load destinations; 0.. hold what is stored
POISON = -5.0
SENTINEL = 0xA5  # what a host slot holds before a test's loads


class _Done:
    """A batch that completed while it was submitted."""

    def __init__(self, results: list[Any]) -> None:
        self._results = results

    def done(self) -> bool:
        return True

    def wait(self, timeout: float | None = None) -> list[Any]:
        return list(self._results)


class _Late:
    """A read the device has not done yet: it reads into its slots when the test `land`s it."""

    def __init__(self, ssd: SsdTier, items: list[Item]) -> None:
        self._ssd = ssd
        self._items = items
        self._landed = threading.Event()
        self._results: list[Any] = []

    def done(self) -> bool:
        return self._landed.is_set()

    def wait(self, timeout: float | None = None) -> list[Any]:
        if not self._landed.wait(timeout):
            raise TimeoutError("read not done")
        return list(self._results)

    def land(self) -> None:
        self._results = self._ssd.submit_get(self._items).wait(WAIT_S)
        self._landed.set()


class SlowSsd:
    """A `LowerTier`: the real SSD tier, whose reads of the blocks in `hold` (of every block,
    while `stuck`) are late (`_Late`); every other batch is done by the time it is submitted,
    so no timing decides a test. `gets`: the keys of every read submitted, in order."""

    stores_block_meta = True

    def __init__(self, ssd: SsdTier) -> None:
        self.ssd = ssd
        self.hold: set[bytes] = set()
        self.stuck = False
        self.gets: list[tuple[bytes, ...]] = []
        self.late: list[_Late] = []
        self._lock = threading.Lock()

    @property
    def name(self) -> Tier:
        return Tier.SSD

    def submit_put(
        self,
        items: Iterable[Item],
        parents: Sequence[bytes | None] | None = None,
        metas: Sequence[bytes | None] | None = None,
    ) -> _Done:
        return _Done(self.ssd.submit_put(items, parents=parents, metas=metas).wait(WAIT_S))

    def submit_get(self, items: Iterable[Item]) -> _Done | _Late:
        items = list(items)
        keys = tuple(k for k, _ in items)
        with self._lock:
            self.gets.append(keys)
            if self.stuck or self.hold.intersection(keys):
                late = _Late(self.ssd, items)
                self.late.append(late)
                return late
        return _Done(self.ssd.submit_get(items).wait(WAIT_S))

    def land_all(self) -> None:
        """The device catches up: every late read lands in its slots."""
        with self._lock:
            late, self.late = self.late, []
            self.hold.clear()
            self.stuck = False
        for batch in late:
            batch.land()

    def delete(self, keys: Iterable[bytes]) -> int:
        return self.ssd.delete(keys)

    def contains(self, key: bytes) -> bool:
        return self.ssd.contains(key)

    def drain_evicted(self) -> list[bytes]:
        return self.ssd.drain_evicted()

    def keys(self) -> list[bytes]:
        return self.ssd.keys()

    def stats(self) -> dict[str, int | float | str]:
        return self.ssd.stats()

    def close(self) -> None:
        self.ssd.close()


def _bits(caches: dict[str, torch.Tensor], block: int) -> list[torch.Tensor]:
    return [t[:, block].view(torch.int16).clone() for t in caches.values()]


@dataclass
class _Rig:
    """An executor over SLOTS host slots and a `SlowSsd` holding 2 x SLOTS blocks, stored from
    GPU blocks 0.. (key i from GPU block i)."""

    ex: JobExecutor
    ssd: SlowSsd
    caches: dict[str, torch.Tensor]
    keys: list[bytes]
    want: list[list[torch.Tensor]]
    next_id: int = 100

    def slot(self, slot: int) -> bytes:
        return bytes(self.ex.pool.tensor[slot].numpy().tobytes())  # type: ignore[attr-defined]

    def fill_slots(self) -> None:
        self.ex.pool.tensor.fill_(SENTINEL)  # type: ignore[attr-defined]

    def untouched_slot(self, slot: int) -> bool:
        return bool((self.ex.pool.tensor[slot] == SENTINEL).all())  # type: ignore[attr-defined]

    def load(self, blocks: Sequence[int], slots: Sequence[int]) -> tuple[LoadJob, JobResult]:
        """Load keys[b] for b in `blocks` from the SSD through `slots` into GPU blocks DST + b
        (poisoned first)."""
        dst = [DST + b for b in blocks]
        for t in self.caches.values():
            t[:, dst] = POISON
        self.next_id += 1
        job = load_job(
            self.next_id, [self.keys[b] for b in blocks], dst, slots, [Tier.SSD] * len(blocks)
        )
        result = self.ex.submit(job).wait(WAIT_S)
        assert self.ex.wait([job.job_id]) == [result]
        return job, result

    def arrived(self, b: int) -> bool:
        got = _bits(self.caches, DST + b)
        return all(torch.equal(x, y) for x, y in zip(got, self.want[b], strict=True))

    def untouched(self, b: int) -> bool:
        return all(bool((t[:, DST + b] == POISON).all()) for t in self.caches.values())

    def fenced(self) -> set[int]:
        return self.ex.late_io.fenced(range(SLOTS))


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[_Rig]:
    gen = torch.Generator().manual_seed(31)
    caches = {
        f"layers.{i}": torch.randn((2, NUM_BLOCKS, 16, 2, 64), generator=gen).to(torch.float16)
        for i in range(2)
    }
    geom = describe_kv_caches(caches)
    ns = _ns(kv_layout=geom.layout, page_bytes=geom.page_nbytes)
    (tmp_path / "ssd").mkdir()
    cfg = load_config(
        {
            "cpu_cache_gb": SLOTS * geom.slot_nbytes / (1 << 30),
            "ssd_cache_gb": 64 * (geom.slot_nbytes + 4096) / (1 << 30),
            "ssd_cache_dir": str(tmp_path / "ssd"),
            "ssd_io_timeout_s": TIMEOUT_S,
        },
        env={},
    )
    ssd = SlowSsd(SsdTier(cfg, ns))
    ex = JobExecutor.from_kv_caches(cfg, ns, caches, options=ExecutorOptions(tiers={Tier.SSD: ssd}))
    keys = ns.keys([f"held-{i}".encode().ljust(32, b".") for i in range(2 * SLOTS)])
    rig = _Rig(ex, ssd, caches, keys, [_bits(caches, b) for b in range(len(keys))])
    try:
        for part in (range(SLOTS), range(SLOTS, 2 * SLOTS)):
            store = store_job(
                len(part) + part[0],
                Blocks(tuple(keys[b] for b in part)),
                tuple(part),
                tuple(range(SLOTS)),
                (WRITE_SSD,) * SLOTS,
            )
            result = ex.submit(store).wait(WAIT_S)
            assert result.ok and not result.write_failed
        assert all(ssd.contains(k) for k in keys)
        ssd.gets.clear()
        rig.fill_slots()
        yield rig
    finally:
        ssd.land_all()  # no late read outlives the test: shutdown waits for them
        assert ex.shutdown(timeout=WAIT_S)


def test_a_load_does_not_read_into_slots_a_late_read_holds(rig: _Rig) -> None:
    r = rig
    k = r.keys
    r.ssd.hold = {k[0], k[1]}
    # Blocks 0 and 1 through slots 0 and 1: the device does not answer in time.
    _, result = r.load([0, 1], [0, 1])
    assert result.failed == {k[0]: IO_TIMEOUT, k[1]: IO_TIMEOUT}
    assert result.failed_gpu_block_ids == {DST + 0, DST + 1}
    assert r.untouched(0) and r.untouched(1)
    assert r.fenced() == {0, 1} and r.ex.stats()["ssd_fenced_slots"] == 2
    assert r.untouched_slot(0) and r.untouched_slot(1)  # the late read has not landed
    # The manager handed slots 0 and 1 out again: blocks 2 and 3 would be read into them.
    r.ssd.gets.clear()
    hits = r.ex.stats().get("fenced_slot_hits", 0)
    _, result = r.load([2, 3, 4, 5], [0, 1, 2, 3])
    assert result.failed == {k[2]: IO_TIMEOUT, k[3]: IO_TIMEOUT}
    assert result.failed_gpu_block_ids == {DST + 2, DST + 3}
    assert r.ssd.gets == [(k[4], k[5])], "the device was asked to read into a fenced slot"
    assert r.untouched_slot(0) and r.untouched_slot(1), "a fenced slot was read into"
    assert r.untouched(2) and r.untouched(3)
    assert r.arrived(4) and r.arrived(5)
    assert r.ex.stats().get("fenced_slot_hits", 0) - hits == 2
    # The device catches up: the late read lands in slots 0 and 1, and their fence goes.
    r.ssd.land_all()
    assert not r.untouched_slot(0) and not r.untouched_slot(1)
    landed = [r.slot(0), r.slot(1)]
    assert r.fenced() == set() and r.ex.late_io.pending() == 0
    assert r.ex.stats()["ssd_fenced_slots"] == 0
    # The same loads again: every block arrives, through the very same slots.
    _, result = r.load([2, 3, 4, 5], [0, 1, 2, 3])
    assert result.ok and all(r.arrived(b) for b in (2, 3, 4, 5))
    _, result = r.load([0, 1], [0, 1])
    assert result.ok and r.arrived(0) and r.arrived(1)
    assert [r.slot(0), r.slot(1)] == landed  # the late read had brought blocks 0 and 1


def test_a_load_in_rounds_does_not_read_into_slots_an_earlier_load_left_fenced(
    rig: _Rig,
) -> None:
    """A load streamed through 3 reused slots (6 blocks, 2 rounds) while slot 1 is fenced by an
    earlier load's late read: in each round the block staged through slot 1 fails unread, the
    others of both rounds arrive bit-exact."""
    r = rig
    k = r.keys
    r.ssd.hold = {k[8]}
    _, result = r.load([8], [1])
    assert result.failed == {k[8]: IO_TIMEOUT} and r.fenced() == {1}
    r.ssd.gets.clear()
    hits = r.ex.stats().get("fenced_slot_hits", 0)
    blocks, slots = [2, 3, 4, 5, 6, 7], [0, 1, 2, 0, 1, 2]
    job, result = r.load(blocks, slots)
    assert [[at for _, at in part] for part in load_rounds(job)] == [[[0, 1, 2]], [[3, 4, 5]]]
    assert result.failed == {k[3]: IO_TIMEOUT, k[6]: IO_TIMEOUT}
    assert result.failed_gpu_block_ids == {DST + 3, DST + 6}
    # One read per round, neither into slot 1.
    assert r.ssd.gets == [(k[2], k[4]), (k[5], k[7])], "a fenced slot was read into"
    assert r.ex.stats().get("fenced_slot_hits", 0) - hits == 2
    assert r.untouched_slot(1) and r.untouched(3) and r.untouched(6)
    assert all(r.arrived(b) for b in (2, 4, 5, 7))
    r.ssd.land_all()
    assert r.fenced() == set() and not r.untouched_slot(1)
    _, result = r.load(blocks, slots)
    assert result.ok and all(r.arrived(b) for b in blocks)


def test_a_stuck_device_is_not_asked_again_by_a_later_round_of_the_load(rig: _Rig) -> None:
    """A load in 2 rounds (4 slots, 8 blocks, a sub-batch each, one in flight) on a device
    that answers nothing: once a read timed out the device is stuck for the rest of the load
    (late_io.py), so the later round submits nothing either: one timeout for the load, not
    one per round, and no slot of a block that was never read stays fenced."""
    r = rig
    k = r.keys
    bodies = r.ex._bodies
    bodies.read_batch_bytes = r.ex.pool.slot_nbytes
    bodies.reads_in_flight = 1
    r.ssd.stuck = True
    blocks, slots = list(range(8)), [0, 1, 2, 3] * 2
    job, result = r.load(blocks, slots)
    assert len(load_rounds(job)) == 2
    assert result.failed == dict.fromkeys(k[:8], IO_TIMEOUT)
    assert all(r.untouched(b) for b in blocks)
    assert r.ssd.gets == [(k[0],)], "a later round asked the stuck device again"
    stats = r.ex.stats()
    # Block 0 timed out; block 4 is staged through its fenced slot; the rest were skipped.
    assert stats["ssd_io_timeouts"] == 1 and stats["ssd_read_skipped_blocks"] == 6
    assert stats["fenced_slot_hits"] == 1
    assert r.fenced() == {0}
    assert all(r.untouched_slot(s) for s in range(SLOTS))
    r.ssd.land_all()
    assert r.fenced() == set()
    _, result = r.load(blocks, slots)
    assert result.ok and all(r.arrived(b) for b in blocks)
