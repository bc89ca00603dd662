"""`flexkv-py replay`: drive a workload through the whole tier stack and measure what it saves.

Per request, like a vLLM worker with the connector: reuse the leading blocks still in the
(simulated) GPU prefix cache; ask the offload tiers for the next ones and load them into fresh GPU
blocks; "prefill" the rest (write their deterministic KV); store the freshly computed blocks.
Every loaded block is compared bit for bit with the KV it must have.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from flexkv_py.cli.model_shape import ModelShape
from flexkv_py.cli.reference_lru import lru_hit_rate
from flexkv_py.cli.sim_gpu import SimulatedGPU
from flexkv_py.cli.workloads import Workload
from flexkv_py.config import FlexKVConfig, load_config, resolve_config
from flexkv_py.coordinator import CacheEngine
from flexkv_py.coordinator.planning import slot_nbytes_for
from flexkv_py.errors import ConfigError
from flexkv_py.index.lower_capacity import STORE_PAGE, SUPERBLOCK_PAGES, block_pages
from flexkv_py.index.namespace import Namespace
from flexkv_py.index.tier_names import Tier
from flexkv_py.tiers.private_files import make_private_dir
from flexkv_py.transfer import describe_kv_caches

logger = logging.getLogger(__name__)

GIB = 1 << 30


@dataclass(frozen=True)
class TierSizes:
    """Capacities in blocks. None = derived from the workload's unique blocks."""

    gpu_blocks: int | None = None
    cpu_blocks: int | None = None
    ssd_blocks: int | None = None
    # Defaults: a GPU cache far smaller than the working set, a host tier that holds a quarter
    # of it, an SSD tier that holds all of it: every tier gets hits.
    gpu_fraction: float = 0.08
    cpu_fraction: float = 0.25
    ssd_fraction: float = 1.5

    def resolve(self, workload: Workload) -> tuple[int, int, int]:
        unique = max(1, workload.unique_blocks)
        gpu = self.gpu_blocks or int(unique * self.gpu_fraction)
        gpu = max(gpu, workload.max_request_blocks + 1)  # one request must fit
        cpu = self.cpu_blocks or max(4, int(unique * self.cpu_fraction))
        ssd = self.ssd_blocks if self.ssd_blocks is not None else int(unique * self.ssd_fraction)
        return gpu, cpu, ssd


@dataclass
class ReplayOptions:
    shape: ModelShape = field(default_factory=ModelShape)
    sizes: TierSizes = field(default_factory=TierSizes)
    ssd_dir: Path | None = None  # kept after the run; None = a temporary directory
    use_config: bool = False  # host/SSD tiers from FLEXKV_* env / FLEXKV_CONFIG_PATH
    overrides: Mapping[str, Any] = field(default_factory=dict)
    progress: bool = True
    # Wait for background jobs (spills, deletes) after each request, so hit rates do not depend
    # on how fast the machine runs them (tests; a live engine does not wait).
    settle: bool = False


@dataclass
class Sample:
    """One request's figures (the time series behind the plot)."""

    t: float  # seconds since the replay started, at the end of this request
    blocks: int
    hits: int
    load_bytes: int
    load_s: float
    store_bytes: int
    store_s: float


