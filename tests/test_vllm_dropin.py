"""The published launch lines, as written: vLLM's built-in `FlexKVConnectorV1` name (through
flexkv-py's vLLM plugin), Dynamo's `PdConnector` from PyPI `kvbm` with NIXL, vLLM's own KV-event
stream, FlexKV's env-only sizing, and what happens when plugins are restricted or the original
FlexKV is installed beside us.

All of it runs vLLM 0.33's real factory, plugin loading, Scheduler and worker-side calls on CPU.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import vllm_harness as vh
import zmq
from vllm.config import KVTransferConfig
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.flexkv_connector import (
    FlexKVConnectorV1 as VllmFlexKVConnectorV1,
)
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
from vllm.v1.request import RequestStatus

from flexkv_py.errors import ConfigError
from flexkv_py.integration.vllm import FlexKVConnectorV1, plugin

BS = 16
TESTS_DIR = Path(__file__).resolve().parent

# Dynamo's disaggregated prefill worker, exactly as its recipe writes it.
PD_PREFILL = {
    "kv_connector": "PdConnector",
    "kv_role": "kv_both",
    "kv_connector_module_path": "kvbm.vllm_integration.connector",
    "kv_connector_extra_config": {
        "connectors": [
            {"kv_connector": "FlexKVConnectorV1", "kv_role": "kv_both"},
            {"kv_connector": "NixlConnector", "kv_role": "kv_both"},
        ]
    },
}
# Plain vLLM's prefill worker: the same two children in vLLM's own MultiConnector.
MULTI_PREFILL = {
    "kv_connector": "MultiConnector",
    "kv_role": "kv_both",
    "kv_connector_extra_config": PD_PREFILL["kv_connector_extra_config"],
}
SEED_LINE = {"kv_connector": "FlexKVConnectorV1", "kv_role": "kv_both"}


def loaded(e: vh.Engine, req_id: str) -> bool:
    return any(req_id in rec.finished_recving for rec in e.history)


def run_twice(e: vh.Engine, prompt: list[int], bs: int = BS) -> tuple[Any, Any]:
    """A computes `prompt`; the GPU prefix cache is dropped; B must come back from our tiers."""
    a = e.add(vh.make_request("A", prompt, block_size=bs))
    e.run()
    e.reset_gpu_prefix_cache()
    b = e.add(vh.make_request("B", prompt, block_size=bs))
    e.run()
    return a, b


def run_script(body: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`body` in a fresh interpreter (vLLM loads plugins once per process), harness importable."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith(("FLEXKV_", "VLLM_PL"))}
    full_env.update(env or {})
    full_env["PYTHONPATH"] = os.pathsep.join(
        [p for p in (full_env.get("PYTHONPATH", "").split(os.pathsep)) if p] + [str(TESTS_DIR)]
    )
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(body)],
        env=full_env,
        capture_output=True,
        text=True,
        timeout=300,
    )


# ------------------------------------------------------------------------------ the plugin
def test_builtin_name_resolves_to_our_connector_through_the_plugin() -> None:
    cls = KVConnectorFactory.get_connector_class(KVTransferConfig(**SEED_LINE))
    assert cls is FlexKVConnectorV1
    assert issubclass(cls, VllmFlexKVConnectorV1)  # PdConnector's isinstance check passes
    # The same through the module path: one class, whichever way it is named.
    by_path = KVConnectorFactory.get_connector_class(
        KVTransferConfig(**SEED_LINE, kv_connector_module_path=vh.MODULE_PATH)
    )
    assert by_path is cls


def test_plugin_is_idempotent() -> None:
    loader = KVConnectorFactory._registry["FlexKVConnectorV1"]
    for _ in range(3):
        plugin.register()
    assert KVConnectorFactory._registry["FlexKVConnectorV1"] is loader
    assert loader() is FlexKVConnectorV1


def test_every_hook_vllms_shim_defines_is_ours() -> None:
    # The shim forwards to `self._flexkv_connector`, which our instances never have: a hook we
    # inherited from it would raise AttributeError in the middle of serving.
    hooks = [n for n, v in vars(VllmFlexKVConnectorV1).items() if callable(v) and n != "__init__"]
    assert len(hooks) >= 15, hooks
    inherited = [
        n for n in hooks if getattr(FlexKVConnectorV1, n) is getattr(VllmFlexKVConnectorV1, n)
    ]
    assert not inherited, f"hooks still vLLM's shim's: {inherited}"


def test_seed_line_builds_our_connector_in_vllms_scheduler(
    model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The seed's env-only sizing: FLEXKV_CPU_CACHE_GB alone, no SSD, no extra config.
    monkeypatch.setenv("FLEXKV_CPU_CACHE_GB", "0.004")
    e = vh.Engine(model_dir, dict(SEED_LINE))
    assert type(e.connector) is FlexKVConnectorV1
    assert isinstance(e.workers[0].connector, VllmFlexKVConnectorV1)
    assert e.connector._config.cpu_cache_gb == pytest.approx(0.004)
    assert not e.connector._config.ssd_enabled
    _, b = run_twice(e, vh.prompt_tokens(301, 4 * BS))
    assert loaded(e, "B")
    assert e.workers[0].model.written["B"] == 4  # last prompt token + 3 decode steps
    assert not e.mismatches()
    assert b.status == RequestStatus.FINISHED_LENGTH_CAPPED
    vh.assert_no_leaks(e)
    e.shutdown()


def test_restricted_plugins_fail_at_start_naming_both_fixes(tmp_path: Path) -> None:
    # VLLM_PLUGINS allows another plugin only: vLLM builds its own shim, which imports
    # flexkv.integration.vllm.vllm_v1_adapter; that must refuse clearly, and the module-path
    # form must still work in the same process.
    out = run_script(
        f"""
        import vllm_harness as vh
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        print("REGISTRY", KVConnectorFactory._registry["FlexKVConnectorV1"].__module__)
        md = vh.tiny_model_dir(__import__("pathlib").Path({str(tmp_path)!r}))
        try:
            vh.Engine(md, {{"kv_connector": "FlexKVConnectorV1", "kv_role": "kv_both",
                            "kv_connector_extra_config": {{"cpu_cache_gb": 0.004}}}})
        except Exception as e:
            print("REFUSED", type(e).__name__, str(e).replace("\\n", " "))
        vh.CONNECTOR_FORM = "module_path"
        e = vh.Engine(md, vh.connector_transfer_config({{"cpu_cache_gb": 0.004}}))
        print("MODULE_PATH_OK", type(e.connector).__module__)
        e.shutdown()
        """,
        env={"VLLM_PLUGINS": "lora_filesystem_resolver"},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "REGISTRY vllm.distributed.kv_transfer.kv_connector.factory" in out.stdout
    refused = next(line for line in out.stdout.splitlines() if line.startswith("REFUSED"))
    assert "ConfigError" in refused
    assert "VLLM_PLUGINS='lora_filesystem_resolver'" in refused
    assert "flexkv_py" in refused and "kv_connector_module_path" in refused
    assert "MODULE_PATH_OK flexkv_py.integration.vllm.connector" in out.stdout


def _fake_original_flexkv(site: Path, *, with_files: bool) -> None:
    """What `pip install` of the original FlexKV leaves: its dist-info claiming `flexkv/`, and
    (when it was installed last) its own `flexkv/__init__.py` over ours."""
    info = site / "flexkv-1.0.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: flexkv\nVersion: 1.0.0\n")
    (info / "top_level.txt").write_text("flexkv\n")
    (info / "RECORD").write_text(
        "flexkv/__init__.py,,\nflexkv-1.0.0.dist-info/METADATA,,\nflexkv-1.0.0.dist-info/RECORD,,\n"
    )
    if with_files:
        (site / "flexkv").mkdir()
        # Importing it would be a bug of ours: the check reads files, never imports them.
        (site / "flexkv" / "__init__.py").write_text(
            "raise RuntimeError('foreign flexkv imported')\n"
        )


@pytest.mark.parametrize("with_files", [True, False], ids=["its-files-won", "metadata-only"])
def test_original_flexkv_beside_us_is_refused_naming_both(tmp_path: Path, with_files: bool) -> None:
    site = tmp_path / "site"
    _fake_original_flexkv(site, with_files=with_files)
    out = run_script(
        f"""
        import vllm_harness as vh
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        md = vh.tiny_model_dir(__import__("pathlib").Path({str(tmp_path)!r}))
        for form in ("builtin", "module_path"):
            vh.CONNECTOR_FORM = form
            try:
                vh.Engine(md, vh.connector_transfer_config({{"cpu_cache_gb": 0.004}}))
                print("STARTED", form)
            except Exception as e:
                print("REFUSED", form, type(e).__name__, str(e).replace("\\n", " "))
        """,
        env={"PYTHONPATH": str(site)},
    )
    assert out.returncode == 0, out.stderr[-3000:]  # the plugin itself never breaks vLLM
    assert "STARTED" not in out.stdout
    assert "foreign flexkv imported" not in out.stdout + out.stderr
    for form in ("builtin", "module_path"):
        line = next(x for x in out.stdout.splitlines() if x.startswith(f"REFUSED {form} "))
        # Our ConfigError, raised as is or inside vLLM's config validation (the plugin's loader
        # runs when VllmConfig checks the connector's HMA support).
        assert "ConfigError" in line or "ValidationError" in line
        assert "two packages install the Python package 'flexkv'" in line
        assert "flexkv-py" in line and "flexkv " in line and "pip uninstall flexkv" in line


# ------------------------------------------------------------------------- load failures
def test_load_failure_policy_fail_when_the_user_asks(model_dir: str, tmp_path: Path) -> None:
    extra = vh.with_ssd(tmp_path / "ssd", load_failure_policy="fail")
    prompt = vh.prompt_tokens(302, 4 * BS)
    e1 = vh.Engine(model_dir, vh.connector_transfer_config(extra))
    e1.add(vh.make_request("A", prompt))
    e1.run()
    e1.shutdown()
    assert vh.corrupt_ssd(tmp_path / "ssd") >= 1
    e2 = vh.Engine(model_dir, vh.connector_transfer_config(extra))
    assert not e2.scheduler.recompute_kv_load_failures
    b = e2.add(vh.make_request("B", prompt))
    e2.run()
    assert b.status == RequestStatus.FINISHED_ERROR
    assert not e2.mismatches()
    e2.shutdown()


# ------------------------------------------------------------------------ FlexKV's env vars
def test_instance_num_is_refused_until_engines_can_share_a_node(
    model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLEXKV_CPU_CACHE_GB", "0.004")
    monkeypatch.setenv("FLEXKV_INSTANCE_NUM", "2")
    monkeypatch.setenv("FLEXKV_INSTANCE_ID", "1")
    with pytest.raises(ConfigError, match="instance_num: 2 engines sharing one node"):
        vh.Engine(model_dir, dict(SEED_LINE))


def test_server_mode_vars_get_one_info_line(
    model_dir: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("FLEXKV_CPU_CACHE_GB", "0.004")
    monkeypatch.setenv("FLEXKV_INSTANCE_NUM", "1")
    monkeypatch.setenv("FLEXKV_SERVER_RECV_PORT", "ipc:///tmp/flexkv_server")
    monkeypatch.setenv("FLEXKV_ENABLE_MPS", "1")
    with caplog.at_level(logging.INFO, logger="flexkv_py"):
        e = vh.Engine(model_dir, dict(SEED_LINE))
    e.shutdown()
    lines = [r for r in caplog.records if r.name.startswith("flexkv_py.config")]
    for name in ("FLEXKV_SERVER_RECV_PORT", "FLEXKV_ENABLE_MPS"):
        mine = [r for r in lines if name in r.getMessage()]
        assert mine and all(r.levelno == logging.INFO for r in mine), name
    assert not [r for r in lines if r.levelno >= logging.WARNING and "unknown" in r.getMessage()]


# ------------------------------------------------------------------- Dynamo's PdConnector
def pd_engine(model_dir: str, transfer: dict[str, Any] = PD_PREFILL, **kw: Any) -> vh.Engine:
    # NIXL's CPU path wants blocks of 32 tokens; HMA off (see test_pd_with_hma_on_...).
    return vh.Engine(
        model_dir,
        json.loads(json.dumps(transfer)),
        block_size=32,
        disable_hma=True,
        process_group=True,
        **kw,
    )


@pytest.mark.parametrize("wrapper", ["PdConnector", "MultiConnector"])
def test_prefill_line_with_nixl_end_to_end(
    model_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, wrapper: str
) -> None:
    from kvbm.vllm_integration.connector import PdConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.multi_connector import MultiConnector
    from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector

    transfer, wrapper_cls = {
        "PdConnector": (PD_PREFILL, PdConnector),
        "MultiConnector": (MULTI_PREFILL, MultiConnector),
    }[wrapper]

    ssd = tmp_path / "ssd"
    ssd.mkdir()
    # Sized by env, as the recipe does: a small host tier and an SSD tier for the restart.
    for k, v in {
        "CPU_CACHE_GB": "0.004",
        "SSD_CACHE_GB": "0.03",
        "SSD_CACHE_DIR": str(ssd),
        "ADMISSION": "write_through",
    }.items():
        monkeypatch.setenv(f"FLEXKV_{k}", v)
    prompt = vh.prompt_tokens(303, 4 * 32)
    e = pd_engine(model_dir, transfer)
    assert type(e.connector) is wrapper_cls
    flexkv, nixl = e.connector.sub_connectors
    assert type(flexkv) is FlexKVConnectorV1 and isinstance(nixl, NixlConnector)
    # Left at vLLM's default, the policy became "recompute" where the scheduler reads it.
    assert e.scheduler.recompute_kv_load_failures
    run_twice(e, prompt, bs=32)
    assert loaded(e, "B")
    assert e.workers[0].model.written["B"] == 4
    assert e.outputs["B"] == e.outputs["A"]
    assert not e.mismatches()
    vh.assert_no_leaks(e)
    e.shutdown()

    # Restart: a new engine over the same SSD directory hits what the first one stored.
    e2 = pd_engine(model_dir, transfer)
    c = e2.add(vh.make_request("C", prompt, block_size=32))
    e2.run()
    assert loaded(e2, "C") and e2.workers[0].model.written["C"] == 4
    assert e2.outputs["C"] == e.outputs["A"]
    assert not e2.mismatches()
    assert c.status == RequestStatus.FINISHED_LENGTH_CAPPED
    e2.shutdown()

    # Corrupt SSD data under PdConnector, policy at vLLM's default: recomputed, right tokens.
    assert vh.corrupt_ssd(ssd) >= 1
    e3 = pd_engine(model_dir, transfer)
    d = e3.add(vh.make_request("D", prompt, block_size=32))
    e3.run()
    assert any(rec.invalid_block_ids for rec in e3.history), "corruption was not reported"
    assert d.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert e3.outputs["D"] == e.outputs["A"]
    assert not e3.mismatches()
    vh.assert_no_leaks(e3)
    e3.shutdown()


def test_pd_connector_preemption(model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FLEXKV_CPU_CACHE_GB", "0.004")
    # 10 usable blocks of 32 for 3 requests that each grow past 3 blocks: decode must preempt.
    e = pd_engine(model_dir, num_blocks=11)
    reqs = [
        e.add(
            vh.make_request(
                f"P{i}", vh.prompt_tokens(310 + i, 3 * 32 - 2), max_tokens=40, block_size=32
            )
        )
        for i in range(3)
    ]
    e.run()
    assert any(r.num_preemptions > 0 for r in reqs), "scenario did not preempt"
    assert not e.mismatches()
    assert all(len(e.outputs[r.request_id]) == 40 for r in reqs)
    vh.assert_no_leaks(e)
    e.shutdown()


def test_pd_with_hma_on_is_a_clear_error(model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # vLLM keeps HMA on for PdConnector (it subclasses MultiConnector under its own name) and
    # then asserts in MultiConnector; we say which flag to add instead.
    monkeypatch.setenv("FLEXKV_CPU_CACHE_GB", "0.004")
    with pytest.raises(ConfigError, match="--disable-hybrid-kv-cache-manager"):
        vh.Engine(model_dir, json.loads(json.dumps(PD_PREFILL)), block_size=32, disable_hma=False)


# --------------------------------------------------------------- vLLM's own KV-event stream
def _replay_all(replay_endpoint: str, timeout_s: float = 10.0) -> list[KVEventBatch]:
    """Every batch vLLM's ZMQ publisher sent, through its replay socket, msgspec-decoded."""
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(replay_endpoint)
    try:
        sock.send_multipart([b"", (0).to_bytes(8, "big")])
        batches: list[KVEventBatch] = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not sock.poll(100):
                continue
            _, _topic, seq, payload = sock.recv_multipart()
            if seq == (-1).to_bytes(8, "big", signed=True) or not payload:
                return batches
            batches.append(decoder.decode(payload))
        raise AssertionError("the publisher's replay did not end")
    finally:
        sock.close(linger=0)


