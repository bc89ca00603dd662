"""The tier policy around the object tier, through vLLM's real Scheduler (helpers/vllm_harness.py)
on the real S3 server (helpers/s3_server.py): host -> SSD -> object write-behind (a block evicted
from a tiny host tier before its upload turn is uploaded from the SSD), the prefetch of a
bucket hit into host memory before the request's load, and TP = 2 (each rank's shard under its
own keys)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
from helpers import vllm_harness as vh
from helpers.s3_proxy import CountingProxy
from helpers.s3_server import S3Server

from integration.s3.test_object_wiring_vllm import (
    BLOCKS,
    BS,
    consume,
    manager_stats,
    object_env,
    produce,
)
from integration.s3.test_object_wiring_vllm import (
    s3 as s3,  # the module's SeaweedFS server (fixture)
)

# 16 host slots of 4 KiB (the harness model's block): six prompts of 6 blocks go through it.
TINY_HOST_GB = 16 * 4096 / (1 << 30) + 1e-9
PROMPTS = 6


def _setenv(monkeypatch: pytest.MonkeyPatch, env: dict[str, Any]) -> None:
    for k, v in env.items():
        monkeypatch.setenv(k, str(v))


def _bucket_blocks(s3: S3Server, prefix: str) -> int:
    listed = s3.client().list_objects_v2(Bucket=s3.bucket, Prefix=f"{prefix}/b/")
    return len(listed.get("Contents", []))


def _produced(
    s3: S3Server, model_dir: str, monkeypatch: pytest.MonkeyPatch, seed: int, tp_size: int = 1
) -> tuple[str, list[int], Any, int]:
    """(bucket prefix, prompt, the producer's output, the positions it computed) of a prompt
    a producer engine wrote to a fresh bucket prefix."""
    prefix = f"policy-{uuid.uuid4().hex[:8]}"
    _setenv(monkeypatch, object_env(s3, prefix))
    prompt = vh.prompt_tokens(seed, BLOCKS * BS + 5)
    producer = produce(model_dir, prompt, tp_size=tp_size)
    try:
        return prefix, prompt, producer.outputs["P"], producer.workers[0].model.written["P"]
    finally:
        producer.shutdown()


def test_blocks_evicted_from_a_tiny_host_tier_reach_the_bucket_from_the_ssd(
    s3: S3Server, model_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    prefix = f"ssd-up-{uuid.uuid4().hex[:8]}"
    _setenv(monkeypatch, object_env(s3, prefix))
    ssd = vh.with_ssd(tmp_path / "ssd", cpu_cache_gb=TINY_HOST_GB)
    _setenv(monkeypatch, {f"FLEXKV_{k.upper()}": v for k, v in ssd.items()})
    prompts = [vh.prompt_tokens(60 + i, BLOCKS * BS + 5) for i in range(PROMPTS)]
    e = vh.Engine(model_dir, vh.connector_transfer_config(kv_role="kv_both"))
    try:
        for i, p in enumerate(prompts):  # one after the other: each store finds 6 slots
            e.add(vh.make_request(f"P{i}", p, block_size=BS))
            e.run()
        assert manager_stats(e)["host_slots"] == 16
        e.run_until(lambda: manager_stats(e)["object_write_pending_blocks"] == 0, 120)
        stats = manager_stats(e)
        expected = {f"P{i}": e.outputs[f"P{i}"] for i in range(PROMPTS)}
        computed = {f"P{i}": e.workers[0].model.written[f"P{i}"] for i in range(PROMPTS)}
        assert not e.mismatches()
    finally:
        e.shutdown()
    # 36 blocks through 16 slots: most were evicted before their upload turn.
    assert stats["object_write_behind_blocks"] == PROMPTS * BLOCKS
    assert stats["object_write_behind_from_ssd_blocks"] >= 1
    assert stats.get("object_write_behind_lost_blocks", 0) == 0
    assert stats.get("object_write_behind_stage_failed_blocks", 0) == 0
    assert _bucket_blocks(s3, prefix) == PROMPTS * BLOCKS
    # A consumer (an empty host tier, no SSD) hits every block from the bucket, bit-identical.
    for k in ssd:
        monkeypatch.delenv(f"FLEXKV_{k.upper()}")
    _setenv(monkeypatch, object_env(s3, prefix))
    c = vh.Engine(model_dir, vh.connector_transfer_config(kv_role="kv_consumer"))
    try:
        for i, p in enumerate(prompts):
            c.add(vh.make_request(f"C{i}", p, block_size=BS))
        c.run()
        assert not c.mismatches()
        for i in range(PROMPTS):
            assert c.outputs[f"C{i}"] == expected[f"P{i}"]
            # The full hit: only the partial last block's tokens (and decodes) are computed.
            assert c.workers[0].model.written[f"C{i}"] == computed[f"P{i}"] - BLOCKS * BS
        assert manager_stats(c)["load_object_blocks"] == PROMPTS * BLOCKS
    finally:
        c.shutdown()


def test_a_bucket_hit_is_prefetched_and_the_load_reads_host_memory(
    s3: S3Server, model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    prefix, prompt, expected, computed = _produced(s3, model_dir, monkeypatch, 70)
    proxy = CountingProxy(s3.ports["s3"])
    try:
        _setenv(monkeypatch, object_env(s3, prefix, proxy.endpoint, prefetch=256))
        got = consume(model_dir, prompt)
    finally:
        proxy.close()
    assert got["loaded"] and got["finished"] and not got["mismatches"]
    assert got["outputs"] == expected
    assert got["written"] == computed - BLOCKS * BS
    stats = got["stats"]
    assert stats["object_prefetch_blocks"] == BLOCKS
    assert stats["load_host_blocks"] == BLOCKS  # the load came from host memory
    assert stats.get("load_object_blocks", 0) == 0
    # Each block was read from the bucket once (by the prefetch), not again by the load.
    path = f" /{s3.bucket}/{prefix}/b/".encode()
    gets = sum(1 for h in proxy.heads if h.startswith(b"GET") and path in h)
    assert gets == BLOCKS


def test_a_prefetch_that_reads_wrong_bytes_shortens_the_hit_and_serves_no_wrong_kv(
    s3: S3Server, model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    prefix, prompt, expected, computed = _produced(s3, model_dir, monkeypatch, 75)
    client = s3.client()
    listed = client.list_objects_v2(Bucket=s3.bucket, Prefix=f"{prefix}/b/")
    for o in listed["Contents"][:2]:  # the same length, other bytes: only the checksum can tell
        client.put_object(Bucket=s3.bucket, Key=o["Key"], Body=b"\x5a" * o["Size"])
    _setenv(monkeypatch, object_env(s3, prefix, prefetch=256))
    got = consume(model_dir, prompt)
    assert got["finished"] and got["outputs"] == expected and not got["mismatches"]
    stats = got["stats"]
    assert stats["object_prefetch_failed_blocks"] == 2
    assert stats["object_read_corrupt_blocks"] == 2
    # The bad copies were forgotten before the load: it reads host memory only, and fails
    # nothing (the blocks from the first bad one on are computed).
    assert got["invalid"] == 0 and stats.get("load_object_blocks", 0) == 0
    hit = stats.get("load_host_blocks", 0)
    assert hit < BLOCKS and got["written"] == computed - hit * BS


def test_tp2_ranks_upload_and_load_their_own_shards(
    s3: S3Server, model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    prefix, prompt, expected, computed = _produced(s3, model_dir, monkeypatch, 80, tp_size=2)
    # One object per block and rank: each rank's shard under its own keys.
    assert _bucket_blocks(s3, prefix) == 2 * BLOCKS
    got = consume(model_dir, prompt, tp_size=2)
    assert got["loaded"] and got["finished"] and not got["mismatches"]  # both ranks' KV
    assert got["outputs"] == expected
    assert got["written"] == computed - BLOCKS * BS
    assert got["stats"]["load_object_blocks"] == BLOCKS
