"""What the disk under a directory gives each read pattern, so an SSD-load ratio can be read
against the pattern it actually uses (tier_bench's raw baseline is one of these).

One file of --gib written with O_DIRECT and fsynced, then, interleaved over --reps rounds (so
drift of the disk moves every pattern alike), O_DIRECT reads of the whole file:
  seq-8M-qd1       8 MiB reads in file order, one at a time (tier_bench's `raw`)
  seq-blk-qd1      --block-bytes reads (one stored block) in file order, one at a time
  seq-blk-qdN      the same with N threads taking the next block in file order
  seq-8M-qdN       8 MiB reads in file order, N threads
Prints the median GB/s [min-max] of each and its ratio to seq-8M-qd1.

    python3 benches/disk_patterns.py [--dir DIR] [--gib 4] [--reps 5] [--block-bytes 2363392]
                                     [--depths 2,4,8] [--json]
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from tier_bench import RAW_CHUNK, RawDisk

CHUNK_8M = RAW_CHUNK  # tier_bench's raw read size
PAGE = 4096


def aligned(n: int) -> int:
    return (n + PAGE - 1) // PAGE * PAGE


def read_pattern(fd: int, nbytes: int, chunk: int, depth: int) -> float:
    """Seconds to read [0, nbytes) in `chunk` reads, `depth` threads taking the next offset."""
    offsets = list(range(0, nbytes, chunk))
    lock = threading.Lock()
    nxt = [0]
    errors: list[BaseException] = []

    def worker() -> None:
        buf = mmap.mmap(-1, chunk)
        try:
            while True:
                with lock:
                    if nxt[0] >= len(offsets):
                        return
                    off = offsets[nxt[0]]
                    nxt[0] += 1
                os.preadv(fd, [buf], off)
        except BaseException as e:  # reported by the caller
            errors.append(e)
        finally:
            buf.close()

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(depth)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return time.perf_counter() - t0


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--dir", type=Path, default=None)
    p.add_argument("--gib", type=float, default=4.0)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--block-bytes", type=int, default=2359296 + PAGE, help="a stored block")
    p.add_argument("--depths", default="2,4,8")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    depths = [int(d) for d in args.depths.split(",") if d]
    block = aligned(args.block_bytes)
    nbytes = int(args.gib * (1 << 30)) // CHUNK_8M * CHUNK_8M
    patterns = {"seq-8M-qd1": (CHUNK_8M, 1), "seq-blk-qd1": (block, 1)}
    for d in depths:
        patterns[f"seq-blk-qd{d}"] = (block, d)
        patterns[f"seq-8M-qd{d}"] = (CHUNK_8M, d)
    base = Path(tempfile.mkdtemp(prefix="flexkv-disk-patterns-", dir=args.dir or Path.cwd()))
    rates: dict[str, list[float]] = {k: [] for k in patterns}
    disk = RawDisk.written(base, nbytes)  # tier_bench's raw file: written with O_DIRECT, fsynced
    try:
        for _ in range(args.reps):
            for name, (chunk, depth) in patterns.items():
                rates[name].append(nbytes / 1e9 / read_pattern(disk.fd, nbytes, chunk, depth))
    finally:
        disk.close()
        base.rmdir()
    ref = statistics.median(rates["seq-8M-qd1"])
    print(f"{nbytes / 2**30:.1f} GiB, block {block} B, {args.reps} interleaved rounds")
    for name, r in rates.items():
        med = statistics.median(r)
        spread = f"[{min(r):.2f}-{max(r):.2f}]"
        print(f"  {name:<14} {med:5.2f} GB/s {spread}  /seq-8M-qd1 {med / ref:.2f}")
    if args.json:
        print(json.dumps({"bytes": nbytes, "block_bytes": block, "gbps": rates}))


if __name__ == "__main__":
    main()
