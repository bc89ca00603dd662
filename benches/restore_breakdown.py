"""Where a host restore's time goes beyond the pinned memcpy (issue 24 item 3): one process, no
model, the Qwen3-8B page shape (36 layers x 8 heads x 16 tokens x 2x128 bf16, LBNHC).

For each P: the pinned memcpy ceiling (one contiguous copy of fresh pinned memory, and of the host
pool's own slots), the transfer engine alone (its default path; waits polled instead of blocking;
the staged H2D's tail size; 16-page chunks), CacheEngine.load as is and with variants (polled
waits, a first part of 32 blocks, one part), a CPU timeline of one load (perf_counter at each
step, `timeline_us` in breakdown.json) and, with --traces, torch.profiler chrome traces of one 4K
load and one transfer (the profiler stalls other threads: read GPU gaps there with care).

    python3 benches/restore_breakdown.py [--tokens 4096,32768] [--reps 9] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cuda_clock import Clock
from restore_model import BLOCK, bench_keys, make_paged_caches

import flexkv_py.coordinator.engine as engine_mod
from flexkv_py.config import load_config
from flexkv_py.coordinator import CacheEngine
from flexkv_py.transfer import TransferEngine

LAYERS, HEADS, HEAD = 36, 8, 128
CUDA = torch.cuda.is_available()
DEV = "cuda" if CUDA else "cpu"
if not CUDA:  # smoke run
    LAYERS, HEADS, HEAD = 2, 2, 8


def blocks_equal(caches: dict[str, torch.Tensor], a: list[int], b: list[int]) -> bool:
    """Bit-exact (random bits hold NaNs: compared as int16)."""
    dev = next(iter(caches.values())).device
    ia, ib = torch.tensor(a, device=dev), torch.tensor(b, device=dev)
    return all(
        torch.equal(v.view(torch.int16)[ia], v.view(torch.int16)[ib]) for v in caches.values()
    )


def run(p: int, args: argparse.Namespace, out: Path, log: Any) -> dict[str, Any]:
    clock = Clock(CUDA)
    n = p // BLOCK
    page = LAYERS * HEADS * BLOCK * 2 * HEAD * 2
    nbytes = n * page
    row: dict[str, Any] = {"tokens": p, "blocks": n, "bytes": nbytes}
    total = 2 * n + 8
    caches = make_paged_caches(LAYERS, total, HEADS, HEAD, DEV)
    perm = torch.randperm(total, generator=torch.Generator().manual_seed(1000 + p)).tolist()
    src, dst, spare = perm[:n], perm[n : 2 * n], perm[2 * n :]
    ns, keys, warm_keys = bench_keys(p, n, len(spare), page, False)
    d = Path(tempfile.mkdtemp())
    cfg = load_config(
        {
            "cpu_cache_gb": 1.25 * (n + 16) * (page + 4096) / 2**30,
            "ssd_cache_gb": 0,
            "ssd_cache_dir": str(d),
            "admission": "write_back",
            "host_pool_init": "sync",
            "transfer_engine": "auto",
        },
        env={},
    )
    eng = CacheEngine.from_kv_caches(cfg, ns, caches)
    med = args.reps
    try:
        assert eng.store(warm_keys, spare).ok and eng.load(warm_keys, spare).ok
        assert eng.store(keys, src).ok
        pool = eng.pool
        row["memcpy_ms"] = 0.0
        # ---- ceilings
        if CUDA:
            dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            host.fill_(1)
            cp = lambda: dev.copy_(host, non_blocking=True)  # noqa: E731
            cp()
            row["memcpy_ms"] = clock.median(cp, med) * 1e3
            del dev, host
            slot_row = pool.tensor.shape[1]
            # the pool's own slots, one contiguous copy (same source memory as the restore)
            pdev = torch.empty((n, slot_row), dtype=torch.uint8, device="cuda")
            cp2 = lambda: pdev.copy_(pool.tensor[:n], non_blocking=True)  # noqa: E731
            cp2()
            row["memcpy_pool_contig_ms"] = clock.median(cp2, med) * 1e3
            del pdev

        def clear() -> None:
            idx = torch.tensor(dst, device=DEV)
            for v in caches.values():
                v[idx] = 0
            clock.sync()

        def timed_load(tag: str) -> None:
            ts = []
            for _ in range(med):
                clear()
                t, o = clock.time(lambda: eng.load(keys, dst))
                assert o.ok and set(o.source_tiers) == {"host"}
                ts.append(t)
            row[f"load_{tag}_ms"] = statistics.median(ts) * 1e3
            row[f"load_{tag}_ms_all"] = [round(t * 1e3, 3) for t in ts]
            row[f"load_{tag}_exact"] = blocks_equal(caches, src, dst)

        timed_load("asis")
        # ---- transfer engine alone
        xfer = eng.executor.transfer
        slots = eng.manager.index.acquire_host(keys, count_hits=False)
        assert slots is not None
        eng.manager.index.unpin(keys)

        def xfer_time(x: Any, tag: str) -> None:
            x.submit_h2d(slots, dst).wait()
            clear()
            row[f"xfer_{tag}_ms"] = clock.median(lambda: x.submit_h2d(slots, dst).wait(), med) * 1e3

        xfer_time(xfer, "default_" + xfer.backend["h2d"].name)
        from flexkv_py.transfer import engine as xengine

        real_wait = xengine.TransferHandle.wait

        def spin_wait(self: Any, timeout: float | None = None) -> None:
            if self._event is not None and timeout is None and not self._finished:
                while not self._event.query():
                    time.sleep(0)
            real_wait(self, timeout)

        def spinning(on: bool) -> None:
            xengine.TransferHandle.wait = spin_wait if on else real_wait  # type: ignore[method-assign]

        spinning(True)
        xfer_time(xfer, "default_spin")
        spinning(False)
        h2d_path = xfer.backend["h2d"]
        if CUDA and hasattr(h2d_path, "_tail"):
            real_tail = h2d_path._tail
            for t in (32, 4):
                h2d_path._tail = t
                xfer_time(xfer, f"tail{t}")
            h2d_path._tail = real_tail
        variants: list[tuple[str, dict[str, Any]]] = [
            ("staged16", {"backend": "staged", "staged_chunk_pages": 16}),
        ]
        for tag, kw in variants if CUDA else []:
            try:
                x = TransferEngine(caches, pool, **kw)
                xfer_time(x, tag)
                x.close()
            except Exception as e:
                row[f"xfer_{tag}_error"] = repr(e)
        # ---- CacheEngine.load variants
        import flexkv_py.coordinator.pipeline as pipeline_mod

        real_first = pipeline_mod.PIPELINE_FIRST_BLOCKS
        spinning(True)
        timed_load("spin")
        spinning(False)
        pipeline_mod.PIPELINE_FIRST_BLOCKS = 32
        timed_load("first32")
        spinning(True)
        timed_load("first32_spin")
        spinning(False)
        pipeline_mod.PIPELINE_FIRST_BLOCKS = real_first
        real_parts = engine_mod.pipeline_parts
        engine_mod.pipeline_parts = lambda k: [(0, k)] if k else []
        timed_load("onepart")

        def sized(*sizes: int) -> Any:
            """Parts of these sizes when they add up to the load, else the real split."""

            def parts(k: int) -> list[tuple[int, int]]:
                if sum(sizes) != k:
                    return real_parts(k)
                out, at = [], 0
                for size in sizes:
                    out.append((at, at + size))
                    at += size
                return out

            return parts

        for tag, sizes in (
            ("parts_32_last32", (32, 64, 64, 64, 32)),
            ("parts_32_last16", (32, 64, 64, 64, 16, 16)),
            ("parts_64_last16", (64, 64, 64, 32, 16, 16)),
        ):
            if sum(sizes) == n:
                engine_mod.pipeline_parts = sized(*sizes)
                timed_load(tag)
        if CUDA and hasattr(h2d_path, "_tail"):  # no taper anywhere: what the middle parts cost
            real_tail = h2d_path._tail
            h2d_path._tail = h2d_path._chunk
            timed_load("notaper")
            if sum((32, 64, 64, 64, 32)) == n:
                engine_mod.pipeline_parts = sized(32, 64, 64, 64, 32)
                timed_load("notaper_parts_32_last32")
            h2d_path._tail = real_tail
            # Taper the load's last part only (its copies are issued inside submit, here=True).
            real_submit = eng.executor.submit

            def submit_last_tapers(job: Any, **kw: Any) -> Any:
                ks = getattr(job, "keys", ())
                last = bool(ks) and ks[-1] == keys[-1]
                h2d_path._tail = real_tail if last else h2d_path._chunk
                try:
                    return real_submit(job, **kw)
                finally:
                    h2d_path._tail = real_tail

            eng.executor.submit = submit_last_tapers  # type: ignore[method-assign]
            engine_mod.pipeline_parts = real_parts
            timed_load("lasttaper")
            for tag, sizes in (
                ("lasttaper_parts_32_last32", (32, 64, 64, 64, 32)),
                ("lasttaper_parts_32_last16", (32, 64, 64, 64, 16, 16)),
                ("lasttaper_parts_16_32_last16", (16, 32, 64, 64, 48, 16, 16)),
            ):
                if sum(sizes) == n:
                    engine_mod.pipeline_parts = sized(*sizes)
                    timed_load(tag)
            eng.executor.submit = real_submit  # type: ignore[method-assign]
        engine_mod.pipeline_parts = real_parts
        from flexkv_py.transfer import staged_path

        staged_path.COALESCE = False
        timed_load("nocoalesce")
        xfer_time(xfer, "nocoalesce")
        staged_path.COALESCE = True
        timed_load("asis2")
        # ---- host time to issue one 32-page chunk's pieces (perf_counter, no sync)
        try:
            if CUDA and hasattr(h2d_path, "_copier"):
                st = h2d_path._stages[0]
                k = min(32, n)
                rowb = np.uint64(st.shape[1])
                stage = np.uint64(st.data_ptr()) + np.arange(k, dtype=np.uint64) * rowb
                base = np.uint64(pool.tensor.data_ptr())
                contig = base + np.asarray(slots[:k], dtype=np.uint64) * rowb
                scattered = base + np.asarray(slots[: 2 * k : 2], dtype=np.uint64) * rowb
                sizes = np.full(k, st.shape[1], dtype=np.uint64)
                stream = h2d_path._dma_stream.cuda_stream  # the batch API refuses the NULL stream
                issue: dict[str, float] = {}
                for tag, srcs, on in (
                    ("copy_contig_coalesced", contig, True),
                    ("copy_contig_plain", contig, False),
                    ("copy_strided", scattered, True),
                ):
                    staged_path.COALESCE = on
                    ts = []
                    for _ in range(med):
                        clock.sync()
                        t = time.perf_counter()
                        h2d_path._copy(stage, srcs, sizes, stream)
                        ts.append(time.perf_counter() - t)
                    issue[tag] = statistics.median(ts) * 1e6
                staged_path.COALESCE = True
                pairs = torch.zeros(2 * k, dtype=torch.int64, device="cuda")
                pairs[:k] = torch.tensor(dst[:k], device="cuda")
                pairs[k:] = torch.arange(k, device="cuda")
                kern = h2d_path._kernels[0]
                ts = []
                for _ in range(med):
                    clock.sync()
                    t = time.perf_counter()
                    kern.enqueue_pairs("h2d", pairs, k)
                    ts.append(time.perf_counter() - t)
                issue["scatter_launch"] = statistics.median(ts) * 1e6
                ts = []
                for _ in range(med):
                    clock.sync()
                    t = time.perf_counter()
                    eng._pump()
                    ts.append(time.perf_counter() - t)
                issue["idle_pump"] = statistics.median(ts) * 1e6
                row["issue_us"] = issue
        except Exception as e:  # a probe that breaks must not lose the row
            row["issue_error"] = repr(e)

        # ---- CPU timeline of one load (as is)
        marks: list[tuple[str, float, str]] = []
        t0 = [0.0]

        def mark(name: str) -> None:
            marks.append(
                (name, (time.perf_counter() - t0[0]) * 1e6, threading.current_thread().name)
            )

        patches = []

        def wrap(obj: Any, attr: str, name: str) -> None:
            real = getattr(obj, attr)

            def w(*a: Any, **k: Any) -> Any:
                mark(name + ">")
                try:
                    return real(*a, **k)
                finally:
                    mark(name + "<")

            setattr(obj, attr, w)
            patches.append((obj, attr, real))

        from flexkv_py.coordinator import copy_handlers

        wrap(eng.manager, "prepare_load_part", "prepare")
        wrap(eng.executor, "submit", "submit")
        wrap(eng.executor._bodies, "load", "body")
        wrap(eng.executor._transfer, "submit", "xsubmit")
        wrap(copy_handlers.CopyFlow, "finish", "copies_finish")
        wrap(eng.manager, "complete", "complete")
        wrap(eng, "_pump", "pump")
        timeline = []
        for _ in range(3):
            marks.clear()
            clear()
            clock.sync()
            t0[0] = time.perf_counter()
            eng.load(keys, dst)
            mark("load_returned")
            clock.sync()
            mark("synced")
            timeline.append(list(marks))
        row["timeline_us"] = timeline
        for obj, attr, real in reversed(patches):
            setattr(obj, attr, real)
        # ---- profiler traces
        from torch.profiler import ProfilerActivity, profile

        for tag, fn in (
            ()
            if not CUDA or p > 4096 or not args.traces
            else (
                ("load", lambda: eng.load(keys, dst)),
                ("xfer", lambda: xfer.submit_h2d(slots, dst).wait()),
            )
        ):
            clear()
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                fn()
                torch.cuda.synchronize()
            prof.export_chrome_trace(str(out / f"trace_{tag}_{p}.json"))
    finally:
        eng.close()
        caches.clear()
        torch.cuda.empty_cache()
    print(json.dumps({k: v for k, v in row.items() if k != "timeline_us"}), file=log, flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="4096,32768")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--out", type=Path, default=Path("."))
    ap.add_argument("--traces", action="store_true", help="torch.profiler traces of one 4K load")
    args = ap.parse_args()
    rows = [run(int(t), args, args.out, sys.stderr) for t in args.tokens.split(",")]
    (args.out / "breakdown.json").write_text(json.dumps(rows))


if __name__ == "__main__":
    main()
