"""The object tier's counters in the connector's stats (integration/vllm/stats.py COUNTERS),
beside the SSD's: vLLM logs and exports per-interval increments, while the tier and the
scheduler's lookups keep running totals, so each side turns its totals into increments here.

Worker side: the rank's `Tier.OBJECT` requests (every kind), I/O errors and timeouts (the
native tier's counters, rust/object/stats.rs). Scheduler side: polls answered "ask again
later", lookups that gave up (answered a miss after `object_store_lookup_wait_s`), and the
requests of the scheduler's own lookup tier.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

REQUEST_KINDS = (
    "get_requests",
    "put_requests",
    "head_requests",
    "delete_requests",
    "list_requests",
)


def tier_totals(native: Mapping[str, Any], prefix: str = "object") -> dict[str, int]:
    """Running totals of one object tier, from its `stats()` dict."""
    return {
        f"{prefix}_requests": sum(int(native.get(k, 0)) for k in REQUEST_KINDS),
        f"{prefix}_io_errors": int(native.get("io_errors", 0)),
        f"{prefix}_timeouts": int(native.get("timeouts", 0)),
    }


class Increments:
    """Running totals in, what each grew by since the last call out (zeros left out)."""

    def __init__(self) -> None:
        self._seen: dict[str, int] = {}

    def since_last(self, totals: Mapping[str, int]) -> dict[str, int]:
        out: dict[str, int] = {}
        for key, total in totals.items():
            grew = total - self._seen.get(key, 0)
            self._seen[key] = total
            if grew > 0:
                out[key] = grew
        return out
