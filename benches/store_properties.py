"""BlockStore properties ssd_bench reports beside throughput: the dedup ratio of blocks stored
twice, and the reopen time after a clean close and after a kill."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import numpy as np
from ssd_paths import MiB, check, fill_unique

from flexkv_py._native import BlockStore, HostPool


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
