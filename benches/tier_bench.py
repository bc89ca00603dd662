"""End-to-end tier bench: the whole stack (CacheEngine: manager + executor + host pool + transfer
engine + SSD BlockStore) on vLLM-shaped KV caches, against the hardware ceilings, in one run.

Phases (N scattered blocks of a Qwen3-8B-like cache, LBNHC, 2.25 MiB per block):
  store      GPU -> host (write-through to SSD)     vs  contiguous pinned D2H memcpy
  load_host  host -> GPU                            vs  contiguous pinned H2D memcpy
  load_ssd   SSD -> host -> GPU, after a restart    vs  raw sequential O_DIRECT read, same disk
             (a file written for it), and the same reader over the store's own data file
Every loaded block is checked bit-exact against what was stored. Each phase runs --reps times
(default 5 on CUDA), each run paired with its baseline measured right before it (the store-file
read: right after the load, over the same bytes), so drift of the machine (clocks, a neighbour)
moves both sides of one ratio; the ratio printed is the median of the paired ratios, with their
range. `--json` ends with one JSON line. Without CUDA it runs on CPU tensors with small sizes.

    python3 benches/tier_bench.py [--blocks 2000] [--reps 5] [--json] [--ssd-dir DIR] [--quick]
                                  [--iouring-entries N]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from transfer_bench import make_caches

from flexkv_py.cli.inspect import DATA_FILE
from flexkv_py.config import load_config
from flexkv_py.coordinator import CacheEngine
from flexkv_py.index.namespace import Namespace
from flexkv_py.index.tier_names import Tier
from flexkv_py.tiers.ssd.tier import SsdTier

RAW_CHUNK = 8 << 20
STORE_PAGE = 4096  # the store's superblock, and each block's header page


def sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


class MemcpyCeiling:
    """One contiguous pinned D2H and H2D copy of nbytes, timed on demand (buffers made once)."""

    def __init__(self, nbytes: int, cuda: bool) -> None:
        self.cuda = cuda
        self.dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda" if cuda else "cpu")
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=cuda)
        for src, dst in ((self.dev, self.host), (self.host, self.dev)):
            dst.copy_(src, non_blocking=True)  # warm-up
        sync(cuda)

    def _seconds(self, src: torch.Tensor, dst: torch.Tensor) -> float:
        sync(self.cuda)
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        sync(self.cuda)
        return time.perf_counter() - t0

    def d2h(self) -> float:
        return self._seconds(self.dev, self.host)

    def h2d(self) -> float:
        return self._seconds(self.host, self.dev)


class RawDisk:
    """Sequential O_DIRECT reads of nbytes from `offset` of one file, on demand."""

    def __init__(self, path: Path, nbytes: int, *, offset: int = 0, owned: bool = False) -> None:
        """`owned`: created here (`written`), and deleted by close(); else read only, left."""
        import mmap

        self.nbytes, self.path, self.offset, self.owned = nbytes, path, offset, owned
        self.buf = mmap.mmap(-1, RAW_CHUNK)  # page-aligned, as O_DIRECT needs
        flags = os.O_RDWR | os.O_CREAT if owned else os.O_RDONLY
        self.fd = os.open(path, flags | os.O_DIRECT, 0o600)

    @classmethod
    def written(cls, directory: Path, nbytes: int) -> RawDisk:
        """A new file of nbytes in `directory`, written once with O_DIRECT and fsynced."""
        disk = cls(directory / "raw-read.dat", nbytes, owned=True)
        disk.buf.write(os.urandom(RAW_CHUNK))
        for off in range(0, nbytes, RAW_CHUNK):
            os.pwrite(disk.fd, disk.buf, off)
        os.fsync(disk.fd)
        return disk

    def read_seconds(self) -> float:
        t0 = time.perf_counter()
        view = memoryview(self.buf)
        for off in range(0, self.nbytes, RAW_CHUNK):
            os.preadv(self.fd, [view[: min(RAW_CHUNK, self.nbytes - off)]], self.offset + off)
        view.release()
        return time.perf_counter() - t0

    def close(self) -> None:
        os.close(self.fd)
        self.buf.close()
        if self.owned:
            self.path.unlink()


def raw_disk_read(directory: Path, nbytes: int) -> float:
    """Write then read nbytes sequentially with O_DIRECT; seconds of the read."""
    disk = RawDisk.written(directory, nbytes)
    try:
        return disk.read_seconds()
    finally:
        disk.close()


def paired(ours: list[float], base: list[float]) -> tuple[float, float, float]:
    """Median, min and max of base/ours over paired runs (seconds: a ratio of speeds)."""
    ratios = sorted(b / o for o, b in zip(ours, base, strict=True))
    return statistics.median(ratios), ratios[0], ratios[-1]


def bench_blocks(
    model: str, tokens: int, page: int, n: int, total_blocks: int
) -> tuple[Namespace, list[int], list[int], list[int], list[bytes]]:
    """The benches' namespace; `n` source, `n` destination and the remaining (spare) block ids,
    scattered over the cache (a seeded permutation, as vLLM's allocator leaves them); the keys."""
    ns = Namespace(
        model=model,
        revision=None,
        kv_dtype="bfloat16",
        kv_layout="LBNHC",
        block_size=tokens,
        page_bytes=page,
    )
    g = torch.Generator().manual_seed(0)
    perm = torch.randperm(total_blocks, generator=g).tolist()
    keys = ns.keys([b"%032x" % i for i in range(n)])
    return ns, perm[:n], perm[n : 2 * n], perm[2 * n :], keys


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--blocks", type=int, default=2000)
    p.add_argument("--ssd-dir", type=Path, default=None)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", action="store_true")
    p.add_argument("--reps", type=int, default=None, help="paired runs per phase (5; --quick: 2)")
    p.add_argument(
        "--iouring-entries",
        type=int,
        default=None,
        help="the SSD tier's queue depth (config iouring_entries; default the config's)",
    )
    args = p.parse_args()
    cuda = torch.cuda.is_available()
    reps = args.reps or (2 if args.quick or not cuda else 5)
    if reps < 1:
        p.error(f"--reps must be >= 1, got {reps}")
    out = sys.stderr if args.json else sys.stdout
    if cuda and not args.quick:
        layers, heads, head, tokens, n = 36, 8, 128, 16, args.blocks
    else:  # CPU: the same path on a small cache
        layers, heads, head, tokens, n = 4, 2, 64, 16, 128
    total_blocks = 2 * n + 8
    device = "cuda" if cuda else "cpu"
    caches = make_caches("LBNHC", layers, total_blocks, heads, head, tokens, device)
    page = layers * heads * tokens * 2 * head * 2
    nbytes = n * page

    base = Path(tempfile.mkdtemp(prefix="flexkv-tier-bench-", dir=args.ssd_dir or Path.cwd()))

    def config(admission: str, directory: Path):  # type: ignore[no-untyped-def]
        values = {
            "cpu_cache_gb": 1.25 * (n + 16) * (page + 4096) / 2**30,  # all of N fit
            "ssd_cache_gb": 2.5 * (n + 16) * (page + 8192) / 2**30,
            "ssd_cache_dir": str(directory),
            "admission": admission,
        }
        if args.iouring_entries is not None:
            values["iouring_entries"] = args.iouring_entries
        return load_config(values, env={})

    (base / "wb").mkdir(mode=0o700)
    (base / "wt").mkdir(mode=0o700)
    # write_back (default): a store is the GPU->host copy; SSD writes happen on eviction.
    cfg = config("write_back", base / "wb")
    # write_through: every store also lands on SSD (used to fill the SSD for the restart phase).
    cfg_wt = config("write_through", base / "wt")
    ns, src_ids, dst_ids, spare, keys = bench_blocks(
        "bench/qwen3-8b-like", tokens, page, n, total_blocks
    )

    def block_bytes(ids: list[int]) -> list[torch.Tensor]:
        return [
            torch.cat([c[i].reshape(-1) for c in caches.values()]).view(torch.uint8) for i in ids
        ]

    def clear_dst() -> None:
        for c in caches.values():
            c[dst_ids] = 0
        sync(cuda)

    def verify() -> int:
        a, b = block_bytes(src_ids), block_bytes(dst_ids)
        return sum(not torch.equal(x, y) for x, y in zip(a, b, strict=True))

    results: dict[str, float | int | str | bool] = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "blocks": n,
        "page_bytes": page,
        "reps": reps,
        "iouring_entries": cfg_wt.iouring_entries,
        "host_mismatches": 0,
        "ssd_mismatches": 0,
    }
    # Seconds per run: ours and the baseline measured right before it.
    t: dict[str, list[float]] = {
        k: [] for k in ("store", "d2h", "host", "h2d", "ssd", "raw", "raw_store")
    }

    def timed_load(engine: CacheEngine, tier: str) -> None:
        """Load every block into the destination blocks, all from `tier`; time it, check it."""
        t0 = time.perf_counter()
        outcome = engine.load(keys, dst_ids)
        sync(cuda)
        t[tier].append(time.perf_counter() - t0)
        assert outcome.ok and set(outcome.source_tiers) == {tier}, outcome.source_tiers[:5]
        results[f"{tier}_mismatches"] += verify()

    try:
        memcpy = MemcpyCeiling(nbytes, cuda)
        engine = CacheEngine.from_kv_caches(cfg, ns, caches)
        results["pinned"] = bool(getattr(engine.pool, "pinned", False))
        ssd = engine.executor.tiers.get(Tier.SSD)
        results["ssd_io_engine"] = ssd.io_engine if isinstance(ssd, SsdTier) else "none"
        # Warm-up on spare blocks: Triton compiles its gather/scatter kernels on first use.
        warm = ns.keys([b"warm-%d" % i for i in range(len(spare))])
        assert engine.store(warm, spare).ok and engine.load(warm, spare).ok
        for rep in range(reps):
            if rep:
                engine.reset()  # an empty host tier again: the next store copies every block
            t["d2h"].append(memcpy.d2h())
            sync(cuda)
            t0 = time.perf_counter()
            outcome = engine.store(keys, src_ids)
            t["store"].append(time.perf_counter() - t0)
            assert outcome.ok, outcome.failed_indices()[:5]

            clear_dst()
            t["h2d"].append(memcpy.h2d())
            timed_load(engine, "host")
        engine.close()
        del memcpy

        # Fill an SSD tier (write-through), then restart before each load: that engine's host
        # tier is empty, so every block comes from the SSD.
        engine = CacheEngine.from_kv_caches(cfg_wt, ns, caches)
        assert engine.store(keys, src_ids).ok
        engine.close()
        with contextlib.ExitStack() as stack:
            disk = RawDisk.written(base, nbytes)
            stack.callback(disk.close)
            # The same raw reader over the store's own data file, exactly the bytes a load reads
            # (blocks lie in order from its second page, each with its header page): whether
            # the gap to `raw` is lost by the read path or lies in where the bytes are.
            (data_file,) = (base / "wt").rglob(DATA_FILE)  # in the shard's subdirectory
            store_file = RawDisk(data_file, n * (page + STORE_PAGE), offset=STORE_PAGE)
            stack.callback(store_file.close)
            for _ in range(reps):
                engine = CacheEngine.from_kv_caches(cfg_wt, ns, caches)
                assert engine.lookup(keys) == n
                clear_dst()
                t["raw"].append(disk.read_seconds())
                timed_load(engine, "ssd")
                engine.close()
                t["raw_store"].append(store_file.read_seconds())

        # Spill path (not timed): a host tier of a quarter of the blocks, so stores must first
        # copy evicted blocks to SSD (the chained-copy path on a side stream); then everything
        # loads back from host + SSD, bit-exact.
        (base / "spill").mkdir(mode=0o700)
        small = load_config(
            {
                "cpu_cache_gb": (n // 4 + 16) * (page + 4096) / 2**30,
                "ssd_cache_gb": 2.5 * (n + 16) * (page + 8192) / 2**30,
                "ssd_cache_dir": str(base / "spill"),
            },
            env={},
        )
        engine = CacheEngine.from_kv_caches(small, ns, caches)
        chunk = max(1, n // 8)  # each store and load fits the small host tier
        for lo in range(0, n, chunk):
            assert engine.store(keys[lo : lo + chunk], src_ids[lo : lo + chunk]).ok
        engine.flush()
        clear_dst()
        sources: set[str] = set()
        loaded = 0
        for lo in range(0, n, chunk):
            outcome = engine.load(keys[lo : lo + chunk], dst_ids[lo : lo + chunk])
            loaded += outcome.num_ok
            sources.update(outcome.source_tiers)
        sync(cuda)
        results["spill_load_ok"] = loaded
        results["spill_sources"] = ",".join(sorted(sources))
        results["spill_mismatches"] = verify() if loaded == n else -1
        engine.close()

    finally:
        shutil.rmtree(base, ignore_errors=True)

    gb = nbytes / 1e9  # payload; the store-file read covers the load's bytes, headers included
    for name, key in (
        ("store_gbps", "store"),
        ("load_host_gbps", "host"),
        ("load_ssd_gbps", "ssd"),
        ("memcpy_d2h_gbps", "d2h"),
        ("memcpy_h2d_gbps", "h2d"),
        ("raw_disk_read_gbps", "raw"),
        ("raw_store_file_gbps", "raw_store"),
    ):
        results[name] = gb / statistics.median(t[key])  # the median run's speed
    for name, ours, base_key in (
        ("store_ratio", "store", "d2h"),
        ("load_host_ratio", "host", "h2d"),
        ("load_ssd_ratio", "ssd", "raw"),
        ("load_ssd_vs_store_file_ratio", "ssd", "raw_store"),
    ):
        results[name], results[name + "_min"], results[name + "_max"] = paired(t[ours], t[base_key])
    r = results
    rows = [
        ("store GPU->host", "store_gbps", "memcpy D2H", "memcpy_d2h_gbps", "store_ratio"),
        ("load host->GPU", "load_host_gbps", "memcpy H2D", "memcpy_h2d_gbps", "load_host_ratio"),
        ("load SSD->GPU", "load_ssd_gbps", "raw disk", "raw_disk_read_gbps", "load_ssd_ratio"),
        (
            "  same",
            "load_ssd_gbps",
            "store file",
            "raw_store_file_gbps",
            "load_ssd_vs_store_file_ratio",
        ),
    ]
    print(
        f"{n} blocks x {page / 2**20:.2f} MiB on {r['device']} (pinned={r['pinned']}, "
        f"ssd={r['ssd_io_engine']})",
        file=out,
    )
    print(
        f"  {reps} paired runs per phase: median GB/s; ratio = median [min-max] of the pairs",
        file=out,
    )
    for name, ours, base_name, base, ratio in rows:
        print(
            f"  {name:<16} {r[ours]:6.2f} GB/s  vs {base_name:<10} {r[base]:6.2f}  ratio "
            f"{r[ratio]:.3f} [{r[ratio + '_min']:.3f}-{r[ratio + '_max']:.3f}]",
            file=out,
        )
    print(f"  mismatched blocks: host {r['host_mismatches']}, ssd {r['ssd_mismatches']}", file=out)
    if args.json:
        print(json.dumps(results))
    print(
        f"  spill path: {r['spill_load_ok']}/{n} loaded from {r['spill_sources']}, "
        f"mismatches {r['spill_mismatches']}",
        file=out,
    )
    if results["host_mismatches"] or results["ssd_mismatches"] or results["spill_mismatches"]:
        raise SystemExit("tier bench: loaded KV differs from stored KV")


if __name__ == "__main__":
    main()
