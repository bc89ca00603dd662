"""The scheduler's object-tier lookups for a hybrid model (several KV cache groups): the hit is
still the longest prefix every group can restore (hybrid_hit.py), now counting blocks found in
the fleet's bucket, without waiting on the network inside a step.

What each group's blocks look like in the bucket (hybrid_plan.HybridPlan.store):
- a full-attention group's blocks form the group's own chain, with segment manifests: one
  `lookup_chain` of the group's keys finds its stored prefix (as for a single-group model);
- a sliding-window block or a Mamba state block is a chain of one (its own one-key manifest):
  one `lookup_chain([key])` says whether it is stored and records the use GC goes by.

A request's lookup runs in rounds on small pools (tiers/object/lookups.py PendingLookups); vLLM
gets `None` ("ask again later") while one is in flight:
1. every full-attention group's chain; what it finds is marked present on `Tier.OBJECT` in the
   index (a hint, as for single-group models), so `readable_hashes` sees it;
2. the hit is computed optimistically (a sliding-window or state block the bucket was not asked
   about counts as there); the blocks that hit needs and nobody asked about yet are asked
   (once a state was missing, also the states of the few boundaries before it, so a missing
   state costs one more round, not one per boundary). Repeat until nothing is left to ask, at most
   `MAX_ROUNDS` times and for `object_store_lookup_wait_s` in all.
The answer is then the hit computed from what is known (the index, bucket marks included): a
block never confirmed counts as missing, so a group missing its block at the boundary shortens
the hit to what every group has (never a partial state), and a lookup that ran out of time or
failed answers with what is confirmed (at worst the local hit).
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from flexkv_py.index.namespace import PREFIX_LEN
from flexkv_py.integration.vllm.scheduler_side_object import (
    ObjectHits,
    lookup_totals,
    open_lookup_tier,
)
from flexkv_py.tiers.object.lookups import PendingLookups

if TYPE_CHECKING:
    from flexkv_py.config import FlexKVConfig
    from flexkv_py.coordinator import CacheManager
    from flexkv_py.integration.vllm.engine_info import EngineInfo
    from flexkv_py.integration.vllm.hybrid_plan import HybridPlan
    from flexkv_py.integration.vllm.load_planning import LoadPlanner
    from flexkv_py.tiers.object.tier import ObjectTier

MAX_ROUNDS = 4  # rounds of single-block questions per request lookup
STATE_CANDIDATES = 8  # boundaries asked per state group once a state was missing
PROBE_WIDTH = 8  # single-block lookups at once


@dataclass
class _Ask:
    """One request's lookup so far."""

    started: float
    noted: dict[int, int] = field(default_factory=dict)  # group -> chain blocks marked
    absent: dict[int, set[int]] = field(default_factory=dict)  # group -> blocks not stored
    asked: set[tuple[int, int]] = field(default_factory=set)  # (group, block) asked already
    rounds: int = 0
    gave_up: bool = False  # ran past the wait: answered from what was confirmed
    probe: list[tuple[int, int, bytes]] | None = None  # in flight: (group, block, key)


