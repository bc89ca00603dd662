"""What survived a restart on every worker's SSD shard, gathered and then adopted by the index.

Each worker (one per (tp_rank, pp_rank): under PP every stage holds other layers of the same
blocks) reports the logical keys its SSD shard holds once, after register_kv_caches. A block can
be loaded only if every worker has its shard, so the scheduler gathers all tp_size x pp_size
reports and adopts the keys every one of them holds; a report keyed by TP rank alone would let
one stage's report replace another's, and a block one stage lost would be loaded and fail there.

So that the first request after a restart can hit, the scheduler side reads the shards itself
when it is built, read-only (tiers/ssd/inventory.py) and on a thread of its own that the first
scheduler call waits for (restart_read.py), and adopts what every shard holds (`adopt_read`).
The reports stay the authority: when they are all in, blocks they do not all list leave the
index and blocks only they list are adopted (coordinator/adopted_before.py); nothing is
adopted or counted twice. A shard the scheduler cannot read leaves it as before.

Lookups never wait for the reports: blocks not adopted yet are missed (0). Waiting ("ask again
later", None) would stall serving: vLLM skips a request that gets None.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from flexkv_py.config import FlexKVConfig
from flexkv_py.coordinator.adopted_before import AdoptedBefore
from flexkv_py.coordinator.manager import ssd_capacity_blocks
from flexkv_py.index.joined_keys import merge_links
from flexkv_py.integration.vllm.events import BlockOrigins, EventGroup
from flexkv_py.integration.vllm.recovered_events import RecoveredAnnouncer
from flexkv_py.integration.vllm.restart_read import RestartRead
from flexkv_py.process_memory import return_freed_memory
from flexkv_py.tiers.ssd.inventory import SsdInventory, read_ssd_inventory

if TYPE_CHECKING:
    from flexkv_py.integration.vllm.engine_info import EngineInfo

WorkerRank = tuple[int, int]  # (tp_rank, pp_rank)

# Chain parents arrive with worker (0, 0)'s report (every worker holds the same chains).
PARENTS_RANK: WorkerRank = (0, 0)


class RestartInventory:
    def __init__(self, num_workers: int, *, enabled: bool) -> None:
        """`enabled`: an SSD tier exists (without one there is nothing to wait for)."""
        self._num_workers = num_workers
        self._reports: dict[WorkerRank, Sequence[bytes]] = {}
        self.ready = not enabled
        # The cache was reset before the reports were in: what they list predates the reset
        # and must be deleted, not adopted.
        self.stale = False
        # Logical key -> its chain parent's, from the reports (for prefix-aware adoption);
        # joined links (index/joined_keys.py) as they came when one report sent them all.
        self._parents: Mapping[bytes, bytes] = {}
        self._announcer: RecoveredAnnouncer | None = None
        # Blocks adopted from the scheduler's own read of the shards, until the reports settle.
        self._before: AdoptedBefore | None = None
        self.adopted_early = 0  # how many (for logs and tests)
        self._read: RestartRead[SsdInventory | None] | None = None
        # The reports were adopted: once vLLM has dropped their step's metadata (the next
        # step), the heap they and the settle freed goes back to the OS (process_memory.py).
        self._reports_freed_next = False

    def announce_with(
        self,
        origins: BlockOrigins,
        block_size: int,
        groups: Mapping[bytes, EventGroup] | None = None,
    ) -> None:
        """Publish the recovered blocks' origins (token ids...) once adopted (take_events);
        `groups`: each block's KV cache group by its key prefix (hybrid models)."""
        self._announcer = RecoveredAnnouncer(origins, block_size, groups)

    def start_read(self, manager: Any, config: FlexKVConfig, info: EngineInfo) -> None:
        """Read the engine's shards on a thread and adopt what they hold into `manager` (a
        CacheManager); `wait_read` before using the index."""
        ns = info.namespace
        # More blocks than the index holds on SSD: it evicts at adoption, so it needs the links.
        capacity = ssd_capacity_blocks(config, ns, info.page_bytes)
        self._read = RestartRead(
            lambda: read_ssd_inventory(config, ns, parents_over=capacity),
            lambda found: self.adopt_read(manager, found),
        )

    def wait_read(self) -> None:
        """Until the shards' blocks are adopted, or their read was given up (bounded)."""
        if self._read is not None:
            self._read.wait()
            self._read = None

    def adopt_read(self, manager: Any, inventory: SsdInventory | None) -> None:
        """Adopt what the scheduler read from the shards itself (None: they could not be read),
        before any report; the reports then settle the difference."""
        if inventory is None or not inventory.keys or self.ready:
            return
        self.adopted_early = manager.adopt_ssd_keys(
            [inventory.keys], parents=inventory.parents, checked=True
        )
        self._before = AdoptedBefore(inventory.keys)

    def adopt_reports(self, manager: Any, meta: Any) -> None:
        """Take a step's worker metadata (FlexKVWorkerMetadata): reports, parents, metas; adopt
        into `manager` (a CacheManager) once every worker reported."""
        ranks = self.add(meta.inventories, meta.inventory_parents)
        if ranks is not None:
            parents = self.take_parents()
            before, self._before = self._before, None
            manager.adopt_ssd_keys(ranks, adopt=not self.stale, parents=parents, before=before)
            self._reports_freed_next = True
        if self._announcer is not None and meta.recovered_metas and not self.stale:
            self._announcer.add(meta.recovered_metas)

    def after_step(self) -> None:
        """A step's output arrived: the step before's metadata is gone (see __init__)."""
        if self._reports_freed_next:
            self._reports_freed_next = False
            return_freed_memory("the workers' restart reports")

    def take_events(self, known: Callable[[bytes], bool]) -> list[Any]:
        """BlockStored events for recovered blocks still `known`, once adopted."""
        if self._announcer is None or not self.ready:
            return []
        return self._announcer.take_events(True, known)

    def forget(self) -> None:
        """A cache reset: reports still to come list blocks to delete (the reset forgot
        those adopted early too)."""
        self.stale = not self.ready
        self._before = None
        if self._announcer is not None:
            self._announcer.clear()

    def add(
        self,
        reports: Mapping[WorkerRank, Sequence[bytes]],
        parents: Mapping[bytes, bytes] | None = None,
    ) -> list[Sequence[bytes]] | None:
        """Take workers' reports; once every worker reported, return them (in rank order, for
        CacheManager.adopt_ssd_keys, which keeps the keys all of them hold) and become ready.
        `parents`: chain parents reported with them (then in `take_parents`)."""
        if self.ready:
            return None
        if parents:
            self._parents = merge_links(self._parents, parents)
        if not reports:
            return None
        self._reports.update(reports)
        if len(self._reports) < self._num_workers:
            return None
        self.ready = True
        ranks = [self._reports[r] for r in sorted(self._reports)]
        self._reports = {}
        return ranks

    def take_parents(self) -> Mapping[bytes, bytes]:
        """The chain parents of the reported blocks (once, at adoption)."""
        parents, self._parents = self._parents, {}
        return parents
