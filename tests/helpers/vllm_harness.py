"""A CPU stand-in for a vLLM 0.33 engine, built from vLLM's own parts, to drive the connector.

Real: `VllmConfig`, vLLM's general-plugin loading (flexkv-py's entry point points the built-in
`FlexKVConnectorV1` name at our connector), the `Scheduler` / `AsyncScheduler`, `Request`s
with the engine's block hasher, the KV cache plan (`get_kv_cache_config_from_groups`) and
tensors (`allocate_kv_cache`, the exact `[B, H, N, C]` views a worker registers), the connector
factory (built-in name or module path), TP and PP output aggregation (`KVOutputAggregator` over
every worker, onto TP rank 0 of the last stage as MultiprocExecutor does), per-stage KV cache
configs (each PP stage registers only its own layers; the scheduler gets stage 0's config, as
`generate_scheduler_kv_cache_config` gives it), and `update_from_output`.

Stand-in: the model. `FakeModel` writes, for every scheduled token, KV that is a deterministic
function of the token prefix (like real attention KV), and before each forward checks that the
KV of every already-computed position is exactly what it would have written — so a wrong,
stale or partial load is caught the moment vLLM would have read it.

Per step, worker hooks run in the order of vllm/v1/worker/gpu/kv_connector.py (see
/work/notes/vllm033.md): handle_preemptions -> bind -> [start_load_kv if sync loads] -> forward
-> finish_forward -> start_load_kv -> wait_for_save -> get_transfer_results ->
get_block_ids_with_load_errors -> stats -> events -> build_connector_worker_meta -> clear.
Metadata is pickled to each worker as it is for TP>1 worker processes.
"""

from __future__ import annotations

import os

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import copy
import hashlib
import json
import pickle
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVEventsConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.distributed.utils import get_pp_indices
from vllm.forward_context import get_forward_context, set_forward_context
from vllm.plugins import load_general_plugins
from vllm.utils.hashing import sha256
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.kv_cache_utils import (
    generate_scheduler_kv_cache_config,
    get_request_block_hasher,
)
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from helpers import vllm_platform  # noqa: F401  (vLLM's CPU platform on every release, before vLLM imports)
from helpers.vllm_versions import (
    allocate_kv_cache,
    get_kv_cache_config_from_groups,
    kv_connector_output,
    plan_kv_cache_configs,
    transfer_results,
)

CONNECTOR = "FlexKVConnectorV1"
MODULE_PATH = "flexkv_py.integration.vllm"
# How a test names the connector: "builtin" (the published launch lines: the name alone, resolved
# through flexkv-py's vLLM plugin) or "module_path" (kv_connector_module_path). The suite runs
# both (conftest's `connector_form`).
CONNECTOR_FORMS = ("builtin", "module_path")
CONNECTOR_FORM = "builtin"

# What vLLM does in every process before it builds a connector.
load_general_plugins()
NUM_LAYERS = 2
NUM_KV_HEADS = 2  # total; each TP rank holds NUM_KV_HEADS // tp
HEAD_SIZE = 16
TINY_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": NUM_KV_HEADS,
    "num_hidden_layers": NUM_LAYERS,
    "head_dim": HEAD_SIZE,
    "vocab_size": 1000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "torch_dtype": "float16",
}
LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]

# Hybrid models (vLLM's hybrid KV cache manager): a Gemma-3-shaped text model, 4 layers, the
# odd ones sliding-window (explicit layer_types), planned by vLLM's own get_kv_cache_configs.
WINDOW = 128
HYBRID_LAYERS = 4
GEMMA3_CONFIG = {
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": NUM_KV_HEADS,
    "head_dim": HEAD_SIZE,
    "num_hidden_layers": HYBRID_LAYERS,
    "layer_types": ["full_attention", "sliding_attention"] * (HYBRID_LAYERS // 2),
    "sliding_window": WINDOW,
    "vocab_size": 1000,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "rope_local_base_freq": 10000.0,
    "query_pre_attn_scalar": HEAD_SIZE,
    "torch_dtype": "bfloat16",
}
HYBRID_MAX_MODEL_LEN = 512
HYBRID_LAYER_NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(HYBRID_LAYERS)]
# layer index -> sliding window in tokens (0: full attention)
HYBRID_WINDOWS = [WINDOW if i % 2 else 0 for i in range(HYBRID_LAYERS)]


# ------------------------------------------------------------------------------------ configs
@cache
def _model_config(model_dir: str) -> ModelConfig:
    # Built once per process: ModelConfig parses the HF config (slow).
    # The config's own dtype (Gemma 3 refuses float16).
    dtype = json.loads((Path(model_dir) / "config.json").read_text()).get("torch_dtype")
    return ModelConfig(model=model_dir, dtype=dtype or "float16", skip_tokenizer_init=True, seed=0)


