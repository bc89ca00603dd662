"""GPU <-> host transfer path on CPU tensors: layouts, page format, round trips, host pool."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    compute_layout_strides,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache

from flexkv_py.tiers.host_pool import SLOT_ALIGN, HostPool
from flexkv_py.transfer import (
    TransferEngine,
    TransferError,
    UnsupportedKVLayoutError,
    describe_kv_caches,
)

VLLM_LAYOUTS = [layout.name for layout in KVCacheLayout]


def vllm_kv_caches(
    layout: str,
    *,
    num_layers: int = 3,
    num_blocks: int = 16,
    heads: int = 2,
    head_size: int = 64,
    block_size: int = 16,
    dtype: torch.dtype = torch.bfloat16,
    seed: int = 0,
) -> dict[str, torch.Tensor]:
    """KV caches exactly as vLLM 0.33's worker allocates them (one int8 buffer, 4-D views)."""
    spec = FullAttentionSpec(
        block_size=block_size, num_kv_heads=heads, head_size=head_size, dtype=dtype
    )
    names = [f"model.layers.{i}.self_attn.attn" for i in range(num_layers)]
    kv_layout = KVCacheLayout[layout]
    layer_stride, block_stride, *_ = compute_layout_strides(spec, num_blocks, num_layers, kv_layout)
    tensor = KVCacheTensor(
        size=spec.page_size_bytes * num_blocks * num_layers,
        layers=names,
        layer_stride=layer_stride,
        block_stride=block_stride,
    )
    config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[tensor],
        kv_cache_groups=[KVCacheGroupSpec(names, spec)],
    )
    caches = allocate_kv_cache(config, torch.device("cpu"), kv_layout)
    fill_random(caches, seed)
    return caches


