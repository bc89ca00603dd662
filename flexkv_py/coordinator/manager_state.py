"""The scheduler-side manager's shared state and its KV events (the parts every planner uses).

`CacheManager` (manager.py) is assembled from one planner per job: stores (stores.py), loads
(loads.py), host eviction and spills (eviction.py); each reads and changes only this state, under
its one re-entrant lock.
"""

from __future__ import annotations

import itertools
import math
import threading
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from flexkv_py.config import FlexKVConfig
from flexkv_py.coordinator.jobs import CORRUPT, IO_ERROR, IO_TIMEOUT, NOT_FOUND, Job
from flexkv_py.coordinator.kv_events import EventQueue, Kind, KVEvent
from flexkv_py.coordinator.planning import host_slots_for, slot_nbytes_for
from flexkv_py.coordinator.write_behind_queue import WriteBehindQueue
from flexkv_py.index.cold_blocks import Forgotten
from flexkv_py.index.entry import Victim
from flexkv_py.index.lower_capacity import store_capacity_blocks
from flexkv_py.index.namespace import Namespace
from flexkv_py.index.policies import AdmissionPolicy, make_eviction_policy
from flexkv_py.index.tier_index import TierIndex
from flexkv_py.index.tier_names import Tier
from flexkv_py.tiers.object_hints import ObjectHints

# Object write-behind lag when the SSD's is off (write_behind_lag_s 0): the bucket has no
# eviction path to catch blocks up, so its write-behind is always on.
DEFAULT_OBJECT_LAG_S = 2.0

# Admitted keys kept for the workers' shutdown drain until a step takes them.
MAX_NOTED_ADMITTED = 1 << 20


def ssd_capacity_blocks(config: FlexKVConfig, namespace: Namespace, page_bytes: int) -> int:
    """Blocks one rank's SSD store holds: its share of ssd_cache_gb over its directories, each
    block a whole host slot (index/lower_capacity.py)."""
    return store_capacity_blocks(
        namespace.rank_share(config.ssd_cache_bytes),
        len(config.ssd_cache_dir),
        slot_nbytes_for(page_bytes),
    )


# Lower-tier read failures that mean "this copy is gone or bad": the index forgets the copy.
# A timed-out read (a stuck device, see late_io.py) too: kept, every lookup would promise it
# again and every retry fail at once on fenced slots, a loop of load errors; forgotten, the
# block is recomputed and stored again.
COPY_LOST = frozenset({NOT_FOUND, CORRUPT, IO_ERROR, IO_TIMEOUT})


@dataclass
class LoadPlan:
    promoted: list[bool]  # block i: a host fill was begun (a lower-tier block stays in host)


