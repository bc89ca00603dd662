"""The scheduler's object-tier lookups: after the host and SSD matches end, the rest of a
prompt is asked of the fleet's bucket without waiting on the network inside a step.

`PendingLookups` (tiers/object/lookups.py) runs `lookup_chain` for the request's whole chain
(root first) on a small pool: while it runs, the connector answers vLLM `None` ("ask again
later": the request is skipped this step), for at most `object_store_lookup_wait_s`, then a
miss. A count beyond the local match marks those blocks present on `Tier.OBJECT` in the index
(a hint: a load that finds one gone recomputes it), so the usual load planning stages them
object -> host -> GPU. Answers are kept per request until it finishes.

Prefetch (coordinator/object_prefetch.py): with such a count, the matched run starts moving
object -> host in a background job, and the request keeps getting "ask again later" while that
job is in flight, for at most `object_store_lookup_wait_s` more: it holds no GPU blocks during
the network reads, and its load then reads host memory. Past the wait (or for blocks the
prefetch could not take) the load stages them from the bucket itself, as without prefetch.

The scheduler opens its own lookup-only tier on the same bucket prefix and keys (rank 0's, as
the scheduler's namespace): `memory://` is per process, so it shares nothing with the workers
here (use it in-process only). Hybrid models (several KV cache groups) ask the bucket through
`hybrid_object_hits.HybridObjectHits` instead (every group's hit; no prefetch yet).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Any

from flexkv_py.tiers.object.counters import tier_totals
from flexkv_py.tiers.object.lookups import PendingLookups
from flexkv_py.tiers.object.opener import open_object_tier

if TYPE_CHECKING:
    from flexkv_py.config import FlexKVConfig
    from flexkv_py.coordinator import CacheManager
    from flexkv_py.integration.vllm.engine_info import EngineInfo
    from flexkv_py.integration.vllm.load_planning import LoadPlanner
    from flexkv_py.tiers.object.tier import ObjectTier

logger = logging.getLogger(__name__)


def open_lookup_tier(config: FlexKVConfig, info: EngineInfo) -> ObjectTier | None:
    """The scheduler's lookup-only tier on the bucket, or None (no object tier, or a bucket that
    cannot be used: then the scheduler never promises an object hit)."""
    if not config.object_enabled:
        return None
    tier, _why = open_object_tier(config, info.namespace, collect=False)
    return tier


def lookup_totals(asked: int, gave_up: int, tier: ObjectTier) -> dict[str, int]:
    """The scheduler's bucket-lookup counters, as running totals (tiers/object/counters.py)."""
    return {
        "object_lookups_asked_later": asked,
        "object_lookups_gave_up": gave_up,
        **tier_totals(tier.stats(), "object_lookup"),
    }


class ObjectHits:
    def __init__(self, tier: ObjectTier, manager: CacheManager, max_wait_s: float) -> None:
        self._tier = tier
        self._mgr = manager
        self._pending = PendingLookups(tier.lookup_chain, max_wait_s)
        self._max_wait_s = max_wait_s
        # request -> (its prefetch job, when to stop waiting for it); None: none was started
        self._prefetch: dict[Hashable, tuple[int, float] | None] = {}
        self.asked = 0  # polls answered "ask again later"
        self.prefetch_waits = 0  # of those, while the request's prefetch was in flight

    @classmethod
    def open(
        cls, config: FlexKVConfig, info: EngineInfo, manager: CacheManager
    ) -> ObjectHits | None:
        """The lookups of this config, or None (no object tier, a hybrid model, or a bucket
        that cannot be used: then the scheduler never promises an object hit)."""
        tier = None if info.hybrid else open_lookup_tier(config, info)
        if tier is None:
            return None
        return cls(tier, manager, config.object_store_lookup_wait_s)

    def hit(
        self, request: Any, variant: bytes, first: int, hit: int, planner: LoadPlanner
    ) -> int | None:
        """The request's hit past `first` (`hit` from the host and SSD) once the bucket's
        answer is in; None: ask again later."""
        n = len(request.block_hashes)
        keys = planner.hit_keys(request, variant, 0, n)
        local = self.extend(request.request_id, keys, first + hit)
        if local is None or local <= first + hit:
            return local if local is None else hit
        return planner.hit(request, first, variant, self._mgr.readable_hashes)

    def extend(self, request_id: Hashable, keys: Sequence[bytes], local: int) -> int | None:
        """Blocks of `keys` (the request's chain, root first) readable once the bucket's
        answer is in, given `local` readable without it; None: ask again later (the lookup,
        or the prefetch of what it found, is in flight)."""
        count = local
        answered = request_id in self._prefetch  # the bucket's count was acted on before
        if local < len(keys):
            answer = self._pending.poll(request_id, keys)
            if answer is None:
                self.asked += 1
                return None
            count = answer
            if count > local and not answered:
                # Once: a copy a prefetch found bad was forgotten, and stays forgotten.
                self._mgr.note_object_hits(keys, local, count)
        if (count > local or answered) and self._prefetching(request_id, keys, local, count):
            self.asked += 1
            self.prefetch_waits += 1
            return None
        return max(local, count)

    def _prefetching(
        self, request_id: Hashable, keys: Sequence[bytes], local: int, count: int
    ) -> bool:
        """Start the prefetch of keys[local:count] on the first answer; True while it is in
        flight (within the wait): the request asks again later."""
        if request_id not in self._prefetch:
            job = self._mgr.prefetch_object(keys[local:count]) if count > local else None
            deadline = time.monotonic() + self._max_wait_s
            self._prefetch[request_id] = None if job is None else (job, deadline)
        started = self._prefetch[request_id]
        if started is None:
            return False
        job, deadline = started
        if self._mgr.prefetch_in_flight(job) and time.monotonic() < deadline:
            return True
        self._prefetch[request_id] = None
        return False

    @property
    def gave_up(self) -> int:
        """Lookups answered as a miss because they ran past the wait."""
        return self._pending.gave_up

    def totals(self) -> dict[str, int]:
        """Running totals for the connector's stats (tiers/object/counters.py)."""
        return lookup_totals(self.asked, self.gave_up, self._tier)

    def forget(self, request_id: Hashable) -> None:
        self._pending.forget(request_id)
        self._prefetch.pop(request_id, None)

    def close(self) -> None:
        self._pending.close()
        self._tier.close()
