"""A load's host -> GPU leg is a flow through whatever handler is registered for (Host, Gpu):
fed sub-batch by sub-batch as the lower-tier reads land when the handler streams (`open`), in
one piece when it only moves whole legs. Nothing in the load body names the transfer engine.

The stand-in "GPU KV cache" is a CPU tensor; the SSD is the real native store; the executor
has no transfer engine at all, so every GPU byte below went through the registered handler.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from pathlib import Path

import pytest
import torch

from flexkv_py.config import load_config
from flexkv_py.coordinator.executor import ExecutorOptions, JobExecutor
from flexkv_py.coordinator.jobs import TRANSFER_ERROR, JobResult, LegJob, load_job
from flexkv_py.coordinator.leg_handlers import Handlers, Moved, PiecesTogether
from flexkv_py.coordinator.legs import Blocks, Gpu, Host, Leg, OnTier
from flexkv_py.index import Namespace
from flexkv_py.index.tier_names import Tier
from flexkv_py.tiers.host_pool import HostPool
from flexkv_py.tiers.protocol import LowerTier
from flexkv_py.tiers.ssd.tier import SsdTier
from flexkv_py.transfer.stream_order import StreamMark

GIB = 1 << 30
PAGE = 8192
BLOCKS = 7


class HostToCpuKv:
    """Host slots -> a CPU stand-in KV cache, whole legs only (no `open`)."""

    def __init__(self, pool: HostPool, kv: torch.Tensor, bad_block: int | None = None) -> None:
        self.pool = pool
        self.kv = kv
        self.bad_block = bad_block  # a GPU block id whose copy "fails"
        self.moves: list[tuple[int, ...]] = []

    def copy(self, gpu_ids: Sequence[int], slots: Sequence[int]) -> dict[int, bool]:
        ok = {}
        for b, s in zip(gpu_ids, slots, strict=True):
            ok[b] = b != self.bad_block
            if ok[b]:
                self.kv[b] = self.pool.tensor[s]
        return ok

    def move(self, leg: Leg) -> Moved:
        assert isinstance(leg.src, Host) and isinstance(leg.dst, Gpu)
        self.moves.append(leg.dst.ids)
        ok = self.copy(leg.dst.ids, leg.src.slots)
        failed = {
            k: TRANSFER_ERROR for k, b in zip(leg.keys, leg.dst.ids, strict=True) if not ok[b]
        }
        return Moved(failed, (len(leg.keys) - len(failed)) * PAGE)


class StreamingHostToCpuKv(HostToCpuKv):
    """The same copy, as a flow: each piece is copied when fed (while later reads still run)."""

    def __init__(self, pool: HostPool, kv: torch.Tensor) -> None:
        super().__init__(pool, kv)
        self.feeds: list[list[int]] = []

    def open(self, leg: Leg, after: object = None) -> _Flow:
        return _Flow(self, leg)


class _Flow:
    def __init__(self, handler: StreamingHostToCpuKv, leg: Leg) -> None:
        self.handler = handler
        self.leg = leg
        self.moved = Moved()
        self.poll = False

    def feed(self, positions: Sequence[int]) -> None:
        if positions:
            self.handler.feeds.append(list(positions))
            self.moved.add(self.handler.move(self.leg.take(positions)))

    def feed_all(self) -> None:
        self.feed(range(len(self.leg.keys)))

    def done(self) -> bool:
        return True

    def wait(self, timeout: float | None = None) -> None:
        pass

    def finish(self) -> Moved:
        return self.moved


@pytest.fixture
def setup(
    tmp_path: Path,
) -> Iterator[tuple[JobExecutor, HostPool, torch.Tensor, tuple[bytes, ...]]]:
    (tmp_path / "ssd").mkdir()
    cfg = load_config(
        {
            "cpu_cache_gb": BLOCKS * PAGE / GIB,
            "ssd_cache_gb": 64 * (PAGE + 4096) / GIB,
            "ssd_cache_dir": str(tmp_path / "ssd"),
        },
        env={},
    )
    ns = Namespace(
        "test/streaming",
        revision="r1",
        kv_dtype="float16",
        kv_layout="NHD",
        block_size=16,
        page_bytes=PAGE,
    )
    pool = HostPool(BLOCKS, PAGE, pin=False)
    tiers: dict[Tier, LowerTier] = {Tier.SSD: SsdTier(cfg, ns)}
    ex = JobExecutor(cfg, ns, pool, options=ExecutorOptions(tiers=tiers), owns=(pool,))
    keys = tuple(ns.keys([f"stream-{i}".encode().ljust(32, b".") for i in range(BLOCKS)]))
    gen = torch.Generator().manual_seed(5)
    pool.tensor[:] = torch.randint(0, 256, (BLOCKS, PAGE), generator=gen, dtype=torch.uint8)
    stored = ex.submit(
        LegJob(1, (Leg(Blocks(keys), Host(tuple(range(BLOCKS))), OnTier(Tier.SSD)),))
    )
    assert stored.wait(30).failed == {}
    kv = torch.zeros((BLOCKS, PAGE), dtype=torch.uint8)
    yield ex, pool, kv, keys
    assert ex.shutdown(timeout=30)


def _load_from_ssd(ex: JobExecutor, pool: HostPool, keys: tuple[bytes, ...]) -> JobResult:
    """Every block read from the SSD into a slot other than its own (the pool is wiped first,
    so nothing but the read can put the bytes there), then to GPU block BLOCKS-1-i."""
    want = pool.tensor.clone()
    pool.tensor.zero_()
    slots = [(i + 3) % BLOCKS for i in range(BLOCKS)]
    gpu = [BLOCKS - 1 - i for i in range(BLOCKS)]
    job = load_job(2, keys, gpu, slots, [Tier.SSD] * BLOCKS)
    result = ex.submit(job).wait(30)
    ex.wait([job.job_id])
    pool.tensor.copy_(want)  # restore the reference for the caller's checks
    return result


def test_a_streaming_gpu_handler_gets_each_sub_batch_as_it_lands(
    setup: tuple[JobExecutor, HostPool, torch.Tensor, tuple[bytes, ...]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ex, pool, kv, keys = setup
    handler = StreamingHostToCpuKv(pool, kv)
    ex.handlers.register(Host, Gpu, handler)
    monkeypatch.setattr(ex._bodies, "read_batch_bytes", 2 * PAGE)  # sub-batches of 2 blocks
    result = _load_from_ssd(ex, pool, keys)
    assert result.failed == {} and result.failed_gpu_block_ids == frozenset()
    for i in range(BLOCKS):
        assert torch.equal(kv[BLOCKS - 1 - i], pool.tensor[i]), i
    # Fed piece by piece, in job order, each block once: 2, 2, 2, 1.
    assert handler.feeds == [[0, 1], [2, 3], [4, 5], [6]]
    assert result.nbytes == 2 * BLOCKS * PAGE  # read into host, then copied to the GPU


def test_a_handler_of_whole_legs_gets_the_pieces_together_and_its_failures_count(
    setup: tuple[JobExecutor, HostPool, torch.Tensor, tuple[bytes, ...]],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ex, pool, kv, keys = setup
    handler = HostToCpuKv(pool, kv, bad_block=2)  # GPU block 2 is block 4's destination
    ex.handlers.register(Host, Gpu, handler)
    monkeypatch.setattr(ex._bodies, "read_batch_bytes", 2 * PAGE)
    result = _load_from_ssd(ex, pool, keys)
    assert len(handler.moves) == 1 and sorted(handler.moves[0]) == list(range(BLOCKS))
    assert result.failed == {keys[4]: TRANSFER_ERROR}
    assert result.failed_gpu_block_ids == frozenset({2})
    for i in range(BLOCKS):
        if i != 4:
            assert torch.equal(kv[BLOCKS - 1 - i], pool.tensor[i]), i
    assert not kv[2].any()  # the failed copy wrote nothing


class GatedMove:
    """A whole-leg handler whose move waits for the test (a slow copy)."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()

    def move(self, leg: Leg) -> Moved:
        self.started.set()
        assert self.release.wait(30)
        return Moved(nbytes=len(leg.keys))


