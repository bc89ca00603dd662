"""CUDA tests: every transfer path on real GPU tensors, the pinned host pool, the spill path.

They guard the refactor that moves stream ordering (GPU issue, item 4). On an NVIDIA GPU:

* each copy path (staged, Triton, copy engine / ``cuMemcpyBatchAsync``, torch) stores scattered
  GPU blocks of every supported KV layout into scattered host slots and loads them back into
  other blocks; host pages must equal the page format the layout's geometry defines and the
  loaded blocks must equal the stored ones, byte for byte (NaN bit patterns included);
* paths that cannot page a layout refuse it with their documented error;
* stores follow the work queued on the caller's stream, loads can be waited for from it, and
  batches issued back to back (staging buffers reused) all land;
* the host pool is really pinned (torch ``is_pinned`` and ``cudaPointerGetAttributes``) and
  ``close`` unregisters it;
* a host tier smaller than what is stored spills to an SSD tier (tmp directory) and everything
  loads back bit-exact; a restarted engine loads from SSD alone.

Marked ``cuda``; skipped only where torch sees no GPU. Needs no vLLM: the vLLM 0.33 layouts are
built here the way ``vllm.v1.worker.utils.allocate_kv_cache`` lays them out (one int8 buffer,
logical ``[L, B, H, N, C]`` strides from ``KVCacheLayout.stride_order``, 4-D per-layer views).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from flexkv_py.tiers import host_pool as host_pool_module
from flexkv_py.tiers.host_pool import HostPool
from flexkv_py.transfer import TransferEngine, describe_kv_caches
from flexkv_py.transfer.kv_layout import VLLM_LAYOUTS, KVPageGeometry

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not torch.cuda.is_available(), reason="no GPU: torch.cuda.is_available() is False"
    ),
]

GIB = 1 << 30
# vLLM 0.33 KVCacheLayout.stride_order: physical order of the logical [L, B, H, N, C] axes.
VLLM_STRIDE_ORDER = {
    "LBHNC": (0, 1, 2, 3, 4),
    "LBNHC": (0, 1, 3, 2, 4),
    "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4),
    "BLNHC": (1, 0, 3, 2, 4),
    "BHLNC": (1, 2, 0, 3, 4),
}
NUM_BLOCKS = 24
NUM_SLOTS = 16
# Scattered, unsorted ids: 11 blocks, so the staged path (chunk 4) runs 3 chunks on 2 buffers.
SRC = [17, 3, 22, 9, 0, 12, 19, 5, 14, 7, 21]
DST = [1, 18, 4, 11, 6, 2, 23, 10, 15, 20, 8]
SLOTS = [7, 0, 13, 5, 2, 9, 15, 3, 11, 6, 12]
HOST_POISON = 0xA5
SLEEP_CYCLES = 200_000_000  # ~0.1 s of torch.cuda._sleep on an H200


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


def bits(t: torch.Tensor) -> torch.Tensor:
    """Same memory as an integer tensor: torch.equal on it compares bit patterns."""
    return t.view(
        {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    )


def fill_random(caches: dict[str, torch.Tensor], seed: int) -> None:
    """Random bytes everywhere (NaN and -0.0 patterns included)."""
    gen = torch.Generator(device=next(iter(caches.values())).device).manual_seed(seed)
    for t in caches.values():
        b = t.view(torch.int8)
        b.copy_(torch.randint(-128, 128, b.shape, dtype=torch.int8, device=b.device, generator=gen))


def vllm_caches(
    layout: str,
    device: torch.device,
    *,
    num_layers: int = 3,
    num_blocks: int = NUM_BLOCKS,
    heads: int = 2,
    tokens: int = 16,
    content: int = 128,
    dtype: torch.dtype = torch.bfloat16,
) -> dict[str, torch.Tensor]:
    """vLLM 0.33's KV caches: one int8 buffer, per-layer [B, H, N, C] views in `layout`."""
    order = VLLM_STRIDE_ORDER[layout]
    logical = (num_layers, num_blocks, heads, tokens, content)
    strides = [0] * 5
    step = 1
    for dim in reversed(order):
        strides[dim] = step
        step *= logical[dim]
    elem = torch.empty((), dtype=dtype).element_size()
    buf = torch.zeros(math.prod(logical) * elem, dtype=torch.int8, device=device)
    view5 = buf.view(dtype).as_strided(logical, strides)
    return {f"model.layers.{i}.self_attn.attn": view5[i] for i in range(num_layers)}