class HybridObjectHits:
    def __init__(
        self, tier: ObjectTier, manager: CacheManager, plan: HybridPlan, max_wait_s: float
    ) -> None:
        self._tier = tier
        self._mgr = manager
        self._plan = plan
        self._max_wait_s = max_wait_s
        self._chains = PendingLookups(tier.lookup_chain, max_wait_s)
        self._probes = PendingLookups(self._present_bits, max_wait_s)
        self._probe_pool = ThreadPoolExecutor(PROBE_WIDTH, thread_name_prefix="flexkv-probe")
        self._asks: dict[Hashable, _Ask] = {}
        self._gid = {g.namespace.prefix: g.group_id for g in plan.groups}
        self._full = [g for g in plan.groups if g.kind == "full"]
        self.asked = 0  # polls answered "ask again later"
        self._gave_up = 0  # lookups answered from what was confirmed when time ran out

    @classmethod
    def open(
        cls, config: FlexKVConfig, info: EngineInfo, manager: CacheManager, plan: HybridPlan
    ) -> HybridObjectHits | None:
        """The lookups of this config, or None (no object tier, or a bucket that cannot be
        used: then the scheduler never promises an object hit)."""
        tier = open_lookup_tier(config, info)
        if tier is None:
            return None
        return cls(tier, manager, plan, config.object_store_lookup_wait_s)

    # ------------------------------------------------------------------ the bucket's side
    def _present_bits(self, keys: Sequence[bytes]) -> int:
        """Bit i set: the one-block chain keys[i] is stored (a failed lookup: not set)."""
        found = self._probe_pool.map(lambda k: self._tier.lookup_chain([k]) == 1, keys)
        return sum(1 << i for i, hit in enumerate(found) if hit)

    # ------------------------------------------------------------------ the scheduler's side
    def hit(
        self, request: Any, variant: bytes, first: int, hit: int, planner: LoadPlanner
    ) -> int | None:
        """The request's hit past `first` (`hit` from the local tiers) once the bucket's
        answers are in; None: ask again later."""
        del planner  # the plan is the hybrid one; kept for ObjectHits' signature
        plan, rid = self._plan, request.request_id
        if first + hit >= plan.limit(request):
            return hit
        ask = self._asks.get(rid)
        if ask is None:
            ask = self._asks[rid] = _Ask(time.monotonic())
        keys = plan.group_keys(request, variant)
        if not self._chains_in(rid, ask, keys, first):
            return self._later(ask, request, variant, first)
        if ask.probe is not None:
            if not self._probe_in(rid, ask):
                return self._later(ask, request, variant, first)
        if ask.rounds < MAX_ROUNDS and not self._late(ask):
            todo = self._unknown(request, variant, first, ask)
            if todo:
                ask.rounds += 1
                ask.probe = [(g, i, keys[g][i]) for g, i in todo]
                ask.asked.update(todo)
                self._probes.poll((rid, ask.rounds), [k for _, _, k in ask.probe])
                self.asked += 1
                return None
        elif not ask.gave_up and self._unknown(request, variant, first, ask):
            self._give_up(ask)
        return plan.hit(request, first, variant, self._mgr.readable_hashes)

    def _late(self, ask: _Ask) -> bool:
        return time.monotonic() - ask.started >= self._max_wait_s

    def _later(self, ask: _Ask, request: Any, variant: bytes, first: int) -> int | None:
        """A round is in flight: None, or past the wait the hit from what is confirmed."""
        if not self._late(ask):
            self.asked += 1
            return None
        self._give_up(ask)
        return self._plan.hit(request, first, variant, self._mgr.readable_hashes)

    def _give_up(self, ask: _Ask) -> None:
        if not ask.gave_up:
            ask.gave_up = True
            self._gave_up += 1

    def _chains_in(self, rid: Hashable, ask: _Ask, keys: list[list[bytes]], first: int) -> bool:
        """Every full-attention group's chain answer is in (and marked in the index)."""
        done = True
        for g in self._full:
            gid, group_keys = g.group_id, keys[g.group_id]
            count = self._chains.poll((rid, gid), group_keys)
            if count is None:
                done = False
                continue
            start = max(ask.noted.get(gid, 0), first // g.scale)
            if count > start:
                self._mgr.note_object_hits(group_keys, start, count)
                ask.noted[gid] = count
        return done

    def _probe_in(self, rid: Hashable, ask: _Ask) -> bool:
        """The round's single-block answers are in: stored blocks marked, the rest absent."""
        assert ask.probe is not None
        bits = self._probes.poll((rid, ask.rounds), [k for _, _, k in ask.probe])
        if bits is None:
            return False
        for n, (gid, i, key) in enumerate(ask.probe):
            if bits >> n & 1:
                self._mgr.note_object_hits([key], 0, 1)
            else:
                ask.absent.setdefault(gid, set()).add(i)
        ask.probe = None
        return True

    def _unknown(
        self, request: Any, variant: bytes, first: int, ask: _Ask
    ) -> list[tuple[int, int]]:
        """(group, block) of sliding-window and state blocks the optimistic hit needs that no
        tier is known to hold and the bucket was not asked about."""
        plan, readable = self._plan, self._mgr.readable_hashes
        absent = ask.absent

        def optimistic(head: bytes, hashes: Sequence[bytes], start: int, stop: int) -> int:
            gid = self._gid[head[:PREFIX_LEN]]
            if plan.groups[gid].kind == "full":
                return readable(head, hashes, start, stop)
            gone = absent.get(gid, ())
            i = readable(head, hashes, start, stop)
            while i < stop and i not in gone:
                i = readable(head, hashes, i + 1, stop)
            return i

        end = first + plan.hit(request, first, variant, optimistic)
        per_group = plan.group_hashes(request, variant)
        out: list[tuple[int, int]] = []

        def need(gid: int, i: int) -> None:
            head, hashes = per_group[gid]
            if (gid, i) not in ask.asked and readable(head, hashes, i, i + 1) == i:
                out.append((gid, i))

        states_missing = any(absent.get(g.group_id) for g in plan.groups if g.kind == "mamba")
        for g in plan.groups:
            if g.kind == "full" or end <= first:
                continue
            s, gid = g.scale, g.group_id
            hi = end // s
            for i in range(max(first // s, hi - g.window_blocks), hi):
                need(gid, i)
            if g.kind == "mamba" and states_missing:
                # A state was missing: ask the boundaries before at once, not one per round.
                ends = range(end - plan.align, first, -plan.align)
                for e in list(ends)[: STATE_CANDIDATES - 1]:
                    need(gid, e // s - 1)
        return out

    # ------------------------------------------------------------------ bookkeeping
    @property
    def gave_up(self) -> int:
        """Lookups (a request's, or one of its rounds) answered from what was confirmed
        because they ran past the wait."""
        return self._gave_up + self._chains.gave_up + self._probes.gave_up

    def totals(self) -> dict[str, int]:
        """Running totals for the connector's stats (as `ObjectHits.totals`)."""
        return lookup_totals(self.asked, self.gave_up, self._tier)

    def forget(self, request_id: Hashable) -> None:
        ask = self._asks.pop(request_id, None)
        for g in self._full:
            self._chains.forget((request_id, g.group_id))
        if ask is not None:
            for r in range(1, ask.rounds + 1):
                self._probes.forget((request_id, r))

    def close(self) -> None:
        self._chains.close()
        self._probes.close()
        self._probe_pool.shutdown(wait=True, cancel_futures=True)
        self._tier.close()


def open_object_hits(
    config: FlexKVConfig, info: EngineInfo, manager: CacheManager, hybrid: HybridPlan | None
) -> ObjectHits | HybridObjectHits | None:
    """The scheduler's bucket lookups: a single-group model's (scheduler_side_object.py) or a
    hybrid model's; None without a usable object tier."""
    if hybrid is None:
        return ObjectHits.open(config, info, manager)
    return HybridObjectHits.open(config, info, manager, hybrid)
