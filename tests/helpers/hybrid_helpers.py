"""What the hybrid-model test files (test_vllm_hybrid.py, test_vllm_ssm.py) read of a harness
engine: stats, loads, a group's block bytes, and vLLM's config warnings."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from helpers import vllm_harness as vh

TURNING_OFF = "Turning off hybrid kv cache manager"


def stat_total(e: vh.Engine, key: str) -> float:
    return sum(s.get(key, 0) for s in e.stats)


def loaded(e: vh.Engine, req_id: str) -> bool:
    return any(req_id in rec.finished_recving for rec in e.history)


def group_bits(e: vh.Engine, req_id: str, group: int, lo: int, hi: int) -> list[torch.Tensor]:
    """Rank 0's bytes of the request's blocks [lo, hi) in one KV cache group (none null)."""
    ids = e.scheduler.kv_cache_manager.get_block_ids(req_id)[group][lo:hi]
    assert all(ids), f"{req_id}: null block in group {group} [{lo}, {hi}): {ids}"
    return [t for b in ids for t in e.workers[0].model.block_bits(b, group)]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@contextmanager
def vllm_config_warnings() -> Iterator[list[str]]:
    """Messages vLLM's config module logs (its loggers do not reach caplog)."""
    seen: list[str] = []

    class _Sink(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append(record.getMessage())

    sink = _Sink(logging.WARNING)
    log = logging.getLogger("vllm.config.vllm")
    log.addHandler(sink)
    try:
        yield seen
    finally:
        log.removeHandler(sink)


def compute_then_reload(e: vh.Engine, prompt: list[int]) -> None:
    """A computes `prompt`; the GPU prefix cache is cleared; B asks for it again and loads it."""
    e.add(vh.make_request("A", prompt, max_tokens=3, block_size=e.block_size))
    e.run()
    e.reset_gpu_prefix_cache()
    e.add(vh.make_request("B", prompt, max_tokens=3, block_size=e.block_size))
    e.run()
    assert loaded(e, "B")


def finish_clean(e: vh.Engine, *same_output: str) -> None:
    """The requests named gave the same output; no KV mismatch was seen, nothing leaked."""
    outputs = [e.outputs[r] for r in same_output]
    assert all(o == outputs[0] for o in outputs)
    assert not e.mismatches()
    vh.assert_no_leaks(e)
    e.shutdown()


def assert_load_failed_then_recomputed(
    e: vh.Engine, req: Any, written: int, outputs: list[int]
) -> None:
    """`req`'s load failed through `failed_recving` (never block-level errors, which vLLM
    refuses with several groups); vLLM recomputed `written` tokens on rank 0 and the request
    finished with `outputs`; then as `finish_clean`."""
    from vllm.v1.request import RequestStatus

    rid = req.request_id
    assert any(rid in rec.failed_recving for rec in e.history), "failed load not reported"
    assert not any(rec.invalid_block_ids for rec in e.history)
    assert req.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert e.workers[0].model.written[rid] == written
    assert e.outputs[rid] == outputs
    finish_clean(e)


def compute_and_shut_down(e: vh.Engine, req: Any) -> list[int]:
    """`e` computes `req` (e.g. onto its SSD tier) and shuts down; the request's output."""
    e.add(req)
    e.run()
    e.shutdown()
    return e.outputs[req.request_id]


def assert_corrupt_ssd_recomputes(
    engine: Callable[..., vh.Engine],
    request: Callable[[str, list[int]], Any],
    model_dir: str,
    ssd_dir: Path,
    prompt: list[int],
    written: int,
) -> None:
    """An engine computes `prompt` onto its SSD tier; with the SSD data corrupted, a new engine's
    load of it fails through `failed_recving` and vLLM recomputes `written` tokens with the same
    output (`assert_load_failed_then_recomputed`)."""
    outputs = compute_and_shut_down(engine(model_dir, vh.with_ssd(ssd_dir)), request("A", prompt))
    assert vh.corrupt_ssd(ssd_dir) >= 1
    e2 = engine(model_dir, vh.with_ssd(ssd_dir), failure_policy="recompute")
    b = e2.add(request("B", prompt))
    e2.run()
    assert_load_failed_then_recomputed(e2, b, written, outputs)
