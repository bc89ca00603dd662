"""Bounded waits and degraded modes: a slow SSD (the fault injector's DELAY mode) turns into
io_timeout failures within ssd_io_timeout_s, never a hung load or store, and never wrong bytes
(host slots a late I/O may touch stay fenced); an SSD directory that cannot be opened at start
leaves the worker serving from the host tier with a loud error and the `ssd_unavailable` stat."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import vllm_harness as vh
from helpers.coordinator_util import _config, _engine, _keys, _ns, _pages
from helpers.store_util import DATA_FILE, PAGE, flip_byte, stored_blocks
from vllm.v1.request import RequestStatus

from flexkv_py import BlockStore, _native
from flexkv_py.config import load_config
from flexkv_py.coordinator import ExecutorOptions, JobExecutor, store_job
from flexkv_py.coordinator.job_bodies import JobBodies
from flexkv_py.coordinator.jobs import WRITE_NONE, WRITE_SSD, load_job
from flexkv_py.coordinator.legs import Blocks
from flexkv_py.index import Namespace
from flexkv_py.index.tier_names import Tier
from flexkv_py.tiers.ssd.tier import SsdTier
from flexkv_py.transfer import describe_kv_caches

TIMEOUT_S = 0.3
# Scheduling noise on a busy 2-core CI machine: a bound of TIMEOUT_S + MARGIN_S still tells a
# timeout from a wait on the device, which takes 10x longer (tests release it at once).
MARGIN_S = 5.0
WAIT_S = 30.0  # bound on waiting for what must complete: only a hang reaches it
SLOW_MS = 60_000
BS = 16


@pytest.fixture(autouse=True)
def _delays_back_on() -> Iterator[None]:
    """The delay switch is process-wide: every test starts and ends with delays enabled."""
    _native.set_fault_delays(True)
    yield
    _native.set_fault_delays(True)


def _until(cond: Any, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


def test_slow_ssd_load_times_out_then_loads_bit_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The short timeout only where the device is slowed: the setup and restart engines write
    # and read a real (maybe busy) disk, where 0.3 s could pass without any fault.
    cfg = _config(tmp_path, 8, 64, admission="write_through")
    slow_cfg = _config(tmp_path, 8, 64, admission="write_through", ssd_io_timeout_s=TIMEOUT_S)
    ns = _ns()
    keys = _keys(ns, 4)
    pages = _pages(keys)
    with _engine(cfg, ns, 8) as eng:
        assert eng.store_pages(keys, pages).ok
    monkeypatch.setenv("FLEXKV_FAULT_INJECTION", f"read:DELAY{SLOW_MS}:1")
    with _engine(slow_cfg, ns, 8) as eng:
        assert eng.lookup(keys) == 4  # adopted from SSD, not in host memory
        started = time.monotonic()
        out = eng.submit_load(keys, None).result()
        assert time.monotonic() - started < TIMEOUT_S + MARGIN_S
        assert out.statuses == ("io_timeout",) * 4
        stats = eng.stats()["executor"]
        assert stats["ssd_io_timeouts"] == 1 and stats["ssd_io_timeout_blocks"] == 4
        assert stats["ssd_fenced_slots"] == 4  # the late reads may still land there
        # Not promised again while the device is stuck (no loop of load errors): recompute.
        assert eng.lookup(keys) == 0
        # Host-only stores meanwhile work; those landing on fenced slots fail, never copy.
        statuses = eng.store_pages(keys, pages).statuses
        assert set(statuses) <= {"ok", "io_timeout"}
        assert [p for p, s in zip(eng.load_pages(keys), statuses, strict=True) if s == "ok"] == [
            p for p, s in zip(pages, statuses, strict=True) if s == "ok"
        ]
        _native.set_fault_delays(False)  # the device is fast again
        _until(lambda: eng.stats()["executor"]["ssd_fenced_slots"] == 0)
        assert eng.store_pages(keys, pages).ok  # the recomputed blocks
        assert eng.load_pages(keys) == pages  # bit-exact, never the late reads' leftovers
    # The SSD copies were never harmed: a restart on a fast device loads them bit-exact.
    monkeypatch.delenv("FLEXKV_FAULT_INJECTION")
    with _engine(cfg, ns, 8) as eng:
        assert eng.lookup(keys) == 4
        assert eng.load_pages(keys) == pages


def _caches(num_blocks: int = 8) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    return {
        f"layers.{i}": torch.randn((2, num_blocks, 16, 2, 64), generator=gen).to(torch.float16)
        for i in range(2)
    }


def _executor_on_a_slow_ssd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, io_timeout_s: float
) -> tuple[dict[str, torch.Tensor], JobExecutor, list[bytes]]:
    """Two job threads over a host tier of 8 slots and an SSD whose every write takes SLOW_MS;
    returns the KV caches, the executor and three keys."""
    caches = _caches()
    geom = describe_kv_caches(caches)
    ns = Namespace("m", "r", "float16", geom.layout, 16, page_bytes=geom.page_nbytes)
    (tmp_path / "ssd").mkdir()
    cfg = load_config(
        {
            "cpu_cache_gb": 8 * geom.slot_nbytes / (1 << 30),
            "ssd_cache_gb": 64 * (geom.slot_nbytes + 4096) / (1 << 30),
            "ssd_cache_dir": str(tmp_path / "ssd"),
            "ssd_io_timeout_s": io_timeout_s,
        },
        env={},
    )
    monkeypatch.setenv("FLEXKV_FAULT_INJECTION", f"write:DELAY{SLOW_MS}:1")
    ex = JobExecutor.from_kv_caches(cfg, ns, caches, options=ExecutorOptions(max_workers=2))
    return caches, ex, ns.keys([f"k{i}".encode().ljust(32, b".") for i in range(3)])


def test_store_through_slow_ssd_never_blocks_the_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    caches, ex, keys = _executor_on_a_slow_ssd(tmp_path, monkeypatch, TIMEOUT_S)
    started = time.monotonic()
    ex.submit(store_job(1, Blocks((keys[0],)), (0,), (0,), (WRITE_SSD,)))
    ex.wait_gpu_reads([1], timeout=WAIT_S)  # the copy is done while the write is stuck
    assert ex.poll_gpu_reads() == [1]
    (res,) = ex.wait([1], timeout=WAIT_S)
    assert time.monotonic() - started < TIMEOUT_S + MARGIN_S
    assert res.ok and res.write_failed_on(Tier.SSD) == {
        keys[0]
    }  # host copy fine, SSD copy not committed
    assert ex.stats()["ssd_fenced_slots"] == 1
    # Slot 0 may still be read by the late write: a store into it fails without copying.
    before = [t[:, 1].clone() for t in caches.values()]
    (res,) = [ex.submit(store_job(2, Blocks((keys[1],)), (1,), (0,), (WRITE_NONE,))).wait(WAIT_S)]
    assert res.failed == {keys[1]: "io_timeout"}
    (res,) = [ex.submit(store_job(3, Blocks((keys[2],)), (2,), (1,), (WRITE_NONE,))).wait(WAIT_S)]
    assert res.ok  # other slots are fine
    _native.set_fault_delays(False)  # the device is fast again: the late write completes
    _until(lambda: ex.stats()["ssd_fenced_slots"] == 0)
    (res,) = [ex.submit(store_job(4, Blocks((keys[1],)), (1,), (0,), (WRITE_SSD,))).wait(WAIT_S)]
    assert res.ok and not res.write_failed
    assert all(torch.equal(t[:, 1], b) for t, b in zip(caches.values(), before, strict=True))
    # Slow again: shutdown does not unmap the pool (or close the store) under a late write.
    _native.set_fault_delays(True)
    (res,) = [ex.submit(store_job(5, Blocks((keys[2],)), (2,), (2,), (WRITE_SSD,))).wait(WAIT_S)]
    assert res.write_failed_on(Tier.SSD) == {keys[2]}
    assert not ex.shutdown(timeout=0.1)
    _native.set_fault_delays(False)
    assert ex.shutdown(timeout=30)


# ---------------------------------------------------------------- degraded start (vLLM)
def _prompt_done(req: Any) -> Any:
    """After an async load vLLM counts the tokens before the KV arrives: wait for RUNNING."""
    return lambda: (
        req.status == RequestStatus.RUNNING and req.num_computed_tokens >= len(req.prompt_token_ids)
    )


def _block_bits(e: vh.Engine, req_id: str, nblocks: int) -> list[torch.Tensor]:
    ids = e.scheduler.kv_cache_manager.get_block_ids(req_id)[0][:nblocks]
    return [t for b in ids for t in e.workers[0].model.block_bits(b)]


def _engine_serves_from_host(model_dir: str, extra: dict[str, Any]) -> vh.Engine:
    """The engine starts without its SSD tier and serves a repeated prompt from host memory,
    bit-exact; the connector's stats report the unavailable tier once."""
    e = vh.Engine(model_dir, vh.connector_transfer_config(extra))
    (ws,) = [w.connector.worker_side for w in e.workers]
    assert Tier.SSD not in ws.executor.tiers and ws.executor.unavailable.get(Tier.SSD)
    prompt = vh.prompt_tokens(21, 4 * BS)
    a = e.add(vh.make_request("A", prompt, max_tokens=3))
    e.run_until(_prompt_done(a))
    bits = _block_bits(e, "A", 4)
    e.run()
    e.reset_gpu_prefix_cache()
    b = e.add(vh.make_request("B", prompt, max_tokens=3))
    e.run_until(_prompt_done(b))
    assert any("B" in rec.finished_recving for rec in e.history), "no host-tier hit"
    assert all(torch.equal(x, y) for x, y in zip(bits, _block_bits(e, "B", 4), strict=True))
    e.run()
    assert e.outputs["B"] == e.outputs["A"]
    assert not e.mismatches()
    assert sum(s.get("ssd_unavailable", 0) for s in e.stats) == 1
    assert ws.executor.stats()["ssd_unavailable"] == 1
    return e