def flash_attention_caches(
    device: torch.device, *, hnd: bool = False, dtype: torch.dtype = torch.float16
) -> dict[str, torch.Tensor]:
    """Legacy FlashAttention: one (2, B, N, H, D) tensor per layer (optionally HND memory)."""
    n, h, d = 16, 2, 64
    out = {}
    for i in range(3):
        if hnd:  # physical (2, B, H, N, D), logical (2, B, N, H, D)
            t = torch.zeros((2, NUM_BLOCKS, h, n, d), dtype=dtype, device=device)
            out[f"layers.{i}"] = t.permute(0, 1, 3, 2, 4)
        else:
            out[f"layers.{i}"] = torch.zeros((2, NUM_BLOCKS, n, h, d), dtype=dtype, device=device)
    return out


def flashinfer_caches(device: torch.device) -> dict[str, torch.Tensor]:
    """FlashInfer: one (B, 2, N, H, D) tensor per layer."""
    return {
        f"layers.{i}": torch.zeros((NUM_BLOCKS, 2, 16, 2, 64), dtype=torch.bfloat16, device=device)
        for i in range(3)
    }


def legacy_mla_caches(device: torch.device) -> dict[str, torch.Tensor]:
    """Legacy MLA: one (B, N, C) latent cache per layer (kv_lora_rank 512 + rope 64)."""
    return {
        f"layers.{i}": torch.zeros((NUM_BLOCKS, 16, 576), dtype=torch.bfloat16, device=device)
        for i in range(2)
    }


@dataclass(frozen=True)
class Case:
    id: str
    build: Callable[[torch.device], dict[str, torch.Tensor]]
    layout: str  # the geometry's layout name (an "X:" prefix: name starts with it)
    block_dim: int = 0
    runs: int = 0  # expected copy runs per block (0: not checked)


def _vllm_case(layout: str, **kw: Any) -> Case:
    # Block-outermost layouts move each block as one run; LB* as one run per layer; LHBNC as
    # one run per layer and head.
    runs = {"L": 3, "B": 1}[layout[0]] * (2 if layout == "LHBNC" else 1)
    return Case(layout, lambda dev: vllm_caches(layout, dev, **kw), layout, runs=runs)


CASES = [
    *(_vllm_case(layout) for layout in VLLM_STRIDE_ORDER),
    Case(
        "LBNHC-fp8",
        lambda dev: vllm_caches("LBNHC", dev, dtype=torch.float8_e4m3fn),
        "LBNHC",
        runs=3,
    ),
    Case(
        "vLLM-MLA",  # vLLM 0.33 MLA: [B, 1, N, C] views, one latent "head"
        lambda dev: vllm_caches("LBNHC", dev, num_layers=2, heads=1, content=576),
        "LBNHC",
        runs=2,
    ),
    Case("FA-NHD", lambda dev: flash_attention_caches(dev), "FA:L2BNHD", block_dim=1, runs=6),
    Case(
        "FA-HND",
        lambda dev: flash_attention_caches(dev, hnd=True, dtype=torch.bfloat16),
        "FA:L2BHND",
        block_dim=1,
        runs=6,
    ),
    Case("FlashInfer", flashinfer_caches, "FI:", runs=3),
    Case("legacy-MLA", legacy_mla_caches, "MLA:", runs=2),
]


@dataclass(frozen=True)
class Backend:
    id: str
    name: str
    options: dict[str, Any] = field(default_factory=dict)


BACKENDS = [
    Backend("staged", "staged", {"staged_chunk_pages": 4}),  # 3 chunks, both staging buffers
    Backend("triton", "triton"),
    Backend("triton-grid", "triton", {"triton_programs": 0, "triton_tile_bytes": 4096}),
    Backend("copy_engine", "copy_engine"),
    Backend("torch", "torch"),
]
PATHS = ["staged", "triton", "copy_engine", "torch"]