@dataclass
class ReplayResult:
    workload: str
    params: dict[str, Any]
    requests: int
    blocks: int
    hits_by_tier: dict[str, int]
    misses: int
    load_failures: int  # blocks the tiers claimed but could not deliver (recomputed)
    mismatches: int  # loaded blocks whose bytes were wrong: must be 0
    prompt_tokens: int
    block_tokens: int
    page_bytes: int
    seconds: float
    load_bytes: int
    load_seconds: float
    store_bytes: int
    store_seconds: float
    tiers: dict[str, Any]
    ssd: dict[str, Any]
    manager: dict[str, Any]
    samples: list[Sample]
    references: dict[str, float] = field(default_factory=dict)  # reference_lru.py

    @property
    def hits(self) -> int:
        return sum(self.hits_by_tier.values())

    @property
    def hit_rate(self) -> float:
        return self.hits / self.blocks if self.blocks else 0.0

    @property
    def tokens_saved(self) -> int:
        return self.hits * self.block_tokens

    def summary(self) -> dict[str, Any]:
        """The JSON report (one line with `--json`)."""
        gbps = {
            "load": _gbps(self.load_bytes, self.load_seconds),
            "store": _gbps(self.store_bytes, self.store_seconds),
        }
        ssd = self.ssd
        return {
            "workload": self.workload,
            "requests": self.requests,
            "blocks": self.blocks,
            "hits": self.hits,
            "misses": self.misses,
            "hit_rate": self.hit_rate,
            "hits_by_tier": dict(self.hits_by_tier),
            "hit_rate_by_tier": {
                t: (n / self.blocks if self.blocks else 0.0) for t, n in self.hits_by_tier.items()
            },
            "bytes_by_tier": {
                "cpu": {
                    "read": int(self.manager.get("load_host_bytes", 0)),
                    "write": self.store_bytes,
                },
                "ssd": {
                    "read": int(ssd.get("bytes_read", 0)),
                    "write": int(ssd.get("bytes_written", 0)),
                },
            },
            "gbps": gbps,
            "tokens_saved": self.tokens_saved,
            "prompt_tokens": self.prompt_tokens,
            # What the offload tiers add on top of the GPU prefix cache alone.
            "tokens_saved_by_offload": (self.hits - self.hits_by_tier["gpu"]) * self.block_tokens,
            "tokens_saved_fraction": (
                self.tokens_saved / self.prompt_tokens if self.prompt_tokens else 0.0
            ),
            "dedup_ratio": float(ssd.get("dedup_ratio", 1.0)),
            "ssd_logical_bytes": int(ssd.get("logical_bytes", 0)),
            "ssd_physical_bytes": int(ssd.get("physical_bytes", 0)),
            "load_failures": self.load_failures,
            # Blocks the index promised that could not be loaded (recomputed): must be 0.
            "false_hits": self.load_failures,
            "references": self.references,
            # SSD wear: bytes written to the SSD per byte it served (None: it served nothing).
            "ssd_written_per_served": (
                int(ssd.get("bytes_written", 0)) / int(ssd["bytes_read"])
                if ssd.get("bytes_read")
                else None
            ),
            "mismatches": self.mismatches,
            "block_tokens": self.block_tokens,
            "page_bytes": self.page_bytes,
            "tiers": self.tiers,
            "seconds": self.seconds,
            "params": self.params,
        }


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else 0.0


def _config(opts: ReplayOptions, page_bytes: int, cpu: int, ssd: int, ssd_dir: str) -> FlexKVConfig:
    if opts.use_config:
        return resolve_config(opts.overrides or None).config
    slot = slot_nbytes_for(page_bytes)
    # Half a slot of slack: float GiB must round back to exactly `cpu` slots.
    cpu_bytes = cpu * slot + slot // 2
    values: dict[str, Any] = {"cpu_cache_gb": cpu_bytes / GIB, "host_huge_pages": False}
    if ssd > 0:
        # Exactly `ssd` blocks as the store lays them out (one directory), as the references
        # assume; half a page of slack so float GiB rounds back to the same pages.
        exact = (ssd * block_pages(slot) + SUPERBLOCK_PAGES) * STORE_PAGE + STORE_PAGE // 2
        ssd_bytes = max(exact, cpu_bytes + slot)  # the config wants SSD > host
        values.update(ssd_cache_gb=ssd_bytes / GIB, ssd_cache_dir=ssd_dir)
    values.update(opts.overrides)
    return load_config(values, env={})  # embedded defaults: the environment does not leak in


@contextlib.contextmanager
def _ssd_directory(opts: ReplayOptions) -> Iterator[str]:
    if opts.ssd_dir is not None:
        try:
            make_private_dir(str(opts.ssd_dir))  # holds KV blocks: 0700 when we create it
        except OSError as e:
            raise ConfigError(
                f"--ssd-dir: cannot create {str(opts.ssd_dir)!r}: {e.strerror}"
            ) from e
        yield str(opts.ssd_dir)
        return
    tmp = tempfile.mkdtemp(prefix="flexkv-replay-")
    try:
        yield tmp
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def replay(workload: Workload, opts: ReplayOptions) -> ReplayResult:
    if not workload.requests:
        raise ConfigError("workload has no requests")
    gpu_blocks, cpu_blocks, ssd_blocks = opts.sizes.resolve(workload)
    gpu = SimulatedGPU(opts.shape, gpu_blocks, workload.block_tokens)
    geom = describe_kv_caches(gpu.kv_caches)
    ns = Namespace(
        model=f"flexkv-replay/{opts.shape.layers}x{opts.shape.kv_heads}x{opts.shape.head_dim}",
        revision=None,
        kv_dtype=opts.shape.dtype,
        kv_layout=geom.layout,
        block_size=workload.block_tokens,
        page_bytes=geom.page_nbytes,
    )
    with _ssd_directory(opts) as ssd_dir:
        config = _config(opts, geom.page_nbytes, cpu_blocks, ssd_blocks, ssd_dir)
        engine = CacheEngine.from_kv_caches(config, ns, gpu.kv_caches)
        try:
            tiers = {
                "gpu_blocks": gpu_blocks,
                "cpu_blocks": engine.manager.num_host_slots,
                "ssd_bytes": config.ssd_cache_bytes,
                "ssd_dirs": list(config.ssd_cache_dir) if config.ssd_enabled else [],
                "ssd_kept": opts.ssd_dir is not None or opts.use_config,
                "kv_layout": geom.layout,
                "transfer": type(engine.executor.transfer).__name__,
            }
            logger.info(
                "replay %s: %d requests, %d blocks (%d unique) of %d KiB; GPU %d blocks, "
                "host %d blocks, SSD %.2f GiB",
                workload.name,
                len(workload.requests),
                workload.num_blocks,
                workload.unique_blocks,
                geom.page_nbytes >> 10,
                gpu_blocks,
                engine.manager.num_host_slots,
                config.ssd_cache_gb,
            )
            result = _run(workload, ns, gpu, engine, geom.page_nbytes, opts.progress, opts.settle)
            engine.flush()
            stats = engine.stats()
        finally:
            engine.close()
        result.tiers = tiers
        result.ssd = {k: v for k, v in stats["executor"].get("ssd", {}).items()}
        result.manager = dict(stats["manager"])
        result.params = {"workload": workload.params, "model": asdict(opts.shape)}
        reqs = [ns.keys(r.keys) for r in workload.requests]
        ssd_n = ssd_blocks if config.ssd_enabled else 0
        result.references = {
            f"lru_gpu_ssd_{gpu_blocks + ssd_n}": lru_hit_rate(reqs, gpu_blocks + ssd_n),
            f"lru_all_{gpu_blocks + cpu_blocks + ssd_n}": lru_hit_rate(
                reqs, gpu_blocks + cpu_blocks + ssd_n
            ),
        }
        return result


