"""What an engine's SSD shards hold, read without their writers: the scheduler's restart
inventory before any worker reported.

Each worker rank writes its own shard (``<dir>/tp{r}-pp{p}``, ``engine{id}-`` in front on a node
of several engines, one stripe per configured directory; tiers/ssd/tier.py). The scheduler opens
every shard of its engine with the native store's ``read_only`` mode, as ``flexkv-py inspect``
does: no lock and no write, so it is safe whether the workers have opened their shards already
(vLLM's engine core builds the scheduler after the workers registered their KV caches) or not
yet. A block is listed only if every shard holds it (under TP/PP each rank holds its own part of
every block; MLA's replicated KV has one shard per stage, TP rank 0's) and only blocks of this
engine's namespace, as the workers' own reports list them.

It is a prediction, not the authority: the workers' reports are (restart_inventory.py). Any
shard that cannot be read (missing, foreign, damaged, unreadable, replaced while read) makes it
answer None, and the scheduler waits for the reports as before: a miss, never an error.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from flexkv_py import _native
from flexkv_py.config import FlexKVConfig
from flexkv_py.index.joined_keys import JoinedKeys, JoinedLinks
from flexkv_py.index.joined_sets import common_keys
from flexkv_py.index.namespace import PREFIX_LEN, VARIANT_LEN, Namespace
from flexkv_py.process_memory import return_freed_memory

logger = logging.getLogger(__name__)

JOURNAL_FILE = "flexkv-journal.log"  # rust/store/journal_file.rs: a store's only metadata
# Keys below this are never logical keys of a namespace (Namespace.owns).
MIN_KEY_LEN = PREFIX_LEN + VARIANT_LEN + 1


@dataclass
class SsdInventory:
    # Logical keys every shard holds, oldest first (rank (0, 0)'s order): joined (no object
    # per block) when they have one width, as a namespace's keys do.
    keys: Sequence[bytes]
    # Key -> its chain parent's key (joined links, as the keys, when those are joined).
    parents: Mapping[bytes, bytes] = field(default_factory=dict)
    shards: int = 0
    seconds: float = 0.0


def shard_dirs(config: FlexKVConfig, namespace: Namespace) -> list[tuple[Namespace, list[str]]]:
    """Each distinct shard of the engine: a rank's namespace (its tag) and its stripes, rank
    (0, 0) first (its store order and chain parents are the ones adopted)."""
    out: dict[str, tuple[Namespace, list[str]]] = {}
    for pp in range(namespace.pp_size):
        for tp in range(namespace.tp_size):
            ns = namespace.for_rank(tp, pp)
            name = ns.shard_dir_name  # replicated KV: every TP rank names TP rank 0's shard
            if name not in out:
                out[name] = (ns, [os.path.join(d, name) for d in config.ssd_cache_dir])
    return list(out.values())


def _logical(ns: Namespace, storage_keys: Sequence[bytes]) -> list[bytes]:
    """`Namespace.logical_key` over a whole shard, inlined: it runs once per stored block
    (the shard's tag and one of the namespace's prefixes in front, a hash after them)."""
    heads = tuple(ns.shard_tag + p for p in ns.prefixes)
    t, shortest = len(ns.shard_tag), len(ns.shard_tag) + MIN_KEY_LEN
    return [k[t:] for k in storage_keys if k.startswith(heads) and len(k) >= shortest]


def _logical_joined(ns: Namespace, store: _native.BlockStore) -> Sequence[bytes]:
    """`_logical` over the whole store, listed by the store itself: one joined buffer when the
    keys have one width (no bytes object per block), else the list."""
    tag = ns.shard_tag
    got = store.keys_joined([tag + p for p in ns.prefixes], len(tag), len(tag) + MIN_KEY_LEN)
    if got is None:
        return _logical(ns, store.keys())
    joined, width = got
    return JoinedKeys(joined, width) if joined else []


def _inventory_joined(
    ns: Namespace, store: _native.BlockStore
) -> tuple[Sequence[bytes], Mapping[bytes, bytes]]:
    """`_logical_joined` with the chain links between blocks of this namespace (`_parents`)."""
    tag = ns.shard_tag
    heads = [tag + p for p in ns.prefixes]
    got = store.inventory_joined(heads, len(tag), len(tag) + MIN_KEY_LEN)
    if got is None:
        inventory = store.inventory()
        return _logical(ns, [k for k, _ in inventory]), _parents(ns, inventory)
    keys, children, parents, width = got
    if not keys:
        return [], {}
    return JoinedKeys(keys, width), JoinedLinks(
        JoinedKeys(children, width), JoinedKeys(parents, width)
    )


def _open(dirs: list[str], io_engine: str) -> _native.BlockStore | None:
    if not os.path.exists(os.path.join(dirs[0], JOURNAL_FILE)):
        return None  # never written: nothing to read (a first start)
    return _native.BlockStore(dirs, 0, io_engine=io_engine, read_only=True)  # type: ignore[arg-type]


def _open_all(
    shards: Sequence[tuple[Namespace, list[str]]], io_engine: str
) -> list[_native.BlockStore | None]:
    """Every shard at once: the journal replays run in Rust, without the GIL, a core each."""
    if len(shards) == 1:
        return [_open(shards[0][1], io_engine)]
    with ThreadPoolExecutor(len(shards), thread_name_prefix="flexkv-shard-open") as pool:
        futures = [pool.submit(_open, dirs, io_engine) for _, dirs in shards]
    errors = [e for e in (f.exception() for f in futures) if e is not None]
    if errors:
        _close_later([f.result() for f in futures if f.exception() is None])
        raise errors[0]
    return [f.result() for f in futures]


def _close_later(stores: Sequence[_native.BlockStore | None]) -> None:
    """Close the views off the caller's path: freeing their indexes takes a while. Not a
    daemon: the interpreter's exit waits for it rather than stop it inside the native store."""
    opened = [s for s in stores if s is not None]

    def close() -> None:
        for store in opened:
            store.close()
        return_freed_memory("closing the shards' read-only views")

    if opened:
        threading.Thread(target=close, name="flexkv-shard-close").start()