def block(t: torch.Tensor, b: int, block_dim: int) -> torch.Tensor:
    return t.select(block_dim, b)


def reference_page(geom: KVPageGeometry, b: int) -> torch.Tensor:
    """Block b's host page as the geometry defines it, read with plain slicing."""
    page = torch.empty(geom.page_nbytes, dtype=torch.uint8, device=geom.device)
    for seg in geom.segments:
        start = seg.gpu_offset + b * seg.block_stride
        page[seg.host_offset : seg.host_offset + seg.nbytes] = geom.storages[seg.storage][
            start : start + seg.nbytes
        ]
    return page


def pinned_pool(geom: KVPageGeometry, num_slots: int = NUM_SLOTS, **kw: Any) -> HostPool:
    pool = HostPool(num_slots, geom.slot_nbytes, pin=True, **kw)
    assert pool.pinned
    return pool


def engine_for(caches: dict[str, torch.Tensor], pool: HostPool, be: Backend) -> TransferEngine:
    eng = TransferEngine(caches, pool, backend=be.name, **be.options)
    assert eng.backend["d2h"].name == be.name and eng.backend["h2d"].name == be.name
    return eng


def assert_blocks_moved(
    caches: dict[str, torch.Tensor],
    before: dict[str, torch.Tensor],
    src: list[int],
    dst: list[int],
    block_dim: int,
) -> None:
    """dst blocks hold the src blocks' bytes; every other block is as before."""
    for name, t in caches.items():
        for s, d in zip(src, dst, strict=True):
            assert torch.equal(
                bits(block(t, d, block_dim)), bits(block(before[name], s, block_dim))
            ), f"{name}: block {s} -> host -> block {d} differs"
        for b in range(t.shape[block_dim]):
            if b not in dst:
                assert torch.equal(
                    bits(block(t, b, block_dim)), bits(block(before[name], b, block_dim))
                ), f"{name}: block {b} was no destination but changed"


# -- every path x every layout -----------------------------------------------------------------


def test_every_vllm_layout_the_package_supports_is_covered() -> None:
    assert set(VLLM_STRIDE_ORDER) == set(VLLM_LAYOUTS)
    dev = _device()
    for layout in VLLM_LAYOUTS:
        assert describe_kv_caches(vllm_caches(layout, dev)).layout == layout


@pytest.mark.parametrize("be", BACKENDS, ids=lambda b: b.id)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_round_trip_scattered_blocks(case: Case, be: Backend) -> None:
    dev = _device()
    caches = case.build(dev)
    fill_random(caches, seed=CASES.index(case))
    geom = describe_kv_caches(caches)
    assert geom.device.type == "cuda"
    if case.layout.endswith(":"):
        assert geom.layout.startswith(case.layout)
    else:
        assert geom.layout == case.layout
    if case.runs:
        assert len(geom.segments) == case.runs
    before = {name: t.clone() for name, t in caches.items()}
    want = {slot: reference_page(geom, b) for b, slot in zip(SRC, SLOTS, strict=True)}
    with pinned_pool(geom) as pool, engine_for(caches, pool, be) as eng:
        pool.tensor.fill_(HOST_POISON)
        eng.submit_d2h(SRC, SLOTS).wait(timeout=60)
        for slot in range(NUM_SLOTS):
            if slot in want:
                got = pool.tensor[slot, : geom.page_nbytes].to(dev)
                assert torch.equal(got, want[slot]), f"host slot {slot}: page differs"
            else:
                assert bool((pool.tensor[slot] == HOST_POISON).all()), f"slot {slot} written"
        for t in caches.values():  # poison the destinations: a byte not loaded would show
            for b in DST:
                block(t, b, case.block_dim).view(torch.uint8).fill_(0x5A)
        eng.submit_h2d(SLOTS, DST).wait(timeout=60)
        torch.cuda.synchronize()
    assert_blocks_moved(caches, before, SRC, DST, case.block_dim)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_all_paths_write_the_same_host_pages(case: Case) -> None:
    """A page stored by one path loads with any other (restarts may pick another backend)."""
    dev = _device()
    caches = case.build(dev)
    fill_random(caches, seed=100 + CASES.index(case))
    geom = describe_kv_caches(caches)
    before = {name: t.clone() for name, t in caches.items()}
    pages = {}
    with pinned_pool(geom, num_slots=len(PATHS) * len(SRC)) as pool:
        pool.tensor.fill_(HOST_POISON)
        for i, name in enumerate(PATHS):
            slots = [i * len(SRC) + s for s in range(len(SRC))]
            with TransferEngine(caches, pool, backend=name) as eng:
                eng.submit_d2h(SRC, slots).wait(timeout=60)
            pages[name] = pool.tensor[slots, : geom.page_nbytes].clone()
        for name in PATHS[1:]:
            assert torch.equal(pages[name], pages[PATHS[0]]), f"{name} vs {PATHS[0]} pages"
        # Each path's pages (slots i * len(SRC) ...) load with the next path.
        for i, name in enumerate(PATHS):
            loader = PATHS[(i + 1) % len(PATHS)]
            slots = [i * len(SRC) + s for s in range(len(SRC))]
            with TransferEngine(caches, pool, d2h_backend=name, h2d_backend=loader) as eng:
                assert eng.backend["h2d"].name == loader
                for t in caches.values():
                    for b in DST:
                        block(t, b, case.block_dim).view(torch.uint8).fill_(0x3C)
                eng.submit_h2d(slots, DST).wait(timeout=60)
            torch.cuda.synchronize()
            assert_blocks_moved(caches, before, SRC, DST, case.block_dim)


