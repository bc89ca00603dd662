"""The SSD tier of one worker (one TP/PP rank): the native BlockStore behind the `LowerTier`
protocol (tiers/protocol.py).

Each rank gets its own subdirectory in every configured directory (``<dir>/tp0-pp0``), so ranks
never share files or locks, and stores its blocks under ``namespace.storage_key(key)`` (rank tag +
logical key), so even a misconfigured shared directory cannot hand one shard's block to another.
The configured sizes are per engine and split evenly across its ranks. Shard directories are
0700 and store files 0600: KV blocks reveal the prompts they were computed from.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from flexkv_py import _native
from flexkv_py.config import FlexKVConfig
from flexkv_py.errors import ConfigError, FlexKVError
from flexkv_py.index.joined_keys import JoinedKeys, JoinedLinks
from flexkv_py.index.namespace import PREFIX_LEN, VARIANT_LEN, Namespace
from flexkv_py.index.tier_names import Tier
from flexkv_py.tiers.private_files import make_private_dir, tighten_dir, warn_if_exposed
from flexkv_py.tiers.protocol import Item

logger = logging.getLogger(__name__)


class SsdTier:
    """Implements `LowerTier`: keys in and out are logical; the store sees storage keys."""

    # submit_put takes per-block chain parents and metadata (see tiers/protocol.py).
    stores_block_meta = True

    def __init__(self, config: FlexKVConfig, namespace: Namespace) -> None:
        if not config.ssd_enabled:
            raise ConfigError("ssd_cache_gb: the SSD tier is disabled (0); nothing to open")
        self.namespace = namespace
        self.dirs = [os.path.join(d, namespace.shard_dir_name) for d in config.ssd_cache_dir]
        for root, d in zip(config.ssd_cache_dir, self.dirs, strict=True):
            warn_if_exposed(root)  # the user's directory: warned about, never chmod-ed
            try:
                # Shard directories are ours: 0700, and tightened if made before that.
                if not make_private_dir(d):
                    tighten_dir(d)
            except OSError as e:
                raise ConfigError(f"ssd_cache_dir: cannot create {d!r}: {e.strerror}") from e
        self.capacity_bytes = namespace.lower_tier_share(config.ssd_cache_bytes)
        self.store = _native.BlockStore(
            self.dirs,
            self.capacity_bytes,
            io_engine=config.ssd_io_engine,  # type: ignore[arg-type]
            queue_depth=config.iouring_entries,
            compression=config.ssd_compression,  # type: ignore[arg-type]
            zstd_level=config.zstd_level,
            content_hash=config.content_hash,  # type: ignore[arg-type]
            durability=config.durability,  # type: ignore[arg-type]
            preallocate=config.ssd_preallocate,
        )
        logger.info(
            "SSD tier %s: %d MiB over %s (%s)",
            namespace.shard_dir_name,
            self.capacity_bytes >> 20,
            self.dirs,
            self.store.io_engine,
        )

    @property
    def name(self) -> Tier:
        return Tier.SSD

    @property
    def io_engine(self) -> str:
        return self.store.io_engine

    def _items(self, items: Iterable[Item]) -> list[tuple[bytes, Any]]:
        sk = self.namespace.storage_key
        return [(sk(key), buf) for key, buf in items]

    def submit_put(
        self,
        items: Iterable[Item],
        parents: Sequence[bytes | None] | None = None,
        metas: Sequence[bytes | None] | None = None,
    ) -> _native.BatchHandle:
        """``parents``: each block's logical chain parent; ``metas``: opaque bytes stored in the
        block's header page (the token ids and extra keys); parallel to ``items``, None = absent."""
        sk = self.namespace.storage_key
        storage_parents = (
            None if parents is None else [None if p is None else sk(p) for p in parents]
        )
        return self.store.submit_put(self._items(items), parents=storage_parents, metas=metas)

    def submit_get(self, items: Iterable[Item]) -> _native.BatchHandle:
        return self.store.submit_get(self._items(items))

    def contains(self, key: bytes) -> bool:
        return self.store.contains(self.namespace.storage_key(key))

    def delete(self, keys: Iterable[bytes]) -> int:
        """Delete `keys`; how many were here. Each key is tried: the store forgets a key before
        journaling its delete, so a refused record (EIO, a full device) still frees its room,
        and it must not keep the keys after it on disk. The first refusal is raised after all
        were tried (the caller counts it)."""
        sk = self.namespace.storage_key
        deleted = 0
        refused: FlexKVError | None = None
        for key in keys:
            try:
                deleted += self.store.delete(sk(key))
            except FlexKVError as e:
                refused = refused or e
        if refused is not None:
            raise refused
        return deleted

    def delete_fingerprints(self, joined: bytes) -> list[bytes]:
        """Delete the blocks the scheduler names by fingerprint (joined 8-byte `BlockSet.digest`s
        of logical keys: it keeps no full keys of cold blocks); returns their logical keys. The
        store's key table is hashed by the same digest of the key past its rank tag, so every
        rank resolves the scheduler's fingerprints to its own keys (rust/index/
        by_fingerprint.rs). A clash deletes one block more: a lost copy, never a wrong one."""
        return self._logical(self.store.delete_fingerprints(self.namespace.shard_tag, joined))

    def delete_namespace(self) -> list[bytes]:
        """Delete every block of this rank's namespace, every KV cache group (a reset);
        returns their logical keys, oldest first."""
        tag = self.namespace.shard_tag
        return self._logical(self.store.delete_prefixed([tag + p for p in self.namespace.prefixes]))

    def drain_evicted(self) -> list[bytes]:
        """Logical keys the store dropped for capacity since the last call."""
        return self._logical(self.store.drain_evicted())

    def keys(self) -> list[bytes]:
        """Every block of this namespace and rank on disk (the restart inventory)."""
        return self._logical(self.store.keys())

    def inventory(self) -> list[tuple[bytes, bytes | None]]:
        """Every block of this namespace and rank on disk with its chain parent (logical keys),
        oldest first; a parent of another namespace or rank reads as None."""
        lk = self.namespace.logical_key
        out: list[tuple[bytes, bytes | None]] = []
        for key, parent in self.store.inventory():
            logical = lk(key)
            if logical is not None:
                out.append((logical, None if parent is None else lk(parent)))
        return out

    def restart_report(self) -> tuple[Sequence[bytes], Mapping[bytes, bytes]]:
        """`inventory()` as a worker's restart report sends it: (keys, child -> parent links).
        Joined (one buffer each, no object per block: index/joined_keys.py) when the keys have
        one width, as a namespace's do; else a tuple and a dict."""
        got = self.store.inventory_joined(*self._listed())
        if got is None:
            inventory = self.inventory()
            return tuple(k for k, _ in inventory), {k: p for k, p in inventory if p is not None}
        keys, children, parents, width = got
        if not keys:
            return (), {}
        return JoinedKeys(keys, width), JoinedLinks(
            JoinedKeys(children, width), JoinedKeys(parents, width)
        )

    def restart_keys(self) -> Sequence[bytes]:
        """`keys()` as the restart report of a worker other than (0, 0) sends them (worker
        (0, 0)'s brings the chain links): joined when they have one width, else a tuple."""
        got = self.store.keys_joined(*self._listed())
        if got is None:
            return tuple(self.keys())
        joined, width = got
        return JoinedKeys(joined, width) if joined else ()

    def _listed(self) -> tuple[list[bytes], int, int]:
        """What the store's joined listings take to list this namespace's keys as `keys()`
        does: (their heads, the rank tag's length to cut, the shortest storage key)."""
        tag = self.namespace.shard_tag
        heads = [tag + p for p in self.namespace.prefixes]
        return heads, len(tag), len(tag) + PREFIX_LEN + VARIANT_LEN + 1

    def read_metas(self, logical_keys: Sequence[bytes]) -> list[bytes | None]:
        """The metadata stored with each block (None: absent); batched header reads."""
        sk = self.namespace.storage_key
        return self.store.read_metas([sk(k) for k in logical_keys])

    def _logical(self, storage_keys: Sequence[bytes]) -> list[bytes]:
        lk = self.namespace.logical_key
        return [k for k in map(lk, storage_keys) if k is not None]

    def stats(self) -> dict[str, int | float | str]:
        return self.store.stats()

    def close(self) -> None:
        self.store.close()
