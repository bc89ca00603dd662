"""Write-behind to the object tier: host blocks reach the fleet's bucket in the background.

A block is queued when its store commits (its host copy became readable), with its chain
parent, so the object tier can write the chain's manifests (tiers/object_tier.py: a lookup by
another worker finds a prefix only through them). The job is a SpillJob body (host slot ->
`Tier.OBJECT`, host copy kept and pinned until the write commits), handed out like the SSD's
write-behind (write_behind.py) but after it: only when nothing else is queued for the workers
and no load or store is in flight, or once the oldest block waited `write_behind_lag_s`; at
the `write_behind_mib_s` rate; one job at a time; ancestors before descendants. A block
evicted from host before its turn is not written (the SSD, if any, still holds it): the lag
bounds how often that happens.

Blocks a store streams through reused slots (no host copy, stores.py) are written through to
the object tier in the store job itself, and `object_store_write_through` writes every stored
block there at store time.

What the index learns here is a hint: the bucket is shared and collected by others, so a
present bit on `Tier.OBJECT` can be stale; a load that finds the object gone or corrupt fails
that block (recomputed) and the bit is cleared (loads.py).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from flexkv_py.coordinator.jobs import JobResult, SpillJob
from flexkv_py.coordinator.write_behind import WriteBehind
from flexkv_py.index.tier_names import Tier

LINKS_CAP = 1 << 20  # remembered chain links (a forgotten one only costs a manifest)


class ObjectWriteBehind(WriteBehind):
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
        for key in keys:
            if not self.index.readable_on(key, Tier.OBJECT):
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

    def take_object_write_behind(self, *, drain: bool = False) -> SpillJob | None:
        """The next object write-behind job (queued for `take_jobs`), or None."""
        with self._lock:
            queue = self._object_queue
            if queue is None or self._object_jobs:
                return None
            budget = self._job_budget(queue, drain)
            if budget <= 0:
                return None
            keys, slots = [], []
            links = self._object_links
            for key in queue.take(budget):
                if links.get(key) in queue:
                    # Its parent is still owed: ancestors go first (a segment's manifest is
                    # written only once its ancestors are stored), this one goes next time.
                    queue.add(key)
                    continue
                slot = self.index.host_slot_of(key)
                if slot is None or not self.index.begin_write(key, Tier.OBJECT):
                    continue  # gone from host, or there / on its way already
                self.index.pin([key])
                keys.append(key)
                slots.append(slot)
            if not keys:
                return None
            if not drain:
                queue.spend(len(keys))
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
            self._inflight[job.job_id] = job
            self._object_jobs.add(job.job_id)
            self._background.append(job)
            return job

    def _complete_object_write(self, job: SpillJob, result: JobResult) -> None:
        self._object_jobs.discard(job.job_id)
        self._commit_pinned_writes(job, result, "object_write_behind")
        self._learned_on_object(k for k in job.keys if k not in result.failed)

    def _learned_on_object(self, keys: Iterable[bytes]) -> None:
        """`keys` are marked present on the object tier now: past `object_store_hint_cap`
        hints the oldest are forgotten here (tiers/object_hints.py; still in the bucket)."""
        forget = self._object_hints.learned(keys)
        if forget:
            self.index.set_present(forget, Tier.OBJECT, False)
            self._stats["object_hints_forgotten"] += len(forget)

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
            return queued + sum(len(self._inflight[j].keys) for j in self._object_jobs)
