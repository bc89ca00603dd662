"""Object-tier bench: N blocks up and down through our `ObjectTier` vs a plain obstore loop and
boto3, at the same concurrency, against the same local SeaweedFS
(tests/helpers/s3_server.py), in the same run.

  ours    `_native.ObjectTier.submit_put` / `submit_get` of all N blocks in one batch (header +
          content hash per object, conditional create, verified reads).
  obstore `obstore.put_async` / `get_async` of the raw blocks, N coroutines under an
          asyncio.Semaphore(concurrency) (no header, no verification, plain puts);
          obstore_create: the same with `mode="create"` (conditional creates, as ours).
  boto3   `put_object` / `get_object` from a ThreadPoolExecutor(concurrency).

Throughput is payload GB/s (block bytes, not object bytes). A second, counted pass goes through a
counting proxy (tests/helpers/s3_proxy.py CountingProxy) to report requests per block for our
put and get, and for a duplicate store by a second worker: the lookup (`contains_many`) requests per
matched block and the body bytes it uploads per deduplicated block (goal: 0). A chain pass
stores one `--chain-blocks` prompt with its manifests and counts `lookup_chain` requests per
matched block (goal <= 0.1 for 8192 blocks) and per miss, and a second writer's body bytes. A
racing pass has 2, 4 and 8 writers store one new chain at once (upload claims: racing bodies 0).

    python3 benches/object_bench.py [--quick] [--json] [--blocks 512] [--block-kib 256]
        [--concurrency 32] [--runs 3] [--chain-blocks 8192]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flexkv_py import _native
from tests.helpers.s3_proxy import CountingProxy
from tests.helpers.s3_server import S3Server, start_server

Mark = tuple[float, float]  # (wall seconds, this process's CPU seconds: every thread)
Marks = tuple[Mark, Mark, Mark]  # before the puts, between puts and gets, after the gets


def mark() -> Mark:
    return time.perf_counter(), time.process_time()


def make_blocks(n: int, size: int) -> list[tuple[bytes, bytearray]]:
    seed = os.urandom(size)
    out = []
    for i in range(n):
        data = bytearray(seed)
        data[:8] = i.to_bytes(8, "little")
        out.append((f"bench/{i:06d}".encode(), data))
    return out


def our_tier(s3: S3Server, prefix: str, concurrency: int, endpoint: str | None = None) -> Any:
    return _native.ObjectTier(
        f"s3://{s3.bucket}/{prefix}",
        endpoint=endpoint or s3.endpoint,
        region=s3.region,
        access_key_id=s3.access_key_id,
        secret_access_key=s3.secret_access_key,
        allow_http=True,
        concurrency=concurrency,
        timeout_s=30.0,
    )


def run_ours(s3: S3Server, blocks: list[tuple[bytes, bytearray]], conc: int) -> Marks:
    tier = our_tier(s3, f"ours-{uuid.uuid4().hex[:8]}", conc)
    t0 = mark()
    put = tier.submit_put(blocks).wait(600)
    t1 = mark()
    outs = [bytearray(len(d)) for _, d in blocks]
    got = tier.submit_get([(k, o) for (k, _), o in zip(blocks, outs, strict=True)]).wait(600)
    t2 = mark()
    assert all(r.status == "ok" for r in put), put[:3]
    assert all(r.status == "ok" for r in got) and outs[-1] == blocks[-1][1]
    return t0, t1, t2


def run_obstore(
    s3: S3Server,
    blocks: list[tuple[bytes, bytearray]],
    conc: int,
    mode: Literal["create", "overwrite"] = "overwrite",
) -> Marks:
    import obstore
    from obstore.store import S3Store

    store = S3Store(
        s3.bucket,
        prefix=f"obstore-{uuid.uuid4().hex[:8]}",
        endpoint=s3.endpoint,
        region=s3.region,
        access_key_id=s3.access_key_id,
        secret_access_key=s3.secret_access_key,
        virtual_hosted_style_request=False,
        client_options={"allow_http": True, "timeout": "30s"},
    )

    async def go() -> tuple[Marks, bytes]:
        sem = asyncio.Semaphore(conc)

        async def put(k: bytes, d: bytearray) -> None:
            async with sem:
                await obstore.put_async(store, k.decode(), bytes(d), mode=mode)

        async def get(k: bytes) -> bytes:
            async with sem:
                r = await obstore.get_async(store, k.decode())
                return bytes(await r.bytes_async())

        t0 = mark()
        await asyncio.gather(*(put(k, d) for k, d in blocks))
        t1 = mark()
        got = await asyncio.gather(*(get(k) for k, _ in blocks))
        t2 = mark()
        return (t0, t1, t2), got[-1]

    marks, last = asyncio.run(go())
    assert last == blocks[-1][1]
    return marks


def run_boto3(s3: S3Server, blocks: list[tuple[bytes, bytearray]], conc: int) -> Marks:
    import boto3
    from botocore.config import Config

    client = boto3.client(
        "s3",
        endpoint_url=s3.endpoint,
        aws_access_key_id=s3.access_key_id,
        aws_secret_access_key=s3.secret_access_key,
        region_name=s3.region,
        config=Config(s3={"addressing_style": "path"}, max_pool_connections=conc),
    )
    prefix = f"boto3-{uuid.uuid4().hex[:8]}"
    with ThreadPoolExecutor(conc) as pool:
        t0 = mark()
        list(
            pool.map(
                lambda kd: client.put_object(
                    Bucket=s3.bucket, Key=f"{prefix}/{kd[0].decode()}", Body=bytes(kd[1])
                ),
                blocks,
            )
        )
        t1 = mark()
        got = list(
            pool.map(
                lambda kd: client.get_object(Bucket=s3.bucket, Key=f"{prefix}/{kd[0].decode()}")[
                    "Body"
                ].read(),
                blocks,
            )
        )
        t2 = mark()
    assert got[-1] == blocks[-1][1]
    return t0, t1, t2


def counted_pass(
    s3: S3Server, blocks: list[tuple[bytes, bytearray]], conc: int
) -> dict[str, float]:
    """Requests per block and body bytes per deduplicated block, measured at a proxy."""
    n = len(blocks)
    proxy = CountingProxy(s3.ports["s3"])
    try:
        prefix = f"counted-{uuid.uuid4().hex[:8]}"
        first = our_tier(s3, prefix, conc, proxy.endpoint)
        proxy.reset()
        assert all(r.ok for r in first.submit_put(blocks).wait(600))
        put_req, put_body = proxy.snapshot()
        outs = [bytearray(len(d)) for _, d in blocks]
        proxy.reset()
        assert all(
            r.ok
            for r in first.submit_get(list(zip([k for k, _ in blocks], outs, strict=True))).wait(
                600
            )
        )
        get_req, _ = proxy.snapshot()
        second = our_tier(s3, prefix, conc, proxy.endpoint)
        proxy.reset()
        found = second.contains_many([k for k, _ in blocks])
        look_req, _ = proxy.snapshot()
        proxy.reset()
        dup = second.submit_put(blocks).wait(600)
        dup_req, dup_body = proxy.snapshot()
        assert all(found) and all(r.status == "deduped" for r in dup)
        payload = sum(len(d) for _, d in blocks)
        return {
            "put_requests_per_block": sum(put_req.values()) / n,
            "put_body_bytes_per_payload_byte": sum(put_body.values()) / payload,
            "get_requests_per_block": sum(get_req.values()) / n,
            "lookup_requests_per_matched_block": sum(look_req.values()) / n,
            "dup_put_requests_per_block": sum(dup_req.values()) / n,
            "dup_body_bytes_per_block": sum(dup_body.values()) / n,
        }
    finally:
        proxy.close()


def chain_pass(s3: S3Server, n: int, conc: int) -> dict[str, float]:
    """Lookups through the chain manifests of one `n`-block prompt (requests at a proxy): the
    prompt again, a prefix ending inside a segment, the prompt continued, a new prompt, and a
    second writer of the same chain."""
    keys = [hashlib.sha256(b"chain-%d" % i).digest() for i in range(n)]
    items = [(k, bytearray(k * 8)) for k in keys]
    proxy = CountingProxy(s3.ports["s3"])
    out: dict[str, float] = {"chain_blocks": n}
    try:
        prefix = f"chain-{uuid.uuid4().hex[:8]}"
        t0 = time.perf_counter()
        writer = our_tier(s3, prefix, conc, proxy.endpoint)
        assert all(r.ok for r in writer.submit_put(items, chain=keys).wait(1200))
        out["chain_store_s"] = time.perf_counter() - t0
        more = [hashlib.sha256(b"more-%d" % i).digest() for i in range(300)]
        miss = [hashlib.sha256(b"miss-%d" % i).digest() for i in range(n)]
        cut = n * 5 // 8 + 7
        for name, probe, want in (
            ("same_prompt", keys, n),
            ("prefix", keys[:cut], cut),
            ("continued", keys + more, n),
            ("miss", miss, 0),
        ):
            reader = our_tier(s3, prefix, conc, proxy.endpoint)
            proxy.reset()
            t0 = time.perf_counter()
            assert reader.lookup_chain(probe) == want, name
            out[f"lookup_{name}_ms"] = (time.perf_counter() - t0) * 1e3
            count = sum(proxy.snapshot()[0].values())
            out[f"lookup_{name}_requests"] = count
            if want:
                out[f"lookup_{name}_requests_per_matched_block"] = count / want
        second = our_tier(s3, prefix, conc, proxy.endpoint)
        proxy.reset()
        assert all(r.status == "deduped" for r in second.submit_put(items, chain=keys).wait(600))
        req, body = proxy.snapshot()
        out["dup_chain_put_requests"] = sum(req.values())
        out["dup_chain_body_bytes"] = sum(body.values())
        return out
    finally:
        proxy.close()


def racing_pass(s3: S3Server, n: int, conc: int, block: int) -> dict[str, float]:
    """2, 4 and 8 writers (threads, each its own tier) store the same new `n`-block chain at
    once: per deduplicated block (every copy beyond the first), the body bytes and requests
    that reached the server beyond one writer's share, counted at a proxy."""
    import threading

    keys = [hashlib.sha256(b"race-%d" % i).digest() for i in range(n)]
    items = [(k, bytearray((k * (block // 32 + 1))[:block])) for k in keys]
    out: dict[str, float] = {}
    for writers in (2, 4, 8):
        proxy = CountingProxy(s3.ports["s3"])
        try:
            prefix = f"race-{writers}-{uuid.uuid4().hex[:8]}"
            tiers = [our_tier(s3, prefix, conc, proxy.endpoint) for _ in range(writers)]
            barrier = threading.Barrier(writers)

            def run(t: Any, barrier: threading.Barrier = barrier) -> None:
                barrier.wait()
                assert all(r.ok for r in t.submit_put(items, chain=keys).wait(600))

            proxy.reset()
            threads = [threading.Thread(target=run, args=(t,)) for t in tiers]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            req, body = proxy.snapshot()
            stats = [t.stats() for t in tiers]
        finally:
            proxy.close()
        dups = (writers - 1) * n
        # Racing bodies: uploads sent, then refused by the conditional create (goal 0); body
        # bytes of all writers per stored block over the block size (1.0: one copy, plus the
        # headers, claims and manifests); requests beyond one PUT per block, per duplicate.
        out[f"race{writers}_racing_bodies"] = sum(int(s["puts_exists"]) for s in stats)
        out[f"race{writers}_body_bytes_per_block_size"] = body.get("PUT", 0) / (n * block)
        out[f"race{writers}_requests_per_dup_block"] = (sum(req.values()) - n) / dups
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--quick", action="store_true", help="64 blocks of 64 KiB, one run (CI)")
    p.add_argument("--json", action="store_true", help="end with one JSON line")
    p.add_argument("--blocks", type=int, default=512)
    p.add_argument("--block-kib", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument(
        "--chain-blocks", type=int, default=8192, help="prompt length of the manifest lookups"
    )
    args = p.parse_args()
    if args.quick:
        args.blocks, args.block_kib, args.runs = 64, 64, 1
    blocks = make_blocks(args.blocks, args.block_kib * 1024)
    payload = sum(len(d) for _, d in blocks)
    runners: dict[str, Callable[..., Marks]] = {
        "ours": run_ours,
        "obstore": run_obstore,
        # The same loop with conditional creates (If-None-Match: *), what our puts send.
        "obstore_create": lambda s3, b, c: run_obstore(s3, b, c, "create"),
        "boto3": run_boto3,
    }
    with tempfile.TemporaryDirectory(prefix="object-bench-") as tmp:
        s3 = start_server(Path(tmp))
        try:
            times: dict[str, dict[str, list[float]]] = {
                name: {"up": [], "down": [], "up_cpu": [], "down_cpu": []} for name in runners
            }
            skipped: dict[str, str] = {}
            # Warm-up, untimed: the server allocates its first volumes on the first writes.
            for run in runners.values():
                try:
                    run(s3, blocks[:16], args.concurrency)
                except ImportError:
                    pass
            for run_no in range(args.runs):
                # Paired: every client once per run; every other run in reverse order, so no
                # client always runs first after the previous run's deletes and writes.
                order = list(runners.items())
                for name, run in order if run_no % 2 == 0 else order[::-1]:
                    if name in skipped:
                        continue
                    try:
                        t0, t1, t2 = run(s3, blocks, args.concurrency)
                    except ImportError as e:
                        skipped[name] = str(e)
                        continue
                    times[name]["up"].append(t1[0] - t0[0])
                    times[name]["down"].append(t2[0] - t1[0])
                    times[name]["up_cpu"].append(t1[1] - t0[1])
                    times[name]["down_cpu"].append(t2[1] - t1[1])
            counts = counted_pass(s3, blocks[: min(len(blocks), 256)], args.concurrency)
            counts.update(chain_pass(s3, args.chain_blocks, args.concurrency))
            counts.update(racing_pass(s3, 4 * 64 + 10, args.concurrency, args.block_kib * 1024))
        finally:
            s3.stop()
    rows = {}
    for name, t in times.items():
        if name in skipped:
            continue
        rows[name] = {
            "put_gbps": payload / statistics.median(t["up"]) / 1e9,
            "get_gbps": payload / statistics.median(t["down"]) / 1e9,
            # Spread over the paired runs: the slowest and fastest run.
            "put_gbps_min": payload / max(t["up"]) / 1e9,
            "put_gbps_max": payload / min(t["up"]) / 1e9,
            "get_gbps_min": payload / max(t["down"]) / 1e9,
            "get_gbps_max": payload / min(t["down"]) / 1e9,
            # The client's CPU (this process, every thread; the server is another process) per
            # GB moved: the load-independent part of the cost on a CPU-bound machine.
            "put_cpu_s_per_gb": statistics.median(t["up_cpu"]) / (payload / 1e9),
            "get_cpu_s_per_gb": statistics.median(t["down_cpu"]) / (payload / 1e9),
        }
    # Ours over each other client, per paired run, then the median (pairs share the load).
    ratios: dict[str, float] = {}
    for other in ("obstore", "obstore_create", "boto3"):
        if other not in rows:
            continue
        for way in ("up", "down", "up_cpu", "down_cpu"):
            pairs = [o / m for m, o in zip(times["ours"][way], times[other][way], strict=True)]
            kind = {"up": "put", "down": "get", "up_cpu": "put_cpu", "down_cpu": "get_cpu"}[way]
            ratios[f"ours_over_{other}_{kind}"] = statistics.median(pairs)
    print(
        f"{args.blocks} blocks x {args.block_kib} KiB, concurrency {args.concurrency}, "
        f"{args.runs} run(s), median"
    )
    print(f"{'client':8} {'put GB/s':>9} {'(min-max)':>13} {'get GB/s':>9} {'(min-max)':>13}")
    for name, r in rows.items():
        print(
            f"{name:8} {r['put_gbps']:9.3f} {r['put_gbps_min']:6.3f}-{r['put_gbps_max']:.3f} "
            f"{r['get_gbps']:9.3f} {r['get_gbps_min']:6.3f}-{r['get_gbps_max']:.3f}  "
            f"client CPU s/GB put {r['put_cpu_s_per_gb']:.2f} get {r['get_cpu_s_per_gb']:.2f}"
        )
    for k, v in ratios.items():
        print(f"{k}: {v:.3f} (median of paired runs; > 1: ours is faster)")
    for name, why in skipped.items():
        print(f"{name:8} skipped: {why}")
    for k, v in counts.items():
        print(f"{k}: {v:.3f}")
    if args.json:
        print(json.dumps({
            "bench": "object", "blocks": args.blocks, "block_kib": args.block_kib,
            "concurrency": args.concurrency, "runs": args.runs, "clients": rows, "skipped": skipped,
            "ratios": ratios, "counts": counts, "python": platform.python_version(),
        }))  # fmt: skip


if __name__ == "__main__":
    main()
