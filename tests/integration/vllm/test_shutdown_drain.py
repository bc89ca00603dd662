"""The connector's shutdown drain (integration/vllm/shutdown_drain.py): host blocks that never
reached the SSD (write-behind off here, so only the drain can write them) are on the SSD after
shutdown and hit after a restart, bit-exact; a stuck device does not make shutdown exceed its
budget; a reset_cache before shutdown means nothing of before it is written."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import vllm_harness as vh
from vllm.v1.request import RequestStatus

from flexkv_py import _native
from flexkv_py.index.tier_names import Tier

pytestmark = pytest.mark.usefixtures("connector_form")

BS = 16
BUDGET_S = 0.5
MARGIN_S = 10.0  # scheduling noise on a busy 2-core test machine; the device is 60x slower


@pytest.fixture(autouse=True)
def _delays_back_on() -> Iterator[None]:
    _native.set_fault_delays(True)
    yield
    _native.set_fault_delays(True)


_MODEL: list[str] = []


@pytest.fixture(autouse=True)
def _model(model_dir: str) -> None:
    _MODEL[:] = [model_dir]


def _engine(ssd: Path, **kw: Any) -> vh.Engine:
    # write_back admission (the default) with write-behind off: nothing reaches the SSD by itself.
    extra = vh.with_ssd(ssd, admission="write_back", write_behind_lag_s=0, **kw)
    return vh.Engine(_MODEL[0], vh.connector_transfer_config(extra))


def _blocks(e: vh.Engine, req_id: str, n: int) -> list[torch.Tensor]:
    ids = e.scheduler.kv_cache_manager.get_block_ids(req_id)[0][:n]
    return [t for b in ids for t in e.workers[0].model.block_bits(b)]


def _prompt_done(req: Any) -> Any:
    """After an async load vLLM sets num_computed_tokens before the KV arrives: wait for RUNNING."""
    return lambda: (
        req.status == RequestStatus.RUNNING and req.num_computed_tokens >= len(req.prompt_token_ids)
    )


def _compute(e: vh.Engine, req_id: str, prompt: list[int]) -> list[torch.Tensor]:
    req = e.add(vh.make_request(req_id, prompt, max_tokens=3))
    e.run_until(_prompt_done(req))
    bits = [t.clone() for t in _blocks(e, req_id, 4)]
    e.run()
    return bits


def _loaded(e: vh.Engine, req_id: str) -> bool:
    return any(req_id in rec.finished_recving for rec in e.history)


def _ssd_blocks(e: vh.Engine) -> int:
    return len(e.workers[0].connector._worker.executor.stored_keys(Tier.SSD))


def test_shutdown_writes_host_only_blocks_to_the_ssd(tmp_path: Path) -> None:
    prompt = vh.prompt_tokens(61, 4 * BS)
    # 30 s: a busy disk may not stop the drain here (its budget is tested apart, BUDGET_S).
    e1 = _engine(tmp_path / "ssd", shutdown_drain_s=30)
    bits = _compute(e1, "A", prompt)
    assert _ssd_blocks(e1) == 0  # write-behind off: only in host memory before shutdown
    e1.shutdown()

    e2 = _engine(tmp_path / "ssd")
    assert _ssd_blocks(e2) >= 4
    b = e2.add(vh.make_request("B", prompt, max_tokens=3))
    e2.run_until(_prompt_done(b))
    assert _loaded(e2, "B"), "no hit after restart: the drain did not write the blocks"
    assert all(torch.equal(x, y) for x, y in zip(bits, _blocks(e2, "B", 4), strict=True))
    e2.run()
    assert not e2.mismatches()
    e2.shutdown()


def test_the_drain_writes_only_what_min_hits_admits(tmp_path: Path) -> None:
    """With admission min_hits:2 the drain writes a block only once the admission filter counts
    two accesses (its store and a connector hit), as write-behind and eviction would: a block
    seen once is not worth its SSD wear at shutdown either."""
    extra = vh.with_ssd(
        tmp_path / "ssd", admission="min_hits:2", write_behind_lag_s=0, shutdown_drain_s=30
    )
    e1 = vh.Engine(_MODEL[0], vh.connector_transfer_config(extra))
    once, again = vh.prompt_tokens(65, 4 * BS), vh.prompt_tokens(66, 4 * BS)
    _compute(e1, "once", once)
    bits = _compute(e1, "again", again)
    e1.reset_gpu_prefix_cache()
    _compute(e1, "again2", again)  # read back from the host tier: a second access
    assert _loaded(e1, "again2")
    assert _ssd_blocks(e1) == 0  # write-behind off: nothing on the SSD before shutdown
    e1.shutdown()

    e2 = _engine(tmp_path / "ssd")
    assert _ssd_blocks(e2) == 4  # again's, not once's
    for req_id, prompt, hit in (("a", once, False), ("b", again, True)):
        req = e2.add(vh.make_request(req_id, prompt, max_tokens=3))
        e2.run_until(_prompt_done(req))
        if hit:
            assert all(torch.equal(x, y) for x, y in zip(bits, _blocks(e2, "b", 4), strict=True))
        e2.run()
        assert _loaded(e2, req_id) == hit, f"{req_id}: expected drained={hit}"
    assert not e2.mismatches()
    e2.shutdown()


def test_no_drain_budget_writes_nothing(tmp_path: Path) -> None:
    e1 = _engine(tmp_path / "ssd", shutdown_drain_s=0)
    _compute(e1, "A", vh.prompt_tokens(62, 4 * BS))
    e1.shutdown()
    e2 = _engine(tmp_path / "ssd")
    assert _ssd_blocks(e2) == 0
    e2.shutdown()


def test_reset_before_shutdown_drains_nothing_of_before_it(tmp_path: Path) -> None:
    e1 = _engine(tmp_path / "ssd")
    _compute(e1, "A", vh.prompt_tokens(63, 4 * BS))
    assert e1.scheduler.reset_prefix_cache(reset_connector=True)
    e1.step()  # the step that carries the reset to the workers
    e1.shutdown()
    e2 = _engine(tmp_path / "ssd")
    assert _ssd_blocks(e2) == 0
    e2.shutdown()


def test_a_stuck_device_does_not_make_shutdown_exceed_its_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLEXKV_FAULT_INJECTION", "write:DELAY30000:1")
    e = _engine(tmp_path / "ssd", shutdown_drain_s=BUDGET_S)
    _compute(e, "A", vh.prompt_tokens(64, 4 * BS))
    worker = e.workers[0].connector
    started = time.monotonic()
    worker.shutdown()
    took = time.monotonic() - started
    _native.set_fault_delays(False)  # the late write completes (its host slots stayed mapped)
    e.scheduler.shutdown()
    assert took < BUDGET_S + MARGIN_S, f"shutdown took {took:.1f} s with a {BUDGET_S} s budget"
