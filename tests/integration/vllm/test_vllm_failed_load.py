"""A request whose async load failed is recomputed, never offered the same load again, and a
shorter load only while vLLM accepts it.

Found by the load tests (test_vllm_pd_load.py, integration/soak/test_soak.py) on a small host tier:
a load promised at lookup found no host slot free to stage its SSD blocks (`load_no_slot_blocks`)
and failed as a whole. The blocks stayed on the SSD, so the next lookup promised them again:
- the same shortage failed it again, a hundred times in a row;
- vLLM (0.33) keeps a request whose async load failed with no valid token in its in-flight
  prefills. A second async load then reserves the request's own blocks against itself; when they
  do not fit twice, the request is refused at the head of the waiting queue every step and the
  engine never schedules anything again (requests stuck in WAITING_FOR_REMOTE_KVS behind it).

Here the shortage is made exact: the restarted engine's first load gets no staging slot."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from helpers import vllm_harness as vh
from helpers.hybrid_helpers import stat_total

from flexkv_py.index.tier_names import Tier

BS = 16
NUM_BLOCKS = 16  # the prompt's 9 blocks fit once, not twice (vLLM's reservation above)


def manager(e: vh.Engine) -> Any:
    return e.connector._scheduler._mgr


def no_slot_for_the_first_load(
    mgr: Any, monkeypatch: pytest.MonkeyPatch, forget_after: int | None = None
) -> list[int]:
    """The manager's first load gets no staging slot, as when every host slot is taken by
    stores in flight; with `forget_after`, the SSD tier also loses the load's blocks from
    there on meanwhile (evicted), so the next lookup is shorter. Returns the number of loads
    planned so far (a one-item list)."""
    loads = [0]
    take_slots = mgr.host.take_slots
    prepare_load = mgr.prepare_load
    starved = False

    def starving_take_slots(n: int, chained: list[Any]) -> list[int]:
        return [] if starved else take_slots(n, chained)

    def counting_prepare_load(*args: Any, **kw: Any) -> Any:
        nonlocal starved
        loads[0] += 1
        starved = loads[0] == 1
        if starved and forget_after is not None:
            keys = args[0] if args else kw["keys"]
            assert mgr.forget_on(Tier.SSD, keys[forget_after:]) > 0
        try:
            return prepare_load(*args, **kw)
        finally:
            starved = False

    monkeypatch.setattr(mgr.host, "take_slots", starving_take_slots)
    monkeypatch.setattr(mgr, "prepare_load", counting_prepare_load)
    return loads


def test_a_failed_load_is_recomputed_and_not_offered_again(
    model_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    transfer = vh.connector_transfer_config(vh.with_ssd(tmp_path / "ssd"))
    prompt = vh.prompt_tokens(1, 9 * BS)
    first = vh.Engine(model_dir, transfer, num_blocks=NUM_BLOCKS)
    first.add(vh.make_request("store", prompt, max_tokens=1))
    first.run()
    first.shutdown()

    # Restarted: the blocks are on the SSD only, so a load must stage them in host slots.
    e = vh.Engine(model_dir, transfer, num_blocks=NUM_BLOCKS)
    loads = no_slot_for_the_first_load(manager(e), monkeypatch)
    req = e.add(vh.make_request("again", [*prompt, *vh.prompt_tokens(2, 5)], max_tokens=3))
    e.run(timeout_s=30)

    assert req.is_finished()
    assert loads[0] == 1, "the failed load was offered again"
    assert any(rec.invalid_block_ids for rec in e.history), "the load did not fail"
    assert stat_total(e, "lookups_after_failed_load") >= 1
    assert not e.mismatches()  # recomputed, so every block it holds is right
    vh.assert_no_leaks(e)
    e.shutdown()


def test_a_shorter_reload_that_vllm_refuses_is_recomputed(
    model_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The failed load's tail left the SSD meanwhile: the next lookup ends sooner, so a load is
    offered again. vLLM (0.33) counts the request's own freed blocks, still reserved for it as
    an in-flight prefill, against that second load: its 10 blocks and the load's 8 do not fit
    in a pool of 16, refused at the head of the queue every step. Asked again without an
    allocation, the lookup answers "recompute" and the request runs (before: the engine
    scheduled nothing, forever)."""
    transfer = vh.connector_transfer_config(vh.with_ssd(tmp_path / "ssd"))
    prompt = [*vh.prompt_tokens(3, 9 * BS), *vh.prompt_tokens(4, 5)]
    first = vh.Engine(model_dir, transfer, num_blocks=NUM_BLOCKS)
    first.add(vh.make_request("store", prompt, max_tokens=1))
    first.run()
    expected = first.outputs["store"]
    first.shutdown()

    e = vh.Engine(model_dir, transfer, num_blocks=NUM_BLOCKS)
    loads = no_slot_for_the_first_load(manager(e), monkeypatch, forget_after=8)
    req = e.add(vh.make_request("again", prompt, max_tokens=1))
    e.run(timeout_s=30)

    assert req.is_finished()
    assert e.outputs["again"] == expected
    assert loads[0] == 1, "vLLM allocated for the second load: the scenario did not refuse it"
    assert stat_total(e, "reloads_refused_by_vllm") == 1
    assert not e.mismatches()
    vh.assert_no_leaks(e)
    e.shutdown()