def test_unaligned_runs_are_refused_by_sm_paths_and_moved_by_the_others() -> None:
    """Runs of 258 bytes (fp16 D=129): Triton and staged need 8-byte aligned runs and say so;
    the copy engine and torch move them; auto falls back to a path that works."""
    dev = _device()
    caches = {
        f"layers.{i}": torch.zeros((2, NUM_BLOCKS, 1, 1, 129), dtype=torch.float16, device=dev)
        for i in range(2)
    }
    fill_random(caches, seed=7)
    geom = describe_kv_caches(caches)
    assert geom.layout.startswith("FA:")
    assert {seg.nbytes for seg in geom.segments} == {258}
    with pinned_pool(geom) as pool:
        for name in ("triton", "staged"):
            with pytest.raises(ValueError, match="8-byte aligned copy runs"):
                TransferEngine(caches, pool, backend=name)
        for name in ("copy_engine", "torch", "auto"):
            before = {n: t.clone() for n, t in caches.items()}
            with TransferEngine(caches, pool, backend=name) as eng:
                if name == "auto":
                    assert eng.backend["d2h"].name not in ("staged", "triton")
                    assert eng.backend["h2d"].name not in ("staged", "triton")
                pool.tensor.fill_(HOST_POISON)
                eng.submit_d2h(SRC, SLOTS).wait(timeout=60)
                for b, slot in zip(SRC, SLOTS, strict=True):
                    assert torch.equal(
                        pool.tensor[slot, : geom.page_nbytes].to(dev), reference_page(geom, b)
                    )
                for t in caches.values():
                    for b in DST:
                        block(t, b, 1).view(torch.uint8).fill_(0x5A)
                eng.submit_h2d(SLOTS, DST).wait(timeout=60)
                torch.cuda.synchronize()
            assert_blocks_moved(caches, before, SRC, DST, 1)


def test_cuda_caches_need_a_pinned_pool() -> None:
    caches = vllm_caches("LBNHC", _device())
    geom = describe_kv_caches(caches)
    with HostPool(2, geom.slot_nbytes, pin=False) as pool:
        assert not pool.pinned
        with pytest.raises(ValueError, match="not pinned"):
            TransferEngine(caches, pool)


# -- stream ordering -----------------------------------------------------------------------------


