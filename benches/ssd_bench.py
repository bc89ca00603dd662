"""SSD tier bench: the block store vs raw sequential O_DIRECT I/O on the same directory.

For each block size, in one run: write N bytes of unique blocks through the store (batched,
several batches in flight), read them back verified; write and read the same bytes with raw
O_DIRECT `pwrite`/`pread` of 8 MiB chunks (the disk's sequential ceiling). Prints GB/s of each
and the ratios; `--json` ends with one JSON line.

    python3 benches/ssd_bench.py [--quick] [--json] [--dir DIR] [--gib N] [--engine io_uring]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from collections import deque
from pathlib import Path

import numpy as np

from flexkv_py import BlockStore, HostPool

MiB = 1 << 20
RAW_CHUNK = 8 * MiB
IN_FLIGHT = 4  # batches submitted ahead of the one being waited on


def fill_unique(view: np.ndarray, block_size: int, seed: int) -> None:
    """Random bytes, plus a unique stamp per block so dedup never kicks in."""
    rng = np.random.default_rng(seed)
    view[:] = rng.integers(0, 256, view.size, dtype=np.uint8)
    stamps = view.reshape(-1, block_size)[:, :8]
    stamps[:] = np.arange(stamps.shape[0], dtype=np.uint64).view(np.uint8).reshape(-1, 8)


def run_batches(submit, items: list, batch_blocks: int) -> float:  # type: ignore[no-untyped-def]
    """Submit items in batches with IN_FLIGHT outstanding; return seconds until all complete."""
    start = time.perf_counter()
    pending: deque = deque()
    for lo in range(0, len(items), batch_blocks):
        pending.append(submit(items[lo : lo + batch_blocks]))
        if len(pending) > IN_FLIGHT:
            check(pending.popleft().wait(600))
    while pending:
        check(pending.popleft().wait(600))
    return time.perf_counter() - start


def check(results: list) -> None:  # type: ignore[type-arg]
    bad = [r for r in results if not r.ok]
    if bad:
        raise SystemExit(f"bench: {len(bad)} blocks failed, first: {bad[0]!r}")


def raw_io(path: Path, pool: HostPool, nbytes: int, write: bool) -> float:
    mv = pool.memoryview()
    flags = os.O_RDWR | os.O_DIRECT | (os.O_CREAT if write else 0)
    fd = os.open(path, flags, 0o644)
    try:
        if write:
            os.posix_fallocate(fd, 0, nbytes)
        start = time.perf_counter()
        for off in range(0, nbytes, RAW_CHUNK):
            chunk = mv[off : off + RAW_CHUNK]
            n = os.pwrite(fd, chunk, off) if write else os.preadv(fd, [chunk], off)
            if n != len(chunk):
                raise SystemExit(f"raw I/O short at {off}: {n}")
        return time.perf_counter() - start
    finally:
        os.close(fd)
        mv.release()


def bench_block_size(
    directory: Path, block_size: int, nbytes: int, args: argparse.Namespace
) -> dict:
    nblocks = nbytes // block_size
    nbytes = nblocks * block_size
    pool = HostPool(2 * nbytes)
    view = np.frombuffer(pool.memoryview(), np.uint8)
    fill_unique(view[:nbytes], block_size, seed=block_size)
    batch_blocks = max(1, (64 * MiB) // block_size)

    keys = [b"bench/%d/%d" % (block_size, i) for i in range(nblocks)]
    puts = [(k, (pool.address + i * block_size, block_size)) for i, k in enumerate(keys)]
    gets = [(k, (pool.address + nbytes + i * block_size, block_size)) for i, k in enumerate(keys)]
    capacity = nbytes + nblocks * 4096 + 64 * MiB
    # Alternate baseline and ours each repetition; keep the best of each (disk noise).
    raw_w = raw_r = ours_w = ours_r = float("inf")
    engine = ""
    for rep in range(args.repeat):
        raw_path = directory / "raw-baseline.dat"
        raw_w = min(raw_w, raw_io(raw_path, pool, nbytes, write=True))
        store_dir = directory / f"store-{block_size}-{rep}"
        store_dir.mkdir()
        store = BlockStore(
            str(store_dir), capacity, io_engine=args.engine, queue_depth=args.queue_depth
        )
        ours_w = min(ours_w, run_batches(store.submit_put, puts, batch_blocks))
        raw_r = min(raw_r, raw_io(raw_path, pool, nbytes, write=False))
        view[nbytes:] = 0
        ours_r = min(ours_r, run_batches(store.submit_get, gets, batch_blocks))
        if not np.array_equal(view[:nbytes], view[nbytes:]):
            raise SystemExit("bench: data read back differs from data written")
        engine = store.io_engine
        store.close()
        shutil.rmtree(store_dir)
        raw_path.unlink()
    del view
    pool.close()

    gb = nbytes / 1e9
    row = {
        "block_size": block_size,
        "blocks": nblocks,
        "bytes": nbytes,
        "engine": engine,
        "repeat": args.repeat,
        "write_gbps": gb / ours_w,
        "read_gbps": gb / ours_r,
        "raw_write_gbps": gb / raw_w,
        "raw_read_gbps": gb / raw_r,
    }
    row["write_ratio"] = row["write_gbps"] / row["raw_write_gbps"]
    row["read_ratio"] = row["read_gbps"] / row["raw_read_gbps"]
    return row


def bench_dedup(directory: Path) -> float:
    """Store 256 distinct 64 KiB blocks twice under different keys: physical / logical bytes."""
    d = directory / "store-dedup"
    d.mkdir()
    block = 64 * 1024
    data = np.random.default_rng(7).integers(0, 256, 256 * block, dtype=np.uint8).tobytes()
    with BlockStore(str(d), 64 * MiB) as store:
        for copy in range(2):
            items = [(b"d%d/%d" % (copy, i), data[i * block : (i + 1) * block]) for i in range(256)]
            check(store.submit_put(items).wait(60))
        s = store.stats()
    shutil.rmtree(d)
    return float(s["physical_bytes"]) / float(s["logical_bytes"])


def bench_recovery(directory: Path, nblocks: int) -> dict:
    """Time reopening a store of `nblocks` 64 KiB blocks after a clean close, and after a kill
    (a copy of the directory taken while the store is open: the journal is not compacted)."""
    d = directory / "store-recovery"
    d.mkdir()
    block = 64 * 1024
    pool = HostPool(256 * block)
    view = np.frombuffer(pool.memoryview(), np.uint8)
    fill_unique(view, block, seed=3)
    store = BlockStore(str(d), nblocks * (block + 4096) + 64 * MiB)
    for lo in range(0, nblocks, 256):
        n = min(256, nblocks - lo)
        items = [(b"r%d" % (lo + i), (pool.address + i * block, block)) for i in range(n)]
        check(store.submit_put(items).wait(600))
    crashed = directory / "store-recovery-crashed"
    shutil.copytree(d, crashed, ignore=shutil.ignore_patterns("flexkv.lock"))
    store.close()
    timings = {}
    for name, path in (("clean", d), ("crash", crashed)):
        start = time.perf_counter()
        reopened = BlockStore(str(path), nblocks * (block + 4096) + 64 * MiB)
        timings[f"recovery_{name}_s"] = time.perf_counter() - start
        assert len(reopened) == nblocks, (name, len(reopened))
        reopened.close()
    del view
    pool.close()
    shutil.rmtree(d)
    shutil.rmtree(crashed)
    return {"recovery_blocks": nblocks, **timings}


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--dir",
        type=Path,
        default=None,
        help="directory on the disk to test (default: a temp dir under ./)",
    )
    p.add_argument("--gib", type=float, default=4.0, help="GiB per block size (default 4)")
    p.add_argument("--block-sizes", default="2M,64K", help="comma list, e.g. 2M,1M,64K")
    p.add_argument("--engine", default="auto", choices=["auto", "io_uring", "psync"])
    p.add_argument("--queue-depth", type=int, default=64)
    p.add_argument(
        "--repeat", type=int, default=3, help="alternating repetitions; best of each is kept"
    )
    p.add_argument("--quick", action="store_true", help="0.5 GiB per block size (< 30 s)")
    p.add_argument("--json", action="store_true", help="print one final JSON line")
    args = p.parse_args()
    gib = 0.5 if args.quick else args.gib
    if args.quick:
        args.repeat = 1
    sizes = [
        int(s[:-1]) * (MiB if s.endswith("M") else 1024) if s[-1] in "MK" else int(s)
        for s in args.block_sizes.split(",")
    ]

    base = Path(tempfile.mkdtemp(prefix="flexkv-ssd-bench-", dir=args.dir or Path.cwd()))
    try:
        rows = []
        for size in sizes:
            row = bench_block_size(base, size, int(gib * (1 << 30)), args)
            rows.append(row)
            print(
                f"{size // 1024:>6} KiB blocks ({row['engine']}): "
                f"write {row['write_gbps']:.2f} GB/s (raw {row['raw_write_gbps']:.2f}, "
                f"ratio {row['write_ratio']:.2f})  read {row['read_gbps']:.2f} GB/s "
                f"(raw {row['raw_read_gbps']:.2f}, ratio {row['read_ratio']:.2f})",
                file=sys.stderr if args.json else sys.stdout,
            )
        recovery = bench_recovery(base, 4096 if args.quick else 65536)
        print(
            f"recovery of {recovery['recovery_blocks']} blocks: clean reopen "
            f"{recovery['recovery_clean_s']:.3f} s, "
            f"after a kill {recovery['recovery_crash_s']:.3f} s",
            file=sys.stderr if args.json else sys.stdout,
        )
        dedup = bench_dedup(base)
        print(
            f"dedup: physical/logical bytes with every block stored twice = {dedup:.3f}",
            file=sys.stderr if args.json else sys.stdout,
        )
    finally:
        shutil.rmtree(base, ignore_errors=True)
    if args.json:
        head = rows[0]  # the largest-block row carries the headline figures
        out = {
            k: head[k]
            for k in (
                "write_gbps",
                "read_gbps",
                "raw_write_gbps",
                "raw_read_gbps",
                "write_ratio",
                "read_ratio",
            )
        }
        out.update(
            dedup_physical_bytes_ratio=dedup,
            **recovery,
            rows=rows,
            gib_per_size=gib,
            host=platform.node(),
            date=time.strftime("%Y-%m-%d"),
        )
        print(json.dumps(out))


if __name__ == "__main__":
    main()
