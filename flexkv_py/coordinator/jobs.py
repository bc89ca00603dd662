"""Jobs (manager -> executor) and their results (executor -> manager): plain picklable data.

The manager decides everything (which slot, which blocks go to which lower tier); a job only says
what to move. A job is a purpose (`kind`) plus legs (legs.py): a load's reads, a spill, a
`LegJob`'s legs, and deletes: every job's `drop_first` is a `Drops`, and a `DropJob` is one plus
a reset's namespace wipe; the keyed deletes of a `Drops` are legs from a lower tier to `Gone`,
beside the cold blocks it names by fingerprint (no leg can name those). Tiers are named with `Tier`
(flexkv_py.index.tier_names) everywhere: a job names the tier it writes to or reads from, so a
second lower tier (the object store) passes through the same jobs.
With TP > 1 the same job goes to every rank's executor and the per-rank results are merged with
`JobResult.merge` before the manager sees them.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from flexkv_py.coordinator.legs import NO_SPILL, Blocks, Gone, Gpu, Host, Leg, OnTier, deletion
from flexkv_py.index.tier_names import Tier, lower_in_order

JobKind = Literal["store", "load", "spill", "drop", "move"]

# One status vocabulary, from the lower tier's per-block status to JobResult.failed and on to
# BlockOutcome.statuses: every string a block can carry is defined here, once.
OK = "ok"  # BlockOutcome: the block arrived
CACHED = "cached"  # BlockOutcome (store): already cached, or being stored by another job

# Per-block failure reasons in JobResult.failed (and BlockOutcome.statuses).
NOT_FOUND = "not_found"  # lower tier: key unknown (evicted, deleted, never written on this rank)
CORRUPT = "corrupt"  # lower tier: checksum/header mismatch, data discarded
IO_ERROR = "io_error"  # lower tier device error (EIO, ENOSPC, short I/O)
IO_TIMEOUT = "io_timeout"  # lower-tier I/O not done within its timeout (or its slot still is)
NO_SPACE = "no_space"  # lower-tier put refused: larger than its budget / everything else pinned
REJECTED = "rejected"  # lower-tier put refused: a read-only tier, a key the tier cannot take
TRANSFER_ERROR = "transfer_error"  # GPU<->host copy failed
NO_SLOT = "no_slot"  # manager: no host slot free to stage the block
MISSING = "missing"  # manager: block no longer in any tier when the load was prepared
INTERNAL = "internal_error"  # executor bug or unexpected exception; block not trusted

# A lower tier's per-block status (the native store's BlockStatus, tiers/protocol.py) -> the
# failure reason above; None: the block made it. The one table between the two vocabularies.
STATUS_REASON: dict[str, str | None] = {
    "ok": None,
    "deduped": None,  # put: identical content already stored
    "not_found": NOT_FOUND,
    "corrupt": CORRUPT,
    "io_error": IO_ERROR,
    "rejected": REJECTED,  # refused by the tier (read-only shard, bad key), not a lack of room
    "no_space": NO_SPACE,
    "bad_buffer": INTERNAL,  # our buffer was too small / read-only: an executor bug
}


def reason_for_status(status: str) -> str | None:
    """The failure reason for a lower tier's block status (None: ok); unknown ones are ours."""
    return STATUS_REASON.get(status, INTERNAL)


# Per-block write-through tiers of `store_job`: the two a store uses today.
WRITE_SSD: tuple[Tier, ...] = (Tier.SSD,)
WRITE_NONE: tuple[Tier, ...] = ()


def _check_tier_legs(
    job: str, blocks: Blocks, gpu: Gpu | None, host: Host, legs: Sequence[Leg], what: str
) -> None:
    """A store's or load's columns are as long as its blocks, and its legs between host slots
    and lower tiers (`what`: "write", host -> tier; "read", tier -> host) one per tier."""
    n = len(blocks)
    if len(host.slots) != n or (gpu is not None and len(gpu.ids) != n):
        raise ValueError(f"{job}: its host slots or GPU ids are not {n} long")
    kinds = (Host, OnTier) if what == "write" else (OnTier, Host)
    tiers = [leg.tier for leg in legs]
    if any(leg.kinds != kinds for leg in legs) or Tier.HOST in tiers:
        way = "host slots -> lower tier" if what == "write" else "lower tier -> host slots"
        raise ValueError(f"{job}: a {what} is not {way}")
    if len(set(tiers)) != len(tiers):
        raise ValueError(f"{job}: two {what}s {'to' if what == 'write' else 'from'} one tier")


