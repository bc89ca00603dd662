"""What the SSD keeps with each block beside its KV (the store's per-block metadata, in the
block's header page): the block's token ids, parent hash, LoRA and vLLM's extra keys, so that a
restarted worker can announce its recovered inventory to routers as vLLM `BlockStored` events.

The encoding is compact (it also travels in the connector metadata with every stored block):
token ids as little-endian u32, the rest length-prefixed; extra keys as JSON with tuples and
bytes tagged. Unknown versions or damaged bytes decode to None (the block is still served; it
is only announced without token ids).
"""

from __future__ import annotations

import dataclasses
import json
import struct
from collections.abc import Mapping, Sequence
from typing import Any

from flexkv_py.coordinator.jobs import LoadJob, SpillJob, StoreJob
from flexkv_py.coordinator.legs import Blocks
from flexkv_py.index.namespace import PREFIX_LEN, VARIANT_LEN
from flexkv_py.integration.vllm.events import BlockOrigin, BlockOrigins, scaled_origin
from flexkv_py.integration.vllm.metadata import JobEntry

VERSION = 1
_PARENT, _LORA_ID, _LORA_NAME, _EXTRA = 1, 2, 4, 8
# Bytes of a logical key before the engine's block hash (namespace prefix + variant).
KEY_HEAD_LEN = PREFIX_LEN + VARIANT_LEN


def _tag(value: Any) -> Any:
    if isinstance(value, tuple | list):
        return {"t": [_tag(v) for v in value]}
    if isinstance(value, bytes):
        return {"b": value.hex()}
    return value


def _untag(value: Any) -> Any:
    if isinstance(value, dict):
        if "t" in value:
            return tuple(_untag(v) for v in value["t"])
        return bytes.fromhex(value["b"])
    return value


def encode_origin(origin: BlockOrigin) -> bytes:
    tokens = origin.token_ids
    flags = (
        (_PARENT if origin.parent_hash is not None else 0)
        | (_LORA_ID if origin.lora_id is not None else 0)
        | (_LORA_NAME if origin.lora_name is not None else 0)
        | (_EXTRA if origin.extra_keys is not None else 0)
    )
    out = bytearray(struct.pack("<BBI", VERSION, flags, len(tokens)))
    out += struct.pack(f"<{len(tokens)}I", *tokens)
    if origin.parent_hash is not None:
        out += struct.pack("<H", len(origin.parent_hash)) + origin.parent_hash
    if origin.lora_id is not None:
        out += struct.pack("<q", origin.lora_id)
    if origin.lora_name is not None:
        name = origin.lora_name.encode()
        out += struct.pack("<H", len(name)) + name
    if origin.extra_keys is not None:
        extra = json.dumps(_tag(origin.extra_keys), separators=(",", ":")).encode()
        out += struct.pack("<I", len(extra)) + extra
    return bytes(out)


def decode_origin(blob: bytes) -> BlockOrigin | None:
    """The origin `encode_origin` wrote, or None for bytes of another version or damaged."""
    try:
        version, flags, n = struct.unpack_from("<BBI", blob, 0)
        if version != VERSION:
            return None
        tokens = struct.unpack_from(f"<{n}I", blob, 6)
        pos = 6 + 4 * n
        parent = lora_id = lora_name = extra = None
        if flags & _PARENT:
            (ln,) = struct.unpack_from("<H", blob, pos)
            parent = bytes(blob[pos + 2 : pos + 2 + ln])
            pos += 2 + ln
        if flags & _LORA_ID:
            (lora_id,) = struct.unpack_from("<q", blob, pos)
            pos += 8
        if flags & _LORA_NAME:
            (ln,) = struct.unpack_from("<H", blob, pos)
            lora_name = bytes(blob[pos + 2 : pos + 2 + ln]).decode()
            pos += 2 + ln
        if flags & _EXTRA:
            (ln,) = struct.unpack_from("<I", blob, pos)
            extra = _untag(json.loads(bytes(blob[pos + 4 : pos + 4 + ln])))
            pos += 4 + ln
        if pos != len(blob):
            return None
        return BlockOrigin(parent, tokens, lora_id, lora_name, extra)
    except (struct.error, ValueError, KeyError, TypeError):
        return None


def parent_key(key: bytes, origin: BlockOrigin | None) -> bytes | None:
    """The logical key of `key`'s chain parent (same namespace and variant), if it has one."""
    if origin is None or origin.parent_hash is None:
        return None
    return key[:KEY_HEAD_LEN] + origin.parent_hash


def _extras(
    keys: Sequence[bytes], origins: BlockOrigins, scales: Mapping[bytes, int]
) -> tuple[tuple[bytes | None, ...], tuple[bytes | None, ...]] | None:
    """Parents and metas of `keys` from what the scheduler remembers (None: it knows none);
    a key of a group of `scales[prefix]` hash blocks per block describes its whole block."""
    found = [origins.get(k[KEY_HEAD_LEN:]) for k in keys]
    if scales:
        found = [
            o
            if o is None or scales.get(k[:PREFIX_LEN], 1) == 1
            else scaled_origin(origins, o, scales[k[:PREFIX_LEN]])
            for k, o in zip(keys, found, strict=True)
        ]
    if all(o is None for o in found):
        return None
    return (
        tuple(parent_key(k, o) for k, o in zip(keys, found, strict=True)),
        tuple(None if o is None else encode_origin(o) for o in found),
    )


def with_block_metas(
    entries: Sequence[JobEntry],
    origins: BlockOrigins,
    scales: Mapping[bytes, int] | None = None,
) -> list[JobEntry]:
    """The step's jobs with each stored or spilled block's parent and metadata filled in from
    what the scheduler remembers of it (blocks it no longer remembers go without), the blocks
    a store or load spills first (its `spill` leg) included."""
    out: list[JobEntry] = []
    for entry in entries:
        job = entry.job
        changes: dict[str, Any] = {}
        if isinstance(job, StoreJob) and not job.blocks.metas and job.keys:
            extras = _extras(job.keys, origins, scales or {})
            if extras is not None:  # its write legs (write-through) carry them too
                job = job.with_blocks(Blocks(job.keys, extras[0], extras[1]))
                entry = dataclasses.replace(entry, job=job)
        if isinstance(job, SpillJob) and not job.leg.blocks.metas and job.keys:
            extras = _extras(job.keys, origins, scales or {})
            if extras is not None:
                blocks = Blocks(job.keys, extras[0], extras[1])
                changes.update(leg=dataclasses.replace(job.leg, blocks=blocks))
        spill = job.spill if isinstance(job, StoreJob | LoadJob) else None
        if spill is not None and spill.keys and not spill.blocks.metas:
            extras = _extras(spill.keys, origins, scales or {})
            if extras is not None:
                blocks = Blocks(spill.keys, extras[0], extras[1])
                changes.update(spill=dataclasses.replace(spill, blocks=blocks))
        if changes:
            assert job is not None
            entry = dataclasses.replace(entry, job=dataclasses.replace(job, **changes))
        out.append(entry)
    return out
