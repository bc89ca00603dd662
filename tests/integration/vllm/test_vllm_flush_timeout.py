"""A preemption flush that times out, against vLLM 0.33's real Scheduler (see vllm_harness).

vLLM hands a preempted request's blocks to other requests in the very step it preempts it, so
the worker waits (bounded) for the stores still copying those blocks. Here the copy is held back
deterministically: the CPU transfer engine runs GPU->host copies in order on one thread, and a
task the test queues ahead of them waits on a threading.Event (a stuck copy engine). The flush
must give up without failing the step, the late copy (which then reads another request's KV)
must never be committed, and nothing may leak or load wrong KV afterwards.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest
import torch
from helpers import vllm_harness as vh

from flexkv_py.integration.vllm import FlexKVConnectorV1, worker_side

# Every test runs with the built-in connector name and with kv_connector_module_path.
pytestmark = pytest.mark.usefixtures("connector_form")

BS = 16
WORKER_LOG = "flexkv_py.integration.vllm.worker_side"


def _engine(model_dir: str, **kw: Any) -> vh.Engine:
    return vh.Engine(model_dir, vh.connector_transfer_config({"cpu_cache_gb": 0.004}), **kw)


def _reference_outputs(model_dir: str, prompt: list[int], max_tokens: int) -> list[int]:
    e = _engine(model_dir)
    e.add(vh.make_request("ref", prompt, max_tokens=max_tokens))
    e.run()
    e.shutdown()
    return e.outputs["ref"]


def _manager_stats(e: vh.Engine) -> dict[str, Any]:
    return e.connector.scheduler_side._mgr.stats()  # type: ignore[no-any-return]


def test_flush_timeout_abandons_the_stores_and_never_commits_them(
    model_dir: str, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The flush must time out (the copies are held below): make that quick.
    monkeypatch.setattr(worker_side, "FLUSH_TIMEOUT_S", 0.05)
    # 6 usable blocks: A (2 blocks, decoding) and B (a 4-block prompt) fill them, so B's first
    # decode token finds no block and B is preempted; A's next block is then B's 4th block.
    e = _engine(model_dir, num_blocks=7)
    w = e.workers[0]
    worker = w.connector.worker_side
    gate = threading.Event()
    worker.executor.transfer._executors["d2h"].submit(gate.wait)
    a_prompt, b_prompt = vh.prompt_tokens(1, 2 * BS - 1), vh.prompt_tokens(2, 4 * BS)
    try:
        a = e.add(vh.make_request("A", a_prompt, max_tokens=40))
        b = e.add(vh.make_request("B", b_prompt, max_tokens=8))
        e.run_until(lambda: b.num_computed_tokens == 4 * BS)
        b_blocks = list(e.scheduler.kv_cache_manager.get_block_ids("B")[0])
        assert len(b_blocks) == 4
        b_kv = [w.model.block_bits(g) for g in b_blocks]
        with caplog.at_level(logging.ERROR, logger=WORKER_LOG):
            e.run_until(lambda: b.num_preemptions > 0)  # the flush times out: no raise
        assert any(
            r.levelno == logging.ERROR and "abandoned" in r.getMessage() for r in caplog.records
        )
        # B's stores are all still held (every copy is), and were all abandoned.
        held = [g for (req, kind, ids) in worker._inflight.values() if req == "B" for g in ids]
        assert sorted(held) == sorted(b_blocks)

        def reused() -> bool:  # A wrote its KV into one of B's blocks
            return any(
                not all(torch.equal(x, y) for x, y in zip(w.model.block_bits(g), kv, strict=True))
                for g, kv in zip(b_blocks, b_kv, strict=True)
            )

        e.run_until(reused)
        assert a.num_preemptions == 0
    finally:
        gate.set()  # the late copies run now, reading what A wrote into B's old blocks
    e.run()
    assert not e.mismatches()  # B's resume did not load the late copy's wrong KV
    # The abandoned store's 4 blocks failed (never committed); every other store succeeded.
    assert _manager_stats(e)["store_failed_blocks"] == 4
    # ... and the connector's stats (what vLLM logs and Prometheus exports) say so.
    total = FlexKVConnectorV1.build_kv_connector_stats()
    for s in e.stats:
        total.aggregate(FlexKVConnectorV1.build_kv_connector_stats(s))
    reduced = total.reduce()
    assert reduced["flush_timeouts"] == 1 and reduced["store_abandoned_jobs"] >= 1
    assert e.outputs["A"] == _reference_outputs(model_dir, a_prompt, 40)
    assert e.outputs["B"] == _reference_outputs(model_dir, b_prompt, 8)
    vh.assert_no_leaks(e)

    # What the cache holds for B's prefix now is right: a new request loads and checks it.
    e.reset_gpu_prefix_cache()
    e.add(vh.make_request("C", b_prompt + vh.prompt_tokens(3, BS), max_tokens=2))
    e.run()
    assert any("C" in rec.finished_recving for rec in e.history), "C did not load from FlexKV"
    assert not e.mismatches()
    vh.assert_no_leaks(e)
    e.shutdown()
