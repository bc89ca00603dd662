"""Latency of one 64 KiB SSD write (one block), with and without a CPU hog.

On a 2-core machine under load, "ssd write of 1 blocks not done after
5 s (ssd_io_timeout_s)" was logged. This bench times a 1-block `BlockStore.submit_put` + `wait`
(the SSD tier's write-through path: io_uring device queue, batch thread, GIL-free wait) one at a
time, and, for comparison, a raw O_DIRECT `pwrite` of the same 64 KiB next to it (what the
device and kernel alone take). Each phase runs without a hog, then with `--hogs` processes
spinning (`while True: pass`, the hog of the report), optionally also with a Python thread of
this process spinning (`--gil`: a busy engine thread holding the GIL between switches).

Prints one JSON line: per phase and path p50 / p99 / max in milliseconds and the sample count.

    python3 benches/write_latency_under_load.py [--n 400] [--hogs 2] [--dir DIR] [--gil]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from flexkv_py._native import BlockStore, HostPool

BLOCK = 64 << 10


def summary(samples: list[float]) -> dict[str, float]:
    ms = np.array(samples) * 1e3
    return {
        "p50_ms": round(float(np.percentile(ms, 50)), 3),
        "p99_ms": round(float(np.percentile(ms, 99)), 3),
        "max_ms": round(float(ms.max()), 3),
        "n": len(samples),
    }


@contextmanager
def hogs(n: int) -> Iterator[None]:
    """`n` processes spinning on the CPU, killed (by their pids) on exit."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]
    try:
        time.sleep(0.5)  # let them reach the run queue (not a completion wait)
        yield
    finally:
        for p in procs:
            p.kill()
        for p in procs:
            p.wait()


@contextmanager
def gil_spinner(on: bool) -> Iterator[None]:
    """A Python thread of this process spinning (holds the GIL between switch intervals)."""
    stop = threading.Event()

    def spin() -> None:
        x = 0
        while not stop.is_set():
            x += 1

    t = threading.Thread(target=spin, daemon=True)
    if on:
        t.start()
    try:
        yield
    finally:
        stop.set()
        if on:
            t.join()


def timed(fn: Callable[[int], None], n: int) -> list[float]:
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        fn(i)
        out.append(time.perf_counter() - t0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, default=400, help="writes per phase and path")
    ap.add_argument("--hogs", type=int, default=2)
    ap.add_argument("--dir", type=Path, default=None)
    ap.add_argument("--gil", action="store_true", help="also a phase with a GIL-holding thread")
    args = ap.parse_args()

    root = Path(tempfile.mkdtemp(prefix="flexkv-wlat-", dir=args.dir))
    pool = HostPool(2 * BLOCK)
    view = np.frombuffer(pool.memoryview(), np.uint8)
    view[:] = np.random.default_rng(0).integers(0, 256, view.size, dtype=np.uint8)
    (root / "store").mkdir()
    store = BlockStore(str(root / "store"), 256 << 20, io_engine="auto", queue_depth=512)
    raw_fd = os.open(root / "raw.dat", os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    os.posix_fallocate(raw_fd, 0, 1024 * BLOCK)
    raw_buf = pool.memoryview()[:BLOCK]
    seq = iter(range(10**9))

    def put(i: int) -> None:
        # A fresh key and fresh bytes each time (no dedup): one header page + 64 KiB written.
        k = next(seq)
        view[:8] = np.frombuffer(k.to_bytes(8, "little"), np.uint8)
        (res,) = store.submit_put([(b"w%d" % k, (pool.address, BLOCK))]).wait(30.0)
        if not res.ok:
            raise SystemExit(f"write failed: {res}")

    def raw(i: int) -> None:
        if os.pwrite(raw_fd, raw_buf, (i % 1024) * BLOCK) != BLOCK:
            raise SystemExit("short raw write")

    out: dict[str, object] = {
        "bench": "write_latency_under_load",
        "engine": store.io_engine,
        "cpus": os.cpu_count(),
        "hogs": args.hogs,
        "block_bytes": BLOCK,
    }
    timed(put, 20)  # warm-up: file extents, journal
    phases = [("baseline", 0, False), ("hog", args.hogs, False)]
    if args.gil:
        phases.append(("hog+gil", args.hogs, True))
    try:
        for name, n_hogs, gil in phases:
            with hogs(n_hogs), gil_spinner(gil):
                out[name] = {
                    "store_put": summary(timed(put, args.n)),
                    "raw_pwrite": summary(timed(raw, args.n)),
                }
    finally:
        raw_buf.release()
        os.close(raw_fd)
        store.close()
        shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
