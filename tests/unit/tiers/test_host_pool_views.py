"""`HostPool.close()` never unmaps memory under a live view: the unmap waits for the last one.

Checked through /proc/self/maps (is the region still mapped?) and by reading and writing the
memory through the surviving view after close.
"""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

import flexkv_py
from flexkv_py import _native
from flexkv_py.errors import ClosedError
from flexkv_py.tiers.alignment import SLOT_ALIGN
from flexkv_py.tiers.host_pool import HostPool


def _mapped(address: int) -> bool:
    with open("/proc/self/maps") as maps:
        for line in maps:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= address < hi:
                return True
    return False


def test_native_region_counts_views_and_defers_the_unmap() -> None:
    region = _native.HostPool(1 << 20)
    address = region.address
    tensor = torch.frombuffer(region.memoryview(), dtype=torch.uint8)
    array = np.frombuffer(region.memoryview(), np.uint8)
    assert region.live_views == 2
    tensor[100] = 7

    region.close()
    assert region.closed
    assert region.live_views == 2 and _mapped(address)
    assert int(array[100]) == 7  # the memory under a live view stays valid
    array[200] = 9
    assert int(tensor[200]) == 9
    with pytest.raises(ClosedError, match="host pool is closed"):
        region.memoryview()
    with pytest.raises(ClosedError):
        _ = region.address

    del tensor
    gc.collect()
    assert region.live_views == 1 and _mapped(address)
    part = array[10:20]  # a view of a view still holds the lease
    del array
    assert region.live_views == 1
    del part
    gc.collect()
    assert region.live_views == 0
    assert not _mapped(address)


def test_native_region_without_views_unmaps_at_close() -> None:
    region = _native.HostPool(1 << 20)
    address = region.address
    view = region.memoryview()
    del view
    assert region.live_views == 0
    region.close()
    assert not _mapped(address)


@pytest.mark.parametrize("backing", ["native", "mmap"])
def test_slot_tensor_alive_past_close(backing: str) -> None:
    pool = HostPool(4, 2 * SLOT_ALIGN, pin=False, backing=backing, huge_pages=False)
    address = pool.address
    slot = pool.tensor[2]
    slot.fill_(5)
    raw = pool.slot_view(3)
    raw[0] = 11

    pool.close()
    assert pool.closed and _mapped(address)
    assert int(slot.sum()) == 5 * 2 * SLOT_ALIGN
    slot[0] = 6  # still writable memory, not a freed mapping
    assert int(slot[0]) == 6 and raw[0] == 11

    with pytest.raises(ClosedError):
        pool.slot_address(0)  # a raw address would hold no lease
    with pytest.raises(ClosedError):
        pool.slot_view(0)

    del slot, raw
    gc.collect()
    assert not _mapped(address)


def test_public_host_pool_is_the_tier_pool() -> None:
    assert flexkv_py.HostPool is HostPool
    assert "HostPool" in flexkv_py.__all__
    assert flexkv_py.HostPool is not _native.HostPool
