"""The object tier's counters reach the connector's stats, as vLLM's Scheduler collects them
every step (helpers/vllm_harness.py `Engine.stats`, real SeaweedFS): the scheduler's "ask again
later" answers, its lookups that gave up and its lookup tier's requests, and the workers'
object requests and errors (tiers/object/counters.py)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from helpers import vllm_harness as vh
from helpers.s3_proxy import CountingProxy
from helpers.s3_server import S3Server

from flexkv_py.integration.vllm.stats import COUNTERS, FlexKVConnectorStats
from flexkv_py.tiers.object.counters import Increments, tier_totals
from integration.s3.test_object_wiring_faults import stored_prompt
from integration.s3.test_object_wiring_vllm import BLOCKS, BS, object_env
from integration.s3.test_object_wiring_vllm import (
    s3 as s3,  # the module's SeaweedFS server (fixture)
)


def consumer_totals(
    model_dir: str, prompt: list[int], before: Callable[[vh.Engine], None] | None = None
) -> tuple[Counter[str], list[int]]:
    """A consumer engine run on `prompt`: its connector stats summed over the steps, and its
    output."""
    e = vh.Engine(model_dir, vh.connector_transfer_config(kv_role="kv_consumer"))
    try:
        if before is not None:
            before(e)
        e.add(vh.make_request("C", prompt, block_size=BS))
        e.run()
        totals: Counter[str] = Counter()
        for step in e.stats:
            totals.update({k: v for k, v in step.items() if isinstance(v, int | float)})
        assert not e.mismatches()
        return totals, e.outputs["C"]
    finally:
        e.shutdown()


def test_increments_and_totals() -> None:
    inc = Increments()
    assert inc.since_last({"a": 2, "b": 0}) == {"a": 2}
    assert inc.since_last({"a": 5, "b": 1}) == {"a": 3, "b": 1}
    assert inc.since_last({"a": 5, "b": 1}) == {}
    native = {"get_requests": 3, "put_requests": 2, "head_requests": 1, "io_errors": 4}
    assert tier_totals(native) == {
        "object_requests": 6,
        "object_io_errors": 4,
        "object_timeouts": 0,
    }
    names = set(tier_totals(native)) | set(tier_totals(native, "object_lookup"))
    assert names <= set(COUNTERS)  # exported as Prometheus counters and in logs
    stats = FlexKVConnectorStats()
    stats.add("object_lookups_gave_up", 1)
    assert stats.reduce()["object_lookups_gave_up"] == 1


def test_lookup_and_load_counters_reach_the_connector_stats(
    s3: S3Server, model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    prefix, prompt, expected = stored_prompt(s3, model_dir, monkeypatch, 31)
    # Each reply a little late once the bucket is open: the scheduler's first ask always finds
    # its lookup still running (a reply from 127.0.0.1 can beat the ask on a quiet machine).
    proxy = CountingProxy(s3.ports["s3"])

    def late(e: vh.Engine) -> None:
        proxy.delay_replies_s = 0.25

    try:
        for k, v in object_env(s3, prefix, proxy.endpoint).items():
            monkeypatch.setenv(k, v)
        monkeypatch.setenv("FLEXKV_OBJECT_STORE_LOOKUP_WAIT_S", "20")  # never given up here
        totals, out = consumer_totals(model_dir, prompt, before=late)
    finally:
        proxy.close()
    assert out == expected
    assert totals["object_lookups_asked_later"] >= 1  # the first ask, while the lookup ran
    assert totals["object_lookup_requests"] >= 1  # the scheduler's manifest lookup
    assert totals["object_requests"] >= BLOCKS  # the worker's gets of the loaded blocks
    assert totals["object_lookups_gave_up"] == 0
    assert totals["object_io_errors"] == 0 and totals["object_lookup_io_errors"] == 0


def test_a_lookup_that_gave_up_is_counted(
    s3: S3Server, model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    prefix, prompt, expected = stored_prompt(s3, model_dir, monkeypatch, 32)
    proxy = CountingProxy(s3.ports["s3"])

    def slow(e: vh.Engine) -> Any:
        proxy.delay_replies_s = 4.0  # once the bucket is open: lookups run past the wait

    try:
        for k, v in object_env(s3, prefix, proxy.endpoint).items():
            monkeypatch.setenv(k, v)
        monkeypatch.setenv("FLEXKV_OBJECT_STORE_LOOKUP_WAIT_S", "1.0")
        totals, out = consumer_totals(model_dir, prompt, before=slow)
    finally:
        proxy.close()
    assert out == expected  # recomputed
    assert totals["object_lookups_gave_up"] == 1
    assert totals["object_lookups_asked_later"] >= 1
