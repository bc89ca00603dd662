"""SSD tier bench: our block store vs vLLM 0.33's filesystem tier vs raw sequential O_DIRECT,
side by side on the same directory, the same blocks and the same host buffers, in the same run.

Paths (each run measures all of them back to back on the same data; the order rotates by run):
  ours   BlockStore `submit_put`/`submit_get` of unique blocks from a page-aligned host pool,
         64 MiB batches, 4 in flight beyond the one being waited on (io_uring, `--queue-depth`).
  vllm   vLLM's fs tier I/O (`vllm.v1.kv_offload.tiering.fs.io.batch_store_block` /
         `batch_load_block`, its C extension when installed), driven as `FileSystemTierManager`
         drives it: one task per job on its `DualQueueThreadPool` with the default 16 read +
         16 write threads, file per block (`FileMapper` names, tmp file + rename), O_DIRECT when
         `probe_o_direct` says the directory takes it (the tier's default).
  raw    the same bytes with raw sequential O_DIRECT `pwrite`/`preadv` of 8 MiB chunks (QD1).
Durability: no path flushes (no fsync/fdatasync): ours runs `durability=process` (acknowledged
after the O_DIRECT data write and the journal append), vLLM's store never fsyncs (write, close,
rename), raw never fsyncs. Reads are O_DIRECT on all three paths (no page cache). Before every
timed phase the bench runs os.sync() and waits for an idle disk (untimed; `--no-settle` skips).
vLLM's block files are kept until the end (disk: runs x sizes x `--gib` GiB for them).
Per phase it also prints CPU seconds of this process per GB and bytes the disk moved per payload
byte (from /sys/dev/block/*/stat; other users of the disk count too).

`--coordinator-reads` adds read variants of ours on the same store, to compare with how the
coordinator (flexkv_py.coordinator) issues an SSD load:
  ours_1batch  every block in one `submit_get`, waited: what the executor does for a load
               staged through SSD (one job, one SSD `tier_batch`: 9dbf3f4, and again since d51fbd4)
  ours_parts   the load split in parts of 64 blocks doubling to 1024, at most 4 parts
               outstanding (the executor's 4 workers): what b3e0524 did for every load (d51fbd4
               keeps parts for host-memory loads only)
  ours_coord   ours_1batch after a reopen (as after a restart) with `iouring_entries` = 512, into
               LIFO-ordered host slots, items built and results checked per block in Python

Prints the median and min-max of `--runs` paired runs (GB/s and per-run ratios); `--json` ends
with one JSON line.

    python3 benches/ssd_bench.py [--quick] [--json] [--dir DIR] [--gib N] [--runs 5]
        [--sizes 64K,256K,2M] [--no-vllm] [--coordinator-reads] [--engine io_uring]

Beside it: ssd_paths.py (how each path moves the bytes), disk_stats.py (disk sectors, settle),
store_properties.py (dedup ratio, reopen time), ssd_report.py (the text rows).
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import shutil
import statistics
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from disk_stats import disk_sectors, disk_stat_file, settle
from ssd_paths import (
    PATHS,
    MiB,
    VllmFs,
    check,
    fill_unique,
    load_vllm,
    pipeline_parts,
    raw_io,
    run_batches,
)
from ssd_report import print_row
from store_properties import bench_dedup, bench_recovery

from flexkv_py._native import BlockStore, HostPool

BATCH_BYTES = 64 * MiB
COORD_QUEUE_DEPTH = 512  # flexkv_py.config default `iouring_entries`
EXECUTOR_WORKERS = 4  # flexkv_py.coordinator.executor.JobExecutor max_workers


# --- one block size ------------------------------------------------------------------------------


def stats_of(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def bench_block_size(
    directory: Path, block_size: int, nbytes: int, args: argparse.Namespace, vllm: VllmFs | None
) -> dict:
    nblocks = nbytes // block_size
    nbytes = nblocks * block_size
    pool = HostPool(2 * nbytes)
    mv = pool.memoryview()
    view = np.frombuffer(mv, np.uint8)
    src, dst = view[:nbytes], view[nbytes:]
    fill_unique(src, block_size, seed=block_size)
    batch_blocks = max(1, BATCH_BYTES // block_size)
    job_blocks = max(1, (args.vllm_job_mib * MiB) // block_size)

    keys = [b"bench/%d/%d" % (block_size, i) for i in range(nblocks)]
    puts = [(k, (pool.address + i * block_size, block_size)) for i, k in enumerate(keys)]
    gets = [(k, (pool.address + nbytes + i * block_size, block_size)) for i, k in enumerate(keys)]
    capacity = nbytes + nblocks * 4096 + 64 * MiB
    paths = [p for p in PATHS if p != "vllm" or vllm is not None]
    times: dict[str, list[float]] = {}
    cpu: dict[str, list[float]] = {}  # CPU seconds of this process (all threads) per phase
    disk: dict[str, list[float]] = {}
    stat = disk_stat_file(directory)
    meta: dict[str, Any] = {"engine": "", "vllm_o_direct": None}

    def timed(name: str, fn: Callable[[], float]) -> None:
        if not args.no_settle:
            settle(directory)
        before = resource.getrusage(resource.RUSAGE_SELF)
        sectors = disk_sectors(stat)
        times.setdefault(name, []).append(fn())
        moved = [b - a for a, b in zip(sectors, disk_sectors(stat), strict=True)]
        after = resource.getrusage(resource.RUSAGE_SELF)
        used = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
        cpu.setdefault(name, []).append(used)
        # Bytes the disk moved in the phase's direction per payload byte (header pages, etc.).
        disk.setdefault(name, []).append(moved[name.endswith("_write")] * 512 / nbytes)

    def read_check(name: str, fn: Callable[[], float], reverse: bool = False) -> None:
        dst[:] = 0
        timed(name, fn)
        got = dst.reshape(nblocks, block_size)[::-1].reshape(-1) if reverse else dst
        if not np.array_equal(src, got):
            raise SystemExit(f"bench: {name}: data read back differs from data written")

    def one_run(run: int) -> None:
        """Every path writes, then every path reads, in an order rotated by run; all on the same
        source and destination halves of the pool, into fresh files / a fresh store."""
        order = paths[run % len(paths) :] + paths[: run % len(paths)]
        raw_path = directory / "raw-baseline.dat"
        store_dir = directory / f"store-{block_size}-{run}"
        store_dir.mkdir()
        store = BlockStore(
            str(store_dir), capacity, io_engine=args.engine, queue_depth=args.queue_depth
        )
        meta["engine"] = store.io_engine
        vroot = directory / f"vllm-fs-{block_size}-{run}"
        jobs_w: list[tuple[list[str], list[int]]] = []
        jobs_r: list[tuple[list[str], list[int]]] = []
        o_direct = False
        if vllm is not None:
            vpaths, o_direct = vllm.layout(vroot, nblocks, block_size, run)
            meta["vllm_o_direct"] = o_direct
            for lo in range(0, nblocks, job_blocks):
                hi = min(nblocks, lo + job_blocks)
                jobs_w.append((vpaths[lo:hi], [i * block_size for i in range(lo, hi)]))
                jobs_r.append((vpaths[lo:hi], [nbytes + i * block_size for i in range(lo, hi)]))

        def vllm_run(load: bool) -> float:
            assert vllm is not None
            return vllm.run(load, jobs_r if load else jobs_w, mv, block_size, o_direct)

        writers: dict[str, Callable[[], float]] = {
            "ours": lambda: run_batches(store.submit_put, puts, batch_blocks),
            "raw": lambda: raw_io(raw_path, pool, nbytes, write=True),
            "vllm": lambda: vllm_run(False),
        }
        readers: dict[str, Callable[[], float]] = {
            "ours": lambda: run_batches(store.submit_get, gets, batch_blocks),
            "raw": lambda: raw_io(raw_path, pool, nbytes, write=False),
            "vllm": lambda: vllm_run(True),
        }
        try:
            for p in order:
                timed(f"{p}_write", writers[p])
            for p in order:
                read_check(f"{p}_read", readers[p])
            if args.coordinator_reads:
                store = coordinator_reads(store, store_dir)
        finally:
            store.close()
            shutil.rmtree(store_dir)
            raw_path.unlink(missing_ok=True)
            # vLLM's block files stay until the bench ends: on ext4 without a journal (the dev
            # VM's disk) creating files within 60 s of deleting thousands scans past every
            # recently deleted inode (fs/ext4/ialloc.c recently_deleted), which would slow the
            # next vLLM write by our own cleanup.

    def coordinator_reads(store: BlockStore, store_dir: Path) -> BlockStore:
        def one_batch() -> float:
            start = time.perf_counter()
            check(store.submit_get(gets).wait(600))
            return time.perf_counter() - start

        read_check("ours_1batch_read", one_batch)

        def parts() -> float:
            # Parts (b3e0524; d51fbd4: host-memory loads only): one job per part, all submitted
            # at once; the executor's 4 worker threads each run one part's submit_get and wait.
            start = time.perf_counter()
            pending: deque = deque()
            for lo, hi in pipeline_parts(nblocks):
                if len(pending) == EXECUTOR_WORKERS:
                    check(pending.popleft().wait(600))
                pending.append(store.submit_get(gets[lo:hi]))
            while pending:
                check(pending.popleft().wait(600))
            return time.perf_counter() - start

        read_check("ours_parts_read", parts)
        store.close()  # reopened as after a restart, with the coordinator's queue depth
        store = BlockStore(
            str(store_dir), capacity, io_engine=args.engine, queue_depth=args.coord_qd
        )
        last = pool.address + nbytes + (nblocks - 1) * block_size

        def coordinator() -> float:
            # JobBodies.tier_batch: items from the job's keys and slots, one batch, waited, each
            # result checked (ok and length). Staging slots come off a LIFO free list.
            start = time.perf_counter()
            items = [(k, (last - i * block_size, block_size)) for i, k in enumerate(keys)]
            results = store.submit_get(items).wait(600)
            bad = [r for r in results if not r.ok or r.nbytes != block_size]
            if bad:
                raise SystemExit(f"bench: coordinator-style read: {len(bad)} blocks failed")
            return time.perf_counter() - start

        read_check("ours_coord_read", coordinator, reverse=True)
        return store

    try:
        for run in range(args.runs):
            one_run(run)
    finally:
        pool.close()  # unmaps even while numpy views exist; none is used after this

    gb = nbytes / 1e9
    row: dict[str, Any] = {
        "block_size": block_size,
        "blocks": nblocks,
        "bytes": nbytes,
        "engine": meta["engine"],
        "runs": args.runs,
        "queue_depth": args.queue_depth,
    }
    if vllm is not None:
        row.update(
            vllm_o_direct=meta["vllm_o_direct"],
            vllm_c_ext=vllm.has_c,
            vllm_threads=[vllm.read_threads, vllm.write_threads],
            vllm_job_blocks=job_blocks,
        )
    for name, secs in times.items():
        rates = [gb / s for s in secs]
        s = stats_of(rates)
        row[f"{name}_gbps"] = s["median"]
        row[f"{name}_gbps_min"] = s["min"]
        row[f"{name}_gbps_max"] = s["max"]
        row[f"{name}_gbps_runs"] = rates
        row[f"{name}_cpu_s_per_gb"] = statistics.median(c / gb for c in cpu[name])
        row[f"{name}_disk_bytes_ratio"] = statistics.median(disk[name])

    def ratio(key: str, num: str, den: str) -> None:
        if num in times and den in times:
            per_run = [d / n for n, d in zip(times[num], times[den], strict=True)]  # paired
            s = stats_of(per_run)
            row[key], row[f"{key}_min"], row[f"{key}_max"] = s["median"], s["min"], s["max"]

    for d in ("write", "read"):
        ratio(f"{d}_ratio", f"ours_{d}", f"raw_{d}")
        ratio(f"{d}_vs_vllm", f"ours_{d}", f"vllm_{d}")
        ratio(f"vllm_{d}_ratio", f"vllm_{d}", f"raw_{d}")
    for v in ("ours_1batch", "ours_parts", "ours_coord"):
        ratio(f"{v}_read_ratio", f"{v}_read", "raw_read")
        ratio(f"{v}_vs_pipelined", f"{v}_read", "ours_read")
    # Back-compatible names (raw_*_gbps already are): the medians of ours.
    for d in ("write", "read"):
        row[f"{d}_gbps"] = row[f"ours_{d}_gbps"]
    return row


def parse_sizes(text: str) -> list[int]:
    return [
        int(s[:-1]) * (MiB if s[-1] in "Mm" else 1024) if s[-1] in "MKmk" else int(s)
        for s in text.split(",")
    ]


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
    p.add_argument("--gib", type=float, default=1.0, help="GiB per block size (default 1)")
    p.add_argument(
        "--sizes",
        "--block-sizes",
        dest="sizes",
        default="64K,256K,2M",
        help="comma list of block sizes, e.g. 64K,256K,2M (default)",
    )
    p.add_argument("--engine", default="auto", choices=["auto", "io_uring", "psync"])
    p.add_argument("--queue-depth", type=int, default=64, help="ours: io_uring entries")
    p.add_argument(
        "--runs",
        "--repeat",
        dest="runs",
        type=int,
        default=5,
        help="paired runs (each measures every path on the same data); median and min-max",
    )
    p.add_argument("--no-vllm", action="store_true", help="skip vLLM's fs tier")
    p.add_argument("--vllm-read-threads", type=int, default=16, help="vLLM default: 16")
    p.add_argument("--vllm-write-threads", type=int, default=16, help="vLLM default: 16")
    p.add_argument(
        "--vllm-job-mib",
        type=int,
        default=16,
        help="MiB of blocks per vLLM job (one request's store/load: one task on its pool)",
    )
    p.add_argument(
        "--coordinator-reads",
        action="store_true",
        help="also read the way the coordinator's executor does (one batch, QD 512, LIFO slots)",
    )
    p.add_argument("--coord-qd", type=int, default=COORD_QUEUE_DEPTH)
    p.add_argument(
        "--no-settle",
        action="store_true",
        help="do not sync and wait for an idle disk before each timed phase",
    )
    p.add_argument("--quick", action="store_true", help="0.25 GiB per size, one run (< 1 min)")
    p.add_argument("--json", action="store_true", help="print one final JSON line")
    args = p.parse_args()
    gib = 0.25 if args.quick else args.gib
    if args.quick:
        args.runs = 1
    sizes = parse_sizes(args.sizes)
    out = sys.stderr if args.json else sys.stdout

    vllm = load_vllm(args, out)
    base = Path(tempfile.mkdtemp(prefix="flexkv-ssd-bench-", dir=args.dir or Path.cwd()))
    try:
        rows = []
        for size in sizes:
            row = bench_block_size(base, size, int(gib * (1 << 30)), args, vllm)
            rows.append(row)
            print_row(row, out)
        recovery = bench_recovery(base, 4096 if args.quick else 65536)
        print(
            f"recovery of {recovery['recovery_blocks']} blocks: clean reopen "
            f"{recovery['recovery_clean_s']:.3f} s, "
            f"after a kill {recovery['recovery_crash_s']:.3f} s",
            file=out,
        )
        dedup = bench_dedup(base)
        print(
            f"dedup: physical/logical bytes with every block stored twice = {dedup:.3f}", file=out
        )
    finally:
        shutil.rmtree(base, ignore_errors=True)
        if vllm is not None:
            vllm.close()
    if args.json:
        head = max(rows, key=lambda r: r["block_size"])  # the largest-block row: headline figures
        keys = (
            "write_gbps",
            "read_gbps",
            "raw_write_gbps",
            "raw_read_gbps",
            "write_ratio",
            "read_ratio",
            "vllm_write_gbps",
            "vllm_read_gbps",
            "write_vs_vllm",
            "read_vs_vllm",
        )
        result: dict[str, Any] = {k: head.get(k) for k in keys}
        result.update(
            dedup_physical_bytes_ratio=dedup,
            **recovery,
            rows=rows,
            gib_per_size=gib,
            runs=args.runs,
            durability="none flushed: ours durability=process, vLLM fs no fsync, raw no fsync",
            vllm=vllm is not None,
            host=platform.node(),
            date=time.strftime("%Y-%m-%d"),
        )
        print(json.dumps(result))


if __name__ == "__main__":
    main()
