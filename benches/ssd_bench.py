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
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import os
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

from flexkv_py._native import BlockStore, HostPool

MiB = 1 << 20
RAW_CHUNK = 8 * MiB
IN_FLIGHT = 4  # batches submitted ahead of the one being waited on
BATCH_BYTES = 64 * MiB
COORD_QUEUE_DEPTH = 512  # flexkv_py.config default `iouring_entries`
EXECUTOR_WORKERS = 4  # flexkv_py.coordinator.executor.JobExecutor max_workers
PATHS = ("ours", "vllm", "raw")


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


def disk_stat_file(path: Path) -> Path | None:
    st = os.stat(path)
    stat = Path(f"/sys/dev/block/{os.major(st.st_dev)}:{os.minor(st.st_dev)}/stat")
    return stat if stat.exists() else None


def disk_sectors(stat: Path | None) -> tuple[int, int]:
    """(sectors read, sectors written) so far on the disk (all its users)."""
    if stat is None:
        return (0, 0)
    f = stat.read_text().split()
    return (int(f[2]), int(f[6]))


def settle(path: Path, quiet: float = 0.25, timeout: float = 5.0) -> None:
    """Outside the timed region: flush what earlier phases left dirty (os.sync, which also commits
    the filesystem journal and its online discards), then wait until the disk has been idle for
    `quiet` seconds, so no path pays for another's deferred work."""
    os.sync()
    stat = disk_stat_file(path)
    if stat is None:
        return
    start = last_change = time.perf_counter()
    last = stat.read_text().split()
    while time.perf_counter() - start < timeout:
        time.sleep(0.05)
        cur = stat.read_text().split()
        if cur[9] != last[9] or cur[8] != "0":  # io_ticks moved, or requests in flight
            last_change = time.perf_counter()
        last = cur
        if time.perf_counter() - last_change >= quiet:
            return


def pipeline_parts(n: int, first: int = 64, most: int = 1024) -> list[tuple[int, int]]:
    """The coordinator's split of a load in parts (flexkv_py.coordinator.engine.pipeline_parts):
    parts of 64 blocks doubling to 1024, no runt part at the end."""
    parts, start, size = [], 0, first
    while start < n:
        end = min(n, start + size)
        if n - end < size // 2:
            end = n
        parts.append((start, end))
        start, size = end, min(2 * size, most)
    return parts


def raw_io(path: Path, pool: HostPool, nbytes: int, write: bool) -> float:
    mv = pool.memoryview()
    flags = os.O_RDWR | os.O_DIRECT | (os.O_CREAT if write else 0)
    fd = os.open(path, flags, 0o644)
    try:
        if write:
            os.posix_fallocate(fd, 0, nbytes)
        # Reads land in the second half of the pool, like every other path's.
        base = 0 if write else nbytes
        start = time.perf_counter()
        for off in range(0, nbytes, RAW_CHUNK):
            chunk = mv[base + off : base + min(off + RAW_CHUNK, nbytes)]
            n = os.pwrite(fd, chunk, off) if write else os.preadv(fd, [chunk], off)
            if n != len(chunk):
                raise SystemExit(f"raw I/O short at {off}: {n}")
        return time.perf_counter() - start
    finally:
        os.close(fd)
        mv.release()


# --- vLLM 0.33's fs tier -------------------------------------------------------------------------


