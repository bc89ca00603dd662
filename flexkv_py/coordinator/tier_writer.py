"""Write-behind: host blocks reach a lower tier in the background. One writer per lower tier that
takes write-behind: the spill tier (SSD, so a restart or a crash finds them there) and the
fleet's bucket (object tier). The writers differ only in their parameters (`TierWriter`'s).

A block is queued when its store commits (its host copy became readable) and the tier lacks it.
A write-behind job goes out only when nothing else is queued for the workers and no load or
store is in flight, so it never stalls a load or a step; a block that has waited `lag_s` is
written even while the workers are busy (the lag is the guarantee a `kill -9` relies on); always
within the rate (blocks/s), one job per writer at a time. The job is a SpillJob body (host slot
-> tier) with the host copy kept: the block is pinned while its write is in flight (readable from
host, never evicted or its slot reused) and unpinned when the write commits. `drain=True`
ignores idleness and the rate (shutdown flush, bounded by the caller's deadline).

Parameters:
- `admit`: the admission check (`min_hits`) made when the write is handed out; a block seen too
  rarely is left to the eviction path (the spill tier's writer).
- `links`: the chain links the tier's manifests need (the object tier): each job carries its
  blocks' parents and the links up to their roots, ancestors go before descendants.
- `stage_from`: a block evicted from host before its turn is uploaded from this tier (host ->
  SSD -> object). The job is then a host-only LoadJob first (SSD -> staging slots taken from the
  free host slots only, never by evicting, never promoted: the block stays off the host tier),
  and on its result the upload, after which the staging slots are given back. A block whose
  spill is still in flight waits for its next turn; one in no tier is not written
  (`<stat>_lost_blocks`).
- `makes_room`: the index decides the tier's evictions (its capacity is authoritative), so each
  job first deletes what the index chose to make room for its writes.
- `hints`: the tier is shared (the bucket, collected by others): what the index learns there is
  a hint, capped (tiers/object/hints.py); a load that finds the copy gone fails that block
  (recomputed) and the bit is cleared.

Every method runs under the manager's lock.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from typing import TypeVar

from flexkv_py.coordinator.chain_links import ChainLinks
from flexkv_py.coordinator.host_space import HostSpace
from flexkv_py.coordinator.jobs import NO_DROPS, Job, JobResult, LoadJob, SpillJob, read_into_host
from flexkv_py.coordinator.kv_events import EventQueue
from flexkv_py.coordinator.legs import Blocks, write_out
from flexkv_py.coordinator.lost_copies import forget_lost_copy
from flexkv_py.coordinator.outbox import Outbox
from flexkv_py.coordinator.write_behind_queue import WriteBehindQueue
from flexkv_py.index.entry import TIER_BIT
from flexkv_py.index.tier_index import TierIndex
from flexkv_py.index.tier_names import Tier
from flexkv_py.tiers.object.hints import ObjectHints

# Most blocks in one write-behind job: small jobs keep each one short behind a load.
MAX_JOB_BLOCKS = 256
WriterJob = TypeVar("WriterJob", SpillJob, LoadJob)


class TierWriter:
    def __init__(
        self,
        tier: Tier,
        queue: WriteBehindQueue,
        *,
        stat: str,
        index: TierIndex,
        host: HostSpace,
        outbox: Outbox,
        events: EventQueue,
        stats: Counter[str],
        admit: Callable[[int], bool] | None = None,
        links: ChainLinks | None = None,
        stage_from: Tier | None = None,
        makes_room: bool = False,
        hints: ObjectHints | None = None,
    ) -> None:
        self.tier = tier
        self.queue = queue
        self._stat = stat  # counters: <stat>_blocks, <stat>_failed_blocks, ...
        self._index = index
        self._host = host
        self._outbox = outbox
        self._events = events
        self._stats = stats
        self._admit = admit
        self.links = links
        self._stage_from = stage_from
        self._makes_room = makes_room
        self.hints = hints
        self._job: Job | None = None  # in flight (one at a time)
        self._waiting = 0  # host blocks waiting for the staging read in flight

    # ------------------------------------------------------------------ queue
    def queue_lacking(self, keys: Iterable[bytes]) -> None:
        """Blocks whose host copy just became readable: those the tier lacks are owed to it."""
        queue = self.queue
        for key in self._index.lacking_on(keys, self.tier):  # one lock for the batch
            queue.add(key)

    def pending(self) -> int:
        """Blocks still owed to the tier (queued, waiting for a staging read, being written)."""
        flying = len(self._job.keys) if self._job is not None else 0
        return len(self.queue) + self._waiting + flying

    def in_flight(self) -> bool:
        return self._job is not None

    def clear(self) -> None:
        """A reset: nothing is owed any more (jobs in flight complete as usual)."""
        self.queue.clear()
        if self.hints is not None:
            self.hints.clear()

    # ------------------------------------------------------------------ jobs
    def take(self, *, drain: bool = False) -> SpillJob | LoadJob | None:
        """The next write-behind job (queued for `take_jobs`), or None: nothing owed, a job in
        flight, the workers busy with a younger backlog, or the rate spent. The job is the
        upload, or the staging read that comes before one (`stage_from`)."""
        queue = self.queue
        if self._job is not None:
            return None
        budget = self._budget(drain)
        if budget <= 0:
            return None
        keys: list[bytes] = []
        slots: list[int] = []
        off_host: list[bytes] = []
        # Keys that turn out to need nothing (gone, written) do not end the turn: the next ones
        # are looked at, each queued key at most once (a step: a few batches).
        looked, queued = 0, len(queue) if drain else min(len(queue), 8 * budget)
        while not keys and not off_host and looked < queued:
            batch = queue.take(min(budget, queued - looked))
            looked += len(batch)
            self._pick(batch, keys, slots, off_host)
        staged = self._staging_slots(off_host)
        if not keys and not staged:
            return None
        if not drain:
            queue.spend(len(keys) + len(staged))
        if staged:
            return self._staging_job(staged, keys, slots)
        return self._write_job(keys, slots)

    def _budget(self, drain: bool) -> int:
        """Blocks the next job may take now: 0 when nothing is owed, or the workers are busy
        with a younger backlog, or the rate is spent."""
        queue = self.queue
        if not len(queue) or (not drain and self._outbox.busy() and not queue.overdue()):
            return 0
        # At most an eighth of the host tier pinned by one writer: eviction finds victims.
        most = max(1, min(MAX_JOB_BLOCKS, self._index.num_host_slots // 8))
        return most if drain else min(most, queue.budget())

    def _pick(
        self, batch: list[bytes], keys: list[bytes], slots: list[int], off_host: list[bytes]
    ) -> None:
        """Sort taken keys: host blocks to write (`keys`, `slots`: begun, pinned), blocks to
        stage from `stage_from` (`off_host`), back in the queue, or nothing to do."""
        index, queue, links, tier = self._index, self.queue, self.links, self.tier
        admit, hits = self._admit, index.hits
        for key in batch:
            if links is not None and links.parent_waits_in(key, queue):
                # Its parent is still owed: ancestors go first (a segment's manifest is
                # written only once its ancestors are stored), this one goes next time.
                queue.add(key)
                continue
            slot = index.host_slot_of(key)
            if slot is None:
                where = self._off_host(key)
                if where == "stage":
                    off_host.append(key)
                elif where == "later":
                    queue.add(key)
                elif not index.readable_on(key, tier):
                    self._stats[f"{self._stat}_lost_blocks"] += 1
                continue
            if admit is not None and not admit(hits(key)):
                continue  # seen too rarely: eviction decides
            if not index.begin_write(key, tier):
                continue  # there / on its way already
            index.pin([key])  # host copy kept readable, slot never reused
            keys.append(key)
            slots.append(slot)

    def _off_host(self, key: bytes) -> str:
        """Where a queued block whose host copy is gone is written from: "stage" (read from
        `stage_from`), "later" (its spill there is in flight) or "" (nowhere: not written)."""
        tier = self._stage_from
        if tier is None:
            return ""
        if self._index.readable_on(key, tier):
            return "stage"
        e = self._index.entry(key)
        if e is not None and not e.stale and (e.evicting or e.pending & TIER_BIT[tier]):
            return "later"
        return ""

    def _staging_slots(self, keys: list[bytes]) -> list[tuple[bytes, int]]:
        """Staging slots for blocks written from `stage_from` (free host slots only: a step
        never waits for them); those without one wait for a later turn."""
        if not keys:
            return []
        index = self._index
        got = index.allocate_slots(len(keys))
        out: list[tuple[bytes, int]] = []
        for key in keys:
            if len(out) == len(got):
                self.queue.add(key)  # no free slot now
            elif index.begin_write(key, self.tier):
                index.pin([key])  # its lower copy stays put (a warm, pinned entry)
                out.append((key, got[len(out)]))
        index.release_slots(got[len(out) :])
        if out:
            self._host.keep_reserve()  # evictions in the background refill the free reserve
        return out

    def _staging_job(
        self, staged: list[tuple[bytes, int]], keys: list[bytes], slots: list[int]
    ) -> LoadJob:
        """`stage_from` -> staging slots (host only); `keys`/`slots` (host blocks) are
        written with them once they are read."""
        tier = self._stage_from
        assert tier is not None
        job = read_into_host(
            self._outbox.new_id(), [k for k, _ in staged], [s for _, s in staged], tier
        )

        def staged_done(job: Job, result: JobResult) -> None:
            self._complete_staging(job, result, keys, slots)

        self._waiting = len(keys)
        return self._send(job, staged_done)

    def _write_job(
        self, keys: list[bytes], slots: list[int], staging: frozenset[bytes] = frozenset()
    ) -> SpillJob:
        """Host slots -> the tier (root first, with the chain links, when the tier keeps
        chains); `staging`: blocks in staging slots, given back when the write ends."""
        links = self.links
        if links is None:
            job = SpillJob(
                self._outbox.new_id(),
                write_out(Blocks(tuple(keys)), slots, self.tier),
                drop_first=self._host.take_drops() if self._makes_room else NO_DROPS,
            )
        else:
            keys, slots = links.root_first(keys, slots)
            blocks = Blocks(
                tuple(keys),
                tuple(links.parent(k) for k in keys),
                # Metadata the bucket does not keep; present, so the connector's fill-in from
                # what it remembers (block_meta.with_block_metas) keeps these parents.
                (None,) * len(keys),
            )
            job = SpillJob(
                self._outbox.new_id(),
                write_out(blocks, slots, self.tier),
                chain_links=tuple(links.ancestors(keys)),
                drop_first=self._host.take_drops() if self._makes_room else NO_DROPS,
            )
        at = dict(zip(keys, slots, strict=True)) if staging else {}
        staging_slots = [at[k] for k in staging]

        def written(job: Job, result: JobResult) -> None:
            self._complete_write(job, result, staging_slots, staging)

        return self._send(job, written)

    def _send(self, job: WriterJob, done: Callable[[Job, JobResult], None]) -> WriterJob:
        self._job = job
        self._outbox.track(job, done, background=True)
        return job

    # ------------------------------------------------------------------ results
    def _complete_staging(
        self, job: Job, result: JobResult, keys: list[bytes], slots: list[int]
    ) -> None:
        """A staging read ended: what it read is written (with the host blocks waiting for
        it); a block it could not read fails its write, a lost lower copy is forgotten."""
        assert isinstance(job, LoadJob)
        self._job, self._waiting = None, 0
        index = self._index
        staged: list[bytes] = []
        tier = job.reads[0].tier if job.reads else None
        for key, slot in zip(job.keys, job.host.slots, strict=True):
            reason = result.failed.get(key)
            if reason is None:
                staged.append(key)
                keys.append(key)
                slots.append(slot)
                continue
            index.commit_write(key, self.tier, False)
            index.unpin([key])
            index.release_slots([slot])
            self._stats[f"{self._stat}_stage_failed_blocks"] += 1
            if tier is not None:
                forget_lost_copy(index, self._events, self._stats, key, tier, reason)
        if keys:
            self._write_job(keys, slots, frozenset(staged))

    def _complete_write(
        self, job: Job, result: JobResult, staging_slots: list[int], staged: frozenset[bytes]
    ) -> None:
        """The blocks (host copies pinned while written) reached the tier, or not: commit,
        unpin, count, announce; staging slots go back."""
        assert isinstance(job, SpillJob)
        self._job = None
        index, failed, stat = self._index, result.failed, self._stat
        for key in job.keys:
            ok = key not in failed
            index.commit_write(key, job.tier, ok)
            index.unpin([key])
            if ok:
                self._stats[f"{stat}_blocks"] += 1
                if index.readable_on(key, job.tier):  # not reset while it was written
                    self._events.add("stored", (key,), job.tier)
            else:
                self._stats[f"{stat}_failed_blocks"] += 1
        self.learned(k for k in job.keys if k not in failed)
        if staging_slots or staged:
            index.release_slots(staging_slots)
            done = sum(k not in failed for k in staged)
            assert self._stage_from is not None
            self._stats[f"{stat}_from_{self._stage_from.value}_blocks"] += done

    def learned(self, keys: Iterable[bytes]) -> None:
        """`keys` are marked present on the tier now: past the hint cap the oldest hints are
        forgotten here (still in the tier). Nothing to do for a tier that is not shared."""
        if self.hints is None:
            return
        forget = self.hints.learned(keys)
        if forget:
            self._index.set_present(forget, self.tier, False)
            self._stats[f"{self.tier.value}_hints_forgotten"] += len(forget)
