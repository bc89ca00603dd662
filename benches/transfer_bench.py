"""GPU <-> host transfer bench: our batched engines vs one copy_ per page vs the memcpy ceiling.

Qwen3-8B-like caches (36 layers, 8 KV heads, head 128, bf16, 16-token blocks), N scattered blocks,
D2H and H2D, in one run:
  * ceiling   - one contiguous pinned memcpy of the same number of bytes (copy engine);
  * per_page  - one ``copy_`` per layer page (what a naive connector does);
  * ours      - TransferEngine with each backend (Triton UVA configs, cuMemcpyBatchAsync, torch).
Every engine's round trip is checked bit-exact (D2H src -> slots, H2D slots -> other blocks).
Also times allocating + pinning a large host pool.

Layouts: "FA" = legacy FlashAttention (2, B, N, H, D) per layer: 32 KiB K and V pages per layer;
"LBNHC" = vLLM 0.33 default (K+V of a layer: one 64 KiB run); "BLNHC" = block-outermost (one
2.25 MiB run per block).

On a machine without CUDA it runs the torch path on CPU tensors with small sizes.
Usage: python benches/transfer_bench.py [--json] [--blocks 4000] [--layouts FA,LBNHC]
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from cuda_clock import Clock
from kv_caches import make_caches  # the tier and coordinator benches import it from here
from transfer_summary import summary

from flexkv_py.tiers.host_pool import GIB, HostPool
from flexkv_py.transfer import TransferEngine, describe_kv_caches
from flexkv_py.transfer.kv_layout import KVPageGeometry

log = logging.getLogger("transfer_bench")

TRITON_CONFIGS = [  # (programs, tile bytes, warps); programs=0: one program per tile
    (8, 16384, 8),
    (8, 32768, 16),
    (8, 32768, 32),
    (0, 16384, 8),
]


def ceiling(pool: HostPool, nbytes: int, device: str, clock: Clock, reps: int) -> dict[str, float]:
    """One contiguous copy of nbytes between device memory and the (pinned) pool."""
    host = pool.tensor.view(-1)[:nbytes]
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    d2h = clock.median(lambda: host.copy_(dev, non_blocking=True), reps)
    h2d = clock.median(lambda: dev.copy_(host, non_blocking=True), reps)
    return {"d2h_gbps": nbytes / d2h / 1e9, "h2d_gbps": nbytes / h2d / 1e9}


def per_page(
    geom: KVPageGeometry, pool: HostPool, ids: list[int], slots: list[int], clock: Clock
) -> dict[str, float]:
    """Baseline: one copy_ per (block, layer page), as a naive connector does."""
    views = [
        geom.storages[s.storage].as_strided(
            (geom.num_blocks, s.nbytes), (s.block_stride, 1), s.gpu_offset
        )
        for s in geom.segments
    ]
    nbytes = len(ids) * geom.page_nbytes
    stream = torch.cuda.Stream() if clock.cuda else None

    def run(d2h: bool) -> None:
        ctx = torch.cuda.stream(stream) if stream is not None else _nullctx()
        with ctx:
            for g, s in zip(ids, slots, strict=True):
                row = pool.tensor[s]
                for seg, view in zip(geom.segments, views, strict=True):
                    h = row[seg.host_offset : seg.host_offset + seg.nbytes]
                    if d2h:
                        h.copy_(view[g], non_blocking=True)
                    else:
                        view[g].copy_(h, non_blocking=True)

    d2h = clock.median(lambda: run(True), 1)
    h2d = clock.median(lambda: run(False), 1)
    return {
        "d2h_gbps": nbytes / d2h / 1e9,
        "h2d_gbps": nbytes / h2d / 1e9,
        "copies_per_dir": len(ids) * len(geom.segments),
    }


class _nullctx:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def check_round_trip(
    caches: dict[str, torch.Tensor],
    eng: TransferEngine,
    src: list[int],
    dst: list[int],
    slots: list[int],
    legacy: bool,
) -> bool:
    """D2H src -> slots, poison dst, H2D slots -> dst; dst must equal src bit for bit."""
    pool = eng.pool
    pool.tensor[slots[0]].fill_(0x5A)
    eng.submit_d2h(src, slots).wait()
    dev = next(iter(caches.values())).device
    dst_t = torch.tensor(dst, device=dev)
    src_t = torch.tensor(src, device=dev)
    for t in caches.values():
        if legacy:
            t.index_fill_(1, dst_t, -3.0)
        else:
            t.index_fill_(0, dst_t, -3.0)
    eng.submit_h2d(slots, dst).wait()
    ok = True
    for t in caches.values():
        a = t.index_select(1 if legacy else 0, dst_t).view(torch.int16)
        b = t.index_select(1 if legacy else 0, src_t).view(torch.int16)
        ok = ok and bool(torch.equal(a, b))
    return ok


def bench_engine(
    caches: dict[str, torch.Tensor],
    pool: HostPool,
    backend: str,
    src: list[int],
    dst: list[int],
    slots: list[int],
    clock: Clock,
    reps: int,
    legacy: bool,
    **kw: Any,
) -> dict[str, Any]:
    eng = TransferEngine(caches, pool, backend=backend, **kw)
    nbytes = len(src) * eng.geometry.page_nbytes
    ok = check_round_trip(caches, eng, src, dst, slots, legacy)  # also warms up (JIT, pinning)
    d2h = clock.median(lambda: eng.submit_d2h(src, slots).wait(), reps)
    h2d = clock.median(lambda: eng.submit_h2d(slots, dst).wait(), reps)
    sms = eng.sms_used
    paths = {d: p.name for d, p in eng.backend.items()}
    eng.close()
    return {
        "backend": backend,
        **{k: v for k, v in kw.items()},
        "bit_exact": ok,
        "d2h_gbps": nbytes / d2h / 1e9,
        "h2d_gbps": nbytes / h2d / 1e9,
        "sms_used": sms["d2h"],
        "h2d_sms_used": sms["h2d"],
        "d2h_path": paths["d2h"],
        "h2d_path": paths["h2d"],
    }


def bench_layout(layout: str, args: argparse.Namespace, clock: Clock) -> dict[str, Any]:
    device = "cuda" if clock.cuda else "cpu"
    n = args.blocks
    total_blocks = 2 * n + 7
    caches = make_caches(
        layout, args.layers, total_blocks, args.heads, args.head_size, args.block_size, device
    )
    geom = describe_kv_caches(caches)
    gen = torch.Generator().manual_seed(0)
    perm = torch.randperm(total_blocks, generator=gen).tolist()
    src, dst = perm[:n], perm[n : 2 * n]
    slots = torch.randperm(n, generator=gen).tolist()
    t0 = time.perf_counter()
    pool = HostPool(n, geom.slot_nbytes)
    pool_s = time.perf_counter() - t0
    nbytes = n * geom.page_nbytes
    res: dict[str, Any] = {
        "layout": geom.layout,
        "blocks": n,
        "page_nbytes": geom.page_nbytes,
        "runs_per_block": len(geom.segments),
        "run_nbytes": sorted({s.nbytes for s in geom.segments}),
        "bytes_per_dir": nbytes,
        "pool_backing": pool.backing,
        "pool_pinned": pool.pinned,
        "pool_build_s": pool_s,
    }
    log.info(
        "%s: %d blocks x %d B pages = %.2f GiB per direction, runs %s",
        geom.layout,
        n,
        geom.page_nbytes,
        nbytes / GIB,
        res["run_nbytes"],
    )
    res["ceiling"] = ceiling(pool, nbytes, device, clock, args.reps)
    log.info("  ceiling  %s", _fmt(res["ceiling"]))
    nb = min(n, args.baseline_blocks)
    res["per_page"] = per_page(geom, pool, src[:nb], slots[:nb], clock)
    res["per_page"]["blocks"] = nb
    log.info("  per_page %s (%d blocks)", _fmt(res["per_page"]), nb)
    legacy = layout == "FA"
    engines: list[dict[str, Any]] = []
    configs: list[tuple[str, dict[str, Any]]] = [("torch", {})]
    if clock.cuda:
        configs = [
            ("auto", {}),
            ("staged", {"staged_chunk_pages": 16}),
            ("staged", {"staged_chunk_pages": 32}),
            ("staged", {"staged_chunk_pages": 32, "copy_engine_prefer_overlap": False}),
            ("staged", {"staged_chunk_pages": 64}),
            ("staged", {"staged_chunk_pages": 128}),
            ("copy_engine", {}),
            ("copy_engine", {"copy_engine_prefer_overlap": False}),
        ]
        configs += [
            ("triton", {"triton_programs": p, "triton_tile_bytes": t, "triton_warps": w})
            for p, t, w in TRITON_CONFIGS
        ]
        if args.with_torch_gpu:
            configs.append(("torch", {}))
    for backend, kw in configs:
        try:
            r = bench_engine(caches, pool, backend, src, dst, slots, clock, args.reps, legacy, **kw)
        except Exception as e:  # report and keep going: one broken path must not hide the rest
            log.exception("  %s %s failed", backend, kw)
            r = {"backend": backend, **kw, "error": repr(e)}
        engines.append(r)
        log.info("  %-11s %s %s", backend, _fmt(r), {k: v for k, v in kw.items()})
    res["engines"] = engines
    pool.close()
    del caches, geom
    gc.collect()
    if clock.cuda:
        torch.cuda.empty_cache()
    return res


def _fmt(r: dict[str, Any]) -> str:
    if "error" in r:
        return f"ERROR {r['error']}"
    extra = f" exact={r['bit_exact']} sms={r['sms_used']}" if "bit_exact" in r else ""
    return f"D2H {r['d2h_gbps']:6.2f} GB/s  H2D {r['h2d_gbps']:6.2f} GB/s{extra}"


def bench_pinning(gib: float, variants: list[str], cuda: bool) -> list[dict[str, Any]]:
    out = []
    slot = 2 * 1024 * 1024 + 256 * 1024  # Qwen3-8B-like block page (2.25 MiB)
    for v in variants:
        backing, threads = v.split(":")
        try:
            t0 = time.perf_counter()
            pool = HostPool.from_cache_gb(
                gib, slot, backing=backing, pin=cuda, register_threads=int(threads)
            )
            total = time.perf_counter() - t0
            r = {
                "variant": v,
                "gib": pool.nbytes / GIB,
                "total_s": total,
                "allocate_s": pool.timings.allocate_s,
                "touch_s": pool.timings.touch_s,
                "pin_s": pool.timings.pin_s,
                "pinned": pool.pinned,
            }
            t1 = time.perf_counter()
            pool.close()
            r["close_s"] = time.perf_counter() - t1
        except Exception as e:
            log.exception("pinning %s failed", v)
            r = {"variant": v, "error": repr(e)}
        log.info("pool %s", r)
        out.append(r)
        gc.collect()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cuda = torch.cuda.is_available()
    p.add_argument("--json", action="store_true", help="print one final JSON line")
    p.add_argument("--blocks", type=int, default=4000 if cuda else 256)
    p.add_argument("--layers", type=int, default=36 if cuda else 8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-size", type=int, default=128)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--layouts", default="FA,LBNHC")
    p.add_argument("--reps", type=int, default=5 if cuda else 3)
    p.add_argument("--baseline-blocks", type=int, default=1000 if cuda else 64)
    p.add_argument("--pin-gib", type=float, default=64 if cuda else 1)
    p.add_argument("--pin-variants", default="mmap:4,native:4,mmap:1")
    p.add_argument("--with-torch-gpu", action="store_true")
    p.add_argument("--out", default=os.environ.get("OUT"), help="folder for full JSON results")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)
    clock = Clock(cuda)
    log.info(
        "device: %s, torch %s", torch.cuda.get_device_name() if cuda else "cpu", torch.__version__
    )
    layouts = [bench_layout(lay, args, clock) for lay in args.layouts.split(",") if lay]
    variants = [v for v in args.pin_variants.split(",") if v]
    try:
        from flexkv_py import _native  # noqa: F401
    except ImportError:
        variants = [v for v in variants if not v.startswith("native")]
        log.info("flexkv_py._native not importable: pool pinning with the mmap backing only")
    pin = bench_pinning(args.pin_gib, variants, cuda) if args.pin_gib > 0 else []
    out = summary(layouts, pin, cuda)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "transfer_bench_full.json").write_text(
            json.dumps({"layouts": layouts, "pinning": pin, "summary": out}, indent=1, default=str)
        )
    print("\n== summary ==")
    for k, v in out.items():
        if k != "engines":
            print(f"{k:20s} {v}")
    for k, v in out.get("engines", {}).items():
        print(f"  {k:48s} {v}")
    if args.json:
        print(json.dumps(out, default=str))


if __name__ == "__main__":
    main()
