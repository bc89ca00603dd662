"""Remote lookups the scheduler can ask without waiting on the network inside a step.

vLLM asks the connector, every step, how many of a request's blocks it can load; `None` means
"ask again later" and the request is skipped for that step. `PendingLookups.poll` submits the
lookup the first time it is asked (`submit`, e.g. the object tier's `submit_lookup_chain`: it
runs on the tier's runtime and returns a handle at once), answers `None` while that is in
flight, then the count once done — or 0 (a miss) once it has been in flight for `max_wait_s`,
so a slow or dead store delays a request by a bounded time and never stalls the scheduler.
Answers are kept until `forget` (the request finished or was preempted); dropping a handle
before its answer aborts its lookup.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Protocol

from flexkv_py.errors import ConfigError, FlexKVError

logger = logging.getLogger(__name__)


class LookupHandle(Protocol):
    """A submitted lookup (`_native.LookupHandle`)."""

    def done(self) -> bool: ...
    def result(self, timeout: float | None = None) -> int: ...


Submit = Callable[[Sequence[bytes]], LookupHandle]


@dataclass
class _Lookup:
    handle: LookupHandle | None  # None once answered (`answer`)
    started: float
    n_keys: int
    answer: int | None = None
    gave_up: bool = False


def _answer(handle: LookupHandle, timeout: float | None) -> int:
    """The handle's count; a failed lookup is a miss (TimeoutError: still running)."""
    try:
        return handle.result(timeout)
    except FlexKVError as e:
        logger.warning("object tier lookup failed: %s", e)
        return 0


class PendingLookups:
    def __init__(
        self,
        submit: Submit,
        max_wait_s: float = 2.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not max_wait_s > 0:
            raise ConfigError(f"object lookup max_wait_s: must be > 0, got {max_wait_s}")
        self._submit = submit
        self.max_wait_s = max_wait_s
        self._clock = clock
        self._lookups: dict[Hashable, _Lookup] = {}
        self._lock = threading.Lock()
        self._closed = False
        self.gave_up = 0  # lookups answered 0 because they took longer than max_wait_s

    def _start(self, keys: Sequence[bytes]) -> _Lookup:
        started = self._clock()
        if self._closed:
            return _Lookup(None, started, len(keys), answer=0)
        try:
            return _Lookup(self._submit(list(keys)), started, len(keys))
        except FlexKVError as e:  # a lookup that cannot be submitted is a miss
            logger.warning("object tier lookup failed: %s", e)
            return _Lookup(None, started, len(keys), answer=0)

    def poll(self, request_id: Hashable, keys: Sequence[bytes]) -> int | None:
        """Blocks of `keys` (root first) the store holds; None: ask again later. A request
        whose prompt grew since the last ask is looked up again."""
        with self._lock:
            entry = self._lookups.get(request_id)
            if entry is None or entry.n_keys != len(keys):
                entry = self._lookups[request_id] = self._start(keys)
            if entry.gave_up:
                return 0
            if entry.handle is not None and entry.handle.done():
                entry.answer, entry.handle = _answer(entry.handle, None), None
            if entry.answer is not None:
                return entry.answer
            if self._clock() - entry.started >= self.max_wait_s:
                entry.gave_up = True
                self.gave_up += 1
                return 0
            return None

    def wait(self, request_id: Hashable, timeout: float | None = None) -> int | None:
        """Block until the request's lookup finished; its count, or None if never asked."""
        with self._lock:
            entry = self._lookups.get(request_id)
            handle = None if entry is None else entry.handle
        if entry is None:
            return None
        if handle is None:
            assert entry.answer is not None
            return entry.answer
        try:
            return _answer(handle, timeout)
        except TimeoutError as e:
            raise TimeoutError(f"object lookup of {request_id!r} still running") from e

    def forget(self, request_id: Hashable) -> None:
        """Drop the request's answer; a lookup still in flight is aborted."""
        with self._lock:
            self._lookups.pop(request_id, None)

    def close(self) -> None:
        """Stop taking lookups (later polls are misses) and abort those in flight."""
        with self._lock:
            self._closed = True
            self._lookups.clear()
