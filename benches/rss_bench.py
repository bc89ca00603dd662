"""RSS bench: what a restarted engine's processes really hold per cached block (the operator's
figure: RSS, not counted bytes), and how long the reopen takes.

A store of N tiny blocks is written once as the worker's shard (restart_read_bench's layout:
connector-shaped keys, chains of 64 with their parents). Then, each in a fresh interpreter
(nothing else in its heap, like a restarted engine), as the connector runs them:

  worker     opens this rank's lower tiers (the SSD store's reopen: journal replay) and builds
             its restart report as WorkerSide does (`restart_report()`: keys and chain
             parents, joined buffers), pickles it (the step's worker metadata) and lets it go.
  scheduler  the scheduler side's restart: its own read-only read of the shard and the
             adoption (`RestartInventory.start_read` / `wait_read`), then the first step's
             settle with the worker's report (unpickled, as vLLM hands it over), then a full
             lookup pass: every stored chain looked up as a request's block hashes
             (`readable_hashes`), every block must hit.

With `--ranks N` (TP = N): a shard per rank, each holding the same blocks (`--lost-every K`:
the last rank's shard lacks every K-th block, so the ranks' listings differ); a worker process
per rank, worker (0, 0) reporting keys and links, the others their keys (as WorkerSide does);
the scheduler reads every shard and settles with the N reports.

Each twice: with the freed heap given back to the OS as the connector does (process_memory.py)
and, the baseline, with it left in glibc's arenas (as before). Per process: RSS (VmRSS) after
its work, less RSS before it (interpreter, imports, an empty manager or no tier), and the
seconds the reopen took: the worker's `open_lower_tiers`, the scheduler's read + adoption.
Reported: bytes per block for each and summed (goal <= 100 B), reopen seconds per 1 M blocks
(goal <= 1 s, adoption included), and the counted bytes (`index_nbytes()` and the cold sets'
`nbytes()`) beside the RSS.

    python3 benches/rss_bench.py [--blocks 1000000] [--quick] [--ranks 1] [--lost-every 0]
        [--dir /tmp] [--keep] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from restart_read_bench import namespace, ssd_gb, write_shards

from flexkv_py._native import BlockStore

_COMMON = """
import gc, json, os, pickle, sys, threading, time
sys.path.insert(0, os.path.dirname(sys.argv[4]))
from restart_read_bench import PAGE_BYTES, namespace, ssd_gb
from flexkv_py.config import load_config
root, n, report_path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
if sys.argv[5] == "kept":  # the baseline: freed heap left in glibc's arenas
    import flexkv_py.process_memory as pm
    pm._malloc_trim = lambda: None
# The ranks (TP), this worker's rank, the blocks every shard holds.
ranks, rank_index, held = int(sys.argv[6]), int(sys.argv[7]), int(sys.argv[8])
ns = namespace(ranks)
cfg = load_config({"cpu_cache_gb": 0.01, "ssd_cache_gb": ssd_gb(n, ranks), "ssd_cache_dir": root},
                  env={})
page = os.sysconf("SC_PAGE_SIZE")
def rss():
    gc.collect()
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * page
"""

_WORKER = (
    _COMMON
    + """
from flexkv_py.index.tier_names import Tier
from flexkv_py.process_memory import return_freed_memory
from flexkv_py.tiers.lower_tiers import open_lower_tiers
rank = ns.for_rank(rank_index, 0)
r0 = rss()
t = time.perf_counter()
tiers, unavailable = open_lower_tiers(cfg, rank)
reopen_s = time.perf_counter() - t
assert not unavailable, unavailable
ssd = tiers[Tier.SSD]
# WorkerSide._report_inventory, pickled: worker (0, 0) sends keys and their chain parents, the
# others their keys (restart_keys; before it, a tuple of keys()).
if rank_index == 0:
    keys, parents = ssd.restart_report()
else:
    listing = getattr(ssd, "restart_keys", None)
    keys, parents = (listing() if listing else tuple(ssd.keys())), {}
with open(report_path + f"-{rank_index}", "wb") as f:
    pickle.dump((keys, parents), f, protocol=pickle.HIGHEST_PROTOCOL)
assert len(keys) in (n, held)
del keys, parents
# WorkerSide.build_worker_meta, once the step that sent the report is over.
return_freed_memory("the restart report")
r1 = rss()
print(json.dumps({"rss": r1 - r0, "reopen_s": reopen_s,
                  "counted": ssd.store.index_nbytes()}))
"""
)

_SCHEDULER = (
    _COMMON
    + """
from types import SimpleNamespace
from flexkv_py.coordinator import CacheManager
from flexkv_py.index.tier_index import HEAD_LEN
from flexkv_py.integration.vllm.restart_inventory import RestartInventory
mgr = CacheManager(cfg, ns, PAGE_BYTES)
inv = RestartInventory(ranks, enabled=True)
r0 = rss()
t = time.perf_counter()
inv.start_read(mgr, cfg, SimpleNamespace(namespace=ns, page_bytes=PAGE_BYTES))
inv.wait_read()
reopen_s = time.perf_counter() - t
assert mgr.stats()["ssd_adopted_blocks"] == held, mgr.stats()
# The first step: every worker's report, unpickled as vLLM hands them over.
reports, parents = {}, {}
for r in range(ranks):
    with open(report_path + f"-{r}", "rb") as f:
        reports[(r, 0)], got = pickle.load(f)
    parents = parents or got
inv.adopt_reports(mgr, SimpleNamespace(inventories=reports,
                                       inventory_parents=parents, recovered_metas=None))
