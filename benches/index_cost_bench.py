"""Index cost bench: bytes per cached block and reopen time.

Goal: <= 100 bytes per cached block over both languages (the scheduler's index of a cold SSD
block + the worker's Rust store index) and reopening a store of 1 M blocks in <= 1 s. For each N
(default 0.2 M and 2 M blocks; --quick: 20 K and 0.2 M):

  plain      the scheduler's cold index as a plain `BlockSet` (24-byte head + 32-byte hash keys):
             `nbytes()` filled at once (a restart's adoption: sized once) and grown 32 keys at a
             time (stores arriving). No key arena: `ColdBlocks` keeps no full keys (drops go to
             the worker by fingerprint, a reset deletes by namespace there).
  chains     the real configuration: `ColdBlocks` adopting N SSD blocks as one chain each
             N/64 long (`add_on` + `link`), so the SSD set keeps chain links for prefix-aware
             eviction: the sets' `nbytes()` (no arena since 22.drops). `rss_per_block`: the
             process's RSS delta of the same, a check on the counted bytes.
  tier_index `TierIndex` adopting N SSD-only blocks (`set_present(keys, Tier.SSD, True)`):
             tracemalloc delta (Python objects only: the Rust sets are in `chains`).
  store      the Rust `BlockStore` index of N tiny blocks (4-byte distinct payloads, 8 KiB each on
             disk): `index_nbytes()`, else the RSS delta of opening the store in a fresh
             process, less that of opening an empty store.
  reopen     seconds to open that store of N blocks in a fresh process (journal replay; the
             journal is in the page cache after the first of --reopens runs: median shown),
             wall and CPU (on a shared machine the wall time mostly measures the neighbours).
  lookup     `BlockSet.prefix_run` vs `TierIndex.readable_hashes` over 8192 present hashes,
             consecutive (near) and spread through the N (median microseconds), and a miss
             at block 0.

Totals: plain + store and chains + store (the goal is for chains). The store is written once
per N in a temporary directory under --dir (local disk; 2 M blocks take ~16 GiB) and deleted.

    python3 benches/index_cost_bench.py [--quick] [--json] [--sizes 200000,2000000]
        [--dir /tmp] [--reopens 3] [--no-store]
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import platform
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flexkv_py._native import BlockSet, BlockStore
from flexkv_py.index.cold_blocks import ColdBlocks
from flexkv_py.index.tier_index import HEAD_LEN, TierIndex
from flexkv_py.index.tier_names import Tier

HEAD = bytes(range(HEAD_LEN))  # namespace prefix (16) + variant (8)
STORE_TAG = b"\0\0\0\0"  # rank tag in front of every stored key (namespace.SHARD_TAG)
LOOKUP_SPAN = 8192
STORE_BATCH = 32  # keys per add_keys when a BlockSet is grown as stores arrive
HASH_LEN = 32  # bytes of a block hash (sha256)
CHAINS = 64  # chains the `chains` row's N blocks form
BLOCK_DISK_BYTES = 8192  # header page + one payload page
GOAL_BYTES = 100.0
GOAL_REOPEN_PER_M = 1.0
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * PAGE_SIZE


def make_hashes(n: int, seed: int) -> list[bytes]:
    """n distinct 32-byte block hashes (random: as uniform as vLLM's sha256 ones)."""
    raw = random.Random(seed).randbytes(32 * n)
    return [raw[i : i + 32] for i in range(0, 32 * n, 32)]


def queries(hashes: list[bytes]) -> dict[str, list[bytes]]:
    """The looked-up hashes: `near`, LOOKUP_SPAN consecutive ones (a request whose blocks were
    stored together: their index entries were made one after another); `spread`, taken evenly
    through all N (after churn: every entry somewhere else in memory); `miss`, spread with an
    unknown first block."""
    mid = max(0, len(hashes) // 2 - LOOKUP_SPAN // 2)
    spread = hashes[:: max(1, len(hashes) // LOOKUP_SPAN)][:LOOKUP_SPAN]
    return {
        "near": hashes[mid : mid + LOOKUP_SPAN],
        "spread": spread,
        "miss": [b"\xff" * 32, *spread[1:]],
    }


def lookup_times(
    prefix: Callable[[list[bytes]], int], hashes: list[bytes], seconds: float
) -> dict[str, float]:
    """Median microseconds of `prefix` (the length of the present run) on each query."""
    out = {}
    for name, q in queries(hashes).items():
        assert prefix(q) == (0 if name == "miss" else len(q)), name
        out[f"{name}_us"] = median_us(lambda q=q: prefix(q), seconds)
    return out


def median_us(fn: Any, seconds: float) -> float:
    fn()  # warm
    times: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(times) < 5:
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def bench_blockset(hashes: list[bytes], seconds: float) -> dict[str, float]:
    n = len(hashes)
    keys = [HEAD + h for h in hashes]
    gc.collect()
    rss0 = rss_bytes()
    t = time.perf_counter()
    s = BlockSet()
    s.add_keys(keys)
    fill_s = time.perf_counter() - t
    rss1 = rss_bytes()
    # Filled as stores arrive (a few blocks per call): grown step by step, not sized once.
    grown = BlockSet()
    for at in range(0, n, STORE_BATCH):
        grown.add_keys(keys[at : at + STORE_BATCH])
    assert len(s) == len(grown) == n
    del keys
    return {
        "nbytes_per_block": s.nbytes() / n,
        "grown_nbytes_per_block": grown.nbytes() / n,
        "rss_per_block": (rss1 - rss0) / n,
        "fill_ns_per_key": fill_s / n * 1e9,
        # The scheduler's plain cold index: the set alone (no key arena since 22.drops).
        "per_block": s.nbytes() / n,
        **lookup_times(lambda q: s.prefix_run(HEAD, q, 0, len(q)), hashes, seconds),
    }


def bench_chains(hashes: list[bytes]) -> dict[str, float]:
    """The scheduler's cold index of N SSD blocks as a restart adopts them: `ColdBlocks` (the
    SSD set keeps chain links), CHAINS chains, each block linked to the one before it."""
    n = len(hashes)
    keys = [HEAD + h for h in hashes]
    step = max(1, n // CHAINS)
    children = [k for i, k in enumerate(keys) if i % step]
    parents = [keys[i - 1] for i in range(n) if i % step]
    gc.collect()
    rss0 = rss_bytes()
    t = time.perf_counter()
    cold = ColdBlocks()
    assert len(cold.add_on(keys, Tier.SSD)) == n
    linked = cold.link(children, parents)
    adopt_s = time.perf_counter() - t
    rss1 = rss_bytes()
    assert linked == len(children), (linked, len(children))
    sets, arena = cold.set_bytes(), cold.arena_bytes()
    del keys, children, parents
    return {
        "set_nbytes_per_block": sets / n,
        "arena_per_block": arena / n,
        "per_block": (sets + arena) / n,
        "rss_per_block": (rss1 - rss0) / n,
        "adopt_s": adopt_s,
    }


def bench_tier_index(hashes: list[bytes], seconds: float) -> dict[str, float]:
    n = len(hashes)
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    idx = TierIndex(0)
    keys = [HEAD + h for h in hashes]
    changed = idx.set_present(keys, Tier.SSD, True)
    assert len(changed) == n
    del keys, changed
    held = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    return {
        "tracemalloc_per_block": held / n,
        **lookup_times(lambda q: idx.readable_hashes(HEAD, q, 0, len(q)), hashes, seconds),
    }


def store_capacity(n: int) -> int:
    return n * BLOCK_DISK_BYTES + (256 << 20)


def write_store(directory: Path, hashes: list[bytes]) -> float:
    """N distinct tiny blocks (a 4-byte payload each: no dedup). Returns seconds."""
    batch, inflight = 8192, 4
    t = time.perf_counter()
    with BlockStore(str(directory), store_capacity(len(hashes)), preallocate=False) as store:
        pending = []
        for at in range(0, len(hashes), batch):
            items = [
                (STORE_TAG + HEAD + h, (at + i).to_bytes(4, "little"))
                for i, h in enumerate(hashes[at : at + batch])
            ]
            pending.append(store.submit_put(items))
            if len(pending) >= inflight:
                results = pending.pop(0).wait()
                assert all(r.ok for r in results), next(r for r in results if not r.ok)
        for h in pending:
            results = h.wait()
            assert all(r.ok for r in results), next(r for r in results if not r.ok)
        assert len(store) == len(hashes)
    return time.perf_counter() - t


# Runs in a fresh interpreter: RSS and open time of one store, nothing else in the heap.
_OPEN_CHILD = """
import json, os, sys, time
from flexkv_py._native import BlockStore
page = os.sysconf("SC_PAGE_SIZE")
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * page
directory, capacity = sys.argv[1], int(sys.argv[2])
r0 = rss()
t, c = time.perf_counter(), time.process_time()
store = BlockStore(directory, capacity, preallocate=False)
open_s, open_cpu_s = time.perf_counter() - t, time.process_time() - c
r1 = rss()
nb = store.index_nbytes() if hasattr(store, "index_nbytes") else None
out = {"open_s": open_s, "open_cpu_s": open_cpu_s, "rss_delta": r1 - r0, "blocks": len(store),
       "index_nbytes": nb}
store.close()
print(json.dumps(out))
"""


def open_in_child(directory: Path, capacity: int) -> dict[str, Any]:
    env = dict(os.environ)
    repo = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = repo + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run(
        [sys.executable, "-c", _OPEN_CHILD, str(directory), str(capacity)],
        capture_output=True,
        text=True,
        check=True,
        env=env,
        timeout=600,
    )
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def bench_store(root: Path, hashes: list[bytes], reopens: int) -> dict[str, Any]:
    n = len(hashes)
    need = n * BLOCK_DISK_BYTES * 1.2 + (2 << 30)
    free = shutil.disk_usage(root).free
    if free < need:
        return {
            "skipped": f"needs {need / 2**30:.1f} GiB free under {root}, has {free / 2**30:.1f}"
        }
    work = Path(tempfile.mkdtemp(prefix="flexkv-index-cost-", dir=root))
    try:
        empty = work / "empty"
        empty.mkdir()
        baseline = open_in_child(empty, store_capacity(n))["rss_delta"]
        full = work / "full"
        full.mkdir()
        write_s = write_store(full, hashes)
        runs = [open_in_child(full, store_capacity(n)) for _ in range(reopens)]
        assert all(r["blocks"] == n for r in runs), runs
        open_s = statistics.median(r["open_s"] for r in runs)
        rss = statistics.median(r["rss_delta"] for r in runs) - baseline
        nbytes = runs[-1]["index_nbytes"]
        return {
            "write_s": write_s,
            "reopen_s": open_s,
            "reopen_first_s": runs[0]["open_s"],
            "reopen_s_per_m": open_s / (n / 1e6),
            # CPU seconds of the open: on a shared machine the steadier figure of the two.
            "reopen_cpu_s": statistics.median(r["open_cpu_s"] for r in runs),
            "rss_per_block": rss / n,
            "index_nbytes_per_block": None if nbytes is None else nbytes / n,
            # What the totals use: the store's own count when it has one.
            "per_block": (rss if nbytes is None else nbytes) / n,
            "measured_by": "rss" if nbytes is None else "index_nbytes",
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run_size(n: int, args: argparse.Namespace) -> dict[str, Any]:
    hashes = make_hashes(n, seed=n)
    row: dict[str, Any] = {"blocks": n}
    row["blockset"] = bench_blockset(hashes, args.seconds)
    row["chains"] = bench_chains(hashes)
    row["tier_index"] = bench_tier_index(hashes, args.seconds)
    row["store"] = (
        {"skipped": "--no-store"} if args.no_store else bench_store(args.dir, hashes, args.reopens)
    )
    store_b = row["store"].get("per_block")
    plain, chains = row["blockset"]["per_block"], row["chains"]["per_block"]
    row["total_plain_per_block"] = None if store_b is None else plain + store_b
    row["total_chains_per_block"] = None if store_b is None else chains + store_b
    return row


def fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def report(rows: list[dict[str, Any]], out: Any) -> None:
    p = functools.partial(print, file=out)
    p("bytes per cached block (scheduler: cold sets, no key arena; store: the worker's Rust index)")
    head: tuple[str, ...] = (
        "blocks",
        "bset.nbytes",
        "bset.grown",
        "plain",
        "chains.set",
        "chains",
        "chains.rss",
        "store",
        "(by)",
        "total plain",
        "total chain",
        "/goal",
    )
    p(" ".join(f"{h:>11}" for h in head))
    for r in rows:
        st, ch = r["store"], r["chains"]
        total = r["total_chains_per_block"]
        cells: tuple[str, ...] = (
            str(r["blocks"]),
            fmt(r["blockset"]["nbytes_per_block"]),
            fmt(r["blockset"]["grown_nbytes_per_block"]),
            fmt(r["blockset"]["per_block"]),
            fmt(ch["set_nbytes_per_block"]),
            fmt(ch["per_block"]),
            fmt(ch["rss_per_block"]),
            fmt(st.get("per_block")),
            st.get("measured_by", "-"),
            fmt(r["total_plain_per_block"]),
            fmt(total),
            fmt(None if total is None else total / GOAL_BYTES, ".2f"),
        )
        p(" ".join(f"{c:>11}" for c in cells))
    p(
        "(tier_index, Python objects only, per block: "
        + ", ".join(f"{r['blocks']}: {r['tier_index']['tracemalloc_per_block']:.1f}" for r in rows)
        + ")"
    )
    p("\nstore reopen (fresh process; median, first)")
    p(
        f"{'blocks':>9} {'write s':>8} {'reopen s':>9} {'cpu s':>8} {'first s':>8} "
        f"{'s per 1M':>9} {'/goal':>6}"
    )
    for r in rows:
        st = r["store"]
        if "skipped" in st:
            p(f"{r['blocks']:>9} skipped: {st['skipped']}")
            continue
        p(
            f"{r['blocks']:>9} {st['write_s']:>8.1f} {st['reopen_s']:>9.3f} "
            f"{st['reopen_cpu_s']:>8.3f} {st['reopen_first_s']:>8.3f} {st['reopen_s_per_m']:>9.3f} "
            f"{st['reopen_s_per_m'] / GOAL_REOPEN_PER_M:>6.2f}"
        )
    p(f"\nlookup of {LOOKUP_SPAN} present hashes (median us)")
    p("near: consecutive hashes, spread: taken through all N; prefix_run = BlockSet, tier = today")
    head = ("blocks", "near bset", "near tier", "ratio", "spread bset", "spread tier", "ratio")
    p(" ".join(f"{h:>11}" for h in (*head, "miss bset", "miss tier")))
    for r in rows:
        b, t = r["blockset"], r["tier_index"]
        cells = (
            str(r["blocks"]),
            fmt(b["near_us"], ".0f"),
            fmt(t["near_us"], ".0f"),
            fmt(b["near_us"] / t["near_us"], ".2f"),
            fmt(b["spread_us"], ".0f"),
            fmt(t["spread_us"], ".0f"),
            fmt(b["spread_us"] / t["spread_us"], ".2f"),
            fmt(b["miss_us"], ".2f"),
            fmt(t["miss_us"], ".2f"),
        )
        p(" ".join(f"{c:>11}" for c in cells))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="20K and 200K blocks, short timings")
    p.add_argument("--json", action="store_true", help="end with one JSON line")
    p.add_argument("--sizes", default="200000,2000000")
    p.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()), help="store scratch")
    p.add_argument("--reopens", type=int, default=3)
    p.add_argument("--seconds", type=float, default=1.0, help="per lookup timing")
    p.add_argument("--no-store", action="store_true", help="skip the store (no disk used)")
    args = p.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    if args.quick:
        sizes, args.seconds, args.reopens = [20_000, 200_000], 0.3, min(args.reopens, 2)
    out = sys.stderr if args.json else sys.stdout
    rows = []
    for n in sizes:
        print(f"... {n} blocks", file=out, flush=True)
        rows.append(run_size(n, args))
    report(rows, out)
    if args.json:
        print(json.dumps({"python": platform.python_version(), "rows": rows}))


if __name__ == "__main__":
    main()
