"""The hybrid hit (every KV cache group must be able to restore the prefix) against a brute-force
oracle, and the per-group key namespace (format version 3)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from flexkv_py.errors import ConfigError
from flexkv_py.index.namespace import FORMAT_VERSION, Namespace
from flexkv_py.integration.vllm.group_plans import ReuseFence, load_targets, store_targets
from flexkv_py.integration.vllm.hybrid_hit import hit_limit, longest_hybrid_hit, window_end


@dataclass(frozen=True)
class G:
    group_id: int
    kind: str
    window_blocks: int = 0


def readable_fn(present: list[set[int]]):  # type: ignore[no-untyped-def]
    def readable(gid: int, start: int, stop: int) -> int:
        for i in range(start, stop):
            if i not in present[gid]:
                return i
        return stop

    return readable


def oracle(groups: list[G], present: list[set[int]], first: int, limit: int) -> int:
    """Largest end e in (first, limit] that every group can serve, else first."""
    for e in range(limit, first, -1):
        ok = True
        for g in groups:
            lo = first if g.kind == "full" else max(first, e - g.window_blocks)
            if any(i not in present[g.group_id] for i in range(lo, e)):
                ok = False
                break
        if ok:
            return e
    return first


@st.composite
def scenarios(draw: st.DrawFn) -> tuple[list[G], list[set[int]], int, int]:
    n = draw(st.integers(1, 24))
    kinds = draw(st.lists(st.sampled_from(["full", "sliding", "mamba"]), min_size=1, max_size=3))
    window = {"full": st.just(0), "sliding": st.integers(0, 6), "mamba": st.just(1)}
    groups = [G(i, k, draw(window[k])) for i, k in enumerate(kinds)]
    present = [set(draw(st.sets(st.integers(0, n - 1)))) for _ in groups]
    first = draw(st.integers(0, n))
    return groups, present, first, n


@given(scenarios())
def test_hit_matches_brute_force_oracle(s: tuple[list[G], list[set[int]], int, int]) -> None:
    groups, present, first, limit = s
    got = longest_hybrid_hit(groups, first, limit, readable_fn(present))
    assert got == oracle(groups, present, first, limit)


def test_hit_is_min_over_groups() -> None:
    full = set(range(10))
    groups = [G(0, "full"), G(1, "full")]
    assert longest_hybrid_hit(groups, 0, 10, readable_fn([full, set(range(6))])) == 6
    assert longest_hybrid_hit(groups, 0, 10, readable_fn([set(range(3)), full])) == 3


def test_swa_gap_inside_window_shortens_hit() -> None:
    groups = [G(0, "full"), G(1, "sliding", 3)]
    swa = set(range(10)) - {8}  # block 8 is in the window of any end in 9..10
    assert longest_hybrid_hit(groups, 0, 10, readable_fn([set(range(10)), swa])) == 8


def test_gap_below_window_is_irrelevant() -> None:
    groups = [G(0, "full"), G(1, "sliding", 3)]
    swa = set(range(7, 10))  # only the last 3 blocks: enough for the end at 10
    assert longest_hybrid_hit(groups, 0, 10, readable_fn([set(range(10)), swa])) == 10
    assert window_end(3, 0, 10, lambda a, b: b if a >= 7 else 7) == 10


def test_missing_mamba_state_shortens_hit() -> None:
    # Attention holds blocks 0..9; the state exists only after blocks 4 and 7 (the
    # boundaries vLLM handed off): the hit ends where a state does.
    groups = [G(0, "mamba", 1), G(1, "full")]
    present = [{3, 6}, set(range(10))]
    assert longest_hybrid_hit(groups, 0, 10, readable_fn(present)) == 7
    assert longest_hybrid_hit(groups, 0, 6, readable_fn(present)) == 4
    # No state past the local hit: nothing to load.
    assert longest_hybrid_hit(groups, 7, 10, readable_fn(present)) == 7


def test_mamba_loads_one_state_block_and_stores_only_hand_offs() -> None:
    from types import SimpleNamespace

    from flexkv_py.integration.vllm.engine_info import GroupInfo
    from flexkv_py.integration.vllm.group_plans import BoundaryStates

    ns = Namespace(model="m", revision=None, kv_dtype="bfloat16", kv_layout="LBNHC", block_size=16)
    mamba = GroupInfo(0, "mamba", 16, 0, ("m",), 64, ns.for_group(0, "mamba"))
    full = GroupInfo(1, "full", 16, 0, ("a",), 64, ns.for_group(1, "full"))
    assert mamba.window_blocks == 1 and mamba.restores_state
    tables = [[0, 0, 0, 5, 9], [1, 2, 3, 4, 6]]
    # A hit [0, 4): the state block at index 3 (after 64 tokens), every attention block.
    assert load_targets([mamba, full], tables, 0, 4) == [(0, 3, 5)] + [
        (1, i, tables[1][i]) for i in range(4)
    ]
    # Mamba positions are never stored positionally: only what vLLM hands off.
    assert all(g == 1 for g, _, _ in store_targets([mamba, full], tables, 0, 5))
    states = BoundaryStates([mamba, full], 16)

    def step(offloads: dict[str, list[tuple[int, int, int]]]) -> SimpleNamespace:
        return SimpleNamespace(
            kv_connector_block_state=SimpleNamespace(boundary_state_offloads=offloads)
        )

    # A sub-block boundary has no hash (not cached); another group's entry is not a state.
    states.offer(step({"r": [(0, 5, 64), (0, 7, 70), (1, 2, 32)], "s": [(0, 8, 32)]}))
    assert states.take("r", 63, 4) == []  # the step computing token 64 has not run yet
    assert states.take("r", 64, 4) == [(0, 3, 5)]
    assert states.take("r", 64, 4) == []  # taken once
    states.forget("s")  # preempted or finished: its state blocks are gone
    assert states.take("s", 32, 2) == []


def test_hit_limit_keeps_the_last_token_only_with_state_groups() -> None:
    # A Mamba group has no state one token before a block-aligned prompt's end.
    assert hit_limit(320, 20, 16, state_groups=True) == 19
    assert hit_limit(321, 20, 16, state_groups=True) == 20
    # Attention groups serve the whole prompt; vLLM recomputes its last token.
    assert hit_limit(320, 20, 16, state_groups=False) == 20


def test_targets_skip_null_blocks_and_load_only_the_window() -> None:
    from flexkv_py.integration.vllm.engine_info import GroupInfo

    ns = Namespace(model="m", revision=None, kv_dtype="bfloat16", kv_layout="LBNHC", block_size=16)
    full = GroupInfo(0, "full", 16, 0, ("a",), 64, ns)
    swa = GroupInfo(1, "sliding", 16, 48, ("b",), 64, ns.for_group(1, "sliding", 48))
    assert swa.window_blocks == 3
    tables = [[1, 2, 3, 4, 5, 6], [0, 0, 7, 8, 9, 10]]
    # A hit [1, 6): full loads 1..5, the sliding group only the window 3..5.
    assert load_targets([full, swa], tables, 1, 6) == [
        (0, i, tables[0][i]) for i in range(1, 6)
    ] + [(1, i, tables[1][i]) for i in range(3, 6)]
    # Stores skip the null (freed) sliding-window blocks.
    assert [t for t in store_targets([full, swa], tables, 0, 6) if t[0] == 1] == [
        (1, i, tables[1][i]) for i in range(2, 6)
    ]


def test_sliding_store_interval_keeps_windows_before_boundaries_and_the_tail() -> None:
    from flexkv_py.integration.vllm.engine_info import GroupInfo

    ns = Namespace(model="m", revision=None, kv_dtype="bfloat16", kv_layout="LBNHC", block_size=16)
    full = GroupInfo(0, "full", 16, 0, ("a",), 64, ns)
    swa = GroupInfo(1, "sliding", 16, 32, ("b",), 64, ns.for_group(1, "sliding", 32))
    assert swa.window_blocks == 2
    tables = [list(range(1, 12)), list(range(21, 32))]

    def sliding(start: int, stop: int, final: bool = False) -> list[int]:
        targets = store_targets([full, swa], tables, start, stop, interval=4, final=final)
        assert [i for g, i, _ in targets if g == 0] == list(range(start, stop))  # full: all
        return [i for g, i, _ in targets if g == 1]

    # Windows before boundaries 4 and 8: blocks 2, 3, 6, 7; what the run planned in two parts.
    assert sliding(0, 5) + sliding(5, 9) == [2, 3, 6, 7]
    # The request ends at 11: its last window, 9 and 10, though the plan starts at 11.
    assert sliding(9, 11, final=True) == [9, 10]
    # Ending on a boundary's window, nothing is planned twice.
    assert sliding(8, 8, final=True) == []
    # The lookup side: a hit ends only where a whole window was stored.
    stored = {2, 3, 6, 7, 9, 10}
    groups = [G(0, "full"), G(1, "sliding", 2)]
    got = [
        longest_hybrid_hit(groups, 0, e, readable_fn([set(range(11)), stored])) for e in (11, 10, 7)
    ]
    assert got == [11, 8, 4]


def test_reuse_fence_names_jobs_reading_reused_blocks() -> None:
    fence = ReuseFence()
    fence.add(7, [3, 4])
    fence.add(8, [4])
    assert fence.reading([4, 9]) == {7, 8}
    fence.done(7)
    assert fence.reading([3, 4]) == {8}
    fence.done(8)
    assert not fence.reading([3, 4]) and not len(fence)


# ---------------------------------------------------------------- key namespace (v3)
def _ns(**kw: object) -> Namespace:
    base: dict[str, object] = {
        "model": "m",
        "revision": None,
        "kv_dtype": "bfloat16",
        "kv_layout": "LBNHC",
        "block_size": 16,
    }
    return Namespace(**{**base, **kw})  # type: ignore[arg-type]


def test_group_id_changes_prefix_not_key_length() -> None:
    a, b = _ns(), _ns().for_group(1, "sliding", 128)
    h = b"\x11" * 32
    assert a.prefix != b.prefix
    assert len(a.key(h)) == len(b.key(h))
    assert b.block_hash(b.key(h)) == h


def test_same_hash_two_groups_two_keys() -> None:
    groups = ((0, "full", 0, 64), (1, "sliding", 128, 64))
    base = _ns(groups=groups)
    g0 = base.for_group(0, "full", 0, page_bytes=64)
    g1 = base.for_group(1, "sliding", 128, page_bytes=64)
    h = b"\x22" * 32
    assert g0.key(h) != g1.key(h)
    # Each group's namespace owns both groups' keys (one pool, one SSD shard), nobody else's.
    assert g0.owns(g1.key(h)) and g1.owns(g0.key(h))
    # Without the engine's group list a namespace owns its own group's keys only.
    assert not _ns().for_group(1, "sliding", 128).owns(g0.key(h))
    assert not _ns(model="other", groups=groups).owns(g0.key(h))
    # The window is part of the identity: another window never hits.
    assert base.for_group(1, "sliding", 64).prefix != g1.prefix


def test_format_version_3_keys_differ_from_v2() -> None:
    import hashlib
    import json

    assert FORMAT_VERSION == 3
    ns = _ns()
    v2 = {
        "v": 2,
        "model": "m",
        "revision": "",
        "kv_dtype": "bfloat16",
        "kv_layout": "LBNHC",
        "block_size": 16,
        "tp_size": 1,
        "pp_size": 1,
        "hash_algo": "sha256",
        "page_bytes": 0,
        "model_identity": "",
    }
    canonical = json.dumps(v2, sort_keys=True, separators=(",", ":")).encode()
    assert ns.prefix != hashlib.blake2b(canonical, digest_size=16).digest()


@pytest.mark.parametrize("bad", [{"group_kind": "linear"}, {"group_id": -1}, {"window": -1}])
def test_namespace_rejects_bad_group(bad: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        _ns(**bad)


def test_sliding_store_interval_must_be_positive() -> None:
    from flexkv_py.config import load_config

    assert load_config({"sliding_store_interval_blocks": "16"}).sliding_store_interval_blocks == 16
    with pytest.raises(ConfigError, match="sliding_store_interval_blocks: must be >= 1, got 0"):
        load_config({"sliding_store_interval_blocks": 0})


@dataclass(frozen=True)
class Scaled:
    group_id: int
    kind: str
    window_blocks: int = 0
    scale: int = 1


def scaled_oracle(
    groups: list[Scaled], present: list[set[int]], first: int, limit: int, align: int
) -> int:
    """Largest end e (hash blocks) in (first, limit], a multiple of `align`, that every group
    serves at its own block size, else first."""
    for e in range(limit, first, -1):
        if e % align:
            continue
        ok = True
        for g in groups:
            lo, hi = first // g.scale, e // g.scale
            lo = lo if g.kind == "full" else max(lo, hi - g.window_blocks)
            ok = ok and all(i in present[g.group_id] for i in range(lo, hi))
        if ok:
            return e
    return first


@given(
    full=st.sets(st.integers(0, 23)),
    swa=st.sets(st.integers(0, 11)),
    need=st.integers(1, 4),
    first_blocks=st.integers(0, 4),
    limit=st.integers(0, 24),
)
def test_hit_over_groups_of_different_block_sizes_matches_oracle(
    full: set[int], swa: set[int], need: int, first_blocks: int, limit: int
) -> None:
    # Full attention at the hash block size, sliding window at twice it: hits end on 2 blocks.
    groups = [Scaled(0, "sliding", need, 2), Scaled(1, "full", 0, 1)]
    present = [swa, full]
    first = 2 * first_blocks  # vLLM's local hit lies on its scheduler block size
    got = longest_hybrid_hit(groups, first, limit, readable_fn(present), align=2)
    assert got == scaled_oracle(groups, present, first, limit, 2)
    assert got % 2 == 0 or got == first


def test_group_block_size_is_in_its_prefix_and_owned_by_siblings() -> None:
    base = Namespace(model="m", revision=None, kv_dtype="bf16", kv_layout="LBNHC", block_size=16)
    base = replace(
        base, groups=((0, "sliding", 128, 64), (1, "full", 0, 64)), group_block_sizes=(32, 16)
    )
    swa = base.for_group(0, "sliding", 128, page_bytes=64, block_size=32)
    same_but_16 = base.for_group(0, "sliding", 128, page_bytes=64)
    full = base.for_group(1, "full", 0, page_bytes=64)
    h = b"\x01" * 32
    assert swa.prefix != same_but_16.prefix
    assert full.owns(swa.key(h)) and swa.owns(full.key(h))
    assert not full.owns(same_but_16.key(h))
