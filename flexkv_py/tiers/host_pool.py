"""The host tier's memory: one big page-aligned region cut into equal 4096-aligned slots.

One slot holds one engine block (all layers, K and V of this worker's shard). The region is
pinned with ``cudaHostRegister`` when CUDA is available, so GPU copies run at full PCIe speed and
kernels can address it directly (UVA); the same memory is handed to the SSD store for O_DIRECT
reads and writes, so no bounce buffer is needed anywhere.

Allocation is fast on purpose: an anonymous mmap (the native ``flexkv_py._native.HostPool``, or
Python's mmap for a pool prepared in the background), first-touched by many threads, then
registered in chunks of at most 64 GiB (single huge registrations fail). torch's
``pin_memory=True`` is ~3x slower and rounds sizes up to powers of two.

Views never outlive the memory: ``close()`` unregisters the pool at once but *defers* the unmap
until the last view (``tensor``, a slot view, any numpy array or tensor made from them) is
garbage-collected. Deferring rather than refusing keeps every shutdown path (executor, vLLM
teardown, ``__del__``) free of a new exception, and a refused close would leak the pool anyway.
A view used after close is plain pageable memory: valid, but no longer pinned for DMA.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from flexkv_py import _native
from flexkv_py.errors import ClosedError, ConfigError, StorageFullError
from flexkv_py.tiers.alignment import SLOT_ALIGN
from flexkv_py.tiers.background_pinning import BACKGROUND_CHUNK_BYTES, BackgroundPinner

logger = logging.getLogger(__name__)

GIB = 1 << 30
MAX_REGISTER_CHUNK = 64 * GIB
_HOST_REGISTER_PORTABLE_MAPPED = 0x1 | 0x2  # cudaHostRegisterPortable | cudaHostRegisterMapped


@dataclass
class PoolTimings:
    """Seconds spent building the pool (reported by the bench)."""

    allocate_s: float = 0.0
    touch_s: float = 0.0
    pin_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.allocate_s + self.touch_s + self.pin_s


class HostPool:
    """``num_slots`` slots of ``slot_nbytes`` bytes in one pinned (if CUDA) region.

    ``tensor`` is a ``uint8 [num_slots, slot_nbytes]`` CPU tensor over the region; views of it
    keep the memory mapped past ``close()`` (see the module). The caller (the coordinator) owns
    slot allocation.
    """

    def __init__(
        self,
        num_slots: int,
        slot_nbytes: int,
        *,
        pin: bool | None = None,
        huge_pages: bool = True,
        touch_threads: int = 0,
        backing: str = "auto",
        register_threads: int = 4,
        background: bool = False,
        background_chunk_bytes: int = BACKGROUND_CHUNK_BYTES,
    ) -> None:
        """`background`: return at once and touch/pin the pool chunk by chunk on a thread (see
        `background_pinning`); only `ready_slots` leading slots may be used meanwhile, and
        registration starts after `allow_registration()`."""
        if num_slots <= 0:
            raise ConfigError(f"host pool needs at least one slot, got num_slots={num_slots}")
        if slot_nbytes <= 0 or slot_nbytes % SLOT_ALIGN:
            raise ConfigError(
                f"host pool slot size {slot_nbytes} is not a positive multiple of {SLOT_ALIGN} "
                "(O_DIRECT alignment); round it up"
            )
        if backing not in ("auto", "native", "mmap"):
            raise ConfigError(f"host pool backing must be auto|native|mmap, got {backing!r}")
        if pin is None:
            pin = torch.cuda.is_available()
        if pin and not torch.cuda.is_available():
            raise ConfigError("host pool pin=True needs CUDA, which is not available")
        self.num_slots = num_slots
        self.slot_nbytes = slot_nbytes
        self.nbytes = num_slots * slot_nbytes
        self.timings = PoolTimings()
        self._registered: list[tuple[int, int]] = []
        self._closed = False
        self._pinner: BackgroundPinner | None = None

        t0 = time.perf_counter()
        # The native pool touches while allocating: a background pool maps and touches later.
        if not background and backing in ("auto", "native"):
            self._buffer: Any = _native.HostPool(
                self.nbytes, huge_pages=huge_pages, touch_threads=touch_threads
            )
            self.backing = "native"
            self.timings.allocate_s = time.perf_counter() - t0  # native touches while allocating
            # The view leases the mapping: tensors over it keep it past close().
            flat = torch.frombuffer(self._buffer.memoryview(), dtype=torch.uint8)
        else:
            self._buffer = mmap.mmap(
                -1,
                self.nbytes,
                flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                prot=mmap.PROT_READ | mmap.PROT_WRITE,
            )
            if huge_pages and hasattr(mmap, "MADV_HUGEPAGE"):
                self._buffer.madvise(mmap.MADV_HUGEPAGE)  # 512x fewer faults and pinned pages
            self.backing = "mmap"
            self.timings.allocate_s = time.perf_counter() - t0
            # torch.frombuffer keeps no buffer export, so mmap.close() would unmap under a live
            # tensor; the ctypes array holds one export for as long as any tensor holds it.
            exporter = (ctypes.c_uint8 * self.nbytes).from_buffer(self._buffer)
            flat = torch.frombuffer(exporter, dtype=torch.uint8)
            del exporter
            if not background:
                t1 = time.perf_counter()
                # First touch from torch's intra-op threads: one byte per 4 KiB page faults it in.
                flat.view(-1, SLOT_ALIGN)[:, 0].fill_(0)
                self.timings.touch_s = time.perf_counter() - t1
        self.tensor = flat[: self.nbytes].view(num_slots, slot_nbytes)  # native may round up
        self.address = int(flat.data_ptr())
        assert self.address % SLOT_ALIGN == 0, "mmap returned an unaligned region"
        self.pinned = False
        if background:
            # `pinned` promises pinning: the transfer engine may only touch ready slots.
            self.pinned = bool(pin)
            self._pinner = BackgroundPinner(
                flat[: self.nbytes],
                slot_nbytes,
                num_slots,
                register=_host_register_fn() if pin else None,
                on_registered=lambda addr, size: self._registered.append((addr, size)),
                chunk_bytes=background_chunk_bytes,
            )
        elif pin:
            t2 = time.perf_counter()
            self._pin(register_threads)
            self.timings.pin_s = time.perf_counter() - t2
            self.pinned = True
        logger.info(
            "host pool: %d slots x %d bytes = %.2f GiB (%s, pinned=%s%s) in %.2f s",
            num_slots,
            slot_nbytes,
            self.nbytes / GIB,
            self.backing,
            self.pinned,
            ", touched and pinned in the background" if background else "",
            self.timings.total_s,
        )

    @classmethod
    def from_cache_gb(cls, cpu_cache_gb: float, slot_nbytes: int, **kwargs: Any) -> HostPool:
        """As many slots as fit in ``cpu_cache_gb`` GiB (FlexKV's FLEXKV_CPU_CACHE_GB)."""
        if not cpu_cache_gb > 0:
            raise ConfigError(f"cpu_cache_gb must be > 0, got {cpu_cache_gb}")
        if slot_nbytes <= 0:
            raise ConfigError(f"slot size must be positive, got {slot_nbytes}")
        num_slots = int(cpu_cache_gb * GIB) // slot_nbytes
        if num_slots < 1:
            raise ConfigError(
                f"cpu_cache_gb={cpu_cache_gb} holds no block of {slot_nbytes} bytes; raise it"
            )
        return cls(num_slots, slot_nbytes, **kwargs)

    # -- pinning -------------------------------------------------------------------------------

    @property
    def ready_slots(self) -> int:
        """Leading slots that may be used now (all of them unless built in the background)."""
        return self.num_slots if self._pinner is None else self._pinner.ready_slots

    @property
    def background(self) -> BackgroundPinner | None:
        """The background preparation (its timings and errors), or None."""
        return self._pinner

    def allow_registration(self) -> None:
        """Background pools: CUDA graph capture is over, `cudaHostRegister` may start."""
        if self._pinner is not None:
            self._pinner.allow_registration()

    def _chunks(self) -> list[tuple[int, int]]:
        # Chunk boundaries fall on slot boundaries: a copy never spans two registrations.
        per_chunk = max(1, min(self.num_slots, MAX_REGISTER_CHUNK // self.slot_nbytes))
        step = per_chunk * self.slot_nbytes
        return [
            (self.address + off, min(step, self.nbytes - off))
            for off in range(0, self.nbytes, step)
        ]

    def _pin(self, threads: int) -> None:
        chunks = self._chunks()
        register = _host_register_fn()
        if threads > 1 and len(chunks) > 1:
            with ThreadPoolExecutor(min(threads, len(chunks))) as ex:
                errors = list(ex.map(lambda c: register(*c), chunks))
        else:
            errors = [register(*c) for c in chunks]
        for (addr, size), err in zip(chunks, errors, strict=True):
            if err == 0:
                self._registered.append((addr, size))
        failed = [(c, e) for c, e in zip(chunks, errors, strict=True) if e != 0]
        if failed:
            self._unpin()
            (addr, size), err = failed[0]
            raise StorageFullError(
                f"cudaHostRegister failed (error {err}) for {size} bytes of the "
                f"{self.nbytes}-byte host pool; lower cpu_cache_gb or raise the memlock limit"
            )

    def _unpin(self) -> None:
        unregister = _host_unregister_fn()
        for addr, _size in self._registered:
            err = unregister(addr)
            if err != 0:
                logger.warning("cudaHostUnregister(%#x) failed with error %s", addr, err)
        self._registered.clear()

    # -- access -----------------------------------------------------------------------------

    def slot_address(self, slot: int) -> int:
        """Address of a slot (4096-aligned): ``(pool.slot_address(i), pool.slot_nbytes)`` is a
        raw block buffer for the native store. A raw address holds no lease on the memory, so
        none is handed out after close (ClosedError)."""
        self._check_slot(slot)
        return self.address + slot * self.slot_nbytes

    def slot_view(self, slot: int) -> memoryview:
        """A writable memoryview of one slot (buffer protocol, for the native store)."""
        self._check_slot(slot)
        return memoryview(self.tensor[slot].numpy())  # type: ignore[arg-type]

    def _check_slot(self, slot: int) -> None:
        if self._closed:
            raise ClosedError(f"host pool is closed (slot {slot} asked for)")
        if not 0 <= slot < self.num_slots:
            raise IndexError(f"host slot {slot} out of range [0, {self.num_slots})")

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Unregister and release the memory; in-flight transfers must be finished. The unmap
        waits for the last live view (see the module)."""
        if self._closed:
            return
        self._closed = True
        if self._pinner is not None and not self._pinner.stop():
            # Still inside cudaHostRegister: unmapping under it is undefined. Leak instead.
            logger.error("host pool: background pinning did not stop; leaking the pool")
            return
        if self._registered:
            self._unpin()
            self.pinned = False
        del self.tensor
        buffer, self._buffer = self._buffer, None
        if self.backing == "native":
            buffer.close()  # unmaps now, or when the last leased view goes
            if buffer.live_views:
                logger.debug("host pool closed; %d views keep it mapped", buffer.live_views)
            return
        try:
            buffer.close()
        except BufferError:  # a view is still alive: the mapping goes when the last view does
            logger.debug("host pool views still alive; memory released by the garbage collector")

    def __enter__(self) -> HostPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            try:
                self.close()
            except Exception:  # interpreter shutdown: CUDA may be gone already
                pass


def _host_register_fn() -> Any:
    """``register(addr, size) -> error code``; cuda-bindings releases the GIL (parallel pin)."""
    try:
        from cuda.bindings import runtime as cudart

        def register(addr: int, size: int) -> int:
            (err,) = cudart.cudaHostRegister(addr, size, _HOST_REGISTER_PORTABLE_MAPPED)
            return int(err)

        return register
    except ImportError:
        rt = torch.cuda.cudart()

        def register_torch(addr: int, size: int) -> int:
            return int(rt.cudaHostRegister(addr, size, _HOST_REGISTER_PORTABLE_MAPPED))

        return register_torch


def _host_unregister_fn() -> Any:
    try:
        from cuda.bindings import runtime as cudart

        def unregister(addr: int) -> int:
            (err,) = cudart.cudaHostUnregister(addr)
            return int(err)

        return unregister
    except ImportError:
        rt = torch.cuda.cudart()
        return lambda addr: int(rt.cudaHostUnregister(addr))
