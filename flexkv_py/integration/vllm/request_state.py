"""What the scheduler side tracks per request and per job in flight."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.v1.request import Request


@dataclass
class RequestState:
    """A request the scheduler side plans loads and stores for."""

    request: Request
    # Leading blocks already handed to the store planner (stored, in flight, or skipped).
    planned_blocks: int = 0
    # Store jobs that still read GPU blocks this request holds (on some rank).
    store_jobs: set[int] = field(default_factory=set)
    load_job: int | None = None
    # Between the async-load answer and the request's finished_recving (vLLM's view).
    loading: bool = False
    finished: bool = False
    # Where this request's load ends (a block count), while one is planned or in flight.
    load_end: int = 0
    # Where its last failed load ended: a load is offered again only if it ends before (the
    # failure made the index forget the blocks it could not bring: progress, never a loop).
    failed_load_end: int | None = None
    # Such a load was offered and vLLM has not allocated for it yet: asked again before it
    # does, vLLM refused it (see scheduler_side.get_num_new_matched_tokens), so no more loads.
    reoffer_pending: bool = False
    no_more_loads: bool = False

    @property
    def done(self) -> bool:
        """Finished, and nothing in flight still needs its blocks."""
        return self.finished and not self.store_jobs and not self.loading and self.load_job is None


@dataclass
class JobInfo:
    """A job in flight on the workers, until every rank reported its result."""

    job_id: int
    req_id: str | None
    kind: str
    keys: tuple[bytes, ...]
    results: list[Any] = field(default_factory=list)
    # Ranks whose GPU->host copy of this store ended (counted like results: one per rank).
    gpu_read_ranks: int = 0


class LoadingKeys:
    """Keys some load job is bringing into GPU blocks (a count per key: several requests may
    load the same prefix). A request whose hit overlaps them waits and takes the prefix from
    the GPU prefix cache once the load is done, rather than load it twice."""

    def __init__(self) -> None:
        self._count: dict[bytes, int] = {}

    def __bool__(self) -> bool:
        return bool(self._count)

    def add(self, keys: Iterable[bytes]) -> None:
        for k in keys:
            self._count[k] = self._count.get(k, 0) + 1

    def release(self, keys: Iterable[bytes]) -> None:
        for k in keys:
            n = self._count.get(k, 0) - 1
            if n > 0:
                self._count[k] = n
            else:
                self._count.pop(k, None)

    def any_of(self, keys: Iterable[bytes]) -> bool:
        return any(k in self._count for k in keys)
