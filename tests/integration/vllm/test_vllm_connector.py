"""FlexKVConnectorV1 against vLLM's real Scheduler (0.33; the oldest supported too, in CI), on
CPU KV tensors (see vllm_harness).

vLLM is a test dependency: if it is missing these tests fail at import, they never skip.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import vllm_harness as vh
from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
from vllm.v1.request import RequestStatus

from flexkv_py.errors import ConfigError
from flexkv_py.integration.vllm import FlexKVConnectorStats, FlexKVConnectorV1, compat

CacheHitSource = compat.CacheHitSource  # vLLM 0.33+

# Every test runs with the built-in connector name and with kv_connector_module_path.
pytestmark = pytest.mark.usefixtures("connector_form")

BS = 16


def host_only(**kw: Any) -> dict[str, Any]:
    return {"cpu_cache_gb": 0.004, **kw}


def engine(model_dir: str, extra: dict[str, Any], **kw: Any) -> vh.Engine:
    transfer_kw = {k: kw.pop(k) for k in ("kv_role", "failure_policy") if k in kw}
    return vh.Engine(model_dir, vh.connector_transfer_config(extra, **transfer_kw), **kw)


def block_bits(e: vh.Engine, req_id: str, nblocks: int, rank: int = 0) -> list[torch.Tensor]:
    ids = e.scheduler.kv_cache_manager.get_block_ids(req_id)[0][:nblocks]
    return [t for b in ids for t in e.workers[rank].model.block_bits(b)]


def loaded(e: vh.Engine, req_id: str) -> bool:
    return any(req_id in rec.finished_recving for rec in e.history)


def stat_total(e: vh.Engine, key: str) -> float:
    return sum(s.get(key, 0) for s in e.stats)


def prompt_done(req: Any) -> Any:
    """After an async load vLLM sets num_computed_tokens before the KV arrives: wait for RUNNING."""
    return lambda: (
        req.status == RequestStatus.RUNNING and req.num_computed_tokens >= len(req.prompt_token_ids)
    )


def run_prompt_then_snapshot(e: vh.Engine, req_id: str, prompt: list[int], nblocks: int) -> Any:
    """Run until `req_id`'s prompt is computed; return its first `nblocks` blocks' bytes."""
    req = e.add(vh.make_request(req_id, prompt, max_tokens=3))
    e.run_until(prompt_done(req))
    return block_bits(e, req_id, nblocks)


# ------------------------------------------------------------------------------------ core path
def test_store_then_external_hit_is_bit_identical(model_dir: str) -> None:
    e = engine(model_dir, host_only())
    prompt = vh.prompt_tokens(1, 5 * BS)  # 5 full blocks
    bits_a = run_prompt_then_snapshot(e, "A", prompt, 5)
    e.run()
    assert stat_total(e, "store_blocks") >= 5, "A's blocks were not offloaded"
    e.reset_gpu_prefix_cache()

    b = e.add(vh.make_request("B", prompt, max_tokens=3))
    e.run_until(prompt_done(b))
    assert loaded(e, "B"), "B did not load from the connector"
    bits_b = block_bits(e, "B", 5)
    assert all(torch.equal(x, y) for x, y in zip(bits_a, bits_b, strict=True))
    e.run()
    m = e.workers[0].model
    # The full-prompt hit is cut to len-1 by vLLM: only the last prompt token is recomputed.
    assert m.written["B"] == 1 + 2  # last prompt token + 2 decode tokens
    assert m.checked["B"] >= len(prompt) - 1
    assert e.outputs["A"] == e.outputs["B"]
    assert not e.mismatches()
    assert stat_total(e, "hit_blocks") == 5
    vh.assert_no_leaks(e)
    e.shutdown()


def test_no_false_hit_for_a_different_prefix(model_dir: str) -> None:
    e = engine(model_dir, host_only())
    e.add(vh.make_request("A", vh.prompt_tokens(1, 4 * BS)))
    e.run()
    e.reset_gpu_prefix_cache()
    other = vh.prompt_tokens(2, 4 * BS)
    e.add(vh.make_request("C", other))
    e.run()
    assert not loaded(e, "C")
    assert e.workers[0].model.written["C"] == 4 * BS + 3  # recomputed in full
    assert not e.mismatches()
    vh.assert_no_leaks(e)
    e.shutdown()


def test_partial_prefix_hit_then_new_suffix(model_dir: str) -> None:
    e = engine(model_dir, host_only())
    shared = vh.prompt_tokens(3, 3 * BS)
    e.add(vh.make_request("A", shared + vh.prompt_tokens(4, BS)))
    e.run()
    e.reset_gpu_prefix_cache()
    b = vh.prompt_tokens(5, 5 * BS, prefix=shared)
    e.add(vh.make_request("B", b))
    e.run()
    assert loaded(e, "B")
    assert e.workers[0].model.written["B"] == 2 * BS + 3  # only the new suffix (+ decode)
    assert not e.mismatches()
    vh.assert_no_leaks(e)
    e.shutdown()


def test_offload_during_chunked_prefill(model_dir: str) -> None:
    # 8 blocks with a 2-block token budget: stores must start before the prompt is done.
    e = engine(model_dir, host_only(), max_num_batched_tokens=2 * BS)
    req = e.add(vh.make_request("A", vh.prompt_tokens(6, 8 * BS), max_tokens=2))
    e.run_until(lambda: req.num_computed_tokens >= 4 * BS)
    assert req.num_computed_tokens < 8 * BS
    e.step()  # let the first stores complete and report
    assert stat_total(e, "store_blocks") >= 2, "no store before the prompt finished"
    e.run()
    assert stat_total(e, "store_blocks") >= 8
    vh.assert_no_leaks(e)
    e.shutdown()


# ------------------------------------------------------------------------------------ SSD
def test_restart_with_same_ssd_dir_still_hits(model_dir: str, tmp_path: Path) -> None:
    extra = vh.with_ssd(tmp_path / "ssd")
    prompt = vh.prompt_tokens(7, 4 * BS)
    e1 = engine(model_dir, extra)
    bits_a = run_prompt_then_snapshot(e1, "A", prompt, 4)
    e1.run()
    e1.shutdown()

    e2 = engine(model_dir, extra)  # new connectors, scheduler and KV tensors
    # Record what vLLM's scheduler gets for its hit-source metrics (the real method runs).
    sources: list[dict[Any, int]] = []
    connector = e2.scheduler.connector
    real_sources = connector.get_external_cache_hit_sources

    def recording(request: Any, num_tokens: int) -> dict[Any, int]:
        sources.append(real_sources(request, num_tokens))
        return sources[-1]

    connector.get_external_cache_hit_sources = recording  # type: ignore[method-assign]
    b = e2.add(vh.make_request("B", prompt, max_tokens=3))
    e2.run_until(prompt_done(b))
    assert loaded(e2, "B"), "no hit after restart"
    # The restart's hits come from disk (the SSD tier), and vLLM is told so (0.33+; older
    # releases have no hit-source metrics and never ask).
    if CacheHitSource is not None:
        assert sources == [{CacheHitSource.DISK: 4 * BS}]
    else:
        assert sources == []
    assert all(torch.equal(x, y) for x, y in zip(bits_a, block_bits(e2, "B", 4), strict=True))
    e2.run()
    assert e2.workers[0].model.written["B"] == 3
    assert not e2.mismatches()
    vh.assert_no_leaks(e2)
    e2.shutdown()


def _store_and_stop(model_dir: str, extra: dict[str, Any], prompt: list[int]) -> None:
    """An engine that stores `prompt`'s blocks (host and SSD) and shuts down."""
    e = engine(model_dir, extra)
    e.add(vh.make_request("A", prompt, max_tokens=2))
    e.run()
    e.shutdown()


