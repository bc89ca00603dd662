"""flexkv-py: a KV-cache storage tier for vLLM (GPU → pinned host → SSD → object store).

`HostPool` is the host tier's slotted, pinned pool (`flexkv_py.tiers.host_pool.HostPool`),
imported on first use so that ``import flexkv_py`` does not load torch. The raw region under it,
``flexkv_py._native.HostPool``, is internal.
"""

from typing import TYPE_CHECKING, Any

from flexkv_py._native import BatchHandle, BlockResult, BlockStore
from flexkv_py.errors import (
    BlockNotFoundError,
    ClosedError,
    ConfigError,
    CorruptBlockError,
    FlexKVError,
    InternalStateError,
    IoEngineError,
    StorageFullError,
    StoreClosedError,
    StoreLockedError,
    TraceFormatError,
    TransferError,
    UnsupportedKVLayoutError,
)

if TYPE_CHECKING:
    from flexkv_py.tiers.host_pool import HostPool

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
    "StoreClosedError",
    "StoreLockedError",
    "TraceFormatError",
    "TransferError",
    "UnsupportedKVLayoutError",
    "__version__",
]


def __getattr__(name: str) -> Any:
    if name == "HostPool":
        from flexkv_py.tiers.host_pool import HostPool

        return HostPool
    raise AttributeError(f"module 'flexkv_py' has no attribute {name!r}")
