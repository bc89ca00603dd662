"""How each path of ssd_bench moves the bytes: ours (BlockStore batches, a few in flight),
raw sequential O_DIRECT, vLLM 0.33's fs tier I/O driven as its `FileSystemTierManager` drives
it, and the coordinator's split of a load in parts; plus the unique block data they all move."""

from __future__ import annotations

import argparse
import functools
import hashlib
import os
import time
from collections import deque
from pathlib import Path
from typing import Any

import numpy as np

from flexkv_py._native import HostPool

MiB = 1 << 20
RAW_CHUNK = 8 * MiB
IN_FLIGHT = 4  # batches submitted ahead of the one being waited on
PATHS = ("ours", "vllm", "raw")


def fill_unique(view: np.ndarray, block_size: int, seed: int) -> None:
    """Random bytes, plus a unique stamp per block so dedup never kicks in."""
    rng = np.random.default_rng(seed)
    view[:] = rng.integers(0, 256, view.size, dtype=np.uint8)
    stamps = view.reshape(-1, block_size)[:, :8]
    stamps[:] = np.arange(stamps.shape[0], dtype=np.uint64).view(np.uint8).reshape(-1, 8)


def check(results: list) -> None:  # type: ignore[type-arg]
    bad = [r for r in results if not r.ok]
    if bad:
        raise SystemExit(f"bench: {len(bad)} blocks failed, first: {bad[0]!r}")


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
