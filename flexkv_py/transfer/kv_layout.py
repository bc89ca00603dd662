"""Describe the KV cache tensors vLLM registers as one host page per engine block.

vLLM 0.33 hands the connector one tensor per attention layer. Each is a view of a shared int8
buffer, shaped ``[B, H, N, C]`` (blocks, kv heads, tokens per block, K and V concatenated on the
last dim; MLA: H = 1), whose *physical* order is one of LBNHC (default), LBHNC, LHBNC, BLHNC,
BLNHC or BHLNC. Older vLLM and many tests use FlashAttention's ``(2, B, N, H, D)`` per layer or
FlashInfer's ``(B, 2, N, H, D)``; legacy MLA uses ``(B, N, C)``.

Whatever the layout, one block of one layer is a handful of contiguous byte runs ("segments") at a
fixed distance (the block stride) from the previous block's. This module finds those runs from the
strides, orders them deterministically, and packs them into one contiguous host page per block:
all layers, K and V, of this worker's shard. Adjacent runs merge, so block-outermost layouts
(BL*, BHLNC) move each block as one large copy.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from flexkv_py.tiers.alignment import round_up_to_slot
from flexkv_py.transfer.errors import UnsupportedKVLayoutError

logger = logging.getLogger(__name__)

MIN_SEGMENT_NBYTES = 256  # below this the copy is all overhead: refuse rather than crawl
MAX_SEGMENTS_PER_LAYER = 4096

VLLM_LAYOUTS = ("LBNHC", "LBHNC", "LHBNC", "BLHNC", "BLNHC", "BHLNC")


@dataclass(frozen=True)
class Segment:
    """One contiguous run of a block's bytes on the device and where it goes in the host page."""

    storage: int  # index into KVPageGeometry.storages
    gpu_offset: int  # bytes from the storage's first byte to block 0's run
    block_stride: int  # bytes from block b's run to block b+1's
    host_offset: int  # bytes from the start of the host page
    nbytes: int


@dataclass(frozen=True)
class KVPageGeometry:
    """How one engine block maps onto one contiguous host page."""

    layout: str
    dtype: torch.dtype
    device: torch.device
    num_blocks: int
    layer_names: tuple[str, ...]
    layer_shapes: tuple[tuple[int, ...], ...]  # per layer, as registered
    segments: tuple[Segment, ...]
    storages: tuple[torch.Tensor, ...]  # flat uint8 tensors over each backing storage
    page_nbytes: int

    @property
    def num_layers(self) -> int:
        return len(self.layer_names)

    @property
    def slot_nbytes(self) -> int:
        """Host slot / SSD block size: the page rounded up to 4096 bytes."""
        return round_up_to_slot(self.page_nbytes)

    @property
    def fingerprint(self) -> str:
        """Everything that fixes the page format (not the number of GPU blocks): goes into the
        key namespace so another model, dtype, layout or shard never reads these pages."""
        shapes = sorted({_shape_without_blocks(s, self.layout) for s in self.layer_shapes})
        shape_txt = "+".join("x".join(map(str, s)) for s in shapes)
        dtype = str(self.dtype).removeprefix("torch.")
        return (
            f"{self.layout};{dtype};layers={self.num_layers};shape={shape_txt};"
            f"page={self.page_nbytes}"
        )

    def storage_address(self, index: int) -> int:
        return int(self.storages[index].data_ptr())


def _shape_without_blocks(shape: tuple[int, ...], layout: str) -> tuple[int, ...]:
    block_dim = 1 if layout.startswith("FA:") else 0
    return shape[:block_dim] + shape[block_dim + 1 :]


@dataclass
class _Layer:
    name: str
    tensor: torch.Tensor
    labels: str  # one letter per logical dim, e.g. "BHNC"
    block_dim: int
    family: str  # "" (vLLM 0.33 4-D), "FA:", "FI:", "MLA:"
    storage_key: int
    base_offset: int  # bytes from the storage start to the tensor's first element
    run_offsets: list[int]  # block 0's runs, relative to base_offset
    run_nbytes: int
    block_stride: int


def _classify(name: str, t: torch.Tensor, num_blocks: int | None) -> tuple[str, str, int]:
    """(family, labels, block dim) from the tensor's shape."""
    shape = tuple(t.shape)
    if t.dim() == 4:
        return "", "BHNC", 0
    if t.dim() == 3:
        return "MLA:", "BNC", 0
    if t.dim() == 5:
        kv_first = shape[0] == 2 and (num_blocks is None or shape[1] == num_blocks)
        blocks_first = shape[1] == 2 and (num_blocks is None or shape[0] == num_blocks)
        if kv_first and not blocks_first:
            return "FA:", "2BNHD", 1
        if blocks_first and not kv_first:
            return "FI:", "B2NHD", 0
        raise UnsupportedKVLayoutError(
            f"KV cache {name!r}: shape {shape} could be FlashAttention (2, B, N, H, D) or "
            "FlashInfer (B, 2, N, H, D); pass num_blocks to tell them apart"
        )
    raise UnsupportedKVLayoutError(
        f"KV cache {name!r}: unsupported KV layout, shape {shape} (expected vLLM's [B, H, N, C] "
        "view, FlashAttention (2, B, N, H, D), FlashInfer (B, 2, N, H, D) or MLA (B, N, C))"
    )


