"""The staged copy path with and without its two cuts (merged page copies, tapered end chunks),
side by side with a contiguous pinned memcpy of the same bytes, in one run (H200).

A restore-shaped batch: Qwen3-8B-shaped KV pages (36 layers, 8 KV heads, head 128, bf16: 2.25 MiB
per 16-token block), consecutive host slots, scattered GPU blocks. Each rep runs every variant
once, in rotating order, so drift of the machine falls on all of them alike. Every variant's H2D
is checked bit-exact against its D2H source.

    python3 benches/staged_variants.py --blocks 2048 --reps 9 --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cuda_clock import Clock
from restore_model import make_paged_caches

from flexkv_py.tiers.host_pool import HostPool
from flexkv_py.transfer import describe_kv_caches
from flexkv_py.transfer.staged_path import StagedCopyPath

# name -> (merge copies within a registration, taper the end chunks)
VARIANTS = {
    "plain": (False, False),
    "merge": (True, False),
    "taper": (False, True),
    "both": (True, True),
}


def memcpy_s(nbytes: int, direction: str, clock: Clock, reps: int) -> float:
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst, src = (host, dev) if direction == "d2h" else (dev, host)
    dst.copy_(src, non_blocking=True)  # warm-up
    return clock.median(lambda: dst.copy_(src, non_blocking=True), reps)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=2048)
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("staged_variants needs a GPU (the staged path is CUDA only)")
    clock = Clock(True)
    n = args.blocks
    caches = make_paged_caches(36, 2 * n + 8, 8, 128, "cuda")
    geom = describe_kv_caches(caches)
    perm = torch.randperm(2 * n + 8, generator=torch.Generator().manual_seed(7)).tolist()
    src, dst = perm[:n], perm[n : 2 * n]
    slots = list(range(n))
    pool = HostPool(n, geom.slot_nbytes, pin=True)
    paths = {
        name: StagedCopyPath(
            geom, pool.tensor, merge_span_slots=pool.registration_slots if merge else 1, taper=taper
        )
        for name, (merge, taper) in VARIANTS.items()
    }
    src_a, dst_a, slots_a = (np.array(x, dtype=np.int64) for x in (src, dst, slots))
    nbytes = n * geom.page_nbytes
    times: dict[str, dict[str, list[float]]] = {v: {"d2h": [], "h2d": []} for v in VARIANTS}
    exact: dict[str, bool] = {}
    copies: dict[str, dict[str, int]] = {v: {} for v in VARIANTS}
    want = torch.cat([c[src].flatten() for c in caches.values()])
    for rep in range(args.reps + 1):  # rep 0 warms every path up (Triton compiles)
        names = list(VARIANTS)
        names = names[rep % len(names) :] + names[: rep % len(names)]
        for name in names:
            path = paths[name]
            issued = path.copies_issued
            t_d2h, _ = clock.time(lambda path=path: path.enqueue("d2h", src_a, slots_a))
            copies[name]["d2h"] = path.copies_issued - issued
            for c in caches.values():
                c[dst] = 0
            issued = path.copies_issued
            t_h2d, _ = clock.time(lambda path=path: path.enqueue("h2d", dst_a, slots_a))
            copies[name]["h2d"] = path.copies_issued - issued
            got = torch.cat([c[dst].flatten() for c in caches.values()])
            exact[name] = exact.get(name, True) and bool(
                torch.equal(got.view(torch.int16), want.view(torch.int16))
            )
            if rep:
                times[name]["d2h"].append(t_d2h)
                times[name]["h2d"].append(t_h2d)
    ceiling = {d: memcpy_s(nbytes, d, clock, args.reps) for d in ("d2h", "h2d")}
    pool.close()
    rows = {}
    for name in VARIANTS:
        row: dict[str, object] = {"bit_exact": exact[name], "copies": copies[name]}
        for d in ("d2h", "h2d"):
            med = statistics.median(times[name][d])
            row[f"{d}_ms"] = med * 1e3
            row[f"{d}_of_memcpy"] = ceiling[d] / med
            row[f"{d}_ms_all"] = [t * 1e3 for t in times[name][d]]
        rows[name] = row
    print(f"{n} blocks of {geom.page_nbytes} B ({nbytes / 1e9:.2f} GB), {args.reps} reps")
    print(f"memcpy: d2h {ceiling['d2h'] * 1e3:.2f} ms, h2d {ceiling['h2d'] * 1e3:.2f} ms")
    for name, row in rows.items():
        print(
            f"{name:6s} d2h {row['d2h_ms']:.2f} ms ({row['d2h_of_memcpy']:.3f})  "
            f"h2d {row['h2d_ms']:.2f} ms ({row['h2d_of_memcpy']:.3f})  "
            f"copies {row['copies']}  exact {row['bit_exact']}"
        )
    if args.json:
        print(
            json.dumps(
                {
                    "blocks": n,
                    "bytes": nbytes,
                    "memcpy_ms": {d: v * 1e3 for d, v in ceiling.items()},
                    "variants": rows,
                }
            )
        )
    if not all(exact.values()):
        raise SystemExit("a variant's H2D did not give back the bytes its D2H took")


if __name__ == "__main__":
    main()
