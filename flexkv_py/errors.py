"""The flexkv-py exception hierarchy (defined by the native module, re-exported here).

FlexKVError
├── ConfigError (also ValueError)       bad configuration or input; the message names the key
├── StorageFullError                    the budget or the device has no room
├── CorruptBlockError                   stored bytes failed verification
├── IoEngineError (also OSError)        the device or the I/O engine failed
├── StoreLockedError                    another process holds the cache directory
└── BlockNotFoundError (also KeyError)  the key is not stored
"""

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


# Engineer D's branch (i9-edge) defines this class beside the other Python-side errors; until it
# merges, the index needs it here (same name, same bases).
class InternalStateError(FlexKVError, RuntimeError):  # type: ignore[misc]
    """A bug: a state transition that the component does not allow."""


__all__ += ["InternalStateError"]
