"""Soak through vLLM's real scheduler.

Hundreds of requests (helpers/load_workload.py: shared prefixes, multi-turn follow-ups; each half's
first turns arrive in a burst) go through vLLM 0.33's scheduler with a small GPU pool
(preemption), a token budget below the longest prompts (chunked prefill), a small host tier and a
write-through SSD tier (blocks spill and come back), while every CPU core runs a busy process.
Half the first turns run on one engine whose SSD writes are slow (every Nth held for a while);
the engine then restarts on the same SSD directory and the other half runs with failing SSD reads
(loads fail, vLLM recomputes), including conversations of the first half coming back (they hit
what the first engine stored). The baseline (plain vLLM) runs before the hog starts: its step
count does not depend on the machine.

It passes when
  - every request finishes with the tokens the same workload gets without the connector, and the
    KV of every loaded block is bit-exact (FakeModel checks each position it reads);
  - the run takes at most 2x the engine steps of the same workload without the connector. Steps
    are those that scheduled tokens: a step that schedules nothing while transfers are in flight
    costs no forward, and the harness spins those in a tight loop, so their count measures the
    wall time of the transfers on this machine, not the engine's work. Waiting is bounded apart:
    nothing may be scheduled for at most STALL_S (several SSD I/O timeouts; a stall fails there,
    naming the stuck requests);
  - no GPU blocks, requests or connector host slots are left once the engine is idle;
  - RSS grows by at most 2 % over the second half: from the restarted engine's start (the first
    half warmed up the process) to its end, both read after a garbage collection at rest;
  - the injected faults happened (failed loads reported to vLLM; the slow writes were waited
    for), and loads came from both the host tier and the SSD.

CI runs the small setting; `SOAK_SCALE=large` runs the large one by hand (not FLEXKV_*: the tests'
conftest clears those). Record large runs with their printed summary (`pytest -s`).
"""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from helpers import vllm_harness as vh
from helpers.load_workload import RunStats, Workload, drive

from flexkv_py.coordinator.job_bodies import JobBodies
from flexkv_py.index.tier_names import Tier

SCALE = os.environ.get("SOAK_SCALE", "small")


@dataclass(frozen=True)
class Setting:
    requests: int  # first turns per half (follow-ups and returning turns come on top)
    seed: int


SETTINGS = {"small": Setting(requests=80, seed=22), "large": Setting(requests=400, seed=23)}

NUM_BLOCKS = 16  # GPU blocks of 32 tokens: a few requests at a time, so vLLM preempts
BLOCK_SIZE = 32
HOST_GB = 0.0005  # ~60 host slots of 8 KiB: most blocks spill to the SSD and come back from it
SLOW_WRITE_S = 1.0  # below the I/O timeout: a slow disk, not a failing one
SLOW_WRITES = f"write:DELAY{int(SLOW_WRITE_S * 1000)}:8"  # first engine: every 8th SSD write
FAILED_READS = "read:EIO:5"  # restarted engine: every 5th SSD read fails
IO_TIMEOUT_S = 5.0  # ssd_io_timeout_s (the default): the longest one SSD batch may take
STALL_S = 6 * IO_TIMEOUT_S  # nothing scheduled for this long: a stall, not a slow device
STEP_FACTOR = 2
RSS_GROWTH = 0.02


