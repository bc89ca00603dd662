"""Restart read bench: what the scheduler's own read of the SSD shards costs a restarted engine
(the first request after a restart hits; goal: start-up grows by <= 1 s at 1 M blocks).

A store of N tiny blocks is written once as each rank's shard (``<dir>/tp{r}-pp0``, connector-
shaped keys: rank tag + 24-byte namespace head + 32-byte hash, chains of 64 blocks with their
parents, as requests store them). Then, in a fresh interpreter per run (nothing else in its
heap, like a restarted engine), the scheduler side's new work is timed as it runs there
(`RestartInventory.start_read` in SchedulerSide's constructor, `wait_read` at the first
scheduler call; its steps here without vLLM, so the bench runs where vLLM is not installed):

  ctor_s        what SchedulerSide's constructor grows by: starting the read's thread
                                                                         goal: <= 1 s
  first_wait_s  the longest the first scheduler call can wait: the whole read and adoption,
                when the first request comes at once (the read overlaps whatever comes first)
  read_s        of it, `read_ssd_inventory`: every shard opened read-only (journal replay,
                GIL released), listed, the namespace's keys kept, the TP rule applied
  adopt_s       of it, `RestartInventory.adopt_read`: the index adopts them (cold sets,
                capacity fit, events), the keys are kept for the settle
  cpu_s         CPU seconds of the process over the read and adoption (all threads; on a
                shared machine the wall times mostly measure the neighbours)
  main_share    the main thread's speed while the read runs, against alone (pure-Python
                work of the same size: what the read leaves to the engine's own start-up)
  settle_s      the first step's settle: the workers' reports against what was adopted
                (every key listed again, nothing new, nothing gone), chain links made
  old_s         for comparison, that first step before: the reports adopted into an empty
                index, chain links made
  rss_mb        the process's RSS growth over read + adoption (the read-only store is freed;
                the keys are kept until the reports settle them)

--cold drops the shards' journal pages from the page cache before each run (posix_fadvise:
that file only), as after a reboot.

A store of 1 M blocks takes ~8 GiB under --dir (sparse data file, 8 KiB per block), written
in ~25 s on the dev VM and deleted after the runs unless --keep (then reused).

    python3 benches/restart_read_bench.py [--quick] [--blocks 1000000] [--tp 1] [--runs 3]
        [--dir /tmp] [--cold] [--keep] [--json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from flexkv_py._native import BlockStore
from flexkv_py.index.namespace import Namespace

CHAIN = 64  # blocks per stored request (each names the one before it as its parent)
BATCH = 8192
BLOCK_DISK_BYTES = 8192  # a tiny block: one header page + one data page
PAGE_BYTES = 4096  # the namespace's page: the index's capacity counts 2 store pages per block
JOURNAL_FILE = "flexkv-journal.log"


def namespace(tp: int) -> Namespace:
    return Namespace(
        "bench/model",
        None,
        kv_dtype="bfloat16",
        kv_layout="NHD",
        block_size=16,
        tp_size=tp,
        page_bytes=PAGE_BYTES,
    )


def ssd_gb(n: int, tp: int) -> float:
    """Room for every block on every rank (nothing evicted at adoption)."""
    return tp * (n * BLOCK_DISK_BYTES + (256 << 20)) / (1 << 30)


def write_shards(root: Path, n: int, tp: int) -> float:
    """Every rank's shard holds the same N blocks. Returns seconds."""
    ns = namespace(tp)
    seed = hashlib.sha256(b"restart-read").digest()
    logical = [ns.key(hashlib.sha256(seed + i.to_bytes(8, "little")).digest()) for i in range(n)]
    t = time.perf_counter()
    for r in range(tp):
        rank = ns.for_rank(r)
        shard = root / rank.shard_dir_name
        shard.mkdir(parents=True)
        capacity = int(ssd_gb(n, tp) * (1 << 30)) // tp
        with BlockStore(str(shard), capacity, preallocate=False) as store:
            pending = []
            for at in range(0, n, BATCH):
                span = range(at, min(n, at + BATCH))
                items = [(rank.storage_key(logical[i]), i.to_bytes(4, "little")) for i in span]
                parents = [rank.storage_key(logical[i - 1]) if i % CHAIN else None for i in span]
                pending.append(store.submit_put(items, parents=parents))
                if len(pending) >= 4:
                    assert all(r.ok for r in pending.pop(0).wait())
            for h in pending:
                assert all(r.ok for r in h.wait())
            assert len(store) == n
    return time.perf_counter() - t


