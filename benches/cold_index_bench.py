"""Cold index bench: bytes per cached block and restart adoption time of the scheduler's tier index.

A restart adopts N SSD blocks (what `CacheManager.adopt_ssd_keys` does once every worker reported
its inventory: `TierIndex.set_present(keys, Tier.SSD, True)`); the blocks are cold (no host copy,
nothing in flight), so they live in the per-tier `BlockSet` plus the key arena, not in `Entry`
objects. Measured per N:

  py_bytes   Python heap growth over the adoption (tracemalloc; the key arena is here), the
             keys given excluded
  rust_bytes heap bytes of the cold sets (`BlockSet.nbytes`)
  per_block  (py_bytes + rust_bytes) / N             goal: <= 100 B
  adopt_s    wall time of the adoption (a separate run, without tracemalloc)
  lookup_us  `readable_hashes` over 8192 adopted hashes (a full hit)

    python3 benches/cold_index_bench.py [--sizes 200000,2000000] [--json]
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import time
import tracemalloc
from typing import Any

from flexkv_py.index.head_map import HEAD_LEN
from flexkv_py.index.tier_index import TierIndex
from flexkv_py.index.tier_names import Tier


def _keys(n: int, head: bytes) -> list[bytes]:
    seed = hashlib.sha256(b"index-cost").digest()
    return [head + hashlib.sha256(seed + i.to_bytes(8, "little")).digest() for i in range(n)]


def measure(n: int) -> dict[str, Any]:
    head = b"H" * HEAD_LEN
    keys = _keys(n, head)
    gc.collect()
    timed = TierIndex(1024)  # timed without tracemalloc (it slows every allocation)
    t0 = time.perf_counter()
    n_adopted = len(timed.set_present(keys, Tier.SSD, True))
    adopt_s = time.perf_counter() - t0
    del timed
    gc.collect()
    idx = TierIndex(1024)
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    adopted = idx.set_present(keys, Tier.SSD, True)
    del adopted  # the caller's list of adopted keys, not the index's cost
    gc.collect()
    py_bytes = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    rust_bytes = idx.counts()["cold_set_bytes"]
    hashes = [k[HEAD_LEN:] for k in keys[:8192]]
    reps = 20
    t0 = time.perf_counter()
    for _ in range(reps):
        hit = idx.readable_hashes(head, hashes)
    lookup_us = (time.perf_counter() - t0) / reps * 1e6
    assert hit == len(hashes) and n_adopted == n
    return {
        "blocks": n,
        "py_bytes": py_bytes,
        "rust_bytes": rust_bytes,
        "per_block": round((py_bytes + rust_bytes) / n, 1),
        "adopt_s": round(adopt_s, 3),
        "lookup_us": round(lookup_us, 1),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="200000,2000000")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    rows = [measure(int(s)) for s in args.sizes.split(",")]
    if args.json:
        print(json.dumps({"rows": rows}))  # one line, as `flexkv-py bench` reads every bench
        return
    print(
        f"{'blocks':>9} {'py B':>11} {'rust B':>11} {'B/block':>8} {'adopt s':>8} {'lookup us':>10}"
    )
    for r in rows:
        print(
            f"{r['blocks']:>9} {r['py_bytes']:>11} {r['rust_bytes']:>11} {r['per_block']:>8} "
            f"{r['adopt_s']:>8} {r['lookup_us']:>10}"
        )


if __name__ == "__main__":
    main()