def _physical_order(labels: str, t: torch.Tensor) -> str:
    """Logical dims sorted outermost-first by stride (ties keep logical order)."""
    order = sorted(range(t.dim()), key=lambda d: (-t.stride()[d], d))
    return "".join(labels[d] for d in order)


def _runs(name: str, t: torch.Tensor, block_dim: int, order: str) -> tuple[list[int], int]:
    """Offsets (bytes, sorted) and length of the contiguous runs of block 0."""
    elem = t.element_size()
    dims = sorted(
        (t.stride(d) * elem, t.shape[d])
        for d in range(t.dim())
        if d != block_dim and t.shape[d] > 1
    )
    run = elem
    outer: list[tuple[int, int]] = []
    for i, (stride, size) in enumerate(dims):
        if stride == run and not outer:
            run *= size
            continue
        if i == 0:
            raise UnsupportedKVLayoutError(
                f"KV cache {name!r}: unsupported KV layout {order} (shape {tuple(t.shape)}, "
                f"strides {t.stride()}): the innermost dimension is not contiguous"
            )
        if stride < run:
            raise UnsupportedKVLayoutError(
                f"KV cache {name!r}: unsupported KV layout {order}: strides {t.stride()} "
                f"overlap within a block (shape {tuple(t.shape)})"
            )
        outer.append((stride, size))
    count = 1
    for _, size in outer:
        count *= size
    if count > MAX_SEGMENTS_PER_LAYER or run < MIN_SEGMENT_NBYTES:
        raise UnsupportedKVLayoutError(
            f"KV cache {name!r}: unsupported KV layout {order} (shape {tuple(t.shape)}, strides "
            f"{t.stride()}): one block of one layer is split into {count} pieces of {run} bytes; "
            f"need pieces of at least {MIN_SEGMENT_NBYTES} bytes"
        )
    offsets = sorted(
        sum(i * stride for i, (stride, _) in zip(idx, outer, strict=True))
        for idx in itertools.product(*(range(size) for _, size in outer))
    )
    return offsets, run


def _check_disjoint(intervals: list[tuple[int, int, str]], what: str) -> None:
    intervals.sort()
    for (a0, a1, an), (b0, _b1, bn) in itertools.pairwise(intervals):
        if b0 < a1:
            raise UnsupportedKVLayoutError(
                f"unsupported KV layout: {what}: {an!r} and {bn!r} overlap at byte {b0} "
                f"(run [{a0}, {a1}))"
            )


