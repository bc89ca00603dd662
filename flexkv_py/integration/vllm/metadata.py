"""What travels between the scheduler-side and worker-side connector halves each step.

Scheduler -> workers (`FlexKVConnectorMetadata`, pickled to every worker: each TP rank of each PP
stage): the coordinator's jobs in creation order (a spill job must run before the store that
reuses its host slot), which request each belongs to, and request-level instructions (flush
stores of preempted requests, report when delayed-free requests' stores are done).

Workers -> scheduler (`FlexKVWorkerMetadata`, folded across all tp_size x pp_size workers by vLLM
with `aggregate`): the per-worker result of every finished job, how many workers ended each
store's GPU->host copy (the request's GPU blocks are no longer read there; the job may still be
writing to SSD), each worker's SSD inventory once after start, and transfer counters.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from flexkv_py.index.joined_keys import merge_links


@dataclass(frozen=True)
class JobEntry:
    """One coordinator job for the workers. `job` is None for a load the manager could not plan
    (its blocks vanished between lookup and allocation): workers report it failed at once."""

    req_id: str | None
    kind: str  # "load" | "store" | "background"
    job: Any | None
    gpu_block_ids: tuple[int, ...] = ()


@dataclass
class FlexKVConnectorMetadata(KVConnectorMetadata):
    jobs: list[JobEntry] = field(default_factory=list)
    # Preempted requests: their GPU blocks are reused from this step on, so in-flight stores
    # reading them must finish before the forward (handle_preemptions).
    flush_req_ids: set[str] = field(default_factory=set)
    # Store jobs still reading sliding-window blocks that this step hands out again (vLLM
    # freed them under a running request): their GPU->host copies must end before the forward.
    flush_job_ids: set[int] = field(default_factory=set)
    # Finished requests whose blocks vLLM keeps until we name them in finished_sending.
    delayed_free_req_ids: set[str] = field(default_factory=set)
    # min_hits > 1: keys the admission filter now admits (their shutdown drain writes only
    # those, shutdown_drain.py).
    drain_admitted: tuple[bytes, ...] = ()


def _merge_lists(a: dict[int, list[Any]], b: dict[int, list[Any]]) -> dict[int, list[Any]]:
    out = {k: list(v) for k, v in a.items()}
    for k, v in b.items():
        out.setdefault(k, []).extend(v)
    return out


@dataclass
class FlexKVWorkerMetadata(KVConnectorWorkerMetadata):
    # job_id -> one JobResult per rank that finished it (the scheduler waits for all ranks).
    results: dict[int, list[Any]] = field(default_factory=dict)
    # store job_id -> number of ranks whose GPU->host copy of it ended (each rank counts once,
    # no later than its result; the scheduler waits for all ranks, as for results).
    gpu_read_done: dict[int, int] = field(default_factory=dict)
    # (tp_rank, pp_rank) -> logical keys that worker's SSD shard holds (sent once, after
    # register_kv_caches; every PP stage holds its own layers of the same blocks).
    # Joined (index/joined_keys.py: one buffer, no object per block) when of one width.
    inventories: dict[tuple[int, int], Sequence[bytes]] = field(default_factory=dict)
    # Numeric transfer counters, summed over ranks.
    counters: dict[str, float] = field(default_factory=dict)
    # (tp_rank, pp_rank) -> leading host slots ready on that worker (pools prepared in the
    # background report as they grow; the scheduler uses the minimum over all workers).
    ready_slots: dict[tuple[int, int], int] = field(default_factory=dict)
    # Worker (0, 0)'s restart report also names each recovered block's chain parent (logical
    # keys), and then, a slice per step, the metadata its store kept with them (block_meta.py).
    inventory_parents: Mapping[bytes, bytes] = field(default_factory=dict)
    recovered_metas: dict[bytes, bytes] = field(default_factory=dict)
    # (tp_rank, pp_rank) -> sibling-shard keys that appeared / vanished on that worker since
    # its last report (node_inventory.py).
    node_added: dict[tuple[int, int], tuple[bytes, ...]] = field(default_factory=dict)
    node_removed: dict[tuple[int, int], tuple[bytes, ...]] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if not isinstance(other, FlexKVWorkerMetadata):
            raise TypeError(f"cannot aggregate FlexKVWorkerMetadata with {type(other).__name__}")
        counters = dict(self.counters)
        for k, v in other.counters.items():
            counters[k] = counters.get(k, 0) + v
        reads = dict(self.gpu_read_done)
        for job_id, n in other.gpu_read_done.items():
            reads[job_id] = reads.get(job_id, 0) + n
        return FlexKVWorkerMetadata(
            results=_merge_lists(self.results, other.results),
            gpu_read_done=reads,
            inventories={**self.inventories, **other.inventories},
            counters=counters,
            ready_slots={**self.ready_slots, **other.ready_slots},
            inventory_parents=merge_links(self.inventory_parents, other.inventory_parents),
            recovered_metas={**self.recovered_metas, **other.recovered_metas},
            node_added={**self.node_added, **other.node_added},
            node_removed={**self.node_removed, **other.node_removed},
        )

    def is_empty(self) -> bool:
        return not (
            self.results
            or self.gpu_read_done
            or self.inventories
            or self.counters
            or self.ready_slots
            or self.inventory_parents
            or self.recovered_metas
            or self.node_added
            or self.node_removed
        )
