"""The published launch lines, as written: vLLM's built-in `FlexKVConnectorV1` name (through
flexkv-py's vLLM plugin), Dynamo's `PdConnector` from PyPI `kvbm` with NIXL, vLLM's own KV-event
stream, FlexKV's env-only sizing, and what happens when plugins are restricted or the original
FlexKV is installed beside us.

All of it runs vLLM 0.33's real factory, plugin loading, Scheduler and worker-side calls on CPU.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
from helpers import vllm_harness as vh
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.flexkv_connector import (
    FlexKVConnectorV1 as VllmFlexKVConnectorV1,
)
from vllm.v1.request import RequestStatus

from flexkv_py.errors import ConfigError
from flexkv_py.integration.vllm import FlexKVConnectorV1, plugin

BS = 16
TESTS_DIR = Path(__file__).resolve().parents[2]

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


def test_plugin_is_idempotent_and_restores_our_entry(monkeypatch: pytest.MonkeyPatch) -> None:
    loader = KVConnectorFactory._registry["FlexKVConnectorV1"]
    for _ in range(3):
        plugin.register()
    assert KVConnectorFactory._registry["FlexKVConnectorV1"] is loader
    assert loader() is FlexKVConnectorV1
    # Something (vLLM re-importing its factory, another plugin) put vLLM's shim back: the next
    # run of the plugin points the name at our class again.
    monkeypatch.setitem(
        KVConnectorFactory._registry, "FlexKVConnectorV1", lambda: VllmFlexKVConnectorV1
    )
    plugin.register()
    assert KVConnectorFactory.get_connector_class_by_name("FlexKVConnectorV1") is FlexKVConnectorV1


@pytest.mark.parametrize(
    ("allowed", "says"),
    [
        (None, "did not run it in this process"),
        ("lora_filesystem_resolver", "does not allow it"),
        ("lora_filesystem_resolver, flexkv_py", "with spaces around it"),
        ("flexkv_py", "never ran vLLM's load_general_plugins()"),
    ],
)
def test_shim_refusal_says_why_the_plugin_did_not_run(
    monkeypatch: pytest.MonkeyPatch, allowed: str | None, says: str
) -> None:
    from flexkv.integration.vllm.vllm_v1_adapter import FlexKVConnectorV1Impl

    if allowed is None:
        monkeypatch.delenv("VLLM_PLUGINS", raising=False)
    else:
        monkeypatch.setenv("VLLM_PLUGINS", allowed)
    with pytest.raises(ConfigError) as err:
        FlexKVConnectorV1Impl(None, None)
    assert says in str(err.value)
    assert "kv_connector_module_path" in str(err.value)


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
        from helpers import vllm_harness as vh
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
        from helpers import vllm_harness as vh
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
def test_instance_num_shares_the_node_cache_and_names_the_shard(
    model_dir: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """FlexKV's FLEXKV_INSTANCE_NUM / _ID: the sizes are the node's, split among the engines,
    and each engine has its own SSD shard (test_vllm_node_engines.py runs two)."""
    monkeypatch.setenv("FLEXKV_CPU_CACHE_GB", "0.004")
    monkeypatch.setenv("FLEXKV_SSD_CACHE_GB", "0.02")
    monkeypatch.setenv("FLEXKV_SSD_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("FLEXKV_INSTANCE_NUM", "2")
    monkeypatch.setenv("FLEXKV_INSTANCE_ID", "1")
    e = vh.Engine(model_dir, dict(SEED_LINE))
    (side,) = e.flexkv_scheduler_sides()
    assert side._mgr.num_host_slots == int(0.004 * (1 << 30)) // 2 // 4096
    assert sorted(p.name for p in tmp_path.iterdir()) == ["engine1-tp0-pp0"]
    e.shutdown()
    monkeypatch.setenv("FLEXKV_INSTANCE_ID", "2")
    with pytest.raises(ConfigError, match=r"instance_id: must be in 0\.\.1"):
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
    # One scheduler and one worker connector resolve the configuration: one line each.
    for name in ("FLEXKV_SERVER_RECV_PORT", "FLEXKV_ENABLE_MPS"):
        mine = [r for r in lines if name in r.getMessage()]
        assert len(mine) == 2 and all(r.levelno == logging.INFO for r in mine), name
    assert not [r for r in lines if r.levelno >= logging.WARNING and "unknown" in r.getMessage()]
