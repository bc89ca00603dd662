"""Scheduler side: decides where blocks go and emits jobs; never touches block memory.

Model: vLLM's kv_offload manager. `lookup` answers from the tier index (the source of truth for
what each tier holds, see flexkv_py/index/tier_index.py); `prepare_store` and `prepare_load` pin
what they use and return a job for every worker; background work (host -> lower-tier spills on
eviction, lower-tier deletes) comes out of `take_jobs`; `complete` applies a job's (merged)
result. Nothing a job still uses can be evicted or reused: stores pin their fresh slots, loads pin
their blocks, and a spilled slot is free only once its lower-tier write is confirmed.

One planner per job, one file each: stores (stores.py), loads (loads.py), host space and spills
(eviction.py), over the shared state and KV events (manager_state.py). This class adds lookups,
result dispatch, the restart inventory, reset and stats.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from flexkv_py.coordinator.adopted_before import AdoptedBefore
from flexkv_py.coordinator.jobs import DropJob, Job, JobResult, LoadJob, SpillJob, StoreJob
from flexkv_py.coordinator.kv_events import KVEvent
from flexkv_py.coordinator.loads import LoadPlanner
from flexkv_py.coordinator.object_prefetch import ObjectPrefetch
from flexkv_py.coordinator.stores import StorePlanner
from flexkv_py.index.cold_blocks import CHAIN_TIER
from flexkv_py.index.tier_names import LOWER_TIERS, Tier

__all__ = ["CacheManager", "KVEvent"]

logger = logging.getLogger(__name__)


class CacheManager(StorePlanner, ObjectPrefetch, LoadPlanner):
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
        self._note_admitted(keys, stored=False)

    def readable_hashes(self, head: bytes, hashes: Sequence[bytes], start: int, stop: int) -> int:
        """Index of the first unreadable key head + hashes[i] in [start, stop) (stop if none),
        without building the keys (the scheduler's lookup). Counts no lookup: the caller calls
        `count_lookup` once per attempt."""
        return self.index.readable_hashes(head, hashes, start, stop)

    def count_lookup(self, hit: int) -> None:
        with self._lock:
            self._stats["lookups"] += 1
            self._stats["lookup_hit_blocks"] += hit

    # ------------------------------------------------------------------ jobs
    def take_jobs(self) -> list[Job]:
        """Background jobs (spills, lower-tier deletes) for every worker, in creation order."""
        with self._lock:
            self._flush_spills()
            self.take_write_behind()  # only when nothing else is queued (write_behind.py)
            self.take_object_write_behind()  # after it (write_behind_object.py)
            self._drop_evicted()
            jobs, self._background = self._background, []
            return jobs

    def _drop_evicted(self) -> None:
        """Evictions no write job took (an adoption over capacity): deleted before the rest."""
        drops = self._take_drops()
        for tier in reversed([*dict.fromkeys([*drops.keys, *drops.prints])]):
            keys, prints = drops.keys_on(tier), drops.prints_on(tier)
            self._background.insert(0, DropJob(next(self._ids), keys, (tier,), prints=prints))

    def complete(self, result: JobResult) -> None:
        """Apply a job's result (merged over ranks): commit or drop blocks, unpin, free slots."""
        with self._lock:
            job = self._inflight.pop(result.job_id, None)
            if result.kind == "drop" and job is None:  # deletes are not tracked in flight
                self._complete_drop(result)
                return
            if job is None:
                logger.warning("result for unknown or finished job %d ignored", result.job_id)
                return
            self._announce_dropped(result.dropped)  # cold victims of its `drop_first`
            if isinstance(job, StoreJob):
                self._complete_chained(job, result)
                self._complete_store(job, result)
            elif isinstance(job, LoadJob):
                self._complete_chained(job, result)
                if not self._complete_object_load(job, result):  # prefetch, SSD -> object
                    self._complete_load(job, result, self._load_plans.pop(job.job_id))
            elif isinstance(job, SpillJob):
                if job.job_id in self._write_behind_jobs:
                    self._complete_write_behind(job, result)
                elif job.job_id in self._object_jobs:
                    self._complete_object_write(job, result)
                else:
                    self._complete_spill(job, result)
            for tier, keys in result.evicted.items():
                # The store's own eviction: a safety net that fires only if sizes are wrong.
                self._stats[f"{tier.value}_store_evicted_blocks"] += len(keys)
                for key in self.index.set_present(keys, tier, False):
                    self._event("removed", key, tier)
                    self._stats[f"{tier.value}_evicted_blocks"] += 1
            for tier, garbage in self.index.take_garbage().items():
                self._background.append(DropJob(next(self._ids), tuple(garbage), (tier,)))
            self._keep_reserve()

    def _complete_drop(self, result: JobResult) -> None:
        """A DropJob's result: announce the blocks it deleted by fingerprint, and of a reset's
        namespace delete those the index held cold when it was reset."""
        forgotten = self._reset_forgotten.pop(result.job_id, None)
        if forgotten is None:
            self._announce_dropped(result.dropped)
            return
        for tier, keys in result.dropped.items():
            held = [k for k in keys if any(f.held(k, tier) for f in forgotten)]
            # Newest first, as the reset announces its warm blocks.
            self._announce_dropped({tier: held[::-1]})

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
            owns = self.namespace.owns
            owned = [list(ks) if checked else [k for k in ks if owns(k)] for ks in keys_per_rank]
            if not owned:
                return 0
            if not adopt:
                stale = sorted({k for ks in owned for k in ks})
                if stale:
                    self._background.append(DropJob(next(self._ids), tuple(stale), (tier,)))
                logger.info("dropped %d %s blocks stored before a reset", len(stale), tier.value)
                return 0
            # Rank 0's order (its store's); sets only with more than one rank (millions of keys).
            common, orphans = owned[0], []
            if len(owned) > 1:
                others = [set(ks) for ks in owned[1:]]
                common = [k for k in common if all(k in o for o in others)]
                kept = set(common)
                orphans = sorted({k for ks in owned for k in ks if k not in kept})
            if before is not None:  # adopted already: settle the difference
                common, gone = before.settle(common)
                forgotten = self.index.set_present(gone, tier, False)
                self._events_of("removed", forgotten, tier)
                self._stats[f"{tier.value}_forgotten_blocks"] += len(forgotten)
            adopted = self.index.set_present(common, tier, True)
            if parents:  # links made before are skipped
                self.index.link_parents(parents)
            self.index.fit_lower_capacity(tier)  # linked first: what goes is chain tails
            self._drop_evicted()
            # Only the newest max_events fit the event queue: the older would be dropped unread.
            maxlen = self._events.maxlen or len(adopted)
            self._events_of("stored", adopted[-maxlen:], tier)
            if orphans:
                self._background.append(DropJob(next(self._ids), tuple(orphans), (tier,)))
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
            if self._write_behind is not None:
                self._write_behind.clear()
            if self._object_queue is not None:
                self._object_queue.clear()
            self._object_hints.clear()
            drop: list[bytes] = []
            tiers: set[Tier] = set()
            # Newest first (insertion order reversed): a chain's blocks mostly leave from its
            # tail, as a router's prefix tree prefers (a parent stored again after its children,
            # or a block still in use, can come out of order).
            for key, entry in reversed(removed):
                if entry.host_slot is not None:
                    self._event("removed", key, Tier.HOST)
                for tier in LOWER_TIERS:
                    if tier in entry.lower_tiers:
                        self._event("removed", key, tier)
                # The bucket is the fleet's: a reset forgets it here, deletes nothing there
                # (a weight update changes every key through model_epoch anyway).
                on = entry.lower_tiers - {Tier.OBJECT}
                if on:
                    tiers |= on
                    drop.append(key)
            self._stats["resets"] += 1
            # Cold blocks are fingerprints here: the workers delete the namespace on the
            # tiers that held some, and their keys are announced from the result.
            forgotten = self.index.take_forgotten()
            wipe = {t for f in forgotten for t in f.sets}
            wipe |= {CHAIN_TIER for f in forgotten if f.evicted}
            wipe -= {Tier.OBJECT, Tier.NODE}  # the fleet's bucket, a sibling's shard: not ours
            if not drop and not wipe:
                return None
            drop_tiers = tuple(t for t in LOWER_TIERS if t in tiers | wipe)
            job = DropJob(next(self._ids), tuple(drop), drop_tiers, namespace=bool(wipe))
            if wipe:
                self._reset_forgotten[job.job_id] = forgotten
            return job

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict[str, Any]:
        with self._lock:
            out: dict[str, Any] = dict(self._stats)
            out.update({f"index_{k}": v for k, v in self.index.counts().items()})
            out["host_slots"] = self.num_host_slots
            out["inflight_jobs"] = len(self._inflight)
            out["spilling_slots"] = self._spilling
            out["write_behind_pending_blocks"] = self.write_behind_pending()
            out["write_behind_inflight_jobs"] = len(self._write_behind_jobs)
            if self.object_enabled:
                out["object_write_pending_blocks"] = self.object_write_pending()
                out["object_hints"] = len(self._object_hints)
            wear = self._written_per_served()
            if wear is not None:  # SSD bytes written per byte it served
                out[f"{(self.spill_tier or Tier.SSD).value}_written_per_served"] = round(wear, 3)
            return out

    def close(self) -> None:
        """Nothing to release: the manager holds no memory or files."""
