"""The object-store tier of one worker (one TP/PP rank): `_native.ObjectTier` behind the
`LowerTier` protocol (tiers/protocol.py), shared by every worker that uses the same bucket
prefix and namespace.

Blocks are stored under ``namespace.storage_key(key)`` (rank tag + logical key), like the SSD
tier, so two ranks never read each other's shard. Stores pass each block's parent (the previous
block of its prompt): the tier remembers parents and hands the native tier the whole chain, so
it can consult and write the chain's segment manifests (one request answers up to 64 blocks;
see rust/object/chain.rs). A chain whose root this process never saw is stored without
manifests (its blocks are found by no lookup and collected after the GC grace).

Optionally one worker of the fleet collects garbage in the background: every `interval_s` each
worker asks for the prefix's GC lease and the holder runs one pass (rust/object/gc.rs).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import uuid
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from flexkv_py import _native
from flexkv_py.errors import ConfigError
from flexkv_py.index.namespace import Namespace
from flexkv_py.index.tier_names import Tier
from flexkv_py.tiers.node.shards import FinishedBatch, MadeResult
from flexkv_py.tiers.object.batches import Batches
from flexkv_py.tiers.object.hash import require_collision_resistant
from flexkv_py.tiers.protocol import Item

logger = logging.getLogger(__name__)

PARENTS_CAP = 1 << 20  # remembered parent links (a forgotten one only costs manifests)


@dataclass(frozen=True)
class GcPolicy:
    """Background collection: a pass every `interval_s` by whichever worker holds the lease."""

    ttl_s: float
    grace_s: float = 600.0
    budget_bytes: int | None = None
    interval_s: float = 300.0
    lease_s: float = 900.0

    def __post_init__(self) -> None:
        for name in ("ttl_s", "grace_s", "interval_s", "lease_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"object GC {name}: must be > 0, got {getattr(self, name)}")
        if self.lease_s < self.interval_s:
            raise ConfigError(
                f"object GC lease_s ({self.lease_s}) must be >= interval_s ({self.interval_s}): "
                f"the holder renews it once per interval"
            )


class ObjectTier:
    """Implements `LowerTier`: keys in and out are logical; the bucket sees storage keys.
    `read_only`: a replicated (MLA) TP rank > 0 reads rank 0's copy and writes nothing (its
    puts report ok, as tiers/node/shards.py ReplicaReader's)."""

    # Takes `parents=` (the chain, for manifests) and `metas=` (ignored) in submit_put.
    stores_block_meta = True

    def __init__(
        self,
        url: str,
        namespace: Namespace,
        *,
        allow_weak_hash: bool = False,
        gc: GcPolicy | None = None,
        read_only: bool = False,
        **native: Any,
    ) -> None:
        require_collision_resistant(namespace.hash_algo, allow_weak_hash)
        self.namespace = namespace
        self.read_only = read_only
        self.native = _native.ObjectTier(url, **native)
        self._parents: OrderedDict[bytes, bytes | None] = OrderedDict()
        self._lock = threading.Lock()
        self.gc_policy = gc
        if gc is not None:  # a task on the tier's own runtime; close stops it
            self.native.start_gc(
                f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}",
                ttl_s=gc.ttl_s,
                grace_s=gc.grace_s,
                budget_bytes=gc.budget_bytes,
                interval_s=gc.interval_s,
                lease_s=gc.lease_s,
            )
        logger.info("object tier %s: %r", namespace.shard_dir_name, self.native)

    @property
    def name(self) -> Tier:
        return Tier.OBJECT

    def _remember(self, key: bytes, parent: bytes | None) -> None:
        with self._lock:
            self._parents[key] = parent
            self._parents.move_to_end(key)
            while len(self._parents) > PARENTS_CAP:
                self._parents.popitem(last=False)

    def remember_links(self, links: Iterable[tuple[bytes, bytes | None]]) -> None:
        """Chain links of blocks stored by others (a prefix this worker loaded): a later put
        of their descendants can then name the whole chain and write its manifests."""
        for key, parent in links:
            self._remember(key, parent)

    def _chain(self, key: bytes) -> list[bytes] | None:
        """Every key from the root to `key`, or None when a link is unknown."""
        out = [key]
        with self._lock:
            while True:
                if out[-1] not in self._parents:
                    return None
                parent = self._parents[out[-1]]
                if parent is None:
                    return out[::-1]
                if len(out) > len(self._parents):
                    return None  # a cycle: bad input, stored without manifests
                out.append(parent)

    def submit_put(
        self,
        items: Iterable[Item],
        parents: Sequence[bytes | None] | None = None,
        metas: Sequence[Any] | None = None,
    ) -> Batches | FinishedBatch:
        """Store the blocks; `parents[i]` is the logical key of item i's parent (None: the
        prompt's first block). `metas` is accepted for the SSD tier's shape and not stored."""
        del metas
        items = list(items)
        if self.read_only:
            sizes = [int(b[1]) if isinstance(b, tuple) else len(memoryview(b)) for _, b in items]
            return FinishedBatch([MadeResult("ok", n) for n in sizes])
        if parents is not None:
            if len(parents) != len(items):
                raise ConfigError(
                    f"submit_put: {len(parents)} parents for {len(items)} items (one each)"
                )
            for (key, _), parent in zip(items, parents, strict=True):
                self._remember(key, parent)
        sk = self.namespace.storage_key
        if parents is None:
            return Batches(
                len(items),
                [
                    (
                        list(range(len(items))),
                        self.native.submit_put([(sk(key), buf) for key, buf in items]),
                    )
                ],
            )
        batch_keys = {key for key, _ in items}
        groups: dict[int, list[int]] = {}
        chains: dict[int, list[bytes] | None] = {}
        # One native batch per chain: a block belongs to the chain of the batch's last block
        # that descends from it (items of one request come root first).
        with self._lock:
            parent_of = {k: self._parents.get(k) for k in batch_keys}
        leaf_of: dict[bytes, int] = {}
        for i in range(len(items) - 1, -1, -1):
            key = items[i][0]
            if key not in leaf_of:
                leaf_of[key] = i
                at = parent_of.get(key)
                while at is not None and at in batch_keys and at not in leaf_of:
                    leaf_of[at] = i
                    at = parent_of.get(at)
            groups.setdefault(leaf_of[key], []).append(i)
        for leaf in groups:
            chains[leaf] = self._chain(items[leaf][0])
        parts = []
        for leaf, idx in groups.items():
            part = [(sk(items[i][0]), items[i][1]) for i in idx]
            chain = chains[leaf]
            native_chain = None if chain is None else [sk(k) for k in chain]
            parts.append((idx, self.native.submit_put(part, chain=native_chain)))
        return Batches(len(items), parts)

    def submit_get(self, items: Iterable[Item]) -> _native.BatchHandle:
        sk = self.namespace.storage_key
        return self.native.submit_get([(sk(key), buf) for key, buf in items])

    def lookup_chain(self, keys: Sequence[bytes]) -> int:
        """Leading blocks of a prompt's chain (logical keys, root first) the bucket holds."""
        sk = self.namespace.storage_key
        return self.native.lookup_chain([sk(k) for k in keys])

    def submit_lookup_chain(self, keys: Sequence[bytes]) -> _native.LookupHandle:
        """`lookup_chain` on the tier's runtime: returns at once; the handle answers the count."""
        sk = self.namespace.storage_key
        return self.native.submit_lookup_chain([sk(k) for k in keys])

    def submit_present(self, keys: Sequence[bytes]) -> _native.LookupHandle:
        """Whether each key is stored as a one-block chain, on the tier's runtime: the handle
        answers bits, bit i set when `lookup_chain([keys[i]]) == 1`."""
        sk = self.namespace.storage_key
        return self.native.submit_present([sk(k) for k in keys])

    def contains(self, key: bytes) -> bool:
        return self.native.contains_many([self.namespace.storage_key(key)])[0]

    def delete(self, keys: Iterable[bytes]) -> int:
        sk = self.namespace.storage_key
        return self.native.delete([sk(k) for k in keys])

    def drain_evicted(self) -> list[bytes]:
        """Always empty: the bucket is collected by GC, not evicted per block."""
        return []

    def keys(self) -> list[bytes]:
        """Empty: a shared bucket is found by lookups, not inventoried at start."""
        return []

    def stats(self) -> dict[str, int | float | str]:
        return self.native.stats()

    def close(self) -> None:
        self.native.close()
