"""A store frees its request's GPU blocks once its GPU->host copy is done, not its SSD write.

With admission=write_through a store job copies GPU blocks to host slots and then writes them to
SSD; only the copy reads GPU memory. These tests hold the SSD writes back deterministically (a
threading.Event gate around each rank's SSD tier `submit_put`, which the job threads block in)
and, where needed, the GPU->host copies (a task waiting on an Event queued ahead of them on the
CPU transfer engine's single d2h thread). Real parts throughout: vLLM 0.33's Scheduler and
output aggregation (vllm_harness), the coordinator, the host pool, the native SSD store.
"""

from __future__ import annotations

import logging
import pickle
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import vllm_harness as vh
from vllm.v1.request import RequestStatus

from flexkv_py.config import load_config
from flexkv_py.coordinator import ExecutorOptions, JobExecutor, store_job
from flexkv_py.coordinator.jobs import WRITE_SSD, load_job
from flexkv_py.coordinator.legs import Blocks
from flexkv_py.index import Namespace
from flexkv_py.index.tier_names import Tier
from flexkv_py.integration.vllm import worker_side
from flexkv_py.integration.vllm.metadata import FlexKVWorkerMetadata
from flexkv_py.transfer import describe_kv_caches

# Every test runs with the built-in connector name and with kv_connector_module_path.
pytestmark = pytest.mark.usefixtures("connector_form")

BS = 16
GATE_S = 60.0  # a safety bound only: every test opens its gates itself
WORKER_LOG = "flexkv_py.integration.vllm.worker_side"