def _run(
    workload: Workload,
    ns: Namespace,
    gpu: SimulatedGPU,
    engine: CacheEngine,
    page_bytes: int,
    progress: bool,
    settle: bool = False,
) -> ReplayResult:
    hits = {"gpu": 0, "cpu": 0, "ssd": 0}
    res = ReplayResult(
        workload=workload.name,
        params={},
        requests=len(workload.requests),
        blocks=0,
        hits_by_tier=hits,
        misses=0,
        load_failures=0,
        mismatches=0,
        prompt_tokens=0,
        block_tokens=workload.block_tokens,
        page_bytes=page_bytes,
        seconds=0.0,
        load_bytes=0,
        load_seconds=0.0,
        store_bytes=0,
        store_seconds=0.0,
        tiers={},
        ssd={},
        manager={},
        samples=[],
    )
    start = time.perf_counter()
    bar = tqdm(workload.requests, desc="replay", unit="req", disable=not progress, mininterval=0.5)
    for req in bar:
        keys, contents = ns.keys(req.keys), req.contents
        g = len(gpu.prefix_hits(keys))
        if g:  # as a connector hears of the engine's own prefix hits: recency below too
            engine.manager.touch(keys[:g])
        rest = keys[g:]
        blocks = gpu.allocate(len(rest), keep=keys[:g])
        loaded, load_bytes, load_s = 0, 0, 0.0
        n = engine.lookup(rest) if rest else 0
        if n:
            gpu.poison(blocks[:n])  # a load that writes nothing must not pass the check
            t0 = time.perf_counter()
            out = engine.load(rest[:n], blocks[:n])
            load_s = time.perf_counter() - t0
            while loaded < n and out.statuses[loaded] == "ok":
                loaded += 1  # like vLLM: recompute from the first block that failed
            for tier in out.source_tiers[:loaded]:
                hits["cpu" if tier == Tier.HOST.value else tier] += 1  # the report says CPU
            res.load_failures += n - loaded
            res.mismatches += gpu.mismatches(blocks[:loaded], contents[g : g + loaded])
            load_bytes = loaded * page_bytes
        gpu.compute(blocks[loaded:], contents[g + loaded :])
        store_bytes, store_s = 0, 0.0
        if loaded < len(rest):
            t0 = time.perf_counter()
            first = g + loaded  # the stored blocks extend the prefix before them
            parent = keys[first - 1] if first else None
            stored = engine.store(rest[loaded:], blocks[loaded:], parent=parent)
            store_s = time.perf_counter() - t0
            store_bytes = stored.num_ok * page_bytes
        gpu.insert(rest, blocks)
        if settle:
            engine.flush()

        hits["gpu"] += g
        res.blocks += len(keys)
        res.misses += len(rest) - loaded
        res.prompt_tokens += req.prompt_tokens
        res.load_bytes += load_bytes
        res.load_seconds += load_s
        res.store_bytes += store_bytes
        res.store_seconds += store_s
        res.samples.append(
            Sample(
                time.perf_counter() - start,
                len(keys),
                g + loaded,
                load_bytes,
                load_s,
                store_bytes,
                store_s,
            )
        )
        if progress:
            bar.set_postfix(hit=f"{res.hits / max(1, res.blocks):.2f}", refresh=False)
    bar.close()
    res.seconds = time.perf_counter() - start
    return res
