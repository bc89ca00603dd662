"""Tier events -> vLLM KV events, so KV routers see blocks in host memory and on SSD.

Published when DYNAMO_USE_FLEXKV=1 (FlexKV's switch) or when vLLM's own KV events are on
(`--kv-events-config` with `enable_kv_cache_events`: other routers, e.g. llm-d's, read the same
stream); otherwise drained and dropped. The events have the shape of vLLM's own prefix-cache
events (token ids, block size, parent hash, LoRA, per-block extra keys, the KV cache group with
its spec kind and sliding window as vLLM's KVCacheManager annotates them; no session id),
with the medium that gained or lost the block: "CPU" for host memory, "DISK" for the SSD tier.
Those are the names Dynamo's router maps to its host-pinned and disk tiers; it does not know
FlexKV's "SSD" (an unknown medium is dropped or filed as GPU).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVCacheEvent
from vllm.v1.core.kv_cache_utils import (
    BlockHash,
    generate_block_hash_extra_keys,
    maybe_convert_block_hash,
)

from flexkv_py.integration.vllm.compat import event_fields, to_event_extra_keys

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from flexkv_py.integration.vllm.engine_info import GroupInfo

# Tier medium (the coordinator's names) -> the medium published to routers.
PUBLISHED_MEDIUM = {"CPU": "CPU", "SSD": "DISK"}


def events_enabled(kv_events_config: Any = None) -> bool:
    """DYNAMO_USE_FLEXKV=1, or vLLM's `--kv-events-config` with KV cache events enabled."""
    if os.environ.get("DYNAMO_USE_FLEXKV", "0").strip().lower() in ("1", "true", "yes"):
        return True
    return bool(getattr(kv_events_config, "enable_kv_cache_events", False))


@dataclass(frozen=True)
class BlockOrigin:
    parent_hash: bytes | None
    token_ids: tuple[int, ...]
    lora_id: int | None
    lora_name: str | None
    # vLLM's untagged per-block extra keys (LoRA name, (mm id, offset) pairs, cache_salt, ...).
    extra_keys: tuple[Any, ...] | None = None


class BlockOrigins:
    """Bounded memory of what each stored block hash covers (parent, tokens, LoRA), filled when
    we plan its store; events for blocks we no longer remember carry no token ids."""

    def __init__(self, capacity: int = 1 << 18) -> None:
        self._capacity = capacity
        self._items: OrderedDict[bytes, BlockOrigin] = OrderedDict()

    def remember(self, block_hash: bytes, origin: BlockOrigin) -> None:
        self._items[block_hash] = origin
        self._items.move_to_end(block_hash)
        while len(self._items) > self._capacity:
            self._items.popitem(last=False)

    def remember_request(
        self, req: Request, start: int, hashes: Sequence[Any], block_size: int
    ) -> None:
        """What blocks start.. of `req` (whose hashes are `hashes`) cover, as their store is
        planned: parent hash, token ids, LoRA and vLLM's per-block extra keys."""
        lora = req.lora_request
        tokens = req.all_token_ids
        mm_idx = 0  # a valid start for any block: features before it are skipped
        for i, h in enumerate(hashes):
            idx = start + i
            parent = bytes(req.block_hashes[idx - 1]) if idx > 0 else None
            keys, mm_idx = generate_block_hash_extra_keys(
                req, idx * block_size, (idx + 1) * block_size, mm_idx
            )
            event_keys = to_event_extra_keys([keys])
            self.remember(
                bytes(h),
                BlockOrigin(
                    parent_hash=parent,
                    token_ids=tuple(tokens[idx * block_size : (idx + 1) * block_size]),
                    lora_id=lora.adapter_id if lora is not None else None,
                    lora_name=lora.lora_name if lora is not None else None,
                    extra_keys=event_keys[0] if event_keys else None,
                ),
            )

    def get(self, block_hash: bytes) -> BlockOrigin | None:
        return self._items.get(block_hash)

    def clear(self) -> None:
        self._items.clear()


