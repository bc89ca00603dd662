"""The coordinator tests' shared fixtures-by-hand: a namespace, a config sized in slots, keys,
their deterministic pages and an engine over an unpinned host pool. Used by the unit tests under
tests/unit/ and by helpers/writers/write_behind_writer.py (a child process)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flexkv_py.config import FlexKVConfig, load_config
from flexkv_py.coordinator import CacheEngine
from flexkv_py.index import Namespace
from flexkv_py.tiers.host_pool import HostPool
from helpers.store_util import PAGE, block

GIB = 1 << 30
PAGE_BYTES = 4 * PAGE  # one "engine block" in the host-only tests


def _ns(model: str = "test/model", **kw: Any) -> Namespace:
    args: dict[str, Any] = dict(
        revision="r1", kv_dtype="bfloat16", kv_layout="LBNHC", block_size=16, page_bytes=PAGE_BYTES
    )
    args.update(kw)
    return Namespace(model, **args)


def _config(
    tmp_path: Path, host_slots: int, ssd_slots: int = 0, slot: int = PAGE_BYTES, **kw: Any
) -> FlexKVConfig:
    """A config with room for exactly `host_slots` host slots (per rank) and an SSD tier of
    `ssd_slots` blocks (header page included) in tmp_path/ssd."""
    world = kw.pop("world", 1)
    over: dict[str, Any] = {"cpu_cache_gb": host_slots * slot * world / GIB}
    if ssd_slots:
        ssd = tmp_path / "ssd"
        ssd.mkdir(exist_ok=True)
        over.update(
            ssd_cache_gb=max(ssd_slots * (slot + PAGE) * world, host_slots * slot * world + 1)
            / GIB,
            ssd_cache_dir=str(ssd),
        )
    over.update(kw)
    return load_config(over, env={})


def _keys(ns: Namespace, n: int, tag: str = "") -> list[bytes]:
    return ns.keys([f"{tag}block-{i}".encode().ljust(32, b".") for i in range(n)])


def _pages(keys: list[bytes], salt: bytes = b"") -> list[bytes]:
    return [block(salt + k, PAGE_BYTES) for k in keys]


def _engine(config: FlexKVConfig, ns: Namespace, slots: int, **kw: Any) -> CacheEngine:
    return CacheEngine(config, ns, HostPool(slots, PAGE_BYTES, pin=False), **kw)
