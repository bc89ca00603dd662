"""Store planning: which blocks of a request get fresh host slots, and which lower tiers they are
copied to at store time (write-through, per the admission policy); applying the store's result.
Keys already cached or in flight are skipped.

A store of more blocks than the host slots it can get streams through them when a spill tier
exists (the host tier is then a staging area): one job copies the first n blocks GPU -> host,
writes them to the spill tier, refills the same slots with the next n, and so on
(planning.store_rounds); only the last n - 1 keep a host copy, one slot is left free for loads
to stage through. The GPU blocks are read until the last round's copy ends, and the job reports
its GPU read done right then: a finished request's blocks stay allocated (vLLM's delay-free,
request_finished -> finished_sending) exactly until that, not until its SSD writes are done.
Without a spill tier, when every slot is pinned, or for a host-only store (its `fill` writes
every slot at once), the store is cut at the end instead (the earliest blocks of a prefix are
the valuable ones).

A store's keys form a chain (vLLM stores a request's consecutive blocks): key i's parent is key
i-1 unless `parents` says otherwise. The index keeps a parent while its child is cached
(prefix-aware eviction, index/index_core.py), so making room for a block never evicts its own
parent, and a block whose parent is in no tier is not stored (no prefix match could reach it)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from flexkv_py.coordinator.chain_links import ChainLinks
from flexkv_py.coordinator.drain_admitted import DrainAdmitted
from flexkv_py.coordinator.host_space import HostSpace, spill_of
from flexkv_py.coordinator.jobs import Job, JobResult, StoreJob, store_job
from flexkv_py.coordinator.kv_events import EventQueue
from flexkv_py.coordinator.legs import Blocks
from flexkv_py.coordinator.outbox import Outbox
from flexkv_py.coordinator.tier_writer import TierWriter
from flexkv_py.index.entry import Victim
from flexkv_py.index.policies import AdmissionPolicy
from flexkv_py.index.tier_index import TierIndex
from flexkv_py.index.tier_names import Tier


class StorePlanner:
    """Every method runs under the manager's lock."""

    def __init__(
        self,
        index: TierIndex,
        admission: AdmissionPolicy,
        host: HostSpace,
        writers: Sequence[TierWriter],
        drain: DrainAdmitted,
        outbox: Outbox,
        events: EventQueue,
        stats: Counter[str],
        *,
        links: ChainLinks | None,
        object_write_through: bool,
    ) -> None:
        self._index = index
        self._admission = admission
        self._host = host
        self._spill_tier = host.spill_tier
        self._writers = tuple(writers)  # write-behind, in order: each queues what it lacks
        self._object = next((w for w in writers if w.tier is Tier.OBJECT), None)
        self._drain = drain
        self._outbox = outbox
        self._events = events
        self._stats = stats
        self._links = links  # None: no tier keeps chains (no object tier)
        self._object_write_through = object_write_through

    def prepare_store(
        self,
        keys: Sequence[bytes],
        gpu_block_ids: Sequence[int] | None,
        *,
        parents: Sequence[bytes | None] | None = None,
    ) -> StoreJob | None:
        """A job copying the not-yet-cached blocks into fresh host slots (and, write-through, to
        the spill tier). Keys already cached or in flight are skipped; None when nothing is left
        to do. `parents[i]`: key i's chain parent (None: a chain's first block); default: key
        i-1 (the first key has none)."""
        if gpu_block_ids is not None and len(gpu_block_ids) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(gpu_block_ids)} GPU block ids")
        if parents is None:
            parents = [None, *keys[:-1]]
        elif len(parents) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(parents)} parents")
        todo, seen = self._store_todo(keys, parents)
        # Parents outside this job are pinned while slots are taken: never their victims.
        outside = list({p: 0 for i in todo if (p := parents[i]) is not None and p not in seen})
        self._index.pin(outside)
        chained: list[Victim] = []
        slots = self._host.take_slots(len(todo), chained) if todo else []
        passing = 0  # leading blocks streamed through reused slots (no host copy kept)
        if len(slots) < len(todo):
            if gpu_block_ids is not None:
                passing = self._stream_through(
                    [keys[i] for i in todo], len(slots), [parents[i] for i in todo]
                )
            kept = min(len(todo), passing + len(slots))
            self._stats["store_skipped_no_slot"] += len(todo) - kept
            todo = todo[:kept]
        job = None
        # Block j uses slot j mod n: round r (planning.store_rounds) refills the slots once
        # round r-1 reached the lower tier; the blocks after the streamed ones keep theirs.
        if len(slots) == len(todo):
            host_slots = slots  # the common case: one slot per block
        else:
            host_slots = [slots[j % len(slots)] for j in range(len(todo))] if todo else []
        whole = len(todo) == len(keys)  # every block (the common case): no per-block pick
        todo_keys = list(keys) if whole else [keys[i] for i in todo]
        todo_parents = tuple(parents) if whole else tuple(parents[i] for i in todo)
        if todo:
            self._index.begin_host_fills(
                todo_keys[passing:], host_slots[passing:], parents=todo_parents[passing:]
            )
            self._drain.note(todo_keys[passing:], stored=True)
        self._index.unpin(outside)
        if todo:
            tier = self._spill_tier
            if self._links is not None:  # the object tier's manifests need the chain
                self._links.remember(todo_keys, todo_parents)
            write_tiers: tuple[tuple[Tier, ...], ...] | None = None
            if passing or self._writes_at_store():
                write_tiers = tuple(
                    self._streamed_tiers(key)
                    if j < passing and tier is not None
                    else self._write_tiers(key)
                    for j, key in enumerate(todo_keys)
                )
            # (else nothing is copied at store time (write-back): no per-block ask)
            job = store_job(
                self._outbox.new_id(),
                Blocks(tuple(todo_keys), todo_parents if self._links is not None else ()),
                (
                    None
                    if gpu_block_ids is None
                    else tuple(gpu_block_ids)
                    if whole
                    else tuple(gpu_block_ids[i] for i in todo)
                ),
                host_slots,
                write_tiers,
                spill=spill_of(chained, self._spill_tier),
                streamed=passing,
                drop_first=self._host.take_drops(),  # after write_tiers: room for its writes
            )
            self._stats["store_streamed_blocks"] += passing
            self._outbox.track(job, self._complete)
        self._host.keep_reserve()
        return job

    def _store_todo(
        self, keys: Sequence[bytes], parents: Sequence[bytes | None]
    ) -> tuple[list[int], set[bytes]]:
        """Positions of the keys to store (lock held): not cached, not repeated, and with a
        parent in some tier or earlier in the batch (else no prefix match reaches them); and
        the set of their keys. A chain of new distinct keys is checked in a few C-level
        passes; only its first parent is asked about."""
        cached = self._index.known_many(keys)  # one lock for the batch, not one per block
        n, known = len(keys), self._index.known
        if not any(cached) and list(parents[1:]) == list(keys[:-1]):
            seen = set(keys)
            first = parents[0] if n else None
            if len(seen) == n and (first is None or known(first)):
                return list(range(n)), seen
        todo: list[int] = []
        seen = set()
        for i, key in enumerate(keys):
            if cached[i] or key in seen:
                self._stats["store_skipped_cached"] += 1
                continue
            parent = parents[i]
            if parent is not None and parent not in seen and not known(parent):
                self._stats["store_skipped_orphan"] += 1  # unreachable by a prefix match
                continue
            seen.add(key)
            todo.append(i)
        return todo, seen

    def _stream_through(
        self, keys: Sequence[bytes], free: int, parents: Sequence[bytes | None]
    ) -> int:
        """A store of more blocks than the `free` slots it got: how many leading blocks pass
        through the slots to the spill tier (and keep no host copy). All but the last
        `free - 1` do: one slot is left free for the loads of this prefix to stage its SSD
        blocks through (they pin every host block they read). Each must be admitted there; at
        the first that is not, streaming stops and the next `free` blocks stay in host (the
        later ones would be orphans of a prefix match). Marks their writes pending."""
        tier = self._spill_tier
        if tier is None or free < 1:
            return 0
        hits, admit = self._index.hits, self._admission.admit_on_evict
        n = 0
        for key in keys[: len(keys) - free + 1]:
            if not admit(hits(key) + 1):  # +1: this store is an access
                break
            n += 1
        return self._index.begin_pass_through(keys[:n], tier, parents[:n])

    def _writes_at_store(self) -> bool:
        """May `_write_tiers` name any tier (write-through to the spill or object tier)?"""
        return (
            self._spill_tier is not None and self._admission.write_through
        ) or self._object_write_through

    def _write_tiers(self, key: bytes) -> tuple[Tier, ...]:
        """The lower tiers a fresh block is copied to at store time (marks the writes pending)."""
        tier = self._spill_tier
        out: tuple[Tier, ...] = ()
        if (
            tier is not None
            and self._admission.admit_on_store(self._index.hits(key))
            and self._index.begin_write(key, tier)
        ):
            out = (tier,)
        if self._object_write_through and self._begin_object_write(key):
            out += (Tier.OBJECT,)
        return out

    def _streamed_tiers(self, key: bytes) -> tuple[Tier, ...]:
        """A streamed block keeps no host copy for the object write-behind to read: it goes to
        the object tier in the same round as to the spill tier (its write already pending)."""
        assert self._spill_tier is not None
        return (
            (self._spill_tier, Tier.OBJECT)
            if self._begin_object_write(key)
            else (self._spill_tier,)
        )

    def _begin_object_write(self, key: bytes) -> bool:
        return self._object is not None and self._index.begin_write(key, Tier.OBJECT)

    def _complete(self, job: Job, result: JobResult) -> None:
        assert isinstance(job, StoreJob)
        self._host.complete_chained(job, result)
        failed = result.failed
        for write in job.writes:  # none for a write-back store
            tier = write.tier
            assert tier is not None  # a write's destination is a lower tier (StoreJob checks)
            tier_failed = result.write_failed_on(tier)
            for key in write.keys:
                ok = key not in failed and key not in tier_failed
                self._index.commit_write(key, tier, ok)
                if ok:
                    if tier is Tier.OBJECT:
                        assert self._object is not None
                        self._object.learned([key])  # capped hints (tier_writer.py)
                    self._stats[f"{tier.value}_written_blocks"] += 1
                    if self._index.readable_on(key, tier):  # not reset while it was written
                        self._events.add("stored", (key,), tier)
                else:
                    self._stats[f"{tier.value}_write_failed_blocks"] += 1
        oks = [key not in failed for key in job.keys] if failed else [True] * len(job.keys)
        # Streamed blocks have no host copy (their lower-tier write above was all of them);
        # a slot only they used is free again.
        n = job.streamed
        if n:
            self._index.release_slots(set(job.host_slots[:n]) - set(job.host_slots[n:]))
        # Announced: the blocks readable now (not those reset while they were stored).
        readable = self._index.commit_host_fills(job.keys[n:], oks[n:])
        self._events.add("stored", readable, Tier.HOST)
        for writer in self._writers:
            writer.queue_lacking(readable)
        num_ok = sum(oks)
        self._stats["stored_blocks"] += num_ok
        self._stats["store_failed_blocks"] += len(job.keys) - num_ok
