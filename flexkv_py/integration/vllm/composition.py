"""The connector as a child of vLLM's `MultiConnector` (or Dynamo's `PdConnector`, a subclass).

A child gets a shallow copy of the engine's `VllmConfig` with its own `KVTransferConfig`, and no
handle on its parent. Two things need the parent, found on the child constructor's call stack:

- the load-failure policy vLLM's scheduler reads from the enclosing connector's config;
- `PdConnector` (kvbm 1.6) answers `get_num_new_matched_tokens` from its first child without
  recording which child loads the request, while vLLM 0.33's scheduler then asks
  `MultiConnector.get_loaded_kv_cache_group_ids`, which looks that record up: a KeyError on the
  first external hit. Under such a parent the child records itself.
"""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass
from typing import Any

_MAX_FRAMES = 32  # far above any MultiConnector nesting; bounds the walk


@dataclass
class ParentLink:
    """Where this child sits: `config` is the outermost MultiConnector's (the one the scheduler
    reads); `parent` / `index` are the direct parent and this child's place in it, kept only
    when that parent does not record the loading child itself."""

    config: Any
    parent: weakref.ReferenceType[Any] | None
    index: int

    @property
    def name(self) -> str:
        return str(self.config.kv_transfer_config.kv_connector)

    def record_loader(self, request_id: str) -> None:
        """Tell a parent that does not record it that this child loads `request_id`."""
        parent = self.parent() if self.parent is not None else None
        chosen = getattr(parent, "_requests_to_connector", None)
        if isinstance(chosen, dict) and request_id not in chosen:
            chosen[request_id] = self.index


def find_parent(depth: int = 1) -> ParentLink | None:
    """The MultiConnector(s) being constructed up the call stack, or None when the caller is not
    built as a child. `depth` skips the caller's own frames."""
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector

    link: ParentLink | None = None
    frame = sys._getframe(depth + 1)
    for _ in range(_MAX_FRAMES):
        if frame is None:
            break
        owner = frame.f_locals.get("self")
        config = frame.f_locals.get("vllm_config")
        if isinstance(owner, MultiConnector) and getattr(config, "kv_transfer_config", None):
            if link is None:  # the direct parent: children built so far precede this one
                index = len(getattr(owner, "_connectors", ()))
                records_itself = (
                    type(owner).get_num_new_matched_tokens
                    is MultiConnector.get_num_new_matched_tokens
                )
                link = ParentLink(config, None if records_itself else weakref.ref(owner), index)
            else:  # an outer MultiConnector: its config is the one the scheduler reads
                link.config = config
        frame = frame.f_back  # type: ignore[assignment]
    return link
