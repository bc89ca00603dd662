"""SSD shards another writer owns, read without its lock: sibling engines on one node, and TP
rank 0's single copy of replicated (MLA) KV.

A shard directory has one writer (its flock, rust/device/dir_lock.rs). Readers open it with the
native store's `read_only` mode: no lock, the journal replayed into a private index, a snapshot
as of that open. A block the writer evicted and overwrote since then fails the header and
content-hash check of the read (`corrupt`): it is recomputed, never served. A block written
after the snapshot is not in it: a miss reopens the snapshot when the writer's journal changed
since (one stat; the reopen replays the journal).

- `NodeShards` (issue 10 item 9): this engine's own SSD tier, plus its siblings' shards of the
  same rank (`Namespace.is_sibling_shard`: other engines of the same model on this node, same
  storage keys). Its inventory is the union, and a read its own shard misses is tried on them.
- `ReplicaReader` (item 10): TP ranks > 0 of an MLA engine. The latent KV is the same on every
  rank, so rank 0 alone writes it; these ranks acknowledge writes without writing (a job's
  merged result still fails a block rank 0 did not write) and read rank 0's shard.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from flexkv_py import _native
from flexkv_py.config import FlexKVConfig
from flexkv_py.errors import FlexKVError
from flexkv_py.index.namespace import Namespace
from flexkv_py.index.tier_names import Tier
from flexkv_py.tiers.protocol import BatchLike, Item, LowerTier

logger = logging.getLogger(__name__)

NOT_FOUND = "not_found"
JOURNAL_FILE = "flexkv-journal.log"  # rust/store/journal_file.rs: the store's only metadata


@dataclass(frozen=True)
class MadeResult:
    """A block result made in Python (the native store's BlockResult shape)."""

    status: str
    nbytes: int = 0
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status in ("ok", "deduped")


class FinishedBatch:
    """A batch that completed while it was submitted."""

    def __init__(self, results: list[MadeResult]) -> None:
        self._results = results

    def done(self) -> bool:
        return True

    def wait(self, timeout: float | None = None) -> list[Any]:
        return list(self._results)


class ReadOnlyShard:
    """One shard directory set another process writes, read through a read-only snapshot."""

    # Replaced snapshots kept open for reads that may still run on them.
    keep_old = 8

    def __init__(self, config: FlexKVConfig, dirs: Sequence[str]) -> None:
        self.dirs = list(dirs)
        self.name = os.path.basename(self.dirs[0])
        self._io_engine = config.ssd_io_engine
        self._store: _native.BlockStore | None = None
        self._old: list[_native.BlockStore] = []  # replaced snapshots: reads may still run
        self._seen: tuple[int, int] | None = None  # the journal (mtime, size) last opened

    def _journal(self) -> tuple[int, int] | None:
        try:
            st = os.stat(os.path.join(self.dirs[0], JOURNAL_FILE))
        except OSError:
            return None
        return st.st_mtime_ns, st.st_size

    def _open(self) -> _native.BlockStore | None:
        self._seen = self._journal()
        try:
            store = _native.BlockStore(
                self.dirs,
                0,
                io_engine=self._io_engine,
                read_only=True,  # type: ignore[arg-type]
            )
        except (FlexKVError, OSError) as e:  # not created yet, being set aside, ...
            logger.debug("shard %s not readable now: %s", self.name, e)
            return self._store
        if self._store is not None:
            self._old.append(self._store)
            while len(self._old) > self.keep_old:
                self._old.pop(0).close()
        self._store = store
        return store

    def store(self) -> _native.BlockStore | None:
        return self._store if self._store is not None else self.fresh()

    def fresh(self) -> _native.BlockStore | None:
        """The store, its snapshot reopened first if the writer's journal changed since (a
        miss: the writer may have stored the block since)."""
        if self._store is None or self._journal() != self._seen:
            return self._open()
        return self._store

    def keys(self) -> list[bytes]:
        store = self.store()
        return store.keys() if store is not None else []

    def close(self) -> None:
        for store in (*self._old, *([self._store] if self._store is not None else [])):
            store.close()
        self._old, self._store = [], None


class _Fallback:
    """A read batch on a first store whose misses (`not_found`) are read from further shards,
    one after the other, as the caller waits. `done()` covers the batch in flight."""

    def __init__(
        self, first: BatchLike, items: list[tuple[bytes, Any]], shards: list[ReadOnlyShard]
    ):
        self._batch = first
        self._items = items
        self._shards = list(shards)  # tried in order, each with a fresh snapshot
        self._results: list[Any] | None = None
        self._missing: list[int] = []

    def done(self) -> bool:
        return self._batch.done()

    def wait(self, timeout: float | None = None) -> list[Any]:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            got = self._batch.wait(left)  # TimeoutError: the caller fences, may wait again
            if self._results is None:
                self._results = list(got)
            else:
                for i, r in zip(self._missing, got, strict=True):
                    self._results[i] = r
            self._missing = [i for i, r in enumerate(self._results) if r.status == NOT_FOUND]
            if not self._missing or not self._shards:
                return self._results
            store = self._shards.pop(0).fresh()
            if store is None:
                continue
            self._batch = store.submit_get([self._items[i] for i in self._missing])


class NodeShards:
    """Implements `LowerTier`: this engine's own SSD tier plus its siblings' shards, read-only."""

    def __init__(self, own: LowerTier, namespace: Namespace, siblings: list[ReadOnlyShard]):
        self.own = own
        self.namespace = namespace
        self.siblings = siblings

    @property
    def name(self) -> Tier:
        return self.own.name

    def submit_put(self, items: Iterable[Item]) -> BatchLike:
        return self.own.submit_put(items)

    def submit_get(self, items: Iterable[Item]) -> BatchLike:
        items = list(items)
        sk = self.namespace.storage_key
        stored = [(sk(k), buf) for k, buf in items]
        return _Fallback(self.own.submit_get(items), stored, self.siblings)

    def delete(self, keys: Iterable[bytes]) -> int:
        return self.own.delete(keys)  # siblings' blocks are theirs to delete

    def contains(self, key: bytes) -> bool:
        sk = self.namespace.storage_key(key)
        return self.own.contains(key) or any(
            (s := sib.store()) is not None and s.contains(sk) for sib in self.siblings
        )

    def drain_evicted(self) -> list[bytes]:
        return self.own.drain_evicted()

    def keys(self) -> list[bytes]:
        """The own shard's keys, then the siblings' not already listed (the inventory)."""
        out = self.own.keys()
        seen = set(out)
        lk = self.namespace.logical_key
        for sib in self.siblings:
            for k in map(lk, sib.keys()):
                if k is not None and k not in seen:
                    seen.add(k)
                    out.append(k)
        return out

    def stats(self) -> dict[str, int | float | str]:
        out = dict(self.own.stats())
        out["sibling_shards"] = len(self.siblings)
        return out

    def close(self) -> None:
        self.own.close()
        for sib in self.siblings:
            sib.close()


class ReplicaReader:
    """Implements `LowerTier` for a TP rank > 0 of replicated (MLA) KV: TP rank 0 writes the one
    copy, this rank reads it (its puts write nothing and report ok)."""

    open_attempts = 5

    def __init__(self, namespace: Namespace, shard: ReadOnlyShard) -> None:
        self.namespace = namespace
        self.shard = shard

    @property
    def name(self) -> Tier:
        return Tier.SSD

    def submit_put(self, items: Iterable[Item]) -> BatchLike:
        return FinishedBatch([MadeResult("ok", _nbytes(buf)) for _, buf in items])

    def submit_get(self, items: Iterable[Item]) -> BatchLike:
        sk = self.namespace.storage_key
        stored = [(sk(k), buf) for k, buf in items]
        store = self.shard.store()
        if store is None:
            return FinishedBatch([MadeResult(NOT_FOUND) for _ in stored])
        # Misses are blocks rank 0 wrote after the snapshot: read again from a fresh one.
        return _Fallback(store.submit_get(stored), stored, [self.shard])

    def delete(self, keys: Iterable[bytes]) -> int:
        return 0  # rank 0 deletes the one copy

    def contains(self, key: bytes) -> bool:
        store = self.shard.store()
        return store is not None and store.contains(self.namespace.storage_key(key))

    def drain_evicted(self) -> list[bytes]:
        return []  # rank 0 reports its store's evictions

    def keys(self) -> list[bytes]:
        """Rank 0's blocks (this rank's restart inventory). Ranks start together: rank 0 may
        be replacing its journal right now, so an unreadable shard is retried a little before
        it counts as empty (then, as for a rank whose SSD is unavailable, rank 0's blocks are
        not adopted)."""
        for _ in range(self.open_attempts - 1):
            if self.shard.store() is not None:
                break
            time.sleep(0.2)
        lk = self.namespace.logical_key
        return [k for k in map(lk, self.shard.keys()) if k is not None]

    def stats(self) -> dict[str, int | float | str]:
        return {"replica_of": self.shard.name}

    def close(self) -> None:
        self.shard.close()


def _nbytes(buf: Any) -> int:
    return int(buf[1]) if isinstance(buf, tuple) else len(memoryview(buf))