@pytest.mark.parametrize("be", BACKENDS, ids=lambda b: b.id)
@pytest.mark.parametrize("layout", ["LBNHC", "BLNHC"])
def test_copies_follow_the_callers_stream(layout: str, be: Backend) -> None:
    """A store sees what the caller's stream wrote before it (though that work is still queued
    behind a sleep); a load lands after the caller's earlier writes to the destination, and a
    stream that waits for the load (make_current_stream_wait) reads the loaded bytes."""
    dev = _device()
    caches = vllm_caches(layout, dev)
    fill_random(caches, seed=11)
    new = {
        name: torch.randint(-128, 128, t[SRC].shape, device=dev, dtype=torch.int8)
        for name, t in ((n, c.view(torch.int8)) for n, c in caches.items())
    }
    src_idx = torch.tensor(SRC, device=dev)
    dst_idx = torch.tensor(DST, device=dev)
    geom = describe_kv_caches(caches)
    side = torch.cuda.Stream(dev)
    with pinned_pool(geom) as pool, engine_for(caches, pool, be) as eng:
        # Warm up with the same batch shapes: Triton compiles (and specializes) on first use ...
        eng.submit_d2h(SRC, SLOTS).wait(timeout=60)
        eng.submit_h2d(SLOTS, DST).wait(timeout=60)
        # ... and run every kernel used below once: a kernel's first launch (CUDA lazy loading)
        # can block the host until the queued sleep ends, hiding a missing stream wait.
        torch.cuda._sleep(1000)
        for t in caches.values():
            raw = t.view(torch.int8)
            raw.index_copy_(0, src_idx, raw.index_select(0, src_idx))
            raw.index_fill_(0, dst_idx, 0x5A)
        torch.cuda.synchronize()
        with torch.cuda.stream(side):
            torch.cuda._sleep(SLEEP_CYCLES)
            for name, t in caches.items():
                t.view(torch.int8).index_copy_(0, src_idx, new[name])
            store = eng.submit_d2h(SRC, SLOTS)
        if be.name != "torch":  # the torch path's id upload waits for the stream on the host
            assert not store.done(), "store finished before the caller's queued writes"
        store.wait(timeout=60)
        assert store.done()
        for b, slot in zip(SRC, SLOTS, strict=True):
            assert torch.equal(
                pool.tensor[slot, : geom.page_nbytes].to(dev), reference_page(geom, b)
            )
        with torch.cuda.stream(side):
            torch.cuda._sleep(SLEEP_CYCLES)
            for t in caches.values():  # written before the load is submitted: the load wins
                t.view(torch.int8).index_fill_(0, dst_idx, 0x5A)
            load = eng.submit_h2d(SLOTS, DST)
        # Another stream reads the blocks once it waits for the load (still behind the sleep):
        # without that wait it would read the poison.
        reader = torch.cuda.Stream(dev)
        with torch.cuda.stream(reader):
            load.make_current_stream_wait()
            got = {name: t.view(torch.int8).index_select(0, dst_idx) for name, t in caches.items()}
        reader.synchronize()
        assert load.done()
    for name in caches:
        assert torch.equal(got[name], new[name]), f"{name}: loaded blocks differ"


@pytest.mark.parametrize("be", BACKENDS, ids=lambda b: b.id)
def test_back_to_back_batches_without_waiting(be: Backend) -> None:
    """Several batches per direction in flight at once (staging buffers reused across batches,
    events only): after synchronize() every page and every block is right."""
    dev = _device()
    caches = vllm_caches("LHBNC", dev, num_blocks=48)
    fill_random(caches, seed=21)
    geom = describe_kv_caches(caches)
    before = {name: t.clone() for name, t in caches.items()}
    gen = torch.Generator().manual_seed(5)
    src = torch.randperm(48, generator=gen)[:30].tolist()
    slots = torch.randperm(32, generator=gen)[:30].tolist()
    dst = torch.randperm(48, generator=gen)[:30].tolist()
    batches = [slice(i, i + 6) for i in range(0, 30, 6)]
    with pinned_pool(geom, num_slots=32) as pool, engine_for(caches, pool, be) as eng:
        handles = [eng.submit_d2h(src[b], slots[b]) for b in batches]
        eng.synchronize()
        assert all(h.done() for h in handles)
        for b, slot in zip(src, slots, strict=True):
            assert torch.equal(
                pool.tensor[slot, : geom.page_nbytes].to(dev), reference_page(geom, b)
            )
        for t in caches.values():
            t.view(torch.int8).index_fill_(0, torch.tensor(dst, device=dev), 0x5A)
        handles = [eng.submit_h2d(slots[b], dst[b]) for b in batches]
        for h in handles:
            h.make_current_stream_wait()
        got = {
            name: bits(t).index_select(0, torch.tensor(dst, device=dev))
            for name, t in caches.items()
        }
        torch.cuda.synchronize()
        assert all(h.done() for h in handles)
    for name, t in caches.items():
        want = bits(before[name]).index_select(0, torch.tensor(src, device=dev))
        assert torch.equal(got[name], want), f"{name}: loaded blocks differ"
        untouched = [b for b in range(48) if b not in dst]
        assert torch.equal(bits(t)[untouched], bits(before[name])[untouched])


