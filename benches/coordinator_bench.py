"""Coordinator cost per block: the whole stack's store and host load (CacheEngine: manager +
index + executor + transfer engine) against the transfer engine alone copying the same blocks in
one call, on CPU tensors with small pages, so that the difference is the coordinator's own work
(planning, slot acquire/release, index updates, events, job hand-offs).

    python3 benches/coordinator_bench.py [--blocks 2048] [--reps 7] [--json] [--profile]

Prints, per phase, the median µs per block of ours and of the floor (a raw index: one dict of
key -> slot, plus one transfer-engine call), their difference (the coordinator's cost per block)
and the ratio, and what ours adds to the transfer engine copying the same parts back to back
(the coordinator work no copy hides: large pages, `--heads 8 --head-dim 64`, show it).
`--profile` adds a cProfile summary of one store and one load (to stderr). `--json` ends with
one JSON line.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from tier_bench import bench_blocks
from transfer_bench import make_caches

from flexkv_py.config import load_config
from flexkv_py.coordinator import CacheEngine, JobResult
from flexkv_py.coordinator.engine import pipeline_parts

LAYERS, TOKENS = 2, 16


Clock = tuple[float, float]  # (wall seconds, CPU seconds of the whole process)


def clock() -> Clock:
    return time.perf_counter(), time.process_time()


def since(t0: Clock) -> Clock:
    t1 = clock()
    return t1[0] - t0[0], t1[1] - t0[1]


def floor_clocks(
    engine: CacheEngine, keys: list[bytes], src: list[int], slots: list[int], dst: list[int]
) -> dict[str, Clock]:
    """The floors, each waited: `d2h` / `h2d`: one transfer-engine call over the blocks;
    `store_raw` / `load_raw`: a raw index (one dict of key -> slot, built / read in one pass)
    plus that call; `d2h_parts` / `h2d_parts`: the transfer engine copying the blocks in the
    coordinator's parts (engine.pipeline_parts) back to back, waited at the end: what the
    coordinator adds to it is its work that no copy hides."""
    transfer = engine.executor._transfer.transfer  # the raw TransferEngine
    assert transfer is not None
    out: dict[str, Clock] = {}
    t0 = clock()
    transfer.submit_d2h(src, slots).wait()
    out["d2h"] = since(t0)
    t0 = clock()
    transfer.submit_h2d(slots, dst).wait()
    out["h2d"] = since(t0)
    t0 = clock()
    index = dict(zip(keys, slots, strict=True))
    transfer.submit_d2h(src, list(index.values())).wait()
    out["store_raw"] = since(t0)
    t0 = clock()
    transfer.submit_h2d([index[k] for k in keys], dst).wait()
    out["load_raw"] = since(t0)
    parts = pipeline_parts(len(keys))
    for name, submit, a, b in (
        ("d2h_parts", transfer.submit_d2h, src, slots),
        ("h2d_parts", transfer.submit_h2d, slots, dst),
    ):
        t0 = clock()
        handles = [submit(a[lo:hi], b[lo:hi]) for lo, hi in parts]
        for h in handles:
            h.wait()
        out[name] = since(t0)
    return out


def exposed_seconds(engine: CacheEngine, keys: list[bytes], src: list[int]) -> tuple[float, float]:
    """The coordinator work of a store and of a host load that no copy can hide, timed through
    the manager alone (results applied as the workers would, no bytes move): the first part's
    preparation (before any copy) plus the last part's completion (after the last copy); the
    parts between prepare and complete while a copy runs (engine.py)."""
    mgr, n = engine.manager, len(keys)
    parts = pipeline_parts(n)
    last_start = parts[-1][0]
    parents = [None, *keys[:-1]]
    out = []
    for kind in ("store", "load"):
        jobs, t_first, t_last = [], 0.0, 0.0
        for k, (lo, hi) in enumerate(parts):
            t0 = time.perf_counter()
            if kind == "store":
                job = mgr.prepare_store(keys[lo:hi], src[lo:hi], parents=parents[lo:hi])
            else:
                job = mgr.prepare_load_part(keys[lo:], src[lo:], hi - lo)
            if k == 0:
                t_first = time.perf_counter() - t0
            assert job is not None and len(job.keys) == hi - lo
            jobs.append(job)
        for k, job in enumerate(jobs):
            t0 = time.perf_counter()
            mgr.complete(JobResult(job.job_id, kind))  # type: ignore[arg-type]
            if k == len(jobs) - 1:
                t_last = time.perf_counter() - t0
        assert last_start == n - len(jobs[-1].keys)
        out.append(t_first + t_last)
    return out[0], out[1]


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--blocks", type=int, default=2048)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--json", action="store_true")
    p.add_argument("--profile", action="store_true")
    p.add_argument(
        "--heads",
        type=int,
        default=1,
        help="KV heads (page = 2 layers x heads x 16 tokens x K,V x head-dim x 2 B; default "
        "1 KiB pages: the copies cost little; larger pages show what the copies do not hide)",
    )
    p.add_argument("--head-dim", type=int, default=8)
    args = p.parse_args()
    n, reps = args.blocks, args.reps
    out = sys.stderr if args.json else sys.stdout
    total = 2 * n + 8
    caches = make_caches("LBNHC", LAYERS, total, args.heads, args.head_dim, TOKENS, "cpu")
    page = LAYERS * args.heads * TOKENS * 2 * args.head_dim * 2
    base = Path(tempfile.mkdtemp(prefix="flexkv-coord-bench-"))
    # Every rep (timed, exposed, profiled) stores fresh keys: no eviction is timed or profiled.
    slots_needed = (2 * reps + 4) * (n + 16)
    cfg = load_config(
        {"cpu_cache_gb": slots_needed * (page + 4096) / 2**30, "admission": "write_back"},
        env={},
    )
    ns, src, dst, spare, _ = bench_blocks("bench/coordinator", TOKENS, page, n, total)
    store_t: list[Clock] = []
    load_t: list[Clock] = []
    floors: list[dict[str, Clock]] = []
    try:
        engine = CacheEngine.from_kv_caches(cfg, ns, caches)
        warm = ns.keys([b"warm-%d" % i for i in range(len(spare))])
        assert engine.store(warm, spare).ok and engine.load(warm, spare).ok
        floor_slots = list(range(engine.pool.num_slots - n, engine.pool.num_slots))
        for r in range(reps):
            keys = ns.keys([b"rep%d-%032x" % (r, i) for i in range(n)])
            t0 = clock()
            assert engine.store(keys, src).ok
            store_t.append(since(t0))
            t0 = clock()
            outcome = engine.load(keys, dst)
            load_t.append(since(t0))
            assert outcome.ok
            floors.append(floor_clocks(engine, keys, src, floor_slots, dst))
        exposed: list[tuple[float, float]] = []
        for r in range(reps):
            keys = ns.keys([b"exposed%d-%032x" % (r, i) for i in range(n)])
            exposed.append(exposed_seconds(engine, keys, src))
        if args.profile:
            keys = ns.keys([b"prof-%032x" % i for i in range(n)])
            for name, call in (
                ("store", lambda: engine.store(keys, src)),
                ("load", lambda: engine.load(keys, dst)),
            ):
                prof = cProfile.Profile()
                prof.enable()
                call()
                prof.disable()
                print(f"--- cProfile: one {name} of {n} blocks", file=sys.stderr)
                pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(15)
        engine.close()
    finally:
        shutil.rmtree(base, ignore_errors=True)

    def us(ts: list[Clock], which: int) -> float:
        return statistics.median(t[which] for t in ts) / n * 1e6

    results: dict[str, float | int] = {"blocks": n, "reps": reps, "page_bytes": page}
    print(f"{n} blocks of {page} B, CPU tensors, median of {reps} reps, µs per block:", file=out)
    for name, ours, copy, raw, parts in (
        ("store", store_t, "d2h", "store_raw", "d2h_parts"),
        ("load", load_t, "h2d", "load_raw", "h2d_parts"),
    ):
        # Wall time is what a caller waits; the process's CPU time is the work itself, much
        # less disturbed by other processes on a shared machine.
        for which, clock_name in ((0, "wall"), (1, "cpu")):
            o = us(ours, which)
            c, f, pc = (us([fl[k] for fl in floors], which) for k in (copy, raw, parts))
            tag = f"{name}_{clock_name}"
            results[f"{tag}_us_per_block"] = o
            results[f"{tag}_copy_us_per_block"] = c
            results[f"{tag}_floor_us_per_block"] = f  # raw index + one transfer-engine call
            results[f"{tag}_coordinator_us_per_block"] = o - f
            results[f"{tag}_ratio"] = o / f
            results[f"{tag}_parts_copy_us_per_block"] = pc
            results[f"{tag}_not_hidden_us_per_block"] = o - pc
            lo = min(t[which] for t in ours) / n * 1e6
            print(
                f"  {name:<5} {clock_name:<4} ours {o:6.2f} (min {lo:5.2f})  floor (raw index + "
                f"one copy call) {f:5.2f}  coordinator {o - f:6.2f}  ratio {o / f:5.1f}x  "
                f"not hidden by the parts' copies {o - pc:6.2f}",
                file=out,
            )
    for which, name in ((0, "store"), (1, "load")):
        e = statistics.median(x[which] for x in exposed) / n * 1e6
        results[f"{name}_exposed_us_per_block"] = e
        print(
            f"  {name:<5} first part's preparation + last part's completion (no copy hides "
            f"them), through the manager: {e:5.2f} µs per block",
            file=out,
        )
    if args.json:
        print(json.dumps(results))


if __name__ == "__main__":
    main()
