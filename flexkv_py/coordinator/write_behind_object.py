"""Write-behind to the object tier: host blocks reach the fleet's bucket in the background.

A block is queued when its store commits (its host copy became readable), with its chain
parent, so the object tier can write the chain's manifests (tiers/object_tier.py: a lookup by
another worker finds a prefix only through them). The job is a SpillJob body (host slot ->
`Tier.OBJECT`, host copy kept and pinned until the write commits), handed out like the SSD's
write-behind (write_behind.py) but after it: only when nothing else is queued for the workers
and no load or store is in flight, or once the oldest block waited `write_behind_lag_s`; at
the `write_behind_mib_s` rate; one job at a time; ancestors before descendants.

Host -> SSD -> object: a block evicted from host before its turn is uploaded from the SSD. The
job is then a host-only LoadJob first (SSD -> staging slots taken from the free host slots only,
never by evicting, never promoted: the block stays off the host tier), and on its result the
upload (staging and host slots -> `Tier.OBJECT`, parents and chain links as for host blocks),
after which the staging slots are given back. A block whose spill to the SSD is still in flight
waits in the queue for its next turn; one in no tier (dropped, no SSD) is not uploaded
(`object_write_behind_lost_blocks`).

Blocks a store streams through reused slots (no host copy, stores.py) are written through to
the object tier in the store job itself, and `object_store_write_through` writes every stored
block there at store time.

What the index learns here is a hint: the bucket is shared and collected by others, so a
present bit on `Tier.OBJECT` can be stale; a load that finds the object gone or corrupt fails
that block (recomputed) and the bit is cleared (loads.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, TypeVar

from flexkv_py.coordinator.jobs import JobResult, LoadJob, SpillJob
from flexkv_py.coordinator.write_behind import WriteBehind
from flexkv_py.coordinator.write_behind_queue import WriteBehindQueue
from flexkv_py.index.entry import TIER_BIT
from flexkv_py.index.tier_names import Tier

LINKS_CAP = 1 << 20  # remembered chain links (a forgotten one only costs a manifest)
ObjectJob = TypeVar("ObjectJob", SpillJob, LoadJob)


class ObjectWriteBehind(WriteBehind):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # SSD -> object: a staging read's job id -> the host blocks (keys, slots) that upload
        # with its blocks; an upload's job id -> the staging slots it gives back, its SSD keys.
        self._object_staged: dict[int, tuple[list[bytes], list[int]]] = {}
        self._object_staging: dict[int, tuple[list[int], frozenset[bytes]]] = {}

    def _remember_links(self, keys: Sequence[bytes], parents: Sequence[bytes | None]) -> None:
        links = self._object_links
        for key, parent in zip(keys, parents, strict=True):
            links[key] = parent
            links.move_to_end(key)
        while len(links) > LINKS_CAP:
            links.popitem(last=False)

    def _queue_object(self, keys: Iterable[bytes]) -> None:
        """Blocks whose host copy just became readable and that the bucket may lack."""
        queue = self._object_queue
        if queue is None:
            return
        for key in self.index.lacking_on(keys, Tier.OBJECT):  # one lock for the batch
            queue.add(key)

    def _ancestor_links(self, keys: Sequence[bytes]) -> list[tuple[bytes, bytes | None]]:
        """Links from the job's blocks up to their roots that the job does not carry: the
        object tier needs a block's whole chain to write its manifests, and a prefix this
        worker loaded (not stored) reaches it only this way."""
        links, inside = self._object_links, set(keys)
        out: list[tuple[bytes, bytes | None]] = []
        seen: set[bytes] = set()
        for key in keys:
            at = links.get(key)
            while at is not None and at not in inside and at not in seen and at in links:
                seen.add(at)
                parent = links[at]
                out.append((at, parent))
                at = parent
        return out

    def _root_first(self, keys: list[bytes], slots: list[int]) -> tuple[list[bytes], list[int]]:
        """The job's blocks ordered so that each comes after its parent (stores can commit
        out of order): the object tier then puts each chain in one batch, ancestors included,
        and writes its manifests (it writes none for a segment whose ancestors are not stored
        yet)."""
        links, inside = self._object_links, set(keys)
        depth: dict[bytes, int] = {}
        for key in keys:
            n, at = 0, links.get(key)
            while at is not None and at in inside and n <= len(keys):
                n, at = n + 1, links.get(at)
            depth[key] = n
        order = sorted(range(len(keys)), key=lambda i: depth[keys[i]])
        return [keys[i] for i in order], [slots[i] for i in order]

    def _off_host(self, key: bytes) -> str:
        """Where a queued block whose host copy is gone uploads from: "ssd" (staged from it),
        "later" (its spill to the SSD is in flight) or "" (nowhere: not uploaded)."""
        tier = self.spill_tier
        if tier is None:
            return ""
        if self.index.readable_on(key, tier):
            return "ssd"
        e = self.index.entry(key)
        if e is not None and not e.stale and (e.evicting or e.pending & TIER_BIT[tier]):
            return "later"
        return ""

    def take_object_write_behind(self, *, drain: bool = False) -> SpillJob | LoadJob | None:
        """The next object write-behind job (queued for `take_jobs`), or None: an upload, or
        the SSD staging read that comes before one (module docstring)."""
        with self._lock:
            queue = self._object_queue
            if queue is None or self._object_jobs:
                return None
            budget = self._job_budget(queue, drain)
            if budget <= 0:
                return None
            keys: list[bytes] = []
            slots: list[int] = []
            on_ssd: list[bytes] = []
            # Keys that turn out to need nothing (lost, uploaded) do not end the turn: the
            # next ones are looked at, each queued key at most once (a step: a few batches).
            looked, queued = 0, len(queue) if drain else min(len(queue), 8 * budget)
            while not keys and not on_ssd and looked < queued:
                batch = queue.take(min(budget, queued - looked))
                looked += len(batch)
                self._pick(batch, queue, keys, slots, on_ssd)
            staged = self._stage_from_ssd(on_ssd, queue)
            if not keys and not staged:
                return None
            if not drain:
                queue.spend(len(keys) + len(staged))
            if staged:
                return self._staging_job(staged, keys, slots)
            return self._upload_job(keys, slots)

    def _pick(
        self,
        batch: list[bytes],
        queue: WriteBehindQueue,
        keys: list[bytes],
        slots: list[int],
        on_ssd: list[bytes],
    ) -> None:
        """Sort taken keys: host blocks to upload (`keys`, `slots`: begun, pinned), blocks to
        stage from the SSD (`on_ssd`), back in the queue, or nothing to do. Lock held."""
        links = self._object_links
        for key in batch:
            if links.get(key) in queue:
                # Its parent is still owed: ancestors go first (a segment's manifest is
                # written only once its ancestors are stored), this one goes next time.
                queue.add(key)
                continue
            slot = self.index.host_slot_of(key)
            if slot is None:
                where = self._off_host(key)
                if where == "ssd":
                    on_ssd.append(key)
                elif where == "later":
                    queue.add(key)
                elif not self.index.readable_on(key, Tier.OBJECT):
                    self._stats["object_write_behind_lost_blocks"] += 1
                continue
            if not self.index.begin_write(key, Tier.OBJECT):
                continue  # there / on its way already
            self.index.pin([key])
            keys.append(key)
            slots.append(slot)

    def _stage_from_ssd(
        self, keys: list[bytes], queue: WriteBehindQueue
    ) -> list[tuple[bytes, int]]:
        """Staging slots for blocks uploaded from the SSD (free host slots only: a step never
        waits for them); those without one wait for a later turn. Lock held."""
        if not keys:
            return []
        got = self.index.allocate_slots(len(keys))
        out: list[tuple[bytes, int]] = []
        for key in keys:
            if len(out) == len(got):
                queue.add(key)  # no free slot now
            elif self.index.begin_write(key, Tier.OBJECT):
                self.index.pin([key])  # its SSD copy stays put (a warm, pinned entry)
                out.append((key, got[len(out)]))
        self.index.release_slots(got[len(out) :])
        if out:
            self._keep_reserve()  # evictions in the background refill the free reserve
        return out

    def _staging_job(
        self, staged: list[tuple[bytes, int]], keys: list[bytes], slots: list[int]
    ) -> LoadJob:
        """SSD -> staging slots (host only); `keys`/`slots` (host blocks) upload with them."""
        tier = self.spill_tier
        assert tier is not None
        job = LoadJob(
            next(self._ids),
            tuple(k for k, _ in staged),
            None,
            tuple(s for _, s in staged),
            (tier,) * len(staged),
        )
        self._object_staged[job.job_id] = (keys, slots)
        return self._queue_object_job(job)

    def _upload_job(
        self, keys: list[bytes], slots: list[int], staging: frozenset[bytes] = frozenset()
    ) -> SpillJob:
        """Host slots -> the bucket, root first, with the chain links its manifests need."""
        links = self._object_links
        keys, slots = self._root_first(keys, slots)
        job = SpillJob(
            next(self._ids),
            tuple(keys),
            tuple(slots),
            Tier.OBJECT,
            parents=tuple(links.get(k) for k in keys),
            # Metadata the bucket does not keep; present, so the connector's fill-in from
            # what it remembers (block_meta.with_block_metas) keeps these parents.
            metas=(None,) * len(keys),
            chain_links=tuple(self._ancestor_links(keys)),
        )
        if staging:
            at = dict(zip(keys, slots, strict=True))
            self._object_staging[job.job_id] = ([at[k] for k in staging], staging)
        return self._queue_object_job(job)

    def _queue_object_job(self, job: ObjectJob) -> ObjectJob:
        self._inflight[job.job_id] = job
        self._object_jobs.add(job.job_id)
        self._background.append(job)
        return job

    def _complete_object_stage(self, job: LoadJob, result: JobResult) -> None:
        """A staging read ended: what it read uploads (with the host blocks waiting for it);
        a block it could not read fails its object write, a lost SSD copy is forgotten."""
        self._object_jobs.discard(job.job_id)
        keys, slots = self._object_staged.pop(job.job_id)
        staged: list[bytes] = []
        tier = job.sources[0] if job.sources else None
        for key, slot in zip(job.keys, job.host_slots, strict=True):
            reason = result.failed.get(key)
            if reason is None:
                staged.append(key)
                keys.append(key)
                slots.append(slot)
                continue
            self.index.commit_write(key, Tier.OBJECT, False)
            self.index.unpin([key])
            self.index.release_slots([slot])
            self._stats["object_write_behind_stage_failed_blocks"] += 1
            if tier is not None:
                self._forget_lost_copy(key, tier, reason)
        if keys:
            self._upload_job(keys, slots, frozenset(staged))

    def _complete_object_write(self, job: SpillJob, result: JobResult) -> None:
        self._object_jobs.discard(job.job_id)
        self._commit_pinned_writes(job, result, "object_write_behind")
        self._learned_on_object(k for k in job.keys if k not in result.failed)
        staging = self._object_staging.pop(job.job_id, None)
        if staging is not None:
            slots, staged = staging
            self.index.release_slots(slots)
            done = sum(k not in result.failed for k in staged)
            self._stats["object_write_behind_from_ssd_blocks"] += done

    def _learned_on_object(self, keys: Iterable[bytes]) -> None:
        """`keys` are marked present on the object tier now: past `object_store_hint_cap`
        hints the oldest are forgotten here (tiers/object_hints.py; still in the bucket)."""
        forget = self._object_hints.learned(keys)
        if forget:
            self.index.set_present(forget, Tier.OBJECT, False)
            self._stats["object_hints_forgotten"] += len(forget)

    def _complete_object_load(self, job: LoadJob, result: JobResult) -> bool:
        """Apply `job` if it is an object write-behind's staging read (True) or not (False)."""
        if job.job_id not in self._object_staged:
            return False
        self._complete_object_stage(job, result)
        return True

    def note_object_hits(self, keys: Sequence[bytes], start: int, count: int) -> int:
        """The bucket holds `keys[:count]` (a prompt's chain, root first, from a lookup): the
        index marks keys[start:count] present on the object tier (a hint, see the module
        docstring) and remembers their links. Returns how many became readable there."""
        if count <= start:
            return 0
        with self._lock:
            hit = list(keys[start:count])
            self._remember_links(hit, [keys[i - 1] if i else None for i in range(start, count)])
            changed = self.index.set_present(hit, Tier.OBJECT, True)
            self._learned_on_object(hit)
            self._stats["object_lookup_hit_blocks"] += count - start
            return len(changed)

    def object_write_pending(self) -> int:
        """Blocks still owed to the object tier (queued or being written)."""
        with self._lock:
            queue = self._object_queue
            queued = len(queue) if queue is not None else 0
            waiting = sum(len(keys) for keys, _ in self._object_staged.values())
            return queued + waiting + sum(len(self._inflight[j].keys) for j in self._object_jobs)
