"""Many requests through Dynamo's PdConnector [FlexKV, NIXL] with preemption: block size 32,
vLLM's hybrid manager off, a small GPU pool so vLLM preempts, chunked prefill, a small host tier
and a write-through SSD tier, multi-turn reuse (helpers/load_workload.py). Reported: the engine did
not become idle within 5000 steps, four preempted requests never finishing. The SSD device here
sometimes takes seconds for a write; the fault injector makes that repeatable: every few writes
are held for a while.

The stall: a load that found no host slot to stage its SSD blocks failed, and the request was
offered the same load again (test_vllm_failed_load.py). Then about 1 run in 4 ended with a
loaded block's KV wrong, beside SSD blocks failing their content hash: PdConnector binds its
children's metadata twice per step, so every job ran twice, and the second run copied into host
slots and GPU blocks the first run's end had freed (test_vllm_pd.py
test_each_job_runs_once_under_the_wrapper)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import vllm_harness as vh
from helpers.load_workload import Workload, drive
from helpers.vllm_versions import needs_nixl_on_cpu

from integration.vllm.test_vllm_pd import pd_engine

pytestmark = needs_nixl_on_cpu

STEP_BOUND = 5000  # the reported bound, on steps that scheduled tokens
# Steps that schedule nothing (transfers in flight) are spun in a tight loop here, so their number
# measures this machine's I/O time, not the engine's work: waiting is bounded by wall time
# instead, several SSD I/O timeouts (ssd_io_timeout_s, 5 s) with nothing scheduled is a stall.
IDLE_BOUND_S = 30.0


def test_pd_connector_many_requests_with_slow_ssd_writes(
    model_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    for k, v in {
        "CPU_CACHE_GB": "0.0005",  # ~60 host slots: spills and SSD reads
        "SSD_CACHE_GB": "0.03",
        "SSD_CACHE_DIR": str(ssd),
        "ADMISSION": "write_through",
        # Every 8th device write takes 3 s (below ssd_io_timeout_s): a slow shared disk.
        "FAULT_INJECTION": "write:DELAY3000:8",
    }.items():
        monkeypatch.setenv(f"FLEXKV_{k}", v)
    e = pd_engine(model_dir, num_blocks=16)
    stats = drive(
        e,
        Workload(seed=2, requests=60),
        max_steps=10**8,
        max_busy_steps=STEP_BOUND,
        max_idle_s=IDLE_BOUND_S,
    )
    assert stats.preemptions > 0, "scenario did not preempt"
    assert stats.followups > 0
    e.run(timeout_s=60)  # the stores still writing through
    assert not e.mismatches()
    vh.assert_no_leaks(e)
    e.shutdown()
