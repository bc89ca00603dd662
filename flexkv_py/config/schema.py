"""Every configuration key: its type, default and one line of help.

A key is FlexKV's env var name minus ``FLEXKV_``, lower-cased (``FLEXKV_CPU_CACHE_GB`` ->
``cpu_cache_gb``). The same keys are accepted from env, a config file and vLLM's
``kv_connector_extra_config``. `coerce` turns a raw value (an env string or a YAML/JSON value)
into the key's type; range and cross-key checks live in `validate.py`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from flexkv_py.config import choices
from flexkv_py.config.admission import parse_admission
from flexkv_py.errors import ConfigError

ENV_PREFIX = "FLEXKV_"
CONFIG_PATH_ENV = "FLEXKV_CONFIG_PATH"

# The accepted values, from the Literals in choices.py (the model's field types).
EVICTION_POLICIES = choices.values(choices.EvictionPolicy)
SSD_IO_ENGINES = choices.values(choices.IoEngine)
SSD_COMPRESSIONS = choices.values(choices.Compression)
CONTENT_HASHES = choices.values(choices.ContentHash)
DURABILITIES = choices.values(choices.Durability)
LOG_LEVELS = choices.values(choices.LogLevel)
TRANSFER_ENGINES = choices.values(choices.TransferEngine)
LOAD_FAILURE_POLICIES = choices.values(choices.LoadFailurePolicy)
HOST_POOL_INITS = choices.values(choices.HostPoolInit)
CACHE_SIZE_SCOPES = choices.values(choices.CacheSizeScope)

# FlexKV server-mode variables that mean nothing for an in-process tier: one info line each.
INERT_ENV: dict[str, str] = {
    "FLEXKV_SERVER_RECV_PORT": "flexkv-py runs inside the engine; there is no FlexKV server",
    "FLEXKV_ENABLE_MPS": "flexkv-py starts no CUDA MPS daemon",
}

_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off", ""})


def _as_float(key: str, value: Any) -> float:
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected a number, got a boolean {value!r}")
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            pass
    raise ConfigError(f"{key}: expected a number, got {value!r}")


def _as_int(key: str, value: Any) -> int:
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected an integer, got a boolean {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
    raise ConfigError(f"{key}: expected an integer, got {value!r}")


def _as_bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        text = value.strip().lower()
        if text in _TRUE:
            return True
        if text in _FALSE:
            return False
    raise ConfigError(f"{key}: expected a boolean (true/false/1/0), got {value!r}")


def _as_str(key: str, value: Any) -> str:
    if isinstance(value, str):
        return value.strip()
    raise ConfigError(f"{key}: expected a string, got {type(value).__name__} {value!r}")


def _as_optional_str(key: str, value: Any) -> str | None:
    if value is None:
        return None
    text = _as_str(key, value)
    return text or None


def _as_dirs(key: str, value: Any) -> tuple[str, ...]:
    """FlexKV's ';'-separated string, or a list of strings (file / overrides)."""
    if isinstance(value, str):
        parts = value.split(";")
    elif isinstance(value, (list, tuple)):
        parts = []
        for item in value:
            if not isinstance(item, str):
                raise ConfigError(f"{key}: every directory must be a string, got {item!r}")
            parts.extend(item.split(";"))
    else:
        raise ConfigError(f"{key}: expected a ';'-separated string or a list, got {value!r}")
    return tuple(p.strip() for p in parts if p.strip())


def _as_admission(key: str, value: Any) -> str:
    return str(parse_admission(_as_str(key, value), key=key))


class _Choice:
    """The parser of a closed-set key; `choices` stays readable (tests, help)."""

    def __init__(self, *choices: str, upper: bool = False) -> None:
        self.choices = choices
        self.upper = upper

    def __call__(self, key: str, value: Any) -> str:
        text = _as_str(key, value)
        text = text.upper() if self.upper else text.lower()
        if text not in self.choices:
            raise ConfigError(
                f"{key}: unknown value {value!r}; expected one of {', '.join(self.choices)}"
            )
        return text