def test_pieces_together_is_not_done_while_another_thread_moves_them() -> None:
    """A store's GPU -> host flow is waited on by its job thread and by vLLM's thread
    (gpu_reads.py): neither may see it done before the move really ended."""
    keys = tuple(bytes([i]) * 8 for i in range(3))
    handler = GatedMove()
    handlers = Handlers()
    handlers.register(Gpu, Host, handler)
    flow = handlers.open(Leg(Blocks(keys), Gpu((0, 1, 2)), Host((0, 1, 2))))
    flow.feed_all()
    assert not flow.done()
    finished: list[Moved] = []
    mover = threading.Thread(target=lambda: finished.append(flow.finish()))
    mover.start()
    assert handler.started.wait(30)
    assert not flow.done()  # taken, still moving
    with pytest.raises(TimeoutError):
        flow.wait(0.01)
    handler.release.set()
    flow.wait(30)  # returns once the move ended
    mover.join(30)
    assert flow.done() and finished[0].nbytes == 3


def test_a_handler_that_cannot_stream_is_refused_behind_a_cuda_stream_mark() -> None:
    handlers = Handlers()
    handlers.register(Gpu, Host, GatedMove())
    mark = StreamMark(None)
    mark.event = object()  # as on CUDA: the copy must start behind the caller's stream
    leg = Leg(Blocks((b"k" * 8,)), Gpu((0,)), Host((0,)))
    with pytest.raises(LookupError, match="cannot start behind the caller's CUDA stream"):
        handlers.open(leg, after=mark)
    assert isinstance(handlers.open(leg, after=StreamMark(None)), PiecesTogether)  # no CUDA
