"""The freed heap goes back to the OS after a restart's short-lived objects (RSS, not counted
bytes: an operator sees RSS)."""

from __future__ import annotations

import platform
import subprocess
import sys
from types import SimpleNamespace
from typing import Any

import pytest

from flexkv_py import process_memory
from flexkv_py.integration.vllm.restart_inventory import RestartInventory

GLIBC = platform.libc_ver()[0] == "glibc"

# In a child: a restart-like burst, freed, with a few survivors spread through the heap (as the
# index's own allocations are). Objects of 600 B come from the C heap, as the native store's and
# sets' allocations and Python's lists do (Python's small-object arenas are not malloc's).
_BURST = """
import gc, json
from flexkv_py.process_memory import return_freed_memory, rss_bytes
base = rss_bytes()
burst = [bytes(592) + i.to_bytes(8, "little") for i in range(400_000)]
kept = burst[::4096]
peak = rss_bytes()
del burst
gc.collect()
freed = rss_bytes()
given = return_freed_memory("a test burst")
print(json.dumps({"burst": peak - base, "held": freed - base, "given": given,
                  "after": rss_bytes() - base, "kept": len(kept)}))
"""


@pytest.mark.skipif(not GLIBC, reason="malloc_trim is glibc's; elsewhere the call does nothing")
def test_a_freed_burst_leaves_rss() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _BURST], capture_output=True, text=True, check=True, timeout=120
    )
    row: dict[str, int] = __import__("json").loads(out.stdout.strip().splitlines()[-1])
    assert row["burst"] > 100 << 20, row  # the burst was resident
    assert row["given"] > 0, row
    # Most of what the burst took is back (the survivors keep a few pages).
    assert row["after"] < row["burst"] // 4, row


def test_without_malloc_trim_nothing_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(process_memory, "_malloc_trim", lambda: None)
    assert process_memory.return_freed_memory("no C library call") == 0


class _Manager:
    def __init__(self) -> None:
        self.adopted: list[Any] = []

    def adopt_ssd_keys(self, ranks: Any, **kw: Any) -> int:
        self.adopted.append(ranks)
        return 0


def test_the_scheduler_gives_back_the_reports_heap_once_the_step_is_over(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[str] = []

    def record(after: str) -> int:
        calls.append(after)
        return 0

    monkeypatch.setattr("flexkv_py.integration.vllm.restart_inventory.return_freed_memory", record)
    inv = RestartInventory(2, enabled=True)
    mgr = _Manager()
    meta = SimpleNamespace(inventory_parents={}, recovered_metas=None)
    inv.adopt_reports(mgr, SimpleNamespace(**vars(meta), inventories={(0, 0): (b"k" * 40,)}))
    inv.after_step()
    assert calls == [] and not mgr.adopted  # one report of two: nothing adopted or freed
    inv.adopt_reports(mgr, SimpleNamespace(**vars(meta), inventories={(1, 0): (b"k" * 40,)}))
    assert len(mgr.adopted) == 1 and calls == []  # the step's metadata is still held
    inv.after_step()
    inv.after_step()
    assert calls == ["the workers' restart reports"]  # once, the step after
