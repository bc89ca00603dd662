"""Write-behind (coordinator/write_behind.py): with an SSD tier and the DEFAULT configuration,
host blocks reach the SSD in the background, so a restart (or a kill -9, minus the lag) is warm;
the write keeps the host copy readable and pinned, waits for idle workers within its rate, and
never delays a load."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.coordinator_util import PAGE_BYTES, _config, _engine, _keys, _ns, _pages
from helpers.writers import TESTS_DIR, argv
from helpers.writers.write_behind_writer import BLOCKS, HOST_SLOTS, SSD_SLOTS

from flexkv_py import _native
from flexkv_py.coordinator import CacheManager, JobResult, SpillJob
from flexkv_py.index import Tier

MARGIN_S = 10.0  # scheduling noise on a busy 2-core test machine; a stuck write is 30 s
LAG_S = 2.0  # the default write_behind_lag_s
# The kill test's margin: the child's write-behind thread competes with the whole suite for
# two cores in CI, where 3 s of scheduling noise was once exceeded.
KILL_MARGIN_S = 10.0


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _manager(tmp_path: Path, slots: int = 32, **kw: object) -> tuple[CacheManager, _Clock]:
    mgr = CacheManager(_config(tmp_path, slots, 256, **kw), _ns(), PAGE_BYTES, free_target=0)
    clock = _Clock()
    writer = mgr.spill_writer  # a job writes at most slots // 8 blocks
    assert writer is not None, "write-behind is on by default with an SSD tier"
    wb = writer.queue
    wb.clock = clock
    wb._last = clock.now
    return mgr, clock


def _stored(mgr: CacheManager, keys: list[bytes]) -> None:
    job = mgr.prepare_store(keys, None)
    assert job is not None
    mgr.complete(JobResult(job.job_id, "store"))


def test_write_behind_keeps_the_host_copy_readable_and_pinned(tmp_path: Path) -> None:
    mgr, _ = _manager(tmp_path)
    keys = _keys(mgr.namespace, 4)
    _stored(mgr, keys)
    (job,) = mgr.take_jobs()
    assert isinstance(job, SpillJob) and job.keys == tuple(keys) and job.tier is Tier.SSD
    assert mgr.index.match(keys) == [Tier.HOST] * 4  # still read from host
    assert mgr.index.begin_evict() is None  # pinned: never evicted, its slot never reused
    assert mgr.take_jobs() == []  # one write-behind at a time
    mgr.complete(JobResult(job.job_id, "spill"))
    assert all(mgr.index.readable_on(k, Tier.SSD) for k in keys)
    assert mgr.index.match(keys) == [Tier.HOST] * 4  # the host copy stays
    v = mgr.index.begin_evict()
    assert v is not None and v.lower == {Tier.SSD}  # evictable again, with no spill needed
    stats = mgr.stats()
    assert stats["write_behind_blocks"] == 4 and stats["write_behind_pending_blocks"] == 0


def test_write_behind_waits_for_idle_workers_unless_the_lag_is_due(tmp_path: Path) -> None:
    mgr, clock = _manager(tmp_path)
    keys = _keys(mgr.namespace, 6)
    _stored(mgr, keys[:2])
    load = mgr.prepare_load(keys[:1], None)  # a load in flight: the workers are busy
    assert load is not None
    assert mgr.take_jobs() == []
    clock.now += LAG_S  # the oldest block has waited the whole lag: written even now
    (job,) = mgr.take_jobs()
    assert isinstance(job, SpillJob) and set(job.keys) == set(keys[:2])
    mgr.complete(JobResult(job.job_id, "spill"))
    mgr.complete(JobResult(load.job_id, "load"))
    _stored(mgr, keys[2:])
    (job,) = mgr.take_jobs()  # idle: at once
    assert set(job.keys) == set(keys[2:])


def test_write_behind_rate_limit(tmp_path: Path) -> None:
    # 1 MiB/s of 16 KiB blocks: 64 blocks/s, bursts of 16 (0.25 s of rate).
    mgr, clock = _manager(tmp_path, slots=256, write_behind_mib_s=1)
    keys = _keys(mgr.namespace, 40)
    _stored(mgr, keys)
    written: list[bytes] = []

    def step() -> int:
        jobs = mgr.take_jobs()
        for job in jobs:
            written.extend(job.keys)
            mgr.complete(JobResult(job.job_id, "spill"))
        return sum(len(j.keys) for j in jobs)

    assert step() == 16  # the burst
    assert step() == 0  # the bucket is empty
    clock.now += 0.125
    assert step() == 8
    clock.now += 10
    assert step() == 16  # never more than a burst at once
    assert written == keys[:40] and step() == 0  # store order: a chain's head first


def test_restart_in_a_new_process_with_the_default_config_hits(tmp_path: Path) -> None:
    out = subprocess.run(
        argv("write_behind_writer", str(tmp_path), "once"),
        cwd=TESTS_DIR,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and "DONE" in out.stdout, out.stderr
    ns = _ns()
    keys = _keys(ns, BLOCKS, "wb")
    with _engine(_config(tmp_path, HOST_SLOTS, SSD_SLOTS), ns, HOST_SLOTS) as eng:
        assert eng.lookup(keys) == BLOCKS  # the host tier's blocks had reached the SSD
        assert eng.load_pages(keys) == _pages(keys)


def test_kill_9_loses_at_most_the_lag_and_no_acknowledged_block(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        argv("write_behind_writer", str(tmp_path), "forever"),
        stdout=subprocess.PIPE,
        text=True,
        cwd=TESTS_DIR,
    )
    assert proc.stdout is not None
    stored_at: dict[int, float] = {}  # when the parent read it (never before it was stored)
    acked: set[int] = set()
    started = None
    try:
        for line in proc.stdout:
            word, *rest = line.split()
            now = time.monotonic()
            if word == "READY":
                started = now
            elif word == "STORED":
                stored_at[int(rest[0])] = now
            elif word == "ACK":
                acked.add(int(rest[0]))
            ran_s = now - started if started is not None else 0.0
            if ran_s > LAG_S + KILL_MARGIN_S + 2 and len(acked) >= 40:
                break
        killed_at = time.monotonic()
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(30)
    ns = _ns()
    keys = _keys(ns, max(stored_at) + 1, "wb")
    with _engine(_config(tmp_path, HOST_SLOTS, SSD_SLOTS), ns, HOST_SLOTS) as eng:
        present = {i for i in stored_at if eng.lookup([keys[i]]) == 1}
        missing_acked = sorted(acked - present)
        assert not missing_acked, missing_acked  # every acknowledged SSD copy survives
        old = {i for i, t in stored_at.items() if t < killed_at - LAG_S - KILL_MARGIN_S}
        assert old and old <= present, sorted(old - present)  # at most the lag is missing
        some = sorted(present)[:8]
        assert eng.load_pages([keys[i] for i in some]) == _pages([keys[i] for i in some])


@pytest.fixture
def _delays() -> Iterator[None]:
    _native.set_fault_delays(True)
    yield
    _native.set_fault_delays(True)


@pytest.mark.usefixtures("_delays")
def test_a_stuck_write_behind_never_delays_a_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = _config(tmp_path, 16, 64, ssd_io_timeout_s=30.0)
    ns = _ns()
    new, more = _keys(ns, 4, "new"), _keys(ns, 4, "more")
    monkeypatch.setenv("FLEXKV_FAULT_INJECTION", "write:DELAY30000:1")  # every write stuck
    with _engine(cfg, ns, 16) as eng:
        assert eng.store_pages(new, _pages(new)).ok
        eng.lookup([])  # the write-behind of `new` starts and sticks on the slow device
        assert eng.manager.stats()["write_behind_inflight_jobs"] == 1
        started = time.monotonic()
        assert eng.load_pages(new) == _pages(new)  # host copies, beside their stuck write
        assert eng.store_pages(more, _pages(more)).ok  # the next step's store too
        assert eng.load_pages(more) == _pages(more)
        assert time.monotonic() - started < MARGIN_S
        _native.set_fault_delays(False)  # the device is fast again: the write completes


def test_evicted_blocks_leave_the_write_behind_queue(tmp_path: Path) -> None:
    mgr, _ = _manager(tmp_path, slots=4)
    keys = _keys(mgr.namespace, 8)
    _stored(mgr, keys[:4])
    assert mgr.stats()["write_behind_pending_blocks"] == 4
    _stored(mgr, keys[4:])  # evicts the first four (spilled inside the job)
    assert mgr.stats()["write_behind_pending_blocks"] == 4  # only the ones still in host
    assert all(mgr.index.readable_on(k, Tier.SSD) for k in keys[:4])


@pytest.mark.usefixtures("_delays")
def test_an_ssd_read_never_waits_behind_a_stuck_write_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The device queue pushes reads first and never blocks on a slow write's completion
    (rust/io/queue.rs): a load from the SSD is served while write-behind sticks on the device."""
    cfg = _config(tmp_path, 16, 64, ssd_io_timeout_s=30.0)
    ns = _ns()
    old, new = _keys(ns, 4, "old"), _keys(ns, 4, "new")
    with _engine(cfg, ns, 16) as eng:
        assert eng.store_pages(old, _pages(old)).ok  # closing writes them to the SSD
    monkeypatch.setenv("FLEXKV_FAULT_INJECTION", "write:DELAY30000:1")  # every write stuck
    with _engine(cfg, ns, 16) as eng:
        assert eng.manager.index.match(old) == [Tier.SSD] * 4  # adopted, on the SSD only
        assert eng.store_pages(new, _pages(new)).ok
        eng.lookup([])  # the write-behind of `new` starts and sticks on the slow device
        assert eng.manager.stats()["write_behind_inflight_jobs"] == 1
        started = time.monotonic()
        assert eng.load_pages(old) == _pages(old)  # read from the SSD beside the stuck write
        assert time.monotonic() - started < MARGIN_S
        _native.set_fault_delays(False)  # the device is fast again: the write completes
