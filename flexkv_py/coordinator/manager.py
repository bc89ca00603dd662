"""Scheduler side: decides where blocks go and emits jobs; never touches block memory.

Model: vLLM's kv_offload manager. `lookup` answers from the tier index (the source of truth for
what each tier holds, see flexkv_py/index/tier_index.py); `prepare_store` and `prepare_load` pin
what they use and return a job for every worker; background work (host -> lower-tier spills on
eviction, write-behind, lower-tier deletes) comes out of `take_jobs`; `complete` applies a job's
(merged) result. Nothing a job still uses can be evicted or reused: stores pin their fresh slots,
loads pin their blocks, and a spilled slot is free only once its lower-tier write is confirmed.

The manager is its parts, each given what it works on in its constructor, all under the
manager's one lock:
- `host` (host_space.py): host slots, eviction, spills to the spill tier, the free reserve;
- `writers` (tier_writer.py): one write-behind per lower tier that takes it (SSD, object);
- `stores` / `loads` (stores.py, loads.py): the store and load planners;
- `prefetch` (object_prefetch.py): bucket hits moved to host ahead of their load;
- `outbox` (outbox.py): jobs in flight with the part that applies each result, and the
  background jobs for the next `take_jobs`.
This class adds lookups, the restart inventory, reset and stats.
"""

from __future__ import annotations

import functools
import logging
import math
import threading
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from flexkv_py.config import FlexKVConfig
from flexkv_py.coordinator.adopted_before import AdoptedBefore
from flexkv_py.coordinator.chain_links import ChainLinks
from flexkv_py.coordinator.drain_admitted import DrainAdmitted
from flexkv_py.coordinator.host_space import HostSpace
from flexkv_py.coordinator.jobs import DropJob, Drops, Job, JobResult, LoadJob, StoreJob
from flexkv_py.coordinator.kv_events import EventQueue, KVEvent
from flexkv_py.coordinator.loads import LoadPlanner
from flexkv_py.coordinator.object_prefetch import ObjectPrefetch
from flexkv_py.coordinator.outbox import Outbox
from flexkv_py.coordinator.planning import host_slots_for, slot_nbytes_for
from flexkv_py.coordinator.stores import StorePlanner
from flexkv_py.coordinator.tier_writer import TierWriter
from flexkv_py.coordinator.write_behind_queue import WriteBehindQueue
from flexkv_py.index.cold_blocks import CHAIN_TIER, Forgotten
from flexkv_py.index.joined_keys import JoinedKeys
from flexkv_py.index.joined_sets import common_and_orphans
from flexkv_py.index.namespace import Namespace
from flexkv_py.index.policies import AdmissionPolicy, make_eviction_policy
from flexkv_py.index.tier_index import TierIndex
from flexkv_py.index.tier_names import LOWER_TIERS, Tier
from flexkv_py.tiers.object.hints import ObjectHints
from flexkv_py.tiers.registry import enabled_specs, spec_of, spill_spec
from flexkv_py.tiers.spec import Role
from flexkv_py.tiers.ssd.spec import capacity_blocks as ssd_capacity

__all__ = ["CacheManager", "KVEvent"]

logger = logging.getLogger(__name__)

# Object write-behind lag when the SSD's is off (write_behind_lag_s 0): the bucket has no
# eviction path to catch blocks up, so its write-behind is always on.
DEFAULT_OBJECT_LAG_S = 2.0


def ssd_capacity_blocks(config: FlexKVConfig, namespace: Namespace, page_bytes: int) -> int:
    """Blocks one rank's SSD store holds (tiers/ssd/spec.py), each block a whole host slot."""
    return ssd_capacity(config, namespace, slot_nbytes_for(page_bytes))


