"""KV cache groups (vLLM's hybrid allocator) over one rank's registered KV tensors.

With HMA, vLLM gives every group the same number of layer slots and makes group i's slot j a
view of the same memory as group k's slot j (`KVCacheTensor`, vllm/v1/worker/utils.py
allocate_kv_cache); a block id belongs to one group at a time. So the page of block b over the
distinct views (`describe_kv_caches` pages aliased views once) holds block b's bytes of
whichever group owns it, and one transfer engine and one host slot size serve every group.
`transfer_kv_caches` picks the layers the engine moves (Mamba state views, whose bytes lie inside
the attention layers' pages, are left out) and verifies that before the executor is built:
groups whose layers are not covered that way are refused.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from flexkv_py.transfer.errors import UnsupportedKVLayoutError
from flexkv_py.transfer.kv_layout import KVPageGeometry, describe_kv_caches


def describe_kv_cache_groups(
    kv_caches: Mapping[str, Any], groups: Sequence[Sequence[str]]
) -> dict[int, KVPageGeometry]:
    """Page geometry of each group's own layers (those this rank registered)."""
    out: dict[int, KVPageGeometry] = {}
    for gid, names in enumerate(groups):
        layers = {n: kv_caches[n] for n in names if n in kv_caches}
        if layers:
            out[gid] = describe_kv_caches(layers)
    return out


def _runs(geom: KVPageGeometry) -> list[tuple[int, int, int]]:
    """(address of block 0's run, block stride, bytes) per segment."""
    return [
        (geom.storage_address(s.storage) + s.gpu_offset, s.block_stride, s.nbytes)
        for s in geom.segments
    ]


def check_groups_share_pages(
    kv_caches: Mapping[str, Any], groups: Sequence[Sequence[str]]
) -> KVPageGeometry:
    """The geometry over every layer, after checking it moves each group's whole block."""
    whole = describe_kv_caches(kv_caches)
    if len(groups) > 1:
        _check_covered(whole, kv_caches, groups)
    return whole


def transfer_kv_caches(
    kv_caches: Mapping[str, Any],
    groups: Sequence[Sequence[str]],
    state_groups: Collection[int] = (),
) -> dict[str, Any]:
    """The layers one transfer engine moves so that every group's block travels whole.

    Mamba (state) layers are int8 views with a padded block stride over the same layer slots as
    the attention layers (vLLM pads the state page up to the attention page): the attention
    layers' pages already hold every state byte, so the state layers are left out (their dtype
    differs, and describing them too would page the same bytes twice). Refused, naming the
    group, when some group's bytes are not covered that way."""
    state_layers = {n for g in state_groups for n in groups[g]}
    moved = {n: t for n, t in kv_caches.items() if n not in state_layers}
    if not moved:
        raise UnsupportedKVLayoutError(
            "KV cache groups: only state (Mamba) layers registered; a hybrid model needs an "
            "attention group whose layer slots hold the states"
        )
    try:
        _check_covered(describe_kv_caches(moved), kv_caches, groups)
    except UnsupportedKVLayoutError:
        # Groups of different block sizes view the same slots with different shapes (vLLM
        # evens out pages by raising a group's block size), so their views are not identical
        # and do not dedup: one group's layers then hold every group's bytes.
        for names in groups:
            one = {n: t for n, t in moved.items() if n in set(names)}
            if one and _covers(one, kv_caches, groups):
                return one
        raise
    return moved


def _covers(
    moved: dict[str, Any], kv_caches: Mapping[str, Any], groups: Sequence[Sequence[str]]
) -> bool:
    try:
        _check_covered(describe_kv_caches(moved), kv_caches, groups)
    except UnsupportedKVLayoutError:
        return False
    return True


def _check_covered(
    whole: KVPageGeometry, kv_caches: Mapping[str, Any], groups: Sequence[Sequence[str]]
) -> None:
    runs = _runs(whole)
    for gid, geom in describe_kv_cache_groups(kv_caches, groups).items():
        for addr, stride, nbytes in _runs(geom):
            if not any(s == stride and a <= addr and addr + nbytes <= a + n for a, s, n in runs):
                raise UnsupportedKVLayoutError(
                    f"KV cache group {gid} ({', '.join(geom.layer_names)}): its blocks are not "
                    "views of the same memory as the other groups' (page "
                    f"{geom.page_nbytes} bytes vs {whole.page_nbytes}); groups must share "
                    "their layer slots as vLLM's hybrid allocator lays them out"
                )
