"""Faults of the object store under vLLM's real Scheduler (helpers/vllm_harness.py, real
SeaweedFS, helpers/s3_proxy.py in between): wrong bytes in the bucket, a slow server, truncated
replies and a server that went down all end in recompute with the right tokens, a bounded
wait and counters; the engine keeps serving."""

from __future__ import annotations

import time
import uuid

import pytest
from helpers import vllm_harness as vh
from helpers.s3_proxy import CountingProxy
from helpers.s3_server import S3Server

from integration.s3.test_object_wiring_vllm import BLOCKS, BS, consume, object_env, produce
from integration.s3.test_object_wiring_vllm import (
    s3 as s3,  # the module's SeaweedFS server (fixture)
)


def stored_prompt(
    s3: S3Server, model_dir: str, monkeypatch: pytest.MonkeyPatch, seed: int
) -> tuple[str, list[int], list[int]]:
    """(bucket prefix, prompt, the producer's output) of a prompt stored in the bucket."""
    prefix = f"faults-{uuid.uuid4().hex[:8]}"
    for k, v in object_env(s3, prefix).items():
        monkeypatch.setenv(k, v)
    prompt = vh.prompt_tokens(seed, BLOCKS * BS + 7)
    e = produce(model_dir, prompt)
    out = e.outputs["P"]
    e.shutdown()
    return prefix, prompt, out


def test_wrong_bytes_in_the_bucket_are_recomputed(
    s3: S3Server, model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    prefix, prompt, expected = stored_prompt(s3, model_dir, monkeypatch, 21)
    client = s3.client()
    listed = client.list_objects_v2(Bucket=s3.bucket, Prefix=f"{prefix}/b/")
    blocks = [o for o in listed.get("Contents", [])]
    assert len(blocks) == BLOCKS
    for o in blocks[:2]:  # the same length, other bytes: only the checksum can tell
        client.put_object(Bucket=s3.bucket, Key=o["Key"], Body=b"\x5a" * o["Size"])
    got = consume(model_dir, prompt)
    assert got["finished"] and got["outputs"] == expected and not got["mismatches"]
    assert got["invalid"] >= 1  # reported to vLLM as failed blocks, recomputed
    assert got["stats"]["object_read_corrupt_blocks"] == 2


@pytest.mark.parametrize("fault", ["slow", "truncated"])
def test_a_slow_or_truncating_server_is_a_bounded_miss(
    s3: S3Server, model_dir: str, monkeypatch: pytest.MonkeyPatch, fault: str
) -> None:
    prefix, prompt, expected = stored_prompt(s3, model_dir, monkeypatch, 22)
    # Truncated replies from the start: the bucket cannot be opened (its listing is cut), the
    # engine serves without the object tier. Slow once the engine opened the bucket: its
    # lookups run past the wait.
    proxy = CountingProxy(s3.ports["s3"], cut_replies_after=40 if fault == "truncated" else None)

    def inject(e: vh.Engine) -> None:
        if fault == "slow":
            proxy.delay_replies_s = 4.0

    try:
        for k, v in object_env(s3, prefix, proxy.endpoint).items():
            monkeypatch.setenv(k, v)
        monkeypatch.setenv("FLEXKV_OBJECT_STORE_LOOKUP_WAIT_S", "1.0")
        t0 = time.monotonic()
        got = consume(model_dir, prompt, before=inject)
        took = time.monotonic() - t0
    finally:
        proxy.close()
    assert got["finished"] and got["outputs"] == expected and not got["mismatches"]
    assert got["stats"].get("load_object_blocks", 0) == 0
    if fault == "slow":
        assert got["asked_later"] >= 1  # skipped while the lookup ran, never waited in a step
        assert got["gave_up"] == 1  # then answered a miss after the 1 s wait
    else:
        assert got["asked_later"] == 0 and got["stats"].get("object_lookup_hit_blocks", 0) == 0
    assert took < 120, f"{fault}: {took:.0f} s"


def test_a_server_that_went_down_is_a_miss_and_serving_goes_on(
    s3: S3Server, model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, prompt, expected = stored_prompt(s3, model_dir, monkeypatch, 23)
    try:
        got = consume(model_dir, prompt, before=lambda e: s3.kill9())
    finally:
        s3.start()
    assert got["finished"] and got["outputs"] == expected and not got["mismatches"]
    assert got["stats"].get("load_object_blocks", 0) == 0
    assert got["stats"].get("object_lookup_hit_blocks", 0) == 0