class CacheManager:
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
            else host_slots_for(config, namespace, page_bytes)
        )
        self.admission = AdmissionPolicy(config.admission_spec)
        # The lower tier that blocks leaving the host tier are written to (None: none exists).
        spill = spill_spec(config)
        self.spill_tier: Tier | None = spill.tier if spill is not None else None
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
        for spec in enabled_specs(config):  # tiers whose evictions the index decides
            if spec.capacity_authoritative and spec.capacity_blocks is not None:
                blocks = spec.capacity_blocks(config, namespace, slot_nbytes_for(page_bytes))
                self.index.set_lower_capacity(spec.tier, blocks)
        self._lock = threading.RLock()
        self._stats: Counter[str] = Counter()
        self.events = EventQueue(namespace, max_events)
        self.outbox = Outbox()
        index, outbox, events, stats = self.index, self.outbox, self.events, self._stats
        self.host = HostSpace(
            index,
            self.admission,
            self.spill_tier,
            outbox,
            events,
            stats,
            free_target=min(slots, math.ceil(free_target * slots)),
        )
        rate = config.write_behind_mib_s * (1 << 20) / max(1, page_bytes)
        # One write-behind per lower tier that takes it: the spill tier (when its lag is on)
        # and each shared store (always on: it has no eviction path to catch blocks up).
        self.links: ChainLinks | None = None
        writers: list[TierWriter] = []
        for spec in enabled_specs(config):
            if spec is spill and config.write_behind_lag_s > 0:
                lag = config.write_behind_lag_s
            elif spec.role is Role.SHARED:
                lag = config.write_behind_lag_s or DEFAULT_OBJECT_LAG_S
            else:
                continue
            shared = spec.role is Role.SHARED
            if spec.keeps_chains and self.links is None:
                self.links = ChainLinks()
            writers.append(
                TierWriter(
                    spec.tier,
                    WriteBehindQueue(lag, rate),
                    stat="write_behind" if spec is spill else f"{spec.tier.value}_write_behind",
                    index=index,
                    host=self.host,
                    outbox=outbox,
                    events=events,
                    stats=stats,
                    # Eviction decides what a rarely seen block is owed; a shared store
                    # takes whatever reached host.
                    admit=self.admission.admit_on_evict if spec is spill else None,
                    links=self.links if spec.keeps_chains else None,
                    # A block evicted before its turn is read back from the spill tier.
                    stage_from=self.spill_tier if shared else None,
                    makes_room=spec.capacity_authoritative,
                    hints=ObjectHints(config.object_store_hint_cap) if shared else None,
                )
            )
        self.writers = tuple(writers)
        by_tier = {w.tier: w for w in writers}
        self.spill_writer = by_tier.get(self.spill_tier) if self.spill_tier else None
        self.object_writer = by_tier.get(Tier.OBJECT)
        if self.spill_writer is not None:  # owed nothing once eviction spills or drops it
            self.host.on_left_host = self.spill_writer.queue.discard
        self.drain = DrainAdmitted(
            index, config.admission_spec.min_hits, has_spill_tier=self.spill_tier is not None
        )
        self.stores = StorePlanner(
            index,
            self.admission,
            self.host,
            self.writers,
            self.drain,
            outbox,
            events,
            stats,
            links=self.links,
            object_write_through=config.object_store_write_through,
        )
        self.loads = LoadPlanner(
            index, self.host, self.drain, outbox, events, stats, page_bytes=page_bytes
        )
        self.prefetch = ObjectPrefetch(
            index, self.host, outbox, events, stats, cap=config.object_store_prefetch_blocks
        )

    @property
    def num_host_slots(self) -> int:
        return self.index.num_host_slots

    # ------------------------------------------------------------------ queries
    def known(self, key: bytes) -> bool:
        """The block is cached in some tier or being stored by a job (not to be stored again)."""
        return self.index.known(key)

    def lookup(self, keys: Sequence[bytes]) -> int:
        """Leading keys readable from some tier (host, lower tiers), at most as many as one load
        can hold in host slots now (every block of a load sits in one: its own, or one it is
        staged through), so a hit is never promised that the load must fail."""
        hit = self.index.loadable(keys, self.index.readable_prefix(keys))
        self.count_lookup(hit)
        return hit

    def touch(self, keys: Sequence[bytes]) -> None:
        """The engine used these cached blocks from its own (GPU) prefix cache: they count as
        recently used here too, so the tiers below keep what the GPU keeps using."""
        self.index.touch(keys)
        with self._lock:
            self.drain.note(keys, stored=False)

    def readable_hashes(self, head: bytes, hashes: Sequence[bytes], start: int, stop: int) -> int:
        """Index of the first unreadable key head + hashes[i] in [start, stop) (stop if none),
        without building the keys (the scheduler's lookup). Counts no lookup: the caller calls
        `count_lookup` once per attempt."""
        return self.index.readable_hashes(head, hashes, start, stop)

    def count_lookup(self, hit: int) -> None:
        with self._lock:
            self._stats["lookups"] += 1
            self._stats["lookup_hit_blocks"] += hit

    def take_drain_admitted(self) -> tuple[bytes, ...]:
        """Keys whose access count reached `min_hits` since the last call (drain_admitted.py)."""
        with self._lock:
            return self.drain.take()

    def take_events(self) -> list[KVEvent]:
        with self._lock:
            return self.events.take()

    # ------------------------------------------------------------------ stores and loads
    def prepare_store(
        self,
        keys: Sequence[bytes],
        gpu_block_ids: Sequence[int] | None,
        *,
        parents: Sequence[bytes | None] | None = None,
    ) -> StoreJob | None:
        """StorePlanner.prepare_store (stores.py)."""
        with self._lock:
            return self.stores.prepare_store(keys, gpu_block_ids, parents=parents)

    def prepare_load(
        self,
        keys: Sequence[bytes],
        gpu_block_ids: Sequence[int] | None,
        *,
        in_rounds: bool = False,
    ) -> LoadJob | None:
        """LoadPlanner.prepare_load (loads.py)."""
        with self._lock:
            return self.loads.prepare_load(keys, gpu_block_ids, in_rounds=in_rounds)

    def prepare_load_part(
        self, keys: Sequence[bytes], gpu_block_ids: Sequence[int] | None, end: int
    ) -> LoadJob | None:
        """LoadPlanner.prepare_load_part (loads.py)."""
        with self._lock:
            return self.loads.prepare_load_part(keys, gpu_block_ids, end)

    def prepare_load_parts(
        self,
        keys: Sequence[bytes],
        gpu_block_ids: Sequence[int] | None,
        bounds: Sequence[tuple[int, int]],
    ) -> list[LoadJob]:
        """LoadPlanner.prepare_load_parts (loads.py)."""
        with self._lock:
            return self.loads.prepare_load_parts(keys, gpu_block_ids, bounds)

    def grow_host_slots(self, usable: int) -> None:
        """Every worker's pool has its first `usable` slots ready: the host tier may use them."""
        with self._lock:
            self.host.grow(usable)

    # ------------------------------------------------------------------ object tier
    def prefetch_object(self, keys: Sequence[bytes]) -> int | None:
        """ObjectPrefetch.start (object_prefetch.py)."""
        with self._lock:
            return self.prefetch.start(keys)

    def prefetch_in_flight(self, job_id: int) -> bool:
        with self._lock:
            return self.prefetch.in_flight(job_id)

    def note_object_hits(self, keys: Sequence[bytes], start: int, count: int) -> int:
        """The bucket holds `keys[:count]` (a prompt's chain, root first, from a lookup): the
        index marks keys[start:count] present on the object tier (a hint, tier_writer.py) and
        remembers their links. Returns how many became readable there."""
        if count <= start:
            return 0
        with self._lock:
            hit = list(keys[start:count])
            if self.links is not None:
                self.links.remember(hit, [keys[i - 1] if i else None for i in range(start, count)])
            changed = self.index.set_present(hit, Tier.OBJECT, True)
            if self.object_writer is not None:
                self.object_writer.learned(hit)
            self._stats["object_lookup_hit_blocks"] += count - start
            return len(changed)

    # ------------------------------------------------------------------ jobs
    def writer(self, tier: Tier | None = None) -> TierWriter | None:
        """The write-behind to `tier` (None: to the spill tier), or None if it has none."""
        if tier is None:
            return self.spill_writer
        return next((w for w in self.writers if w.tier is tier), None)

    def take_write_behind(self, *, drain: bool = False, tier: Tier | None = None) -> Job | None:
        """The next write-behind job to `tier` (None: the spill tier), also queued for
        `take_jobs`; None when there is none (tier_writer.py). `drain`: ignore idleness and
        the rate (shutdown flush)."""
        with self._lock:
            w = self.writer(tier)
            return w.take(drain=drain) if w is not None else None

    def take_object_write_behind(self, *, drain: bool = False) -> Job | None:
        """`take_write_behind` to the object tier."""
        return self.take_write_behind(drain=drain, tier=Tier.OBJECT)

    def take_jobs_now(self, job: Job) -> Job:
        """Hand `job` (from a take_*write_behind) to a caller that submits it at once, instead
        of to the next `take_jobs`."""
        with self._lock:
            self.outbox.unqueue(job)
            return job

    def take_jobs(self) -> list[Job]:
        """Background jobs (spills, write-behind, lower-tier deletes) for every worker, in
        creation order."""
        with self._lock:
            self.host.flush_spills()
            for writer in self.writers:  # only when nothing else is queued (tier_writer.py)
                writer.take()
            self._drop_evicted()
            return self.outbox.take_background()

    def _drop_evicted(self) -> None:
        """Evictions no write job took (an adoption over capacity): deleted before the rest."""
        drops = self.host.take_drops()
        if drops:
            self.outbox.send(DropJob(self.outbox.new_id(), drops), first=True)

    def complete(self, result: JobResult) -> None:
        """Apply a job's result (merged over ranks): commit or drop blocks, unpin, free slots."""
        with self._lock:
            tracked = self.outbox.pop(result.job_id)
            if tracked is not None:
                job, done = tracked
                if result.kind != "drop":  # a reset's delete announces what it held (below)
                    self.host.announce_dropped(result.dropped)  # cold victims of `drop_first`
                done(job, result)
            elif result.kind == "drop":  # deletes are sent untracked (Outbox.send)
                self.host.announce_dropped(result.dropped)
            else:
                logger.warning("result for unknown or finished job %d ignored", result.job_id)
                return
            for tier, keys in result.evicted.items():
                # The store's own eviction: a safety net that fires only if sizes are wrong.
                self._stats[f"{tier.value}_store_evicted_blocks"] += len(keys)
                for key in self.index.set_present(keys, tier, False):
                    self.events.add("removed", (key,), tier)
                    self._stats[f"{tier.value}_evicted_blocks"] += 1
            for tier, garbage in self.index.take_garbage().items():
                self.outbox.send(DropJob(self.outbox.new_id(), Drops.of({tier: garbage})))
            self.host.keep_reserve()

    def _reset_deleted(self, forgotten: list[Forgotten], _job: Job, result: JobResult) -> None:
        """A reset's delete came back: of the blocks its namespace delete removed, announce
        those the index held cold when it was reset (newest first, as the reset announced its
        warm blocks)."""
        for tier, keys in result.dropped.items():
            held = [k for k in keys if any(f.held(k, tier) for f in forgotten)]
            self.host.announce_dropped({tier: held[::-1]})

    # ------------------------------------------------------------------ inventory / reset
    def adopt_ssd_keys(
        self,
        keys_per_rank: Sequence[Collection[bytes]],
        *,
        adopt: bool = True,
        parents: Mapping[bytes, bytes] | None = None,
        before: AdoptedBefore | None = None,
        checked: bool = False,
    ) -> int:
        """Restart: index the blocks every rank's SSD tier holds (from JobExecutor.stored_keys).
        Blocks only some ranks hold are useless and get deleted. Returns how many were adopted.
        `adopt` False (the cache was reset before the reports came): delete them all.
        `parents`: logical key -> its chain parent's logical key (what the store persisted),
        so eviction stays tail-first across restarts; None: blocks adopted unlinked.
        `before`: blocks adopted already from a read-only read of the shards: not adopted
        again, and those not on every rank now are forgotten (adopted_before.py). `checked`:
        every key is of this namespace already (that read kept only those)."""
        return self.adopt_keys(
            Tier.SSD, keys_per_rank, adopt=adopt, parents=parents, before=before, checked=checked
        )

    def _owned(self, keys: Collection[bytes], checked: bool) -> Sequence[bytes]:
        """The keys of this namespace among `keys` (all of them when `checked`). Joined keys
        (a restart's own read) stay joined when all are ours: no object per block."""
        if isinstance(keys, JoinedKeys) and (checked or self.namespace.owns_all(keys)):
            return keys
        if checked:
            return list(keys)
        owns = self.namespace.owns
        return [k for k in keys if owns(k)]

    def adopt_keys(
        self,
        tier: Tier,
        keys_per_rank: Sequence[Collection[bytes]],
        *,
        adopt: bool = True,
        parents: Mapping[bytes, bytes] | None = None,
        before: AdoptedBefore | None = None,
        checked: bool = False,
    ) -> int:
        """`adopt_ssd_keys` for any lower tier."""
        with self._lock:
            owned = [self._owned(ks, checked) for ks in keys_per_rank]
            if not owned:
                return 0
            if not adopt:
                stale = sorted({k for ks in owned for k in ks})
                if stale:
                    self.outbox.send(DropJob(self.outbox.new_id(), Drops.of({tier: stale})))
                logger.info("dropped %d %s blocks stored before a reset", len(stale), tier.value)
                return 0
            # Rank 0's order (its store's); joined reports are intersected as buffers
            # (index/joined_sets.py): millions of keys, no object per key.
            common: Sequence[bytes] = owned[0]
            orphans: Sequence[bytes] = ()
            if len(owned) > 1:
                common, orphans = common_and_orphans(owned[0], owned[1:])
            if before is not None:  # adopted already: settle the difference
                common, gone = before.settle(common)
                forgotten = self.index.set_present(gone, tier, False)
                self.events.add("removed", forgotten, tier)
                self._stats[f"{tier.value}_forgotten_blocks"] += len(forgotten)
            adopted = self.index.set_present(common, tier, True)
            if parents:  # links made before are skipped
                self.index.link_parents(parents)
            self.index.fit_lower_capacity(tier)  # linked first: what goes is chain tails
            self._drop_evicted()
            # Only the newest max_events fit the event queue: the older would be dropped unread.
            maxlen = self.events.maxlen or len(adopted)
            self.events.add("stored", adopted[-maxlen:], tier)
            if orphans:
                self.outbox.send(DropJob(self.outbox.new_id(), Drops.of({tier: orphans})))
            self._stats[f"{tier.value}_adopted_blocks"] += len(adopted)
            logger.info(
                "adopted %d %s blocks (%d orphans dropped)", len(adopted), tier.value, len(orphans)
            )
            return len(adopted)

    def forget_on(self, tier: Tier, keys: Sequence[bytes]) -> int:
        """`tier` no longer holds `keys` (a sibling shard evicted them): stop offering them
        there. Returns how many were forgotten."""
        with self._lock:
            gone = self.index.set_present(keys, tier, False)
            self._stats[f"{tier.value}_forgotten_blocks"] += len(gone)
            return len(gone)

    def reset(self) -> DropJob | None:
        """Forget every block (e.g. after a weight update). Blocks in use by in-flight jobs become
        unreadable now and are cleaned up when their jobs complete. Returns the lower-tier
        deletes (one job: every key on every tier it names)."""
        with self._lock:
            removed = self.index.reset()
            for writer in self.writers:
                writer.clear()
            drop: list[bytes] = []
            tiers: set[Tier] = set()
            # Newest first (insertion order reversed): a chain's blocks mostly leave from its
            # tail, as a router's prefix tree prefers (a parent stored again after its children,
            # or a block still in use, can come out of order).
            for key, entry in reversed(removed):
                if entry.host_slot is not None:
                    self.events.add("removed", (key,), Tier.HOST)
                for tier in LOWER_TIERS:
                    if tier in entry.lower_tiers:
                        self.events.add("removed", (key,), tier)
                # Only what this engine owns is deleted: the fleet's bucket and a sibling's
                # shard are forgotten here, nothing deleted there (a weight update changes every
                # key through model_epoch anyway).
                on = {t for t in entry.lower_tiers if spec_of(t).ours}
                if on:
                    tiers |= on
                    drop.append(key)
            self._stats["resets"] += 1
            # Cold blocks are fingerprints here: the workers delete the namespace on the
            # tiers that held some, and their keys are announced from the result.
            forgotten = self.index.take_forgotten()
            wipe = {t for f in forgotten for t in f.sets}
            wipe |= {CHAIN_TIER for f in forgotten if f.evicted}
            wipe = {t for t in wipe if spec_of(t).ours}
            if not drop and not wipe:
                return None
            drop_tiers = tuple(t for t in LOWER_TIERS if t in tiers | wipe)
            # Every key on every tier the reset touches (one tuple, shared by the legs: a tier
            # lacking a key deletes nothing), and the namespace there once any held cold blocks.
            keys = tuple(drop)
            job = DropJob(
                self.outbox.new_id(),
                Drops.of(dict.fromkeys(drop_tiers, keys)),
                wipe_namespace_on=drop_tiers if wipe else (),
            )
            if wipe:  # its result names the cold blocks it deleted: announced as it comes back
                self.outbox.track(job, functools.partial(self._reset_deleted, forgotten))
            return job

    # ------------------------------------------------------------------ stats
    def write_behind_pending(self, tier: Tier | None = None) -> int:
        """Blocks still owed to `tier` (None: the spill tier): queued, waiting for a staging
        read, or being written."""
        with self._lock:
            w = self.writer(tier)
            return w.pending() if w is not None else 0

    def object_write_pending(self) -> int:
        """`write_behind_pending` of the object tier."""
        return self.write_behind_pending(Tier.OBJECT)

    def _written_per_served(self) -> float | None:
        """SSD wear: blocks written to the spill tier per block it served (None: none served)."""
        tier = self.spill_tier or Tier.SSD
        s = self._stats
        written = s[f"{tier.value}_written_blocks"] + s["spilled_blocks"]
        written += s["write_behind_blocks"]
        served = s[f"load_{tier.value}_blocks"]
        return written / served if served else None

    def stats(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = dict(self._stats)
            out.update({f"index_{k}": v for k, v in self.index.counts().items()})
            out["host_slots"] = self.num_host_slots
            out["inflight_jobs"] = len(self.outbox)
            out["spilling_slots"] = self.host.spilling
            out["write_behind_pending_blocks"] = self.write_behind_pending()
            w = self.spill_writer
            out["write_behind_inflight_jobs"] = int(w is not None and w.in_flight())
            if self.object_writer is not None:
                out["object_write_pending_blocks"] = self.object_writer.pending()
                hints = self.object_writer.hints
                out["object_hints"] = len(hints) if hints is not None else 0
            wear = self._written_per_served()
            if wear is not None:  # SSD bytes written per byte it served
                out[f"{(self.spill_tier or Tier.SSD).value}_written_per_served"] = round(wear, 3)
            return out

    def close(self) -> None:
        """Nothing to release: the manager holds no memory or files."""
