"""Remote lookups the scheduler can ask without waiting on the network inside a step.

vLLM asks the connector, every step, how many of a request's blocks it can load; `None` means
"ask again later" and the request is skipped for that step. `PendingLookups.poll` starts the
object tier's `lookup_chain` on a small thread pool the first time it is asked, answers `None`
while that is in flight, then the count once done — or 0 (a miss) once it has been in flight
for `max_wait_s`, so a slow or dead store delays a request by a bounded time and never stalls
the scheduler. Answers are kept until `forget` (the request finished or was preempted).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass

from flexkv_py.errors import ConfigError, FlexKVError

logger = logging.getLogger(__name__)


@dataclass
class _Lookup:
    future: Future[int]
    started: float
    n_keys: int
    gave_up: bool = False


class PendingLookups:
    def __init__(
        self,
        lookup_chain: Callable[[Sequence[bytes]], int],
        max_wait_s: float = 2.0,
        workers: int = 4,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not max_wait_s > 0:
            raise ConfigError(f"object lookup max_wait_s: must be > 0, got {max_wait_s}")
        self._lookup_chain = lookup_chain
        self.max_wait_s = max_wait_s
        self._clock = clock
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="flexkv-object-lookup")
        self._lookups: dict[Hashable, _Lookup] = {}
        self._lock = threading.Lock()
        self.gave_up = 0  # lookups answered 0 because they took longer than max_wait_s

    def _run(self, keys: list[bytes]) -> int:
        try:
            return self._lookup_chain(keys)
        except FlexKVError as e:  # a failed lookup is a miss
            logger.warning("object tier lookup failed: %s", e)
            return 0

    def poll(self, request_id: Hashable, keys: Sequence[bytes]) -> int | None:
        """Blocks of `keys` (root first) the store holds; None: ask again later. A request
        whose prompt grew since the last ask is looked up again."""
        with self._lock:
            entry = self._lookups.get(request_id)
            if entry is None or entry.n_keys != len(keys):
                fut = self._pool.submit(self._run, list(keys))
                entry = _Lookup(fut, self._clock(), len(keys))
                self._lookups[request_id] = entry
            if entry.gave_up:
                return 0
            if entry.future.done():
                return entry.future.result()
            if self._clock() - entry.started >= self.max_wait_s:
                entry.gave_up = True
                self.gave_up += 1
                return 0
            return None

    def wait(self, request_id: Hashable, timeout: float | None = None) -> int | None:
        """Block until the request's lookup finished; its count, or None if never asked."""
        with self._lock:
            entry = self._lookups.get(request_id)
        if entry is None:
            return None
        try:
            return entry.future.result(timeout)
        except FutureTimeout as e:
            raise TimeoutError(f"object lookup of {request_id!r} still running") from e

    def forget(self, request_id: Hashable) -> None:
        with self._lock:
            self._lookups.pop(request_id, None)

    def close(self) -> None:
        """Stop taking lookups; running ones finish (each request is bounded by the tier)."""
        self._pool.shutdown(wait=True, cancel_futures=True)
