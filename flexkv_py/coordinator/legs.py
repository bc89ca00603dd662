"""Legs: what a job moves, from which medium to which: plain picklable data.

A leg moves one batch of blocks (`Blocks`: the keys with the chain parents and metadata a tier
keeps with them, columns aligned by construction) from a source medium to a destination medium.
The media are this rank's GPU KV cache (`Gpu`: one block id per block), host-pool slots (`Host`:
one slot per block), a lower tier (`OnTier`), and `Gone`: a leg from a lower tier to `Gone` is a
delete (`deletion`), so a drop is legs too (jobs.py `Drops`). The executor runs a leg through
the handler registered for its (source kind, destination kind) pair (leg_handlers.py): a new
path, such as GPU <-> SSD without a host slot, is a new handler, not a new job class.

A leg is one columnar batch, never one object per block: the load path is hot.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from flexkv_py.index.tier_names import Tier

# Per key: the chain parents and metadata of a lower-tier put (None: the batch carries none).
PutExtras = tuple[list[bytes | None], list[bytes | None]]


def _pick(column: tuple[bytes | None, ...], positions: Sequence[int]) -> tuple[bytes | None, ...]:
    return tuple(column[i] for i in positions) if column else ()


@dataclass(frozen=True)
class Blocks:
    """A batch of blocks: `keys`, and per key (or () for none) its chain parent and the opaque
    metadata a tier keeps with it (token ids, extra keys; see integration/vllm/block_meta.py)."""

    keys: tuple[bytes, ...]
    parents: tuple[bytes | None, ...] = ()
    metas: tuple[bytes | None, ...] = ()

    def __post_init__(self) -> None:
        n = len(self.keys)
        for name, column in (("parents", self.parents), ("metas", self.metas)):
            if column and len(column) != n:
                raise ValueError(f"Blocks: {n} keys but {len(column)} {name}")

    def __len__(self) -> int:
        return len(self.keys)

    def take(self, positions: Sequence[int]) -> Blocks:
        """The blocks at `positions`, their columns with them."""
        return Blocks(
            tuple(self.keys[i] for i in positions),
            _pick(self.parents, positions),
            _pick(self.metas, positions),
        )

    def extras(self) -> PutExtras | None:
        """The parents and metas of a put of these blocks, or None when they carry neither."""
        if not self.parents and not self.metas:
            return None
        none: list[bytes | None] = [None] * len(self.keys)
        return list(self.parents) or none, list(self.metas) or list(none)


NO_BLOCKS = Blocks(())


@dataclass(frozen=True)
class Gpu:
    """Blocks of this rank's GPU KV cache, by vLLM block id (one per block of the leg)."""

    ids: tuple[int, ...]

    def places(self) -> tuple[int, ...] | None:
        return self.ids

    def take(self, positions: Sequence[int]) -> Gpu:
        return Gpu(tuple(self.ids[i] for i in positions))


@dataclass(frozen=True)
class Host:
    """Host-pool slots (one per block of the leg)."""

    slots: tuple[int, ...]

    def places(self) -> tuple[int, ...] | None:
        return self.slots

    def take(self, positions: Sequence[int]) -> Host:
        return Host(tuple(self.slots[i] for i in positions))


@dataclass(frozen=True)
class OnTier:
    """A lower tier: blocks there are named by their keys alone."""

    tier: Tier

    def places(self) -> tuple[int, ...] | None:
        return None

    def take(self, positions: Sequence[int]) -> OnTier:
        return self


@dataclass(frozen=True)
class Gone:
    """Nowhere: blocks moved here leave their source (from a lower tier: deleted there)."""

    def places(self) -> tuple[int, ...] | None:
        return None

    def take(self, positions: Sequence[int]) -> Gone:
        return self


Medium = Gpu | Host | OnTier | Gone


@dataclass(frozen=True)
class Leg:
    """Move `blocks` from `src` to `dst`; a per-block medium lists one place per block."""

    blocks: Blocks
    src: Medium
    dst: Medium

    def __post_init__(self) -> None:
        for end, medium in (("source", self.src), ("destination", self.dst)):
            places = medium.places()
            if places is not None and len(places) != len(self.blocks):
                raise ValueError(
                    f"Leg: {len(self.blocks)} blocks but {len(places)} places in its {end} "
                    f"({type(medium).__name__})"
                )

    @property
    def keys(self) -> tuple[bytes, ...]:
        return self.blocks.keys

    def take(self, positions: Sequence[int]) -> Leg:
        """The leg for the blocks at `positions` only."""
        return Leg(self.blocks.take(positions), self.src.take(positions), self.dst.take(positions))

    @property
    def tier(self) -> Tier | None:
        """The lower tier at either end of the leg, if any."""
        for end in (self.dst, self.src):
            if isinstance(end, OnTier):
                return end.tier
        return None

    @property
    def kinds(self) -> tuple[type, type]:
        """(source kind, destination kind): what picks its handler."""
        return type(self.src), type(self.dst)


def write_out(blocks: Blocks, slots: Sequence[int], tier: Tier) -> Leg:
    """The leg writing `blocks` from their host `slots` to `tier` (a spill, a write-through)."""
    return Leg(blocks, Host(tuple(slots)), OnTier(tier))


def deletion(keys: Sequence[bytes], tier: Tier) -> Leg:
    """The leg deleting the blocks `keys` name from `tier`."""
    return Leg(Blocks(tuple(keys)), OnTier(tier), Gone())


# The spill of a job that spills nothing.
NO_SPILL = write_out(NO_BLOCKS, (), Tier.SSD)