# -- pinned host pool ----------------------------------------------------------------------------


def _cudart() -> Any:
    from cuda.bindings import runtime as cudart

    return cudart


def memory_type(address: int) -> Any:
    cudart = _cudart()
    err, attrs = cudart.cudaPointerGetAttributes(address)
    assert err == cudart.cudaError_t.cudaSuccess, err
    return attrs.type


def is_registered(address: int) -> bool:
    return memory_type(address) == _cudart().cudaMemoryType.cudaMemoryTypeHost


@pytest.mark.parametrize("backing", ["native", "mmap"])
def test_host_pool_is_pinned_mapped_and_unregistered_on_close(backing: str) -> None:
    cudart = _cudart()
    slot = 2 * 4096
    pool = HostPool(6, slot, pin=True, backing=backing)
    assert pool.backing == backing and pool.pinned
    addresses = [pool.address, pool.slot_address(5) + slot - 1]
    try:
        assert pool.tensor.is_pinned()
        assert pool.tensor[3].is_pinned()
        assert pool.tensor.view(-1)[pool.nbytes - 8 :].is_pinned()
        for a in addresses:
            assert is_registered(a), hex(a)
        err, dptr = cudart.cudaHostGetDevicePointer(pool.address, 0)  # registered as mapped
        assert err == cudart.cudaError_t.cudaSuccess and int(dptr) != 0
        # The GPU reads and writes the pool through those pages.
        pool.tensor[2].copy_(torch.arange(slot, dtype=torch.int64).to(torch.uint8))
        on_gpu = pool.tensor[2].to(_device(), non_blocking=True)
        pool.tensor[4].copy_((on_gpu + 1).cpu())
        torch.cuda.synchronize()
        assert torch.equal(pool.tensor[4], pool.tensor[2] + 1)
    finally:
        pool.close()  # views must not be used after this: the memory is unmapped too
    assert pool.closed and not pool.pinned
    for a in addresses:
        assert memory_type(a) == cudart.cudaMemoryType.cudaMemoryTypeUnregistered, hex(a)


def test_host_pool_pins_by_default_when_cuda_is_available() -> None:
    with HostPool(2, 4096) as pool:
        assert pool.pinned and pool.tensor.is_pinned()
        assert is_registered(pool.address)


