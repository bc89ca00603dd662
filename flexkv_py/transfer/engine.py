"""GPU <-> host transfer engine: batched copies between vLLM's KV cache and the host pool.

``submit_d2h`` / ``submit_h2d`` take the whole list of (GPU block, host slot) pairs and issue one
kernel (Triton, UVA) or one batched copy (``cuMemcpyBatchAsync``, copy engines) on a dedicated
CUDA stream per direction, ordered after the work already enqueued on the caller's current stream
(so a store sees the KV the model wrote). Completion is an event, polled without blocking.
A copy issued later from another thread is ordered behind the caller's stream by
stream_order.py (a mark taken at submit, a side stream that waits for it).

With CPU tensors (CI, CPU-only hosts) the same API runs torch gather/scatter on one worker
thread per direction.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Protocol

import numpy as np
import torch

from flexkv_py.errors import ClosedError, InternalStateError
from flexkv_py.tiers.host_pool import HostPool
from flexkv_py.transfer.errors import TransferError
from flexkv_py.transfer.kv_layout import KVPageGeometry, describe_kv_caches
from flexkv_py.transfer.torch_path import TorchCopyPath

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "torch", "triton", "copy_engine", "staged")
# Measured on an H200 (benches/RESULTS_transfer.md): for 32-64 KiB runs the staged path reaches
# 0.98x the pinned-memcpy ceiling both ways with 8 SMs (Triton UVA 0.94 / 0.92; batched copies of
# such runs 0.56-0.85). When a block is already one large run (block-outermost layouts), batched
# copies reach 0.97-0.98x with no SMs at all, so they win there.
AUTO_STAGED = "staged"
AUTO_LARGE_RUNS = "copy_engine"
LARGE_RUN_NBYTES = 1 << 20


class CopyPath(Protocol):
    name: str
    sms_used: int

    def enqueue(
        self, direction: str, gpu_ids: np.ndarray, slots: np.ndarray
    ) -> torch.cuda.Stream | None:
        """Issue the batch on the current stream. Returns the stream whose work so far completes
        it when that is another one (a side stream the path does not join back), else None."""
        ...


class TransferHandle:
    """One submitted batch. ``done()`` never blocks; ``wait()`` blocks (GIL released)."""

    def __init__(
        self,
        direction: str,
        gpu_ids: np.ndarray,
        slots: np.ndarray,
        nbytes: int,
        *,
        event: torch.cuda.Event | None = None,
        future: Future[torch.cuda.Stream | None] | None = None,
    ) -> None:
        self.direction = direction
        self.gpu_block_ids = gpu_ids
        self.host_slots = slots
        self.nbytes = nbytes
        self._event = event
        self._future = future
        self._error: BaseException | None = None
        self._finished = False

    @property
    def num_blocks(self) -> int:
        return len(self.gpu_block_ids)

    def _fail(self, exc: BaseException) -> None:
        self._error = exc
        self._finished = True

    def done(self) -> bool:
        if self._finished:
            return True
        try:
            if self._event is not None:
                ready = bool(self._event.query())
            else:
                assert self._future is not None
                ready = self._future.done()
                if ready and self._future.exception() is not None:
                    self._fail(self._future.exception())  # type: ignore[arg-type]
        except Exception as e:  # a CUDA fault surfaces here
            self._fail(e)
            return True
        if ready:
            self._finished = True
        return ready

    def wait(self, timeout: float | None = None) -> None:
        """Until done; TimeoutError after ``timeout`` s; TransferError if the batch failed."""
        if not self._finished:
            try:
                if self._future is not None:
                    try:
                        self._future.result(timeout)
                    except FutureTimeout:
                        raise TimeoutError(
                            f"{self.direction} of {self.num_blocks} blocks not done "
                            f"after {timeout} s"
                        ) from None
                elif timeout is None:
                    assert self._event is not None
                    self._event.synchronize()
                else:
                    self._poll_until(timeout)
                self._finished = True
            except TimeoutError:
                raise
            except Exception as e:
                self._fail(e)
        if self._error is not None:
            raise TransferError(
                f"{self.direction} of {self.num_blocks} blocks failed: {self._error}",
                direction=self.direction,
                block_ids=tuple(int(b) for b in self.gpu_block_ids),
            ) from self._error

    def make_current_stream_wait(self) -> None:
        """Order the caller's current CUDA stream after this batch without blocking the host
        (a consumer that reads a load's blocks on its own stream); CPU tensors: `wait()`."""
        if self._event is None:
            self.wait()
            return
        torch.cuda.current_stream().wait_event(self._event)

    def _poll_until(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        pause = 20e-6
        assert self._event is not None
        while not self._event.query():
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"{self.direction} of {self.num_blocks} blocks not done after {timeout} s"
                )
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)


