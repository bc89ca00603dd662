"""Restore vs recompute: prefill a Qwen3-8B-shaped model, or restore its KV from host / SSD.

For each prompt length P (default 4K, 16K, 32K tokens):
  prefill   the model's forward over P tokens (random weights, bf16, CUDA-synchronized, warm-up
            first, median of --reps runs): the cost of recomputing the KV
  capture   its past_key_values (per layer K and V) written into a vLLM 0.33 paged cache: per layer
            a [num_blocks, kv_heads, 16, 2*head_dim] view (K and V concatenated on the last dim) of
            one bf16 buffer, physical order LBNHC, at scattered (randomly permuted) block ids
  host      CacheEngine.store into the host tier, zero the GPU copy, CacheEngine.load into OTHER
            block ids (median of --reps), vs a contiguous pinned H2D memcpy of the same bytes
  ssd       write-through store into the SSD tier, restart (new engine, empty host tier), load into
            the other block ids (every block from SSD), vs a raw O_DIRECT read of the same bytes
  check     the restored blocks are bit-identical to the captured ones (torch.equal), and the
            next-token logits over the KV gathered from the restored pages equal (exactly) those
            over the KV gathered from the original pages (one DynamicCache built from each)
Reports per P: prefill ms, restore ms (host, SSD), speedups, GB/s vs the ceilings measured in the
same run, and the disk speed at which an SSD restore breaks even with recompute (bytes / prefill).
Goal: host restore of 32K tokens at >= 0.95 of pinned memcpy and >= 17x faster than recompute.

    python3 benches/restore_vs_recompute.py [--tokens 4096,16384,32768] [--json] [--plot FILE]
        [--ssd-dir DIR] [--reps 3] [--quick]

`--quick`: a tiny model and short prompts, so the whole path runs in seconds on CPU (smoke test).
"""

from __future__ import annotations

import argparse
import functools
import json
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flexkv_py.config import load_config
from flexkv_py.coordinator import CacheEngine
from flexkv_py.errors import ConfigError
from flexkv_py.index.namespace import Namespace
from flexkv_py.index.tier_names import Tier
from flexkv_py.tiers.ssd_tier import SsdTier

BLOCK = 16  # tokens per vLLM block
RAW_CHUNK = 8 << 20
GOAL_TOKENS = 32768
GOAL_RATIO = 0.95
GOAL_SPEEDUP = 17.0
# vLLM 0.33 stride order over the logical [L, B, H, N, C] (LBNHC: per layer, block, token, head).
LBNHC_ORDER = (0, 1, 3, 2, 4)

QWEN3_8B: dict[str, Any] = dict(
    num_hidden_layers=36,
    hidden_size=4096,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=12288,
    vocab_size=151936,
    max_position_embeddings=40960,
)
TINY: dict[str, Any] = dict(
    num_hidden_layers=2,
    hidden_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    intermediate_size=256,
    vocab_size=512,
    max_position_embeddings=4096,
)


# ---------------------------------------------------------------------------------------- timing
class Clock:
    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def time(self, fn: Callable[[], Any]) -> tuple[float, Any]:
        self.sync()
        t0 = time.perf_counter()
        out = fn()
        self.sync()
        return time.perf_counter() - t0, out