class ManagerState:
    def __init__(
        self,
        config: FlexKVConfig,
        namespace: Namespace,
        page_bytes: int,
        *,
        num_host_slots: int | None = None,
        usable_host_slots: int | None = None,
        free_target: float = 0.05,
        max_events: int = 100_000,
    ) -> None:
        """`page_bytes`: one block of one rank (all layers, K and V). `num_host_slots` overrides
        the count planned from cpu_cache_gb (it must equal every worker's pool).
        `usable_host_slots`: slots usable now (default all); the rest arrive through
        `grow_host_slots` as the workers' pools are prepared in the background."""
        self.config = config
        self.namespace = namespace
        self.page_bytes = page_bytes
        slots = (
            num_host_slots
            if num_host_slots is not None
            else (host_slots_for(config, namespace, page_bytes))
        )
        self.admission = AdmissionPolicy(config.admission_spec)
        # The lower tier that blocks leaving the host tier are written to (None: none exists).
        self.spill_tier: Tier | None = Tier.SSD if config.ssd_enabled else None
        # Prefix-aware host eviction matters where a victim can be dropped: no spill tier, or an
        # admission filter that leaves some victims out. Otherwise a victim stays matchable
        # from the spill tier and the policy's own order is kept (a full SSD can still refuse
        # one: its children are orphans then, never written down, index/index_core.py).
        keep_chains = self.spill_tier is None or config.admission_spec.min_hits > 1
        self.index = TierIndex(
            slots,
            make_eviction_policy(config.eviction_policy),
            usable_host_slots=usable_host_slots,
            keep_chains=keep_chains,
        )
        if self.spill_tier is Tier.SSD:  # the index decides every SSD eviction
            self.index.set_lower_capacity(
                Tier.SSD, ssd_capacity_blocks(config, namespace, page_bytes)
            )
        # Host blocks owed to the spill tier in the background (write_behind.py); None: off.
        self._write_behind: WriteBehindQueue | None = None
        if self.spill_tier is not None and config.write_behind_lag_s > 0:
            rate = config.write_behind_mib_s * (1 << 20) / max(1, page_bytes)
            self._write_behind = WriteBehindQueue(config.write_behind_lag_s, rate)
        self._write_behind_jobs: set[int] = set()  # in flight (one at a time)
        # The object tier's write-behind (write_behind_object.py): its queue (None: no object
        # tier), its job in flight, and the chain links its manifests need.
        self.object_enabled = config.object_enabled
        self._object_queue: WriteBehindQueue | None = None
        if config.object_enabled:
            rate = config.write_behind_mib_s * (1 << 20) / max(1, page_bytes)
            lag = config.write_behind_lag_s or DEFAULT_OBJECT_LAG_S
            self._object_queue = WriteBehindQueue(lag, rate)
        self._object_jobs: set[int] = set()
        self._object_links: OrderedDict[bytes, bytes | None] = OrderedDict()
        self._object_hints = ObjectHints(config.object_store_hint_cap)  # tiers/object_hints.py
        self._free_target = min(slots, math.ceil(free_target * slots))
        self._lock = threading.RLock()
        self._ids = itertools.count(1)
        self._inflight: dict[int, Job] = {}
        # A reset's DropJob -> what it cleared of the cold blocks (which deleted keys were ours).
        self._reset_forgotten: dict[int, list[Forgotten]] = {}
        self._load_plans: dict[int, LoadPlan] = {}
        self._spilling = 0  # slots held by in-flight spills
        self._spill_batch: list[Victim] = []
        self._background: list[Job] = []
        self._events = EventQueue(namespace, max_events)
        self._stats: Counter[str] = Counter()
        # min_hits > 1: keys that reached it since the workers last heard (write_behind.py).
        self._drain_admitted: dict[bytes, None] = {}

    @property
    def num_host_slots(self) -> int:
        return self.index.num_host_slots

    def _note_admitted(self, keys: Iterable[bytes], *, stored: bool) -> None:
        """With min_hits > 1, keys whose access count just reached it (a store: has reached
        it) are named to the workers: their shutdown drain writes only those
        (integration/vllm/shutdown_drain.py), as write-behind and eviction would."""
        need = self.admission.spec.min_hits
        if need <= 1 or self.spill_tier is None:
            return
        with self._lock:
            hits, noted = self.index.hits, self._drain_admitted
            for key in keys:
                h = hits(key)
                if h == need or (stored and h > need):
                    noted[key] = None
            while len(noted) > MAX_NOTED_ADMITTED:  # nobody takes them (no vLLM workers)
                del noted[next(iter(noted))]

    def take_drain_admitted(self) -> tuple[bytes, ...]:
        """Keys noted by `_note_admitted` since the last call (for the step's metadata)."""
        with self._lock:
            out = tuple(self._drain_admitted)
            self._drain_admitted.clear()
            return out

    def _forget_lost_copy(self, key: bytes, tier: Tier, reason: str | None) -> None:
        """A read of `key` from lower tier `tier` failed for `reason`: if the copy is gone or
        bad (COPY_LOST), never trust it again (forgotten, announced, counted)."""
        if reason in COPY_LOST:
            if self.index.set_present([key], tier, False):
                self._event("removed", key, tier)
            self._stats[f"{tier.value}_read_{reason}_blocks"] += 1

    def _event(self, kind: Kind, key: bytes, tier: Tier) -> None:
        self._events.add(kind, (key,), tier)

    def _events_of(self, kind: Kind, keys: Sequence[bytes], tier: Tier) -> None:
        """`_event` for each of a store's blocks: one queue entry for the batch (kv_events.py)."""
        self._events.add(kind, keys, tier)

    def take_events(self) -> list[KVEvent]:
        with self._lock:
            return self._events.take()