def describe_kv_caches(
    kv_caches: Mapping[str, torch.Tensor], *, num_blocks: int | None = None
) -> KVPageGeometry:
    """Page geometry for the tensors vLLM passes to ``register_kv_caches``.

    Layers that are views of the same memory (vLLM's KV sharing) are paged once. Raises
    UnsupportedKVLayoutError naming the layer, the layout and the reason.
    """
    if not kv_caches:
        raise UnsupportedKVLayoutError("no KV cache tensors registered")
    first = next(iter(kv_caches.values()))
    dtype, device = first.dtype, first.device
    layers: list[_Layer] = []
    seen: dict[tuple[object, ...], str] = {}
    storage_index: dict[int, int] = {}
    storages: list[torch.Tensor] = []
    for name, t in kv_caches.items():
        if not isinstance(t, torch.Tensor):
            raise UnsupportedKVLayoutError(f"KV cache {name!r} is {type(t).__name__}, not a Tensor")
        if t.dtype != dtype or t.device != device:
            raise UnsupportedKVLayoutError(
                f"KV cache {name!r} is {t.dtype} on {t.device}; "
                f"other layers are {dtype} on {device}"
            )
        family, labels, block_dim = _classify(name, t, num_blocks)
        blocks = t.shape[block_dim]
        if num_blocks is None:
            num_blocks = blocks
        if blocks != num_blocks:
            raise UnsupportedKVLayoutError(
                f"KV cache {name!r} has {blocks} blocks (shape {tuple(t.shape)}); "
                f"expected {num_blocks}"
            )
        storage = t.untyped_storage()
        key = storage.data_ptr()
        alias = (key, t.storage_offset(), tuple(t.shape), t.stride())
        if alias in seen:
            logger.debug("KV cache %r shares memory with %r: paged once", name, seen[alias])
            continue
        seen[alias] = name
        if key not in storage_index:
            storage_index[key] = len(storages)
            flat = torch.empty(0, dtype=torch.uint8, device=device)
            flat.set_(storage, 0, (storage.nbytes(),), (1,))
            storages.append(flat)
        order = _physical_order(labels, t)
        offsets, run = _runs(name, t, block_dim, family + order)
        block_stride = t.stride(block_dim) * t.element_size()
        if block_stride <= 0:
            raise UnsupportedKVLayoutError(
                f"KV cache {name!r}: block stride {t.stride(block_dim)} (expanded view?)"
            )
        layers.append(
            _Layer(
                name=name,
                tensor=t,
                labels=labels,
                block_dim=block_dim,
                family=family,
                storage_key=key,
                base_offset=int(t.storage_offset()) * t.element_size(),
                run_offsets=offsets,
                run_nbytes=run,
                block_stride=block_stride,
            )
        )
    assert num_blocks is not None
    families = {layer.family for layer in layers}
    if len(families) > 1:
        raise UnsupportedKVLayoutError(
            f"KV caches mix layouts {sorted(f or 'vLLM [B,H,N,C]' for f in families)}"
        )
    layout = _layout_name(layers)
    if layers[0].family == "" and layout not in VLLM_LAYOUTS:
        # Attention kernels never produce these; refuse rather than guess at a page format.
        raise UnsupportedKVLayoutError(
            f"unsupported KV layout {layout} (layer {layers[0].name!r}, shape "
            f"{tuple(layers[0].tensor.shape)}, strides {layers[0].tensor.stride()}); "
            f"supported: {', '.join(VLLM_LAYOUTS)} and the legacy FlashAttention/FlashInfer "
            "5-D layouts"
        )
    shared = len(storages) == 1

    # Blocks 0 and 1 of all layers must not touch each other (aliasing, odd strides).
    per_storage: dict[int, list[tuple[int, int, str]]] = {}
    for b in range(min(num_blocks, 2)):
        for layer in layers:
            start = layer.base_offset + b * layer.block_stride
            per_storage.setdefault(layer.storage_key, []).extend(
                (start + o, start + o + layer.run_nbytes, f"{layer.name}[block {b}]")
                for o in layer.run_offsets
            )
    for ivs in per_storage.values():
        _check_disjoint(ivs, "KV cache runs")

    # Host page order: deterministic across processes. One shared buffer: by offset inside it
    # (fixed by vLLM's layout plan), which also puts a block-outermost block in one run.
    # Separate buffers (allocator-placed): by registration order, then offset.
    raw: list[tuple[int, int, int, int, int]] = []  # (layer key, gpu_off, storage, stride, n)
    for li, layer in enumerate(layers):
        si = storage_index[layer.storage_key]
        for o in layer.run_offsets:
            raw.append(
                (
                    0 if shared else li,
                    layer.base_offset + o,
                    si,
                    layer.block_stride,
                    layer.run_nbytes,
                )
            )
    raw.sort()
    segments: list[Segment] = []
    host = 0
    for _, gpu_off, si, stride, n in raw:
        prev = segments[-1] if segments else None
        if (
            prev is not None
            and prev.storage == si
            and prev.block_stride == stride
            and prev.gpu_offset + prev.nbytes == gpu_off
        ):
            segments[-1] = Segment(si, prev.gpu_offset, stride, prev.host_offset, prev.nbytes + n)
        else:
            segments.append(Segment(si, gpu_off, stride, host, n))
        host += n
    geom = KVPageGeometry(
        layout=layout,
        dtype=dtype,
        device=device,
        num_blocks=num_blocks,
        layer_names=tuple(layer.name for layer in layers),
        layer_shapes=tuple(tuple(layer.tensor.shape) for layer in layers),
        segments=tuple(segments),
        storages=tuple(storages),
        page_nbytes=host,
    )
    logger.info(
        "KV layout %s: %d blocks x %d layers, page %d bytes in %d copy runs per block",
        layout,
        num_blocks,
        geom.num_layers,
        geom.page_nbytes,
        len(segments),
    )
    return geom


def _layout_name(layers: list[_Layer]) -> str:
    """Physical order with L (layer) placed by the distance between consecutive layers.

    Dims of size 1 (MLA's single head) have meaningless strides: they are left out and the name
    is the first vLLM layout with the same order of the remaining dims (same memory anyway).
    """
    first = layers[0]
    t = first.tensor
    keep = "".join(c for d, c in enumerate(first.labels) if t.shape[d] > 1 or d == first.block_dim)
    order = "".join(c for c in _physical_order(first.labels, t) if c in keep)
    storages = {layer.storage_key for layer in layers}
    layer_step: int | None = None
    if len(storages) == 1 and len(layers) > 1:
        bases = sorted(layer.base_offset for layer in layers)
        steps = {b - a for a, b in itertools.pairwise(bases)}
        if len(steps) == 1:
            layer_step = steps.pop()
    if layer_step is None:
        name = "L" + order
    else:
        elem = t.element_size()
        by_label = {first.labels[d]: t.stride(d) * elem for d in range(t.dim())}
        outer = sum(1 for c in order if by_label[c] >= layer_step)
        name = order[:outer] + "L" + order[outer:]
    if first.family == "":
        matches = [v for v in VLLM_LAYOUTS if "".join(c for c in v if c in name) == name]
        if matches:
            name = matches[0]
    else:
        dropped = "".join(c for c in first.labels if c not in keep)
        name += dropped  # legacy names keep every dim; size-1 dims last
    return first.family + name