class SsdGate:
    """Holds every SSD write of the given executors until `open()`: the job thread that writes
    blocks in `submit_put`. `passed` counts writes that reached the store."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, executors: Iterable[Any]) -> None:
        self._opened = threading.Event()
        self._lock = threading.Lock()
        self.passed = 0
        for ex in executors:
            assert Tier.SSD in ex.tiers
            monkeypatch.setattr(
                ex.tiers[Tier.SSD], "submit_put", self._gated(ex.tiers[Tier.SSD].submit_put)
            )

    def _gated(self, real: Callable[..., Any]) -> Callable[..., Any]:
        def submit_put(items: Any, **extras: Any) -> Any:  # parents= / metas= (block metadata)
            if not self._opened.wait(GATE_S):
                raise RuntimeError("SSD gate never opened")
            handle = real(items, **extras)
            with self._lock:
                self.passed += 1
            return handle

        return submit_put

    def open(self) -> None:
        self._opened.set()


def _hold_d2h(executor: Any) -> threading.Event:
    """Every GPU->host copy this executor issues from now on waits until the gate is set."""
    gate = threading.Event()
    executor.transfer._executors["d2h"].submit(gate.wait)
    return gate


def _engine(model_dir: str, extra: dict[str, Any], **kw: Any) -> vh.Engine:
    return vh.Engine(model_dir, vh.connector_transfer_config(extra), **kw)


def _workers(e: vh.Engine) -> list[Any]:
    return [w.connector.worker_side for w in e.workers]


def _block_bits(e: vh.Engine, block_ids: Iterable[int], rank: int = 0) -> list[torch.Tensor]:
    return [t for b in block_ids for t in e.workers[rank].model.block_bits(b)]


def _same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _freed(e: vh.Engine, req_id: str) -> bool:
    return any(req_id in rec.finished_sending for rec in e.history)


def _loaded(e: vh.Engine, req_id: str) -> bool:
    return any(req_id in rec.finished_recving for rec in e.history)


def _prompt_done(req: Any) -> Callable[[], bool]:
    return lambda: (
        req.status == RequestStatus.RUNNING and req.num_computed_tokens >= len(req.prompt_token_ids)
    )


def _mgr_stats(e: vh.Engine) -> dict[str, Any]:
    return e.connector.scheduler_side._mgr.stats()  # type: ignore[no-any-return]


def _store_jobs_in_flight(e: vh.Engine, req_id: str) -> list[int]:
    jobs = e.connector.scheduler_side._jobs
    return [j for j, info in jobs.items() if info.kind == "store" and info.req_id == req_id]


def _held_blocks(e: vh.Engine, req_id: str) -> bool:
    mgr = e.scheduler.kv_cache_manager
    return any(req_id in m.req_to_blocks for m in mgr.coordinator.single_type_managers)


def _load_and_compare(
    e: vh.Engine, req_id: str, prompt: list[int], want: list[list[torch.Tensor]]
) -> None:
    """A new request with `prompt` loads its prefix from FlexKV, bit-exact on every rank."""
    req = e.add(vh.make_request(req_id, prompt, max_tokens=2))
    e.run_until(_prompt_done(req))
    assert _loaded(e, req_id), f"{req_id} did not load from FlexKV"
    ids = e.scheduler.kv_cache_manager.get_block_ids(req_id)[0][: len(prompt) // BS]
    for rank, bits in enumerate(want):
        assert _same(_block_bits(e, ids, rank), bits), f"{req_id}: rank {rank} KV differs"
    e.run()
    assert not e.mismatches()


def test_worker_metadata_counts_gpu_reads_per_rank_and_pickles() -> None:
    r0 = FlexKVWorkerMetadata(gpu_read_done={7: 1, 8: 1})
    r1 = pickle.loads(pickle.dumps(FlexKVWorkerMetadata(gpu_read_done={7: 1})))
    assert not r1.is_empty()
    both = r0.aggregate(r1)
    assert isinstance(both, FlexKVWorkerMetadata) and both.gpu_read_done == {7: 2, 8: 1}
    assert pickle.loads(pickle.dumps(both)).gpu_read_done == {7: 2, 8: 1}
    assert r0.gpu_read_done == {7: 1, 8: 1}  # aggregate does not mutate its inputs


# ---------------------------------------------------------------- executor
def test_executor_reports_the_copy_before_the_ssd_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """poll_gpu_reads names a store once its copy is done; its SSD write is still held. More
    gated stores than job threads: the copies are seen through their transfer handles."""
    gen = torch.Generator().manual_seed(3)
    caches = {
        f"layers.{i}": torch.randn((2, 16, 16, 2, 64), generator=gen).to(torch.float16)
        for i in range(2)
    }
    geom = describe_kv_caches(caches)
    ns = Namespace("m", "r", "float16", geom.layout, 16, page_bytes=geom.page_nbytes)
    (tmp_path / "ssd").mkdir()
    cfg = load_config(
        {
            "cpu_cache_gb": 16 * geom.slot_nbytes / (1 << 30),
            "ssd_cache_gb": 64 * (geom.slot_nbytes + 4096) / (1 << 30),
            "ssd_cache_dir": str(tmp_path / "ssd"),
        },
        env={},
    )
    ex = JobExecutor.from_kv_caches(cfg, ns, caches, options=ExecutorOptions(max_workers=2))
    before = [[t[:, b].clone() for t in caches.values()] for b in range(6)]
    ssd = SsdGate(monkeypatch, [ex])
    keys = ns.keys([f"k{i}".encode().ljust(32, b".") for i in range(6)])
    d2h = _hold_d2h(ex)
    try:
        for i in range(6):  # 6 stores, 2 job threads
            ex.submit(store_job(i + 1, Blocks((keys[i],)), (i,), (i,), (WRITE_SSD,)))
        with pytest.raises(TimeoutError):
            ex.wait_gpu_reads([1], timeout=0.05)  # the copy is held: this must give up
        assert ex.poll_gpu_reads() == []
        d2h.set()
        ex.wait_gpu_reads(range(1, 7), timeout=GATE_S)  # the SSD writes are still held
        assert ex.poll_gpu_reads() == [1, 2, 3, 4, 5, 6]
        assert ex.poll_gpu_reads() == []  # named once
        assert ex.poll() == [] and ex.pending() == 6 and ssd.passed == 0
        assert ex.abandon([1, 6]) == []  # copied: nothing left to distrust
        for t in caches.values():  # the blocks are reused: the stores must not care
            t[:, :6].fill_(-3.0)
    finally:
        d2h.set()
        ssd.open()
    results = ex.wait(range(1, 7), timeout=GATE_S)
    assert sorted(r.job_id for r in results) == [1, 2, 3, 4, 5, 6]
    assert all(r.ok and not r.write_failed for r in results)
    assert ssd.passed == 6 and ex.poll_gpu_reads() == []
    # What reached SSD is the KV copied before the reuse: load it into blocks 8.. and compare.
    for i, k in enumerate(keys):
        load = load_job(10 + i, (k,), (8 + i,), (6 + i,), (Tier.SSD,))
        assert ex.submit(load).wait(timeout=GATE_S).ok
        got = [t[:, 8 + i] for t in caches.values()]
        assert all(
            torch.equal(x.view(torch.int16), y.view(torch.int16))
            for x, y in zip(got, before[i], strict=True)
        )
    assert ex.shutdown(timeout=30)


# ---------------------------------------------------------------- vLLM, TP=1
def test_finished_request_is_freed_before_its_ssd_write(
    model_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    extra = vh.with_ssd(tmp_path / "ssd")
    e = _engine(model_dir, extra, num_blocks=9)  # 8 usable blocks
    (ws,) = _workers(e)
    ssd = SsdGate(monkeypatch, [ws.executor])
    d2h = _hold_d2h(ws.executor)  # A finishes while its copies are held: blocks kept
    prompt = vh.prompt_tokens(11, 4 * BS)
    try:
        a = e.add(vh.make_request("A", prompt, max_tokens=3))
        e.run_until(_prompt_done(a))
        a_blocks = list(e.scheduler.kv_cache_manager.get_block_ids("A")[0][:4])
        a_bits = _block_bits(e, a_blocks)
        e.run_until(a.is_finished)
        e.step()  # the delayed free reaches the worker; the copies are still held
        assert _held_blocks(e, "A") and not _freed(e, "A")
        d2h.set()
        e.run_until(lambda: _freed(e, "A"), timeout_s=30)
        # Freed, while none of its SSD writes got through and the manager still waits.
        assert not _held_blocks(e, "A")
        assert ssd.passed == 0
        assert _store_jobs_in_flight(e, "A") and _mgr_stats(e)["inflight_jobs"] > 0
        assert ws.executor.pending() > 0

        # Another request takes every block, A's included (its stores are held too).
        x = e.add(vh.make_request("X", vh.prompt_tokens(12, 8 * BS - 1), max_tokens=1))
        e.run_until(x.is_finished)  # X's forward wrote its KV
        per_block = len(a_bits) // len(a_blocks)
        for i, g in enumerate(a_blocks):
            old = a_bits[i * per_block : (i + 1) * per_block]
            assert not _same(_block_bits(e, [g]), old), f"X did not overwrite A's block {g}"
        assert ssd.passed == 0
    finally:
        d2h.set()
        ssd.open()
    e.run()
    assert ssd.passed > 0
    stats = _mgr_stats(e)
    assert stats["inflight_jobs"] == 0 and stats.get("store_failed_blocks", 0) == 0
    assert not e.mismatches()
    vh.assert_no_leaks(e)

    # A's KV, copied before its blocks were reused, is what the host tier serves...
    e.reset_gpu_prefix_cache()
    _load_and_compare(e, "B", prompt, [a_bits])
    assert e.outputs["B"][:2] == e.outputs["A"][:2]
    vh.assert_no_leaks(e)
    e.shutdown()

    # ... and what the SSD write (done after the reuse) holds: a restart loads it from SSD.
    e2 = _engine(model_dir, extra, num_blocks=9)
    _load_and_compare(e2, "C", prompt, [a_bits])
    vh.assert_no_leaks(e2)
    e2.shutdown()


# ---------------------------------------------------------------- vLLM, TP=2
def test_tp2_frees_only_when_both_ranks_copied(
    model_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    extra = vh.with_ssd(tmp_path / "ssd")
    e = _engine(model_dir, extra, tp_size=2)
    ws0, ws1 = _workers(e)
    ssd = SsdGate(monkeypatch, [ws0.executor, ws1.executor])
    sent0: list[set[str]] = []  # what rank 0 alone reports in finished_sending, per step
    real = ws0.get_finished

    def get_finished(finished: set[str]) -> tuple[set[str] | None, set[str] | None]:
        sending, recving = real(finished)
        sent0.append(set(sending or ()))
        return sending, recving

    monkeypatch.setattr(ws0, "get_finished", get_finished)
    d2h1 = _hold_d2h(ws1.executor)  # rank 1's copies are held; rank 0's run
    prompt = vh.prompt_tokens(21, 4 * BS)
    sched = e.connector.scheduler_side
    try:
        a = e.add(vh.make_request("A", prompt, max_tokens=4))
        e.run_until(_prompt_done(a))  # the prompt's store was submitted on both ranks
        bits = [
            _block_bits(e, e.scheduler.kv_cache_manager.get_block_ids("A")[0][:4], r)
            for r in (0, 1)
        ]
        (job,) = _store_jobs_in_flight(e, "A")
        ws0.executor.wait_gpu_reads([job], timeout=GATE_S)
        e.step()  # rank 0 reports its copy; rank 1 cannot
        assert sched._jobs[job].gpu_read_ranks == 1
        assert job in sched._reqs["A"].store_jobs  # one rank of two: still read
        # (A freed early would be a bug: stop there too, so the asserts below say so.)
        e.run_until(
            lambda: a.is_finished() and (any("A" in s for s in sent0) or not _held_blocks(e, "A")),
            timeout_s=30,
        )
        # Rank 0 is done with A's blocks, rank 1 is not: vLLM must keep them.
        assert _held_blocks(e, "A") and not _freed(e, "A")
        assert "A" in e.scheduler.requests
        d2h1.set()
        e.run_until(lambda: _freed(e, "A"), timeout_s=30)
        assert not _held_blocks(e, "A")
        assert ssd.passed == 0 and _store_jobs_in_flight(e, "A")  # SSD writes still held
        assert sched._jobs[job].gpu_read_ranks == 2 and "A" not in sched._reqs
    finally:
        d2h1.set()
        ssd.open()
    e.run()
    stats = _mgr_stats(e)
    assert stats["inflight_jobs"] == 0 and stats.get("store_failed_blocks", 0) == 0
    assert ssd.passed > 0
    vh.assert_no_leaks(e)
    e.reset_gpu_prefix_cache()
    _load_and_compare(e, "B", prompt, bits)
    vh.assert_no_leaks(e)
    assert not sched._jobs and not sched._reqs
    for ws in (ws0, ws1):
        assert not ws._inflight and not ws._req_stores and not ws._reads_unreported
    e.shutdown()


# ---------------------------------------------------------------- preemption
def test_preemption_flush_does_not_wait_for_ssd_writes(
    model_dir: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A flush that waited for the (held) SSD writes would time out and abandon the stores.
    monkeypatch.setattr(worker_side, "FLUSH_TIMEOUT_S", 30.0)
    extra = vh.with_ssd(tmp_path / "ssd")
    # As in test_vllm_flush_timeout: A decodes while B's 4-block prompt fills the cache, so
    # B is preempted and its blocks go to A in that very step.
    e = _engine(model_dir, extra, num_blocks=7)
    (ws,) = _workers(e)
    ssd = SsdGate(monkeypatch, [ws.executor])
    a_prompt, b_prompt = vh.prompt_tokens(1, 2 * BS - 1), vh.prompt_tokens(2, 4 * BS)
    try:
        a = e.add(vh.make_request("A", a_prompt, max_tokens=40))
        b = e.add(vh.make_request("B", b_prompt, max_tokens=8))
        with caplog.at_level(logging.ERROR, logger=WORKER_LOG):
            e.run_until(lambda: b.num_preemptions > 0, timeout_s=25)
        assert not [r for r in caplog.records if "abandoned" in r.getMessage()]
        assert ssd.passed == 0  # the flush went through with every SSD write held
        assert _store_jobs_in_flight(e, "B")
    finally:
        ssd.open()
    e.run()
    assert sum(s.get("flush_timeouts", 0) for s in e.stats) == 0
    stats = _mgr_stats(e)
    assert stats["inflight_jobs"] == 0 and stats.get("store_failed_blocks", 0) == 0
    assert a.num_preemptions == 0 and not e.mismatches()
    vh.assert_no_leaks(e)
    e.reset_gpu_prefix_cache()
    c = e.add(vh.make_request("C", b_prompt + vh.prompt_tokens(3, BS), max_tokens=2))
    e.run_until(_prompt_done(c))
    assert _loaded(e, "C")
    e.run()
    assert not e.mismatches()
    vh.assert_no_leaks(e)
    e.shutdown()
