"""GPU <-> host transfers: KV layout description, batched copy engines, async handles.

The names below load on first use: the coordinator imports `transfer.stream_order` on
scheduler-side and CPU-only paths, which must not pay for importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from flexkv_py._lazy import lazy_exports

if TYPE_CHECKING:
    from flexkv_py.transfer.engine import TransferEngine, TransferHandle
    from flexkv_py.transfer.errors import TransferError, UnsupportedKVLayoutError
    from flexkv_py.transfer.kv_layout import KVPageGeometry, Segment, describe_kv_caches

_WHERE = {
    "KVPageGeometry": "kv_layout",
    "Segment": "kv_layout",
    "describe_kv_caches": "kv_layout",
    "TransferEngine": "engine",
    "TransferHandle": "engine",
    "TransferError": "errors",
    "UnsupportedKVLayoutError": "errors",
}

__all__ = [
    "KVPageGeometry",
    "Segment",
    "TransferEngine",
    "TransferError",
    "TransferHandle",
    "UnsupportedKVLayoutError",
    "describe_kv_caches",
]


__getattr__ = lazy_exports(__name__, _WHERE, globals())
