"""The one place that checks a whole configuration: ranges and cross-key rules.

Every error names the key (and the value) so a user can fix it without reading code.
"""

from __future__ import annotations

import logging
import math
import os

from flexkv_py.config.admission import parse_admission
from flexkv_py.config.model import FlexKVConfig
from flexkv_py.errors import ConfigError

logger = logging.getLogger(__name__)

MAX_IOURING_ENTRIES = 32768  # the kernel's IORING_MAX_ENTRIES


def _positive(key: str, value: float) -> None:
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{key}: must be a positive number, got {value!r}")


def _check_dir(key: str, path: str) -> None:
    if not os.path.isabs(path) and path.startswith("~"):
        raise ConfigError(f"{key}: '~' is not expanded; give an absolute path, got {path!r}")
    if not os.path.exists(path):
        raise ConfigError(f"{key}: directory {path!r} does not exist (create it first)")
    if not os.path.isdir(path):
        raise ConfigError(f"{key}: {path!r} is not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"{key}: directory {path!r} is not writable by this process")


def _check_instances(cfg: FlexKVConfig) -> None:
    """FlexKV's several-engines-per-node mode: `instance_num` engines share the node's sizes,
    `instance_id` names this one (its SSD shard directories, index/namespace.py)."""
    if cfg.instance_num < 1:
        raise ConfigError(f"instance_num: must be >= 1, got {cfg.instance_num}")
    if not 0 <= cfg.instance_id < cfg.instance_num:
        raise ConfigError(
            f"instance_id: must be in 0..{cfg.instance_num - 1} (instance_num "
            f"{cfg.instance_num}), got {cfg.instance_id}"
        )


OBJECT_SCHEMES = ("s3", "gs", "az", "file", "memory")


def _check_object_store(cfg: FlexKVConfig) -> None:
    """The object tier's keys (their static shape only: the bucket itself is checked when the
    tier opens, tiers/lower_tiers.py)."""
    url = cfg.object_store_url
    if url is not None:
        scheme, sep, _ = url.partition("://")
        if not sep or scheme.lower() not in OBJECT_SCHEMES:
            raise ConfigError(
                f"object_store_url: {url!r} is not an object-store URL; expected one of "
                + ", ".join(f"{s}://" for s in OBJECT_SCHEMES)
            )
    for key in ("object_store_lookup_wait_s", "object_store_gc_interval_s"):
        _positive(key, getattr(cfg, key))
    _positive("object_store_io_timeout_s", cfg.object_store_io_timeout_s)
    if cfg.object_store_hint_cap < 0:
        raise ConfigError(
            f"object_store_hint_cap: must be >= 0 (0: no hints kept), got "
            f"{cfg.object_store_hint_cap}"
        )
    for key in ("object_store_gc_ttl_s", "object_store_gc_budget_gb"):
        value = getattr(cfg, key)
        if not (value >= 0 and math.isfinite(value)):
            raise ConfigError(f"{key}: must be a finite number >= 0 (0: off), got {value!r}")
    if (blocks := cfg.object_store_prefetch_blocks) < 0:
        raise ConfigError(f"object_store_prefetch_blocks: must be >= 0 (0: off), got {blocks}")


def validate(cfg: FlexKVConfig) -> FlexKVConfig:
    """Raise ConfigError naming the first bad key; return `cfg` unchanged when it is valid."""
    _positive("cpu_cache_gb", cfg.cpu_cache_gb)
    if not math.isfinite(cfg.ssd_cache_gb) or cfg.ssd_cache_gb < 0:
        raise ConfigError(f"ssd_cache_gb: must be >= 0 (0 disables SSD), got {cfg.ssd_cache_gb!r}")
    if cfg.enable_gds:
        raise ConfigError("enable_gds: GPU Direct Storage is not supported here; set it to false")

    if cfg.ssd_enabled:
        if not cfg.ssd_cache_dir:
            raise ConfigError("ssd_cache_dir: required when ssd_cache_gb > 0 (';'-separated dirs)")
        if cfg.ssd_cache_gb <= cfg.cpu_cache_gb:
            raise ConfigError(
                f"ssd_cache_gb: the SSD tier ({cfg.ssd_cache_gb:g} GiB) must be larger than the "
                f"host tier cpu_cache_gb ({cfg.cpu_cache_gb:g} GiB); it holds everything the host "
                "tier evicts"
            )
        seen: dict[str, str] = {}
        for path in cfg.ssd_cache_dir:
            _check_dir("ssd_cache_dir", path)
            real = os.path.realpath(path)
            if real in seen:
                raise ConfigError(
                    f"ssd_cache_dir: {path!r} and {seen[real]!r} are the same directory"
                )
            seen[real] = path
    elif cfg.ssd_cache_dir:
        logger.warning("ssd_cache_dir is set but ssd_cache_gb is 0: the SSD tier is disabled")

    if not 1 <= cfg.iouring_entries <= MAX_IOURING_ENTRIES:
        raise ConfigError(
            f"iouring_entries: must be in 1..{MAX_IOURING_ENTRIES}, got {cfg.iouring_entries}"
        )
    if not (cfg.ssd_io_timeout_s > 0 and math.isfinite(cfg.ssd_io_timeout_s)):
        raise ConfigError(
            f"ssd_io_timeout_s: must be a finite number > 0, got {cfg.ssd_io_timeout_s}"
        )
    if not (cfg.shutdown_drain_s >= 0 and math.isfinite(cfg.shutdown_drain_s)):
        raise ConfigError(
            f"shutdown_drain_s: must be a finite number >= 0, got {cfg.shutdown_drain_s}"
        )
    if not (cfg.write_behind_lag_s >= 0 and math.isfinite(cfg.write_behind_lag_s)):
        raise ConfigError(
            f"write_behind_lag_s: must be a finite number >= 0, got {cfg.write_behind_lag_s}"
        )
    if not (cfg.write_behind_mib_s > 0 and math.isfinite(cfg.write_behind_mib_s)):
        raise ConfigError(
            f"write_behind_mib_s: must be a finite number > 0, got {cfg.write_behind_mib_s}"
        )
    if cfg.sliding_store_interval_blocks < 1:
        raise ConfigError(
            f"sliding_store_interval_blocks: must be >= 1, got {cfg.sliding_store_interval_blocks}"
        )
    if not 1 <= cfg.zstd_level <= 22:
        raise ConfigError(f"zstd_level: must be in 1..22, got {cfg.zstd_level}")
    parse_admission(cfg.admission)
    _check_object_store(cfg)
    _check_instances(cfg)
    if cfg.max_file_size_gb is not None:
        _positive("max_file_size_gb", cfg.max_file_size_gb)
        logger.warning("max_file_size_gb is accepted for FlexKV compatibility and ignored")
    return cfg
