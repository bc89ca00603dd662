"""A load of more lower-tier blocks than it gets host staging slots (coordinator/loads.py,
`_plan_load`): a GPU load streams through the slots in rounds (staged_load.py `load_rounds`,
job_bodies.py `JobBodies.load`: round r reads each slot's (r+1)-th use, copies it to the GPU, and
only then are the slots reused); a host-only `load_pages` loads in several jobs instead.

`load_rounds` is tested on hand-built jobs; the rest over a real engine (manager, executor, a
real SSD tier in tmp_path, CPU "GPU" tensors), with every block compared bit for bit. The GPU
loads' host->GPU copies run late, as on a busy GPU stream (`LateCopies`, around the real
transfer engine): a round that reused a slot before the copy out of it ran would show up as a
wrong block, on any machine, not only when the timing happens to expose it."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.coordinator_util import _config, _engine, _keys, _ns, _pages
from helpers.store_util import DATA_FILE, PAGE, flip_byte, stored_blocks
from hypothesis import given
from hypothesis import strategies as st

from flexkv_py.coordinator import CacheEngine, JobResult, LoadJob
from flexkv_py.coordinator.host_side import build_host_side
from flexkv_py.coordinator.jobs import CORRUPT, NOT_FOUND, load_job
from flexkv_py.coordinator.legs import Host, Leg, OnTier
from flexkv_py.coordinator.staged_load import load_rounds
from flexkv_py.index import Namespace
from flexkv_py.index.tier_names import Tier
from flexkv_py.transfer import describe_kv_caches
from flexkv_py.transfer.stream_order import TransferHandleLike

WAIT_S = 30.0  # bound on waiting for a job: only a hang reaches it
HOST_SLOTS = 4
N = 12  # blocks per load: 3 rounds through HOST_SLOTS staging slots
POISON = -7.0


# ---------------------------------------------------------------- load_rounds, by hand
def _check_rounds(job: LoadJob) -> list[list[tuple[Leg, list[int]]]]:
    """`load_rounds(job)`, checked against what the body relies on; returns it."""
    rounds = load_rounds(job)
    keys, slots = job.keys, job.host.slots
    reads = zip(job.reads, job.read_positions, strict=True)
    read_tier = {i: leg.tier for leg, at in reads for i in at}
    seen: list[int] = []
    for r, part in enumerate(rounds):
        assert part, f"round {r} is empty"
        in_round: list[int] = []
        tiers = [leg.tier for leg, _ in part]
        assert len(set(tiers)) == len(tiers), "one read per tier and round"
        # Tiers in the job's read order (fastest first), as the executor reads them.
        order = [leg.tier for leg in job.reads]
        assert tiers == sorted(tiers, key=order.index)
        for leg, at in part:
            assert leg.kinds == (OnTier, Host)
            assert at == sorted(at), "job order within a read"
            assert leg.keys == tuple(keys[i] for i in at)
            assert leg.dst.places() == tuple(slots[i] for i in at)
            assert all(read_tier[i] is leg.tier for i in at)
            in_round += at
        used = [slots[i] for i in in_round]
        assert len(set(used)) == len(used), f"a slot twice in round {r}"
        seen += in_round
    # The rounds partition the job's reads.
    assert sorted(seen) == sorted(read_tier) and len(seen) == len(read_tier)
    # Round r holds each slot's (r+1)-th use, in job order.
    round_of = {i: r for r, part in enumerate(rounds) for _, at in part for i in at}
    for slot in {slots[i] for i in read_tier}:
        uses = sorted(i for i in read_tier if slots[i] == slot)
        assert [round_of[i] for i in uses] == list(range(len(uses)))
    return rounds


def _hand_keys(n: int) -> list[bytes]:
    return [f"hand-{i}".encode().ljust(40, b".") for i in range(n)]


def test_load_rounds_of_a_load_reusing_its_staging_slots() -> None:
    # Blocks 0 and 4 are in host memory (slots 20, 21), block 7 is missing; seven SSD blocks
    # stream through slots 10..12 in the order the planner hands them out (slot j mod 3).
    host, ssd = Tier.HOST, Tier.SSD
    sources: list[Tier | None] = [host, ssd, ssd, ssd, host, ssd, ssd, None, ssd, ssd]
    slots = [20, 10, 11, 12, 21, 10, 11, -1, 12, 10]
    keys = _hand_keys(len(slots))
    job = load_job(1, keys, list(range(len(slots))), slots, sources)
    rounds = _check_rounds(job)
    assert [[at for _, at in part] for part in rounds] == [[[1, 2, 3]], [[5, 6, 8]], [[9]]]
    assert [[leg.dst.places() for leg, _ in part] for part in rounds] == [
        [(10, 11, 12)],
        [(10, 11, 12)],
        [(10,)],
    ]


def test_load_rounds_over_two_tiers_sharing_staging_slots() -> None:
    # SSD and object blocks stream through the same two slots: a round holds each slot's
    # (r+1)-th use over both tiers, in job order, and reads the SSD first.
    ssd, obj = Tier.SSD, Tier.OBJECT
    sources: list[Tier | None] = [obj, ssd, ssd, obj, obj, ssd]
    slots = [5, 6, 5, 6, 5, 6]
    job = load_job(2, _hand_keys(6), None, slots, sources)
    rounds = _check_rounds(job)
    assert [[(leg.tier, at) for leg, at in part] for part in rounds] == [
        [(ssd, [1]), (obj, [0])],
        [(ssd, [2]), (obj, [3])],
        [(ssd, [5]), (obj, [4])],
    ]


def test_load_rounds_of_a_load_with_no_slot_reused_is_its_reads() -> None:
    sources: list[Tier | None] = [Tier.HOST, Tier.SSD, Tier.OBJECT, Tier.SSD, None]
    job = load_job(3, _hand_keys(5), None, [0, 1, 2, 3, -1], sources)
    rounds = _check_rounds(job)
    assert len(rounds) == 1
    assert [leg for leg, _ in rounds[0]] == list(job.reads)
    all_host = load_job(4, _hand_keys(3), [0, 1, 2], [0, 1, 2], None)
    assert load_rounds(all_host) == []


@dataclass(frozen=True)
class _Planned:
    sources: list[Tier | None]
    slots: list[int]


@st.composite
def _planned_loads(draw: st.DrawFn) -> _Planned:
    """Loads as `_plan_load` builds them: host blocks in slots of their own, lower-tier blocks
    (SSD or object) through `n` staging slots in turn, missing blocks in none."""
    kinds = draw(st.lists(st.sampled_from(["host", "ssd", "object", "missing"]), max_size=40))
    n = draw(st.integers(1, 6))
    staging = draw(st.permutations(range(100, 100 + n)))
    sources: list[Tier | None] = []
    slots: list[int] = []
    j = 0
    for i, kind in enumerate(kinds):
        if kind == "missing":
            sources.append(None)
            slots.append(-1)
        elif kind == "host":
            sources.append(Tier.HOST)
            slots.append(i)
        else:
            sources.append(Tier.SSD if kind == "ssd" else Tier.OBJECT)
            slots.append(staging[j % n])
            j += 1
    return _Planned(sources, slots)


@given(_planned_loads())
def test_load_rounds_partition_the_reads_in_job_order(planned: _Planned) -> None:
    n = len(planned.slots)
    job = load_job(5, _hand_keys(n), list(range(n)), planned.slots, planned.sources)
    rounds = _check_rounds(job)
    lower = (Tier.SSD, Tier.OBJECT)
    staged = [s for s, t in zip(planned.slots, planned.sources, strict=True) if t in lower]
    uses = max((staged.count(s) for s in set(staged)), default=0)
    assert len(rounds) == uses  # as many rounds as the busiest slot has uses


# ---------------------------------------------------------------- a GPU load in rounds
def _caches(num_blocks: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(23)
    return {
        f"layers.{i}": torch.randn((2, num_blocks, 16, 2, 64), generator=gen).to(torch.float16)
        for i in range(3)
    }


def _bits(caches: dict[str, torch.Tensor], block: int) -> list[torch.Tensor]:
    return [t[:, block].view(torch.int16).clone() for t in caches.values()]


class _LateCopy:
    """A host->GPU copy a busy GPU stream has not run yet: it reads its host slots only when
    someone waits for it (or asks whether it is done)."""

    def __init__(self, issue: Callable[[], TransferHandleLike]) -> None:
        self._issue: Callable[[], TransferHandleLike] | None = issue
        self._lock = threading.Lock()

    def _run(self) -> None:
        with self._lock:
            if self._issue is not None:
                self._issue().wait(WAIT_S)
                self._issue = None

    def done(self) -> bool:
        self._run()
        return True

    def wait(self, timeout: float | None = None) -> None:
        self._run()


class LateCopies:
    """The real transfer engine, its host->GPU copies run late (`_LateCopy`): a load that reused
    a staging slot before waiting for the copy out of it would copy the wrong block."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.late = 0

    def submit_d2h(self, gpu_block_ids: Sequence[int], host_slots: Sequence[int]) -> Any:
        return self.engine.submit_d2h(gpu_block_ids, host_slots)

    def submit_h2d(self, host_slots: Sequence[int], gpu_block_ids: Sequence[int]) -> _LateCopy:
        slots, ids = list(host_slots), list(gpu_block_ids)
        self.late += 1
        return _LateCopy(lambda: self.engine.submit_h2d(slots, ids))

    def close(self) -> None:
        self.engine.close()