def tiny_model_dir(root: Path) -> str:
    d = root / "tiny-llama"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(TINY_CONFIG))
    return str(d)


def hybrid_model_dir(root: Path) -> str:
    d = root / "tiny-gemma3"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(GEMMA3_CONFIG))
    return str(d)


def hybrid_layer_specs(vllm_config: VllmConfig) -> dict[str, KVCacheSpec]:
    """What each layer's Attention.get_kv_cache_spec returns for the Gemma-3-shaped model."""
    bs = vllm_config.cache_config.block_size
    heads = NUM_KV_HEADS // vllm_config.parallel_config.tensor_parallel_size
    specs: dict[str, KVCacheSpec] = {}
    for name, window in zip(HYBRID_LAYER_NAMES, HYBRID_WINDOWS, strict=True):
        if window:
            specs[name] = SlidingWindowSpec(
                block_size=bs,
                num_kv_heads=heads,
                head_size=HEAD_SIZE,
                dtype=torch.bfloat16,
                sliding_window=window,
            )
        else:
            specs[name] = FullAttentionSpec(
                block_size=bs, num_kv_heads=heads, head_size=HEAD_SIZE, dtype=torch.bfloat16
            )
    return specs


def plan_hybrid_kv_cache(vllm_config: VllmConfig, memory: int) -> KVCacheConfig:
    """vLLM's engine-core planning (get_global_kv_cache_groups + get_kv_cache_configs) of the
    hybrid model for `memory` bytes of KV cache: several groups with HMA on, one without."""
    specs = hybrid_layer_specs(vllm_config)
    return plan_kv_cache_configs(vllm_config, [specs], [memory])[0]


