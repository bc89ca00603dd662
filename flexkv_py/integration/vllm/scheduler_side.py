"""Scheduler half of the connector: decides loads and stores, tracks them until every rank is done.

Decisions come from the coordinator's `CacheManager` (tier index); this module only translates
vLLM's request lifecycle into manager calls and picklable jobs:

- lookup: full blocks beyond the local GPU hit, answered as an asynchronous load;
- store: blocks are offloaded as they fill (prefill chunks and decode), not only at finish;
- finish: GPU blocks stay allocated (delay_free) only while a store still reads them: until every
  rank reported the store's GPU->host copy ended (`gpu_read_done`), not until its SSD
  write-through is done; the manager still commits or fails the keys only from the job's results;
- preemption: workers finish the stores of preempted requests before the blocks are reused;
- hybrid models (several KV cache groups): a hit is what every group can restore
  (hybrid_hit.py), one job moves every group's blocks (group_plans.py), and stores reading
  sliding-window blocks that vLLM hands out again are waited for (group_plans.ReuseFence).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

from flexkv_py.coordinator import CacheManager, JobResult
from flexkv_py.coordinator.planning import host_pool_in_background
from flexkv_py.index.tier_names import Tier
from flexkv_py.integration.vllm import compat
from flexkv_py.integration.vllm.block_meta import with_block_metas
from flexkv_py.integration.vllm.engine_info import EngineInfo
from flexkv_py.integration.vllm.events import BlockOrigins, event_groups, to_vllm_events
from flexkv_py.integration.vllm.group_plans import allocated_block_ids
from flexkv_py.integration.vllm.hit_sources import add_tier_hits, tokens_by_tier
from flexkv_py.integration.vllm.hybrid_plan import HybridPlan
from flexkv_py.integration.vllm.identity import AdapterVariants
from flexkv_py.integration.vllm.load_planning import LoadPlanner
from flexkv_py.integration.vllm.metadata import (
    FlexKVConnectorMetadata,
    FlexKVWorkerMetadata,
    JobEntry,
)
from flexkv_py.integration.vllm.node_inventory import NodeInventory
from flexkv_py.integration.vllm.remote_hits import DenseShape, RemoteHits
from flexkv_py.integration.vllm.request_keys import RequestKeys
from flexkv_py.integration.vllm.request_state import JobInfo, LoadingKeys, RequestState
from flexkv_py.integration.vllm.restart_inventory import RestartInventory
from flexkv_py.integration.vllm.stats import FlexKVConnectorStats
from flexkv_py.integration.vllm.store_planning import StorePlanner
from flexkv_py.tiers.object.counters import Increments

if TYPE_CHECKING:
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from flexkv_py.config import FlexKVConfig

logger = logging.getLogger(__name__)


class SchedulerSide:
    def __init__(
        self,
        info: EngineInfo,
        config: FlexKVConfig,
        block_tables: Callable[[str], Sequence[Sequence[int]]] | None,
    ) -> None:
        """`block_tables`: req_id -> the request's GPU block ids per KV cache group, from the
        KV cache manager vLLM binds to the connector; None where vLLM binds none (before 0.31):
        they are then followed in the scheduler output (compat.BlockTables)."""
        self._info = info
        self._config = config
        self._ns = info.namespace
        self._bs = info.block_size
        self._followed_tables = compat.BlockTables() if block_tables is None else None
        tables = block_tables or self._followed_tables.get  # type: ignore[union-attr]
        background = host_pool_in_background(config, self._ns, info.page_bytes, serving=True)
        # A background pool has no usable slot until every worker reported its ready slots.
        self._mgr = CacheManager(
            config, self._ns, info.page_bytes, usable_host_slots=0 if background else None
        )
        self._ready_slots: dict[tuple[int, int], int] = {}
        self._reqs: dict[str, RequestState] = {}
        # req_id -> (local tokens given to the lookup, hit blocks): remembered between
        # get_num_new_matched_tokens and update_state_after_alloc.
        self._lookups: dict[str, tuple[int, int]] = {}
        # req_id -> tokens of its external hit per tier, for vLLM's hit-source metrics.
        self._hit_sources: dict[str, dict[Tier, int]] = {}
        self._jobs: dict[int, JobInfo] = {}
        self._loading_keys = LoadingKeys()
        # Where vLLM stops stepping while stores are in flight (no has_pending_push_work hook,
        # before 0.26), a request arriving after an idle spell would be looked up before the
        # results of the stores of its own prefix came back, and miss: such a request is asked
        # again (None) until they do, for at most store_wait_s.
        self._storing_keys = None if compat.ENGINE_STEPS_FOR_STORES else LoadingKeys()
        self._store_waits: dict[str, float] = {}
        self._store_wait_s = float(config.ssd_io_timeout_s)
        self._step_jobs: list[JobEntry] = []
        self._delayed_free: set[str] = set()
        # What survived a restart on every worker's SSD: read from the shards on a thread the
        # first scheduler call waits for (bounded), settled by the workers' reports. A block not
        # adopted is missed (0), never "ask again later" (None): vLLM skips a request that gets
        # None, so waiting for the reports would stall serving.
        self._inventory = RestartInventory(info.num_workers, enabled=config.ssd_enabled)
        if config.ssd_enabled:  # read now, so the first request can hit; the reports settle it
            self._inventory.start_read(self._mgr, config, info)
        self._origins = BlockOrigins()
        # Groups whose blocks are several hash blocks: their SSD metadata covers whole blocks.
        self._event_groups, self._scales = event_groups(info.groups)
        self._inventory.announce_with(
            self._origins, self._bs, self._event_groups if info.hybrid else None
        )
        # Sibling engines' blocks on this node, kept up to date by the workers' refreshes.
        self._node = NodeInventory(info.num_workers)
        # LoRA requests key their blocks by the adapter's identity, not only its name.
        self._variants = AdapterVariants()
        # Keys per request, kept across its scheduling attempts (vLLM asks every step).
        self._keys = RequestKeys(self._ns)
        # Hybrid models: one namespace (and key memo) per KV cache group.
        interval = config.sliding_store_interval_blocks
        self._hybrid = (
            HybridPlan(info.groups, self._bs, interval, info.hit_align_blocks)
            if info.hybrid
            else None
        )
        self._store_planner = StorePlanner(self._ns, self._bs, self._hybrid, tables)
        self._load_planner = LoadPlanner(self._keys, self._hybrid)
        self._events_on = info.publish_kv_events
        self._stats = FlexKVConnectorStats()
        shape = self._hybrid if self._hybrid is not None else DenseShape(self._keys, self._ns)
        self._objects = RemoteHits.open(config, info, self._mgr, shape)
        self._object_increments = Increments()

    # ---------------------------------------------------------------- lookup / load
    def get_num_new_matched_tokens(
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        self._inventory.wait_read()
        if not self._info.can_load:
            return 0, False
        hashes = request.block_hashes
        first = num_computed_tokens // self._bs
        if first >= len(hashes):
            return 0, False
        state = self._reqs.get(request.request_id)
        if state is not None and state.no_more_loads:
            self._stats.add("lookups_after_failed_load", 1)
            return 0, False
        variant = self._variants.variant(request.lora_request)
        hit = self._load_planner.hit(request, first, variant, self._mgr.readable_hashes)
        if self._objects is not None:  # the rest of the prompt from the bucket, never waited on
            remote = self._objects.hit(request, variant, first, hit)
            if remote is None:
                return None, False
            hit = remote
        if self._storing_keys and self._waits_for_store(request, variant, first + hit):
            return None, False
        self._mgr.count_lookup(hit)
        self._stats.add("lookup_blocks", len(hashes) - first)
        if hit == 0:
            return 0, False
        if self._loading_keys:
            keys = self._load_planner.hit_keys(request, variant, first, first + hit)
            if self._loading_keys.any_of(keys):
                # Another request is loading this prefix: wait, then take it from the GPU cache.
                return None, False
        ext_tokens = min(hit * self._bs, request.num_tokens - num_computed_tokens)
        if ext_tokens <= 0:
            return 0, False
        if (
            state is not None
            and state.failed_load_end is not None
            and self._no_reload(state, first + hit)
        ):
            return 0, False
        self._lookups[request.request_id] = (num_computed_tokens, hit)
        return ext_tokens, True

    def _no_reload(self, state: RequestState, end: int) -> bool:
        """Whether a request whose load failed is refused a load that ends at `end` (and
        recomputes instead). Offered again, the same blocks can fail the same way (no host slot
        to stage them: a loop of load errors), so a load is offered again only if it ends
        before the failed one did: the failure made the index forget what it could not bring.
        And vLLM (0.33) keeps a request whose async load failed with no valid token in its
        in-flight prefills: a second async load reserves the request's own blocks against
        itself, and when they do not fit twice vLLM refuses it at the head of the queue every
        step, scheduling nothing. Asked again before vLLM allocated for the load offered, it
        was refused: from then on the request recomputes."""
        assert state.failed_load_end is not None
        if state.reoffer_pending:
            state.no_more_loads = True
            self._stats.add("reloads_refused_by_vllm", 1)
        if state.no_more_loads or end >= state.failed_load_end:
            self._stats.add("lookups_after_failed_load", 1)
            return True
        state.reoffer_pending = True
        return False

    def _waits_for_store(self, request: Request, variant: bytes, position: int) -> bool:
        """Whether the block at `position` (the first the hit lacks) is being stored, and the
        request has not waited for it longer than the bound."""
        if position >= len(request.block_hashes):
            return False
        key = self._load_planner.hit_keys(request, variant, position, position + 1)
        assert self._storing_keys is not None
        if not self._storing_keys.any_of(key):
            self._store_waits.pop(request.request_id, None)
            return False
        now = time.monotonic()
        since = self._store_waits.setdefault(request.request_id, now)
        return now - since < self._store_wait_s

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        state = self._state(request)
        state.reoffer_pending = False
        lookup = self._lookups.pop(request.request_id, None)
        if num_external_tokens == 0 or lookup is None:
            return
        local_tokens, _ = lookup
        first = local_tokens // self._bs
        count = -(-num_external_tokens // self._bs)
        variant = self._variants.variant(request.lora_request)
        tables = blocks.get_block_ids()
        if self._followed_tables is not None:
            self._followed_tables.set(request.request_id, tables)
        keys, block_ids, n_full = self._load_planner.plan(
            request, variant, tables, first, count, self._stats
        )
        # No keys: a group cannot be written (hybrid_plan.load); the load fails, vLLM recomputes.
        job = self._mgr.prepare_load(keys, block_ids) if keys else None
        self._stats.add("hit_blocks", count)
        add_tier_hits(self._stats, job)
        # Hit sources by tier from the first group's blocks (the hit's tokens, once).
        split = tokens_by_tier(job, n_full, num_external_tokens, self._bs)
        self._hit_sources[request.request_id] = split
        state.load_end = first + count
        if job is None:
            logger.warning("%s: blocks vanished before load; recomputing", request.request_id)
            state.failed_load_end = state.load_end
        else:
            self._jobs[job.job_id] = JobInfo(job.job_id, request.request_id, "load", tuple(keys))
            state.load_job = job.job_id
            self._loading_keys.add(keys)
        state.loading = True
        self._step_jobs.append(JobEntry(request.request_id, "load", job, tuple(block_ids)))
        # Loaded blocks are already in our tiers: the store planner starts after them.
        state.planned_blocks = max(state.planned_blocks, first + count)

    def take_hit_sources(self, request: Request) -> dict[Tier, int] | None:
        """Tokens of this request's last external hit per tier (then forgotten)."""
        return self._hit_sources.pop(request.request_id, None)

    # ---------------------------------------------------------------- per-step planning
    def build_connector_meta(self, so: SchedulerOutput) -> FlexKVConnectorMetadata:
        self._inventory.wait_read()
        meta = FlexKVConnectorMetadata()
        if self._followed_tables is not None:
            self._followed_tables.offer(so)
        if self._hybrid is not None:
            if len(self._hybrid.fence):
                # Before this step's stores are planned: those read blocks computed this step.
                meta.flush_job_ids = self._hybrid.fence.reading(allocated_block_ids(so))
            self._hybrid.states.offer(so)
        for req_id in so.preempted_req_ids or ():
            state = self._reqs.get(req_id)
            if state is not None:
                meta.flush_req_ids.add(req_id)
                # The flush makes the old blocks safe to reuse; the resumed request gets new
                # blocks and re-plans (keys already stored are skipped by the manager).
                state.store_jobs.clear()
                state.planned_blocks = 0
                if self._hybrid is not None:
                    self._hybrid.states.forget(req_id)
        if self._info.can_store:
            for req_id, num_new in so.num_scheduled_tokens.items():
                state = self._reqs.get(req_id)
                if state is not None:
                    req = state.request
                    self._plan_store(state, req.num_computed_tokens + num_new)
        for job in self._mgr.take_jobs():
            self._add_background(job)
        if self._config.ssd_enabled:  # the SSD keeps each block's token ids and parent
            self._step_jobs = with_block_metas(self._step_jobs, self._origins, self._scales)
        meta.jobs, self._step_jobs = self._step_jobs, []
        meta.delayed_free_req_ids, self._delayed_free = self._delayed_free, set()
        meta.drain_admitted = self._mgr.take_drain_admitted()
        for req_id in so.finished_req_ids:
            self._maybe_forget(req_id)
        return meta

    def _plan_store(
        self,
        state: RequestState,
        tokens_with_kv: int,
        block_ids: tuple[list[int], ...] | None = None,
        final: bool = False,
    ) -> None:
        """Queue a store for the request's full blocks whose KV exists once the step ran
        (`block_ids`: the request's tables per group, the manager's when None)."""
        req = state.request
        variant = self._variants.variant(req.lora_request)
        plan = self._store_planner.plan(state, tokens_with_kv, variant, block_ids, final=final)
        if plan is None:
            return
        keys, gpu_ids, start, full = plan.keys, plan.gpu_ids, plan.start, plan.stop
        parents = plan.parents
        if parents is None and plan.first_parent is not None:
            parents = [plan.first_parent, *keys[:-1]]
        job = self._mgr.prepare_store(keys, gpu_ids, parents=parents) if keys else None
        if job is None:
            return
        if self._events_on or self._config.ssd_enabled:
            self._origins.remember_request(req, start, req.block_hashes[start:full], self._bs)
        if self._hybrid is not None:
            self._hybrid.planned_store(job, plan.reused, self._stats)
        self._jobs[job.job_id] = JobInfo(job.job_id, req.request_id, "store", tuple(job.keys))
        if self._storing_keys is not None:
            self._storing_keys.add(job.keys)
        state.store_jobs.add(job.job_id)
        self._step_jobs.append(JobEntry(req.request_id, "store", job, tuple(gpu_ids)))

    # ---------------------------------------------------------------- completions
    def update_connector_output(self, output: KVConnectorOutput) -> None:
        self._inventory.wait_read()  # the reports settle what it adopted
        self._inventory.after_step()
        for req_id in output.finished_recving or ():
            state = self._reqs.get(req_id)
            if state is not None:
                state.loading = False
                self._maybe_forget(req_id)
        meta = output.kv_connector_worker_meta
        if meta is None:
            return
        if not isinstance(meta, FlexKVWorkerMetadata):
            raise TypeError(f"unexpected worker metadata {type(meta).__name__}")
        if meta.ready_slots:
            self._ready_slots.update(meta.ready_slots)
            if len(self._ready_slots) >= self._info.num_workers:
                self._mgr.grow_host_slots(min(self._ready_slots.values()))
        self._inventory.adopt_reports(self._mgr, meta)
        if meta.node_added or meta.node_removed:
            self._node.apply(self._mgr, meta.node_added, meta.node_removed)
        for job_id, nranks in meta.gpu_read_done.items():
            info = self._jobs.get(job_id)
            if info is None:
                continue
            info.gpu_read_ranks += nranks
            if info.gpu_read_ranks >= self._info.num_workers:
                self._gpu_read_done(info)
        for job_id, results in meta.results.items():
            info = self._jobs.get(job_id)
            if info is None:
                continue
            info.results.extend(results)
            if len(info.results) >= self._info.num_workers:
                self._finish_job(job_id, info)

    def _add_background(self, job: Any) -> None:
        """Spills and SSD deletes: no request, but spills must report back to free slots."""
        self._jobs[job.job_id] = JobInfo(job.job_id, None, str(job.kind), tuple(job.keys))
        self._step_jobs.append(JobEntry(None, "background", job))

    def _gpu_read_done(self, info: JobInfo) -> None:
        """Every rank's GPU->host copy of a store ended: its request's blocks are not read any
        more (the job may still write to SSD; the manager hears of it from the results)."""
        if info.kind != "store":
            return
        if self._hybrid is not None:
            self._hybrid.fence.done(info.job_id)
        if info.req_id is None:
            return
        state = self._reqs.get(info.req_id)
        if state is None:
            return
        state.store_jobs.discard(info.job_id)
        self._maybe_forget(info.req_id)

    def _finish_job(self, job_id: int, info: JobInfo) -> None:
        del self._jobs[job_id]
        if self._hybrid is not None:
            self._hybrid.fence.done(job_id)
        merged = JobResult.merge(info.results)
        self._mgr.complete(merged)  # deletes too: they name the keys they resolved (events)
        if info.kind == "load" and info.req_id is not None:  # not a background prefetch
            self._loading_keys.release(info.keys)
        if info.kind == "store" and self._storing_keys is not None:
            self._storing_keys.release(info.keys)
        if info.req_id is None:
            return
        state = self._reqs.get(info.req_id)
        if state is None:
            return
        if info.kind == "store":
            state.store_jobs.discard(job_id)
        elif info.kind == "load" and state.load_job == job_id:
            state.load_job = None
            if not merged.ok:
                # Failed blocks are recomputed by vLLM; let the planner store them again.
                state.planned_blocks = 0
                state.failed_load_end = state.load_end
        self._maybe_forget(info.req_id)

    # ---------------------------------------------------------------- request end
    def request_finished(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, None]:
        """`block_ids`: the request's blocks per KV cache group."""
        state = self._reqs.get(request.request_id)
        self._lookups.pop(request.request_id, None)
        self._keys.forget(request.request_id)
        if self._objects is not None:
            self._objects.forget(request.request_id)
        if self._hybrid is not None:
            self._hybrid.forget(request.request_id)
        self._hit_sources.pop(request.request_id, None)
        self._store_waits.pop(request.request_id, None)
        followed = self._followed_tables
        if followed is not None:
            followed.forget(request.request_id)
        if state is None:
            return False, None
        state.finished = True
        if self._info.can_store and not state.loading:
            # Blocks whose hash became known only now (the last decode tokens).
            tables = block_ids if self._hybrid is not None or followed is not None else None
            self._plan_store(state, request.num_computed_tokens, tables, final=True)
        if state.loading:
            # vLLM frees the blocks when the load reports finished_recving.
            return True, None
        if state.store_jobs:
            self._delayed_free.add(request.request_id)
            return True, None
        self._reqs.pop(request.request_id, None)
        return False, None

    def _maybe_forget(self, req_id: str) -> None:
        state = self._reqs.get(req_id)
        if state is not None and state.done:
            del self._reqs[req_id]

    def _state(self, request: Request) -> RequestState:
        state = self._reqs.get(request.request_id)
        if state is None or state.request is not request:
            state = RequestState(request)
            self._reqs[request.request_id] = state
        return state

    # ---------------------------------------------------------------- misc
    def take_events(self) -> Iterable[KVCacheEvent]:
        tier_events = self._mgr.take_events()
        if not self._events_on:
            return []
        events = to_vllm_events(tier_events, self._origins, self._bs, self._event_groups)
        return events + self._inventory.take_events(self._mgr.known)

    def reset_cache(self) -> bool:
        self._inventory.wait_read()
        self._inventory.forget()
        self._step_jobs.append(JobEntry(None, "reset", None))  # workers forget host-only blocks
        job = self._mgr.reset()
        if job is not None:
            self._add_background(job)
        self._origins.clear()
        return True

    def get_stats(self) -> FlexKVConnectorStats | None:
        if self._objects is not None:  # the bucket lookups' counters, as increments
            for key, grew in self._object_increments.since_last(self._objects.totals()).items():
                self._stats.add(key, grew)
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, FlexKVConnectorStats()
        return stats

    @property
    def recovered(self) -> bool:
        """Every worker's restart inventory is adopted (at once without an SSD tier)."""
        return self._inventory.ready

    def has_pending_stores(self) -> bool:
        """Store jobs not yet finished on every rank (their requests may be gone)."""
        return any(info.kind == "store" for info in self._jobs.values())

    def shutdown(self) -> None:
        self._inventory.wait_read()
        for part in (self._objects, self._mgr):  # the bucket's lookups, then the manager
            close = getattr(part, "close", None)
            if close is not None:
                close()
