"""Key namespace: what makes two KV blocks with the same token hash interchangeable.

A logical key is ``prefix + variant + block_hash``: the 16-byte prefix digests everything that
changes the bytes of a page (model and revision, the model's identity — its config, weights and
epoch, see integration/vllm/identity.py —, the KV cache format, KV layout, tokens per block, page
size, the TP/PP split and the engine's hash algorithm), so another model, dtype or sharding can
never hit. The 8-byte variant separates what differs per request inside one engine: zero bytes
for the base model, a digest of the LoRA adapter's identity otherwise. The
scheduler-side manager has no rank, so the prefix leaves the ranks out; each rank isolates its
shard physically with a rank tag in front of the stored key (`storage_key`) and its own SSD
subdirectory (`shard_dir_name`). Several engines on one node (data parallel, several Dynamo
workers) each get their own shards (`engine_id` in the name) and may read their siblings'
(`is_sibling_shard`); MLA at TP > 1 stores one copy, TP rank 0's (`kv_replicated`).

Hybrid models (vLLM's HMA: several KV cache groups, e.g. full attention + sliding window) key
each group's blocks in its own namespace: the group's id, kind and window are digested into the
prefix (`for_group`), not appended, so keys keep their length and the index's `(head, hash)`
lookup stays one head per group. A single-group model is group 0, kind "full", window 0.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass, replace
from functools import cached_property
from typing import TYPE_CHECKING

from flexkv_py.errors import ConfigError

if TYPE_CHECKING:
    from flexkv_py.index.joined_keys import JoinedKeys

PREFIX_LEN = 16
VARIANT_LEN = 8
BASE_VARIANT = bytes(VARIANT_LEN)
# Bump when the page or key format changes so old SSD contents stop matching (they are never
# adopted at restart and age out of the store). 2: model identity, KV cache format, variants.
# 3: the KV cache group (id, kind, window) in the prefix.
FORMAT_VERSION = 3
GROUP_KINDS = ("full", "sliding", "mamba")  # mamba: one state block per prefix
# Rank tag in front of every stored key: (tp_rank, pp_rank), big-endian u16 each.
SHARD_TAG = struct.Struct(">HH")


@dataclass(frozen=True)
class Namespace:
    model: str
    revision: str | None
    kv_dtype: str
    kv_layout: str
    block_size: int
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    hash_algo: str = "sha256"
    page_bytes: int = 0
    # Digest of the model's config, weights and epoch, or an operator's override (identity.py).
    model_identity: str = ""
    # vLLM KV cache group this namespace keys (hybrid models have several; see for_group).
    group_id: int = 0
    group_kind: str = "full"
    window: int = 0  # sliding window in tokens (0: none)
    # Every group of the engine as (group_id, kind, window, page_bytes): `owns` accepts the keys
    # of all of them (one host pool, one SSD shard hold every group's blocks). Not digested.
    groups: tuple[tuple[int, str, int, int], ...] = ()
    # Tokens per block of each entry of `groups` where it differs from `block_size` (vLLM
    # raises a group's block size to even out page sizes); empty: all `block_size`. Not digested.
    group_block_sizes: tuple[int, ...] = ()
    # Several engines on one node: this engine's id there (None: it is alone, its shards keep
    # the plain `tp{r}-pp{p}` name) and how many engines share the configured sizes. Not
    # digested: engines of one model on one node share keys, and read each other's shards.
    engine_id: int | None = None
    node_engines: int = 1
    # MLA at TP > 1: every TP rank holds the same latent KV, so one copy is stored, in TP rank
    # 0's shard under rank 0's tag, and every rank reads it (`writes_lower_tiers`). Not
    # digested: the logical keys and rank 0's shard are what they were.
    kv_replicated: bool = False

    def __post_init__(self) -> None:
        if not self.model:
            raise ConfigError("namespace.model: must be a non-empty model name")
        if self.block_size <= 0:
            raise ConfigError(f"namespace.block_size: must be > 0, got {self.block_size}")
        if self.page_bytes < 0:
            raise ConfigError(f"namespace.page_bytes: must be >= 0, got {self.page_bytes}")
        if self.group_kind not in GROUP_KINDS or self.group_id < 0 or self.window < 0:
            raise ConfigError(
                f"namespace.group: id {self.group_id} kind {self.group_kind!r} window "
                f"{self.window} (kinds: {', '.join(GROUP_KINDS)}; id and window >= 0)"
            )
        if (self.engine_id is not None and self.engine_id < 0) or self.node_engines < 1:
            raise ConfigError(
                f"namespace.engine_id: {self.engine_id} must be >= 0 and node_engines "
                f"{self.node_engines} >= 1"
            )
        for rank_key, size_key in (("tp_rank", "tp_size"), ("pp_rank", "pp_size")):
            rank, size = getattr(self, rank_key), getattr(self, size_key)
            if size < 1 or not 0 <= rank < size or size > 0xFFFF:
                raise ConfigError(f"namespace.{rank_key}: {rank} is not in 0..{size_key}={size}")

    @cached_property
    def prefix(self) -> bytes:
        ident = {
            "v": FORMAT_VERSION,
            "model": self.model,
            "revision": self.revision or "",
            "kv_dtype": self.kv_dtype.removeprefix("torch."),
            "kv_layout": self.kv_layout.upper(),
            "block_size": self.block_size,
            "tp_size": self.tp_size,
            "pp_size": self.pp_size,
            "hash_algo": self.hash_algo.lower(),
            "page_bytes": self.page_bytes,
            "model_identity": self.model_identity,
            "group_id": self.group_id,
            "group_kind": self.group_kind,
            "window": self.window,
        }
        canonical = json.dumps(ident, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.blake2b(canonical, digest_size=PREFIX_LEN).digest()

    def key(self, block_hash: bytes, variant: bytes = BASE_VARIANT) -> bytes:
        return self.keys((block_hash,), variant)[0]

    def keys(self, block_hashes: Iterable[bytes], variant: bytes = BASE_VARIANT) -> list[bytes]:
        if len(variant) != VARIANT_LEN:
            raise ValueError(f"key variant must be {VARIANT_LEN} bytes, got {len(variant)}")
        head = self.prefix + variant
        # No bytes(h) per hash: vLLM's hashes are bytes already (and bytes + any buffer is
        # bytes); the call per block was most of the cost of building keys.
        return [head + h for h in block_hashes]

    @cached_property
    def prefixes(self) -> frozenset[bytes]:
        """The prefixes of every group of this engine (this one's alone without `groups`)."""
        sizes = self.group_block_sizes or (self.block_size,) * len(self.groups)
        siblings = (
            replace(
                self, group_id=g, group_kind=k, window=w, page_bytes=p, block_size=b, groups=()
            ).prefix
            for (g, k, w, p), b in zip(self.groups, sizes, strict=True)
        )
        return frozenset((self.prefix, *siblings))

    def owns(self, key: bytes) -> bool:
        return len(key) > PREFIX_LEN + VARIANT_LEN and key[:PREFIX_LEN] in self.prefixes

    def owns_all(self, keys: JoinedKeys) -> bool:
        """`owns` of every key of `keys`, read from their buffer (no object kept per key)."""
        if not keys:
            return True
        if keys.width <= PREFIX_LEN + VARIANT_LEN:
            return False
        prefixes, joined, w = self.prefixes, keys.joined, keys.width
        return all(joined[i : i + PREFIX_LEN] in prefixes for i in range(0, len(joined), w))

    def block_hash(self, key: bytes) -> bytes:
        """The engine's block hash inside a logical key of this namespace."""
        if not self.owns(key):
            raise ValueError("key does not belong to this namespace")
        return key[PREFIX_LEN + VARIANT_LEN :]

    # --- per-rank isolation (worker side) ---
    @property
    def storage_tp_rank(self) -> int:
        """The TP rank whose shard holds this rank's blocks (rank 0 for replicated KV)."""
        return 0 if self.kv_replicated else self.tp_rank

    @property
    def writes_lower_tiers(self) -> bool:
        """Does this rank write its shard (False: it reads TP rank 0's copy of replicated KV)?"""
        return self.storage_tp_rank == self.tp_rank

    @cached_property
    def shard_tag(self) -> bytes:
        return SHARD_TAG.pack(self.storage_tp_rank, self.pp_rank)

    @property
    def shard_dir_name(self) -> str:
        engine = "" if self.engine_id is None else f"engine{self.engine_id}-"
        return f"{engine}tp{self.storage_tp_rank}-pp{self.pp_rank}"

    def is_sibling_shard(self, dir_name: str) -> bool:
        """Is `dir_name` the same rank's shard of another engine on this node (same tag)?"""
        rank = f"tp{self.storage_tp_rank}-pp{self.pp_rank}"
        return dir_name != self.shard_dir_name and bool(
            re.fullmatch(rf"(engine\d+-)?{rank}", dir_name)
        )

    def storage_key(self, key: bytes) -> bytes:
        return self.shard_tag + key

    def logical_key(self, storage_key: bytes) -> bytes | None:
        """Inverse of `storage_key`; None for keys of another shard or namespace."""
        tag = self.shard_tag
        if storage_key[: len(tag)] != tag:
            return None
        key = storage_key[len(tag) :]
        return key if self.owns(key) else None

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    def rank_share(self, total: int) -> int:
        """One rank's share of a configured size: per engine, or per node (cache_size_scope,
        instance_num) shared by `node_engines` engines."""
        return total // (self.world_size * self.node_engines)

    def lower_tier_share(self, total: int) -> int:
        """One shard's share of a lower-tier size: replicated KV has one shard per PP stage
        (TP rank 0's), which gets what the TP ranks would have split."""
        if self.kv_replicated:
            return total // (self.pp_size * self.node_engines)
        return self.rank_share(total)

    def for_rank(self, tp_rank: int, pp_rank: int = 0) -> Namespace:
        return replace(self, tp_rank=tp_rank, pp_rank=pp_rank)

    def for_group(
        self,
        group_id: int,
        kind: str,
        window: int = 0,
        *,
        page_bytes: int | None = None,
        block_size: int | None = None,
    ) -> Namespace:
        """The namespace of one KV cache group (ranks and model kept; `block_size`: the
        group's tokens per block where vLLM gave it its own)."""
        return replace(
            self,
            group_id=group_id,
            group_kind=kind,
            window=window,
            block_size=self.block_size if block_size is None else block_size,
            page_bytes=self.page_bytes if page_bytes is None else page_bytes,
        )