def test_kv_events_through_vllms_zmq_publisher(model_dir: str, tmp_path: Path) -> None:
    # No DYNAMO_USE_FLEXKV: vLLM's --kv-events-config alone turns our events on.
    events_cfg = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"ipc://{tmp_path}/kv-events",
        "replay_endpoint": f"ipc://{tmp_path}/kv-replay",
        "topic": "kv",
    }
    # A host tier of 8 slots: the second prompt spills the first to SSD.
    extra = vh.with_ssd(tmp_path / "ssd", cpu_cache_gb=8 * 4096 / 2**30, admission="write_back")
    e = vh.Engine(model_dir, vh.connector_transfer_config(extra), kv_events=events_cfg)
    a = e.add(vh.make_request("A", vh.prompt_tokens(320, 4 * BS), cache_salt="tenant-7"))
    e.run()
    e.add(vh.make_request("C", vh.prompt_tokens(321, 8 * BS)))
    e.run()
    assert e.scheduler.reset_prefix_cache(reset_connector=True)
    e.step()  # the step that publishes reset_cache's removals
    publisher = e.scheduler.kv_event_publisher
    publisher._event_queue.join()  # every queued batch was sent (publish is asynchronous)
    batches = _replay_all(events_cfg["replay_endpoint"])
    e.shutdown()

    events = [ev for batch in batches for ev in batch.events]
    a_hashes = [maybe_convert_block_hash(h) for h in a.block_hashes]
    stored = {
        m: [ev for ev in events if isinstance(ev, BlockStored) and ev.medium == m]
        for m in ("CPU", "SSD")
    }
    removed = {
        m: {
            h
            for ev in events
            if isinstance(ev, BlockRemoved) and ev.medium == m
            for h in ev.block_hashes
        }
        for m in ("CPU", "SSD")
    }
    by_hash = {ev.block_hashes[0]: ev for ev in stored["CPU"]}
    assert set(a_hashes[:4]) <= set(by_hash), "A's blocks were not announced in host memory"
    first, second = by_hash[a_hashes[0]], by_hash[a_hashes[1]]
    assert first.parent_block_hash is None and second.parent_block_hash == a_hashes[0]
    assert second.token_ids == a.all_token_ids[BS : 2 * BS] and second.block_size == BS
    assert first.extra_keys == [("tenant-7",)]  # cache_salt keys the first block only
    assert second.extra_keys is None
    assert first.group_idx == 0
    spilled = set(a_hashes) & {h for ev in stored["SSD"] for h in ev.block_hashes}
    assert spilled, "no SSD store event for A's spilled blocks"
    # The spill removed them from host memory only; the SSD lost them at reset_cache.
    assert spilled <= removed["CPU"]
    assert spilled <= removed["SSD"]
    last_ssd_store = max(
        i for i, ev in enumerate(events) if isinstance(ev, BlockStored) and ev.medium == "SSD"
    )
    first_ssd_removal = min(
        i for i, ev in enumerate(events) if isinstance(ev, BlockRemoved) and ev.medium == "SSD"
    )
    assert first_ssd_removal > last_ssd_store, "an SSD removal came before reset_cache"

    # Dynamo's router index (PyPI ai-dynamo-runtime's RadixTree, no NATS/etcd) consumes the
    # SSD tier's stream (spills arrive parent first, so every stored block attaches).
    from dynamo._core import RadixTree, compute_block_hash_for_seq

    tree = RadixTree()
    ssd_events = [(i, ev) for i, ev in enumerate(events) if getattr(ev, "medium", None) == "SSD"]
    for i, ev in ssd_events:
        if i < first_ssd_removal:
            tree.apply_event(2, _dynamo_event(i, ev))
    a_seq = compute_block_hash_for_seq(list(a.all_token_ids[: 4 * BS]), BS)
    on_ssd_prefix = next(i for i, h in enumerate([*a_hashes[:4], None]) if h not in spilled)
    assert on_ssd_prefix >= 1
    assert tree.find_matches(a_seq).scores.get((2, 0), 0) == on_ssd_prefix
    other = compute_block_hash_for_seq(vh.prompt_tokens(399, 4 * BS), BS)
    assert not any(tree.find_matches(other).scores.values())
    for i, ev in ssd_events:
        if i >= first_ssd_removal:
            tree.apply_event(2, _dynamo_event(i, ev))
    assert tree.find_matches(a_seq).scores.get((2, 0), 0) == 0  # reset_cache reached the router


def _u64(block_hash: Any) -> int:
    if isinstance(block_hash, bytes):
        return int.from_bytes(block_hash, "big") & ((1 << 64) - 1)
    return int(block_hash) & ((1 << 64) - 1)


def _dynamo_event(event_id: int, ev: Any) -> bytes:
    """A vLLM KV event as Dynamo's router event (what its vLLM ZMQ relay hands the indexer):
    its own hash of each block's token ids, our block hash as the block's identity."""
    from dynamo._core import compute_block_hash_for_seq

    if isinstance(ev, BlockStored):
        tokens_hash = compute_block_hash_for_seq(list(ev.token_ids), ev.block_size)
        parent = ev.parent_block_hash
        data: dict[str, Any] = {
            "stored": {
                "parent_hash": _u64(parent) if parent is not None else None,
                "blocks": [
                    {"block_hash": _u64(h), "tokens_hash": t}
                    for h, t in zip(ev.block_hashes, tokens_hash, strict=True)
                ],
            }
        }
    else:
        data = {"removed": {"block_hashes": [_u64(h) for h in ev.block_hashes]}}
    return json.dumps({"event_id": event_id, "data": data}).encode()
