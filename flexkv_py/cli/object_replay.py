"""`flexkv-py replay --object-store URL --workers N`: N worker processes share one bucket
prefix, the way a fleet's replicas would. Each takes every N-th request of the workload, asks
`lookup_chain` how much of its prompt the bucket holds, loads those blocks (checking every byte)
and stores the rest with its chain. Reported against one shared cache of unbounded size fed the
same requests in order: the hit rate, the stored copies per logical block (conditional creates:
one), racing uploads that lost (their body was sent, then refused), and lookup requests per
matched block and per miss.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import sys
from dataclasses import dataclass
from typing import Any

from flexkv_py import _native
from flexkv_py.cli.object_args import add_object_args
from flexkv_py.cli.workloads import Workload
from flexkv_py.errors import FlexKVError

REQUEST_STATS = ("get_requests", "head_requests", "put_requests", "list_requests")


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("object store (--object-store: workers share one bucket prefix)")
    add_object_args(g, required=False)  # type: ignore[arg-type]
    g.add_argument("--workers", type=int, default=8, help="worker processes (default 8)")
    g.add_argument("--object-block-kib", type=int, default=4, help="bytes stored per block")


@dataclass(frozen=True)
class WorkerArgs:
    url: str
    native: dict[str, Any]
    index: int
    workers: int
    block_bytes: int
    requests: list[tuple[tuple[bytes, ...], tuple[bytes, ...]]]  # (keys, contents)


def block_bytes(content: bytes, size: int) -> bytearray:
    seed = hashlib.blake2b(content, digest_size=32).digest()
    return bytearray((seed * (size // 32 + 1))[:size])


def _requests(tier: _native.ObjectTier) -> int:
    stats = tier.stats()
    return sum(int(stats[name]) for name in REQUEST_STATS)


def worker(a: WorkerArgs) -> dict[str, Any]:
    tier = _native.ObjectTier(a.url, **a.native)
    out = {"blocks": 0, "hits": 0, "mismatches": 0, "load_errors": 0, "hit_lookups": 0,
           "hit_lookup_requests": 0, "miss_lookups": 0, "miss_lookup_requests": 0,
           "max_miss_lookup_requests": 0}  # fmt: skip
    for keys, contents in a.requests[a.index :: a.workers]:
        before = _requests(tier)
        matched = tier.lookup_chain(list(keys))
        cost = _requests(tier) - before
        out["blocks"] += len(keys)
        out["hits"] += matched
        if matched:
            out["hit_lookups"] += 1
            out["hit_lookup_requests"] += cost
        else:
            out["miss_lookups"] += 1
            out["miss_lookup_requests"] += cost
            out["max_miss_lookup_requests"] = max(out["max_miss_lookup_requests"], cost)
        bufs = [bytearray(a.block_bytes) for _ in range(matched)]
        got = tier.submit_get(list(zip(keys[:matched], bufs, strict=True))).wait(600)
        for r, buf, content in zip(got, bufs, contents, strict=False):
            if not r.ok:
                out["load_errors"] += 1
            elif buf != block_bytes(content, a.block_bytes):
                out["mismatches"] += 1
        items = [(k, block_bytes(c, a.block_bytes)) for k, c in zip(keys, contents, strict=True)]
        tier.submit_put(items[matched:], chain=list(keys)).wait(600)
    stats = tier.stats()
    for name in ("puts_ok", "puts_exists", "puts_known", "puts_claimed", "put_body_bytes",
                 *REQUEST_STATS):  # fmt: skip
        out[name] = int(stats[name])
    tier.close()
    return out


def shared_cache_hits(workload: Workload) -> int:
    """Hits of one unbounded shared cache fed the requests in order (prefix matches)."""
    seen: set[bytes] = set()
    hits = 0
    for r in workload.requests:
        n = 0
        while n < len(r.keys) and r.keys[n] in seen:
            n += 1
        hits += n
        seen.update(r.keys)
    return hits


def run(args: argparse.Namespace, workload: Workload) -> int:
    if args.workers < 1 or args.object_block_kib < 1:
        print("flexkv-py replay: --workers and --object-block-kib must be >= 1", file=sys.stderr)
        return 2
    native: dict[str, Any] = {"allow_http": args.allow_http}
    if args.endpoint:
        native["endpoint"] = args.endpoint
    if args.region:
        native["region"] = args.region
    requests = [(r.keys, r.contents) for r in workload.requests]
    jobs = [
        WorkerArgs(
            args.object_store, native, i, args.workers, args.object_block_kib << 10, requests
        )
        for i in range(args.workers)
    ]
    try:
        with mp.get_context("spawn").Pool(args.workers) as pool:
            parts = pool.map(worker, jobs)
        probe = _native.ObjectTier(args.object_store, **native)
        stored = probe.inspect().get("blocks", 0)
        probe.close()
    except FlexKVError as e:
        print(f"flexkv-py replay: {e}", file=sys.stderr)
        return 2
    total = {k: sum(p[k] for p in parts) for k in parts[0] if not k.startswith("max_")}
    total["max_miss_lookup_requests"] = max(p["max_miss_lookup_requests"] for p in parts)
    unique = workload.unique_blocks
    result = {
        "workload": workload.name,
        "workers": args.workers,
        "requests": len(requests),
        "blocks": total["blocks"],
        "unique_blocks": unique,
        "hit_rate": total["hits"] / max(1, total["blocks"]),
        "shared_cache_hit_rate": shared_cache_hits(workload) / max(1, workload.num_blocks),
        "stored_blocks": stored,
        "stored_copies_per_block": stored / max(1, unique),
        "created_per_block": total["puts_ok"] / max(1, unique),
        "racing_uploads_refused": total["puts_exists"],
        # Racing writers that sent no body: another worker's claim and manifest covered it.
        "racing_uploads_skipped": total["puts_claimed"],
        "put_body_bytes_per_unique_block": total["put_body_bytes"] / max(1, unique),
        "lookup_requests_per_matched_block": total["hit_lookup_requests"] / max(1, total["hits"]),
        "lookup_requests_per_hit_request": total["hit_lookup_requests"]
        / max(1, total["hit_lookups"]),
        "lookup_requests_per_miss": total["miss_lookup_requests"] / max(1, total["miss_lookups"]),
        "max_lookup_requests_per_miss": total["max_miss_lookup_requests"],
        "load_errors": total["load_errors"],
        "mismatches": total["mismatches"],
    }
    if args.json:
        print(json.dumps(result))
    else:
        for name, value in result.items():
            shown = f"{value:.4f}" if isinstance(value, float) else value
            print(f"{name:34} {shown}")
    if total["mismatches"]:
        print(f"flexkv-py replay: {total['mismatches']} blocks had wrong KV bytes", file=sys.stderr)
        return 1
    return 0