def memcpy_h2d(nbytes: int, cuda: bool, reps: int) -> float:
    """Median seconds of one contiguous pinned host -> device copy of nbytes."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda" if cuda else "cpu")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    host.fill_(1)
    clock = Clock(cuda)
    clock.time(lambda: dev.copy_(host, non_blocking=True))  # warm-up
    t = statistics.median(
        clock.time(lambda: dev.copy_(host, non_blocking=True))[0] for _ in range(reps)
    )
    return t


def raw_odirect_read(directory: Path, nbytes: int) -> tuple[float, bool]:
    """Write nbytes, then read them back sequentially (8 MiB preadv) with O_DIRECT when the file
    system allows it: (seconds of the read, whether O_DIRECT was used)."""
    path = directory / "raw-read.dat"
    buf = mmap.mmap(-1, RAW_CHUNK)  # page-aligned, as O_DIRECT needs
    buf.write(os.urandom(RAW_CHUNK))
    direct = True
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
    except OSError:  # e.g. tmpfs: no O_DIRECT
        direct = False
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        total = -(-nbytes // RAW_CHUNK) * RAW_CHUNK
        for off in range(0, total, RAW_CHUNK):
            os.pwrite(fd, buf, off)
        os.fsync(fd)
        if not direct:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        t0 = time.perf_counter()
        for off in range(0, total, RAW_CHUNK):
            if os.preadv(fd, [buf], off) != RAW_CHUNK:
                raise SystemExit(f"raw read short at {off}")
        return (time.perf_counter() - t0) * nbytes / total, direct
    finally:
        os.close(fd)
        path.unlink()


# ----------------------------------------------------------------------------------------- model
def build_model(quick: bool, device: str) -> Any:
    from transformers import AutoModelForCausalLM, Qwen3Config

    cfg = Qwen3Config(
        **(TINY if quick else QWEN3_8B),
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    if isinstance(getattr(cfg, "rope_parameters", None), dict):  # transformers >= 5
        cfg.rope_parameters["rope_theta"] = 1000000.0  # Qwen3-8B's
    else:
        cfg.rope_theta = 1000000.0
    torch.manual_seed(0)
    with torch.device(device):
        try:
            model = AutoModelForCausalLM.from_config(
                cfg, dtype=torch.bfloat16, attn_implementation="sdpa"
            )
        except TypeError:  # transformers < 4.56
            model = AutoModelForCausalLM.from_config(
                cfg, torch_dtype=torch.bfloat16, attn_implementation="sdpa"
            )
    return model.to(device=device, dtype=torch.bfloat16).eval()


def cache_layers(pkv: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (K, V), each [1, kv_heads, tokens, head_dim], from a transformers cache."""
    if hasattr(pkv, "layers"):  # transformers >= 4.56
        return [(layer.keys, layer.values) for layer in pkv.layers]
    if hasattr(pkv, "key_cache"):
        return list(zip(pkv.key_cache, pkv.value_cache, strict=True))
    return [(k, v) for k, v in pkv]  # legacy tuple of tuples