def _without_cached(state: dict[str, object]) -> dict[str, object]:
    """A job's pickled state: its fields, not the positions it worked out (`cached_property`s
    in its __dict__): the receiver works them out again, the metadata stays small."""
    return {k: v for k, v in state.items() if k not in ("read_positions", "write_positions")}


def _positions(
    job_id: int, what: str, keys: Sequence[bytes], slots: Sequence[int], legs: Sequence[Leg]
) -> list[list[int]]:
    """Per leg, the positions of its blocks among a job's (`keys` in their `slots`): each leg's
    blocks are in job order, so one walk per leg matching key and slot finds them, and a
    repeated key (or a reused slot) cannot be mistaken."""
    n = len(keys)
    out = []
    for leg in legs:
        at: list[int] = []
        i = 0
        host = leg.dst if isinstance(leg.dst, Host) else leg.src
        if leg.blocks.keys is keys and host.places() is slots:  # built from the job's own
            out.append(list(range(n)))  # columns (every block takes this leg): no walk
            continue
        for key, slot in zip(leg.keys, host.places() or (), strict=True):
            while i < n and (keys[i] != key or slots[i] != slot):
                i += 1
            if i == n:
                raise ValueError(
                    f"job {job_id}: its {what} {leg.tier} has a block that is not one of its "
                    "blocks in that slot, or not in the job's order"
                )
            at.append(i)
            i += 1
        out.append(at)
    return out


@dataclass(frozen=True)
class Drops:
    """Lower-tier deletes: a DropJob's, or a job's `drop_first` (room the index made for its
    writes, deleted before any of them). Blocks the scheduler knows by key are `legs`, one
    deletion leg (lower tier -> `Gone`, legs.py) per tier, run through the executor's handlers.
    Cold blocks it knows only by fingerprint are `prints`: per tier, joined 8-byte
    `BlockSet.digest`s of logical keys; the worker's store resolves them to its keys and the
    job's result names what it deleted (`JobResult.dropped`)."""

    legs: tuple[Leg, ...] = ()
    prints: dict[Tier, bytes] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if any(leg.kinds != (OnTier, Gone) for leg in self.legs):
            raise ValueError("Drops: a keyed delete is not a lower tier -> Gone leg")
        tiers = [leg.tier for leg in self.legs]
        if len(set(tiers)) != len(tiers):
            raise ValueError("Drops: two keyed deletes on one tier")

    @classmethod
    def of(
        cls,
        keys: Mapping[Tier, Sequence[bytes]] | None = None,
        prints: Mapping[Tier, bytes] | None = None,
    ) -> Drops:
        """The deletes of `keys` and `prints` per tier (a tier with no keys gets no leg)."""
        legs = tuple(deletion(k, tier) for tier, k in (keys or {}).items() if k)
        return cls(legs, dict(prints or {}))

    def __bool__(self) -> bool:
        return any(leg.keys for leg in self.legs) or any(self.prints.values())

    def keys_on(self, tier: Tier) -> tuple[bytes, ...]:
        return next((leg.keys for leg in self.legs if leg.tier is tier), ())

    def prints_on(self, tier: Tier) -> bytes:
        return self.prints.get(tier, b"")


NO_DROPS = Drops()


