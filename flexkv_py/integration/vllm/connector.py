"""`FlexKVConnectorV1`: vLLM's KV connector API (0.23 to 0.33) over the FlexKV tiers.

vLLM builds one instance per role: SCHEDULER (engine core process) and WORKER (one per rank).
This class only routes each hook to `SchedulerSide` or `WorkerSide`.

It subclasses vLLM's built-in `FlexKVConnectorV1` shim, so type checks against vLLM's class
(Dynamo's `PdConnector` checks its first child that way) pass whether it was built through the
plugin's registry entry or `kv_connector_module_path`. The shim's constructor (which imports the
original FlexKV) is skipped, and every hook the shim forwards is overridden here.

It implements `SupportsHMA`, so vLLM keeps its hybrid KV cache manager on (sliding-window models
get their full GPU block count), alone, under the built-in name, or inside a MultiConnector /
PdConnector whose other children support HMA too. What older vLLM releases lack is handled
in `compat.py`; importing this module under a vLLM older than the supported range raises an
error that names the range.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from flexkv_py.integration.vllm import compat

compat.check_supported()  # before importing what an older vLLM may lack

from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.distributed.kv_transfer.kv_connector.v1.flexkv_connector import (  # noqa: E402
    FlexKVConnectorV1 as VllmFlexKVConnectorV1,
)

from flexkv_py.errors import InternalStateError  # noqa: E402
from flexkv_py.index.tier_names import Tier  # noqa: E402
from flexkv_py.integration.vllm.coexistence import check_flexkv_owner  # noqa: E402
from flexkv_py.integration.vllm.composition import find_parent  # noqa: E402
from flexkv_py.integration.vllm.engine_info import (  # noqa: E402
    read_engine_info,
    read_flexkv_config,
    worker_rank,
)
from flexkv_py.integration.vllm.failure_policy import apply_load_failure_policy  # noqa: E402
from flexkv_py.integration.vllm.metadata import FlexKVConnectorMetadata  # noqa: E402
from flexkv_py.integration.vllm.scheduler_side import SchedulerSide  # noqa: E402
from flexkv_py.integration.vllm.stats import (  # noqa: E402
    FlexKVConnectorStats,
    FlexKVPromMetrics,
    metrics_enabled,
)
from flexkv_py.integration.vllm.worker_side import WorkerSide  # noqa: E402
from flexkv_py.tiers.registry import specs  # noqa: E402

if TYPE_CHECKING:
    import torch
    from vllm.config import VllmConfig
    from vllm.distributed.kv_events import KVCacheEvent
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
        KVConnectorPromMetrics,
        KVConnectorStats,
        PromMetric,
        PromMetricT,
    )
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from flexkv_py.integration.vllm.metadata import FlexKVWorkerMetadata

logger = logging.getLogger(__name__)


class FlexKVConnectorV1(VllmFlexKVConnectorV1, SupportsHMA):
    def __init__(
        self,
        vllm_config: VllmConfig,
        role: KVConnectorRole,
        kv_cache_config: KVCacheConfig,
    ) -> None:
        # The base connector's constructor, not the shim's (which imports the original FlexKV).
        KVConnectorBase_V1.__init__(self, vllm_config, role, kv_cache_config)
        check_flexkv_owner()
        compat.log_features_once()
        compat.check_kv_groups(len(kv_cache_config.kv_cache_groups))
        self._parent = find_parent()
        self._config = read_flexkv_config(vllm_config)
        self._info = read_engine_info(vllm_config, kv_cache_config, self._config)
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            apply_load_failure_policy(vllm_config, self._parent, self._config.load_failure_policy)
            compat.pin_none_hash(vllm_config)
            tables = self._bound_kv_cache_manager_tables if compat.BINDS_KV_CACHE_MANAGER else None
            self._scheduler = SchedulerSide(self._info, self._config, tables)
        else:
            tp_rank, pp_rank = worker_rank(vllm_config)
            self._worker = WorkerSide(self._info, self._config, tp_rank, pp_rank)
        logger.info(
            "FlexKVConnectorV1 %s: role=%s cpu=%.2fGB ssd=%.2fGB dirs=%s",
            role.name,
            self._kv_transfer_config.kv_role,
            self._config.cpu_cache_gb,
            self._config.ssd_cache_gb,
            ";".join(self._config.ssd_cache_dir),
        )

    @property
    def requires_kv_delivery(self) -> bool:
        # A best-effort cache: a dropped store is a future miss, never a wrong token.
        return False

    def _bound_kv_cache_manager_tables(self, req_id: str) -> tuple[list[int], ...]:
        manager = getattr(self, "_kv_cache_manager", None)
        if manager is None:
            raise InternalStateError(
                "FlexKVConnectorV1: the scheduler did not bind its KV cache manager"
            )
        return manager.get_block_ids(req_id)  # type: ignore[no-any-return]

    @property
    def scheduler_side(self) -> SchedulerSide:
        if self._scheduler is None:
            raise InternalStateError("scheduler-side hook called on a WORKER-role connector")
        return self._scheduler

    @property
    def worker_side(self) -> WorkerSide:
        if self._worker is None:
            raise InternalStateError("worker-side hook called on a SCHEDULER-role connector")
        return self._worker

    # ============================================================== worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self.worker_side.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if not isinstance(connector_metadata, FlexKVConnectorMetadata):
            raise TypeError(f"unexpected connector metadata {type(connector_metadata).__name__}")
        self.worker_side.bind(connector_metadata)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        assert isinstance(kv_connector_metadata, FlexKVConnectorMetadata)
        self.worker_side.handle_preemptions(kv_connector_metadata)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        # Loads are asynchronous (the request waits outside the batch), so they are submitted
        # with the step's other jobs in wait_for_save, keeping the scheduler's job order.
        return None

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None

    def save_kv_layer(
        self,
        layer_name: str,
        kv_layer: torch.Tensor,
        attn_metadata: AttentionMetadata,
        **kwargs: Any,
    ) -> None:
        # Stores read the registered KV tensors by block id after the forward; this hook is
        # skipped by full CUDA graphs anyway.
        return None

    def wait_for_save(self) -> None:
        self.worker_side.submit_pending()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return self.worker_side.get_finished(finished_req_ids)

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        # vLLM 0.31+ (compat.KVConnectorTransferResults); older releases call get_finished.
        sending, recving = self.worker_side.get_finished(finished_req_ids)
        return compat.KVConnectorTransferResults(
            finished_sending=set(sending or ()),
            finished_recving=set(recving or ()),
            failed_recving=self.worker_side.take_failed_recving(),
        )

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker_side.take_load_errors()

    def build_connector_worker_meta(self) -> FlexKVWorkerMetadata | None:
        if self._worker is None:
            return None
        return self._worker.build_worker_meta()

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._worker is not None:
            return self._worker.get_stats()
        if self._scheduler is not None:
            return self._scheduler.get_stats()
        return None

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._scheduler is not None:
            self._scheduler.shutdown()

    # ============================================================== scheduler side
    # vLLM's shim narrowed the base's `int | None` ("ask again later") to `int`: keep the base's.
    def get_num_new_matched_tokens(  # type: ignore[override]
        self, request: Request, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        tokens, load_async = self.scheduler_side.get_num_new_matched_tokens(
            request, num_computed_tokens
        )
        if tokens and self._parent is not None:
            self._parent.record_loader(request.request_id)
        return tokens, load_async

    def update_state_after_alloc(
        self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int
    ) -> None:
        self.scheduler_side.update_state_after_alloc(request, blocks, num_external_tokens)

    def get_external_cache_hit_sources(
        self, request: Request, num_external_tokens: int
    ) -> dict[Any, int]:
        """External hits split into host memory (HOST), SSD (DISK) and object-store tokens
        (vLLM 0.33+, compat.CacheHitSource)."""
        split = self.scheduler_side.take_hit_sources(request)
        CacheHitSource = compat.CacheHitSource
        if not num_external_tokens or CacheHitSource is None:
            return {}
        if not split or sum(split.values()) != num_external_tokens:
            return {CacheHitSource.HOST: num_external_tokens}
        names = {Tier.HOST: CacheHitSource.HOST}
        names.update({s.tier: getattr(CacheHitSource, s.hit_source) for s in specs()})
        out: dict[Any, int] = {}
        for tier, tokens in split.items():
            out[names[tier]] = out.get(names[tier], 0) + tokens
        return out

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        return self.scheduler_side.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        self.scheduler_side.update_connector_output(connector_output)

    def request_finished(
        self, request: Request, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler_side.request_finished(request, (block_ids,))

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        # vLLM already freed the sliding-window blocks out of the window (their ids are 0).
        return self.scheduler_side.request_finished(request, block_ids)

    def has_pending_push_work(self) -> bool:
        # A finished request's blocks are freed once its stores' GPU->host copies are done;
        # the engine keeps stepping until those stores report back (SSD write-through), so
        # the manager commits them now rather than whenever the next request comes.
        return self._scheduler is not None and self._scheduler.has_pending_stores()

    def take_events(self) -> Iterable[KVCacheEvent]:
        return self.scheduler_side.take_events()

    def reset_cache(self) -> bool | None:
        return self.scheduler_side.reset_cache()

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        # Every vLLM 0.33 layout is accepted (the transfer engine gathers pages); no
        # measurement so far shows that forcing a block-outermost layout pays.
        return None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats:
        return FlexKVConnectorStats(data=dict(data) if data else {})

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: VllmConfig,
        metric_types: dict[type[PromMetric], type[PromMetricT]],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> KVConnectorPromMetrics | None:
        ktc = vllm_config.kv_transfer_config
        extra = (ktc.kv_connector_extra_config or {}) if ktc is not None else {}
        if not metrics_enabled(bool(extra.get("enable_metrics", False))):
            return None
        return FlexKVPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
