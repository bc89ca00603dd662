"""Start serving at once: a large host tier prepared in the background vs built up front.

What a vLLM worker sees (H200 run): `register_kv_caches` builds this rank's host pool and transfer
engine (`build_host_side`, what the connector calls), then vLLM captures its CUDA graphs, then
serves. Measured, for a `--gib` host tier:

- return time of `build_host_side` with host_pool_init=background (ours) vs sync (the baseline:
  touch and pin everything before returning), ratio printed;
- 40 CUDA graph captures right after it, while the pool is touched in the background: how many
  were invalidated (must be 0: registration waits for the first step);
- time to the first usable slot (first store possible) and to the fully pinned pool, after the
  first step allowed registration;
- step latency (a captured graph replayed, plus an 8-block GPU->host store into ready slots)
  while pinning runs, vs after it finished: median and p99, ratio printed;
- a control: cudaHostRegister allowed during capture (what the gate prevents) invalidates
  captures on this machine.

CPU machines run the same path on CPU tensors (no pinning, no graphs): figures of the host only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from transfer_bench import make_caches

from flexkv_py.config import load_config
from flexkv_py.coordinator import build_host_side
from flexkv_py.index.namespace import Namespace
from flexkv_py.tiers.host_pool import HostPool

LAYERS, HEADS, HEAD, TOKENS = 36, 8, 128, 16  # Qwen3-8B-shaped pages (1.1 MiB per block)


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def _graph_workload(cuda: bool) -> tuple[Any, Any]:
    """A model-step stand-in: a few bf16 matmuls, captured once as a CUDA graph."""
    dev = "cuda" if cuda else "cpu"
    n = 4096 if cuda else 256  # ~1-2 ms of H200 work per step; small on CPU
    x = torch.randn(n // 2, n, device=dev, dtype=torch.bfloat16 if cuda else torch.float32)
    w = torch.randn(n, n, device=dev, dtype=x.dtype)

    def step() -> Any:
        y = x
        for _ in range(8):
            y = torch.tanh(y @ w)
        return y

    if not cuda:
        return step, None
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm-up outside capture, as vLLM does
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return step, graph


def _capture_many(n: int, cuda: bool) -> int:
    """Capture `n` graphs the way vLLM's start-up does; return how many failed."""
    if not cuda:
        return 0
    failed = 0
    for _ in range(n):
        try:
            _graph_workload(cuda)
        except RuntimeError:
            failed += 1
            torch.cuda.synchronize()
    return failed


def _capture_during_register(gib: float, captures: int) -> int:
    """Register a touched region in 64 MiB chunks on a thread, over and over, while capturing."""
    import threading

    from flexkv_py.tiers.host_pool import _host_register_fn, _host_unregister_fn

    region = HostPool.from_cache_gb(gib, 1 << 20, pin=False)  # touched, not pinned
    register, unregister = _host_register_fn(), _host_unregister_fn()
    stop = threading.Event()
    chunk = 64 << 20

    def churn() -> None:
        while not stop.is_set():
            for off in range(0, region.nbytes, chunk):
                if register(region.address + off, chunk) == 0:
                    unregister(region.address + off)

    t = threading.Thread(target=churn, daemon=True)
    t.start()
    try:
        return _capture_many(captures, True)
    finally:
        stop.set()
        t.join()
        region.close()


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--gib", type=float, default=64.0, help="host tier size (one rank)")
    p.add_argument("--captures", type=int, default=40)
    p.add_argument("--quick", action="store_true", help="2 GiB, 4 captures")
    p.add_argument("--skip-sync-baseline", action="store_true")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.quick:
        args.gib, args.captures = 2.0, 4
    cuda = torch.cuda.is_available()
    log = sys.stderr if args.json else sys.stdout
    device = "cuda" if cuda else "cpu"
    caches = make_caches("LBNHC", LAYERS if cuda else 2, 64, HEADS, HEAD, TOKENS, device)
    page = sum(c[0].numel() * c.element_size() for c in caches.values())
    ns = Namespace(
        model="bench/pool-startup",
        revision=None,
        kv_dtype="bfloat16",
        kv_layout="LBNHC",
        block_size=TOKENS,
        page_bytes=page,
    )
    res: dict[str, Any] = {"gib": args.gib, "cuda": cuda, "page_bytes": page}

    # --- baseline: build everything before returning (host_pool_init=sync)
    if not args.skip_sync_baseline:
        t0 = time.perf_counter()
        pool, engine = build_host_side(
            load_config({"cpu_cache_gb": args.gib, "host_pool_init": "sync"}, env={}), ns, caches
        )
        res["sync_return_s"] = time.perf_counter() - t0
        engine.close()
        pool.close()
        print(f"sync: build_host_side returned in {res['sync_return_s']:.2f} s", file=log)

    # --- ours: background
    step_fn, graph = _graph_workload(cuda)
    t0 = time.perf_counter()
    pool, engine = build_host_side(
        load_config({"cpu_cache_gb": args.gib, "host_pool_init": "background"}, env={}),
        ns,
        caches,
        serving=True,
    )
    res["background_return_s"] = time.perf_counter() - t0
    bg = pool.background
    assert bg is not None, "host_pool_init=background built a sync pool"
    res["captures_failed_during_touch"] = _capture_many(args.captures, cuda)
    res["ready_slots_before_first_step"] = pool.ready_slots
    t_step0 = time.perf_counter()
    pool.allow_registration()  # what the connector does at the first engine step
    first_store_s: float | None = None
    pinning, after = [], []
    ids = list(range(8))
    while True:
        ready = pool.ready_slots
        t = time.perf_counter()
        if graph is not None:
            graph.replay()
        else:
            step_fn()
        if ready >= len(ids):
            engine.submit_d2h(ids, list(range(ready - len(ids), ready))).wait()
            if first_store_s is None:
                first_store_s = time.perf_counter() - t_step0
        _sync(cuda)
        dt = time.perf_counter() - t
        done = bg.times.all_ready_s is not None
        (after if done else pinning).append(dt)
        if done and len(after) >= max(50, len(pinning) // 4):
            break
        if time.perf_counter() - t_step0 > 600:
            raise SystemExit("pool not ready after 600 s")
    res["first_store_after_first_step_s"] = first_store_s
    res["all_ready_after_creation_s"] = bg.times.all_ready_s
    res["steps_while_pinning"] = len(pinning)
    if pinning:
        res["step_ms_while_pinning"] = {
            "median": 1e3 * statistics.median(pinning),
            "p99": 1e3 * _percentile(pinning, 0.99),
        }
    res["step_ms_after"] = {
        "median": 1e3 * statistics.median(after),
        "p99": 1e3 * _percentile(after, 0.99),
    }
    engine.close()
    pool.close()

    # --- control: cudaHostRegister running during the captures (the hazard the gate avoids)
    if cuda:
        res["captures_failed_with_register_during_capture"] = _capture_during_register(
            min(8.0, args.gib), args.captures
        )

    if "sync_return_s" in res:
        res["return_ratio_sync_over_background"] = res["sync_return_s"] / res["background_return_s"]
    for k, v in res.items():
        print(f"{k:45s} {v}", file=log)
    if args.json:
        print(json.dumps(res))


if __name__ == "__main__":
    main()