@dataclass
class _Gpu:
    """An engine over a real SSD tier and HOST_SLOTS host slots, with N blocks stored from GPU
    blocks `src` and then pushed out of host memory (they are on the SSD only)."""

    eng: CacheEngine
    transfer: LateCopies
    caches: dict[str, torch.Tensor]
    ns: Namespace
    keys: list[bytes]
    src: list[int]
    dst: list[int]
    want: list[list[torch.Tensor]]  # per key, its GPU block's bits when stored

    def poison(self) -> None:
        for t in self.caches.values():
            t[:, self.dst] = POISON

    def arrived(self, i: int) -> bool:
        got = _bits(self.caches, self.dst[i])
        return all(torch.equal(a, b) for a, b in zip(got, self.want[i], strict=True))

    def untouched(self, i: int) -> bool:
        return all(bool((t[:, self.dst[i]] == POISON).all()) for t in self.caches.values())

    def manager_stats(self) -> dict[str, Any]:
        return self.eng.manager.stats()

    def push_out(self, tag: str) -> None:
        """Other blocks take every host slot: the N blocks are on the SSD only."""
        fillers = _keys(self.ns, HOST_SLOTS, tag)
        gpu = list(range(3 * N, 3 * N + HOST_SLOTS))
        assert self.eng.store(fillers, gpu, parent=None).ok
        self.eng.flush()
        assert self.eng.manager.index.match(self.keys) == [Tier.SSD] * N