def hybrid_block_bytes(vllm_config: VllmConfig) -> int:
    """Bytes one block id costs with HMA on: one page per layer slot (the largest group)."""
    specs = hybrid_layer_specs(vllm_config)
    page = next(iter(specs.values())).page_size_bytes
    return page * (HYBRID_LAYERS // 2)


def connector_transfer_config(
    extra: dict[str, Any] | None = None,
    *,
    kv_role: str = "kv_both",
    failure_policy: str | None = None,
) -> dict[str, Any]:
    """Our connector's transfer config; `failure_policy` None leaves vLLM's default ("fail")."""
    out: dict[str, Any] = {
        "kv_connector": CONNECTOR,
        "kv_role": kv_role,
        "kv_connector_extra_config": dict(extra or {}),
    }
    if CONNECTOR_FORM == "module_path":
        out["kv_connector_module_path"] = MODULE_PATH
    if failure_policy is not None:
        out["kv_load_failure_policy"] = failure_policy
    return out


def make_vllm_config(
    model_dir: str,
    transfer: dict[str, Any] | None,
    *,
    block_size: int = 16,
    max_num_batched_tokens: int = 256,
    max_num_seqs: int = 64,
    tp_size: int = 1,
    pp_size: int = 1,
    layout: str = "LBNHC",
    async_scheduling: bool = False,
    kv_events: dict[str, Any] | None = None,
    disable_hma: bool | None = None,
) -> VllmConfig:
    model_config = copy.copy(_model_config(model_dir))
    cache_config = CacheConfig(block_size=block_size, enable_prefix_caching=True)
    # The engine core resolves the layout before connectors exist; do the same (vLLM 0.31+).
    if hasattr(cache_config, "kv_cache_layout"):
        cache_config.kv_cache_layout = layout
    cfg = VllmConfig(
        model_config=model_config,
        cache_config=cache_config,
        scheduler_config=SchedulerConfig(
            max_num_seqs=min(max_num_seqs, max_num_batched_tokens),
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=2048,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
            async_scheduling=async_scheduling,
            disable_hybrid_kv_cache_manager=disable_hma,
        ),
        parallel_config=ParallelConfig(
            tensor_parallel_size=tp_size, pipeline_parallel_size=pp_size
        ),
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=KVTransferConfig(**transfer) if transfer is not None else None,
        kv_events_config=KVEventsConfig(**kv_events) if kv_events is not None else None,
    )
    # The CPU platform turns async scheduling off; a test asking for the CUDA default gets it.
    cfg.scheduler_config.async_scheduling = async_scheduling
    return cfg


def stage_layers(pp_rank: int, pp_size: int) -> list[int]:
    """The layers PP stage `pp_rank` holds, split as vLLM's model loader splits them."""
    start, end = get_pp_indices(NUM_LAYERS, pp_rank, pp_size)
    return list(range(start, end))


def make_stage_kv_cache_configs(
    vllm_config: VllmConfig, num_blocks: int, *, hybrid: bool | str = False
) -> list[KVCacheConfig]:
    """One KVCacheConfig per PP stage, as vLLM's get_kv_cache_configs plans them: the groups of
    the whole model projected onto each stage's layers, every stage with the same num_blocks
    (each stage's tensors are sized by its own layers). `hybrid`: the Gemma-3-shaped model
    (one stage), with vLLM's own planning."""
    parallel = vllm_config.parallel_config
    if hybrid in ("jamba", "qwen3next"):  # the state-space hybrids of helpers/ssm_model.py
        from helpers import ssm_model

        names = ssm_model.layer_names(str(hybrid))
        return [ssm_model.plan_jamba_kv_cache(vllm_config, num_blocks, names)]
    if hybrid == "gemma4":  # groups of different block sizes (helpers/block_size_model.py)
        from helpers import block_size_model

        return [block_size_model.plan_kv_cache(vllm_config, num_blocks)]
    if hybrid:
        assert parallel.pipeline_parallel_size == 1, "the hybrid model runs on one stage"
        hma = not vllm_config.scheduler_config.disable_hybrid_kv_cache_manager
        per_block = hybrid_block_bytes(vllm_config) * (1 if hma else 2)
        cfg = plan_hybrid_kv_cache(vllm_config, num_blocks * per_block)
        assert cfg.num_blocks == num_blocks, (cfg.num_blocks, num_blocks)
        return [cfg]
    spec = FullAttentionSpec(
        block_size=vllm_config.cache_config.block_size,
        num_kv_heads=NUM_KV_HEADS // parallel.tensor_parallel_size,
        head_size=HEAD_SIZE,
        dtype=torch.float16,
    )
    out = []
    for p in range(parallel.pipeline_parallel_size):
        names = [LAYER_NAMES[i] for i in stage_layers(p, parallel.pipeline_parallel_size)]
        groups = [KVCacheGroupSpec(names, spec)]
        page = spec.page_size_bytes * len(names)
        cfg = get_kv_cache_config_from_groups(
            vllm_config, groups, available_memory=num_blocks * page
        )
        assert cfg.num_blocks == num_blocks, (cfg.num_blocks, num_blocks)
        out.append(cfg)
    return out


def make_kv_cache_config(vllm_config: VllmConfig, num_blocks: int) -> KVCacheConfig:
    """The scheduler's KVCacheConfig: vLLM's engine core takes the first worker's (stage 0's
    layers under PP; generate_scheduler_kv_cache_config checks num_blocks agree)."""
    return generate_scheduler_kv_cache_config(make_stage_kv_cache_configs(vllm_config, num_blocks))


# ------------------------------------------------------------------------------------ requests
_NONE_HASH_READY = False


def make_request(
    req_id: str,
    prompt: Sequence[int],
    *,
    max_tokens: int = 4,
    block_size: int = 16,
    cache_salt: str | None = None,
) -> Request:
    global _NONE_HASH_READY
    if not _NONE_HASH_READY:
        # What the engine core does after building the scheduler (the module's name, which the
        # connector wraps on a vLLM that draws a random root: compat.pin_none_hash).
        kv_cache_utils.init_none_hash(sha256)
        _NONE_HASH_READY = True
    return Request(
        request_id=req_id,
        prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        pooling_params=None,
        block_hasher=get_request_block_hasher(block_size, sha256),
        cache_salt=cache_salt,
    )


def prompt_tokens(seed: int, length: int, prefix: Sequence[int] = ()) -> list[int]:
    """Deterministic token ids in [1, 999] (seeded), after an optional shared prefix."""
    g = torch.Generator().manual_seed(seed)
    tail = torch.randint(1, 1000, (length - len(prefix),), generator=g).tolist()
    return [*prefix, *tail]


# ------------------------------------------------------------------------------------ the model
def _prefix_digests(tokens: Sequence[int]) -> list[int]:
    """A 32-bit digest of every prefix tokens[:p+1] (what KV at position p depends on)."""
    out = []
    h = hashlib.blake2b(digest_size=8)
    for t in tokens:
        h.update(int(t).to_bytes(4, "little"))
        out.append(int.from_bytes(h.copy().digest()[:4], "little"))
    return out


@dataclass
class FakeModel:
    """Writes/validates deterministic per-position KV in one rank's registered cache tensors:
    only the layers of its PP stage (`layers`, indices into LAYER_NAMES), the only ones it has."""

    rank: int
    kv_caches: dict[str, torch.Tensor]
    layers: list[int] = field(default_factory=lambda: list(range(NUM_LAYERS)))
    # Hybrid model: names of all layers, each layer's KV cache group and sliding window.
    names: Sequence[str] = tuple(LAYER_NAMES)
    layer_group: dict[int, int] = field(default_factory=dict)  # layer -> group (0 if absent)
    windows: Sequence[int] = ()  # layer -> sliding window in tokens (0 / absent: full)
    mismatches: list[str] = field(default_factory=list)
    written: dict[str, int] = field(default_factory=dict)  # req_id -> positions computed
    checked: dict[str, int] = field(default_factory=dict)  # req_id -> positions verified

    def expected(self, layer: int, digest: int) -> torch.Tensor:
        cache = self.kv_caches[self.names[layer]]
        h, c = cache.shape[1], cache.shape[3]
        base = torch.arange(h * c, dtype=torch.int64).reshape(h, c)
        seed = digest ^ (layer * 0x9E3779B1) ^ (self.rank * 0x85EBCA77)
        vals = (base * 2654435761 + seed) % 65521 - 32760
        return vals.to(torch.int16)

    def _slot(self, layer: int, block: int, offset: int) -> torch.Tensor:
        # [B, H, N, C] fp16 view -> int16 bits of one token slot: [H, C]
        return self.kv_caches[self.names[layer]][block, :, offset, :].view(torch.int16)

    def _table(self, layer: int, tables: Sequence[Sequence[int]]) -> Sequence[int]:
        return tables[self.layer_group.get(layer, 0)]

    def _window(self, layer: int) -> int:
        return self.windows[layer] if layer < len(self.windows) else 0

    def check(
        self,
        req_id: str,
        tokens: Sequence[int],
        block_ids: Sequence[int],
        upto: int,
        *,
        tables: Sequence[Sequence[int]] | None = None,
    ) -> None:
        """KV of positions [0, upto) the next token reads: all of a full-attention layer's,
        the last window - 1 of a sliding-window layer's (`tables`: per group, hybrid)."""
        digests = _prefix_digests(tokens[:upto])
        groups = tables if tables is not None else (block_ids,)
        sizes = {layer: self._layer_block_size(layer) for layer in self.layers}
        for p in range(upto):
            for layer in self.layers:
                window = self._window(layer)
                if window and p < upto - window + 1:
                    continue  # out of the window: vLLM freed the block
                bs = sizes[layer]
                got = self._slot(layer, self._table(layer, groups)[p // bs], p % bs)
                if not torch.equal(got, self.expected(layer, digests[p])):
                    self.mismatches.append(f"{req_id} pos {p} layer {layer} rank {self.rank}")
                    return
            self.checked[req_id] = self.checked.get(req_id, 0) + 1

    def write(
        self,
        req_id: str,
        tokens: Sequence[int],
        block_ids: Sequence[int],
        start: int,
        end: int,
        *,
        tables: Sequence[Sequence[int]] | None = None,
    ) -> None:
        digests = _prefix_digests(tokens[:end])
        groups = tables if tables is not None else (block_ids,)
        sizes = {layer: self._layer_block_size(layer) for layer in self.layers}
        for p in range(start, end):
            for layer in self.layers:
                bs = sizes[layer]
                self._slot(layer, self._table(layer, groups)[p // bs], p % bs).copy_(
                    self.expected(layer, digests[p])
                )
        self.written[req_id] = self.written.get(req_id, 0) + (end - start)

    def block_bits(self, block_id: int, group: int | None = None) -> list[torch.Tensor]:
        """This rank's layers' bytes of one block (for bit-exact comparisons between requests);
        `group`: only that KV cache group's layers (hybrid)."""
        return [
            self.kv_caches[self.names[i]][block_id].contiguous().view(torch.int16).clone()
            for i in self.layers
            if group is None or self.layer_group.get(i, 0) == group
        ]

    def _block_size(self) -> int:
        return int(self.kv_caches[self.names[self.layers[0]]].shape[2])

    def _layer_block_size(self, layer: int) -> int:
        """Tokens per block of one layer: its group's (vLLM may give groups different ones),
        unless a subclass says what the model's is."""
        if type(self)._block_size is not FakeModel._block_size:
            return self._block_size()
        return int(self.kv_caches[self.names[layer]].shape[2])


def sampled_token(tokens: Sequence[int]) -> int:
    return 10 + _prefix_digests(tokens)[-1] % 900


# ------------------------------------------------------------------------------------ engine
class _RecordingPublisher:
    def __init__(self, sink: list[Any]) -> None:
        self._sink = sink

    def publish(self, batch: Any) -> None:
        self._sink.extend(batch.events)

    def shutdown(self) -> None:
        return None


@dataclass
class Worker:
    connector: Any
    kv_caches: dict[str, torch.Tensor]
    model: FakeModel


@dataclass
class StepRecord:
    scheduled: dict[str, int]
    finished_sending: set[str]
    finished_recving: set[str]
    invalid_block_ids: set[int]
    loaded_req_ids: set[str]
    failed_recving: set[str] = field(default_factory=set)


_OPEN_ENGINES: list[Engine] = []


def shutdown_open_engines() -> int:
    """Shut down every engine a test left open; returns how many there were."""
    left = list(_OPEN_ENGINES)
    for e in left:
        e.shutdown()
    return len(left)


class Engine:
    """Scheduler + N worker-role connectors on CPU tensors, stepped like vLLM's engine core."""

    def __init__(
        self,
        model_dir: str,
        transfer: dict[str, Any] | None,
        *,
        num_blocks: int = 64,
        block_size: int = 16,
        tp_size: int = 1,
        pp_size: int = 1,
        max_num_batched_tokens: int = 256,
        layout: str = "LBNHC",
        async_scheduling: bool = False,
        kv_events: dict[str, Any] | None = None,
        disable_hma: bool | None = None,
        process_group: bool = False,
        recover: bool = True,
        hybrid: bool | str = False,
        max_model_len: int = HYBRID_MAX_MODEL_LEN,
    ) -> None:
        """`kv_events`: a KVEventsConfig (vLLM's --kv-events-config); vLLM's own publisher is
        kept. Without it, what the scheduler publishes is recorded in `events`.
        `transfer` None: plain vLLM without a connector (a baseline; one worker only).
        `process_group`: vLLM's distributed state on a one-process gloo group, as a worker has it
        (NixlConnector's worker reads its TP rank from it); TP and PP must be 1.
        `pp_size`: tp_size x pp_size workers, global rank = pp_rank * tp_size + tp_rank as vLLM
        numbers them; stage p's workers get stage p's KVCacheConfig and register only its layers,
        the scheduler gets stage 0's (what vLLM's engine core hands it). Steps stay synchronous
        (one batch in flight, not vLLM's batch queue of pp_size batches).
        `recover`: step (idle) until FlexKV adopted the restart inventory, so a test's first
        request can hit what a previous engine stored (lookups miss those blocks until then).
        `hybrid`: `model_dir` is `hybrid_model_dir`'s Gemma-3-shaped model, planned by vLLM
        (`max_model_len`: what vLLM's planning checks one request of fits in `num_blocks`);
        "jamba" / "qwen3next": helpers/ssm_model.py's state-space hybrids (vLLM raises their block
        size: the engine's `block_size` is the one vLLM chose); "gemma4": tests/
        block_size_model.py's groups of different block sizes (`block_size` is the hash one)."""
        assert transfer is not None or tp_size == pp_size == 1, "no connector: one worker"
        self.block_size = block_size
        self.hybrid = hybrid
        self.vllm_config = make_vllm_config(
            model_dir,
            transfer,
            block_size=block_size,
            max_num_batched_tokens=max_num_batched_tokens,
            tp_size=tp_size,
            pp_size=pp_size,
            layout=layout,
            async_scheduling=async_scheduling,
            kv_events=kv_events,
            disable_hma=disable_hma,
        )
        if hybrid in ("jamba", "qwen3next"):
            from helpers import ssm_model

            self.block_size = block_size = ssm_model.align_block_size(self.vllm_config)
        self._process_group: Path | None = None
        self.workers: list[Worker] = []
        self.scheduler: Any = None
        if process_group:
            assert tp_size == pp_size == 1, "a one-process group holds one rank"
            self._process_group = _init_process_group(self.vllm_config)
        # Shut down after the test even if it fails or stalls first (conftest): a process group
        # left behind makes every later engine's workers TP/PP rank 0.
        _OPEN_ENGINES.append(self)
        if hybrid:
            # vLLM's planning checks that one max-length request fits: keep the tests' pools small.
            self.vllm_config.model_config.max_model_len = max_model_len
            self.vllm_config.scheduler_config.max_model_len = max_model_len
        self.stage_kv_cache_configs = make_stage_kv_cache_configs(
            self.vllm_config, num_blocks, hybrid=hybrid
        )
        self.kv_cache_config = generate_scheduler_kv_cache_config(self.stage_kv_cache_configs)
        self.vllm_config.cache_config.num_gpu_blocks = num_blocks
        sched_bs = hash_bs = block_size
        if hybrid == "gemma4":
            # As the engine core resolves them: schedule in the LCM of the groups' block
            # sizes, hash every GCD tokens (tests' requests hash at `block_size`, the GCD).
            from vllm.v1.core.kv_cache_utils import resolve_kv_cache_block_sizes

            sched_bs, hash_bs = resolve_kv_cache_block_sizes(self.kv_cache_config, self.vllm_config)
            for kcc in (*self.stage_kv_cache_configs, self.kv_cache_config):
                kcc.hash_block_size = hash_bs
            self.block_size = hash_bs
        self.scheduler_block_size = sched_bs
        sched_cls = AsyncScheduler if async_scheduling else Scheduler
        self.scheduler = sched_cls(
            vllm_config=self.vllm_config,
            kv_cache_config=self.kv_cache_config,
            structured_output_manager=StructuredOutputManager(self.vllm_config),
            block_size=sched_bs,
            hash_block_size=hash_bs,
            log_stats=True,
        )
        self.connector = self.scheduler.connector
        self.events: list[Any] = []
        if kv_events is None:
            # update_from_output publishes connector.take_events(); record what it publishes.
            self.scheduler.kv_event_publisher = _RecordingPublisher(self.events)
        self.tp_size, self.pp_size = tp_size, pp_size
        self.world_size = world = tp_size * pp_size
        for rank in range(world):
            self.workers.append(self._make_worker(rank, layout))
        # One for the engine's lifetime, as vLLM's executor keeps it: a request is finished
        # once every worker (all TP ranks of all stages) has reported it, possibly in different
        # steps.
        self._aggregator = KVOutputAggregator(expected_finished_count=world)
        # MultiprocExecutor's output rank: TP rank 0 of the last stage (the one that samples).
        self._output_rank = world - tp_size
        self.history: list[StepRecord] = []
        self.outputs: dict[str, list[int]] = {}
        self.stats: list[dict[str, Any]] = []  # kv_connector_stats payload per step
        self._in_flight: list[tuple[SchedulerOutput, Any]] = []
        if recover:
            self.wait_recovered()

    def _make_worker(self, rank: int, layout: str) -> Worker:
        cfg = copy.copy(self.vllm_config)
        cfg.parallel_config = copy.copy(self.vllm_config.parallel_config)
        cfg.parallel_config.rank = rank
        pp_rank = rank // self.tp_size
        stage_config = self.stage_kv_cache_configs[pp_rank]
        from vllm.config import set_current_vllm_config

        kv = allocate_kv_cache(stage_config, layout)
        connector = None  # `transfer` None: plain vLLM, no connector (a baseline)
        if cfg.kv_transfer_config is not None:
            # As a worker builds it: under its config (NixlConnector's worker reads it, 0.23+).
            with set_current_vllm_config(cfg):
                connector = KVConnectorFactory.create_connector(
                    config=cfg, role=KVConnectorRole.WORKER, kv_cache_config=stage_config
                )
            connector.register_kv_caches(kv)
        if not self.hybrid:
            return Worker(connector, kv, FakeModel(rank, kv, stage_layers(pp_rank, self.pp_size)))
        if self.hybrid in ("jamba", "qwen3next"):
            from helpers import ssm_model

            names = ssm_model.layer_names(str(self.hybrid))
            return Worker(connector, kv, ssm_model.state_model(rank, kv, stage_config, names))
        if self.hybrid == "gemma4":
            from helpers import block_size_model

            return Worker(connector, kv, block_size_model.fake_model(rank, kv, stage_config))
        layer_group = {
            HYBRID_LAYER_NAMES.index(name): gid
            for gid, group in enumerate(stage_config.kv_cache_groups)
            for name in group.layer_names
        }
        # With HMA off vLLM promotes sliding-window layers to full attention: all KV is kept.
        hma = len(stage_config.kv_cache_groups) > 1
        model = FakeModel(
            rank,
            kv,
            list(range(HYBRID_LAYERS)),
            names=tuple(HYBRID_LAYER_NAMES),
            layer_group=layer_group,
            windows=tuple(HYBRID_WINDOWS) if hma else (),
        )
        return Worker(connector, kv, model)

    # -------------------------------------------------------------- driving
    def add(self, request: Request) -> Request:
        self.scheduler.add_request(request)
        return request

    def abort(self, req_ids: Iterable[str]) -> None:
        self.scheduler.finish_requests(list(req_ids), RequestStatus.FINISHED_ABORTED)

    def _run_workers(self, so: SchedulerOutput) -> ModelRunnerOutput:
        blob = pickle.dumps(so.kv_connector_metadata)
        per_rank: list[ModelRunnerOutput] = []
        req_ids = list(so.num_scheduled_tokens)
        for rank, w in enumerate(self.workers):
            c = w.connector
            if c is None:  # no connector: the forward and the sampled tokens only
                if so.total_num_scheduled_tokens > 0:
                    self._forward(w, so)
                per_rank.append(
                    ModelRunnerOutput(
                        req_ids=req_ids,
                        req_id_to_index={r: i for i, r in enumerate(req_ids)},
                        sampled_token_ids=self._sample(so) if rank == self._output_rank else [],
                    )
                )
                continue
            meta = pickle.loads(blob)
            c.handle_preemptions(meta)
            c.bind_connector_metadata(meta)
            started = False
            # vLLM before 0.31 has no such flag: its V1 runner always starts loads first.
            if getattr(so, "has_sync_kv_loads", True):
                self._start_load(c)
                started = True
            if so.total_num_scheduled_tokens > 0:
                self._forward(w, so)
            if hasattr(c, "finish_forward"):  # vLLM 0.31+
                c.finish_forward()
            if not started:
                self._start_load(c)
            c.wait_for_save()
            sending, recving, failed = transfer_results(c, so.finished_req_ids)
            out = kv_connector_output(
                finished_sending=sending or None,
                finished_recving=recving or None,
                failed_recving=failed,
                invalid_block_ids=c.get_block_ids_with_load_errors(),
                kv_connector_stats=c.get_kv_connector_stats(),
                kv_cache_events=c.get_kv_connector_kv_cache_events(),
                kv_connector_worker_meta=c.build_connector_worker_meta(),
            )
            c.clear_connector_metadata()
            if rank < self.world_size - self.tp_size:
                # A stage before the last passes on only its connector output (as
                # GPUModelRunner.sample_tokens does on a non-last PP rank).
                per_rank.append(ModelRunnerOutput.with_kv_conn_output_only(out))
                continue
            per_rank.append(
                ModelRunnerOutput(
                    req_ids=req_ids,
                    req_id_to_index={r: i for i, r in enumerate(req_ids)},
                    sampled_token_ids=self._sample(so) if rank == self._output_rank else [],
                    kv_connector_output=out,
                )
            )
        if len(per_rank) == 1:
            return per_rank[0]
        aggregated = self._aggregator.aggregate(list(per_rank), self._output_rank)
        assert aggregated is not None
        return aggregated

    def _start_load(self, connector: Any) -> None:
        # As ActiveKVConnector does outside a forward: a context without attention metadata.
        with set_forward_context(None, self.vllm_config):
            connector.start_load_kv(get_forward_context())

    def _forward(self, w: Worker, so: SchedulerOutput) -> None:
        mgr = self.scheduler.kv_cache_manager
        starts = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        # KV from the GPU prefix cache or a load is first read when a request (re)joins.
        joining = {r.req_id for r in so.scheduled_new_reqs} | set(cached.resumed_req_ids)
        for req_id, n in so.num_scheduled_tokens.items():
            req = self.scheduler.requests[req_id]
            tokens = req.all_token_ids
            tables = mgr.get_block_ids(req_id)
            block_ids = tables[0]
            start = starts[req_id]
            if req_id in joining:
                w.model.check(req_id, tokens, block_ids, start, tables=tables)
            w.model.write(req_id, tokens, block_ids, start, start + n, tables=tables)

    def _sample(self, so: SchedulerOutput) -> list[list[int]]:
        starts = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        out = []
        for req_id, n in so.num_scheduled_tokens.items():
            req = self.scheduler.requests[req_id]
            if starts[req_id] + n < req.num_tokens:
                out.append([])  # a prefill chunk: nothing sampled
            else:
                out.append([sampled_token(req.all_token_ids)])
        return out

    def step(self) -> StepRecord:
        so = self.scheduler.schedule()
        mro = self._run_workers(so)
        kvo = mro.kv_connector_output
        rec = StepRecord(
            scheduled=dict(so.num_scheduled_tokens),
            finished_sending=set(kvo.finished_sending or ()) if kvo else set(),
            finished_recving=set(kvo.finished_recving or ()) if kvo else set(),
            invalid_block_ids=set(kvo.invalid_block_ids) if kvo else set(),
            loaded_req_ids=set(),
            failed_recving=set(getattr(kvo, "failed_recving", None) or ()) if kvo else set(),
        )
        engine_outputs = self.scheduler.update_from_output(so, mro)
        for eco in engine_outputs.values():
            # Worker stats (aggregated over ranks) + the scheduler side's, as vLLM logs them.
            sched_stats = eco.scheduler_stats
            if sched_stats is not None and sched_stats.kv_connector_stats:
                self.stats.append(dict(sched_stats.kv_connector_stats))
            for o in eco.outputs:
                self.outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
        self.history.append(rec)
        return rec

    def run(self, timeout_s: float = 120.0) -> int:
        """Step until the scheduler holds no request (including delayed frees)."""
        # Before 0.26 vLLM's has_requests() ignores requests whose blocks wait for the
        # connector's stores and the stores in flight (an idle engine core stops stepping; its
        # next request's steps collect them): step on, as those steps would.
        s = self.scheduler
        sides = self.flexkv_scheduler_sides()

        def idle() -> bool:
            pending = any(side.has_pending_stores() for side in sides)
            return not s.has_requests() and not s.requests and not pending

        return self.run_until(idle, timeout_s, first=False)

    def run_until(self, cond: Any, timeout_s: float = 120.0, *, first: bool = True) -> int:
        """Step until `cond()`; idle steps (nothing scheduled, transfers in flight) are cheap,
        so the bound is wall time, and an idle step yields the CPU to the transfer threads."""
        deadline = time.monotonic() + timeout_s
        steps = 0
        if not first and cond():
            return 0
        while True:
            rec = self.step()
            steps += 1
            if cond():
                return steps
            if time.monotonic() > deadline:
                raise AssertionError(f"condition not reached in {timeout_s} s ({steps} steps)")
            if not rec.scheduled:
                time.sleep(0.0005)

    def flexkv_scheduler_sides(self) -> list[Any]:
        """The scheduler side of every FlexKV connector (itself or inside a wrapper)."""
        from flexkv_py.integration.vllm.connector import FlexKVConnectorV1

        c = self.connector
        subs = [] if c is None else children(c) or [c]
        return [s.scheduler_side for s in subs if isinstance(s, FlexKVConnectorV1)]

    def wait_recovered(self, timeout_s: float = 30.0) -> int:
        """Step until every FlexKV scheduler side adopted its workers' restart inventory (at
        once without an SSD tier); returns the steps it took."""
        sides = self.flexkv_scheduler_sides()
        return self.run_until(lambda: all(s.recovered for s in sides), timeout_s, first=False)

    def mismatches(self) -> list[str]:
        return [m for w in self.workers for m in w.model.mismatches]

    def reset_gpu_prefix_cache(self) -> None:
        assert self.scheduler.reset_prefix_cache(), "GPU prefix cache reset refused"

    def shutdown(self) -> None:
        if self not in _OPEN_ENGINES:
            return  # already shut down
        _OPEN_ENGINES.remove(self)
        for w in self.workers:
            if w.connector is not None:
                w.connector.shutdown()
        if self.scheduler is not None:
            self.scheduler.shutdown()
        if self._process_group is not None:
            import shutil

            from vllm.distributed import parallel_state as ps

            ps.destroy_model_parallel()
            ps.destroy_distributed_environment()
            shutil.rmtree(self._process_group, ignore_errors=True)


def vllm_version() -> str:
    import vllm

    return str(vllm.__version__)


def children(connector: Any) -> list[Any]:
    """A MultiConnector's (or PdConnector's) children: `sub_connectors` (0.31+), else its list."""
    subs = getattr(connector, "sub_connectors", None)
    if subs is None:
        subs = getattr(connector, "_connectors", None)
    return list(subs or ())


def _init_process_group(vllm_config: VllmConfig) -> Path:
    """vLLM's distributed state on one gloo rank; returns the rendezvous directory."""
    import tempfile

    from vllm.config import set_current_vllm_config
    from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment

    tmp = Path(tempfile.mkdtemp(prefix="flexkv-pg-"))
    rendezvous = tmp / "rendezvous"
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(
            world_size=1,
            rank=0,
            distributed_init_method=f"file://{rendezvous}",
            local_rank=0,
            backend="gloo",
        )
        ensure_model_parallel_initialized(1, 1)
    return tmp


def assert_no_leaks(engine: Engine) -> None:
    s = engine.scheduler
    assert not s.requests, f"requests left: {list(s.requests)}"
    assert len(s.waiting) == 0 and len(s.running) == 0
    assert not s.finished_recving_kv_req_ids
    mgr = s.kv_cache_manager
    for single in mgr.coordinator.single_type_managers:
        assert not single.req_to_blocks, f"blocks held: {list(single.req_to_blocks)}"
    pool = mgr.block_pool
    assert pool.free_block_queue.num_free_blocks == pool.num_gpu_blocks - 1  # minus null block
    assert all(b.ref_cnt == 0 for b in pool.blocks if not b.is_null)
    # The scheduler side's per-request key memo is forgotten with its requests.
    side = getattr(getattr(engine, "connector", None), "_scheduler", None)
    memo = getattr(side, "_keys", None)
    assert memo is None or len(memo) == 0, f"request keys left: {len(memo or ())}"


def corrupt_ssd(ssd_dir: Path) -> int:
    """Flip bytes all over every data file, past its one-page superblock."""
    import numpy as np

    n = 0
    for f in ssd_dir.rglob("*.dat"):
        data = np.memmap(f, dtype=np.uint8, mode="r+")
        data[4096::97] ^= 0xFF
        data.flush()
        del data
        fd = os.open(f, os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
        n += 1
    return n


def with_ssd(ssd_dir: Path, **kw: Any) -> dict[str, Any]:
    """Connector extra config with a small host tier and a write-through SSD tier."""
    ssd_dir.mkdir(parents=True, exist_ok=True)
    return {
        "cpu_cache_gb": 0.004,
        "ssd_cache_gb": 0.03,
        "ssd_cache_dir": str(ssd_dir),
        "admission": "write_through",
        **kw,
    }
