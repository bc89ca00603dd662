"""The SSD inventory's read, then the interpreter's exit at once, in a child process (split from
tests/unit/tiers/test_ssd_inventory.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

# Light imports (no torch): the interpreter's exit follows the read at once.
_READ_THEN_EXIT = """
import sys
from pathlib import Path
from flexkv_py import BlockStore
from flexkv_py.config import load_config
from flexkv_py.index import Namespace
from flexkv_py.tiers.ssd.inventory import read_ssd_inventory
root, n = Path(sys.argv[1]), 100_000
ns = Namespace("m", None, kv_dtype="bfloat16", kv_layout="NHD", block_size=16)
shard = root / ns.shard_dir_name
shard.mkdir(parents=True)
with BlockStore(str(shard), n * 8192 + (64 << 20), preallocate=False) as store:  # tiny blocks
    items = [(ns.storage_key(ns.key(i.to_bytes(32, "little"))), b"kv") for i in range(n)]
    assert all(r.ok for r in store.submit_put(items).wait(60))
config = load_config({"cpu_cache_gb": 0.01, "ssd_cache_gb": 1, "ssd_cache_dir": str(root)}, env={})
assert len(read_ssd_inventory(config, ns).keys) == n
"""


def test_an_exit_right_after_a_read_does_not_abort(tmp_path: Path) -> None:
    """The views are closed on a thread: the interpreter's exit must wait for it, not stop it
    inside the native store (that aborts: "FATAL: exception not rethrown")."""
    out = subprocess.run(
        [sys.executable, "-c", _READ_THEN_EXIT, str(tmp_path / "ssd")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "FATAL" not in out.stderr