# One run in a fresh interpreter: argv = root, blocks, tp, this file. The scheduler side's steps
# as RestartInventory takes them (start_read / adopt_read / adopt_reports), without vLLM.
_CHILD = """
import json, os, sys, time
from flexkv_py.config import load_config
from flexkv_py.coordinator import CacheManager
from flexkv_py.coordinator.adopted_before import AdoptedBefore
from flexkv_py.coordinator.manager import ssd_capacity_blocks
from flexkv_py.integration.vllm.restart_read import RestartRead
from flexkv_py.tiers.ssd.inventory import read_ssd_inventory
sys.path.insert(0, os.path.dirname(sys.argv[4]))
from restart_read_bench import PAGE_BYTES, namespace, ssd_gb

root, n, tp = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
ns = namespace(tp)
cfg = load_config({"cpu_cache_gb": 0.01, "ssd_cache_gb": ssd_gb(n, tp), "ssd_cache_dir": root},
                  env={})
capacity = ssd_capacity_blocks(cfg, ns, PAGE_BYTES)
page = os.sysconf("SC_PAGE_SIZE")
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * page
def work(n):
    x = 0
    for i in range(n):
        x += i & 7
    return x

def start(mgr, got):
    def adopt(inv):
        got["read_s"] = inv.seconds
        t = time.perf_counter()
        mgr.adopt_ssd_keys([inv.keys], parents=inv.parents, checked=True)
        got["before"] = AdoptedBefore(inv.keys)
        got["adopt_s"] = time.perf_counter() - t
    t = time.perf_counter()
    read = RestartRead(lambda: read_ssd_inventory(cfg, ns, parents_over=capacity), adopt)
    return read, time.perf_counter() - t

# The constructor's growth and the first call's longest wait.
mgr = CacheManager(cfg, ns, PAGE_BYTES)
got = {}
r0, c0, w0 = rss(), time.process_time(), time.perf_counter()
read, ctor_s = start(mgr, got)
read.wait(timeout=600)  # the whole read, however long (WAIT_S bounds the engine's)
first_wait_s, cpu_s = time.perf_counter() - w0, time.process_time() - c0
rss_mb = (rss() - r0) / 2**20
assert read.adopted and mgr.stats()["ssd_adopted_blocks"] == n
before = got.pop("before")

# The main thread's speed while a read runs (a second engine's worth, on a fresh index).
steps = 2_000_000
t = time.perf_counter(); work(steps); alone = time.perf_counter() - t
steps = int(steps * first_wait_s / alone)
t = time.perf_counter(); work(steps); alone = time.perf_counter() - t
other, _ = start(CacheManager(cfg, ns, PAGE_BYTES), {})
t = time.perf_counter(); work(steps); beside = time.perf_counter() - t
other.wait(timeout=600)

# The first step: the reports (new objects, as unpickled from the workers) settle it.
size = len(ns.key(bytes(32)))
blob = b"".join(before._keys)
keys = tuple(blob[i : i + size] for i in range(0, len(blob), size))
ranks = [keys] * tp
parents = {keys[i]: keys[i - 1] for i in range(n) if i % 64}
t = time.perf_counter()
mgr.adopt_ssd_keys(ranks, parents=parents, before=before)
settle_s = time.perf_counter() - t
assert mgr.stats()["ssd_adopted_blocks"] == n and not mgr.stats().get("ssd_forgotten_blocks")
old = CacheManager(cfg, ns, PAGE_BYTES)
t = time.perf_counter()
old.adopt_ssd_keys(ranks, parents=parents)
old_s = time.perf_counter() - t
print(json.dumps({"ctor_s": ctor_s, "first_wait_s": first_wait_s, **got, "cpu_s": cpu_s,
                  "main_share": alone / beside, "settle_s": settle_s, "old_s": old_s,
                  "rss_mb": rss_mb}))
"""


def drop_journal_pages(root: Path) -> None:
    for journal in root.glob(f"*/{JOURNAL_FILE}"):
        fd = os.open(journal, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def run_child(root: Path, n: int, tp: int) -> dict[str, float]:
    env = dict(os.environ)
    repo = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = repo + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(root), str(n), str(tp), str(Path(__file__).resolve())],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    if out.returncode:
        raise RuntimeError(f"bench child failed:\n{out.stderr[-4000:]}")
    row: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=None, help="default 1 M (--quick: 100 K)")
    ap.add_argument("--quick", action="store_true", help="100 K blocks, 2 runs")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--runs", type=int, default=None, help="default 3 (--quick: 2)")
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the shards are written")
    ap.add_argument("--cold", action="store_true", help="journal pages out of the page cache")
    ap.add_argument("--keep", action="store_true", help="keep (and reuse) the written shards")
    ap.add_argument("--json", action="store_true", help="end with one JSON line")
    args = ap.parse_args()
    if args.blocks is None:
        args.blocks = 100_000 if args.quick else 1_000_000
    if args.runs is None:
        args.runs = 2 if args.quick else 3
    out = sys.stderr if args.json else sys.stdout
    root = Path(args.dir) / f"flexkv-restart-read-{args.blocks}-tp{args.tp}"
    if not root.exists():
        print(
            f"writing {args.blocks} blocks x {args.tp} shards in {root} ...", file=out, flush=True
        )
        print(f"  {write_shards(root, args.blocks, args.tp):.1f} s", file=out, flush=True)
    try:
        runs = []
        for i in range(args.runs):
            if args.cold:
                drop_journal_pages(root)
            runs.append(run_child(root, args.blocks, args.tp))
            print(
                f"run {i}: " + json.dumps({k: round(v, 3) for k, v in runs[-1].items()}), file=out
            )
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    median: dict[str, Any] = {k: round(statistics.median(r[k] for r in runs), 3) for k in runs[0]}
    summary = {"blocks": args.blocks, "tp": args.tp, "cold": args.cold, "runs": len(runs), **median}
    # The first step's settle against what it cost before (adopting the reports): <= 1 wanted.
    summary["settle_over_old"] = round(median["settle_s"] / median["old_s"], 3)
    if args.json:
        print(json.dumps(summary))
    else:
        print("median: " + json.dumps(summary))


if __name__ == "__main__":
    main()
