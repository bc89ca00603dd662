"""Hypothesis stateful test: the block store against a dict model, across evictions and reopens."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import hypothesis.strategies as st
from helpers.store_util import block
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from flexkv_py import BlockStore

KEYS = [b"key-%d" % i for i in range(12)]
# Few distinct contents so dedup is exercised constantly.
CONTENTS = [block(b"c%d" % i, (i % 5) * 20000 + 1) for i in range(6)]
CAPACITY = 256 * 1024  # small: puts regularly evict


class StoreMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="flexkv-model-"))
        self.store = BlockStore(str(self.dir), CAPACITY, batch_threads=2)
        self.model: dict[bytes, bytes] = {}

    def _sync_evictions(self) -> None:
        for key in self.store.drain_evicted():
            self.model.pop(key, None)

    @rule(
        keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=4),
        content=st.lists(st.sampled_from(range(len(CONTENTS))), min_size=4, max_size=4),
    )
    def put_batch(self, keys: list[bytes], content: list[int]) -> None:
        items = [
            (k, CONTENTS[c]) for k, c in zip(keys, content, strict=False)
        ]  # keys may be shorter
        results = self.store.submit_put(items).wait(30)
        for (k, data), r in zip(items, results, strict=True):
            assert r.status in ("ok", "deduped", "no_space"), r
            if r.ok:
                self.model[k] = data
        self._sync_evictions()

    @rule(key=st.sampled_from(KEYS))
    def get(self, key: bytes) -> None:
        out = bytearray(110_000)
        r = self.store.get(key, out)
        if key in self.model:
            assert r.status == "ok", r
            assert bytes(out[: r.nbytes]) == self.model[key]
        else:
            assert r.status == "not_found"

    @rule(key=st.sampled_from(KEYS))
    def delete(self, key: bytes) -> None:
        assert self.store.delete(key) == (key in self.model)
        self.model.pop(key, None)

    @rule()
    def reopen(self) -> None:
        # Crash-reopens are covered by test_store_persistence's SIGKILL test (a real process).
        self._sync_evictions()
        self.store.close()
        self.store = BlockStore(str(self.dir), CAPACITY, batch_threads=2)

    @invariant()
    def same_keys(self) -> None:
        self._sync_evictions()
        assert set(self.store.keys()) == set(self.model)
        s = self.store.stats()
        assert s["physical_bytes"] <= self.store.capacity_bytes
        assert s["logical_bytes"] == sum(len(v) for v in self.model.values())

    def teardown(self) -> None:
        self.store.close()
        shutil.rmtree(self.dir, ignore_errors=True)


StoreMachine.TestCase.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
TestStoreModel = StoreMachine.TestCase