def fill_random(caches: dict[str, torch.Tensor], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    for view in caches.values():
        view.copy_(torch.randn(view.shape, generator=gen).to(view.dtype))


def snapshot(caches: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: t.clone() for name, t in caches.items()}


def block_of(t: torch.Tensor, block: int, *, legacy_fa: bool = False) -> torch.Tensor:
    return t[:, block] if legacy_fa else t[block]


def round_trip(
    caches: dict[str, torch.Tensor],
    src_blocks: list[int],
    dst_blocks: list[int],
    slots: list[int],
    *,
    legacy_fa: bool = False,
) -> None:
    """Store src_blocks into slots, load them back into dst_blocks, check bit-exactness."""
    before = snapshot(caches)
    geom = describe_kv_caches(caches)
    with (
        HostPool(max(slots) + 1, geom.slot_nbytes, pin=False) as pool,
        TransferEngine(caches, pool) as engine,
    ):
        pool.tensor.fill_(0xA5)  # poison: a byte not copied would show
        engine.submit_d2h(src_blocks, slots).wait(timeout=30)
        for b in dst_blocks:  # poison the destination blocks
            for t in caches.values():
                block_of(t, b, legacy_fa=legacy_fa).fill_(-7.0)
        engine.submit_h2d(slots, dst_blocks).wait(timeout=30)
    for name, t in caches.items():
        for src, dst in zip(src_blocks, dst_blocks, strict=True):
            got = block_of(t, dst, legacy_fa=legacy_fa).view(torch.int16)
            want = block_of(before[name], src, legacy_fa=legacy_fa).view(torch.int16)
            assert torch.equal(got, want), f"{name}: block {src} -> slot -> block {dst} differs"
        untouched = [b for b in range(t.shape[1 if legacy_fa else 0]) if b not in dst_blocks]
        for b in untouched:
            assert torch.equal(
                block_of(t, b, legacy_fa=legacy_fa), block_of(before[name], b, legacy_fa=legacy_fa)
            ), f"{name}: block {b} was not a destination but changed"


# -- layouts -----------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", VLLM_LAYOUTS)
def test_vllm_layouts_are_named_and_paged(layout: str) -> None:
    caches = vllm_kv_caches(layout, num_layers=3, heads=2, head_size=64)
    geom = describe_kv_caches(caches)
    assert geom.layout == layout
    assert geom.num_layers == 3
    assert geom.num_blocks == 16
    per_layer = 2 * 16 * 128 * 2  # H * N * (K + V head size) * bf16
    assert geom.page_nbytes == 3 * per_layer
    assert geom.slot_nbytes % SLOT_ALIGN == 0 and geom.slot_nbytes >= geom.page_nbytes
    assert layout in geom.fingerprint and "bfloat16" in geom.fingerprint
    if layout.startswith("B"):  # block-outermost: the whole block is one contiguous copy
        assert len(geom.segments) == 1


@pytest.mark.parametrize("layout", VLLM_LAYOUTS)
def test_vllm_layout_round_trip_scattered(layout: str) -> None:
    caches = vllm_kv_caches(layout, num_layers=4, num_blocks=20, seed=VLLM_LAYOUTS.index(layout))
    src = [17, 3, 9, 0, 12, 19]
    dst = [1, 18, 4, 11, 6, 2]
    slots = [7, 0, 5, 2, 9, 3]
    round_trip(caches, src, dst, slots)


def test_default_layout_page_format_is_layer_major_block_bytes() -> None:
    """LBNHC page = for each layer in order, block b's bytes as stored ([N, H, C])."""
    caches = vllm_kv_caches("LBNHC", num_layers=3, num_blocks=8)
    geom = describe_kv_caches(caches)
    with HostPool(4, geom.slot_nbytes, pin=False) as pool, TransferEngine(caches, pool) as eng:
        eng.submit_d2h([5, 2], [3, 1]).wait()
        for block, slot in ((5, 3), (2, 1)):
            want = torch.cat(
                [
                    t[block].transpose(0, 1).contiguous().view(torch.uint8).reshape(-1)
                    for t in caches.values()
                ]
            )
            assert torch.equal(pool.tensor[slot, : geom.page_nbytes], want)


def test_legacy_flash_attention_layout_round_trip_and_page_format() -> None:
    num_blocks, n, h, d = 10, 16, 4, 32
    gen = torch.Generator().manual_seed(1)
    caches = {
        f"layers.{i}": torch.randn((2, num_blocks, n, h, d), generator=gen).to(torch.float16)
        for i in range(3)
    }
    geom = describe_kv_caches(caches)
    assert geom.layout == "FA:L2BNHD"
    assert geom.page_nbytes == 3 * 2 * n * h * d * 2
    with HostPool(3, geom.slot_nbytes, pin=False) as pool, TransferEngine(caches, pool) as eng:
        eng.submit_d2h([7], [2]).wait()
        want = torch.cat(
            [t[kv, 7].reshape(-1).view(torch.uint8) for t in caches.values() for kv in (0, 1)]
        )
        assert torch.equal(pool.tensor[2, : geom.page_nbytes], want)
    round_trip(caches, [9, 0, 4], [1, 8, 3], [0, 4, 2], legacy_fa=True)


def test_legacy_flash_attention_hnd_strides_round_trip() -> None:
    """(2, B, N, H, D) logical shape over HND physical memory (vLLM's legacy HND layout)."""
    gen = torch.Generator().manual_seed(2)
    caches = {
        f"layers.{i}": torch.randn((2, 12, 4, 16, 32), generator=gen)
        .to(torch.bfloat16)
        .permute(0, 1, 3, 2, 4)  # physical (2, B, H, N, D), logical (2, B, N, H, D)
        for i in range(2)
    }
    assert describe_kv_caches(caches).layout == "FA:L2BHND"
    round_trip(caches, [11, 2, 5], [0, 7, 10], [1, 0, 2], legacy_fa=True)


def test_flashinfer_layout_round_trip() -> None:
    gen = torch.Generator().manual_seed(3)
    caches = {
        f"layers.{i}": torch.randn((9, 2, 16, 2, 64), generator=gen).to(torch.bfloat16)
        for i in range(3)
    }
    geom = describe_kv_caches(caches)
    assert geom.layout.startswith("FI:")
    assert len(geom.segments) == 3  # one run per layer: K and V of a block are adjacent
    round_trip(caches, [8, 1, 4], [0, 6, 5], [2, 1, 0])


def test_mla_single_head_round_trip() -> None:
    caches = vllm_kv_caches("LBNHC", num_layers=2, heads=1, head_size=288, num_blocks=6)
    round_trip(caches, [5, 0], [2, 3], [1, 0])


def test_kv_sharing_layers_are_paged_once() -> None:
    caches = vllm_kv_caches("LBNHC", num_layers=2, num_blocks=4)
    names = list(caches)
    shared = {**caches, "model.layers.2.self_attn.attn": caches[names[0]]}
    assert describe_kv_caches(shared).page_nbytes == describe_kv_caches(caches).page_nbytes


@given(
    layout=st.sampled_from(VLLM_LAYOUTS),
    num_layers=st.integers(1, 4),
    mapping=st.permutations(list(range(12))),
    count=st.integers(1, 12),
)
@settings(max_examples=25, deadline=None)
def test_round_trip_property(layout: str, num_layers: int, mapping: list[int], count: int) -> None:
    caches = vllm_kv_caches(layout, num_layers=num_layers, num_blocks=12, heads=1, head_size=32)
    src = mapping[:count]
    dst = list(reversed(mapping))[:count]
    slots = list(range(count))[::-1]
    round_trip(caches, src, dst, slots)


# -- unsupported layouts -----------------------------------------------------------------------


def test_non_vllm_physical_order_is_rejected_with_layout_name() -> None:
    base = torch.zeros((8, 2, 128, 16), dtype=torch.bfloat16)  # physical [B, H, C, N]
    view = base.permute(0, 1, 3, 2)  # logical [B, H, N, C]
    with pytest.raises(UnsupportedKVLayoutError, match=r"unsupported KV layout LBHCN"):
        describe_kv_caches({"layers.0": view})


def test_innermost_dim_not_contiguous_is_rejected() -> None:
    view = torch.zeros((8, 2, 16, 256), dtype=torch.bfloat16)[..., ::2]  # C with gaps
    with pytest.raises(UnsupportedKVLayoutError, match=r"BHNC.*innermost dimension"):
        describe_kv_caches({"layers.0": view})


def test_raw_buffer_layer_is_rejected() -> None:
    with pytest.raises(UnsupportedKVLayoutError, match=r"'mamba.0'.*unsupported KV layout"):
        describe_kv_caches({"mamba.0": torch.zeros(4096, dtype=torch.int8)})


def test_tiny_copy_runs_are_rejected() -> None:
    # Physical [H, C, B, N]-like order: each block of a layer is 2 * 64 runs of 2 tokens.
    base = torch.zeros((2, 64, 8, 2), dtype=torch.float16)
    view = base.permute(2, 0, 3, 1)  # [B, H, N, C] with C strided
    with pytest.raises(UnsupportedKVLayoutError):
        describe_kv_caches({"layers.0": view})


def test_mismatched_layers_are_rejected() -> None:
    caches = vllm_kv_caches("LBNHC", num_layers=1, num_blocks=4)
    other = torch.zeros((5, 2, 16, 128), dtype=torch.bfloat16)
    with pytest.raises(UnsupportedKVLayoutError, match="5 blocks"):
        describe_kv_caches({**caches, "layers.x": other})
    with pytest.raises(UnsupportedKVLayoutError, match="float32"):
        describe_kv_caches({**caches, "layers.y": other[:4].float()})
    with pytest.raises(UnsupportedKVLayoutError, match="no KV cache"):
        describe_kv_caches({})


# -- engine API --------------------------------------------------------------------------------


def test_submit_validates_ids_and_slots() -> None:
    caches = vllm_kv_caches("LBNHC", num_layers=1, num_blocks=4)
    geom = describe_kv_caches(caches)
    with HostPool(2, geom.slot_nbytes, pin=False) as pool, TransferEngine(caches, pool) as eng:
        with pytest.raises(ValueError, match="2 GPU block ids but 1 host slots"):
            eng.submit_d2h([0, 1], [0])
        with pytest.raises(ValueError, match="GPU block id out of range"):
            eng.submit_d2h([4], [0])
        with pytest.raises(ValueError, match="host slot out of range"):
            eng.submit_h2d([2], [0])
        with pytest.raises(ValueError, match="duplicate destination host slot"):
            eng.submit_d2h([0, 1], [1, 1])
        with pytest.raises(ValueError, match="duplicate destination GPU block"):
            eng.submit_h2d([0, 1], [3, 3])
        with pytest.raises(ValueError, match="needs CUDA"):
            TransferEngine(caches, pool, backend="triton")
        empty = eng.submit_d2h([], [])
        empty.wait(timeout=30)
        assert empty.done() and empty.nbytes == 0


def test_pool_slot_too_small_is_rejected() -> None:
    caches = vllm_kv_caches("LBNHC", num_layers=2, num_blocks=4)
    with HostPool(1, SLOT_ALIGN, pin=False) as pool:
        with pytest.raises(ValueError, match="cannot hold a LBNHC page"):
            TransferEngine(caches, pool)


def test_handle_reports_failure_as_transfer_error() -> None:
    caches = vllm_kv_caches("LBNHC", num_layers=1, num_blocks=4)
    geom = describe_kv_caches(caches)
    pool = HostPool(2, geom.slot_nbytes, pin=False)
    eng = TransferEngine(caches, pool)
    # Break the host view under the engine: the copy itself must fail, and say so.
    eng.backend["d2h"]._host_words = torch.zeros((2, 1), dtype=torch.int64)  # type: ignore[attr-defined]
    handle = eng.submit_d2h([1], [0])
    with pytest.raises(TransferError, match="d2h of 1 blocks failed") as info:
        handle.wait(timeout=30)
    assert info.value.block_ids == (1,)
    assert handle.done()
    eng.close()
    pool.close()


def test_concurrent_submitters_all_land() -> None:
    caches = vllm_kv_caches("LBHNC", num_layers=2, num_blocks=32)
    before = snapshot(caches)
    geom = describe_kv_caches(caches)
    with HostPool(32, geom.slot_nbytes, pin=False) as pool, TransferEngine(caches, pool) as eng:
        handles = []

        def store(worker: int) -> None:
            blocks = list(range(worker * 8, worker * 8 + 8))
            handles.append(eng.submit_d2h(blocks, [31 - b for b in blocks]))

        threads = [threading.Thread(target=store, args=(w,)) for w in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        for h in handles:
            h.wait(timeout=30)
        fill_random(caches, seed=99)
        eng.submit_h2d([31 - b for b in range(32)], list(range(32))).wait(timeout=30)
    for name, t in caches.items():
        assert torch.equal(t.view(torch.int16), before[name].view(torch.int16))


# -- host pool ---------------------------------------------------------------------------------


def test_host_pool_alignment_and_views() -> None:
    with HostPool(5, 3 * SLOT_ALIGN, pin=False) as pool:
        assert pool.address % SLOT_ALIGN == 0
        assert all(pool.slot_address(i) % SLOT_ALIGN == 0 for i in range(5))
        assert pool.tensor.shape == (5, 3 * SLOT_ALIGN)
        assert pool.tensor.dtype == torch.uint8
        assert pool.nbytes == 15 * SLOT_ALIGN
        assert not pool.pinned
        view = pool.slot_view(2)
        view[:4] = b"abcd"
        assert bytes(pool.tensor[2, :4].numpy()) == b"abcd"
        assert pool.slot_address(3) - pool.slot_address(2) == pool.slot_nbytes
        arr = np.frombuffer(view, dtype=np.uint8)
        assert arr.ctypes.data == pool.slot_address(2)
        del view, arr
        with pytest.raises(IndexError):
            pool.slot_address(5)
    assert pool.closed


def test_host_pool_from_cache_gb_and_errors() -> None:
    pool = HostPool.from_cache_gb(0.001, slot_nbytes=64 * 1024, pin=False)
    assert pool.num_slots == int(0.001 * (1 << 30)) // (64 * 1024)
    pool.close()
    with pytest.raises(ValueError, match="multiple of 4096"):
        HostPool(2, 5000, pin=False)
    with pytest.raises(ValueError, match="holds no block"):
        HostPool.from_cache_gb(0.00001, slot_nbytes=1 << 20, pin=False)
    with pytest.raises(ValueError, match="cpu_cache_gb must be > 0"):
        HostPool.from_cache_gb(0, slot_nbytes=SLOT_ALIGN, pin=False)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs CUDA"):
            HostPool(1, SLOT_ALIGN, pin=True)


def test_host_pool_python_mmap_backing() -> None:
    with HostPool(3, SLOT_ALIGN, pin=False, backing="mmap") as pool:
        assert pool.backing == "mmap"
        assert pool.address % SLOT_ALIGN == 0
        pool.tensor[1].fill_(7)
        assert int(pool.tensor[1].sum()) == 7 * SLOT_ALIGN
        assert int(pool.tensor[0].sum()) == 0
