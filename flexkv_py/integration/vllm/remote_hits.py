"""The scheduler's object-tier lookups, one path for every model: after the local tiers' match
ends, the rest of a prompt is asked of the fleet's bucket without waiting on the network inside
a step. vLLM gets `None` ("ask again later": the request is skipped this step) while a lookup
is in flight, for at most `object_store_lookup_wait_s` in all; past it the hit is what is
confirmed (at worst the local hit).

A model is a list of KV cache groups (`LookupShape`): a dense model is one full-attention
group, a hybrid one adds sliding-window and Mamba state groups (hybrid_plan.HybridPlan). What
each group's blocks look like in the bucket (hybrid_plan.HybridPlan.store):
- a full-attention group's blocks form the group's own chain, with segment manifests: one
  `lookup_chain` of the group's keys finds its stored prefix;
- a sliding-window block or a Mamba state block is a chain of one (its own one-key manifest):
  one `lookup_chain([key])` says whether it is stored and records the use GC goes by.

A request's lookup runs in rounds, each a handle on the object tier's runtime
(tiers/object/lookups.py PendingLookups; no thread of its own):
1. every full-attention group's chain; what it finds is marked present on `Tier.OBJECT` in the
   index (a hint: a load that finds one gone recomputes it), so `readable_hashes` sees it and
   the usual load planning stages those blocks object -> host -> GPU;
2. the hit is computed optimistically (a sliding-window or state block the bucket was not asked
   about counts as there); the blocks that hit needs and nobody asked about yet are asked, as
   one presence probe (`submit_present`: each a one-block chain, a few at once)
   (once a state was missing, also the states of the few boundaries before it, so a missing
   state costs one more round, not one per boundary). Repeat until nothing is left to ask, at
   most `MAX_ROUNDS` times. A dense model never gets here: it has no such blocks.
The answer is the hit computed from what is known (the index, bucket marks included): a block
never confirmed counts as missing, so a group missing its block at the boundary shortens the
hit to what every group has (never a partial state).

Prefetch (coordinator/object_prefetch.py), for models of full-attention groups only (a hybrid
model's window and state blocks are staged by its load): on the chain's first answer the run
found past the local match starts moving object -> host in a background job, and the request
keeps getting "ask again later" while that job is in flight, for at most
`object_store_lookup_wait_s` more: it holds no GPU blocks during the network reads, and its
load then reads host memory. Past the wait (or for blocks the prefetch could not take) the load
stages them from the bucket itself.

The scheduler opens its own lookup-only tier on the same bucket prefix and keys (rank 0's, as
the scheduler's namespace): `memory://` is per process, so it shares nothing with the workers
here (use it in-process only). Answers are kept per request until it finishes.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from flexkv_py.index.namespace import PREFIX_LEN, Namespace
from flexkv_py.tiers.object.counters import tier_totals
from flexkv_py.tiers.object.lookups import PendingLookups
from flexkv_py.tiers.object.opener import open_object_tier

if TYPE_CHECKING:
    from flexkv_py.config import FlexKVConfig
    from flexkv_py.coordinator import CacheManager
    from flexkv_py.integration.vllm.engine_info import EngineInfo
    from flexkv_py.integration.vllm.request_keys import HashPrefixFn, RequestKeys
    from flexkv_py.tiers.object.tier import ObjectTier

MAX_ROUNDS = 4  # rounds of single-block questions per request lookup
STATE_CANDIDATES = 8  # boundaries asked per state group once a state was missing


class GroupShape(Protocol):
    """One KV cache group as the lookups see it (engine_info.GroupInfo)."""

    @property
    def group_id(self) -> int: ...
    @property
    def kind(self) -> str: ...  # "full" | "sliding" | "mamba"
    @property
    def scale(self) -> int: ...  # hash blocks per block of the group
    @property
    def window_blocks(self) -> int: ...
    @property
    def namespace(self) -> Namespace: ...


class LookupShape(Protocol):
    """A model's groups and how its hit is computed (hybrid_plan.HybridPlan, `DenseShape`)."""

    @property
    def groups(self) -> Sequence[GroupShape]: ...
    @property
    def align(self) -> int: ...
    def limit(self, request: Any) -> int: ...
    def group_keys(self, request: Any, variant: bytes) -> list[list[bytes]]: ...
    def group_hashes(self, request: Any, variant: bytes) -> list[tuple[bytes, Sequence[bytes]]]: ...
    def hit(self, request: Any, first: int, variant: bytes, readable: HashPrefixFn) -> int: ...


