"""The GPU-read protocol: when a store job stops reading the caller's GPU blocks.

A store reads GPU memory only in its GPU->host copy; its lower-tier write-through (and, for a
store reusing evicted slots, the spill before the copy) reads host slots. So "GPU read done" is
reported apart from job completion: `poll` names each store job once its copy finished, failed
or will never be issued (abandoned, submit failed, job crashed), and `wait` blocks on that alone.
The caller may reuse the job's GPU blocks from then on, while the job still runs. A copy issued
at submit is watched through its flow (the GPU -> host leg opened, store_copies.py: `done` and
`wait`), so the report does not wait for a job thread (those may all be busy with lower-tier
writes).

A caller that stops waiting for a store while its GPU->host copy may still run (vLLM reuses a
preempted request's blocks) calls `abandon`: the job's blocks fail, so nothing the late copy read
is ever committed. Its host slots stay pinned until the job really ends, so the late copy only
lands in memory nobody else uses.

The state shares the executor's lock: "no later than its result is available" and "not named
once its result was taken" are decided under the same lock as the job registry. Methods ending
in `_locked` expect the caller to hold it; the others take it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable

from flexkv_py.errors import FlexKVError
from flexkv_py.transfer.stream_order import TransferHandleLike


class _GpuRead:
    """A store job that may still read GPU blocks: its copy once issued, and whether the caller
    abandoned it."""

    __slots__ = ("abandoned", "copy")

    def __init__(self) -> None:
        self.abandoned = False
        self.copy: TransferHandleLike | None = None

    def copied(self) -> bool:
        """The copy was issued and has finished (or failed): no GPU read left."""
        return self.copy is not None and self.copy.done()


class Abandoned(FlexKVError):
    """The job was abandoned while it could still read GPU blocks (raised and caught inside a
    job body: its blocks fail, nothing escapes)."""


class GpuReads:
    def __init__(self, lock: threading.Lock) -> None:
        self._lock = lock
        # Store jobs that may still read GPU blocks.
        self._reading: dict[int, _GpuRead] = {}
        self._ended = threading.Condition(lock)  # an entry left _reading / got a copy
        # Store jobs reading GPU blocks whose end of reading `poll` has not reported.
        self._unreported: set[int] = set()

    # -- the job's side --------------------------------------------------------------------
    def begin_locked(self, job_id: int) -> None:
        """A store job that will read GPU blocks is being submitted."""
        self._reading[job_id] = _GpuRead()

    def watch_locked(self, job_id: int) -> None:
        """Its handle is registered: report the end of its reading from here on."""
        self._unreported.add(job_id)

    def forget_locked(self, job_id: int) -> None:
        """Its result was taken: the result says more, do not name it any more."""
        self._unreported.discard(job_id)

    def issued(self, job_id: int, copy: TransferHandleLike) -> None:
        """The job's GPU->host copy is issued: its end can be seen without the job thread."""
        with self._lock:
            read = self._reading.get(job_id)
            if read is not None:
                read.copy = copy
                self._ended.notify_all()

    def end(self, job_id: int) -> bool:
        """The job reads no GPU block any more (its copy finished or will never be issued);
        True if it was abandoned before that."""
        with self._lock:
            read = self._reading.pop(job_id, None)
            if read is None:
                return False
            self._ended.notify_all()
            return read.abandoned

    def is_abandoned(self, job_id: int) -> bool:
        with self._lock:
            read = self._reading.get(job_id)
            return read is not None and read.abandoned

    # -- the caller's side -----------------------------------------------------------------
    def abandon(self, job_ids: Iterable[int]) -> list[int]:
        """Mark these jobs abandoned where their copy may still run; returns those ids."""
        out: list[int] = []
        with self._lock:
            for job_id in job_ids:
                read = self._reading.get(job_id)
                if read is not None and not read.copied():
                    read.abandoned = True
                    out.append(job_id)
        return out

    def _still_reading(self, job_id: int) -> bool:
        read = self._reading.get(job_id)
        return read is not None and not read.copied()

    def poll(self) -> list[int]:
        """Store jobs whose copy ended since the last call (each named once). Non-blocking."""
        with self._lock:
            out = sorted(j for j in self._unreported if not self._still_reading(j))
            self._unreported.difference_update(out)
        return out

    def wait(self, job_ids: Iterable[int], timeout: float | None = None) -> None:
        """Block until none of these jobs reads GPU blocks any more. Unknown or finished ids
        are ignored. TimeoutError if a copy is still running after `timeout`; nothing is
        consumed either way (`poll` still names them)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        for job_id in job_ids:
            while True:
                remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
                with self._lock:
                    if not self._still_reading(job_id):
                        break
                    copy = self._reading[job_id].copy
                    if copy is None:  # not issued yet (spill first): the job thread tells us
                        if remaining is not None and remaining <= 0:
                            raise TimeoutError(
                                f"job {job_id}: GPU->host copy not issued after {timeout} s"
                            )
                        self._ended.wait(remaining)
                        continue
                try:
                    copy.wait(remaining)
                except TimeoutError:
                    raise TimeoutError(
                        f"job {job_id}: GPU->host copy not done after {timeout} s"
                    ) from None
                except Exception:
                    pass  # the copy failed: it reads nothing any more
                break
