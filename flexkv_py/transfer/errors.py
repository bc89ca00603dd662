"""Errors raised by the GPU <-> host transfer path (defined with the rest of the tree in
`flexkv_py.errors`; re-exported here for the transfer modules)."""

from __future__ import annotations

from flexkv_py.errors import TransferError, UnsupportedKVLayoutError

__all__ = ["TransferError", "UnsupportedKVLayoutError"]
