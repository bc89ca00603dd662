"""Errors raised by the GPU <-> host transfer path.

Kept free of the native extension so the transfer path imports on machines without the wheel.
"""

from __future__ import annotations


class UnsupportedKVLayoutError(ValueError):
    """The registered KV cache tensors have a shape/stride layout we cannot page."""


class TransferError(RuntimeError):
    """A GPU <-> host batch failed; no block of the batch may be trusted."""

    def __init__(self, message: str, *, direction: str, block_ids: tuple[int, ...]) -> None:
        super().__init__(message)
        self.direction = direction
        self.block_ids = block_ids