assert inv.ready and mgr.stats()["ssd_adopted_blocks"] == held, mgr.stats()
# The full lookup pass: each stored chain of 64 as one request's block hashes (with blocks
# lost on a shard, a chain hits up to its first lost block).
keys = reports[(0, 0)]
heads = {k[:HEAD_LEN] for k in keys[:1]}
head = heads.pop()
hashes = [k[HEAD_LEN:] for k in keys]
del keys, reports, parents, got
t = time.perf_counter()
hit = 0
for at in range(0, n, 64):
    chain = hashes[at : at + 64]
    got = mgr.readable_hashes(head, chain, 0, len(chain))
    assert got == len(chain) or held < n, (at, got)
    hit += got
lookup_s = time.perf_counter() - t
assert hit == n or held < n
del hashes, chain
# The next steps, as SchedulerSide runs them: the events taken (the connector's take_events),
# the step's metadata gone, the shards' read-only views closed (on their own thread).
mgr.take_events()
for t in threading.enumerate():
    if t.name == "flexkv-shard-close":
        t.join()
inv.after_step()
r1 = rss()
cold = mgr.index._cold.set_bytes()
print(json.dumps({"rss": r1 - r0, "reopen_s": reopen_s, "lookup_s": lookup_s,
                  "counted": cold}))
"""
)


def run_child(
    code: str, root: Path, n: int, report: Path, heap: str, ranks: int, rank: int, held: int
) -> dict[str, Any]:
    env = dict(os.environ)
    repo = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = repo + os.pathsep + env.get("PYTHONPATH", "")
    here = str(Path(__file__).resolve())
    args = [str(root), str(n), str(report), here, heap, str(ranks), str(rank), str(held)]
    out = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    if out.returncode:
        raise RuntimeError(f"bench child failed:\n{out.stderr[-4000:]}")
    row: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return row


def blocks_held(n: int, every: int) -> int:
    """How many blocks every shard holds when the last loses every `every`-th (0: none)."""
    return n - len(range(every // 2, n, every)) if every else n


def lose_blocks(root: Path, n: int, ranks: int, every: int) -> None:
    """The last rank's shard loses every `every`-th block, oldest first (its listing then
    differs from the others')."""
    ns = namespace(ranks).for_rank(ranks - 1)
    capacity = int(ssd_gb(n, ranks) * (1 << 30)) // ranks
    with BlockStore(str(root / ns.shard_dir_name), capacity, preallocate=False) as store:
        lost = store.keys()[every // 2 :: every]
        assert sum(store.delete(k) for k in lost) == n - blocks_held(n, every)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=None, help="default 1 M (--quick: 100 K)")
    ap.add_argument("--quick", action="store_true", help="100 K blocks")
    ap.add_argument("--ranks", type=int, default=1, help="TP ranks: a shard and worker each")
    ap.add_argument("--lost-every", type=int, default=0, help="the last shard lacks every K-th")
    ap.add_argument("--dir", default=tempfile.gettempdir(), help="where the shard is written")
    ap.add_argument("--keep", action="store_true", help="keep (and reuse) the written shard")
    ap.add_argument("--json", action="store_true", help="end with one JSON line")
    args = ap.parse_args()
    n = args.blocks or (100_000 if args.quick else 1_000_000)
    ranks, every = args.ranks, args.lost_every
    out = sys.stderr if args.json else sys.stdout
    lost = f"-lost{every}" if every else ""
    root = Path(args.dir) / f"flexkv-restart-read-{n}-tp{ranks}{lost}"
    if not root.exists():
        print(f"writing {n} blocks x {ranks} shards in {root} ...", file=out, flush=True)
        print(f"  {write_shards(root, n, ranks):.1f} s", file=out, flush=True)
        if every:
            lose_blocks(root, n, ranks, every)
    held = blocks_held(n, every)
    report = root.parent / f"flexkv-rss-report-{n}-tp{ranks}{lost}-{os.getpid()}.pickle"
    rows = {}
    try:
        for heap in ("given back", "kept"):
            workers = [
                run_child(_WORKER, root, n, report, heap, ranks, r, held) for r in range(ranks)
            ]
            sched = run_child(_SCHEDULER, root, n, report, heap, ranks, 0, held)
            rows[heap] = summary(n, workers, sched)
    finally:
        for r in range(ranks):
            Path(f"{report}-{r}").unlink(missing_ok=True)
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    ours, base = rows["given back"], rows["kept"]
    row = {"blocks": n, "ranks": ranks, "held": held, **ours}
    row["baseline_total_b_per_block"] = base["total_b_per_block"]
    row["baseline_over_ours"] = round(base["total_b_per_block"] / ours["total_b_per_block"], 2)
    if args.json:
        print(json.dumps(row))
    else:
        for k, v in row.items():
            print(f"{k:28} {v}")


def summary(n: int, workers: list[dict[str, Any]], sched: dict[str, Any]) -> dict[str, Any]:
    """Per block of the shards (`n`): each process's RSS growth, all of them summed."""
    worker = workers[0]  # rank 0: the single-rank figures' worker
    return {
        "worker_b_per_block": round(worker["rss"] / n, 1),
        "other_workers_b_per_block": [round(w["rss"] / n, 1) for w in workers[1:]],
        "scheduler_b_per_block": round(sched["rss"] / n, 1),
        "total_b_per_block": round((sum(w["rss"] for w in workers) + sched["rss"]) / n, 1),
        "worker_counted_b": round(worker["counted"] / n, 1),
        "scheduler_counted_b": None if sched["counted"] is None else round(sched["counted"] / n, 1),
        "worker_reopen_s_per_m": round(max(w["reopen_s"] for w in workers) * 1e6 / n, 3),
        "scheduler_reopen_s_per_m": round(sched["reopen_s"] * 1e6 / n, 3),
        "lookup_s": round(sched["lookup_s"], 3),
    }


if __name__ == "__main__":
    main()
