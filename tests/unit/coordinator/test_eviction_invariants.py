"""A Hypothesis state machine over the host tier and a real SSD tier (tmp dir), both small, fed
requests that share a prefix: every cached block's parent stays cached (in some tier), no lookup
promises a block a tier does not hold (each promised block loads, bit for bit), and every block
the index places on the SSD is in the store."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any

from helpers.coordinator_util import _config, _engine, _ns, _pages
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from flexkv_py.index.tier_names import Tier

NS = _ns()
ROOT = [f"root-{i}".encode().ljust(32, b".") for i in range(3)]
# Four requests' chains of 12 blocks, sharing a 3-block prompt.
CHAINS = [
    NS.keys(ROOT + [f"c{c}-{i}".encode().ljust(32, b".") for i in range(9)]) for c in range(4)
]
PARENT = {k[i]: k[i - 1] for k in CHAINS for i in range(1, len(k))}


class HostAndSsd(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="flexkv-inv-"))
        self.eng = _engine(_config(self.dir, 4, 24), NS, 4, free_target=0)
        # Tail-first in host too (as with no SSD or an admission filter): no block ever leaves
        # while a cached child stays, so the parent invariant holds strictly.
        self.eng.manager.index.keep_chains = True
        self.ssd = self.eng.executor.tiers[Tier.SSD]

    @rule(c=st.integers(0, 3), n=st.integers(1, 12))
    def store(self, c: int, n: int) -> None:
        keys = CHAINS[c][:n]
        self.eng.store_pages(keys, _pages(keys))

    @rule(c=st.integers(0, 3), n=st.integers(1, 12))
    def load(self, c: int, n: int) -> None:
        keys = CHAINS[c][:n]
        hit = self.eng.lookup(keys)
        assert self.eng.load_pages(keys[:hit]) == _pages(keys)[:hit]

    @rule()
    def flush(self) -> None:
        self.eng.flush()

    @invariant()
    def parents_are_cached(self) -> None:
        # Holds strictly until the SSD, full of blocks that hold up chains, refuses a block
        # leaving host (it is dropped; its children are orphans, never written down again).
        if self.eng.manager.stats().get("ssd_spill_refused_blocks", 0):
            return
        # Every key the test stores (cold keys are fingerprints: recognised, not listed).
        index = self.eng.manager.index
        every = [k for chain in CHAINS for k in chain]
        cached = set(index.keys()) | set(index.cold_keys_among(every))
        for key in cached:
            parent = PARENT.get(key)
            assert parent is None or parent in cached, "a cached block's parent left"

    @invariant()
    def the_index_promises_only_what_the_ssd_holds(self) -> None:
        index = self.eng.manager.index
        on_ssd = set(self.ssd.keys())
        # Warm keys, and the cold ones among those the test stores (cold keys are fingerprints).
        for key in index.keys() + index.cold_keys_among(k for chain in CHAINS for k in chain):
            if index.readable_on(key, Tier.SSD):
                assert key in on_ssd
        assert index.occupancy(Tier.SSD) <= (index.lower_capacity(Tier.SSD) or 0)

    def teardown(self) -> None:
        stats = self.eng.stats()["manager"]
        self.eng.close()
        shutil.rmtree(self.dir, ignore_errors=True)
        assert stats.get("load_failed_blocks", 0) == 0  # no false hit
        assert stats.get("ssd_store_evicted_blocks", 0) == 0  # the index decided every eviction


HostAndSsd.TestCase.settings = settings(max_examples=20, stateful_step_count=30, deadline=None)
TestHostAndSsd = HostAndSsd.TestCase


def test_a_host_only_load_needs_a_slot_per_lower_tier_block_and_gets_them_in_rounds() -> None:
    """A lookup promises lower-tier blocks counting one staging slot between them (a GPU load
    streams through it); a host-only load reads every slot after its job, so with fewer free
    slots than SSD blocks it loads them in several jobs, and none fails (Hypothesis found it)."""
    machine = HostAndSsd()
    try:
        machine.store(0, 8)
        machine.load(0, 4)
        machine.load(0, 12)
    finally:
        machine.teardown()


def test_a_host_only_load_in_rounds_counts_one_hit_per_block() -> None:
    """The blocks past a round's cut are pinned, let go and loaded in the next round: their
    hit is counted there, once (admission's min_hits and LFU read these counts)."""
    machine = HostAndSsd()
    try:
        machine.store(0, 12)
        machine.store(1, 12)  # chain 0 now lives on the SSD, 4 free host slots at most
        machine.flush()
        mgr, keys = machine.eng.manager, CHAINS[0]
        jobs: list[object] = []
        prepare = mgr.prepare_load

        def counted(*a: Any, **kw: Any) -> Any:
            jobs.append(prepare(*a, **kw))
            return jobs[-1]

        mgr.prepare_load = counted  # type: ignore[method-assign]
        before = [mgr.index.hits(k) for k in keys]
        machine.load(0, 12)
        assert len(jobs) >= 2  # in rounds
        assert [mgr.index.hits(k) - b for k, b in zip(keys, before, strict=True)] == [1] * 12
    finally:
        machine.teardown()
