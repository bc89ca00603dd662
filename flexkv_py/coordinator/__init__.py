"""Moves blocks between tiers: a scheduler-side manager that decides and emits jobs, a worker-side
executor that runs them, and an in-process engine combining both."""

from __future__ import annotations

from flexkv_py.coordinator.engine import BlockOutcome, CacheEngine, EngineHandle
from flexkv_py.coordinator.executor import ExecutorOptions, JobExecutor, JobHandle
from flexkv_py.coordinator.host_side import build_host_side
from flexkv_py.coordinator.jobs import (
    DropJob,
    Drops,
    Job,
    JobResult,
    LoadJob,
    SpillJob,
    StoreJob,
    store_job,
)
from flexkv_py.coordinator.manager import CacheManager, KVEvent
from flexkv_py.coordinator.planning import host_slots_for, slot_nbytes_for

__all__ = [
    "BlockOutcome",
    "CacheEngine",
    "CacheManager",
    "DropJob",
    "Drops",
    "EngineHandle",
    "ExecutorOptions",
    "Job",
    "JobExecutor",
    "JobHandle",
    "JobResult",
    "KVEvent",
    "LoadJob",
    "SpillJob",
    "StoreJob",
    "build_host_side",
    "host_slots_for",
    "slot_nbytes_for",
    "store_job",
]
