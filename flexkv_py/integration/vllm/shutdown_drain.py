"""The worker's shutdown drain: host blocks that never reached the SSD are written to it within
a budget (`shutdown_drain_s`), so a restart finds them (write-behind owes at most its lag).

vLLM calls the connector's `shutdown` only after the last step, so the scheduler can hand out no
more write-behind jobs then; each worker therefore remembers which of its host slots hold a block
that is readable and not on the SSD (a store that committed to host only), and forgets a slot as
soon as a job fills it again, writes it to the SSD, or the cache is reset. Only blocks whose store
succeeded are kept, so a drain never persists KV that is not the key's. With an admission filter
(`min_hits` > 1) only the blocks the scheduler named admitted (their access count reached
min_hits: `drain_admitted` in the step metadata) are written, as write-behind and eviction would:
a block seen too rarely is not worth its SSD wear at shutdown either. The drain writes oldest
first (parents before their children), in batches, each bounded by what is left of the budget; a
stuck device leaves the rest unwritten and the slots fenced (late_io.py), never a hang.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Any

from flexkv_py.coordinator.jobs import LoadJob, SpillJob, StoreJob
from flexkv_py.index.tier_names import Tier

logger = logging.getLogger(__name__)

DRAIN_BATCH = 64
# Admitted keys remembered per worker (a key can be named before its store finishes here).
MAX_ADMITTED = 1 << 20


class HostOnlyBlocks:
    """Host slot -> (key, parent, meta) of a committed block with no SSD copy on this worker."""

    def __init__(self, min_hits: int = 1) -> None:
        self._by_slot: dict[int, tuple[bytes, bytes | None, bytes | None]] = {}
        self._min_hits = min_hits
        self._admitted: dict[bytes, None] = {}  # min_hits > 1: keys the filter admits

    def admit(self, keys: Sequence[bytes]) -> None:
        """The scheduler's admission filter now admits `keys` (min_hits reached)."""
        if self._min_hits <= 1:
            return
        for k in keys:
            self._admitted[k] = None
        while len(self._admitted) > MAX_ADMITTED:
            del self._admitted[next(iter(self._admitted))]

    def __len__(self) -> int:
        return len(self._by_slot)

    def submitted(self, job: Any) -> None:
        """A job is about to run: slots it fills or writes out no longer hold a host-only block."""
        if isinstance(job, StoreJob):
            self._forget(job.spill.src.places() or ())
            self._forget(job.host_slots)
        elif isinstance(job, LoadJob):
            self._forget(job.spill.src.places() or ())
            for read in job.reads:  # the staging slots its reads fill
                self._forget(read.dst.places() or ())
        elif isinstance(job, SpillJob) and job.tier is Tier.SSD:
            self._forget(job.host_slots)

    def finished(self, job: StoreJob, result: Any) -> None:
        """A store ended: its blocks committed to host and not written to the SSD are owed."""
        failed = result.failed
        on_ssd = set(job.writes_to(Tier.SSD))
        not_written = result.write_failed_on(Tier.SSD)
        for i, (key, slot) in enumerate(zip(job.keys, job.host_slots, strict=True)):
            if key in failed or (i in on_ssd and key not in not_written):
                continue
            parent = job.blocks.parents[i] if job.blocks.parents else None
            meta = job.blocks.metas[i] if job.blocks.metas else None
            self._by_slot[slot] = (key, parent, meta)

    def reset(self) -> None:
        self._by_slot.clear()
        self._admitted.clear()

    def owed(self) -> list[tuple[int, tuple[bytes, bytes | None, bytes | None]]]:
        """(slot, (key, parent, meta)) of the blocks the drain writes, oldest first."""
        if self._min_hits <= 1:
            return list(self._by_slot.items())
        return [(s, b) for s, b in self._by_slot.items() if b[0] in self._admitted]

    def _forget(self, slots: Sequence[int]) -> None:
        for s in slots:
            self._by_slot.pop(s, None)

    def drain(self, ssd: Any, pool: Any, late_io: Any, budget_s: float) -> tuple[int, bool]:
        """Write the owed blocks to `ssd` within `budget_s`; (blocks written, device stuck)."""
        deadline = time.monotonic() + budget_s
        owed = self.owed()
        written = 0
        addr, nbytes = pool.slot_address, pool.slot_nbytes
        for lo in range(0, len(owed), DRAIN_BATCH):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            part = owed[lo : lo + DRAIN_BATCH]
            slots = [s for s, _ in part]
            items = [(k, (addr(s), nbytes)) for s, (k, _, _) in part]
            batch = ssd.submit_put(
                items, parents=[p for _, (_, p, _) in part], metas=[m for _, (_, _, m) in part]
            )
            results = late_io.wait(batch, slots, "write", Tier.SSD, left)
            if results is None:  # a stuck device: its slots stay fenced, the rest waits no more
                return written, True
            written += sum(1 for r in results if r.ok)
            self._forget(slots)
        return written, False