def rss_bytes() -> int:
    """This process's resident set, after a collection (garbage is not growth)."""
    gc.collect()
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@contextmanager
def cpu_hog() -> Iterator[list[subprocess.Popen[bytes]]]:
    """One busy process per CPU core for the duration (the engine competes for every core)."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for _ in range(os.cpu_count() or 1):
            procs.append(subprocess.Popen([sys.executable, "-c", "while True: pass"]))
        yield procs
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


def workloads(
    setting: Setting, model_dir: str
) -> tuple[Workload, Workload, list[RunStats], dict[str, list[int]]]:
    """The two halves (the second brings back half the first's conversations), the steps each
    takes without the connector (plain vLLM, same GPU pool, a fresh engine for each half as the
    restart gives the connector run) and every request's output tokens there."""
    n, spread = setting.requests, 30  # a burst, as the reported load test: a long queue at once
    first = Workload(seed=setting.seed, requests=n, spread_steps=spread)
    outputs: dict[str, list[int]] = {}

    def plain(w: Workload) -> RunStats:
        e = vh.Engine(
            model_dir, None, num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE, disable_hma=True
        )
        stats = drive(e, w, 10**6, histories=True)
        assert not e.mismatches()
        outputs.update(e.outputs)
        e.shutdown()
        return stats

    a = plain(first)
    back = dict(sorted(a.histories.items())[::2])
    second = Workload(setting.seed, n, spread_steps=spread, first=n, returning=back)
    return first, second, [a, plain(second)], outputs


@contextmanager
def timed_ssd_writes() -> Iterator[list[float]]:
    """Seconds of every SSD write batch the workers wait for (shows the held writes)."""
    real = JobBodies.tier_batch
    seconds: list[float] = []

    def timed(self: JobBodies, tier: Tier, put: bool, *args: Any, **kw: Any) -> Any:
        t0 = time.monotonic()
        try:
            return real(self, tier, put, *args, **kw)
        finally:
            if put and tier is Tier.SSD:
                seconds.append(time.monotonic() - t0)

    JobBodies.tier_batch = timed  # type: ignore[method-assign]
    try:
        yield seconds
    finally:
        JobBodies.tier_batch = real  # type: ignore[method-assign]


def flexkv_engine(model_dir: str, ssd: Path) -> vh.Engine:
    extra = vh.with_ssd(ssd, cpu_cache_gb=HOST_GB, ssd_io_timeout_s=IO_TIMEOUT_S)
    return vh.Engine(
        model_dir,
        vh.connector_transfer_config(extra),
        num_blocks=NUM_BLOCKS,
        block_size=BLOCK_SIZE,
        disable_hma=True,
    )


def assert_no_slot_leaks(e: vh.Engine) -> None:
    """No connector job in flight and every host slot either free or holding a ready block."""
    for side in e.flexkv_scheduler_sides():
        st = side._mgr.stats()
        assert st["inflight_jobs"] == 0, st
        held = {k: st[f"index_{k}"] for k in ("pinned", "evicting", "releasing", "host_filling")}
        assert not any(held.values()), held
        assert st["index_host_ready"] + st["index_free_slots"] == st["host_slots"], st
    for w in e.workers:
        assert w.connector.worker_side.executor.stats()["pending_jobs"] == 0


def connector_state(e: vh.Engine) -> dict[str, Any]:
    """What a stall report needs: the jobs the scheduler side waits for, both sides' counters."""
    (side,) = e.flexkv_scheduler_sides()
    jobs = {i: (j.kind, j.req_id, len(j.keys), len(j.results)) for i, j in side._jobs.items()}
    workers = [w.connector.worker_side.executor.stats() for w in e.workers]
    return {
        "jobs (kind, request, blocks, results)": jobs,
        "manager": side._mgr.stats(),
        **{f"worker{i}": st for i, st in enumerate(workers)},
    }


def run_half(e: vh.Engine, w: Workload, max_busy: int, what: str) -> RunStats:
    """Drive one half to the end and drain the connector's stores; blocks and slots checked."""
    try:
        stats = drive(e, w, 10**9, max_idle_s=STALL_S, keep_records=False, max_busy_steps=max_busy)
        e.run(timeout_s=STALL_S)  # the stores still writing through
    except AssertionError as exc:
        raise AssertionError(f"{what}: {exc}\nconnector: {connector_state(e)}") from exc
    vh.assert_no_leaks(e)
    assert_no_slot_leaks(e)
    return stats


def test_soak(model_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    setting = SETTINGS[SCALE]
    t0 = time.monotonic()
    first, second, base, expected = workloads(setting, model_dir)
    # Steps that scheduled tokens on both sides (plain vLLM idles only before an arrival).
    base_steps = sum(s.busy_steps for s in base)
    max_busy = STEP_FACTOR * base_steps
    ssd = tmp_path / "ssd"
    t1 = time.monotonic()
    with cpu_hog() as hogs, timed_ssd_writes() as writes:
        # The store reads the fault plan when it opens: each engine gets its own.
        monkeypatch.setenv("FLEXKV_FAULT_INJECTION", SLOW_WRITES)
        e = flexkv_engine(model_dir, ssd)
        a = run_half(e, first, max_busy, f"{setting}, first half ({SLOW_WRITES})")
        assert not e.mismatches(), e.mismatches()[:5]
        outputs = dict(e.outputs)
        slowest_write = max(writes, default=0.0)
        e.shutdown()

        monkeypatch.setenv("FLEXKV_FAULT_INJECTION", FAILED_READS)
        e = flexkv_engine(model_dir, ssd)  # adopts the SSD inventory (waits for the workers)
        (side,) = e.flexkv_scheduler_sides()
        adopted = side._mgr.stats().get("ssd_adopted_blocks", 0)
        rss_mid = rss_bytes()
        b = run_half(
            e, second, max_busy - a.busy_steps, f"{setting}, after the restart ({FAILED_READS})"
        )
        rss_end = rss_bytes()
        assert not e.mismatches(), e.mismatches()[:5]
        outputs.update(e.outputs)
        checked = sum(sum(w.model.checked.values()) for w in e.workers)
        e.shutdown()
        assert all(p.poll() is None for p in hogs), "a CPU hog exited before the end"

    busy = a.busy_steps + b.busy_steps
    growth = (rss_end - rss_mid) / rss_mid
    summary = {
        "scale": SCALE,
        "requests": a.requests + b.requests,
        "baseline_steps": base_steps,
        "busy_steps": busy,
        "idle_steps": a.steps + b.steps - busy,
        "longest_idle_s": round(max(a.longest_idle_s, b.longest_idle_s), 2),
        "preemptions": (a.preemptions, b.preemptions),
        "baseline_preemptions": tuple(s.preemptions for s in base),
        "chunks": (a.chunks, b.chunks),
        "followups": (a.followups, b.followups),
        "adopted_blocks": adopted,
        "positions_checked_after_restart": checked,
        "slowest_ssd_write_s": round(slowest_write, 2),
        "invalid_blocks": b.invalid_blocks,
        "rss_mid_mib": round(rss_mid / 2**20, 1),
        "rss_end_mib": round(rss_end / 2**20, 1),
        "rss_growth_pct": round(100 * growth, 3),
        "connector_first": {k: round(v, 2) for k, v in a.connector.items()},
        "connector_second": {k: round(v, 2) for k, v in b.connector.items()},
        "baseline_s": round(t1 - t0, 1),
        "soak_s": (round(a.seconds, 1), round(b.seconds, 1), round(time.monotonic() - t1, 1)),
    }
    print("soak:", summary)

    # The scenario is what it says: preemption, chunked prefill, reuse, loads from both tiers.
    assert a.preemptions > 0 and b.preemptions > 0, summary
    assert a.chunks > 0 and b.chunks > 0, summary
    assert a.followups > 0 and b.followups > 0, summary
    assert adopted > 0, "the restarted engine adopted nothing from the SSD"
    for half in (a, b):
        assert half.connector.get("hit_blocks_host", 0) > 0, summary
        assert half.connector.get("hit_blocks_ssd", 0) > 0, summary
    assert checked > 0  # loaded KV was read, and checked position by position
    # The faults happened: a write was held, failed loads were reported to vLLM (recomputed).
    assert slowest_write >= 0.9 * SLOW_WRITE_S, summary
    assert b.connector.get("load_failed_blocks", 0) > 0, summary
    assert b.invalid_blocks > 0, summary
    # Every request produced what it produces without the connector.
    assert outputs == expected
    assert busy <= max_busy, summary
    assert growth <= RSS_GROWTH, summary