# A KV cache group as vLLM's own events describe it: (group_idx, kv_cache_spec_kind,
# kv_cache_spec_sliding_window, hash blocks per block of the group), found by the group's key
# prefix.
EventGroup = tuple[int, str | None, int | None, int]
_GROUP_0: EventGroup = (0, None, None, 1)


def scaled_origin(origins: BlockOrigins, last: BlockOrigin, scale: int) -> BlockOrigin | None:
    """The origin of a block of `scale` hash blocks, from the one of its last: its parent is
    the hash before its first, its tokens all of theirs (None if one is forgotten)."""
    parts = [last]
    while len(parts) < scale:
        parent = parts[-1].parent_hash
        prev = origins.get(parent) if parent is not None else None
        if prev is None:
            return None
        parts.append(prev)
    tokens = tuple(t for o in reversed(parts) for t in o.token_ids)
    return replace(last, parent_hash=parts[-1].parent_hash, token_ids=tokens)


def event_groups(
    groups: Iterable[GroupInfo],
) -> tuple[dict[bytes, EventGroup], dict[bytes, int]]:
    """(group prefix -> what its events name, group prefix -> scale for groups whose blocks are
    several hash blocks)."""
    named = {
        g.namespace.prefix: (g.group_id, g.event_kind, g.event_window, g.scale) for g in groups
    }
    return named, {p: g[3] for p, g in named.items() if g[3] > 1}


def to_vllm_events(
    tier_events: Iterable[Any],
    origins: BlockOrigins,
    block_size: int,
    groups: Mapping[bytes, EventGroup] | None = None,
    *,
    whole_origins: bool = False,
) -> list[KVCacheEvent]:
    """`tier_events`: objects with `kind` ("stored"|"removed"), `block_hash`, `medium` and
    `group_prefix` (hybrid models: `groups` maps it to the group; group 0 otherwise).
    `whole_origins`: `origins` already describe a scaled group's whole blocks (read back from
    the SSD), not their last hash block."""
    out: list[KVCacheEvent] = []
    for ev in tier_events:
        medium = PUBLISHED_MEDIUM.get(str(ev.medium).upper())
        if medium is None:
            continue
        group_idx, spec_kind, spec_window, scale = (groups or {}).get(
            getattr(ev, "group_prefix", b""), _GROUP_0
        )
        block_hash = bytes(ev.block_hash)
        if ev.kind == "stored":
            origin = origins.get(block_hash)
            if origin is not None and scale > 1 and not whole_origins:
                origin = scaled_origin(origins, origin, scale)
            out.append(
                _event(
                    BlockStored,
                    block_hashes=[maybe_convert_block_hash(BlockHash(block_hash))],
                    parent_block_hash=(
                        maybe_convert_block_hash(BlockHash(origin.parent_hash))
                        if origin is not None and origin.parent_hash is not None
                        else None
                    ),
                    token_ids=list(origin.token_ids) if origin is not None else [],
                    block_size=block_size * scale,
                    lora_id=origin.lora_id if origin is not None else None,
                    medium=medium,
                    lora_name=origin.lora_name if origin is not None else None,
                    # One entry per block, None for a block without extra keys (as vLLM does).
                    extra_keys=[origin.extra_keys] if origin is not None else None,
                    group_idx=group_idx,
                    kv_cache_spec_kind=spec_kind,
                    kv_cache_spec_sliding_window=spec_window,
                )
            )
        elif ev.kind == "removed":
            out.append(
                _event(
                    BlockRemoved,
                    block_hashes=[maybe_convert_block_hash(BlockHash(block_hash))],
                    medium=medium,
                    group_idx=group_idx,
                )
            )
    return out


def _event(struct: type, **fields: Any) -> Any:
    """`struct(**fields)` with only the fields this vLLM's event struct has (the group fields
    came with vLLM 0.23, later ones may go)."""
    known = _FIELDS.get(struct)
    if known is None:
        known = _FIELDS[struct] = event_fields(struct)
    return struct(**{k: v for k, v in fields.items() if k in known})


_FIELDS: dict[type, frozenset[str]] = {}
