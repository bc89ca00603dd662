"""Where the whole stack's SSD load loses against raw O_DIRECT: the coordinator's SSD load path
(tier_bench's `load_ssd` phase) taken apart, with ssd_bench's read pattern on the same store.

Per run (fresh directory): store N blocks write-through through a CacheEngine (CPU tensors unless
CUDA), restart the engine, then time
  engine_load   `engine.load(keys, gpu_ids)` after the restart (what tier_bench reports)
  ssd_batch     the wall time inside the executor's SSD reads of that load (`read_in_sub_batches`:
                the job's blocks read into host slots in sub-batches, several in flight, each
                sub-batch's host->GPU copy issued as it lands; overlapping calls of concurrent
                jobs counted once)
  h2d_copy      the wall time of that load's host->GPU copies (submit to wait; CPU tensors on a
                machine without CUDA); they overlap the SSD reads
  pipelined     the same blocks of the same store read the way ssd_bench reads them: 64 MiB
                batches, 4 in flight beyond the one waited on, into the same host slots
  raw           sequential O_DIRECT 8 MiB reads of as many bytes in the same directory
Prints the medians [min-max] and paired ratios against raw and against `pipelined`.

    python3 benches/coord_ssd_probe.py [--blocks 8192] [--layers 8] [--runs 5] [--dir DIR]
                                       [--host-only]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from collections import deque
from pathlib import Path
from typing import Any

import torch

import flexkv_py

# flexkv_py from the installed (editable) tree, or another one via PYTHONPATH (e.g. an older
# commit's package next to the same _native build, to compare coordinator versions).
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tier_bench import bench_blocks, raw_disk_read
from transfer_bench import make_caches

from flexkv_py.config import load_config
from flexkv_py.coordinator import CacheEngine
from flexkv_py.index.tier_names import Tier
from flexkv_py.tiers.ssd.tier import SsdTier


def busy_seconds(spans: list[tuple[float, float]]) -> float:
    """Wall time during which at least one SSD batch was running (parts may overlap)."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(spans):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def one_run(base: Path, args: argparse.Namespace, cuda: bool) -> dict[str, float]:
    heads, head, tokens, n = 2, 64, 16, args.blocks
    device = "cuda" if cuda else "cpu"
    caches = make_caches("LBNHC", args.layers, 2 * n + 8, heads, head, tokens, device)
    page = args.layers * heads * tokens * 2 * head * 2
    cfg = load_config(
        {
            "cpu_cache_gb": 1.25 * (n + 16) * (page + 4096) / 2**30,
            "ssd_cache_gb": 2.5 * (n + 16) * (page + 8192) / 2**30,
            "ssd_cache_dir": str(base),
            "admission": "write_through",
        },
        env={},
    )
    ns, src_ids, dst_ids, _, keys = bench_blocks("bench/probe", tokens, page, n, 2 * n + 8)
    engine = CacheEngine.from_kv_caches(cfg, ns, caches)
    assert engine.store(keys, src_ids).ok
    engine.close()

    engine = CacheEngine.from_kv_caches(cfg, ns, caches)
    assert engine.lookup(keys) == n
    ex = engine.executor
    bodies = ex._bodies
    spans: list[tuple[float, float]] = []
    if not hasattr(bodies, "read_in_sub_batches"):  # an older coordinator: one batch per job
        old = bodies.tier_batch

        def timed_batch(tier: Tier, put: bool, k: Any, s: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return old(tier, put, k, s)
            finally:
                if not put and k:
                    spans.append((t0, time.perf_counter()))

        bodies.tier_batch = timed_batch  # type: ignore[method-assign]
    inner = getattr(bodies, "read_in_sub_batches", None)

    def timed_reads(tier: Tier, k: Any, s: Any, landed: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return inner(tier, k, s, landed)
        finally:
            if k:
                spans.append((t0, time.perf_counter()))

    if inner is not None:
        bodies.read_in_sub_batches = timed_reads  # type: ignore[method-assign]
    copies: list[tuple[float, float]] = []
    submit_copy = ex._transfer.submit

    def timed_copy(direction: str, *a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        handle = submit_copy(direction, *a, **kw)
        wait = handle.wait

        def timed_wait(*wa: Any, **wkw: Any) -> Any:
            try:
                return wait(*wa, **wkw)
            finally:
                if direction == "h2d":
                    copies.append((t0, time.perf_counter()))

        handle.wait = timed_wait
        return handle

    ex._transfer.submit = timed_copy  # type: ignore[method-assign]
    t0 = time.perf_counter()
    if args.host_only:  # SSD -> host slots only: the stack's SSD path without any copy
        outcome = engine.submit_load(keys, None).result()
    else:
        outcome = engine.load(keys, dst_ids)
    if cuda:
        torch.cuda.synchronize()
    t1 = time.perf_counter()
    t_load = t1 - t0
    window = (t0, t1)
    assert outcome.ok and set(outcome.source_tiers) == {"ssd"}, outcome.source_tiers[:5]

    # The same blocks of the same store, ssd_bench's way, into host slots of the pool.
    ssd = ex.tiers[Tier.SSD]
    assert isinstance(ssd, SsdTier)
    store, pool = ssd.store, ex.pool
    sk = ns.storage_key
    items = [(sk(k), (pool.slot_address(i), page)) for i, k in enumerate(keys)]
    batch = max(1, (64 << 20) // page)
    t0 = time.perf_counter()
    pending: deque = deque()
    for lo in range(0, n, batch):
        pending.append(store.submit_get(items[lo : lo + batch]))
        if len(pending) > 4:
            assert all(r.ok for r in pending.popleft().wait(600))
    while pending:
        assert all(r.ok for r in pending.popleft().wait(600))
    t_pipe = time.perf_counter() - t0
    engine.close()
    t_raw = raw_disk_read(base, n * page)
    gb = n * page / 1e9

    def inside(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
        """Only what ran inside the load (a copy handle may be waited on again later)."""
        lo, hi = window
        return [(max(a, lo), min(b, hi)) for a, b in intervals if a < hi]

    spans, copies = inside(spans), inside(copies)
    return {
        "engine_load": gb / t_load,
        "ssd_batch": gb / busy_seconds(spans),
        "h2d_copy": gb / busy_seconds(copies) if copies else float("nan"),
        "other_s": t_load - busy_seconds(spans + copies),
        "overlap_s": busy_seconds(spans) + busy_seconds(copies) - busy_seconds(spans + copies),
        "pipelined": gb / t_pipe,
        "raw": gb / t_raw,
        "page_bytes": page,
    }


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--blocks", type=int, default=8192)
    p.add_argument("--layers", type=int, default=8, help="8 layers: 64 KiB pages")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--dir", type=Path, default=None)
    p.add_argument("--json", action="store_true")
    p.add_argument(
        "--host-only",
        action="store_true",
        help="load into host slots only (no host->GPU copy: on CPU tensors that copy, a torch "
        "scatter, is slower than the disk and hides the SSD path)",
    )
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    runs = []
    for _ in range(args.runs):
        base = Path(tempfile.mkdtemp(prefix="flexkv-coord-probe-", dir=args.dir or Path.cwd()))
        try:
            runs.append(one_run(base, args, cuda))
        finally:
            shutil.rmtree(base, ignore_errors=True)
    out: dict[str, Any] = {"blocks": args.blocks, "page_bytes": runs[0]["page_bytes"]}
    out["package"] = str(Path(flexkv_py.__file__).parent)
    print(
        f"{args.blocks} blocks of {runs[0]['page_bytes'] // 1024} KiB, {args.runs} runs "
        f"(flexkv_py from {out['package']})"
    )
    other = [r["other_s"] for r in runs]
    out["other_s"] = other
    out["overlap_s"] = [r["overlap_s"] for r in runs]
    for name in ("engine_load", "ssd_batch", "h2d_copy", "pipelined", "raw"):
        rates = [r[name] for r in runs]
        ratios = [r[name] / r["raw"] for r in runs]
        vs_pipe = [r[name] / r["pipelined"] for r in runs]
        out[name] = {"gbps": rates, "ratio": ratios, "vs_pipelined": vs_pipe}
        print(
            f"  {name:<12} {statistics.median(rates):5.2f} GB/s [{min(rates):.2f}-{max(rates):.2f}]"
            f"  /raw {statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}]"
            f"  /pipelined {statistics.median(vs_pipe):.2f} [{min(vs_pipe):.2f}-{max(vs_pipe):.2f}]"
        )
    print(
        f"  rest of engine_load (neither SSD batch nor host->GPU copy): "
        f"{statistics.median(other) * 1e3:.0f} ms [{min(other) * 1e3:.0f}-{max(other) * 1e3:.0f}]"
    )
    ov = [x * 1e3 for x in out["overlap_s"]]
    print(
        f"  SSD reads and host->GPU copies overlapped for "
        f"{statistics.median(ov):.0f} ms [{min(ov):.0f}-{max(ov):.0f}]"
    )
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
