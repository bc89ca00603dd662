"""Every closed set of configuration values, defined once as a `Literal`.

The schema's parsers, the config model's field types and the native module's `.pyi` all use
these; tests check each against what the schema accepts and, for the values Rust parses, what
the native store accepts. `values(Lit)` is the runtime tuple of a Literal.
"""

from __future__ import annotations

from typing import Any, Literal, get_args

# Host tier eviction (LFU counts hits, which only the host tier sees).
EvictionPolicy = Literal["lru", "fifo", "lfu"]
AdmissionMode = Literal["write_back", "write_through"]
IoEngine = Literal["auto", "io_uring", "psync"]
Compression = Literal["none", "zstd"]
ContentHash = Literal["xxh3-128", "blake3"]
Durability = Literal["process", "power"]
LogLevel = Literal["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"]
TransferEngine = Literal["auto", "staged", "triton", "copy_engine", "torch"]
LoadFailurePolicy = Literal["recompute", "fail"]  # vLLM's kv_load_failure_policy
HostPoolInit = Literal["auto", "sync", "background"]
# What cpu_cache_gb / ssd_cache_gb size: one engine, or every engine of the node together.
CacheSizeScope = Literal["engine", "node"]


def values(literal: Any) -> tuple[str, ...]:
    """The values of a Literal, in declaration order."""
    return tuple(get_args(literal))