@pytest.fixture
def gpu(tmp_path: Path) -> Iterator[_Gpu]:
    caches = _caches(3 * N + HOST_SLOTS)  # N sources, 2 x N destinations, the fillers'
    geom = describe_kv_caches(caches)
    ns = _ns(kv_layout=geom.layout, page_bytes=geom.page_nbytes)
    cfg = _config(tmp_path, HOST_SLOTS, 64, slot=geom.slot_nbytes, admission="write_through")
    keys = _keys(ns, N)
    src, dst = list(range(N)), list(range(N, 2 * N))
    pool, engine = build_host_side(cfg, ns, caches)
    transfer = LateCopies(engine)
    # No free-slot reserve: what a load promotes stays in host memory until a job evicts it.
    with CacheEngine(cfg, ns, pool, transfer, owns=(transfer, pool), free_target=0) as eng:
        assert eng.store(keys, src).ok
        g = _Gpu(eng, transfer, caches, ns, keys, src, dst, [_bits(caches, b) for b in src])
        g.push_out("filler-")
        assert all(eng.executor.tiers[Tier.SSD].contains(k) for k in keys)
        yield g


def _no_pins_left(g: _Gpu) -> None:
    s = g.manager_stats()
    assert s["index_pinned"] == 0 and s["index_host_filling"] == 0, s
    assert s["inflight_jobs"] == 0
    assert s["index_free_slots"] + s["index_host_ready"] == HOST_SLOTS