@dataclass(frozen=True)
class StoreJob:
    """Blocks into host slots, as legs run in order: `spill` (evicted blocks whose slots this
    job reuses, written from those slots to their lower tier first); GPU -> host, the leg
    (`blocks`, `gpu`, `host`); then each of `writes`, host slots -> a lower tier (write-through:
    one leg per tier, a subset of `blocks` in their order, from their `host` slots).

    `gpu` None: the caller already filled the slots (host-only path)."""

    job_id: int
    # The blocks, with the chain parent and opaque metadata the SSD keeps with each (token ids,
    # extra keys; see integration/vllm/block_meta.py).
    blocks: Blocks
    gpu: Gpu | None
    host: Host
    writes: tuple[Leg, ...] = ()  # per lower tier: Host -> OnTier, tiers in the order written
    kind: JobKind = "store"
    spill: Leg = NO_SPILL
    # The first `streamed` blocks pass through reused host slots to their lower tier and keep
    # no host copy (a store larger than the free slots, coordinator/stores.py).
    streamed: int = 0
    # Deletes the index chose to make room on lower tiers, done before any write of this job.
    drop_first: Drops = NO_DROPS

    def __post_init__(self) -> None:
        _check_tier_legs(
            f"StoreJob {self.job_id}", self.blocks, self.gpu, self.host, self.writes, "write"
        )
        if self.writes:  # write-through: the check below is a pass over the written blocks
            self.write_positions  # noqa: B018  (raises if a write is not the job's blocks)

    @property
    def keys(self) -> tuple[bytes, ...]:
        return self.blocks.keys

    @property
    def gpu_block_ids(self) -> tuple[int, ...] | None:
        return None if self.gpu is None else self.gpu.ids

    @property
    def host_slots(self) -> tuple[int, ...]:
        return self.host.slots

    @functools.cached_property
    def write_positions(self) -> list[list[int]]:
        """Per leg of `writes`, the positions of its blocks in `blocks`."""
        return _positions(self.job_id, "write to", self.keys, self.host.slots, self.writes)

    def __getstate__(self) -> dict[str, object]:
        return _without_cached(self.__dict__)

    def with_blocks(self, blocks: Blocks) -> StoreJob:
        """The job with `blocks` (the same keys with parents and metas filled in, as the
        scheduler side does before a step's jobs go out): its write legs carry them too."""
        if blocks.keys != self.keys:
            raise ValueError(f"StoreJob {self.job_id}: with_blocks needs the job's own keys")
        writes = tuple(
            Leg(blocks.take(at) if len(at) < len(blocks) else blocks, leg.src, leg.dst)
            for leg, at in zip(self.writes, self.write_positions, strict=True)
        )
        return dataclasses.replace(self, blocks=blocks, writes=writes)

    def writes_to(self, tier: Tier) -> list[int]:
        """Positions of the blocks this job copies to `tier` after the host copy."""
        for leg, at in zip(self.writes, self.write_positions, strict=True):
            if leg.tier is tier:
                return at
        return []

    def take(self, positions: Sequence[int]) -> StoreJob:
        """The part of the job that moves the blocks at `positions` (ascending) only."""
        kept = set(positions)
        writes = []
        for leg, at in zip(self.writes, self.write_positions, strict=True):
            mine = [j for j, i in enumerate(at) if i in kept]
            if mine:
                writes.append(leg.take(mine))
        return dataclasses.replace(
            self,
            blocks=self.blocks.take(positions),
            gpu=None if self.gpu is None else self.gpu.take(positions),
            host=self.host.take(positions),
            writes=tuple(writes),
            streamed=sum(1 for i in positions if i < self.streamed),
        )


def store_job(
    job_id: int,
    blocks: Blocks,
    gpu_block_ids: Sequence[int] | None,
    host_slots: Sequence[int],
    write_tiers: Sequence[tuple[Tier, ...]] | None = None,
    *,
    spill: Leg = NO_SPILL,
    streamed: int = 0,
    drop_first: Drops = NO_DROPS,
) -> StoreJob:
    """The StoreJob of blocks planned one by one: `write_tiers[i]` the lower tiers block i is
    written through to (None: none at all, write-back: no per-block pass)."""
    if write_tiers is not None and len(write_tiers) != len(blocks):
        raise ValueError(f"StoreJob {job_id}: {len(blocks)} blocks but {len(write_tiers)} tiers")
    by_tier: dict[Tier, Sequence[int]]
    planned = set(write_tiers or ())
    if len(planned) == 1:  # every block to the same tiers (write-through): one C-level pass
        by_tier = dict.fromkeys(planned.pop(), range(len(blocks)))
    else:
        picked: dict[Tier, list[int]] = {}
        for i, tiers in enumerate(write_tiers or ()):
            for tier in tiers:
                picked.setdefault(tier, []).append(i)
        by_tier = dict(picked)
    host = Host(tuple(host_slots))
    n = len(blocks)
    writes = tuple(
        Leg(blocks, host, OnTier(tier))  # every block: the job's own columns (no pass)
        if len(at) == n
        else Leg(blocks.take(at), Host(tuple(host.slots[i] for i in at)), OnTier(tier))
        for tier in lower_in_order(by_tier)
        for at in (by_tier[tier],)
    )
    return StoreJob(
        job_id,
        blocks,
        None if gpu_block_ids is None else Gpu(tuple(gpu_block_ids)),
        host,
        writes,
        spill=spill,
        streamed=streamed,
        drop_first=drop_first,
    )


