"""The flexkv-py exception tree: every error the package raises on purpose is a `FlexKVError`.

The base and the tiers' errors are made by the native module (so Rust can raise them, each
mapped from one variant of the SSD store's `StoreError` or the object tier's `ObjectError`: a
closed object tier is a `StoreClosedError`, a failed request an `IoEngineError`, a refused
configuration a `ConfigError`); the Python layers' errors are defined here, on the same base.
Where callers have always caught a builtin, the class keeps it as a second base (``except
ValueError`` still catches a `ConfigError`).

FlexKVError
├── ConfigError (also ValueError)          bad configuration or input; the message names the key
├── StorageFullError                       the budget or the device has no room
├── CorruptBlockError                      stored bytes failed verification
├── IoEngineError (also OSError)           the device or the I/O engine failed
├── StoreLockedError                       another process holds the cache directory
├── StoreClosedError                       a block store used after close()
├── BlockNotFoundError (also KeyError)     the key is not stored
├── UnsupportedKVLayoutError (ValueError)  vLLM's KV cache tensors have a layout we cannot page
├── TransferError (also RuntimeError)      a GPU <-> host batch failed; none of its blocks count
├── TraceFormatError (also ValueError)     a replay trace line is not a request (CLI)
├── InternalStateError (also RuntimeError) a bug: a state transition that is not allowed
└── ClosedError (also RuntimeError)        a component used after close() / shutdown
"""

from __future__ import annotations

from flexkv_py._native import (
    BlockNotFoundError,
    ConfigError,
    CorruptBlockError,
    FlexKVError,
    IoEngineError,
    StorageFullError,
    StoreClosedError,
    StoreLockedError,
)


class UnsupportedKVLayoutError(FlexKVError, ValueError):
    """The registered KV cache tensors have a shape/stride layout we cannot page."""


class TransferError(FlexKVError, RuntimeError):
    """A GPU <-> host batch failed; no block of the batch may be trusted."""

    def __init__(self, message: str, *, direction: str, block_ids: tuple[int, ...]) -> None:
        super().__init__(message)
        self.direction = direction
        self.block_ids = block_ids


class TraceFormatError(FlexKVError, ValueError):
    """A trace line that is not a Mooncake request; the message names the line and field."""


class InternalStateError(FlexKVError, RuntimeError):
    """A bug: an index/job state transition that is not allowed, or a broken invariant."""


class ClosedError(FlexKVError, RuntimeError):
    """A component (host pool, executor, transfer engine, ...) used after close/shutdown."""


__all__ = [
    "BlockNotFoundError",
    "ClosedError",
    "ConfigError",
    "CorruptBlockError",
    "FlexKVError",
    "InternalStateError",
    "IoEngineError",
    "StorageFullError",
    "StoreClosedError",
    "StoreLockedError",
    "TraceFormatError",
    "TransferError",
    "UnsupportedKVLayoutError",
]
