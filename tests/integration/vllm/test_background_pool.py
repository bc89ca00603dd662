"""A large host pool is touched and pinned in the background: serving starts at once, the host
tier grows as chunks become ready, and registration waits until start-up captures are over."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch
from helpers import vllm_harness as vh

from flexkv_py.config import load_config
from flexkv_py.coordinator.planning import BACKGROUND_POOL_MIN_BYTES, host_pool_in_background
from flexkv_py.index.namespace import Namespace
from flexkv_py.index.tier_index import TierIndex
from flexkv_py.tiers.background_pinning import BackgroundPinner
from flexkv_py.tiers.host_pool import HostPool

pytestmark = pytest.mark.usefixtures("connector_form")

SLOT = 64 * 1024
BS = 16


def test_pool_becomes_ready_chunk_by_chunk_and_is_usable() -> None:
    with HostPool(64, SLOT, pin=False, background=True, background_chunk_bytes=8 * SLOT) as pool:
        assert pool.background is not None
        assert pool.background.wait_ready(64, timeout_s=30)
        assert pool.ready_slots == 64
        times = pool.background.times
        assert times.first_ready_s is not None and times.all_ready_s is not None
        assert times.first_ready_s <= times.all_ready_s
        pool.tensor[63].fill_(7)
        assert int(pool.tensor[63].sum()) == 7 * SLOT
        assert int(pool.tensor[:63].sum()) == 0


def test_a_sync_pool_is_ready_at_once() -> None:
    with HostPool(4, SLOT, pin=False) as pool:
        assert pool.background is None and pool.ready_slots == 4
        pool.allow_registration()  # a no-op, never an error


def test_registration_waits_for_permission_and_goes_in_slot_order() -> None:
    # A stand-in for cudaHostRegister records the calls: none may happen before permission
    # (vLLM captures CUDA graphs right after register_kv_caches).
    flat = torch.zeros(40 * SLOT, dtype=torch.uint8)
    calls: list[tuple[int, int]] = []
    registered: list[tuple[int, int]] = []

    def register(addr: int, size: int) -> int:
        calls.append((addr, size))
        return 0

    pinner = BackgroundPinner(
        flat,
        SLOT,
        40,
        register=register,
        on_registered=lambda a, s: registered.append((a, s)),
        chunk_bytes=16 * SLOT,
    )
    assert not pinner.wait_ready(1, timeout_s=0.3)
    assert calls == [] and pinner.ready_slots == 0
    pinner.allow_registration()
    assert pinner.wait_ready(40, timeout_s=30)
    base = flat.data_ptr()
    assert calls == [(base, 16 * SLOT), (base + 16 * SLOT, 16 * SLOT), (base + 32 * SLOT, 8 * SLOT)]
    assert registered == calls
    assert pinner.stop()


def test_a_failed_registration_keeps_the_ready_part() -> None:
    flat = torch.zeros(32 * SLOT, dtype=torch.uint8)
    done = threading.Event()

    def register(addr: int, size: int) -> int:
        if addr >= flat.data_ptr() + 16 * SLOT:
            done.set()
            return 2  # cudaErrorMemoryAllocation
        return 0

    pinner = BackgroundPinner(
        flat, SLOT, 32, register=register, on_registered=lambda a, s: None, chunk_bytes=8 * SLOT
    )
    pinner.allow_registration()
    assert not pinner.wait_ready(32, timeout_s=30)  # the thread ended, short of the pool
    assert done.is_set() and pinner.ready_slots == 16
    assert pinner.error is not None and "error 2" in pinner.error


def test_index_grows_usable_slots_and_never_hands_out_the_rest() -> None:
    index = TierIndex(10, usable_host_slots=0)
    assert index.allocate_slots(3) == []
    assert index.grow_usable_slots(4) == 4
    got = index.allocate_slots(10)
    assert sorted(got) == [0, 1, 2, 3]
    index.release_slots(got[:2])
    assert index.grow_usable_slots(2) == 0  # never shrinks
    assert index.grow_usable_slots(99) == 6  # capped at the pool
    assert sorted(index.allocate_slots(10)) == sorted([*got[:2], 4, 5, 6, 7, 8, 9])
    assert index.usable_host_slots == 10
    with pytest.raises(ValueError, match="usable_host_slots"):
        TierIndex(4, usable_host_slots=5)


def test_auto_mode_goes_background_from_the_threshold() -> None:
    ns = Namespace(
        model="m",
        revision=None,
        kv_dtype="float16",
        kv_layout="LBNHC",
        block_size=16,
        tp_size=1,
        pp_size=1,
        hash_algo="sha256",
        page_bytes=SLOT,
    )
    small = load_config({"cpu_cache_gb": 1.0})
    big = load_config({"cpu_cache_gb": BACKGROUND_POOL_MIN_BYTES / 2**30})
    assert not host_pool_in_background(small, ns, SLOT, serving=True)
    assert host_pool_in_background(big, ns, SLOT, serving=True)
    # In-process engines (benches, replay) want every slot at once unless asked.
    assert not host_pool_in_background(big, ns, SLOT, serving=False)
    forced = load_config({"cpu_cache_gb": 1.0, "host_pool_init": "background"})
    assert host_pool_in_background(forced, ns, SLOT, serving=False)
    assert not host_pool_in_background(
        load_config({"cpu_cache_gb": 64.0, "host_pool_init": "sync"}), ns, SLOT, serving=True
    )


def _usable(e: vh.Engine) -> int:
    return int(e.connector.scheduler_side._mgr.index.usable_host_slots)


def test_connector_serves_while_the_pool_gets_ready(model_dir: str) -> None:
    extra: dict[str, Any] = {"cpu_cache_gb": 0.004, "host_pool_init": "background"}
    e = vh.Engine(model_dir, vh.connector_transfer_config(extra))
    slots = e.workers[0].connector.worker_side.executor.pool.num_slots
    assert _usable(e) == 0  # nothing usable until every worker reported
    prompt = vh.prompt_tokens(501, 4 * BS)
    e.add(vh.make_request("A", prompt))
    e.run_until(lambda: _usable(e) == slots, timeout_s=60)
    e.run()
    # A's stores planned before the pool was ready were skipped and counted, never blocked.
    assert e.connector.scheduler_side._mgr._stats["store_skipped_no_slot"] >= 1
    assert not e.mismatches()
    # Once ready, the host tier works as usual.
    later = vh.prompt_tokens(502, 4 * BS)
    e.add(vh.make_request("B", later))
    e.run()
    e.reset_gpu_prefix_cache()
    e.add(vh.make_request("C", later))
    e.run()
    assert any("C" in rec.finished_recving for rec in e.history)
    assert e.workers[0].model.written["C"] == 4
    assert not e.mismatches()
    vh.assert_no_leaks(e)
    e.shutdown()


def test_creating_a_background_pool_touches_nothing() -> None:
    # 2 GiB of host tier on CPU tensors: creating the pool maps it and returns; the memory is
    # touched by the background thread (stopped right away here), not by the caller.
    pool = HostPool(2048, 1 << 20, pin=False, background=True)
    try:
        assert pool.timings.touch_s == 0.0 and pool.timings.pin_s == 0.0
        assert pool.background is not None
    finally:
        pool.close()
    assert pool.closed