@dataclass(frozen=True)
class LoadJob:
    """Blocks into this rank's GPU (or host memory only), as legs run in order: `spill` (as in
    StoreJob); each of `reads`, a lower tier -> host slots (one leg per tier, a subset of
    `blocks` in their order, landing in their `host` slots); then host -> GPU, the leg
    (`blocks`, `host`, `gpu`), every block but the `missing` ones. `gpu` None: a host-only
    load (the blocks end pinned in their `host` slots). A block neither missing nor read is
    in host memory already.

    Results are by key (and GPU block) as for any job: a missing block fails with MISSING."""

    job_id: int
    blocks: Blocks  # every block asked for, in the caller's order
    host: Host  # per block, its host slot: where it is or where its read lands (-1: missing)
    gpu: Gpu | None  # per block, its GPU block; None: host only
    reads: tuple[Leg, ...] = ()  # per lower tier: OnTier -> Host, tiers in the order read
    missing: tuple[int, ...] = ()  # positions of blocks in no tier (not loadable), ascending
    kind: JobKind = "load"
    spill: Leg = NO_SPILL  # as in StoreJob
    # Deletes the index chose to make room on lower tiers, done before any write of this job.
    drop_first: Drops = NO_DROPS

    def __post_init__(self) -> None:
        n = len(self.blocks)
        _check_tier_legs(
            f"LoadJob {self.job_id}", self.blocks, self.gpu, self.host, self.reads, "read"
        )
        if self.missing and not 0 <= self.missing[0] <= self.missing[-1] < n:
            raise ValueError(f"LoadJob {self.job_id}: missing positions outside its {n} blocks")
        if self.reads:  # not the common all-in-host load: a pass over its blocks is fine
            taken = sum(len(leg.blocks) for leg in self.reads) + len(self.missing)
            if len(set(self.missing).union(*self.read_positions)) != taken:
                raise ValueError(f"LoadJob {self.job_id}: a block is both read and missing")

    @property
    def keys(self) -> tuple[bytes, ...]:
        return self.blocks.keys

    @property
    def gpu_block_ids(self) -> tuple[int, ...] | None:
        return None if self.gpu is None else self.gpu.ids

    @property
    def all_from_host(self) -> bool:
        """Every block is in host memory already: nothing to read, nothing missing."""
        return not self.reads and not self.missing

    @functools.cached_property
    def read_positions(self) -> list[list[int]]:
        """Per leg of `reads`, the positions of its blocks in `blocks`. Worked out once, by the
        check at construction, for the load body and `sources`."""
        return _positions(self.job_id, "read from", self.keys, self.host.slots, self.reads)

    def __getstate__(self) -> dict[str, object]:
        return _without_cached(self.__dict__)

    @property
    def sources(self) -> tuple[Tier | None, ...]:
        """Per block: Tier.HOST, the lower tier it is read from, or None (missing)."""
        n = len(self.blocks)
        if self.all_from_host:
            return (Tier.HOST,) * n
        out: list[Tier | None] = [Tier.HOST] * n
        for i in self.missing:
            out[i] = None
        for leg, positions in zip(self.reads, self.read_positions, strict=True):
            for i in positions:
                out[i] = leg.tier
        return tuple(out)


