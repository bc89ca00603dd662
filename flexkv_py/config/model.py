"""The effective configuration (typed, immutable) and where each value came from."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from flexkv_py.config.admission import AdmissionSpec, parse_admission
from flexkv_py.config.choices import (
    CacheSizeScope,
    Compression,
    ContentHash,
    Durability,
    EvictionPolicy,
    HostPoolInit,
    IoEngine,
    LoadFailurePolicy,
    LogLevel,
    TransferEngine,
)

GIB = 1 << 30


@dataclass(frozen=True)
class FlexKVConfig:
    cpu_cache_gb: float = 16.0
    ssd_cache_gb: float = 0.0
    ssd_cache_dir: tuple[str, ...] = ()
    enable_gds: bool = False
    eviction_policy: EvictionPolicy = "lru"
    admission: str = "write_back"
    write_behind_lag_s: float = 2.0
    write_behind_mib_s: float = 256.0
    ssd_io_engine: IoEngine = "auto"
    iouring_entries: int = 512
    ssd_compression: Compression = "none"
    zstd_level: int = 1
    content_hash: ContentHash = "xxh3-128"
    durability: Durability = "process"
    ssd_preallocate: bool = True
    ssd_io_timeout_s: float = 5.0
    shutdown_drain_s: float = 2.0
    log_level: LogLevel = "INFO"
    enable_metrics: bool = False
    object_store_url: str | None = None
    object_store_endpoint: str | None = None
    object_store_region: str | None = None
    object_store_allow_http: bool = False
    object_store_allow_weak_hash: bool = False
    object_store_write_through: bool = False
    object_store_lookup_wait_s: float = 2.0
    object_store_io_timeout_s: float = 30.0
    object_store_hint_cap: int = 1 << 20
    object_store_gc_ttl_s: float = 0.0
    object_store_gc_budget_gb: float = 0.0
    object_store_gc_interval_s: float = 300.0
    object_store_prefetch_blocks: int = 256
    transfer_engine: TransferEngine = "auto"
    host_huge_pages: bool = True
    host_pool_init: HostPoolInit = "auto"
    max_file_size_gb: float | None = None
    load_failure_policy: LoadFailurePolicy = "recompute"
    model_identity: str | None = None
    model_epoch: int = 0
    instance_num: int = 1
    instance_id: int = 0
    cache_size_scope: CacheSizeScope = "engine"
    share_node_shards: bool = True
    sliding_store_interval_blocks: int = 1

    @property
    def ssd_enabled(self) -> bool:
        return self.ssd_cache_gb > 0

    @property
    def object_enabled(self) -> bool:
        return self.object_store_url is not None

    @property
    def cpu_cache_bytes(self) -> int:
        return int(self.cpu_cache_gb * GIB)

    @property
    def ssd_cache_bytes(self) -> int:
        return int(self.ssd_cache_gb * GIB)

    @property
    def admission_spec(self) -> AdmissionSpec:
        return parse_admission(self.admission)

    def as_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True)
class ResolvedConfig:
    """`config` plus, per key, its origin: "default", "env:FLEXKV_X", "file:<path>", "override"."""

    config: FlexKVConfig
    sources: dict[str, str] = field(default_factory=dict)
    config_path: str | None = None

    def rows(self) -> list[tuple[str, Any, str]]:
        """(key, value, source) in schema order, for printing."""
        return [(k, v, self.sources.get(k, "default")) for k, v in self.config.as_dict().items()]
