"""What `restore_vs_recompute.py` measures a restore against, in the same run: a contiguous
pinned H2D memcpy of the same bytes and a raw O_DIRECT read of them; and its clock (every
timing CUDA-synchronized on both ends)."""

from __future__ import annotations

import mmap
import os
import statistics
import time
from pathlib import Path

import torch
from cuda_clock import Clock

RAW_CHUNK = 8 << 20


def memcpy_h2d(nbytes: int, cuda: bool, reps: int) -> float:
    """Median seconds of one contiguous pinned host -> device copy of nbytes."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda" if cuda else "cpu")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
    host.fill_(1)
    clock = Clock(cuda)
    clock.time(lambda: dev.copy_(host, non_blocking=True))  # warm-up
    t = statistics.median(
        clock.time(lambda: dev.copy_(host, non_blocking=True))[0] for _ in range(reps)
    )
    return t


def raw_odirect_read(directory: Path, nbytes: int) -> tuple[float, bool]:
    """Write nbytes, then read them back sequentially (8 MiB preadv) with O_DIRECT when the file
    system allows it: (seconds of the read, whether O_DIRECT was used)."""
    path = directory / "raw-read.dat"
    buf = mmap.mmap(-1, RAW_CHUNK)  # page-aligned, as O_DIRECT needs
    buf.write(os.urandom(RAW_CHUNK))
    direct = True
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o644)
    except OSError:  # e.g. tmpfs: no O_DIRECT
        direct = False
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        total = -(-nbytes // RAW_CHUNK) * RAW_CHUNK
        for off in range(0, total, RAW_CHUNK):
            os.pwrite(fd, buf, off)
        os.fsync(fd)
        if not direct:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        t0 = time.perf_counter()
        for off in range(0, total, RAW_CHUNK):
            if os.preadv(fd, [buf], off) != RAW_CHUNK:
                raise SystemExit(f"raw read short at {off}")
        return (time.perf_counter() - t0) * nbytes / total, direct
    finally:
        os.close(fd)
        path.unlink()
