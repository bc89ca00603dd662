"""Disaggregated prefill lines with NIXL, as published: Dynamo's `PdConnector` (PyPI `kvbm`)
and vLLM's own `MultiConnector`, each with [FlexKVConnectorV1, NixlConnector] children built by
vLLM's factory from the exact JSON, driven end to end by vLLM's scheduler and worker-side calls
on CPU: stores, bit-exact reloads, restart, corrupt SSD data, preemption."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from helpers import vllm_harness as vh
from helpers.vllm_versions import needs_kv_groups, needs_nixl_on_cpu
from vllm.v1.request import RequestStatus

from flexkv_py.integration.vllm import FlexKVConnectorV1

pytestmark = needs_nixl_on_cpu

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


def loaded(e: vh.Engine, req_id: str) -> bool:
    return any(req_id in rec.finished_recving for rec in e.history)


def run_twice(e: vh.Engine, prompt: list[int], bs: int) -> None:
    """A computes `prompt`; the GPU prefix cache is dropped; B must come back from our tiers."""
    e.add(vh.make_request("A", prompt, block_size=bs))
    e.run()
    e.reset_gpu_prefix_cache()
    e.add(vh.make_request("B", prompt, block_size=bs))
    e.run()


# ------------------------------------------------------------------- Dynamo's PdConnector
def pd_engine(model_dir: str, transfer: dict[str, Any] = PD_PREFILL, **kw: Any) -> vh.Engine:
    # NIXL's CPU path wants blocks of 32 tokens; HMA off: this model has one group anyway.
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
    flexkv, nixl = vh.children(e.connector)
    assert type(flexkv) is FlexKVConnectorV1 and isinstance(nixl, NixlConnector)
    # Left at vLLM's default, the policy became "recompute" where the scheduler reads it.
    assert e.scheduler.recompute_kv_load_failures
    run_twice(e, prompt, 32)
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


@needs_kv_groups
@pytest.mark.parametrize("wrapper", ["PdConnector", "MultiConnector"])
def test_pd_connector_with_nixl_keeps_hma(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, wrapper: str
) -> None:
    # Both wrappers declare HMA only when every child does: with ours and NIXL's, vLLM keeps its
    # hybrid KV cache manager on, and a sliding-window model stores and reloads through us.
    monkeypatch.setenv("FLEXKV_CPU_CACHE_GB", "0.01")
    transfer = {"PdConnector": PD_PREFILL, "MultiConnector": MULTI_PREFILL}[wrapper]
    e = vh.Engine(
        vh.hybrid_model_dir(tmp_path),
        json.loads(json.dumps(transfer)),
        block_size=32,
        num_blocks=64,
        process_group=True,
        hybrid=True,
    )
    assert e.vllm_config.scheduler_config.disable_hybrid_kv_cache_manager is False
    assert len(e.kv_cache_config.kv_cache_groups) == 2
    prompt = vh.prompt_tokens(304, 10 * 32)
    run_twice(e, prompt, 32)
    assert loaded(e, "B")
    # A block-aligned prompt hits in full: only its last token and the decode tokens are computed.
    assert e.workers[0].model.written["B"] == 1 + 3
    assert e.outputs["B"] == e.outputs["A"]
    assert not e.mismatches()
    vh.assert_no_leaks(e)
    e.shutdown()


@pytest.mark.parametrize("transfer", [PD_PREFILL, MULTI_PREFILL], ids=["PdConnector", "Multi"])
def test_each_job_runs_once_under_the_wrapper(
    model_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, transfer: dict[str, Any]
) -> None:
    """Dynamo's PdConnector binds its children's metadata twice per step (MultiConnector's
    bind, then its own loop). Taken twice, every store and load ran twice on the worker: the
    first run's end freed the job's host slots and GPU blocks while the second still copied
    into them, so SSD blocks were written from slots holding other KV (content hash failures)
    and loads landed in GPU blocks vLLM had handed to other requests (wrong KV, under slow
    SSD writes: test_vllm_pd_load.py). Each job must reach the executor once."""
    from flexkv_py.coordinator.executor import JobExecutor

    (tmp_path / "ssd").mkdir()
    monkeypatch.setenv("FLEXKV_SSD_CACHE_DIR", str(tmp_path / "ssd"))
    monkeypatch.setenv("FLEXKV_SSD_CACHE_GB", "0.03")
    monkeypatch.setenv("FLEXKV_CPU_CACHE_GB", "0.004")
    submitted: list[int] = []
    submit = JobExecutor.submit

    def counting_submit(self: JobExecutor, job: Any, fill: Any = None) -> Any:
        submitted.append(job.job_id)
        return submit(self, job, fill)

    monkeypatch.setattr(JobExecutor, "submit", counting_submit)
    e = pd_engine(model_dir, transfer)
    run_twice(e, vh.prompt_tokens(7, 4 * 32 + 5), 32)
    assert loaded(e, "B")
    assert len(submitted) >= 2, "a store and a load"
    assert len(submitted) == len(set(submitted)), f"jobs run twice: {sorted(submitted)}"
    assert not e.mismatches()
    vh.assert_no_leaks(e)
    e.shutdown()