@pytest.mark.usefixtures("connector_form")
def test_locked_ssd_dir_serves_from_host(
    model_dir: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    extra = vh.with_ssd(tmp_path / "ssd")
    shard = tmp_path / "ssd" / "tp0-pp0"
    shard.mkdir(mode=0o700)
    with BlockStore(str(shard), 16 << 20):  # another live owner of the directory
        with caplog.at_level("ERROR", logger="flexkv_py.tiers.ssd.opener"):
            e = _engine_serves_from_host(model_dir, extra)
    loud = [r.message for r in caplog.records if "UNAVAILABLE" in r.message]
    assert len(loud) == 1 and "StoreLockedError" in loud[0] and str(tmp_path) in loud[0]
    vh.assert_no_leaks(e)
    e.shutdown()


@pytest.mark.usefixtures("connector_form")
def test_foreign_ssd_dir_serves_from_host(
    model_dir: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    extra = vh.with_ssd(tmp_path / "ssd")
    shard = tmp_path / "ssd" / "tp0-pp0"
    shard.mkdir(mode=0o700)
    for name in ("flexkv-journal.log", "flexkv-blocks.dat"):
        (shard / name).write_bytes(b"not a flexkv file " * 1000)
    with caplog.at_level("ERROR", logger="flexkv_py.tiers.ssd.opener"):
        e = _engine_serves_from_host(model_dir, extra)
    assert any("UNAVAILABLE" in r.message for r in caplog.records)
    assert (shard / "flexkv-journal.log").read_bytes().startswith(b"not a flexkv")  # untouched
    vh.assert_no_leaks(e)
    e.shutdown()


@pytest.mark.usefixtures("connector_form")
def test_slow_ssd_load_in_vllm_is_recomputed_not_hung(
    model_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    extra = vh.with_ssd(tmp_path / "ssd", ssd_io_timeout_s=TIMEOUT_S)
    prompt = vh.prompt_tokens(23, 4 * BS)
    # The writer runs on a real (maybe busy) disk: the default timeout, not the slow device's.
    e1 = vh.Engine(model_dir, vh.connector_transfer_config(vh.with_ssd(tmp_path / "ssd")))
    e1.add(vh.make_request("A", prompt))
    e1.run()
    e1.shutdown()
    monkeypatch.setenv("FLEXKV_FAULT_INJECTION", f"read:DELAY{SLOW_MS}:1")
    e2 = vh.Engine(model_dir, vh.connector_transfer_config(extra))  # restart: A's blocks on SSD
    started = time.monotonic()
    e2.add(vh.make_request("B", prompt))
    e2.run(timeout_s=TIMEOUT_S + 30)
    assert time.monotonic() - started < TIMEOUT_S + 30  # far below the device's 60 s
    assert any(rec.invalid_block_ids for rec in e2.history), "the timeout was not a load error"
    assert sum(s.get("ssd_io_timeout_blocks", 0) for s in e2.stats) >= 1
    assert not e2.mismatches(), "KV of a timed-out read reached the model"
    assert e2.outputs["B"] == e1.outputs["A"]  # recomputed
    _native.set_fault_delays(False)  # let the late reads finish before the pool is unmapped
    e2.shutdown()


# ---------------------------------------------------------------- staged loads in sub-batches
class _SubBatchTier:
    """The real SSD tier, with the logical keys of each read recorded; the `hold`-th read
    (0-based) reaches the store only once `gate` is set (a device stuck on that sub-batch)."""

    def __init__(self, tier: Any, hold: int | None = None) -> None:
        self.tier = tier
        self.hold = hold
        self.gate = threading.Event()
        self.reads: list[list[bytes]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.tier, name)

    def submit_get(self, items: Any) -> Any:
        items = list(items)
        self.reads.append([k for k, _ in items])
        if len(self.reads) - 1 == self.hold:
            return _GatedBatch(self.tier, items, self.gate)
        batch = self.tier.submit_get(items)
        # Done before it is handed over: only the held read depends on the clock (a busy disk
        # must not make a real read look stuck next to it).
        batch.wait(WAIT_S)
        return batch


class _GatedBatch:
    def __init__(self, tier: Any, items: list[Any], gate: threading.Event) -> None:
        self._tier, self._items, self._gate = tier, items, gate
        self._batch: Any = None

    def _started(self) -> Any:
        if self._batch is None:
            self._batch = self._tier.submit_get(self._items)
        return self._batch

    def done(self) -> bool:
        return self._gate.is_set() and self._started().done()

    def wait(self, timeout: float | None = None) -> list[Any]:
        if not self._gate.wait(timeout):
            raise TimeoutError("held")
        return self._started().wait(timeout)


def _staged_setup(
    tmp_path: Path, n: int, timeout_s: float = 5.0
) -> tuple[dict[str, torch.Tensor], Namespace, Any, list[bytes]]:
    """A CPU KV cache of 2n blocks and n blocks of it stored write-through to SSD (slots 0..n-1,
    GPU blocks 0..n-1); the load side uses slots n..2n-1 and GPU blocks n..2n-1."""
    caches = _caches(2 * n)
    geom = describe_kv_caches(caches)
    ns = Namespace("m", "r", "float16", geom.layout, 16, page_bytes=geom.page_nbytes)
    (tmp_path / "ssd").mkdir(mode=0o700)
    values = {
        "cpu_cache_gb": 2 * n * geom.slot_nbytes / (1 << 30),
        "ssd_cache_gb": 4 * n * (geom.slot_nbytes + 4096) / (1 << 30),
        "ssd_cache_dir": str(tmp_path / "ssd"),
    }
    cfg = load_config({**values, "ssd_io_timeout_s": timeout_s}, env={})
    keys = ns.keys([f"k{i}".encode().ljust(32, b".") for i in range(n)])
    # The store that sets up runs on a real (maybe busy) disk: the default timeout.
    ex = JobExecutor.from_kv_caches(load_config(values, env={}), ns, caches)
    res = ex.submit(
        store_job(1, Blocks(tuple(keys)), tuple(range(n)), tuple(range(n)), (WRITE_SSD,) * n)
    )
    assert res.wait(30).ok
    assert ex.shutdown(timeout=30)
    return caches, ns, cfg, keys


def _staged_load(ex: JobExecutor, job_id: int, keys: list[bytes], first: int, n: int) -> Any:
    """Load keys[first:] from SSD into slots/GPU blocks n+first.. (a restart: nothing in host)."""
    pos = range(first, first + len(keys))
    return ex.submit(
        load_job(
            job_id,
            tuple(keys),
            tuple(n + i for i in pos),
            tuple(n + i for i in pos),
            (Tier.SSD,) * len(keys),
        )
    )


def _same_block(caches: dict[str, torch.Tensor], a: int, b: int) -> bool:
    return all(torch.equal(t[:, a], t[:, b]) for t in caches.values())


def test_staged_load_in_sub_batches_is_bit_exact_and_a_corrupt_block_fails_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    n = 20
    caches, ns, cfg, keys = _staged_setup(tmp_path, n)
    shard = tmp_path / "ssd" / ns.shard_dir_name
    flip_byte(shard / DATA_FILE, stored_blocks(shard)[ns.storage_key(keys[10])] + PAGE + 123)
    for t in caches.values():
        t[:, n:] = 0
    slot = describe_kv_caches(caches).slot_nbytes
    monkeypatch.setattr(JobBodies, "read_batch_bytes", 3 * slot)  # 7 sub-batches of <= 3
    tier = _SubBatchTier(SsdTier(cfg, ns))
    ex = JobExecutor.from_kv_caches(
        cfg, ns, caches, options=ExecutorOptions(tiers={Tier.SSD: tier})
    )
    res = _staged_load(ex, 2, keys, 0, n).wait(30)
    assert [len(r) for r in tier.reads] == [3, 3, 3, 3, 3, 3, 2]
    assert [k for r in tier.reads for k in r] == keys  # in order, each once
    assert res.failed == {keys[10]: "corrupt"}
    assert res.failed_gpu_block_ids == {n + 10}
    assert all(_same_block(caches, i, n + i) for i in range(n) if i != 10)
    assert all(not t[:, n + 10].any() for t in caches.values())  # never copied
    assert ex.stats()["h2d_blocks"] == n - 1
    assert ex.shutdown(timeout=30)


def test_staged_load_sub_batch_timeout_fences_only_its_own_slots(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    n = 10
    timeout_s = 1.0  # the other sub-batches (real reads of 2 small blocks) finish well within
    caches, ns, cfg, keys = _staged_setup(tmp_path, n, timeout_s)
    slot = describe_kv_caches(caches).slot_nbytes
    monkeypatch.setattr(JobBodies, "read_batch_bytes", 2 * slot)  # 5 sub-batches of 2
    tier = _SubBatchTier(SsdTier(cfg, ns), hold=1)  # blocks 2, 3 stuck on the device
    ex = JobExecutor.from_kv_caches(
        cfg, ns, caches, options=ExecutorOptions(tiers={Tier.SSD: tier})
    )
    started = time.monotonic()
    res = _staged_load(ex, 2, keys, 0, n).wait(30)
    assert time.monotonic() - started < timeout_s + MARGIN_S
    # Sub-batches 0, 2, 3 landed; 1 timed out; 4 was never submitted (the device is stuck).
    assert len(tier.reads) == 4
    assert res.failed == dict.fromkeys([keys[2], keys[3], keys[8], keys[9]], "io_timeout")
    assert res.failed_gpu_block_ids == {n + 2, n + 3, n + 8, n + 9}
    assert all(_same_block(caches, i, n + i) for i in (0, 1, 4, 5, 6, 7))
    stats = ex.stats()
    assert stats["ssd_io_timeout_blocks"] == 2 and stats["ssd_read_skipped_blocks"] == 2
    assert ex.late_io.fenced(range(2 * n)) == {n + 2, n + 3}  # sub-batch 1's slots only
    # The device recovers: the late read lands, the fence lifts, the blocks load bit-exact.
    tier.gate.set()
    _until(lambda: ex.late_io.pending() == 0)
    res = _staged_load(ex, 3, [keys[2], keys[3], keys[8], keys[9]][:2], 2, n).wait(30)
    assert res.ok and _same_block(caches, 2, n + 2) and _same_block(caches, 3, n + 3)
    res = _staged_load(ex, 4, keys[8:], 8, n).wait(30)
    assert res.ok and _same_block(caches, 8, n + 8) and _same_block(caches, 9, n + 9)
    assert ex.shutdown(timeout=30)


def test_load_never_queues_behind_stores_stuck_on_a_slow_ssd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # With write-through, every job thread can be waiting on an SSD write
    # (seconds on a busy disk); a load queued behind them kept its request, and the GPU blocks
    # it holds, waiting that long (the engine stalled). Loads have threads of their own.
    # The stores wait on the device, not on a timeout.
    caches, ex, keys = _executor_on_a_slow_ssd(tmp_path, monkeypatch, WAIT_S)
    # A block in host memory only (no device write), from GPU block 0.
    (res,) = [ex.submit(store_job(1, Blocks((keys[0],)), (0,), (0,), (WRITE_NONE,))).wait(WAIT_S)]
    assert res.ok
    # Both job threads now wait on a stuck SSD write.
    for job_id, i in ((2, 1), (3, 2)):
        ex.submit(store_job(job_id, Blocks((keys[i],)), (i,), (i,), (WRITE_SSD,)))
    ex.wait_gpu_reads([2, 3], timeout=WAIT_S)
    started = time.monotonic()
    (res,) = [ex.submit(load_job(4, (keys[0],), (5,), (0,), (Tier.HOST,))).wait(WAIT_S)]
    assert res.ok and time.monotonic() - started < MARGIN_S
    assert all(torch.equal(t[:, 5], t[:, 0]) for t in caches.values())  # bit-exact
    assert {r.job_id for r in ex.poll()} <= {1, 4}  # the stores are still writing
    _native.set_fault_delays(False)
    assert all(r.ok and not r.write_failed for r in ex.wait([2, 3], timeout=WAIT_S))
    assert ex.shutdown(timeout=30)