def test_the_first_request_after_a_restart_hits_before_the_workers_report(
    model_dir: str, tmp_path: Path
) -> None:
    """The scheduler reads the SSD shards itself when it is built, so a restarted engine's very
    first request hits in the very first step (an asynchronous load, not "ask again later"),
    before any worker reported its inventory; the workers' reports then add nothing twice."""
    extra = vh.with_ssd(tmp_path / "ssd")
    prompt = vh.prompt_tokens(17, 4 * BS)
    _store_and_stop(model_dir, extra, prompt)
    e2 = engine(model_dir, extra, recover=False)
    (side,) = e2.flexkv_scheduler_sides()
    assert not side.recovered
    b = e2.add(vh.make_request("B", prompt, max_tokens=2))
    first = e2.step()
    assert "B" not in first.scheduled and b.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert side.recovered  # the workers' first output carried their reports
    e2.run()
    assert loaded(e2, "B") and b.is_finished()
    m = e2.workers[0].model
    assert m.written["B"] == 1 + 1  # the last prompt token (vLLM's cut) and one decode token
    assert m.checked["B"] >= len(prompt) - 1
    assert not e2.mismatches()
    assert side._mgr.stats()["ssd_adopted_blocks"] == 4
    vh.assert_no_leaks(e2)
    e2.shutdown()