@dataclass(frozen=True)
class _DenseGroup:
    namespace: Namespace
    group_id: int = 0
    kind: str = "full"
    scale: int = 1
    window_blocks: int = 0


class DenseShape:
    """A single-group model: one full-attention chain, keyed by the scheduler's key memo."""

    align = 1

    def __init__(self, keys: RequestKeys, namespace: Namespace) -> None:
        self._keys = keys
        self.groups = (_DenseGroup(namespace),)

    def limit(self, request: Any) -> int:
        return len(request.block_hashes)

    def group_keys(self, request: Any, variant: bytes) -> list[list[bytes]]:
        return [self._keys.keys(request, variant)]

    def group_hashes(self, request: Any, variant: bytes) -> list[tuple[bytes, Sequence[bytes]]]:
        return [(self._keys.head(variant), request.block_hashes)]

    def hit(self, request: Any, first: int, variant: bytes, readable: HashPrefixFn) -> int:
        return self._keys.longest_hit(request, first, variant, readable)


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
    # The prefetch started on the chain's first answer: (job, when to stop waiting for it);
    # None once it ended or when none was started. Absent until the first answer.
    prefetch: tuple[int, float] | None = None
    answered: bool = False


def open_lookup_tier(config: FlexKVConfig, info: EngineInfo) -> ObjectTier | None:
    """The scheduler's lookup-only tier on the bucket, or None (no object tier, or a bucket that
    cannot be used: then the scheduler never promises an object hit)."""
    if not config.object_enabled:
        return None
    tier, _why = open_object_tier(config, info.namespace, collect=False)
    return tier