class VllmFs:
    """vLLM's fs tier I/O, driven like `FileSystemTierManager`: one job per `batch_*_block` call,
    enqueued on its `DualQueueThreadPool` (both thread groups drain either queue), completion by
    `wait_idle` + `get_finished`."""

    def __init__(self, read_threads: int, write_threads: int) -> None:
        from vllm.v1.kv_offload.base import make_offload_key
        from vllm.v1.kv_offload.file_mapper import FileMapper
        from vllm.v1.kv_offload.tiering.fs import io as fs_io
        from vllm.v1.kv_offload.tiering.fs.thread_pool import DualQueueThreadPool

        self.io = fs_io
        self.file_mapper = FileMapper
        self.make_key = make_offload_key
        self.has_c = bool(fs_io._HAS_FSIO_C)
        self.read_threads, self.write_threads = read_threads, write_threads
        self.pool = DualQueueThreadPool(read_threads, write_threads, "vllm_kv_py_fs")
        self.next_job = 0

    def layout(self, root: Path, nblocks: int, block_size: int, tag: int) -> tuple[list[str], bool]:
        """Block file names as the tier names them, and whether it would use O_DIRECT there."""
        fm = self.file_mapper(
            root_dir=str(root),
            model_name="flexkv-bench/ssd",
            tokens_per_hash=16,
            blocks_per_file=1,
            tp_size=1,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            rank=0,
            dtype="bfloat16",
            parallel_agnostic=True,
        )
        config_dir = os.path.dirname(fm.get_config_file_path())
        os.makedirs(config_dir, exist_ok=True)
        paths = [
            fm.get_file_name(
                self.make_key(hashlib.sha256(b"%d/%d/%d" % (block_size, tag, i)).digest(), 0)
            )
            for i in range(nblocks)
        ]
        return paths, bool(self.io.probe_o_direct(config_dir))

    def run(
        self,
        load: bool,
        jobs: list[tuple[list[str], list[int]]],
        view: memoryview,
        block_size: int,
        o_direct: bool,
    ) -> float:
        fn = self.io.batch_load_block if load else self.io.batch_store_block
        enqueue = self.pool.enqueue_load if load else self.pool.enqueue_store
        first = self.next_job
        start = time.perf_counter()
        for paths, offsets in jobs:
            task = functools.partial(fn, paths, view, offsets, block_size, o_direct)
            enqueue(self.next_job, 1, [task])
            self.next_job += 1
        self.pool.wait_idle()
        seconds = time.perf_counter() - start
        ok = {job for job, success, _ in self.pool.get_finished() if success}
        if ok != set(range(first, self.next_job)):
            raise SystemExit(f"bench: vLLM fs {'load' if load else 'store'}: jobs failed")
        return seconds

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def load_vllm(args: argparse.Namespace, out: Any) -> VllmFs | None:
    if args.no_vllm:
        return None
    try:
        return VllmFs(args.vllm_read_threads, args.vllm_write_threads)
    except ImportError as e:
        print(f"vLLM fs tier not importable ({e}); its column is skipped", file=out)
        return None


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


def fmt(row: dict, key: str) -> str:
    if key not in row:
        return "-"
    lo, hi = row.get(f"{key}_min"), row.get(f"{key}_max")
    if lo is None or row["runs"] == 1:
        return f"{row[key]:.2f}"
    return f"{row[key]:.2f} [{lo:.2f}-{hi:.2f}]"


def print_row(row: dict, out: Any) -> None:
    print(
        f"{row['block_size'] // 1024:>6} KiB blocks ({row['engine']}, {row['blocks']} blocks, "
        f"{row['runs']} run(s): median [min-max])",
        file=out,
    )
    for d in ("write", "read"):
        print(
            f"    {d:<5} GB/s  ours {fmt(row, f'ours_{d}_gbps')}  vllm {fmt(row, f'vllm_{d}_gbps')}"
            f"  raw {fmt(row, f'raw_{d}_gbps')}  |  ours/vllm {fmt(row, f'{d}_vs_vllm')}"
            f"  ours/raw {fmt(row, f'{d}_ratio')}",
            file=out,
        )
        cpu = "  ".join(
            f"{p} {row[f'{p}_{d}_cpu_s_per_gb']:.2f}" for p in PATHS if f"{p}_{d}_gbps" in row
        )
        moved = "  ".join(
            f"{p} {row[f'{p}_{d}_disk_bytes_ratio']:.3f}" for p in PATHS if f"{p}_{d}_gbps" in row
        )
        print(f"          CPU s/GB (this process, all threads): {cpu}", file=out)
        print(f"          disk bytes / payload bytes: {moved}", file=out)
    for v, label in (
        ("ours_1batch", "ours, one batch"),
        ("ours_parts", "ours, coordinator parts"),
        ("ours_coord", "ours, one batch, QD 512, restart"),
    ):
        if f"{v}_read_gbps" in row:
            print(
                f"    read  {label}: {fmt(row, f'{v}_read_gbps')} GB/s, "
                f"/raw {fmt(row, f'{v}_read_ratio')}, /ours {fmt(row, f'{v}_vs_pipelined')}",
                file=out,
            )


# --- dedup, recovery -----------------------------------------------------------------------------


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
