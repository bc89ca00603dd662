"""KV-reuse workloads for `flexkv-py replay`: a synthetic chat/document generator and a reader
for Mooncake FAST'25 JSONL traces. Both yield `Request`s carrying per-block keys."""

from __future__ import annotations

from flexkv_py.cli.workloads.base import Request, Workload
from flexkv_py.cli.workloads.mooncake import TraceFormatError, read_mooncake_trace
from flexkv_py.cli.workloads.synthetic import SyntheticSpec, generate_synthetic

__all__ = [
    "Request",
    "SyntheticSpec",
    "TraceFormatError",
    "Workload",
    "generate_synthetic",
    "read_mooncake_trace",
]