def load_job(
    job_id: int,
    keys: Sequence[bytes],
    gpu_block_ids: Sequence[int] | None,
    slots: Sequence[int],
    sources: Sequence[Tier | None] | None,
    *,
    spill: Leg = NO_SPILL,
    drop_first: Drops = NO_DROPS,
) -> LoadJob:
    """The LoadJob of blocks planned one by one: `sources[i]` Tier.HOST (in `slots[i]`), a lower
    tier (read into `slots[i]`) or None (missing, slot -1); `sources` None: all in host memory
    (the common case: no per-block pass)."""
    blocks = Blocks(tuple(keys))
    by_tier: dict[Tier, list[int]] = {}
    missing: list[int] = []
    for i, src in enumerate(sources or ()):
        if src is None:
            missing.append(i)
        elif src is not Tier.HOST:
            by_tier.setdefault(src, []).append(i)
    reads = tuple(
        Leg(blocks.take(by_tier[t]), OnTier(t), Host(tuple(slots[i] for i in by_tier[t])))
        for t in lower_in_order(by_tier)  # fastest first, as the executor reads them
    )
    return LoadJob(
        job_id,
        blocks,
        Host(tuple(slots)),
        None if gpu_block_ids is None else Gpu(tuple(gpu_block_ids)),
        reads,
        tuple(missing),
        spill=spill,
        drop_first=drop_first,
    )


def read_into_host(job_id: int, keys: Sequence[bytes], slots: Sequence[int], tier: Tier) -> LoadJob:
    """A host-only load reading every block from one lower `tier` into its slot (a write-behind's
    staging read, an object prefetch)."""
    blocks, into = Blocks(tuple(keys)), Host(tuple(slots))
    return LoadJob(job_id, blocks, into, None, (Leg(blocks, OnTier(tier), into),))


@dataclass(frozen=True)
class SpillJob:
    """Blocks leaving the host tier (write-back): one leg, host slots -> a lower tier."""

    job_id: int
    leg: Leg
    kind: JobKind = "spill"
    gpu_block_ids: None = None
    # (key, parent) links of the blocks' ancestors outside the job: the object tier needs a
    # block's whole chain to write its manifests (coordinator/write_behind_object.py).
    chain_links: tuple[tuple[bytes, bytes | None], ...] = ()
    # Deletes the index chose to make room on lower tiers, done before any write of this job.
    drop_first: Drops = NO_DROPS

    def __post_init__(self) -> None:
        if not isinstance(self.leg.src, Host) or not isinstance(self.leg.dst, OnTier):
            raise ValueError("a spill writes host slots to a lower tier")

    @property
    def keys(self) -> tuple[bytes, ...]:
        return self.leg.keys

    @property
    def host_slots(self) -> tuple[int, ...]:
        return self.leg.src.places() or ()

    @property
    def tier(self) -> Tier:
        return self.leg.tier or Tier.SSD


@dataclass(frozen=True)
class DropJob:
    """Delete blocks from lower tiers (a reset, copies written after a reset, orphans,
    evictions no write took): `drops`, its keyed deletes legs to `Gone` and its fingerprints,
    as a job's `drop_first`; then on each tier of `wipe_namespace_on` every block of this
    rank's namespace (a reset: the scheduler does not know its cold blocks' keys). The result's
    `dropped` names what the fingerprints and the namespace delete removed. The executor runs
    it inside `submit`, before any job submitted after it."""

    job_id: int
    drops: Drops
    wipe_namespace_on: tuple[Tier, ...] = ()
    kind: JobKind = "drop"
    gpu_block_ids: None = None

    @property
    def legs(self) -> tuple[Leg, ...]:
        return self.drops.legs

    @property
    def keys(self) -> tuple[bytes, ...]:
        """Every block deleted by key, once (a reset deletes the same keys on every tier)."""
        legs = self.drops.legs
        if not legs:
            return ()
        first = legs[0].keys
        if all(leg.keys == first for leg in legs[1:]):
            return first
        return tuple(dict.fromkeys(k for leg in legs for k in leg.keys))