class TransferEngine:
    """Moves whole pages between vLLM's registered KV caches and a HostPool."""

    def __init__(
        self,
        kv_caches: Mapping[str, torch.Tensor] | KVPageGeometry,
        host_pool: HostPool,
        *,
        backend: str = "auto",
        d2h_backend: str | None = None,
        h2d_backend: str | None = None,
        triton_programs: int = 8,
        triton_tile_bytes: int = 16384,
        triton_warps: int = 8,
        staged_chunk_pages: int = 32,
        copy_engine_prefer_overlap: bool = True,
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"transfer backend must be one of {BACKENDS}, got {backend!r}")
        geom = kv_caches if isinstance(kv_caches, KVPageGeometry) else describe_kv_caches(kv_caches)
        if host_pool.slot_nbytes < geom.page_nbytes:
            raise ValueError(
                f"host pool slots of {host_pool.slot_nbytes} bytes cannot hold a {geom.layout} "
                f"page of {geom.page_nbytes} bytes"
            )
        self.geometry = geom
        self.pool = host_pool
        self.device = geom.device
        self._lock = threading.Lock()
        self._closed = False
        self._paths: dict[str, CopyPath] = {}
        self._inflight: list[TransferHandle] = []
        if self.device.type == "cuda":
            if not host_pool.pinned:
                raise ValueError(
                    "KV caches are on CUDA but the host pool is not pinned; build it with pin=True"
                )
            self._streams = {
                "d2h": torch.cuda.Stream(self.device),
                "h2d": torch.cuda.Stream(self.device),
            }
            self._executors: dict[str, ThreadPoolExecutor] = {}
        else:
            self._streams = {}
            self._executors = {
                d: ThreadPoolExecutor(1, thread_name_prefix=f"flexkv-{d}") for d in ("d2h", "h2d")
            }
        self._triton = {
            "programs": triton_programs,
            "tile_bytes": triton_tile_bytes,
            "num_warps": triton_warps,
        }
        self._staged_chunk_pages = staged_chunk_pages
        self._prefer_overlap = copy_engine_prefer_overlap
        self.backend = {
            "d2h": self._resolve(d2h_backend or backend, "d2h"),
            "h2d": self._resolve(h2d_backend or backend, "h2d"),
        }
        logger.info(
            "transfer engine on %s: d2h=%s h2d=%s, %s",
            self.device,
            self.backend["d2h"].name,
            self.backend["h2d"].name,
            geom.fingerprint,
        )

    # -- backend choice ----------------------------------------------------------------------

    def _path(self, name: str, direction: str) -> CopyPath:
        # One instance per direction: the staged path owns staging buffers and events that the
        # two direction streams must not share.
        key = f"{name}:{direction}"
        if key not in self._paths:
            host = self.pool.tensor
            path: CopyPath
            if name == "torch":
                path = TorchCopyPath(self.geometry, host)
            elif name == "triton":
                from flexkv_py.transfer.triton_path import TritonCopyPath

                path = TritonCopyPath(self.geometry, host, **self._triton)
            elif name == "copy_engine":
                from flexkv_py.transfer.copy_engine_path import CopyEnginePath

                path = CopyEnginePath(self.geometry, host, prefer_overlap=self._prefer_overlap)
            elif name == "staged":
                from flexkv_py.transfer.staged_path import StagedCopyPath

                path = StagedCopyPath(
                    self.geometry,
                    host,
                    chunk_pages=self._staged_chunk_pages,
                    programs=self._triton["programs"],
                    prefer_overlap=self._prefer_overlap,
                )
            else:
                raise ValueError(f"unknown transfer backend {name!r}")
            self._paths[key] = path
        return self._paths[key]

    def _resolve(self, name: str, direction: str) -> CopyPath:
        if self.device.type != "cuda":
            if name not in ("auto", "torch"):
                raise ValueError(f"transfer backend {name!r} needs CUDA tensors; use 'torch'")
            return self._path("torch", direction)
        if name != "auto":
            return self._path(name, direction)
        large = min(seg.nbytes for seg in self.geometry.segments) >= LARGE_RUN_NBYTES
        preferred = AUTO_LARGE_RUNS if large else AUTO_STAGED
        for candidate in dict.fromkeys((preferred, "staged", "triton", "copy_engine", "torch")):
            try:
                return self._path(candidate, direction)
            except (ImportError, ValueError, RuntimeError, OSError) as e:
                logger.warning(
                    "transfer backend %s unavailable (%s); trying the next", candidate, e
                )
        raise InternalStateError("no transfer backend available")  # torch always works

    @property
    def sms_used(self) -> dict[str, int]:
        return {d: p.sms_used for d, p in self.backend.items()}

    # -- submit ------------------------------------------------------------------------------

    def submit_d2h(self, gpu_block_ids: Sequence[int], host_slots: Sequence[int]) -> TransferHandle:
        """Copy GPU blocks into host slots (a store)."""
        return self._submit("d2h", gpu_block_ids, host_slots)

    def submit_h2d(self, host_slots: Sequence[int], gpu_block_ids: Sequence[int]) -> TransferHandle:
        """Copy host slots into GPU blocks (a load)."""
        return self._submit("h2d", gpu_block_ids, host_slots)

    def _validate(
        self, direction: str, gpu_block_ids: Sequence[int], host_slots: Sequence[int]
    ) -> tuple[np.ndarray, np.ndarray]:
        ids = np.asarray(gpu_block_ids, dtype=np.int64).reshape(-1)
        slots = np.asarray(host_slots, dtype=np.int64).reshape(-1)
        if len(ids) != len(slots):
            raise ValueError(f"{direction}: {len(ids)} GPU block ids but {len(slots)} host slots")
        if len(ids):
            if ids.min() < 0 or ids.max() >= self.geometry.num_blocks:
                raise ValueError(
                    f"{direction}: GPU block id out of range [0, {self.geometry.num_blocks})"
                )
            if slots.min() < 0 or slots.max() >= self.pool.num_slots:
                raise ValueError(f"{direction}: host slot out of range [0, {self.pool.num_slots})")
            # Sorted neighbours, not np.unique: ~5x cheaper, and this runs before the copy is
            # issued (a store's first copy waits for it).
            dst = np.sort(slots if direction == "d2h" else ids)
            if bool((dst[1:] == dst[:-1]).any()):
                what = "host slot" if direction == "d2h" else "GPU block id"
                raise ValueError(f"{direction}: duplicate destination {what} in one batch")
        return ids, slots

    def _submit(
        self, direction: str, gpu_block_ids: Sequence[int], host_slots: Sequence[int]
    ) -> TransferHandle:
        if self._closed or self.pool.closed:
            raise ClosedError("transfer engine is closed")
        ids, slots = self._validate(direction, gpu_block_ids, host_slots)
        nbytes = len(ids) * self.geometry.page_nbytes
        path = self.backend[direction]
        with self._lock:
            if self.device.type == "cuda":
                stream = self._streams[direction]
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    done_on = None
                    if len(ids):
                        try:
                            done_on = path.enqueue(direction, ids, slots)
                        except Exception as e:  # a driver call failed: none of it counts
                            raise TransferError(
                                f"{direction} of {len(ids)} blocks could not be issued: {e}",
                                direction=direction,
                                block_ids=tuple(int(b) for b in ids),
                            ) from e
                    event = torch.cuda.Event(blocking=True)
                    event.record(stream if done_on is None else done_on)
                handle = TransferHandle(direction, ids, slots, nbytes, event=event)
            else:
                future = self._executors[direction].submit(path.enqueue, direction, ids, slots)
                handle = TransferHandle(direction, ids, slots, nbytes, future=future)
            self._inflight = [h for h in self._inflight if not h.done()]
            self._inflight.append(handle)
        return handle

    def synchronize(self) -> None:
        """Wait for every batch submitted so far."""
        with self._lock:
            pending = list(self._inflight)
        for h in pending:
            try:
                h.wait()
            except TransferError as e:
                logger.warning("%s", e)

    def close(self) -> None:
        """Wait for in-flight batches; the host pool stays open (the caller owns it)."""
        if self._closed:
            return
        self.synchronize()
        self._closed = True
        for ex in self._executors.values():
            ex.shutdown(wait=True)

    def __enter__(self) -> TransferEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