@dataclass(frozen=True)
class Field:
    key: str
    parse: Callable[[str, Any], Any]
    default: Any
    help: str

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.key.upper()

    @property
    def choices(self) -> tuple[str, ...] | None:
        """The accepted values of a closed-set key, else None."""
        return self.parse.choices if isinstance(self.parse, _Choice) else None


FIELDS: tuple[Field, ...] = (
    Field("cpu_cache_gb", _as_float, 16.0, "host (pinned memory) tier size in GiB, > 0"),
    Field("ssd_cache_gb", _as_float, 0.0, "SSD tier size in GiB; 0 disables the SSD tier"),
    Field("ssd_cache_dir", _as_dirs, (), "SSD directories, ';'-separated, one per disk"),
    Field("enable_gds", _as_bool, False, "GPU Direct Storage (FlexKV key; not supported: false)"),
    Field("eviction_policy", _Choice(*EVICTION_POLICIES), "lru", "host and SSD eviction"),
    Field("admission", _as_admission, "write_back", "host->SSD admission, see config/admission.py"),
    Field(
        "write_behind_lag_s",
        _as_float,
        2.0,
        "host blocks reach the SSD in the background within about this lag (warm after a "
        "restart or crash); 0 turns write-behind off (blocks reach the SSD only when evicted)",
    ),
    Field(
        "write_behind_mib_s",
        _as_float,
        256.0,
        "write-behind rate limit per rank in MiB/s, > 0 (loads and stores go first)",
    ),
    Field("ssd_io_engine", _Choice(*SSD_IO_ENGINES), "auto", "SSD I/O engine"),
    Field("iouring_entries", _as_int, 512, "SSD queue depth (io_uring entries)"),
    Field("ssd_compression", _Choice(*SSD_COMPRESSIONS), "none", "SSD block compression"),
    Field("zstd_level", _as_int, 1, "zstd level when ssd_compression=zstd (1..22)"),
    Field("content_hash", _Choice(*CONTENT_HASHES), "xxh3-128", "SSD dedup/checksum hash"),
    Field(
        "durability",
        _Choice(*DURABILITIES),
        "process",
        "acked SSD writes survive process|power loss",
    ),
    Field("ssd_preallocate", _as_bool, True, "fallocate SSD files at start"),
    Field(
        "ssd_io_timeout_s",
        _as_float,
        5.0,
        "longest wait for one SSD batch, > 0; later: its blocks fail (io_timeout), recompute",
    ),
    Field(
        "shutdown_drain_s",
        _as_float,
        2.0,
        "at worker shutdown, host blocks not yet on the SSD are written within this budget, "
        ">= 0 (vLLM kills workers after VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS, 5 by default)",
    ),
    Field(
        "log_level",
        _Choice(*LOG_LEVELS, upper=True),
        "INFO",
        "flexkv_py logger level, applied when set (unset: the host application's logging)",
    ),
    Field("enable_metrics", _as_bool, False, "export connector metrics/stats"),
    Field(
        "object_store_url",
        _as_optional_str,
        None,
        "object tier shared by the fleet: s3://bucket/prefix, gs://, az://, file:///path or "
        "memory:// (unset: off); S3 credentials only from the AWS_* environment",
    ),
    Field("object_store_endpoint", _as_optional_str, None, "S3-compatible endpoint URL"),
    Field("object_store_region", _as_optional_str, None, "S3 region"),
    Field("object_store_allow_http", _as_bool, False, "allow a plain-HTTP object endpoint"),
    Field(
        "object_store_allow_weak_hash",
        _as_bool,
        False,
        "accept a non-sha256 engine block hash with a shared object tier (collision risk)",
    ),
    Field(
        "object_store_write_through",
        _as_bool,
        False,
        "copy stored blocks to the object tier at store time too (default: write-behind only)",
    ),
    Field(
        "object_store_lookup_wait_s",
        _as_float,
        2.0,
        "longest a request waits (skipped by the scheduler, never blocking a step) for the "
        "bucket's answer, > 0; later: a miss",
    ),
    Field(
        "object_store_io_timeout_s",
        _as_float,
        30.0,
        "longest wait for one object-store batch (a load's sub-batch, a write-behind job), > 0; "
        "later: its blocks fail (io_timeout), recompute",
    ),
    Field(
        "object_store_hint_cap",
        _as_int,
        1 << 20,
        "object-tier presence hints (blocks known to be in the bucket) kept per rank, >= 0; "
        "past it the oldest are forgotten (asked of the bucket again)",
    ),
    Field(
        "object_store_gc_ttl_s",
        _as_float,
        0.0,
        "background GC: chains unused this long are collected; 0: no background GC here",
    ),
    Field(
        "object_store_gc_budget_gb",
        _as_float,
        0.0,
        "background GC: byte budget of the bucket prefix in GiB, least recently used chains "
        "go first; 0: no budget",
    ),
    Field(
        "object_store_gc_interval_s",
        _as_float,
        300.0,
        "background GC: seconds between passes (one worker holds the lease), > 0",
    ),
    Field(
        "object_store_prefetch_blocks",
        _as_int,
        256,
        "most blocks of a bucket hit moved object -> host before the request's load (free "
        "host slots only); 0: off",
    ),
    Field("transfer_engine", _Choice(*TRANSFER_ENGINES), "auto", "GPU<->host copy engine"),
    Field("host_huge_pages", _as_bool, True, "back the host pool with huge pages if possible"),
    Field(
        "host_pool_init",
        _Choice(*HOST_POOL_INITS),
        "auto",
        "touch/pin the host pool at start (sync) or chunk by chunk while serving (background); "
        "auto: background from 4 GiB per rank",
    ),
    Field("max_file_size_gb", _as_float, None, "FlexKV key, accepted and ignored"),
    Field(
        "load_failure_policy",
        _Choice(*LOAD_FAILURE_POLICIES),
        "recompute",
        "a failed load recomputes (default) or fails the request (vLLM's policy is set to it)",
    ),
    Field(
        "model_identity",
        _as_optional_str,
        None,
        "share blocks across renamed copies of one checkpoint: replaces the model's own identity "
        "(config, weights, served name) in every key",
    ),
    Field("model_epoch", _as_int, 0, "bump after changing weights in place: old blocks never hit"),
    Field(
        "instance_num",
        _as_int,
        1,
        "FlexKV: engines sharing this node's cache; > 1: the sizes are the node's, divided "
        "among them, and each engine has its own SSD shards (instance_id)",
    ),
    Field(
        "instance_id",
        _as_int,
        0,
        "FlexKV: this engine's index among instance_num (its SSD shard directory name)",
    ),
    Field(
        "cache_size_scope",
        _Choice(*CACHE_SIZE_SCOPES),
        "engine",
        "cpu_cache_gb / ssd_cache_gb size each engine, or the node: divided among its engines "
        "(instance_num, else vLLM's data-parallel ranks on this node)",
    ),
    Field(
        "share_node_shards",
        _as_bool,
        True,
        "read blocks other engines of the same model on this node stored in their SSD shards "
        "(opened read-only)",
    ),
    Field(
        "sliding_store_interval_blocks",
        _as_int,
        1,
        "hybrid models: a sliding-window group stores only the window before every N-th block "
        "boundary and a request's last window (1: every block); hits then end on those",
    ),
)

FIELDS_BY_KEY: dict[str, Field] = {f.key: f for f in FIELDS}


def coerce(key: str, value: Any) -> Any:
    field = FIELDS_BY_KEY.get(key)
    if field is None:
        known = ", ".join(FIELDS_BY_KEY)
        raise ConfigError(f"{key}: unknown configuration key; known keys: {known}")
    if value is None and field.default is None:
        return None
    return field.parse(key, value)