def _run(g: _Gpu, job: LoadJob) -> JobResult:
    """Run a job the manager planned and apply its result, as the engine does."""
    result = g.eng.executor.submit(job).wait(WAIT_S)
    assert g.eng.executor.wait([job.job_id]) == [result]
    g.eng.manager.complete(result)
    return result


def test_a_gpu_load_streams_through_fewer_slots_in_rounds_bit_exact(gpu: _Gpu) -> None:
    g = gpu
    g.poison()
    job = g.eng.manager.prepare_load(g.keys, g.dst)
    assert job is not None and job.sources == (Tier.SSD,) * N
    staging = set(job.host.slots)
    assert len(staging) == HOST_SLOTS  # every host slot, each used N / HOST_SLOTS times
    rounds = load_rounds(job)
    assert [[at for _, at in part] for part in rounds] == [
        [list(range(r * HOST_SLOTS, (r + 1) * HOST_SLOTS))] for r in range(N // HOST_SLOTS)
    ]
    before, copies = g.eng.executor.stats(), g.transfer.late
    result = _run(g, job)
    assert result.failed == {} and result.failed_gpu_block_ids == frozenset()
    assert all(g.arrived(i) for i in range(N)), "a block arrived with another block's bytes"
    after = g.eng.executor.stats()
    assert after["ssd_read_blocks"] - before.get("ssd_read_blocks", 0) == N
    assert after["h2d_blocks"] - before.get("h2d_blocks", 0) == N
    assert g.transfer.late - copies == len(rounds)  # a host->GPU copy per round
    s = g.manager_stats()
    assert s["load_streamed_blocks"] == N - HOST_SLOTS and s["load_ssd_blocks"] == N
    # Only each slot's last block stays in host memory (promoted); nothing stays pinned.
    assert g.eng.manager.index.match(g.keys[-HOST_SLOTS:]) == [Tier.HOST] * HOST_SLOTS
    kept = [g.eng.manager.index.entry(k) for k in g.keys[-HOST_SLOTS:]]
    assert {e.host_slot for e in kept if e is not None} == staging
    _no_pins_left(g)


def _corrupt(g: _Gpu, tmp_path: Path, key: bytes) -> None:
    shard = tmp_path / "ssd" / g.ns.shard_dir_name
    offset = stored_blocks(shard)[g.ns.storage_key(key)]
    flip_byte(shard / DATA_FILE, offset + PAGE + 123)  # first payload page


def test_a_failed_block_in_one_round_fails_alone_and_leaves_nothing_pinned(
    gpu: _Gpu, tmp_path: Path
) -> None:
    g = gpu
    # Block 1 is read in round 0 (corrupt on disk), block 6 in round 1 (corrupt), block 10
    # in the last round (deleted from the SSD: its slot was to keep it in host memory).
    bad = {1: CORRUPT, 6: CORRUPT, 10: NOT_FOUND}
    _corrupt(g, tmp_path, g.keys[1])
    _corrupt(g, tmp_path, g.keys[6])
    assert g.eng.executor.tiers[Tier.SSD].delete([g.keys[10]]) == 1
    g.poison()
    assert g.eng.lookup(g.keys) == N  # the index cannot know yet
    out = g.eng.load(g.keys, g.dst, timeout=WAIT_S)
    assert out.statuses == tuple(bad.get(i, "ok") for i in range(N))
    assert out.source_tiers == ("ssd",) * N
    for i in range(N):
        if i in bad:
            assert g.untouched(i), f"block {i} failed but its GPU block was written"
        else:
            assert g.arrived(i), f"block {i} did not arrive bit-exact"
    s = g.manager_stats()
    assert s["load_streamed_blocks"] == N - HOST_SLOTS  # it did load in rounds
    assert s["load_failed_blocks"] == len(bad) and s["load_ssd_blocks"] == N - len(bad)
    _no_pins_left(g)
    # The bad copies are forgotten; the failed last-round block did not stay in host memory.
    index = g.eng.manager.index
    assert [index.readable_on(g.keys[i], Tier.SSD) for i in bad] == [False] * len(bad)
    assert index.match(g.keys[8:]) == [Tier.HOST, Tier.HOST]  # 10 breaks the chain
    assert g.eng.manager.stats()["index_host_ready"] == HOST_SLOTS - 1
    # Stored again (and pushed out of host memory again), every block loads bit-exact, in
    # rounds again.
    redo = sorted(bad)
    assert g.eng.store([g.keys[i] for i in redo], [g.src[i] for i in redo]).ok
    g.push_out("again-")
    assert g.eng.lookup(g.keys) == N
    g.dst = list(range(2 * N, 3 * N))
    g.poison()
    assert g.eng.load(g.keys, g.dst, timeout=WAIT_S).ok
    assert all(g.arrived(i) for i in range(N))
    assert g.manager_stats()["load_streamed_blocks"] == 2 * (N - HOST_SLOTS)
    _no_pins_left(g)


# ---------------------------------------------------------------- a host-only load in jobs
def _load_jobs(eng: CacheEngine) -> tuple[list[LoadJob], Callable[[], None]]:
    """Record the load jobs the engine submits (the executor itself runs them)."""
    jobs: list[LoadJob] = []
    real = eng.executor.submit

    def submit(job: Any, *a: Any, **kw: Any) -> Any:
        if isinstance(job, LoadJob):
            jobs.append(job)
        return real(job, *a, **kw)

    eng.executor.submit = submit  # type: ignore[method-assign]

    def restore() -> None:
        eng.executor.submit = real  # type: ignore[method-assign]

    return jobs, restore


def _push_out(eng: CacheEngine, ns: Namespace, keys: list[bytes], tag: str) -> None:
    """Other blocks take every host slot: `keys` are on the SSD only."""
    fillers = _keys(ns, HOST_SLOTS, tag)
    assert eng.store_pages(fillers, _pages(fillers)).ok
    eng.flush()
    assert eng.manager.index.match(keys) == [Tier.SSD] * len(keys)


def _host_only(tmp_path: Path) -> tuple[CacheEngine, list[bytes], list[bytes], Namespace]:
    ns = _ns()
    cfg = _config(tmp_path, HOST_SLOTS, 64, admission="write_through")
    eng = _engine(cfg, ns, HOST_SLOTS, free_target=0)
    keys = _keys(ns, N)
    pages = _pages(keys)
    assert eng.store_pages(keys, pages).ok
    _push_out(eng, ns, keys, "filler-")
    return eng, keys, pages, ns


def test_a_host_only_load_of_more_blocks_than_slots_loads_in_jobs_bit_exact(
    tmp_path: Path,
) -> None:
    eng, keys, pages, _ = _host_only(tmp_path)
    with eng:
        jobs, restore = _load_jobs(eng)
        got = eng.load_pages(keys, timeout=WAIT_S)
        restore()
        assert got == pages
        # Each job reads into slots of its own (the caller reads them after the job): no
        # slot reused within a job, so several jobs, in the request's order.
        assert len(jobs) == N // HOST_SLOTS
        assert [k for j in jobs for k in j.keys] == keys
        for j in jobs:
            assert len(set(j.host.slots)) == len(j.keys) and len(load_rounds(j)) == 1
        s = eng.manager.stats()
        assert s["load_ssd_blocks"] == N and s.get("load_failed_blocks", 0) == 0
        assert s["index_pinned"] == 0 and s["index_host_filling"] == 0


def test_a_host_only_load_in_jobs_fails_only_the_bad_block(tmp_path: Path) -> None:
    eng, keys, pages, ns = _host_only(tmp_path)
    with eng:
        shard = tmp_path / "ssd" / ns.shard_dir_name
        flip_byte(shard / DATA_FILE, stored_blocks(shard)[ns.storage_key(keys[5])] + PAGE + 9)
        got = eng.load_pages(keys, timeout=WAIT_S)
        assert got == [None if i == 5 else p for i, p in enumerate(pages)]
        s = eng.manager.stats()
        assert s["load_failed_blocks"] == 1 and s["load_ssd_blocks"] == N - 1
        assert s["index_pinned"] == 0 and s["index_host_filling"] == 0
        assert eng.lookup(keys) == 5  # the bad copy is forgotten
        assert eng.store_pages(keys[5:6], pages[5:6]).ok
        _push_out(eng, ns, keys, "again-")
        assert eng.lookup(keys) == N
        assert eng.load_pages(keys, timeout=WAIT_S) == pages