def test_reset_before_the_restart_inventory_deletes_what_it_lists(
    model_dir: str, tmp_path: Path
) -> None:
    """A cache reset that comes before the workers' SSD reports: it forgets what the scheduler
    adopted from its own read of the shards, and the blocks the reports list predate the reset,
    so they are deleted, not adopted (no hit now, none after another restart)."""
    extra = vh.with_ssd(tmp_path / "ssd")
    prompt = vh.prompt_tokens(19, 4 * BS)
    _store_and_stop(model_dir, extra, prompt)
    e2 = engine(model_dir, extra, recover=False)
    (side,) = e2.flexkv_scheduler_sides()
    side._inventory.wait_read()  # as every scheduler call does first: the read runs on a thread
    adopted_early = side._mgr.stats()["ssd_adopted_blocks"]  # the scheduler's own read
    assert adopted_early == 4
    assert e2.scheduler.reset_prefix_cache(reset_connector=True)
    e2.wait_recovered()
    assert side._mgr.stats().get("ssd_adopted_blocks", 0) == adopted_early  # none from reports
    assert side._mgr.index.counts()["on_ssd"] == 0
    e2.step()  # the step that sends the deletes (the shutdown lets them finish)
    e2.shutdown()

    e3 = engine(model_dir, extra)
    e3.add(vh.make_request("C", prompt, max_tokens=2))
    e3.run()
    assert not loaded(e3, "C"), "a block stored before the reset was adopted"
    assert e3.workers[0].model.written["C"] == 4 * BS + 1
    assert not e3.mismatches()
    e3.shutdown()


def test_corrupt_ssd_data_is_a_load_error_and_recomputed(model_dir: str, tmp_path: Path) -> None:
    extra = vh.with_ssd(tmp_path / "ssd")
    prompt = vh.prompt_tokens(8, 4 * BS)
    e1 = engine(model_dir, extra)
    e1.add(vh.make_request("A", prompt))
    e1.run()
    e1.shutdown()

    # vLLM's kv_load_failure_policy left at its default ("fail"), as on the published lines.
    e2 = engine(model_dir, extra)
    assert e2.scheduler.recompute_kv_load_failures
    assert vh.corrupt_ssd(tmp_path / "ssd") >= 1
    e2.add(vh.make_request("B", prompt))
    e2.run()
    assert any(rec.invalid_block_ids for rec in e2.history), "corruption was not reported"
    assert loaded(e2, "B")
    assert not e2.mismatches(), "corrupt KV reached the model"
    # Everything from the first bad block on was recomputed.
    assert e2.workers[0].model.written["B"] >= 3 * BS
    assert e2.outputs["B"] == _reference_outputs(model_dir, prompt)
    vh.assert_no_leaks(e2)
    e2.shutdown()


