"""A host load run in parts (engine.py pipeline_parts, loads.py prepare_load_part): each part is
pinned only when it is prepared, bit-exact, and a miss or a lower-tier block ends the parts:
the rest of the load is one job, as a load in one job would be."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.coordinator_util import _config, _keys, _ns

from flexkv_py.coordinator import CacheEngine, JobResult
from flexkv_py.coordinator.engine import pipeline_parts
from flexkv_py.transfer import describe_kv_caches
from unit.coordinator.test_coordinator import _vllm_caches


def test_parts_pin_as_they_go_and_a_miss_ends_the_load_there(tmp_path: Path) -> None:
    n, gap = 300, 150  # keys[gap] is never stored: the load stops there, as one job would
    caches = _vllm_caches("LBNHC", num_blocks=2 * n + 2)
    geom = describe_kv_caches(caches)
    ns = _ns(page_bytes=geom.page_nbytes)
    keys = _keys(ns, n)
    src, dst = list(range(n)), list(range(n + 1, 2 * n + 1))
    before = {name: t.clone() for name, t in caches.items()}
    cfg = _config(tmp_path, 2 * n, slot=geom.slot_nbytes)
    with CacheEngine.from_kv_caches(cfg, ns, caches) as eng:
        assert eng.store(keys, src).ok
        (_, first_end), *_ = pipeline_parts(n)
        mgr = eng.manager
        job = mgr.prepare_load_part(keys, dst, first_end)
        assert job is not None and job.keys == tuple(keys[:first_end])
        pins = [mgr.index.entry(k) for k in keys]
        assert [e is not None and e.pins for e in pins] == [1] * first_end + [0] * (n - first_end)
        mgr.complete(JobResult(job.job_id, "load"))
        assert all(e is not None and e.pins == 0 for e in map(mgr.index.entry, keys))

        out = eng.load(keys, dst)
        assert out.statuses == ("ok",) * n and out.source_tiers == ("host",) * n
        for name, t in caches.items():
            assert torch.equal(t[dst].view(torch.int16), before[name][src].view(torch.int16))

        other = _keys(ns, n, "gap-")
        assert eng.store(other[:gap], src[:gap]).ok
        assert eng.store(other[gap + 1 :], src[gap + 1 :], parent=None).ok  # a chain of its own
        assert eng.lookup(other) == gap
        out = eng.load(other, dst)
        assert out.statuses[:gap] == ("ok",) * gap
        assert set(out.statuses[gap:]) == {"missing"} and len(out.statuses) == n
        assert out.source_tiers == ("host",) * gap + ("none",) * (n - gap)
        # Nothing stays pinned: the blocks after the miss were never pinned or were released.
        assert all(e is None or e.pins == 0 for e in map(mgr.index.entry, other))
        assert eng.stats()["manager"]["load_missing_blocks"] == n - gap


def test_an_error_preparing_a_part_leaves_the_part_before_applied(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    n = 300
    caches = _vllm_caches("LBNHC", num_blocks=2 * n + 2)
    geom = describe_kv_caches(caches)
    ns = _ns(page_bytes=geom.page_nbytes)
    keys = _keys(ns, n)
    src, dst = list(range(n)), list(range(n + 1, 2 * n + 1))
    with CacheEngine.from_kv_caches(
        _config(tmp_path, 2 * n, slot=geom.slot_nbytes), ns, caches
    ) as eng:
        assert eng.store(keys, src).ok
        mgr = eng.manager
        real, calls = mgr.prepare_load_part, []

        def second_part_fails(*args: Any, **kw: Any) -> Any:
            calls.append(args)
            if len(calls) == 2:
                raise RuntimeError("planning failed")
            return real(*args, **kw)

        monkeypatch.setattr(mgr, "prepare_load_part", second_part_fails)
        with pytest.raises(RuntimeError, match="planning failed"):
            eng.load(keys, dst)
        assert len(calls) == 2
        # The first part's job ran and was applied: no block stays pinned.
        assert all(e is not None and e.pins == 0 for e in map(mgr.index.entry, keys))
        monkeypatch.setattr(mgr, "prepare_load_part", real)
        assert eng.load(keys, dst).ok


def test_host_parts_are_issued_and_completed_in_the_callers_thread(tmp_path: Path) -> None:
    """executor.submit(here=True), as CacheEngine.load submits a part from host memory: the
    copies are issued in the caller's thread and the caller that waits runs the completion;
    with no one waiting, the load thread completes the job (poll returns it)."""
    import threading
    import time

    n = 300
    caches = _vllm_caches("LBNHC", num_blocks=2 * n + 2)
    geom = describe_kv_caches(caches)
    ns = _ns(page_bytes=geom.page_nbytes)
    keys = _keys(ns, n)
    src, dst = list(range(n)), list(range(n + 1, 2 * n + 1))
    cfg = _config(tmp_path, 2 * n, slot=geom.slot_nbytes)
    with CacheEngine.from_kv_caches(cfg, ns, caches) as eng:
        assert eng.store(keys, src).ok
        bodies = eng.executor._bodies
        real_load = bodies.load
        threads: list[str] = []

        def load(*a: Any, **k: Any) -> Any:
            threads.append(threading.current_thread().name)
            return real_load(*a, **k)

        bodies.load = load  # type: ignore[method-assign]
        # CPU copies are done at once, so a free load thread could take a part's completion
        # before the caller waits for it (the design's "no one waiting" case). Keep the load
        # threads busy during the load, as they are while a GPU's copies run.
        release = threading.Event()
        pool = eng.executor._load_threads
        busy = [pool.submit(release.wait, 30) for _ in range(pool._max_workers)]
        try:
            out = eng.load(keys, dst)
        finally:
            release.set()
            for f in busy:
                f.result(30)
        assert out.ok and set(out.source_tiers) == {"host"}
        assert len(threads) == len(pipeline_parts(n)) > 1
        assert set(threads) == {threading.current_thread().name}
        for name, t in caches.items():
            assert torch.equal(t[dst], t[src]), name
        # No waiter: the load thread completes it.
        job = eng.manager.prepare_load(keys[:10], dst[:10])
        assert job is not None
        eng.executor.submit(job, here=True)
        results: list[JobResult] = []
        deadline = time.monotonic() + 10
        while not results and time.monotonic() < deadline:
            results = eng.executor.poll()
            time.sleep(0.01)
        assert [r.job_id for r in results] == [job.job_id] and not results[0].failed
        assert threads[-1] != threading.current_thread().name
        eng.manager.complete(results[0])
