"""Worker half of the connector: runs the scheduler's jobs on this rank's KV tensors.

Jobs run in-process through the coordinator's `JobExecutor` (host pool, lower tiers, transfer
engine on the worker's own CUDA streams). Ordering rules:

- every job of a step is submitted in `wait_for_save`, after the step's forward was enqueued, in
  the order the scheduler created them — a store copies only KV the model already wrote (the
  transfer engine orders its copy after the current stream), and decode steps replayed as full
  CUDA graphs call no per-layer hooks, so block ids come from our metadata, never save_kv_layer;
- a store reads GPU blocks only in its GPU->host copy. Once that copy ended on this rank (the
  executor's `poll_gpu_reads`), the job no longer holds its request's blocks here, although its
  lower-tier write-through may still run: the rank names the job in the worker metadata
  (`gpu_read_done`, counted per rank by the scheduler like job results) and a finished request
  whose stores all ended their copies is reported in finished_sending (vLLM frees its blocks once
  every rank did);
- `handle_preemptions` (before the next forward) waits for the GPU->host copies of stores reading
  preempted requests' blocks, which vLLM hands to other requests from that step on (not for
  their lower-tier writes). The wait is bounded: a store still copying after `flush_timeout_s`
  is abandoned (all its blocks fail, so KV the late copy reads from reused blocks is never
  committed; the scheduler learns it from the job's result when the job really ends, and frees
  its host slots only then) and the step goes on;
- a load reports its request in finished_recving and its failed blocks in
  get_block_ids_with_load_errors in the same step, so vLLM recomputes them. With several KV
  cache groups (hybrid models) vLLM refuses block-level errors: a load that fails any block
  fails its whole request through failed_recving instead (also in finished_recving), and vLLM
  recomputes the request.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from flexkv_py.coordinator import JobExecutor
from flexkv_py.coordinator.jobs import StoreJob
from flexkv_py.errors import InternalStateError
from flexkv_py.index.tier_names import Tier
from flexkv_py.integration.vllm.engine_info import EngineInfo
from flexkv_py.integration.vllm.metadata import (
    FlexKVConnectorMetadata,
    FlexKVWorkerMetadata,
    JobEntry,
)
from flexkv_py.integration.vllm.recovered_events import RecoveredMetaReader
from flexkv_py.integration.vllm.restart_inventory import PARENTS_RANK
from flexkv_py.integration.vllm.shutdown_drain import HostOnlyBlocks
from flexkv_py.integration.vllm.stats import FlexKVConnectorStats
from flexkv_py.process_memory import return_freed_memory
from flexkv_py.tiers.object.counters import Increments, tier_totals

if TYPE_CHECKING:
    import torch

    from flexkv_py.config import FlexKVConfig

logger = logging.getLogger(__name__)

# Bounded waits: a stuck device must degrade to an error, never hang the engine.
FLUSH_TIMEOUT_S = 120.0
SHUTDOWN_TIMEOUT_S = 120.0


class WorkerSide:
    def __init__(self, info: EngineInfo, config: FlexKVConfig, tp_rank: int, pp_rank: int) -> None:
        self._info = info
        self._config = config
        self._ns = info.namespace.for_rank(tp_rank, pp_rank)
        self.tp_rank = tp_rank
        self.pp_rank = pp_rank
        # Logs name the worker by both ranks: under PP, TP rank 0 exists once per stage.
        self._label = self._ns.shard_dir_name
        # Host slots this worker last reported ready (a background pool grows while serving).
        self._reported_ready = 0
        self._stepping = False
        self.flush_timeout_s = FLUSH_TIMEOUT_S
        self.shutdown_timeout_s = SHUTDOWN_TIMEOUT_S
        self._executor: Any | None = None
        # job_id -> (req_id, kind, gpu block ids) for jobs submitted and not yet finished.
        self._inflight: dict[int, tuple[str | None, str, tuple[int, ...]]] = {}
        # req_id -> its store jobs whose GPU->host copy has not ended on this rank.
        self._req_stores: dict[str, set[int]] = {}
        # Submitted store jobs whose end of GPU reading is not yet in the worker metadata.
        self._reads_unreported: set[int] = set()
        self._await_free: set[str] = set()
        self._pending: list[JobEntry] = []
        # The step's metadata last taken: Dynamo's PdConnector binds each child's metadata twice
        # per step (through MultiConnector and again itself), which must not run its jobs twice.
        self._bound: FlexKVConnectorMetadata | None = None
        self._finished_recving: set[str] = set()
        self._failed_recving: set[str] = set()  # hybrid models: failed loads, per request
        self._load_errors: set[int] = set()
        self._out = FlexKVWorkerMetadata()
        # Metadata builds until the restart report has been sent and freed (then its heap goes
        # back to the OS: process_memory.py); 0: nothing to give back.
        self._report_freed_in = 0
        self._stats = FlexKVConnectorStats()
        self._timeouts_seen = 0  # executor.late_io.timeout_blocks already counted in stats
        self._object_increments = Increments()  # object tier counters already in stats
        self._meta_reader: RecoveredMetaReader | None = None
        # Host blocks not on the SSD, written at shutdown (shutdown_drain.py); store jobs by id.
        self._host_only = HostOnlyBlocks(config.admission_spec.min_hits)
        self._store_jobs: dict[int, Any] = {}

    @property
    def executor(self) -> Any:
        if self._executor is None:
            raise InternalStateError("FlexKVConnectorV1: register_kv_caches was not called")
        return self._executor

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if self._info.hybrid:
            from flexkv_py.transfer.group_layouts import transfer_kv_caches

            # One transfer engine moves every group's blocks: the groups alias the same slots.
            groups = self._info.groups
            states = [g.group_id for g in groups if g.restores_state]
            kv_caches = transfer_kv_caches(kv_caches, [g.layer_names for g in groups], states)
        self._executor = JobExecutor.from_kv_caches(self._config, self._ns, kv_caches, serving=True)
        for tier in self._executor.unavailable:
            # Degraded start (tiers/ssd/opener.py): the executor logged the cause; the empty
            # inventory below adopts nothing and every job part naming the tier fails fast.
            self._stats.add(f"{tier.value}_unavailable", 1)
        if self._config.ssd_enabled:
            self._report_inventory()

    def _report_inventory(self) -> None:
        """The restart report: the SSD's keys (worker (0, 0) adds their chain parents), then,
        with KV events on, their token ids read in the background (recovered_events.py)."""
        ssd = self.executor.tiers.get(Tier.SSD)
        first = (self.tp_rank, self.pp_rank) == PARENTS_RANK
        keys: Sequence[bytes]
        if first and ssd is not None and hasattr(ssd, "restart_report"):
            # Joined buffers (no object per block) when the keys have one width.
            keys, self._out.inventory_parents = ssd.restart_report()
            if self._info.publish_kv_events and keys:
                self._meta_reader = RecoveredMetaReader(ssd, keys, self._label)
        elif ssd is not None and hasattr(ssd, "restart_keys"):
            keys = ssd.restart_keys()  # joined too: the scheduler intersects the buffers
        else:
            keys = tuple(self.executor.stored_keys())
        logger.info("%s: %d blocks in lower tiers from a previous run", self._label, len(keys))
        self._out.inventories[(self.tp_rank, self.pp_rank)] = keys
        self._report_freed_in = 2  # sent by the next build, dropped by vLLM before the one after

    # ---------------------------------------------------------------- per step
    def bind(self, meta: FlexKVConnectorMetadata) -> None:
        """Take the step's jobs; they are submitted after the forward (wait_for_save). The same
        metadata bound again is ignored: a job run twice ends twice, and its first end frees its
        host slots and GPU blocks while the second still copies into them (wrong KV)."""
        if meta is self._bound:
            return
        self._bound = meta
        if not self._stepping:
            # The first engine step: vLLM's start-up CUDA graph captures are over, so a pool
            # prepared in the background may call cudaHostRegister now.
            self._stepping = True
            self.executor.pool.allow_registration()
        self._pending.extend(meta.jobs)
        # Register stores per request now, not at submit: with spec decode vLLM asks
        # get_finished before wait_for_save, and a delayed free must not overtake its store.
        for entry in meta.jobs:
            if entry.kind == "store" and entry.req_id is not None and entry.job is not None:
                self._req_stores.setdefault(entry.req_id, set()).add(entry.job.job_id)
        self._await_free |= meta.delayed_free_req_ids
        self._host_only.admit(meta.drain_admitted)

    def handle_preemptions(self, meta: FlexKVConnectorMetadata) -> None:
        if not meta.flush_req_ids and not meta.flush_job_ids:
            return
        # Stores of the previous steps are all submitted (wait_for_save ran); wait for those
        # reading the preempted requests' blocks, and for those reading sliding-window blocks
        # handed out again this step.
        self.submit_pending()  # jobs of a step whose wait_for_save has not run yet
        self._collect_reads(self.executor.poll_gpu_reads())
        stores = {j for r in meta.flush_req_ids for j in self._req_stores.get(r, ())}
        stores |= meta.flush_job_ids
        job_ids = sorted(j for j in stores if j in self._inflight)
        if not job_ids:
            return
        try:
            # Only the copies read the blocks: lower-tier writes of these stores may go on.
            self.executor.wait_gpu_reads(job_ids, self.flush_timeout_s)
        except TimeoutError:
            self._abandon(meta.flush_req_ids, job_ids)
        self._collect_reads(self.executor.poll_gpu_reads())

    def _abandon(self, req_ids: set[str], job_ids: list[int]) -> None:
        """Flush timed out: vLLM reuses the blocks now, so stores still copying them must not
        be committed. Their results (all blocks failed) reach the scheduler when they end."""
        abandoned = set(self.executor.abandon(job_ids))
        logger.error(
            "%s: stores of preempted requests %s not done after %g s; %d of %d jobs "
            "abandoned: their blocks fail and are not cached (jobs %s)",
            self._label,
            sorted(req_ids),
            self.flush_timeout_s,
            len(abandoned),
            len(job_ids),
            sorted(abandoned),
        )
        self._stats.add("flush_timeouts", 1)
        self._stats.add("store_abandoned_jobs", len(abandoned))
        # As the scheduler does on preemption: the requests no longer wait for these stores.
        for r in req_ids:
            stores = self._req_stores.get(r)
            if stores is None:
                continue
            stores.difference_update(job_ids)
            if not stores and r not in self._await_free:
                del self._req_stores[r]

    def submit_pending(self) -> None:
        jobs, self._pending = self._pending, []
        for entry in jobs:
            if entry.kind == "reset":  # reset_cache: nothing stored before it may be written
                self._host_only.reset()
                self._store_jobs.clear()  # nor what stores still running bring in
                continue
            if entry.job is None:
                # Unplannable load: fail it now so vLLM recomputes.
                self._fail_load(entry.req_id, set(entry.gpu_block_ids))
                continue
            job_id = entry.job.job_id
            self._inflight[job_id] = (entry.req_id, entry.kind, entry.gpu_block_ids)
            self._host_only.submitted(entry.job)
            if isinstance(entry.job, StoreJob) and self._config.ssd_enabled:
                self._store_jobs[job_id] = entry.job
            self.executor.submit(entry.job)
            if entry.kind == "store":
                self._reads_unreported.add(job_id)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._executor is not None:
            self._collect(self._executor.poll())
            self._collect_reads(self._executor.poll_gpu_reads())
            # Lower-tier I/O past ssd_io_timeout_s (loads, write-through, spills): a stuck device.
            timed_out = self._executor.late_io.timeout_blocks
            self._stats.add("ssd_io_timeout_blocks", timed_out - self._timeouts_seen)
            self._timeouts_seen = timed_out
        sending = {r for r in self._await_free if not self._req_stores.get(r)}
        self._await_free -= sending
        for r in sending:
            self._req_stores.pop(r, None)
        recving, self._finished_recving = self._finished_recving, set()
        return sending or None, recving or None

    def _collect(self, results: list[Any]) -> None:
        for res in results:
            entry = self._inflight.pop(res.job_id, None)
            if entry is None:
                continue  # already collected (a flush wait and a poll can both see it)
            req_id, kind, gpu_ids = entry
            self._out.results.setdefault(res.job_id, []).append(res)
            store = self._store_jobs.pop(res.job_id, None)
            if store is not None:
                self._host_only.finished(store, res)
            failed = set(getattr(res, "failed_gpu_block_ids", ()) or ())
            prefix = "load" if kind == "load" else "store" if kind == "store" else "bg"
            self._stats.add(f"{prefix}_jobs", 1)
            self._stats.add(f"{prefix}_blocks", len(gpu_ids))
            self._stats.add(f"{prefix}_bytes", getattr(res, "nbytes", 0) or 0)
            self._stats.add(f"{prefix}_seconds", getattr(res, "seconds", 0.0) or 0.0)
            if kind == "load":
                if not res.ok and not failed:
                    failed = set(gpu_ids)  # no per-block detail: treat the whole load as failed
                failed &= set(gpu_ids)
                self._stats.add("load_failed_blocks", len(failed))
                self._fail_load(req_id, failed)
            elif kind == "store":
                self._stats.add("store_failed_blocks", len(getattr(res, "failed", {}) or {}))
                self._read_done(res.job_id, req_id)  # a finished job reads nothing any more

    def _fail_load(self, req_id: str | None, failed: set[int]) -> None:
        """A load ended (`failed`: its GPU blocks whose KV is not valid, maybe none)."""
        if failed:
            if self._info.hybrid and req_id is not None:
                self._failed_recving.add(req_id)  # vLLM refuses block ids with >1 group
            else:
                self._load_errors |= failed
        if req_id is not None:
            self._finished_recving.add(req_id)

    def _collect_reads(self, job_ids: list[int]) -> None:
        """Store jobs whose GPU->host copy ended on this rank (they may still write to SSD)."""
        for job_id in job_ids:
            entry = self._inflight.get(job_id)
            self._read_done(job_id, entry[0] if entry is not None else None)

    def _read_done(self, job_id: int, req_id: str | None) -> None:
        if job_id not in self._reads_unreported:
            return  # reported already (the copy's end, then the job's result)
        self._reads_unreported.discard(job_id)
        self._out.gpu_read_done[job_id] = self._out.gpu_read_done.get(job_id, 0) + 1
        if req_id is None:
            return
        stores = self._req_stores.get(req_id)
        if stores is not None:
            stores.discard(job_id)
            if not stores and req_id not in self._await_free:
                del self._req_stores[req_id]

    def take_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        if errors:
            logger.warning("%s: %d blocks failed to load", self._label, len(errors))
        return errors

    def take_failed_recving(self) -> set[str]:
        """Requests whose load failed (hybrid models); already in finished_recving."""
        failed, self._failed_recving = self._failed_recving, set()
        if failed:
            logger.warning("%s: loads of %d requests failed; recomputing", self._label, len(failed))
        return failed

    def build_worker_meta(self) -> FlexKVWorkerMetadata | None:
        if self._report_freed_in:
            self._report_freed_in -= 1
            if not self._report_freed_in:
                return_freed_memory("the restart report")
        ready = self.executor.pool.ready_slots if self._executor is not None else 0
        if ready != self._reported_ready:
            self._reported_ready = ready
            self._out.ready_slots[(self.tp_rank, self.pp_rank)] = ready
        if self._meta_reader is not None:
            self._out.recovered_metas.update(self._meta_reader.take())
        node = self.executor.tiers.get(Tier.NODE) if self._executor is not None else None
        if node is not None and hasattr(node, "take_changes"):
            added, removed = node.take_changes()  # sibling shards' refresh (tiers/node/shards.py)
            rank = (self.tp_rank, self.pp_rank)
            if added:
                self._out.node_added[rank] = added
            if removed:
                self._out.node_removed[rank] = removed
        if self._out.is_empty():
            return None
        out, self._out = self._out, FlexKVWorkerMetadata()
        return out

    def get_stats(self) -> FlexKVConnectorStats | None:
        obj = self.executor.tiers.get(Tier.OBJECT) if self._executor is not None else None
        if obj is not None:  # the rank's object requests and errors, as increments
            for key, grew in self._object_increments.since_last(tier_totals(obj.stats())).items():
                self._stats.add(key, grew)
        if self._stats.is_empty():
            return None
        stats, self._stats = self._stats, FlexKVConnectorStats()
        return stats

    def shutdown(self) -> None:
        if self._meta_reader is not None:
            self._meta_reader.stop()
        if self._executor is not None:
            if self._pending:
                self.submit_pending()
            stuck = self._drain()
            # A stuck device: waiting longer frees nothing (vLLM kills the worker soon anyway).
            if not self._executor.shutdown(0.0 if stuck else self.shutdown_timeout_s):
                logger.error("%s: FlexKV jobs still running at shutdown", self._label)
            self._executor = None

    def _drain(self) -> bool:
        """Write host blocks the SSD does not have yet, within shutdown_drain_s; True when the
        device is stuck. Stores still running are waited for within the same budget."""
        ssd = self.executor.tiers.get(Tier.SSD)
        budget = self._config.shutdown_drain_s
        if ssd is None or budget <= 0 or not hasattr(ssd, "stores_block_meta"):
            return False
        deadline = time.monotonic() + budget
        try:
            self._collect(self.executor.wait(list(self._store_jobs), budget))
        except TimeoutError:
            self._collect(self.executor.poll())
        owed = len(self._host_only.owed())
        left = max(0.0, deadline - time.monotonic())
        ex = self.executor
        written, stuck = self._host_only.drain(ssd, ex.pool, ex.late_io, left)
        logger.info(
            "%s: shutdown wrote %d of %d host-only blocks to SSD (%d left out: min_hits)",
            self._label,
            written,
            owed,
            len(self._host_only) - owed,
        )
        return stuck