def _reference_outputs(model_dir: str, prompt: list[int], max_tokens: int = 4) -> list[int]:
    """What an engine with a cold cache generates for `prompt`."""
    e = engine(model_dir, host_only())
    e.add(vh.make_request("ref", prompt, max_tokens=max_tokens))
    e.run()
    e.shutdown()
    return e.outputs["ref"]


# ------------------------------------------------------------------------------------ lifecycle
def test_preemption_keeps_kv_correct(model_dir: str) -> None:
    # 14 usable blocks for 3 requests that each grow to 4 blocks: decode must preempt.
    e = engine(model_dir, host_only(), num_blocks=15)
    reqs = [
        e.add(vh.make_request(f"P{i}", vh.prompt_tokens(20 + i, 3 * BS - 2), max_tokens=20))
        for i in range(3)
    ]
    e.run()
    assert any(r.num_preemptions > 0 for r in reqs), "scenario did not preempt"
    assert not e.mismatches()
    for r in reqs:
        ref = _reference_outputs(model_dir, list(r.prompt_token_ids or ()), max_tokens=20)
        assert e.outputs[r.request_id] == ref
    vh.assert_no_leaks(e)
    e.shutdown()


def test_abort_mid_prefill_and_during_load(model_dir: str) -> None:
    e = engine(model_dir, host_only(), max_num_batched_tokens=2 * BS)
    prompt = vh.prompt_tokens(30, 6 * BS)
    a = e.add(vh.make_request("A", prompt, max_tokens=5))
    e.run_until(lambda: a.num_computed_tokens >= 4 * BS)
    e.abort(["A"])  # stores of the first blocks may still be in flight
    e.run()
    vh.assert_no_leaks(e)
    assert stat_total(e, "store_blocks") >= 4, "an aborted request left no reusable KV"

    e.reset_gpu_prefix_cache()
    b = e.add(vh.make_request("B", prompt[: 4 * BS] + vh.prompt_tokens(31, BS)))
    e.step()  # lookup + async load planned
    assert b.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    e.abort(["B"])
    e.run()
    vh.assert_no_leaks(e)
    assert not e.mismatches()
    e.shutdown()


def test_32_concurrent_requests_share_a_prefix(model_dir: str) -> None:
    e = engine(model_dir, host_only(), num_blocks=256, max_num_batched_tokens=512)
    shared = vh.prompt_tokens(40, 2 * BS)
    prompts = [vh.prompt_tokens(100 + i, 4 * BS, prefix=shared) for i in range(32)]
    for i, p in enumerate(prompts):
        e.add(vh.make_request(f"W{i}", p))
    e.run()
    e.reset_gpu_prefix_cache()
    for i, p in enumerate(prompts):
        e.add(vh.make_request(f"R{i}", p))
    e.run()
    m = e.workers[0].model
    hits = [i for i in range(32) if m.written[f"R{i}"] < m.written[f"W{i}"]]
    assert len(hits) == 32, f"only {len(hits)} of 32 reused their KV"
    assert all(e.outputs[f"R{i}"] == e.outputs[f"W{i}"] for i in range(32))
    assert not e.mismatches()
    vh.assert_no_leaks(e)
    e.shutdown()


def test_async_scheduler(model_dir: str) -> None:
    e = engine(model_dir, host_only(), async_scheduling=True)
    prompt = vh.prompt_tokens(50, 4 * BS)
    e.add(vh.make_request("A", prompt, max_tokens=6))
    e.run()
    e.reset_gpu_prefix_cache()
    e.add(vh.make_request("B", prompt, max_tokens=6))
    e.run()
    assert loaded(e, "B")
    assert e.outputs["A"] == e.outputs["B"]
    assert not e.mismatches()
    vh.assert_no_leaks(e)
    e.shutdown()


