"""flexkv-py: a KV-cache storage tier for vLLM (GPU → pinned host → SSD → object store)."""

from flexkv_py._native import BatchHandle, BlockResult, BlockStore, HostPool
from flexkv_py.errors import (
    BlockNotFoundError,
    ClosedError,
    ConfigError,
    CorruptBlockError,
    FlexKVError,
    InternalStateError,
    IoEngineError,
    StorageFullError,
    StoreLockedError,
    TraceFormatError,
    TransferError,
    UnsupportedKVLayoutError,
)

__version__ = "0.1.0"

__all__ = [
    "BatchHandle",
    "BlockNotFoundError",
    "BlockResult",
    "BlockStore",
    "ClosedError",
    "ConfigError",
    "CorruptBlockError",
    "FlexKVError",
    "HostPool",
    "InternalStateError",
    "IoEngineError",
    "StorageFullError",
    "StoreLockedError",
    "TraceFormatError",
    "TransferError",
    "UnsupportedKVLayoutError",
    "__version__",
]
