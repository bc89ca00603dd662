"""The scheduler's own read of the SSD shards at a restart, on a thread of its own.

Started when the scheduler side is built, so engine start-up does not wait for it (a store of
1 M blocks takes a second or two to replay and list). Everything that reads or changes the
index waits for it first (`wait`, one flag test once done), so the first lookup already finds
the blocks, and the workers' reports are settled against what it adopted, never before it.

The wait is bounded (WAIT_S): a read still running then is abandoned (what it finds is never
adopted) and those blocks miss until the workers report, as without it. A lookup waits, it
never answers "ask again later": vLLM skips a request that gets that.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")

# Longest the first scheduler call waits for the read: 1 M blocks took 1.5-5 s on a loaded
# 2-core machine (benches/restart_read_bench.py); longer, a recompute is the cheaper miss.
WAIT_S = 5.0


class RestartRead(Generic[T]):
    def __init__(self, read: Callable[[], T], adopt: Callable[[T], None]) -> None:
        self._read = read
        self._adopt = adopt
        self._lock = threading.Lock()  # adoption and abandonment exclude each other
        self._abandoned = False
        self.adopted = False
        self.done = False
        # Not a daemon: an exit during the read waits for it (seconds) rather than stop it
        # inside the native store, which aborts the interpreter.
        self._thread = threading.Thread(target=self._run, name="flexkv-restart-read")
        self._thread.start()

    def _run(self) -> None:
        try:
            found = self._read()
        except Exception:  # the read degrades on its own; anything else must not kill serving
            logger.exception("reading the SSD shards before the workers report failed")
            return
        with self._lock:
            if self._abandoned:
                return
            try:
                self._adopt(found)
                self.adopted = True
            except Exception:
                logger.exception("adopting the SSD shards' blocks before the workers report failed")

    def wait(self, timeout: float = WAIT_S) -> None:
        """Until the read was adopted (or abandoned: after `timeout` seconds)."""
        if self.done:
            return
        self._thread.join(timeout)
        with self._lock:  # an adoption under way ends first
            self._abandoned = not self.adopted and self._thread.is_alive()
            if self._abandoned:
                logger.warning(
                    "SSD shards not read in %.1f s: blocks a previous run stored miss until the "
                    "workers report them",
                    timeout,
                )
            self.done = True
