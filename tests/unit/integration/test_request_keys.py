"""RequestKeys: memoized per-request keys and the lookup by block hash (no keys built), against
the slow path (`Namespace.keys` over all hashes + `TierIndex.lookup`) the scheduler used before."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import flexkv_py.integration.vllm.request_keys as rk_mod
from flexkv_py.index import Namespace, Tier, TierIndex
from flexkv_py.index.namespace import BASE_VARIANT
from flexkv_py.integration.vllm.request_keys import RequestKeys

NS = Namespace(model="m", revision=None, kv_dtype="bfloat16", kv_layout="LBNHC", block_size=16)
LORA = b"\x07" * 8


@dataclass
class Req:
    request_id: str
    block_hashes: list[bytes] = field(default_factory=list)
    lora_request: Any = None


def _hashes(n: int, tag: str = "p", start: int = 0) -> list[bytes]:
    # Chained like vLLM's: a block's hash covers the one before it.
    out: list[bytes] = []
    parent = tag.encode()
    for i in range(n):
        parent = hashlib.sha256(parent + str(start + i).encode()).digest()
        out.append(parent)
    return out


def _index(keys: list[bytes], states: list[str]) -> TierIndex:
    """An index where keys[i] is in states[i]: absent, host (ready), ssd, or filling."""
    idx = TierIndex(len(keys) + 1)
    for key, state in zip(keys, states, strict=False):
        if state in ("host", "filling"):
            (slot,) = idx.allocate_slots(1)
            idx.begin_host_fill(key, slot)
            if state == "host":
                idx.commit_host_fill(key, True)
        elif state == "ssd":
            idx.set_present([key], Tier.SSD, True)
    return idx


def test_miss_at_block_k_returns_k_and_builds_no_keys() -> None:
    hashes = _hashes(500)
    keys = NS.keys(hashes)
    for k in (0, 1, 15, 16, 17, 100, 499, 500):
        idx = _index(keys, ["host"] * k)
        rk = RequestKeys(NS)
        req = Req("r", hashes)
        assert rk.longest_hit(req, 0, BASE_VARIANT, idx.readable_hashes) == k
        assert len(rk) == 0  # the lookup reads hashes; keys are built only for a load
        assert rk.longest_hit(req, 0, BASE_VARIANT, idx.readable_hashes) == k
        for first in (0, k // 2, k, 499):
            want = max(0, k - first) if first < 500 else 0
            assert rk.longest_hit(req, first, BASE_VARIANT, idx.readable_hashes) == want
        # Another variant (adapter) is another namespace head: nothing of it is cached.
        assert rk.longest_hit(req, 0, LORA, idx.readable_hashes) == 0


def test_memo_extends_as_block_hashes_grow() -> None:
    hashes = _hashes(300)
    keys = NS.keys(hashes, LORA)
    idx = _index(keys, ["host"] * 300)
    rk = RequestKeys(NS)
    req = Req("r", hashes[:40])
    assert rk.longest_hit(req, 0, LORA, idx.readable_hashes) == 40
    memo = rk.keys(req, LORA, 20)
    assert memo[:20] == keys[:20] and len(memo) == 20  # built only as far as asked
    assert rk.keys(req, LORA) == keys[:40]
    req.block_hashes.extend(hashes[40:300])  # decode / more prompt blocks hashed
    assert rk.longest_hit(req, 10, LORA, idx.readable_hashes) == 290
    assert rk.keys(req, LORA) == keys
    assert rk.keys(req, LORA)[100:120] == NS.keys(hashes[100:120], LORA)


def test_stale_and_evicting_entries_stop_the_prefix_as_before() -> None:
    hashes = _hashes(40)
    keys = NS.keys(hashes)
    idx = _index(keys, ["ssd"] * 40)
    rk = RequestKeys(NS)
    req = Req("r", hashes)
    # Block 20 also gets a host copy; being evicted it is still readable (written out).
    (slot,) = idx.allocate_slots(1)
    idx.begin_host_fill(keys[20], slot)
    idx.commit_host_fill(keys[20], True)
    victim = idx.begin_evict()
    assert victim is not None and victim.key == keys[20]
    assert rk.longest_hit(req, 0, BASE_VARIANT, idx.readable_hashes) == 40
    idx.finish_evict(keys[20])
    # A filling host copy alone is not readable: drop block 30's SSD copy, start a fill.
    idx.set_present([keys[30]], Tier.SSD, False)
    (slot,) = idx.allocate_slots(1)
    idx.begin_host_fill(keys[30], slot)
    assert rk.longest_hit(req, 0, BASE_VARIANT, idx.readable_hashes) == 30
    assert idx.lookup(keys) == 30
    # reset() while block 5 is pinned: it stays in the index, stale, never readable.
    idx.pin([keys[5]])
    idx.reset()
    assert idx.entry(keys[5]) is not None and idx.entry(keys[5]).stale  # type: ignore[union-attr]
    assert rk.longest_hit(req, 0, BASE_VARIANT, idx.readable_hashes) == 0
    assert rk.longest_hit(req, 6, BASE_VARIANT, idx.readable_hashes) == 0
    assert len(idx.match(keys)) == 0


def test_cut_or_rehashed_hashes_are_noticed() -> None:
    hashes = _hashes(64)
    rk = RequestKeys(NS)
    req = Req("r", list(hashes))
    assert rk.keys(req, BASE_VARIANT) == NS.keys(hashes)
    del req.block_hashes[30:]  # a streaming session cuts its tail
    assert rk.keys(req, BASE_VARIANT) == NS.keys(hashes[:30])
    other = _hashes(50, tag="q")
    req.block_hashes[:] = hashes[:20] + other[20:]  # recomputed from block 20 on
    assert rk.keys(req, BASE_VARIANT) == NS.keys(req.block_hashes)
    req.block_hashes.clear()
    assert rk.keys(req, BASE_VARIANT) == []


def test_new_request_object_variant_and_forget() -> None:
    a = _hashes(10, "a")
    b = _hashes(10, "b")
    rk = RequestKeys(NS)
    first = Req("same-id", a)
    assert rk.keys(first, BASE_VARIANT) == NS.keys(a)
    assert rk.keys(first, LORA) == NS.keys(a, LORA)  # another adapter: other keys
    assert rk.keys(Req("same-id", b), LORA) == NS.keys(b, LORA)  # a new Request object
    assert len(rk) == 1
    rk.forget("same-id")
    rk.forget("never-seen")
    assert len(rk) == 0
    with pytest.raises(ValueError, match="variant"):
        rk.keys(first, b"short")


def test_memo_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(rk_mod, "MAX_REQUESTS", 3)
    rk = RequestKeys(NS)
    for i in range(5):
        rk.keys(Req(f"r{i}", _hashes(2, str(i))), BASE_VARIANT)
    assert len(rk) == 3


_STATE = st.sampled_from(["absent", "host", "ssd", "filling"])


@settings(max_examples=200, deadline=None)
@given(
    states=st.lists(st.sampled_from(["host", "ssd"]), max_size=70).flatmap(
        lambda hits: st.tuples(st.just(hits), st.lists(_STATE, max_size=30))
    ),
    growth=st.lists(st.integers(0, 40), min_size=1, max_size=5),
    firsts=st.lists(st.integers(0, 110), min_size=5, max_size=5),
    lora=st.booleans(),
)
def test_same_answer_as_the_slow_path(
    states: tuple[list[str], list[str]], growth: list[int], firsts: list[int], lora: bool
) -> None:
    """Random index states (a readable run, then anything), hashes growing between attempts,
    random first blocks: always what building every key and `TierIndex.lookup` answer."""
    variant = LORA if lora else BASE_VARIANT
    all_states = states[0] + states[1]
    hashes = _hashes(len(all_states) + sum(growth))
    keys = NS.keys(hashes, variant)
    idx = _index(keys, all_states)
    rk = RequestKeys(NS)
    req = Req("r", [])
    for grow, first in zip(growth, firsts, strict=False):
        req.block_hashes.extend(hashes[len(req.block_hashes) : len(req.block_hashes) + grow])
        slow_keys = NS.keys(req.block_hashes[first:], variant)
        want = idx.lookup(slow_keys)
        assert want == len(idx.match(slow_keys))
        assert rk.longest_hit(req, first, variant, idx.readable_hashes) == want
        n = len(req.block_hashes)
        assert rk.keys(req, variant, first + want)[first : first + want] == slow_keys[:want]
        assert rk.keys(req, variant) == NS.keys(req.block_hashes, variant)[:n]
