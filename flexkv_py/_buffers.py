"""Buffers across the stable-ABI line: raw ``(address, nbytes)`` pairs of Python buffers for the
native store, and memoryviews of native memory that keep it alive.

The extension is built against CPython's stable ABI for 3.10, which has no buffer API, so the
address of a Python buffer is taken here (through numpy) and handed to Rust together with an
owner object that keeps the memory alive until the batch completes.
"""

from __future__ import annotations

import ctypes

import numpy as np

from flexkv_py.errors import ConfigError


def address_of(obj: object, writable: bool) -> tuple[int, int, object]:
    """Return ``(address, nbytes, owner)`` for a C-contiguous buffer object."""
    view = memoryview(obj)  # type: ignore[arg-type]
    if not view.c_contiguous:
        raise ConfigError("block buffers must be C-contiguous")
    if writable and view.readonly:
        raise ConfigError(f"a read-only {type(obj).__name__} cannot receive a block")
    if view.nbytes == 0:
        return 0, 0, view
    flat = np.frombuffer(view.cast("B") if view.format != "B" or view.ndim != 1 else view, np.uint8)
    return int(flat.ctypes.data), int(view.nbytes), flat


def leased_view(address: int, nbytes: int, lease: object) -> memoryview:
    """A writable ``B`` memoryview of native memory that keeps `lease` alive.

    The view's exporter is a ctypes array carrying the lease, and numpy arrays and torch tensors
    made from the view hold that array: the memory stays mapped while any of them lives.
    """
    raw = (ctypes.c_uint8 * nbytes).from_address(address)
    raw._flexkv_lease = lease  # type: ignore[attr-defined]
    return memoryview(raw).cast("B")
