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
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from restore_ceilings import Clock, memcpy_h2d, raw_odirect_read
from restore_model import (
    BLOCK,
    bench_keys,
    blocks_equal,
    build_model,
    cache_layers,
    gather_kv,
    kv_equal,
    make_paged_caches,
    next_token_logits,
    prefill,
    scatter_kv,
)
from restore_report import plot, table

from flexkv_py.config import load_config
from flexkv_py.coordinator import CacheEngine
from flexkv_py.errors import ConfigError
from flexkv_py.index.tier_names import Tier
from flexkv_py.tiers.ssd.tier import SsdTier

GOAL_TOKENS = 32768
GOAL_RATIO = 0.95
GOAL_SPEEDUP = 17.0


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

    ns, keys, warm_keys = bench_keys(p, n, len(spare), page, args.quick)
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
