"""Test-wide settings, fixtures and markers.

Layout: tests/unit/<package>/ mirrors flexkv_py's packages (unit/store: the native Rust store's
bindings) and holds fast in-process tests; tests/integration/<area>/ holds the rest (vllm: vLLM's
scheduler and connector, s3: a SeaweedFS server, crash: writers killed or faulted in child
processes, cli: the `flexkv-py` command, process: other child interpreters, replay, cuda, soak);
tests/helpers/ the shared helper modules and helpers/writers/ the scripts tests start as child
processes. Markers are applied here by directory (see `pytest_collection_modifyitems`).

Hypothesis runs derandomized by default, so CI explores the same examples on every run and a
failure reproduces anywhere; `HYPOTHESIS_PROFILE=explore` draws fresh random examples (and more
of them) when hunting for new bugs locally. Neither profile times examples (no `deadline`, no
too-slow health check): on a loaded 2-core CI machine one slow example would fail a correct test.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

# vLLM picks its platform once per process, at the first use: every test module sees the CPU one
# (NixlConnector, for one, refuses an unresolved platform), whichever imports vLLM first.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


import pytest
from helpers import vllm_platform  # noqa: F401  (vLLM's CPU platform on every release)
from hypothesis import HealthCheck, settings

_UNTIMED = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow]}
settings.register_profile("default", derandomize=True, print_blob=True, **_UNTIMED)
settings.register_profile("explore", derandomize=False, max_examples=500, **_UNTIMED)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tests never see the developer's FLEXKV_* / DYNAMO_USE_FLEXKV settings."""
    for name in list(os.environ):
        if name.startswith("FLEXKV_") or name == "DYNAMO_USE_FLEXKV":
            monkeypatch.delenv(name)


@pytest.fixture(autouse=True)
def _shutdown_open_engines() -> Iterator[None]:
    """An engine a test left open (it failed or stalled before `shutdown`) is shut down before
    the next test: its connectors' threads and SSD locks, and vLLM's process-wide distributed
    state, would otherwise leak into later tests."""
    yield
    harness = sys.modules.get("helpers.vllm_harness")
    if harness is not None:
        harness.shutdown_open_engines()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    # vLLM connector tests run with both ways of naming the connector (see vllm_harness).
    if "connector_form" in metafunc.fixturenames:
        from helpers import vllm_harness

        metafunc.parametrize("connector_form", vllm_harness.CONNECTOR_FORMS, indirect=True)


@pytest.fixture
def connector_form(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    from helpers import vllm_harness

    monkeypatch.setattr(vllm_harness, "CONNECTOR_FORM", request.param)
    return str(request.param)


@pytest.fixture(params=["bfloat16", "float32"])
def ssm_state_dtype(request: pytest.FixtureRequest) -> Iterator[str]:
    """State-space tests run with both SSM state dtypes on any CPU: vLLM's CPU platform picks one
    by a CPU feature (tests/helpers/ssm_model.py `state_dtype`)."""
    from helpers import ssm_model

    with ssm_model.state_dtype(request.param):
        yield str(request.param)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A local model directory holding only a tiny config.json (vLLM tests, no weights)."""
    from helpers import vllm_harness

    return vllm_harness.tiny_model_dir(tmp_path_factory.mktemp("model"))


# Markers (registered in pyproject.toml, which runs pytest with --strict-markers), by directory
# under tests/ ...
_MARKS_BY_DIR = {
    "unit": ("unit",),
    "integration/vllm": ("vllm",),
    "integration/s3": ("s3",),
    "integration/crash": ("subprocess",),
    "integration/cli": ("subprocess",),
    "integration/process": ("subprocess",),
    "integration/cuda": ("cuda",),
    "integration/soak": ("vllm", "subprocess", "slow"),
    "integration/replay": ("slow",),
}
# ... and by file, where a file outside those directories also starts child processes or drives
# vLLM's scheduler.
_MARKS_BY_FILE = {
    "test_restart_announce.py": ("subprocess",),
    "test_restart_first_hit.py": ("subprocess",),
    "test_vllm_dropin.py": ("subprocess",),
    "test_vllm_versions.py": ("subprocess",),
    "test_object_claims.py": ("subprocess",),
    "test_object_replay.py": ("subprocess",),
    "test_object_share.py": ("subprocess",),
    "test_object_tier.py": ("subprocess",),
    "test_object_hybrid.py": ("vllm", "subprocess"),
    "test_object_wiring_vllm.py": ("vllm", "subprocess"),
    "test_object_counters.py": ("vllm",),
    "test_object_policy_vllm.py": ("vllm",),
    "test_object_wiring_faults.py": ("vllm",),
}
# The slowest tests, as "file" or "file::test" (a prefix of the node id without its path and
# parameters): they get `slow`, and under tests/unit they do NOT get `unit`, so that `-m unit`
# stays a fast loop (`pytest tests/unit` still runs them). From `--durations=60` of the whole
# suite on the loaded 2-core dev VM: every test of 20 s or more, and the unit state machines.
_SLOW = (
    "test_native_stub.py",  # mypy stubtest: ~130 s
    "test_replay_conversation.py",
    "test_restart_announce.py",
    "test_restart_first_hit.py",  # ~30 s a test, the module's child writer included
    "test_vllm_pd_load.py",
    "test_vllm_versions.py::test_a_new_process_hits_what_the_last_one_stored",
    "test_vllm_dropin.py::test_restricted_plugins_fail_at_start_naming_both_fixes",
    "test_vllm_dropin.py::test_original_flexkv_beside_us_is_refused_naming_both",
    "test_object_gc.py::test_gc_under_concurrent_writers_keeps_what_live_manifests_reference",
    "test_object_faults.py::test_server_killed_mid_batch_then_restarted",
    "test_object_hybrid.py::test_a_consumer_process_hits_a_sliding_window_model_from_the_bucket",
    "test_object_wiring_vllm.py::test_a_consumer_process_loads_the_producers_prompt_from_the_bucket",
    "test_object_wiring_faults.py::test_a_server_that_went_down_is_a_miss_and_serving_goes_on",
    "test_object_server.py::test_conditional_create_and_kill9_keep_data",
    "test_cli.py::test_replay_synthetic_quick_json_and_plot",
    "test_write_behind.py::test_kill_9_loses_at_most_the_lag_and_no_acknowledged_block",
    # Hypothesis state machines under tests/unit: 8-25 s each.
    "test_index.py::test_tier_index_state_machine",
    "test_block_set.py::test_block_set_state_machine",
    "test_store_model.py::TestStoreModel",
)
_TESTS = Path(__file__).parent


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    # `-m unit` selects nothing under tests/integration: skip importing it (vLLM, S3, ...).
    if config.getoption("markexpr") == "unit" and collection_path == _TESTS / "integration":
        return True
    return None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        path = Path(item.path)
        try:
            rel = path.relative_to(_TESTS).parent.as_posix()
        except ValueError:
            continue
        names: list[str] = []
        for prefix, marks in _MARKS_BY_DIR.items():
            if rel == prefix or rel.startswith(prefix + "/"):
                names += marks
        names += _MARKS_BY_FILE.get(path.name, ())
        test = f"{path.name}::{item.nodeid.split('::', 1)[-1].split('[', 1)[0]}"
        if any(test == slow or test.startswith(slow + "::") for slow in _SLOW):
            names = [name for name in names if name != "unit"] + ["slow"]
        for name in dict.fromkeys(names):
            item.add_marker(name)