def read_ssd_inventory(
    config: FlexKVConfig, namespace: Namespace, parents_over: int | None = None
) -> SsdInventory | None:
    """The blocks of `namespace` (rank-less: its TP/PP sizes say which shards) that every shard
    holds; an empty inventory when a shard was never written; None when one cannot be read.
    Chain parents are read only when rank (0, 0)'s shard holds more than `parents_over` blocks
    (the index then evicts at adoption, tail-first); else the workers' reports bring them."""
    started = time.perf_counter()
    shards = shard_dirs(config, namespace)
    keys: Sequence[bytes] = []
    parents: Mapping[bytes, bytes] = {}
    try:
        opened = _open_all(shards, config.ssd_io_engine)
        try:
            stores = [store for store in opened if store is not None]
            if len(stores) < len(shards):
                return SsdInventory([], {}, len(shards), time.perf_counter() - started)
            first, ns0 = stores[0], shards[0][0]
            if parents_over is not None and len(first) > parents_over:
                keys, parents = _inventory_joined(ns0, first)
            else:
                keys = _logical_joined(ns0, first)
            for (ns, _), store in zip(shards[1:], stores[1:], strict=True):
                if not keys:
                    break
                # Only what every shard holds: a block one rank lacks cannot be loaded. Joined
                # listings stay joined (index/joined_sets.py): no object per block.
                keys = common_keys(keys, [_logical_joined(ns, store)])
        finally:
            _close_later(opened)
    except Exception as e:  # a damaged shard must not stop the engine: wait for the reports
        logger.warning(
            "SSD shards of %s not readable before the workers report (%s: %s); blocks a "
            "previous run stored miss until they do",
            namespace.shard_dir_name,
            type(e).__name__,
            e,
        )
        return None
    seconds = time.perf_counter() - started
    if keys:
        logger.info(
            "read %d SSD blocks from %d shards of a previous run in %.3f s",
            len(keys),
            len(shards),
            seconds,
        )
    return SsdInventory(keys, parents if keys else {}, len(shards), seconds)


def _parents(ns: Namespace, inventory: list[tuple[bytes, bytes | None]]) -> dict[bytes, bytes]:
    """Chain links between blocks of this namespace (a parent of another one is left out)."""
    tag, prefixes = ns.shard_tag, ns.prefixes
    t, p = len(tag), len(tag) + PREFIX_LEN
    linked = [(k, q) for k, q in inventory if q is not None and q[:t] == tag and q[t:p] in prefixes]
    return {k[t:]: q[t:] for k, q in linked if k[:t] == tag and k[t:p] in prefixes}
