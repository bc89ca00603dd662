"""`flexkv-py replay` over all 2000 requests of Mooncake's vendored conversation trace: 0 false
hits and at least the single-LRU reference's hit rate (split from
tests/unit/cli/test_replay_mooncake.py: ~20-40 s, too slow for `-m unit`)."""

from __future__ import annotations

from unit.cli.test_replay_mooncake import _run


def test_conversation_trace_reaches_the_lru_reference() -> None:
    # The sizes over all 2000 vendored requests (~15-20 s on the dev VM).
    out = _run("mooncake_conversation_2000.jsonl", (1000, 2000, 8000))
    assert out["false_hits"] == 0 and out["mismatches"] == 0
    assert out["hit_rate"] >= out["references"]["lru_gpu_ssd_9000"]  # 21.2-21.3 % vs 20.4 %
