"""The recovered SSD inventory announced to routers: after a restart, worker (0, 0) reads what
its store kept with each block (token ids, parent hash, LoRA, extra keys: block_meta.py) in the
background, batched and bounded, and hands it over with its worker metadata a slice per step;
once the inventory is adopted, the scheduler publishes each still-cached block as a vLLM
`BlockStored` event (medium "DISK", as events.py maps the SSD tier) and remembers its origin for
later events. Nothing here blocks `register_kv_caches` or a step.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from flexkv_py.index.namespace import PREFIX_LEN
from flexkv_py.integration.vllm.block_meta import KEY_HEAD_LEN, decode_origin
from flexkv_py.integration.vllm.events import BlockOrigins, EventGroup, to_vllm_events

logger = logging.getLogger(__name__)

# Newest blocks announced after a restart (as many as the manager's event queue holds).
MAX_ANNOUNCED = 100_000
# Header pages read per store call, and metas handed to the scheduler per step.
READ_BATCH = 512
PER_STEP = 4096


class MetaSource(Protocol):
    def read_metas(self, logical_keys: Sequence[bytes]) -> list[bytes | None]: ...


class RecoveredMetaReader:
    """Worker side: reads the metadata of `keys` (newest MAX_ANNOUNCED) on a thread of its own."""

    def __init__(self, tier: MetaSource, keys: Sequence[bytes], label: str) -> None:
        self._keys = list(keys[-MAX_ANNOUNCED:])
        self._tier = tier
        self._label = label
        self._ready: deque[tuple[bytes, bytes]] = deque()
        self._stop = threading.Event()
        self.done = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="flexkv-recovered-metas", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        try:
            for lo in range(0, len(self._keys), READ_BATCH):
                if self._stop.is_set():
                    return
                keys = self._keys[lo : lo + READ_BATCH]
                for key, meta in zip(keys, self._tier.read_metas(keys), strict=True):
                    if meta is not None:
                        self._ready.append((key, meta))
        except Exception as e:
            logger.warning("%s: reading recovered block metadata failed: %s", self._label, e)
        finally:
            self.done.set()

    def take(self, most: int = PER_STEP) -> dict[bytes, bytes]:
        out: dict[bytes, bytes] = {}
        while self._ready and len(out) < most:
            key, meta = self._ready.popleft()
            out[key] = meta
        return out

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._thread.join(timeout)


@dataclass(frozen=True)
class _TierEvent:
    kind: str
    block_hash: bytes
    medium: str
    group_prefix: bytes = b""


class RecoveredAnnouncer:
    """Scheduler side: metas from the worker, held until the inventory is adopted (bounded),
    then turned into `BlockStored` events for the blocks the index still knows."""

    def __init__(
        self,
        origins: BlockOrigins,
        block_size: int,
        groups: Mapping[bytes, EventGroup] | None = None,
    ) -> None:
        self._origins = origins
        self._block_size = block_size
        self._groups = groups  # hybrid models: each block's group, by its key prefix
        self._pending: dict[bytes, bytes] = {}

    def add(self, metas: Mapping[bytes, bytes]) -> None:
        room = MAX_ANNOUNCED - len(self._pending)
        for key, meta in list(metas.items())[: max(0, room)]:
            self._pending[key] = meta

    def clear(self) -> None:
        """A cache reset: what was recovered before it is gone."""
        self._pending.clear()

    def take_events(self, adopted: bool, known: Callable[[bytes], bool]) -> list[Any]:
        if not adopted or not self._pending:
            return []
        pending, self._pending = self._pending, {}
        out: list[Any] = []
        whole = BlockOrigins()  # scaled groups' origins (whole blocks), kept apart
        groups = self._groups or {}
        for key, meta in pending.items():
            origin = decode_origin(meta)
            if origin is None or not known(key):
                continue
            block_hash, prefix = key[KEY_HEAD_LEN:], key[:PREFIX_LEN]
            # A block of several hash blocks shares its last one's hash with the other groups'
            # block there: its origin (all its tokens) must not replace theirs.
            scaled = groups.get(prefix, (0, None, None, 1))[3] > 1
            source = whole if scaled else self._origins
            source.remember(block_hash, origin)
            event = _TierEvent("stored", block_hash, "SSD", prefix)
            out += to_vllm_events(
                [event], source, self._block_size, self._groups, whole_origins=True
            )
        return out