# ------------------------------------------------------------------------------------ TP, roles
def test_tp2_each_rank_stores_and_loads_its_own_shard(model_dir: str, tmp_path: Path) -> None:
    extra = vh.with_ssd(tmp_path / "ssd")
    e = engine(model_dir, extra, tp_size=2)
    assert [w.connector.worker_side.tp_rank for w in e.workers] == [0, 1]
    prompt = vh.prompt_tokens(60, 4 * BS)
    bits = [run_prompt_then_snapshot(e, "A", prompt, 4)]
    bits.append(block_bits(e, "A", 4, rank=1))
    assert not all(torch.equal(x, y) for x, y in zip(bits[0], bits[1], strict=True))
    e.run()
    e.reset_gpu_prefix_cache()
    b = e.add(vh.make_request("B", prompt, max_tokens=3))
    e.run_until(prompt_done(b))
    assert loaded(e, "B")
    for rank in (0, 1):
        got = block_bits(e, "B", 4, rank=rank)
        assert all(torch.equal(x, y) for x, y in zip(bits[rank], got, strict=True))
    e.run()
    assert not e.mismatches()
    assert sorted(p.name for p in (tmp_path / "ssd").iterdir() if p.is_dir()) == [
        "tp0-pp0",
        "tp1-pp0",
    ]
    vh.assert_no_leaks(e)
    e.shutdown()


def test_kv_role_producer_only_stores_consumer_only_loads(model_dir: str, tmp_path: Path) -> None:
    extra = vh.with_ssd(tmp_path / "ssd")
    prompt = vh.prompt_tokens(70, 4 * BS)
    prod = engine(model_dir, extra, kv_role="kv_producer")
    prod.add(vh.make_request("A", prompt))
    prod.run()
    prod.reset_gpu_prefix_cache()
    prod.add(vh.make_request("A2", prompt))
    prod.run()
    assert not loaded(prod, "A2"), "a producer must not load"
    assert stat_total(prod, "store_blocks") >= 4
    prod.shutdown()

    cons = engine(model_dir, extra, kv_role="kv_consumer")
    cons.add(vh.make_request("B", prompt))
    cons.add(vh.make_request("C", vh.prompt_tokens(71, 4 * BS)))
    cons.run()
    assert loaded(cons, "B")
    assert stat_total(cons, "store_blocks") == 0, "a consumer must not store"
    assert not cons.mismatches()
    vh.assert_no_leaks(cons)
    cons.shutdown()


def test_multiconnector_child(model_dir: str, tmp_path: Path) -> None:
    # The Dynamo prefill pattern [FlexKV, <P/D connector>]; vLLM's ExampleConnector stands in
    # for NIXL (which needs RDMA hardware).
    flexkv = vh.connector_transfer_config(host_only())
    second = {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_consumer",
        "kv_connector_extra_config": {"shared_storage_path": str(tmp_path / "example")},
    }
    transfer = {
        "kv_connector": "MultiConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"connectors": [flexkv, second]},
    }
    e = vh.Engine(model_dir, transfer)
    # The child set the policy where the scheduler reads it (vLLM's default would be "fail").
    assert e.vllm_config.kv_transfer_config.kv_load_failure_policy == "recompute"
    assert e.scheduler.recompute_kv_load_failures
    children = vh.children(e.connector)
    assert isinstance(children[0], FlexKVConnectorV1)
    assert type(children[1]).__name__ == "ExampleConnector"
    prompt = vh.prompt_tokens(80, 4 * BS)
    e.add(vh.make_request("A", prompt))
    e.run()
    e.reset_gpu_prefix_cache()
    e.add(vh.make_request("B", prompt))
    e.run()
    assert loaded(e, "B")
    assert e.workers[0].model.written["B"] == 4  # last prompt token + 3 decode
    assert not e.mismatches()
    vh.assert_no_leaks(e)
    e.shutdown()


