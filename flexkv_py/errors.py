"""Public exception types (defined by the native extension, re-exported here)."""

from __future__ import annotations

from flexkv_py._native import (
    BlockNotFoundError,
    ConfigError,
    CorruptBlockError,
    FlexKVError,
    IoEngineError,
    StorageFullError,
    StoreLockedError,
)

__all__ = [
    "BlockNotFoundError",
    "ConfigError",
    "CorruptBlockError",
    "FlexKVError",
    "IoEngineError",
    "StorageFullError",
    "StoreLockedError",
]
