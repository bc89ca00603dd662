"""Test-wide settings and fixtures.

Hypothesis runs derandomized by default, so CI explores the same examples on every run and a
failure reproduces anywhere; `HYPOTHESIS_PROFILE=explore` draws fresh random examples (and more
of them) when hunting for new bugs locally. Neither profile times examples (no `deadline`, no
too-slow health check): on a loaded 2-core CI machine one slow example would fail a correct test.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

# vLLM picks its platform once per process, at the first use: every test module sees the CPU one
# (NixlConnector, for one, refuses an unresolved platform), whichever imports vLLM first.
os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


import pytest
import vllm_platform  # noqa: F401  (vLLM's CPU platform on every release)
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
    harness = sys.modules.get("vllm_harness")
    if harness is not None:
        harness.shutdown_open_engines()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    # vLLM connector tests run with both ways of naming the connector (see vllm_harness).
    if "connector_form" in metafunc.fixturenames:
        import vllm_harness

        metafunc.parametrize("connector_form", vllm_harness.CONNECTOR_FORMS, indirect=True)


@pytest.fixture
def connector_form(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    import vllm_harness

    monkeypatch.setattr(vllm_harness, "CONNECTOR_FORM", request.param)
    return str(request.param)


@pytest.fixture(params=["bfloat16", "float32"])
def ssm_state_dtype(request: pytest.FixtureRequest) -> Iterator[str]:
    """State-space tests run with both SSM state dtypes on any CPU: vLLM's CPU platform picks one
    by a CPU feature (tests/ssm_model.py `state_dtype`)."""
    import ssm_model

    with ssm_model.state_dtype(request.param):
        yield str(request.param)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A local model directory holding only a tiny config.json (vLLM tests, no weights)."""
    import vllm_harness

    return vllm_harness.tiny_model_dir(tmp_path_factory.mktemp("model"))


def pytest_configure(config: pytest.Config) -> None:
    # tests/test_cuda.py: real CUDA tensors; skipped where torch.cuda.is_available() is False.
    config.addinivalue_line(
        "markers", "cuda: needs an NVIDIA GPU (skipped when torch.cuda.is_available() is False)"
    )