# ------------------------------------------------------------------------------------ events
def test_dynamo_events(model_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYNAMO_USE_FLEXKV", "1")
    # A host tier of 8 slots: the second prompt evicts the first to SSD.
    extra = vh.with_ssd(tmp_path / "ssd", cpu_cache_gb=8 * 4096 / 2**30, admission="write_back")
    e = engine(model_dir, extra)
    a = e.add(vh.make_request("A", vh.prompt_tokens(90, 4 * BS)))
    e.run()
    stored_cpu = [ev for ev in e.events if isinstance(ev, BlockStored) and ev.medium == "CPU"]
    hashes = [h for ev in stored_cpu for h in ev.block_hashes]
    a_hashes = [maybe_convert_block_hash(h) for h in a.block_hashes]  # as vLLM publishes them
    assert hashes[:4] == a_hashes[:4]
    first = next(ev for ev in stored_cpu if ev.block_hashes[0] == a_hashes[1])
    assert first.parent_block_hash == a_hashes[0]
    assert first.token_ids == a.all_token_ids[BS : 2 * BS]
    assert first.block_size == BS

    e.add(vh.make_request("C", vh.prompt_tokens(91, 8 * BS)))
    e.run()
    removed_cpu = {
        h
        for ev in e.events
        if isinstance(ev, BlockRemoved) and ev.medium == "CPU"
        for h in ev.block_hashes
    }
    on_ssd = {
        h
        for ev in e.events
        if isinstance(ev, BlockStored) and ev.medium == "DISK"
        for h in ev.block_hashes
    }
    assert removed_cpu & set(a_hashes), "no CPU eviction event for A's blocks"
    assert on_ssd & set(a_hashes), "no SSD store event for A's blocks"
    e.shutdown()


def test_no_events_without_dynamo_switch(model_dir: str) -> None:
    e = engine(model_dir, host_only())
    e.add(vh.make_request("A", vh.prompt_tokens(92, 4 * BS)))
    e.run()
    assert not [ev for ev in e.events if isinstance(ev, (BlockStored, BlockRemoved))]
    e.shutdown()


# ------------------------------------------------------------------------------- metrics, config
def test_stats_roundtrip_and_prometheus(model_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    e = engine(model_dir, host_only())
    prompt = vh.prompt_tokens(95, 4 * BS)
    e.add(vh.make_request("A", prompt))
    e.run()
    e.reset_gpu_prefix_cache()
    e.add(vh.make_request("B", prompt))
    e.run()
    total = FlexKVConnectorV1.build_kv_connector_stats()
    for s in e.stats:
        total.aggregate(FlexKVConnectorV1.build_kv_connector_stats(s))
    assert isinstance(total, FlexKVConnectorStats)
    red = total.reduce()
    assert red["hit_blocks"] == 4 and red["store_blocks"] >= 4 and red["load_blocks"] == 4
    assert red["load_bytes"] > 0 and red["store_bytes"] > 0
    e.shutdown()

    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm

    assert KVConnectorProm(e.vllm_config, ["model_name"], {0: ["m"]}).prom_metrics is None
    monkeypatch.setenv("FLEXKV_ENABLE_METRICS", "1")
    from prometheus_client import REGISTRY

    before = set(REGISTRY._collector_to_names)
    try:
        prom = KVConnectorProm(e.vllm_config, ["model_name"], {0: ["m"]})
        assert prom.prom_metrics is not None
        # What vLLM hands the metrics: to_dict() from 0.31 on, the stats' data before.
        prom.observe(total.to_dict() if hasattr(total, "to_dict") else dict(total.data), 0)
        sample = REGISTRY.get_sample_value("vllm:flexkv_hit_blocks_total", {"model_name": "m"})
        assert sample == 4
    finally:
        # The process-wide registry: the test's other connector form registers them again.
        for collector in set(REGISTRY._collector_to_names) - before:
            REGISTRY.unregister(collector)


def test_extra_config_overrides_env_and_rejects_unknown_keys(
    model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FLEXKV_CPU_CACHE_GB", "0.5")
    e = engine(model_dir, {"cpu_cache_gb": 0.004})
    assert e.connector._config.cpu_cache_gb == pytest.approx(0.004)
    e.shutdown()
    with pytest.raises(ConfigError, match="no_such_key"):
        engine(model_dir, {"no_such_key": 1})
