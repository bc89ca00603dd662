"""What the scheduler side tracks per request and per job in flight."""

from __future__ import annotations

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