@dataclass(frozen=True)
class LegJob:
    """A job that is only its legs, run in order on one job thread through the executor's
    handlers (leg_handlers.py): a block that failed in a leg is left out of the later ones. Any
    pair of media a handler is registered for can be moved so, with no new job class."""

    job_id: int
    legs: tuple[Leg, ...]
    kind: JobKind = "move"
    gpu_block_ids: None = None
    drop_first: Drops = NO_DROPS

    @property
    def keys(self) -> tuple[bytes, ...]:
        """Every block the job moves (in the order its legs first name them)."""
        return tuple(dict.fromkeys(k for leg in self.legs for k in leg.keys))


Job = StoreJob | LoadJob | SpillJob | DropJob | LegJob


def drops_first(job: Job) -> Drops:
    """The deletes to run before `job` (a drop job is deletes itself: none)."""
    return NO_DROPS if isinstance(job, DropJob) else job.drop_first


@dataclass(frozen=True)
class JobResult:
    """Outcome of one job on one rank (or merged over ranks).

    failed: key -> reason for blocks that did not arrive where the job put them (load: not in
        GPU; store: not in host; spill: not in its tier). Never a partial block.
    failed_gpu_block_ids: GPU blocks whose content is not valid after a load.
    write_failed: per tier, store write-through copies that were not made (the host copy is
        fine).
    evicted: per tier, logical keys that tier evicted for capacity while the job ran.
    dropped: per tier, logical keys the job deleted that the scheduler named by fingerprint or
        by namespace (`Drops.prints`, `DropJob.wipe_namespace_on`): it announces them.
    spill_failed: a job's `spill` keys that did not reach its tier (for SpillJob: `failed`).
    """

    job_id: int
    kind: JobKind
    failed: dict[bytes, str] = field(default_factory=dict)
    failed_gpu_block_ids: frozenset[int] = frozenset()
    write_failed: dict[Tier, frozenset[bytes]] = field(default_factory=dict)
    evicted: dict[Tier, tuple[bytes, ...]] = field(default_factory=dict)
    spill_failed: frozenset[bytes] = frozenset()
    nbytes: int = 0
    seconds: float = 0.0
    dropped: dict[Tier, tuple[bytes, ...]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.failed

    def write_failed_on(self, tier: Tier) -> frozenset[bytes]:
        return self.write_failed.get(tier, frozenset())

    def evicted_from(self, tier: Tier) -> tuple[bytes, ...]:
        return self.evicted.get(tier, ())

    @staticmethod
    def merge(results: Sequence[JobResult]) -> JobResult:
        """Combine the results of one job from every rank: a block failed anywhere failed."""
        if not results:
            raise ValueError("JobResult.merge needs at least one result")
        first = results[0]
        if any(r.job_id != first.job_id for r in results):
            raise ValueError("JobResult.merge: results of different jobs")
        failed: dict[bytes, str] = {}
        evicted: dict[Tier, dict[bytes, None]] = {}
        write_failed: dict[Tier, set[bytes]] = {}
        dropped: dict[Tier, dict[bytes, None]] = {}  # every rank resolves the same blocks
        for r in results:
            for tier, keys in r.dropped.items():
                dropped.setdefault(tier, {}).update(dict.fromkeys(keys))
            for k, reason in r.failed.items():
                failed.setdefault(k, reason)
            for tier, keys in r.evicted.items():
                evicted.setdefault(tier, {}).update(dict.fromkeys(keys))
            for tier, failed_keys in r.write_failed.items():
                write_failed.setdefault(tier, set()).update(failed_keys)
        return JobResult(
            job_id=first.job_id,
            kind=first.kind,
            failed=failed,
            failed_gpu_block_ids=frozenset().union(*(r.failed_gpu_block_ids for r in results)),
            write_failed={t: frozenset(k) for t, k in write_failed.items()},
            evicted={t: tuple(k) for t, k in evicted.items()},
            spill_failed=frozenset().union(*(r.spill_failed for r in results)),
            nbytes=sum(r.nbytes for r in results),
            seconds=max(r.seconds for r in results),
            dropped={t: tuple(k) for t, k in dropped.items()},
        )
