"""flexkv-py: a KV-cache storage tier for vLLM (GPU → pinned host → SSD → object store)."""

from flexkv_py._native import BatchHandle, BlockResult, BlockStore, HostPool
from flexkv_py.errors import (
    BlockNotFoundError,
    ConfigError,
    CorruptBlockError,
    FlexKVError,
    IoEngineError,
    StorageFullError,
    StoreLockedError,
)

__version__ = "0.1.0"

__all__ = [
    "BatchHandle",
    "BlockNotFoundError",
    "BlockResult",
    "BlockStore",
    "ConfigError",
    "CorruptBlockError",
    "FlexKVError",
    "HostPool",
    "IoEngineError",
    "StorageFullError",
    "StoreLockedError",
    "__version__",
]
