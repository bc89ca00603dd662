"""GPU <-> host transfers: KV layout description, batched copy engines, async handles."""

from __future__ import annotations

from flexkv_py.transfer.engine import TransferEngine, TransferHandle
from flexkv_py.transfer.errors import TransferError, UnsupportedKVLayoutError
from flexkv_py.transfer.kv_layout import KVPageGeometry, Segment, describe_kv_caches

__all__ = [
    "KVPageGeometry",
    "Segment",
    "TransferEngine",
    "TransferError",
    "TransferHandle",
    "UnsupportedKVLayoutError",
    "describe_kv_caches",
]
