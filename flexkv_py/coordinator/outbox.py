"""The manager's jobs in flight, each with the part that applies its result, and the background
jobs waiting for the workers' next `take_jobs`.

A job's purpose (a store, a load, a spill, a write-behind upload, a prefetch...) is the callback
it was registered with: `CacheManager.complete` pops the job and calls it, so no part keeps a
table of job ids to tell whose result came back. Not locked: the manager's lock covers it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

from flexkv_py.coordinator.jobs import DropJob, Job, JobResult, LoadJob, StoreJob

# Applies a job's (merged) result: the part that planned the job, with what it must remember.
Done = Callable[[Job, JobResult], None]


class Outbox:
    def __init__(self) -> None:
        self._ids = itertools.count(1)
        self._inflight: dict[int, tuple[Job, Done]] = {}
        self._background: list[Job] = []

    def new_id(self) -> int:
        return next(self._ids)

    def track(self, job: Job, done: Done, *, background: bool = False) -> None:
        """`job` is in flight until its result comes back to `done`; `background`: it is also
        queued for the workers' next `take_jobs` (a foreground job goes out with its step)."""
        self._inflight[job.job_id] = (job, done)
        if background:
            self._background.append(job)

    def send(self, job: DropJob, *, first: bool = False) -> None:
        """Queue an untracked delete for the next `take_jobs` (its result still comes back:
        `CacheManager.complete` handles a drop it does not track). `first`: before the rest."""
        if first:
            self._background.insert(0, job)
        else:
            self._background.append(job)

    def pop(self, job_id: int) -> tuple[Job, Done] | None:
        return self._inflight.pop(job_id, None)

    def forget(self, job_id: int) -> None:
        """Drop a job that was never handed out (it was split into parts)."""
        del self._inflight[job_id]

    def unqueue(self, job: Job) -> None:
        """Take `job` back from the background queue: its caller submits it at once."""
        self._background.remove(job)

    def take_background(self) -> list[Job]:
        jobs, self._background = self._background, []
        return jobs

    def busy(self) -> bool:
        """Background jobs queued, or a load or store in flight: the workers have work that a
        write-behind must not delay."""
        return bool(self._background) or any(
            isinstance(job, (LoadJob, StoreJob)) for job, _ in self._inflight.values()
        )

    def __len__(self) -> int:
        return len(self._inflight)