def make_dynamic_cache(kv: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    from transformers import DynamicCache

    cache = DynamicCache()
    for i, (k, v) in enumerate(kv):
        cache.update(k, v, i)
    return cache


@torch.inference_mode()
def prefill(model: Any, ids: torch.Tensor) -> Any:
    return model(input_ids=ids, use_cache=True, logits_to_keep=1)


@torch.inference_mode()
def next_token_logits(
    model: Any, kv: list[tuple[torch.Tensor, torch.Tensor]], token: torch.Tensor, math: bool = True
) -> torch.Tensor:
    """Logits of one next token over this KV. Attention runs SDPA's math backend by default: with
    the default (fused) backends, bit-identical KV of 32K tokens gave logits up to 0.14 apart on
    the H200, which would make "exactly equal" meaningless (row: logits_repeatable_fused)."""
    import contextlib

    from torch.nn.attention import SDPBackend, sdpa_kernel

    p = kv[0][0].shape[2]
    pos = torch.tensor([[p]], device=token.device)
    with sdpa_kernel([SDPBackend.MATH]) if math else contextlib.nullcontext():
        out = model(
            input_ids=token,
            past_key_values=make_dynamic_cache(kv),
            position_ids=pos,
            cache_position=pos[0],
            use_cache=True,
        )
    return out.logits[:, -1].float()


# ------------------------------------------------------------------------------------ paged cache
def make_paged_caches(
    layers: int, blocks: int, heads: int, head: int, device: str
) -> dict[str, torch.Tensor]:
    """vLLM 0.33 KV caches: per layer a [B, H, N, 2*D] view of one bf16 buffer, LBNHC order,
    filled with random bits (so unwritten blocks never look restored)."""
    logical = (layers, blocks, heads, BLOCK, 2 * head)
    buf = torch.empty(tuple(logical[d] for d in LBNHC_ORDER), dtype=torch.bfloat16, device=device)
    buf.view(torch.int16).random_(-32768, 32767)
    view5 = buf.permute(*[LBNHC_ORDER.index(d) for d in range(5)])  # logical [L, B, H, N, C]
    return {f"model.layers.{i}.self_attn.attn": view5[i] for i in range(layers)}


def scatter_kv(
    caches: dict[str, torch.Tensor], kv: list[tuple[torch.Tensor, torch.Tensor]], ids: list[int]
) -> None:
    """Write each layer's K, V ([1, H, P, D]) into the paged cache at block ids `ids`."""
    idx = torch.tensor(ids, device=kv[0][0].device)
    for view, (k, v) in zip(caches.values(), kv, strict=True):
        _, h, p, d = k.shape
        pages = torch.cat([k[0], v[0]], dim=-1).reshape(h, p // BLOCK, BLOCK, 2 * d)
        view[idx] = pages.permute(1, 0, 2, 3)


def gather_kv(
    caches: dict[str, torch.Tensor], ids: list[int]
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (K, V) [1, H, len(ids)*16, D], read back from the paged cache's blocks `ids`."""
    idx = torch.tensor(ids, device=next(iter(caches.values())).device)
    out = []
    for view in caches.values():
        pages = view[idx]  # [n, H, N, 2D]
        n, h, _, c = pages.shape
        kv = pages.permute(1, 0, 2, 3).reshape(1, h, n * BLOCK, c)
        d = c // 2
        out.append((kv[..., :d].contiguous(), kv[..., d:].contiguous()))
    return out


def blocks_equal(caches: dict[str, torch.Tensor], a: list[int], b: list[int]) -> bool:
    dev = next(iter(caches.values())).device
    ia, ib = torch.tensor(a, device=dev), torch.tensor(b, device=dev)
    return all(torch.equal(v[ia], v[ib]) for v in caches.values())


def kv_equal(
    a: list[tuple[torch.Tensor, torch.Tensor]], b: list[tuple[torch.Tensor, torch.Tensor]]
) -> bool:
    return all(
        torch.equal(x, y) for la, lb in zip(a, b, strict=True) for x, y in zip(la, lb, strict=True)
    )


# ------------------------------------------------------------------------------------- one prompt
def run_prompt(
    model: Any, p: int, args: argparse.Namespace, base: Path, cuda: bool, log: Any
) -> dict[str, Any]:
    device = "cuda" if cuda else "cpu"
    clock = Clock(cuda)
    cfg = model.config
    layers, heads, head = cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim
    n = p // BLOCK
    page = layers * heads * BLOCK * 2 * head * 2  # bytes per block: all layers, K and V, bf16
    nbytes = n * page
    row: dict[str, Any] = {"tokens": p, "blocks": n, "page_bytes": page, "bytes": nbytes}

    free = shutil.disk_usage(base).free
    if free < 2.6 * nbytes + (1 << 30):
        raise SystemExit(
            f"P={p}: {free / 1e9:.1f} GB free under {base}, need ~{2.6 * nbytes / 1e9:.1f}"
        )

    # ---- recompute: the prefill
    g = torch.Generator().manual_seed(p)
    ids = torch.randint(0, cfg.vocab_size, (1, p + 1), generator=g).to(device)
    prompt, next_tok = ids[:, :p], ids[:, p:]
    prefill(model, prompt)  # warm-up (kernels, allocator)
    times = []
    out = None
    for _ in range(args.reps):
        out = None
        t, out = clock.time(lambda: prefill(model, prompt))
        times.append(t)
    t_prefill = statistics.median(times)
    row["prefill_ms"] = t_prefill * 1e3
    row["prefill_ms_all"] = [t * 1e3 for t in times]
    assert out is not None
    kv = cache_layers(out.past_key_values)
    assert len(kv) == layers and tuple(kv[0][0].shape) == (1, heads, p, head), kv[0][0].shape
    del out

    # ---- capture into a vLLM-shaped paged cache at scattered block ids
    total = 2 * n + 8
    caches = make_paged_caches(layers, total, heads, head, device)
    perm = torch.randperm(total, generator=torch.Generator().manual_seed(1000 + p)).tolist()
    src, dst, spare = perm[:n], perm[n : 2 * n], perm[2 * n :]
    scatter_kv(caches, kv, src)
    clock.sync()
    orig = gather_kv(caches, src)
    row["capture_exact"] = kv_equal(orig, kv)
    del kv
    logits_orig = next_token_logits(model, orig, next_tok)
    # The check is only meaningful if the same KV gives the same logits twice.
    row["logits_repeatable"] = bool(
        torch.equal(next_token_logits(model, orig, next_tok), logits_orig)
    )
    fused = [next_token_logits(model, orig, next_tok, math=False) for _ in range(3)]
    row["logits_repeatable_fused"] = all(torch.equal(f, fused[0]) for f in fused)
    row["logits_fused_vs_math_max_abs_diff"] = float((fused[0] - logits_orig).abs().max())
    del fused
    row["logits_finite"] = bool(torch.isfinite(logits_orig).all())

    def clear_dst() -> None:
        idx = torch.tensor(dst, device=device)
        for v in caches.values():
            v[idx] = 0
        clock.sync()

    def check_restored(tag: str) -> None:
        row[f"{tag}_bit_exact"] = blocks_equal(caches, src, dst)
        restored = gather_kv(caches, dst)
        row[f"{tag}_kv_exact"] = kv_equal(restored, orig)
        logits = next_token_logits(model, restored, next_tok)
        row[f"{tag}_logits_equal"] = bool(torch.equal(logits, logits_orig))
        row[f"{tag}_logits_max_abs_diff"] = float((logits - logits_orig).abs().max())

    ns = Namespace(
        model="bench/qwen3-8b-random" if not args.quick else "bench/tiny-random",
        revision=None,
        kv_dtype="bfloat16",
        kv_layout="LBNHC",
        block_size=BLOCK,
        page_bytes=page,
    )
    keys = ns.keys([b"p%d-%027x" % (p, i) for i in range(n)])
    warm_keys = ns.keys([b"warm-%d-%d" % (p, i) for i in range(len(spare))])
    pdir = base / f"p{p}"

    def config(admission: str, directory: Path) -> Any:
        directory.mkdir(parents=True, exist_ok=True)
        values = {
            "cpu_cache_gb": 1.25 * (n + 16) * (page + 4096) / 2**30,  # all of P fits
            "ssd_cache_gb": 2.0 * (n + 16) * (page + 8192) / 2**30,
            "ssd_cache_dir": str(directory),
            "admission": admission,
            # Restore is timed on a ready pool: pin it all at start, not in the background.
            "host_pool_init": "sync",
        }
        try:
            return load_config(values, env={})
        except ConfigError:  # a package without host_pool_init (always sync)
            del values["host_pool_init"]
            return load_config(values, env={})

    try:
        # ---- host tier (write-back: the store is a GPU->host copy only)
        engine = CacheEngine.from_kv_caches(config("write_back", pdir / "wb"), ns, caches)
        try:
            row["pinned"] = bool(getattr(engine.pool, "pinned", False))
            backend = getattr(engine.executor.transfer, "backend", {})
            row["transfer_backend"] = {d: getattr(b, "name", str(b)) for d, b in backend.items()}
            # Warm-up on spare blocks: Triton compiles its gather/scatter kernels on first use.
            assert engine.store(warm_keys, spare).ok and engine.load(warm_keys, spare).ok
            t, outcome = clock.time(lambda: engine.store(keys, src))
            assert outcome.ok, outcome.failed_indices()[:5]
            row["store_host_ms"] = t * 1e3
            times = []
            for _ in range(args.restore_reps):
                clear_dst()
                t, outcome = clock.time(lambda: engine.load(keys, dst))
                assert outcome.ok, outcome.failed_indices()[:5]
                assert set(outcome.source_tiers) == {"host"}, set(outcome.source_tiers)
                times.append(t)
            row["restore_host_ms"] = statistics.median(times) * 1e3
            row["restore_host_ms_all"] = [t * 1e3 for t in times]
            check_restored("host")
            # Diagnostic: the transfer engine alone, same block count (no coordinator work).
            xfer = engine.executor.transfer
            assert xfer is not None
            slots = list(range(n))
            tt = []
            for _ in range(args.restore_reps):
                t, _h = clock.time(lambda: xfer.submit_h2d(slots, dst).wait())
                tt.append(t)
            row["transfer_only_ms"] = statistics.median(tt) * 1e3
        finally:
            engine.close()

        # ---- SSD tier: write-through store, restart (empty host tier), load from SSD
        cfg_wt = config("write_through", pdir / "wt")
        engine = CacheEngine.from_kv_caches(cfg_wt, ns, caches)
        try:
            t, outcome = clock.time(lambda: engine.store(keys, src))
            assert outcome.ok, outcome.failed_indices()[:5]
            engine.flush()
            row["store_ssd_ms"] = t * 1e3
            ssd = engine.executor.tiers.get(Tier.SSD)
            row["ssd_io_engine"] = ssd.io_engine if isinstance(ssd, SsdTier) else "none"
        finally:
            engine.close()
        times = []
        for _ in range(args.ssd_reps):
            engine = CacheEngine.from_kv_caches(cfg_wt, ns, caches)
            try:
                assert engine.lookup(keys) == n, "SSD tier lost blocks over the restart"
                clear_dst()
                t, outcome = clock.time(functools.partial(engine.load, keys, dst))
                assert outcome.ok, outcome.failed_indices()[:5]
                assert set(outcome.source_tiers) == {"ssd"}, set(outcome.source_tiers)
                times.append(t)
            finally:
                engine.close()
        row["restore_ssd_ms"] = statistics.median(times) * 1e3
        row["restore_ssd_ms_all"] = [t * 1e3 for t in times]
        check_restored("ssd")
        shutil.rmtree(pdir, ignore_errors=True)

        # ---- ceilings, same run, same byte count
        row["memcpy_h2d_ms"] = memcpy_h2d(nbytes, cuda, args.restore_reps) * 1e3
        t_raw, direct = raw_odirect_read(base, nbytes)
        row["raw_read_ms"] = t_raw * 1e3
        row["raw_read_o_direct"] = direct
    finally:
        shutil.rmtree(pdir, ignore_errors=True)
        caches.clear()  # free the GPU memory before the next prompt
        orig.clear()
        if cuda:
            torch.cuda.empty_cache()

    gb = nbytes / 1e9
    r = row
    r["restore_host_gbps"] = gb / (r["restore_host_ms"] / 1e3)
    r["restore_ssd_gbps"] = gb / (r["restore_ssd_ms"] / 1e3)
    r["transfer_only_gbps"] = gb / (r["transfer_only_ms"] / 1e3)
    r["memcpy_h2d_gbps"] = gb / (r["memcpy_h2d_ms"] / 1e3)
    r["raw_read_gbps"] = gb / (r["raw_read_ms"] / 1e3)
    r["host_vs_memcpy"] = r["restore_host_gbps"] / r["memcpy_h2d_gbps"]
    r["transfer_only_vs_memcpy"] = r["transfer_only_gbps"] / r["memcpy_h2d_gbps"]
    r["ssd_vs_raw"] = r["restore_ssd_gbps"] / r["raw_read_gbps"]
    # Where a host restore's time goes beyond the copy itself: the coordinator's per-job work.
    r["coordinator_overhead_ms"] = r["restore_host_ms"] - r["transfer_only_ms"]
    r["coordinator_overhead_us_per_block"] = r["coordinator_overhead_ms"] * 1e3 / n
    r["speedup_host"] = r["prefill_ms"] / r["restore_host_ms"]
    r["speedup_ssd"] = r["prefill_ms"] / r["restore_ssd_ms"]
    r["breakeven_disk_gbps"] = gb / t_prefill
    r["ok"] = all(
        r[k]
        for k in (
            "capture_exact",
            "logits_repeatable",
            "host_bit_exact",
            "host_kv_exact",
            "host_logits_equal",
            "ssd_bit_exact",
            "ssd_kv_exact",
            "ssd_logits_equal",
        )
    )
    print(
        f"P={p:>6}: prefill {r['prefill_ms']:8.1f} ms | host {r['restore_host_ms']:7.1f} ms "
        f"({r['restore_host_gbps']:5.1f} GB/s, {r['host_vs_memcpy']:.2f} of memcpy "
        f"{r['memcpy_h2d_gbps']:.1f}; {r['speedup_host']:5.1f}x) | "
        f"ssd {r['restore_ssd_ms']:8.1f} ms ({r['restore_ssd_gbps']:.2f} GB/s, "
        f"{r['ssd_vs_raw']:.2f} of raw {r['raw_read_gbps']:.2f}; "
        f"{r['speedup_ssd']:.2f}x) | break-even disk {r['breakeven_disk_gbps']:.2f} GB/s | "
        f"exact={r['ok']}",
        file=log,
        flush=True,
    )
    return row


# -------------------------------------------------------------------------------------- reporting
def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| P tokens | KV GB | prefill ms | host restore ms | host GB/s (memcpy) | host/memcpy | "
        "host speedup | SSD restore ms | SSD GB/s (raw O_DIRECT) | SSD/raw | SSD speedup | "
        "break-even disk GB/s | transfer-only GB/s | bit-exact + logits equal |\n"
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n"
    )
    lines = [
        f"| {r['tokens']} | {r['bytes'] / 1e9:.2f} | {r['prefill_ms']:.1f} | "
        f"{r['restore_host_ms']:.1f} | {r['restore_host_gbps']:.1f} ({r['memcpy_h2d_gbps']:.1f}) | "
        f"{r['host_vs_memcpy']:.3f} | {r['speedup_host']:.1f}x | {r['restore_ssd_ms']:.0f} | "
        f"{r['restore_ssd_gbps']:.2f} ({r['raw_read_gbps']:.2f}) | {r['ssd_vs_raw']:.2f} | "
        f"{r['speedup_ssd']:.2f}x | {r['breakeven_disk_gbps']:.2f} | "
        f"{r['transfer_only_gbps']:.1f} ({r['transfer_only_vs_memcpy']:.3f}) | "
        f"{'yes' if r['ok'] else 'NO'} |"
        for r in rows
    ]
    return head + "\n".join(lines)


def tok_label(t: int) -> str:
    return f"{t / 1024:g}K" if t >= 1024 else str(t)


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    toks = [r["tokens"] for r in rows]
    xs = range(len(rows))
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    w = 0.27
    for i, (key, label) in enumerate(
        (
            ("prefill_ms", "recompute (prefill)"),
            ("restore_host_ms", "restore from host"),
            ("restore_ssd_ms", "restore from SSD"),
        )
    ):
        vals = [r[key] for r in rows]
        bars = a1.bar([x + (i - 1) * w for x in xs], vals, w, label=label)
        a1.bar_label(bars, fmt="%.3g", fontsize=7)
    a1.set_yscale("log")
    a1.set_xticks(list(xs), [tok_label(t) for t in toks])
    a1.set_xlabel("prompt tokens")
    a1.set_ylabel("ms (log)")
    a1.set_title("time to have the KV on the GPU")
    a1.legend(fontsize=8)
    for key, label, style in (
        ("restore_host_gbps", "host restore", "o-"),
        ("memcpy_h2d_gbps", "pinned memcpy H2D", "k--"),
        ("restore_ssd_gbps", "SSD restore", "s-"),
        ("raw_read_gbps", "raw O_DIRECT read", "k:"),
        ("breakeven_disk_gbps", "break-even disk (bytes / prefill)", "r-."),
    ):
        a2.plot(toks, [r[key] for r in rows], style, label=label)
    a2.set_xscale("log", base=2)
    a2.set_yscale("log")
    a2.set_xticks(toks, [tok_label(t) for t in toks])
    a2.set_xlabel("prompt tokens")
    a2.set_ylabel("GB/s (log)")
    a2.set_title("achieved bandwidth vs ceilings")
    a2.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--tokens", default=None, help="comma-separated prompt lengths (multiples of 16)"
    )
    p.add_argument("--reps", type=int, default=3, help="timed prefill runs (median)")
    p.add_argument("--restore-reps", type=int, default=5, help="timed host restores (median)")
    p.add_argument("--ssd-reps", type=int, default=1, help="timed SSD restores (a restart each)")
    p.add_argument(
        "--ssd-dir", type=Path, default=None, help="where the SSD tier lives (local disk)"
    )
    p.add_argument("--quick", action="store_true", help="tiny model, short prompts (CPU smoke run)")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.add_argument("--plot", type=Path, default=None, help="write a PNG chart (needs matplotlib)")
    args = p.parse_args()
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise SystemExit("--plot needs matplotlib (pip install matplotlib)") from None
    if args.tokens:
        tokens = [int(t) for t in args.tokens.split(",") if t.strip()]
    else:
        tokens = [64, 256] if args.quick else [4096, 16384, 32768]
    for t in tokens:
        if t <= 0 or t % BLOCK:
            raise SystemExit(f"--tokens: {t} is not a positive multiple of {BLOCK}")
    cuda = torch.cuda.is_available()
    log = sys.stderr if args.json else sys.stdout
    device_name = torch.cuda.get_device_name() if cuda else "cpu"

    import transformers

    t0 = time.perf_counter()
    model = build_model(args.quick, "cuda" if cuda else "cpu")
    cfg = model.config
    print(
        f"{'tiny' if args.quick else 'Qwen3-8B-shaped'} model, random weights, bf16, on "
        f"{device_name}: {cfg.num_hidden_layers} layers, hidden {cfg.hidden_size}, "
        f"{cfg.num_attention_heads}/{cfg.num_key_value_heads} heads x {cfg.head_dim}, "
        f"built in {time.perf_counter() - t0:.1f} s (attn {cfg._attn_implementation})",
        file=log,
        flush=True,
    )
    base = Path(tempfile.mkdtemp(prefix="flexkv-restore-", dir=args.ssd_dir or Path.cwd()))
    try:
        rows = [run_prompt(model, t, args, base, cuda, log) for t in tokens]
    finally:
        shutil.rmtree(base, ignore_errors=True)

    goal_row = next((r for r in rows if r["tokens"] == GOAL_TOKENS), None)
    goal: dict[str, Any] = {"tokens": GOAL_TOKENS, "ratio": GOAL_RATIO, "speedup": GOAL_SPEEDUP}
    if goal_row is not None:
        goal["host_vs_memcpy"] = goal_row["host_vs_memcpy"]
        goal["speedup_host"] = goal_row["speedup_host"]
        goal["ratio_met"] = goal_row["host_vs_memcpy"] >= GOAL_RATIO
        goal["speedup_met"] = goal_row["speedup_host"] >= GOAL_SPEEDUP
        goal["met"] = goal["ratio_met"] and goal["speedup_met"]
    result = {
        "bench": "restore_vs_recompute",
        "device": device_name,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "model": {
            k: getattr(cfg, k)
            for k in (
                "num_hidden_layers",
                "hidden_size",
                "num_attention_heads",
                "num_key_value_heads",
                "head_dim",
                "intermediate_size",
                "vocab_size",
            )
        },
        "quick": args.quick,
        "reps": args.reps,
        "rows": rows,
        "goal": goal,
    }
    print(table(rows), file=log)
    if goal_row is not None:
        print(
            f"goal (P={GOAL_TOKENS}: host restore >= {GOAL_RATIO} of pinned memcpy, >= "
            f"{GOAL_SPEEDUP:.0f}x recompute): ratio {goal['host_vs_memcpy']:.3f}, speedup "
            f"{goal['speedup_host']:.1f}x -> {'MET' if goal['met'] else 'NOT met'}",
            file=log,
        )
    if args.plot is not None:
        plot(rows, args.plot, f"restore vs recompute, {result['device']}, Qwen3-8B-shaped KV")
        print(f"plot: {args.plot}", file=log)
    if args.json:
        print(json.dumps(result))
    if not all(r["ok"] for r in rows):
        raise SystemExit("restore_vs_recompute: restored KV or logits differ from the original")


if __name__ == "__main__":
    main()
