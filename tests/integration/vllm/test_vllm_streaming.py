"""Stores and loads larger than the free host slots, through vLLM's real
Scheduler (helpers/vllm_harness.py): the host tier is a staging area for the SSD, so a prefill of
more blocks than it has slots streams through them in rounds (GPU->host copy, SSD write, reuse)
and loads stream back the same way, instead of dropping blocks."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import vllm_harness as vh

from integration.vllm.test_vllm_connector import block_bits, engine, loaded, prompt_done

pytestmark = pytest.mark.usefixtures("connector_form")

BS = 16
PAGE = 2 * vh.NUM_LAYERS * vh.NUM_KV_HEADS * BS * vh.HEAD_SIZE * 2  # K and V, fp16: one slot
HOST_SLOTS = 8
BLOCKS = 12  # the case: 12 blocks in one prefill step, 8 host slots
TAIL = 5  # prompt tokens after the last full block
SLOW_WRITE_MS = 1500  # each SSD write (fault injector): far longer than a scheduler step


def streaming_extra(ssd_dir: Path, **kw: Any) -> dict[str, Any]:
    """A host tier of HOST_SLOTS slots over a 1 GiB SSD tier (a sparse file: test machines'
    temporary directories are shared and small)."""
    ssd_dir.mkdir(parents=True, exist_ok=True)
    return {
        "cpu_cache_gb": HOST_SLOTS * PAGE / (1 << 30),
        "ssd_cache_gb": 1,
        "ssd_cache_dir": str(ssd_dir),
        "ssd_preallocate": False,
        **kw,
    }


def manager_stats(e: vh.Engine) -> dict[str, Any]:
    (side,) = e.flexkv_scheduler_sides()
    return dict(side._mgr.stats())


def hit_in_full(e: vh.Engine, req_id: str, prompt: list[int], bits: list[torch.Tensor]) -> None:
    """`req_id` gets every full block of `prompt` from the connector, bit-identical to `bits`,
    and computes only the tail and its decode tokens."""
    e.reset_gpu_prefix_cache()
    req = e.add(vh.make_request(req_id, prompt, max_tokens=3))
    e.run_until(prompt_done(req))
    assert loaded(e, req_id), f"{req_id} did not load from the connector"
    got = block_bits(e, req_id, BLOCKS)
    assert all(torch.equal(x, y) for x, y in zip(bits, got, strict=True))
    e.run()
    assert e.workers[0].model.written[req_id] == TAIL + 2, "not all 192 tokens were loaded"
    assert not e.mismatches()
    vh.assert_no_leaks(e)


@pytest.mark.parametrize("admission", ["write_through", "write_back"])
def test_a_store_larger_than_the_host_tier_reaches_the_ssd_and_survives_a_restart(
    model_dir: str, tmp_path: Path, admission: str
) -> None:
    # write_back (the default) relies on write-behind for the blocks kept in host: a short
    # lag, so the restart below finds them.
    extra = streaming_extra(tmp_path / "ssd", admission=admission, write_behind_lag_s=0.05)
    prompt = vh.prompt_tokens(81, BLOCKS * BS + TAIL)
    e1 = engine(model_dir, extra)
    assert manager_stats(e1)["host_slots"] == HOST_SLOTS
    a = e1.add(vh.make_request("A", prompt, max_tokens=3))
    first = e1.step()
    assert first.scheduled["A"] == len(prompt), "the prefill was not one step"
    e1.run_until(prompt_done(a))
    bits = block_bits(e1, "A", BLOCKS)
    e1.run()
    stats = manager_stats(e1)
    # All but HOST_SLOTS - 1 stream through: one slot stays free for loads to stage through.
    assert stats["store_streamed_blocks"] == BLOCKS - HOST_SLOTS + 1
    assert stats["store_skipped_no_slot"] == 0
    assert stats["stored_blocks"] == BLOCKS
    hit_in_full(e1, "B", prompt, bits)  # part from SSD, through the host slots in rounds
    assert manager_stats(e1)["load_streamed_blocks"] > 0
    e1.run_until(lambda: manager_stats(e1)["index_on_ssd"] == BLOCKS, first=False)
    e1.shutdown()

    e2 = engine(model_dir, extra)  # a restart: new connectors, scheduler and KV tensors
    assert manager_stats(e2)["ssd_adopted_blocks"] == BLOCKS
    hit_in_full(e2, "C", prompt, bits)
    e2.shutdown()


def test_the_gpu_blocks_are_freed_once_the_last_rounds_copy_ended(
    model_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's delay-free contract: a finished request whose store still streams keeps its GPU
    blocks (request_finished said delay) until every round's GPU->host copy ended, and no
    longer: they are freed (finished_sending) while the last round's SSD write still runs."""
    monkeypatch.setenv("FLEXKV_FAULT_INJECTION", f"write:DELAY{SLOW_WRITE_MS}:1")
    extra = streaming_extra(tmp_path / "ssd", admission="write_through")
    e = engine(model_dir, extra)
    prompt = vh.prompt_tokens(82, BLOCKS * BS + TAIL)
    e.add(vh.make_request("A", prompt, max_tokens=1))  # finishes in its prefill step
    e.run_until(lambda: any("A" in rec.finished_sending for rec in e.history))
    assert manager_stats(e).get("stored_blocks", 0) == 0, "the store ended before the blocks left"
    e.run()
    stats = manager_stats(e)
    assert stats["store_streamed_blocks"] == BLOCKS - HOST_SLOTS + 1
    assert stats["stored_blocks"] == BLOCKS and stats["store_failed_blocks"] == 0
    assert stats["ssd_written_blocks"] == BLOCKS
    vh.assert_no_leaks(e)
    e.shutdown()


def test_without_an_ssd_tier_a_large_store_is_cut_not_streamed(model_dir: str) -> None:
    """No lower tier to stream to: the host tier keeps what fits, the head of the prefix."""
    e = engine(model_dir, {"cpu_cache_gb": HOST_SLOTS * PAGE / (1 << 30)})
    e.add(vh.make_request("A", vh.prompt_tokens(83, BLOCKS * BS + TAIL), max_tokens=2))
    e.run()
    stats = manager_stats(e)
    assert stats.get("store_streamed_blocks", 0) == 0
    assert stats["stored_blocks"] == HOST_SLOTS
    assert stats["store_skipped_no_slot"] == BLOCKS - HOST_SLOTS
    vh.assert_no_leaks(e)
    e.shutdown()