def test_host_pool_registers_in_chunks_and_unregisters_all(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pool larger than one registration chunk (cut to 3 slots here) is pinned chunk by chunk
    (4 register threads), copies into every chunk work, and close unregisters every chunk."""
    caches = vllm_caches("LBNHC", _device(), num_blocks=NUM_BLOCKS)
    fill_random(caches, seed=31)
    geom = describe_kv_caches(caches)
    monkeypatch.setattr(host_pool_module, "MAX_REGISTER_CHUNK", 3 * geom.slot_nbytes)
    pool = HostPool(10, geom.slot_nbytes, pin=True, register_threads=4)
    try:
        assert pool.pinned
        assert len(pool._registered) == 4  # 3 + 3 + 3 + 1 slots
        for s in range(10):
            assert is_registered(pool.slot_address(s)), s
            assert pool.tensor[s].is_pinned()
        with TransferEngine(caches, pool, backend="copy_engine") as eng:
            ids = [23, 1, 17, 8, 12, 5, 0, 19, 9, 14]
            eng.submit_d2h(ids, list(range(10))).wait(timeout=60)
            for s, b in enumerate(ids):
                assert torch.equal(
                    pool.tensor[s, : geom.page_nbytes].to(geom.device), reference_page(geom, b)
                )
        addresses = [pool.slot_address(s) for s in range(10)]
    finally:
        pool.close()
    for s, a in enumerate(addresses):
        assert not is_registered(a), s


# -- spill path (host tier smaller than what is stored) and SSD restart --------------------------


def _namespace(page: int) -> Any:
    from flexkv_py.index.namespace import Namespace

    return Namespace(
        model="test/cuda-spill",
        revision=None,
        kv_dtype="bfloat16",
        kv_layout="LBNHC",
        block_size=16,
        page_bytes=page,
    )


def _config(
    directory: Path, host_slots: int, ssd_blocks: int, slot: int, backend: str, **kw: Any
) -> Any:
    from flexkv_py.config import load_config

    directory.mkdir(exist_ok=True)
    over = {
        "cpu_cache_gb": host_slots * slot / GIB,
        "ssd_cache_gb": 2.5 * ssd_blocks * (slot + 8192) / GIB,
        "ssd_cache_dir": str(directory),
        "transfer_engine": backend,
        **kw,
    }
    return load_config(over, env={})


@pytest.mark.parametrize("backend", PATHS)
def test_spill_to_ssd_and_reload_everything_bit_exact(tmp_path: Path, backend: str) -> None:
    """48 blocks through a 12-slot host tier (write-back): stores evict host slots to SSD
    first (the spill-then-copy path on a side stream), every store sees the bytes the caller's
    stream wrote just before it, and all 48 load back bit-exact from host and SSD."""
    from flexkv_py.coordinator import CacheEngine
    from flexkv_py.index.tier_names import Tier

    dev = _device()
    n, host_slots, chunk = 48, 12, 6
    caches = vllm_caches("LBNHC", dev, num_layers=4, num_blocks=2 * n + 4)
    fill_random(caches, seed=41)
    geom = describe_kv_caches(caches)
    ns = _namespace(geom.page_nbytes)
    cfg = _config(tmp_path / "ssd", host_slots, n + 16, geom.slot_nbytes, backend)
    perm = torch.randperm(2 * n + 4, generator=torch.Generator().manual_seed(3)).tolist()
    src, dst = perm[:n], perm[n : 2 * n]
    keys = ns.keys([b"%032x" % i for i in range(n)])
    fresh = {
        name: torch.randint(-128, 128, t.view(torch.int8)[src].shape, device=dev, dtype=torch.int8)
        for name, t in caches.items()
    }
    engine = CacheEngine.from_kv_caches(cfg, ns, caches)
    try:
        assert engine.pool.num_slots == host_slots and engine.pool.pinned
        assert Tier.SSD in engine.executor.tiers
        assert engine.executor.transfer.backend["d2h"].name == backend
        for lo in range(0, n, chunk):
            idx = torch.tensor(src[lo : lo + chunk], device=dev)
            torch.cuda._sleep(SLEEP_CYCLES // 10)  # the writes below are still queued at store
            for name, t in caches.items():
                t.view(torch.int8).index_copy_(0, idx, fresh[name][lo : lo + chunk])
            outcome = engine.store(keys[lo : lo + chunk], src[lo : lo + chunk])
            assert outcome.ok, (lo, outcome.statuses)
        engine.flush()
        assert engine.lookup(keys) == n
        dst_idx = torch.tensor(dst, device=dev)
        for t in caches.values():
            t.view(torch.int8).index_fill_(0, dst_idx, 0x5A)
        sources: list[str] = []
        for lo in reversed(range(0, n, chunk)):  # newest first: those are still in host slots
            outcome = engine.load(keys[lo : lo + chunk], dst[lo : lo + chunk])
            assert outcome.num_ok == len(keys[lo : lo + chunk]), (lo, outcome.statuses)
            sources += outcome.source_tiers
        assert sources.count("ssd") >= n - host_slots, sources
        assert sources.count("host") >= chunk, sources
        for name, t in caches.items():
            got = t.view(torch.int8).index_select(0, dst_idx)
            assert torch.equal(got, fresh[name]), f"{name}: reloaded blocks differ"
    finally:
        engine.close()


def test_restarted_engine_loads_from_ssd_alone(tmp_path: Path) -> None:
    """Write-through store, close, reopen: the new host tier is empty and every block comes
    back from SSD through host slots into other GPU blocks, bit-exact."""
    from flexkv_py.coordinator import CacheEngine

    dev = _device()
    n = 20
    caches = vllm_caches("BLNHC", dev, num_layers=4, num_blocks=2 * n)
    fill_random(caches, seed=51)
    geom = describe_kv_caches(caches)
    ns = _namespace(geom.page_nbytes)
    cfg = _config(
        tmp_path / "ssd", n + 4, 2 * n, geom.slot_nbytes, "auto", admission="write_through"
    )
    src, dst = list(range(0, 2 * n, 2)), list(range(2 * n - 1, 0, -2))
    keys = ns.keys([b"%032x" % i for i in range(n)])
    want = {name: bits(t)[src].clone() for name, t in caches.items()}
    with CacheEngine.from_kv_caches(cfg, ns, caches) as engine:
        assert engine.store(keys, src).ok
    with CacheEngine.from_kv_caches(cfg, ns, caches) as engine:
        assert engine.lookup(keys) == n
        for t in caches.values():
            t.view(torch.int8)[dst] = 0x5A
        outcome = engine.load(keys, dst)
        assert outcome.ok and set(outcome.source_tiers) == {"ssd"}, outcome.source_tiers
        for name, t in caches.items():
            assert torch.equal(bits(t)[dst], want[name]), f"{name}: blocks from SSD differ"


def streamed_store_then_reload(tmp_path: Path, dev: torch.device, backend: str) -> None:
    """A store of 30 blocks through a 6-slot host tier streams through the slots in rounds
    (GPU -> host copy, SSD write, slot reuse: coordinator/stores.py) and sees the bytes the
    caller's stream wrote just before it; after a restart the 30 blocks come back from SSD
    through the same few slots into other GPU blocks, bit-exact."""
    from flexkv_py.coordinator import CacheEngine

    n, host_slots = 30, 6
    caches = vllm_caches("LBNHC", dev, num_layers=4, num_blocks=2 * n + 2)
    fill_random(caches, seed=61)
    geom = describe_kv_caches(caches)
    ns = _namespace(geom.page_nbytes)
    cfg = _config(
        tmp_path / "ssd", host_slots, 2 * n, geom.slot_nbytes, backend, admission="write_through"
    )
    src, dst = list(range(0, 2 * n, 2)), list(range(2 * n - 1, 0, -2))
    keys = ns.keys([b"stream-%026x" % i for i in range(n)])
    fresh = {
        name: torch.randint(-128, 128, t.view(torch.int8)[src].shape, device=dev, dtype=torch.int8)
        for name, t in caches.items()
    }
    with CacheEngine.from_kv_caches(cfg, ns, caches) as engine:
        assert engine.pool.num_slots == host_slots
        if dev.type == "cuda":
            torch.cuda._sleep(SLEEP_CYCLES // 10)  # the writes below are still queued at store
        idx = torch.tensor(src, device=dev)
        for name, t in caches.items():
            t.view(torch.int8).index_copy_(0, idx, fresh[name])
        outcome = engine.store(keys, src)
        assert outcome.ok, outcome.statuses
        assert engine.manager.stats()["store_streamed_blocks"] > 0
    with CacheEngine.from_kv_caches(cfg, ns, caches) as engine:
        got_n = engine.lookup(keys)
        assert got_n > host_slots, got_n  # more than one round of the host tier
        for t in caches.values():
            t.view(torch.int8)[dst] = 0x5A
        outcome = engine.load(keys[:got_n], dst[:got_n])
        assert outcome.ok and set(outcome.source_tiers) == {"ssd"}, outcome.source_tiers
        for name, t in caches.items():
            got = t.view(torch.int8)[dst[:got_n]]
            assert torch.equal(got, fresh[name][:got_n]), f"{name}: blocks from SSD differ"


@pytest.mark.parametrize("backend", PATHS)
def test_store_larger_than_the_host_tier_streams_through_it(tmp_path: Path, backend: str) -> None:
    streamed_store_then_reload(tmp_path, _device(), backend)
