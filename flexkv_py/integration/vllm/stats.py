"""Connector metrics: vLLM `KVConnectorStats` (logged by the engine) and Prometheus metrics.

All values are counters summed over ranks and steps; `reduce()` turns them into rates for logs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
    PromMetric,
    PromMetricT,
)

# Counter names (data keys). Worker side: *_jobs, *_blocks, *_bytes, *_seconds, *_failed_blocks.
# Scheduler side: lookup_blocks, hit_blocks, hit_blocks_host, hit_blocks_ssd.
COUNTERS = (
    "lookup_blocks",
    "hit_blocks",
    "hit_blocks_host",
    "hit_blocks_ssd",
    "load_jobs",
    "load_blocks",
    "load_bytes",
    "load_seconds",
    "load_failed_blocks",
    "store_jobs",
    "store_blocks",
    "store_bytes",
    "store_seconds",
    "store_failed_blocks",
    "flush_timeouts",  # preemption flushes that gave up waiting for a GPU->host copy
    "store_abandoned_jobs",  # stores failed because their GPU blocks were reused mid-copy
    "ssd_io_timeout_blocks",  # blocks whose SSD I/O ran past ssd_io_timeout_s (recomputed)
    "ssd_unavailable",  # workers whose SSD tier could not be opened (host tier only)
    # Requests whose load failed: lookups answered "recompute", and loads offered again that
    # vLLM refused (scheduler_side._no_reload).
    "lookups_after_failed_load",
    "reloads_refused_by_vllm",
    # The object tier (tiers/object/counters.py): the workers' requests and failures, the
    # scheduler's lookups ("ask again later" answers, give-ups after the wait, its requests).
    "object_requests",
    "object_io_errors",
    "object_timeouts",
    "object_lookups_asked_later",
    "object_lookups_gave_up",
    "object_lookup_requests",
    "object_lookup_io_errors",
    "object_lookup_timeouts",
)


@dataclass
class FlexKVConnectorStats(KVConnectorStats):
    data: dict[str, Any] = field(default_factory=dict)

    def add(self, key: str, value: float) -> None:
        if value:
            self.data[key] = self.data.get(key, 0) + value

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in (other.data or {}).items():
            if isinstance(v, (int, float)):
                self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        d = self.data
        out: dict[str, int | float] = {k: d.get(k, 0) for k in COUNTERS if d.get(k)}
        lookups = d.get("lookup_blocks", 0)
        if lookups:
            out["hit_rate"] = round(d.get("hit_blocks", 0) / lookups, 4)
        for kind in ("load", "store"):
            secs, nbytes, jobs = (
                d.get(f"{kind}_seconds", 0),
                d.get(f"{kind}_bytes", 0),
                d.get(f"{kind}_jobs", 0),
            )
            if secs:
                out[f"{kind}_gbps"] = round(nbytes / secs / 1e9, 3)
            if jobs:
                out[f"{kind}_avg_ms"] = round(1000 * secs / jobs, 3)
        return out

    def is_empty(self) -> bool:
        return not any(self.data.values())


def metrics_enabled(enable_metrics: bool | None = None) -> bool:
    if enable_metrics:
        return True
    return os.environ.get("FLEXKV_ENABLE_METRICS", "0").strip().lower() in ("1", "true", "yes")


class FlexKVPromMetrics(KVConnectorPromMetrics):
    """Prometheus counters per engine: blocks hit per tier, bytes moved, transfer seconds,
    failed blocks; plus a histogram of per-job transfer latency derived from each interval."""

    def __init__(
        self,
        vllm_config: Any,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._labelvalues = per_engine_labelvalues
        self._counters: dict[str, dict[int, Any]] = {}
        for key in COUNTERS:
            metric = self._counter_cls(
                name=f"vllm:flexkv_{key}",
                documentation=f"FlexKV connector: {key.replace('_', ' ')}",
                labelnames=labelnames,
            )
            self._counters[key] = self.create_metric_per_engine(metric)
        histogram: Any = self._histogram_cls  # a Histogram class (vLLM types it as a union)
        latency = histogram(
            name="vllm:flexkv_transfer_job_seconds",
            documentation="FlexKV connector: mean job latency per logging interval",
            labelnames=[*labelnames, "direction"],
            buckets=[0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5],
        )
        self._latency = latency

    def create_metric_per_engine(self, metric: Any) -> dict[int, Any]:
        return {idx: metric.labels(*values) for idx, values in self._labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, per_engine in self._counters.items():
            value = transfer_stats_data.get(key, 0)
            if value and engine_idx in per_engine:
                per_engine[engine_idx].inc(value)
        for kind in ("load", "store"):
            jobs = transfer_stats_data.get(f"{kind}_jobs", 0)
            if jobs and engine_idx in self._labelvalues:
                mean = transfer_stats_data.get(f"{kind}_seconds", 0) / jobs
                self._latency.labels(*self._labelvalues[engine_idx], kind).observe(mean)
