"""SSD shards another writer owns, read without its lock: sibling engines on one node, and TP
rank 0's single copy of replicated (MLA) KV.

A shard directory has one writer (its flock, rust/device/dir_lock.rs). Readers open it with the
native store's `read_only` mode: no lock, the journal replayed into a private index, a snapshot
as of that open. A block the writer evicted and overwrote since then fails the header and
content-hash check of the read (`corrupt`): it is recomputed, never served. A block written
after the snapshot is not in it: a miss (and the sibling refresh) brings the view up to date
when the writer's journal changed since (one stat, then a read of the appended records; a
journal replaced by a compaction is replayed whole into a new view).

- `SiblingShards`: the shards of this rank that other engines of the same
  model on this node write (`Namespace.is_sibling_shard`, same storage keys), as a tier of
  their own (`Tier.NODE`), kept fresh by a background refresh.
- `ReplicaReader` (item 10): TP ranks > 0 of an MLA engine. The latent KV is the same on every
  rank, so rank 0 alone writes it; these ranks acknowledge writes without writing (a job's
  merged result still fails a block rank 0 did not write) and read rank 0's shard.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from flexkv_py import _native
from flexkv_py.config import FlexKVConfig
from flexkv_py.errors import FlexKVError
from flexkv_py.index.namespace import Namespace
from flexkv_py.index.tier_names import Tier
from flexkv_py.tiers.protocol import BatchLike, Item

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
        self._seen: tuple[int, int] | None = None  # the journal (mtime, size) last read
        self._lock = threading.Lock()  # the refresh thread and readers both update the view
        # Storage keys that came and went since `take_changes`; True: reopened (compare all).
        self._came: list[bytes] = []
        self._gone: list[bytes] = []
        self._reopened = False

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
        self._reopened = True
        self._came, self._gone = [], []
        return store

    def store(self) -> _native.BlockStore | None:
        return self._store if self._store is not None else self.fresh()

    def fresh(self) -> _native.BlockStore | None:
        """The view, brought up to date first if the writer's journal changed since (a miss:
        the writer may have stored the block since): the records it appended are applied to
        the view (`follow`, a read of the new bytes); a journal replaced since (compaction)
        is replayed into a new view."""
        with self._lock:
            seen = self._journal()
            if self._store is None:
                return self._open()
            if seen == self._seen:
                return self._store
            self._seen = seen  # before the read: a later append changes it again
            got = self._store.follow()
            if got is None:
                return self._open()
            self._came += got[0]
            self._gone += got[1]
            return self._store

    def take_changes(self) -> tuple[list[bytes], list[bytes]] | None:
        """Storage keys that (appeared, vanished) since the last call, in order; None when the
        view was reopened since (the caller compares whole key sets)."""
        with self._lock:
            reopened, self._reopened = self._reopened, False
            came, gone, self._came, self._gone = self._came, self._gone, [], []
            return None if reopened else (came, gone)

    def keys(self) -> list[bytes]:
        store = self.store()
        return store.keys() if store is not None else []

    def close(self) -> None:
        with self._lock:
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


class SiblingShards:
    """Implements `LowerTier` as `Tier.NODE`: the sibling engines' shards of this rank, read-only.

    Its own tier, not part of this engine's SSD tier: the index counts these blocks apart from
    the own shard's capacity (the siblings evict on their own), writes never go here, and
    deletes are the siblings' business. A background thread re-reads each sibling's journal
    every `refresh_s` when it changed (one stat; a reopen replays it) and queues the keys that
    appeared and vanished since (`take_changes`): the worker hands them to the scheduler, which
    starts or stops offering them. A block evicted between two refreshes fails its read (the
    header names another key or the content hash differs: `corrupt`, or `not_found`) and is
    recomputed, never served. Nothing here runs on a step."""

    refresh_s = 2.0

    def __init__(self, namespace: Namespace, siblings: list[ReadOnlyShard]) -> None:
        self.namespace = namespace
        self.siblings = siblings
        self._lock = threading.Lock()
        self._known: set[bytes] = set()  # logical keys as of the last refresh
        self._per_sibling: dict[int, set[bytes]] = {}  # each sibling's, as of its last open
        self._added: dict[bytes, None] = {}  # since the last take_changes, in order
        self._removed: set[bytes] = set()
        self._stop = threading.Event()
        self.refreshes = 0
        self.refresh()  # the blocks siblings hold at start
        self._thread = threading.Thread(target=self._run, name="flexkv-sibling-shards", daemon=True)
        self._thread.start()

    @property
    def name(self) -> Tier:
        return Tier.NODE

    def _run(self) -> None:
        while not self._stop.wait(self.refresh_s):
            try:
                self.refresh()
            except Exception as e:  # a refresh is retried next time; never kills the thread
                logger.warning("sibling shards: refresh failed: %s", e)

    def refresh(self) -> None:
        """Bring each sibling's view up to date (the appended journal records, or a reopen
        after a compaction); queue the keys that came and went."""
        lk = self.namespace.logical_key
        for i, sib in enumerate(self.siblings):
            store = sib.fresh()
            changes = sib.take_changes()
            old = self._per_sibling.get(i)
            if store is None or (changes is not None and old is not None and changes == ([], [])):
                continue  # unchanged
            if changes is None or old is None:  # a new view: compare whole key sets
                now = {k for k in map(lk, store.keys()) if k is not None}
                came, gone = now - (old or set()), (old or set()) - now
                self._per_sibling[i] = now
            else:  # the appended records only: O(changes), not O(keys)
                came = {k for k in map(lk, changes[0]) if k is not None}
                gone = {k for k in map(lk, changes[1]) if k is not None} - came
                old.difference_update(gone)
                old.update(came)
            self._apply(i, came, gone)
        with self._lock:
            self.refreshes += 1

    def _apply(self, sibling: int, came: set[bytes], gone: set[bytes]) -> None:
        """Sibling `sibling`'s keys changed: queue what the node view gains and loses (a key
        leaves it only when no other sibling holds it)."""
        others = [keys for j, keys in self._per_sibling.items() if j != sibling]
        with self._lock:
            for k in came:
                if k not in self._known:
                    self._known.add(k)
                    self._added[k] = None
                    self._removed.discard(k)
            for k in gone:
                if k in self._known and not any(k in keys for keys in others):
                    self._known.discard(k)
                    self._removed.add(k)
                    self._added.pop(k, None)

    def take_changes(self) -> tuple[tuple[bytes, ...], tuple[bytes, ...]]:
        """(keys that appeared, keys that vanished) since the last call."""
        with self._lock:
            added, self._added = tuple(self._added), {}
            removed, self._removed = tuple(self._removed), set()
            return added, removed

    def submit_put(self, items: Iterable[Item]) -> BatchLike:
        # Never planned (the scheduler writes only to its own tiers): refused, not written.
        return FinishedBatch(
            [MadeResult("rejected", 0, "sibling shards are read-only")] * len(list(items))
        )

    def submit_get(self, items: Iterable[Item]) -> BatchLike:
        sk = self.namespace.storage_key
        stored = [(sk(k), buf) for k, buf in items]
        first = self.siblings[0].store() if self.siblings else None
        if first is None:
            return FinishedBatch([MadeResult(NOT_FOUND) for _ in stored])
        return _Fallback(first.submit_get(stored), stored, self.siblings[1:])

    def delete(self, keys: Iterable[bytes]) -> int:
        return 0  # siblings' blocks are theirs to delete

    def contains(self, key: bytes) -> bool:
        sk = self.namespace.storage_key(key)
        return any((s := sib.store()) is not None and s.contains(sk) for sib in self.siblings)

    def drain_evicted(self) -> list[bytes]:
        return []  # vanished blocks travel with take_changes

    def keys(self) -> list[bytes]:
        """The siblings' blocks as of the last refresh."""
        with self._lock:
            return list(self._known)

    def stats(self) -> dict[str, int | float | str]:
        with self._lock:
            return {
                "sibling_shards": len(self.siblings),
                "blocks": len(self._known),
                "refreshes": self.refreshes,
            }

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5.0)
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
