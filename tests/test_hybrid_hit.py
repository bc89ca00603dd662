"""The hybrid hit (every KV cache group must be able to restore the prefix) against a brute-force
oracle, and the per-group key namespace (format version 3)."""

from __future__ import annotations

from dataclasses import dataclass

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
    kinds = draw(st.lists(st.sampled_from(["full", "sliding"]), min_size=1, max_size=3))
    groups = [
        G(i, k, draw(st.integers(0, 6)) if k == "sliding" else 0) for i, k in enumerate(kinds)
    ]
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


def test_hit_limit_keeps_the_last_token_for_hybrid() -> None:
    assert hit_limit(320, 20, 16, hybrid=True) == 19
    assert hit_limit(321, 20, 16, hybrid=True) == 20
    assert hit_limit(320, 20, 16, hybrid=False) == 20


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


@pytest.mark.parametrize("bad", [{"group_kind": "mamba"}, {"group_id": -1}, {"window": -1}])
def test_namespace_rejects_bad_group(bad: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        _ns(**bad)