class RemoteHits:
    def __init__(
        self, tier: ObjectTier, manager: CacheManager, shape: LookupShape, max_wait_s: float
    ) -> None:
        self._tier = tier
        self._mgr = manager
        self._shape = shape
        self._max_wait_s = max_wait_s
        self._chains = PendingLookups(tier.submit_lookup_chain, max_wait_s)
        # Bit i of a probe's answer: its i-th one-block chain is stored.
        self._probes = PendingLookups(tier.submit_present, max_wait_s)
        self._asks: dict[Hashable, _Ask] = {}
        self._gid = {g.namespace.prefix: g.group_id for g in shape.groups}
        self._full = [g for g in shape.groups if g.kind == "full"]
        self._prefetches = len(self._full) == len(shape.groups)
        self.asked = 0  # polls answered "ask again later"
        self.prefetch_waits = 0  # of those, while the request's prefetch was in flight
        self._gave_up = 0  # lookups answered from what was confirmed when time ran out

    @classmethod
    def open(
        cls, config: FlexKVConfig, info: EngineInfo, manager: CacheManager, shape: LookupShape
    ) -> RemoteHits | None:
        """The lookups of this config, or None (no object tier, or a bucket that cannot be
        used: then the scheduler never promises an object hit)."""
        tier = open_lookup_tier(config, info)
        if tier is None:
            return None
        return cls(tier, manager, shape, config.object_store_lookup_wait_s)

    # ------------------------------------------------------------------ the scheduler's side
    def hit(self, request: Any, variant: bytes, first: int, hit: int) -> int | None:
        """The request's hit past `first` (`hit` from the local tiers) once the bucket's
        answers are in; None: ask again later."""
        shape, rid = self._shape, request.request_id
        ask = self._asks.get(rid)
        if first + hit >= shape.limit(request):
            if ask is not None and self._prefetching(ask):
                return None
            return hit
        if ask is None:
            ask = self._asks[rid] = _Ask(time.monotonic())
        keys = shape.group_keys(request, variant)
        if not self._chains_in(rid, ask, keys, first, first + hit):
            return self._later(ask, request, variant, first)
        if self._prefetching(ask):
            return None
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
        return shape.hit(request, first, variant, self._mgr.readable_hashes)

    def _late(self, ask: _Ask) -> bool:
        return time.monotonic() - ask.started >= self._max_wait_s

    def _later(self, ask: _Ask, request: Any, variant: bytes, first: int) -> int | None:
        """A round is in flight: None, or past the wait the hit from what is confirmed."""
        if not self._late(ask):
            self.asked += 1
            return None
        self._give_up(ask)
        return self._shape.hit(request, first, variant, self._mgr.readable_hashes)

    def _give_up(self, ask: _Ask) -> None:
        if not ask.gave_up:
            ask.gave_up = True
            self._gave_up += 1

    def _chains_in(
        self, rid: Hashable, ask: _Ask, keys: list[list[bytes]], first: int, local: int
    ) -> bool:
        """Every full-attention group's chain answer is in (and marked in the index); on the
        first answer of a model that prefetches, the prefetch of what was found past the
        `local` match starts."""
        done = True
        for g in self._full:
            gid, group_keys = g.group_id, keys[g.group_id]
            count = self._chains.poll((rid, gid), group_keys)
            if count is None:
                done = False
                continue
            start = max(ask.noted.get(gid, 0), first // g.scale)
            if count > start:
                # Once per request: a copy a prefetch found bad was forgotten, and stays so.
                self._mgr.note_object_hits(group_keys, start, count)
                ask.noted[gid] = count
            if self._prefetches and not ask.answered:
                run = group_keys[local // g.scale : count]
                job = self._mgr.prefetch_object(run) if run else None
                if job is not None:
                    ask.prefetch = (job, time.monotonic() + self._max_wait_s)
        if done:
            ask.answered = True
        return done

    def _prefetching(self, ask: _Ask) -> bool:
        """The request's prefetch is in flight (within its wait): ask again later."""
        if ask.prefetch is None:
            return False
        job, deadline = ask.prefetch
        if self._mgr.prefetch_in_flight(job) and time.monotonic() < deadline:
            self.asked += 1
            self.prefetch_waits += 1
            return True
        ask.prefetch = None
        return False

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
        shape, readable = self._shape, self._mgr.readable_hashes
        if len(self._full) == len(shape.groups):
            return []  # chains only: nothing asked block by block
        absent = ask.absent

        def optimistic(head: bytes, hashes: Sequence[bytes], start: int, stop: int) -> int:
            gid = self._gid[head[:PREFIX_LEN]]
            if shape.groups[gid].kind == "full":
                return readable(head, hashes, start, stop)
            gone = absent.get(gid, ())
            i = readable(head, hashes, start, stop)
            while i < stop and i not in gone:
                i = readable(head, hashes, i + 1, stop)
            return i

        end = first + shape.hit(request, first, variant, optimistic)
        per_group = shape.group_hashes(request, variant)
        out: list[tuple[int, int]] = []

        def need(gid: int, i: int) -> None:
            head, hashes = per_group[gid]
            if (gid, i) not in ask.asked and readable(head, hashes, i, i + 1) == i:
                out.append((gid, i))

        states_missing = any(absent.get(g.group_id) for g in shape.groups if g.kind == "mamba")
        for g in shape.groups:
            if g.kind == "full" or end <= first:
                continue
            s, gid = g.scale, g.group_id
            hi = end // s
            for i in range(max(first // s, hi - g.window_blocks), hi):
                need(gid, i)
            if g.kind == "mamba" and states_missing:
                # A state was missing: ask the boundaries before at once, not one per round.
                ends = range(end - shape.align, first, -shape.align)
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
        """Running totals for the connector's stats (tiers/object/counters.py)."""
        return {
            "object_lookups_asked_later": self.asked,
            "object_lookups_gave_up": self.gave_up,
            **tier_totals(self._tier.stats(), "object_lookup"),
        }

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
        self._tier.close()
