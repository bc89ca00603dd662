"""The connector across vLLM releases (compat.py): the supported range's edges, the plugin that
never raises, and restarts that hit without PYTHONHASHSEED on whatever vLLM runs the suite (CI
runs these on 0.33 and on the oldest supported release; .ci/vllm_matrix.sh on every pin)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.writers import TESTS_DIR, argv

from flexkv_py.errors import ConfigError
from flexkv_py.integration.vllm import compat, plugin


# ------------------------------------------------------------------ the range's edges
@pytest.mark.parametrize(
    ("version", "expected"),
    [
        ("0.23.0", (0, 23, 0)),
        ("0.31.1+cpu", (0, 31, 1)),
        ("0.34.0rc1.dev5", (0, 34, 0)),
        ("1.0", (1, 0, 0)),
    ],
)
def test_version_tuples(version: str, expected: tuple[int, int, int]) -> None:
    assert compat.version_tuple(version) == expected


@pytest.mark.parametrize("version", ["0.19.0", "0.22.1", "0.17.2+cu128"])
def test_an_older_vllm_is_refused_with_the_range_named(version: str) -> None:
    with pytest.raises(compat.UnsupportedVllmError) as err:
        compat.check_supported(version)
    assert isinstance(err.value, ConfigError)
    assert "0.23.0 to 0.33.0" in str(err.value) and version in str(err.value)


def test_supported_releases_pass_and_a_newer_one_warns_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    for version in ("0.23.0", "0.28.0", "0.33.0"):
        compat.check_supported(version)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    compat._warned.discard("newer")
    with caplog.at_level(logging.WARNING, logger="flexkv_py"):
        compat.check_supported("0.34.0")
        compat.check_supported("0.35.1")
    warnings = [r.getMessage() for r in caplog.records if "newer than" in r.getMessage()]
    assert len(warnings) == 1 and "0.34.0" in warnings[0]


def test_the_plugin_never_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    class Broken(dict):  # type: ignore[type-arg]
        def get(self, *args: object) -> None:
            raise RuntimeError("a registry vLLM changed")

    monkeypatch.setattr(KVConnectorFactory, "_registry", Broken())
    plugin.register()  # logs, does not raise: a broken plugin would stop vLLM for every model


def test_the_connector_name_is_ours_and_its_import_checks_the_range(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    plugin.register()
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    loader = KVConnectorFactory._registry[plugin.CONNECTOR_NAME]
    assert loader().__module__ == "flexkv_py.integration.vllm.connector"
    # Under a vLLM below the range, building the connector (its import) names the range.
    monkeypatch.setattr(compat, "vllm_version", lambda: "0.19.0")
    monkeypatch.delitem(sys.modules, "flexkv_py.integration.vllm.connector")
    with pytest.raises(compat.UnsupportedVllmError, match=r"0\.23\.0 to 0\.33\.0"):
        loader()


def test_features_match_what_this_vllm_has() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1

    found = compat.features()
    assert found["kv_cache_manager_binding"] == hasattr(KVConnectorBase_V1, "bind_kv_cache_manager")
    assert found["steps_for_pending_stores"] == hasattr(KVConnectorBase_V1, "has_pending_push_work")
    assert found["hybrid_kv_cache_manager"] == (
        found["kv_cache_manager_binding"] and found["request_level_load_failures"]
    )


def test_several_kv_groups_are_refused_only_where_vllm_cannot_recompute_them() -> None:
    compat.check_kv_groups(1)
    if compat.SEVERAL_KV_GROUPS:
        compat.check_kv_groups(3)
    else:
        with pytest.raises(ConfigError, match="--disable-hybrid-kv-cache-manager"):
            compat.check_kv_groups(3)


# ------------------------------------------------------------------ restarts in new processes
def _child(model_dir: str, ssd: Path, mode: str, seed: str | None) -> dict[str, object]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    if seed is not None:
        env["PYTHONHASHSEED"] = seed
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(TESTS_DIR), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        argv("vllm_restart_child", model_dir, str(ssd), mode),
        cwd=TESTS_DIR,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("seed", [None, "1234"], ids=["no-seed", "seed"])
def test_a_new_process_hits_what_the_last_one_stored(
    model_dir: str, tmp_path: Path, seed: str | None
) -> None:
    """The README's launch line as written (no PYTHONHASHSEED) and with a seed: a fresh engine
    process on the same SSD directory loads the prompt's blocks, bit-exact, with the same
    output; vLLM's block hashes agree across the two processes."""
    ssd = tmp_path / "ssd"
    stored = _child(model_dir, ssd, "store", seed)
    assert stored["hit_blocks"] == 0 and stored["mismatches"] == []
    again = _child(model_dir, ssd, "load", seed)
    assert again["hashes"] == stored["hashes"]
    assert again["hit_blocks"] == 4, again
    assert again["mismatches"] == []
    assert again["outputs"] == stored["outputs"]


# ------------------------------------------------------------------ block tables before 0.31
def _output(new=(), cached=(), resumed=(), preempted=()):  # type: ignore[no-untyped-def]
    from types import SimpleNamespace

    return SimpleNamespace(
        preempted_req_ids=set(preempted),
        scheduled_new_reqs=[SimpleNamespace(req_id=r, block_ids=(ids,)) for r, ids in new],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, _ in cached],
            new_block_ids=[(ids,) if ids is not None else None for _, ids in cached],
            resumed_req_ids=set(resumed),
        ),
    )


def test_block_tables_follow_the_scheduler_output() -> None:
    """Where vLLM binds no KV cache manager: new requests bring their table, running ones
    append, a resumed one replaces its table, a preempted one loses it."""
    tables = compat.BlockTables()
    tables.offer(_output(new=[("a", [1, 2]), ("b", [3])]))
    tables.offer(_output(cached=[("a", [4]), ("b", None)]))
    assert tables.get("a") == ([1, 2, 4],) and tables.get("b") == ([3],)
    tables.offer(_output(preempted=["a"]))
    assert tables.get("a") == ([],)
    tables.offer(_output(cached=[("a", [7, 8, 9])], resumed=["a"]))
    assert tables.get("a") == ([7, 8, 9],)
    tables.set("c", ([5, 6],))
    tables.forget("b")
    assert tables.get("c") == ([5, 6],) and tables.get("b") == ([],) and len(tables) == 2
