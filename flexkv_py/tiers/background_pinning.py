"""Touch and pin a large host pool chunk by chunk in the background, so serving starts at once.

First-touching and `cudaHostRegister`-ing 100 GB takes seconds to tens of seconds (15 s for
64 GiB on a freshly started H200 VM). vLLM calls `register_kv_caches` and then captures its CUDA
graphs, so the pool must not hold up start-up. Instead a thread prepares the pool in chunks
(slot-aligned, in slot order) and publishes `ready_slots`: the count of leading slots that are
touched and, with CUDA, registered. Only those slots may be used; the coordinator grows the host
tier as they come (stores that find no ready slot are skipped and counted, never blocked).

`cudaHostRegister` from another thread while a CUDA graph is being captured invalidates the
capture (measured on an H200: every capture in torch's "global" and "thread_local" modes), so
registration waits for `allow_registration()`: the worker calls it when the first real engine
step arrives, after vLLM's start-up captures. Touching needs no CUDA and starts at once.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

# Slots become usable 256 MiB at a time. Each cudaHostRegister stalls the GPU's other work
# while it runs (H200: ~25-60 ms per GiB), so small chunks keep a step's worst case short.
BACKGROUND_CHUNK_BYTES = 256 << 20


@dataclass
class PinningTimes:
    """Seconds from the pool's creation: first ready chunk and whole pool ready."""

    first_ready_s: float | None = None
    all_ready_s: float | None = None


class BackgroundPinner:
    """Prepares `flat` (the pool's bytes) chunk by chunk on a daemon thread."""

    def __init__(
        self,
        flat: torch.Tensor,
        slot_nbytes: int,
        num_slots: int,
        *,
        register: Callable[[int, int], int] | None,
        on_registered: Callable[[int, int], None],
        chunk_bytes: int = BACKGROUND_CHUNK_BYTES,
        page_bytes: int = 4096,
    ) -> None:
        self._flat = flat
        self._slot_nbytes = slot_nbytes
        self._num_slots = num_slots
        self._register = register  # None: nothing to pin (no CUDA), touching only
        self._on_registered = on_registered
        self._slots_per_chunk = max(1, chunk_bytes // slot_nbytes)
        self._page_bytes = page_bytes
        self._ready = 0
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)
        self._may_register = threading.Event()
        self._stop = threading.Event()
        self._started = time.perf_counter()
        self.times = PinningTimes()
        self.error: str | None = None
        self._thread = threading.Thread(target=self._run, name="flexkv-pool-pin", daemon=True)
        self._thread.start()

    @property
    def ready_slots(self) -> int:
        with self._lock:
            return self._ready

    def allow_registration(self) -> None:
        self._may_register.set()

    def wait_ready(self, slots: int, timeout_s: float) -> bool:
        """Block until at least `slots` slots are ready (or preparation stopped)."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while self._ready < slots and self._thread.is_alive():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)
            return self._ready >= slots

    def stop(self, timeout_s: float = 30.0) -> bool:
        """Stop after the chunk in progress; True when the thread ended in time."""
        self._stop.set()
        self._may_register.set()
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        base = int(self._flat.data_ptr())
        for first in range(0, self._num_slots, self._slots_per_chunk):
            if self._stop.is_set():
                return
            end = min(self._num_slots, first + self._slots_per_chunk)
            lo, hi = first * self._slot_nbytes, end * self._slot_nbytes
            # First touch: one write per page faults it in (no slot here is in use yet).
            self._flat[lo:hi].view(-1, self._page_bytes)[:, 0].fill_(0)
            if self._register is not None:
                self._may_register.wait()
                if self._stop.is_set():
                    return
                err = self._register(base + lo, hi - lo)
                if err != 0:
                    self.error = f"cudaHostRegister error {err} at slot {first}"
                    logger.error(
                        "host pool: pinning stopped at slot %d of %d (cudaHostRegister error %s); "
                        "the host tier serves with %d slots",
                        first,
                        self._num_slots,
                        err,
                        first,
                    )
                    with self._changed:
                        self._changed.notify_all()
                    return
                self._on_registered(base + lo, hi - lo)
            with self._changed:
                self._ready = end
                self._changed.notify_all()
            now = time.perf_counter() - self._started
            if self.times.first_ready_s is None:
                self.times.first_ready_s = now
        self.times.all_ready_s = time.perf_counter() - self._started
        logger.info(
            "host pool: %d slots ready (%s) in %.2f s",
            self._num_slots,
            "touched and pinned" if self._register is not None else "touched",
            self.times.all_ready_s,
        )
