"""A restarted engine announces what its SSD kept as vLLM `BlockStored` events (medium DISK):
token ids, parent hash, block size and extra keys read back from each block's stored metadata,
in a new process, without any request touching those blocks."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from helpers import vllm_harness as vh
from helpers.writers import TESTS_DIR, argv
from helpers.writers.restart_announce_writer import BLOCKS, BS, SALT
from vllm.distributed.kv_events import BlockStored
from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash


@pytest.mark.parametrize("written_by", ["write-behind", "inline-spill", "write-through"])
def test_restart_in_a_new_process_announces_the_inventory_with_token_ids(
    model_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, written_by: str
) -> None:
    """`inline-spill`: the blocks reached the SSD only through the spill a later store ran
    first (write-behind and the shutdown drain off); `write-through`: through the store job's
    own write legs. Either way they carry their metadata too."""
    ssd = tmp_path / "ssd"
    mode = [] if written_by == "write-behind" else [written_by]
    out = subprocess.run(
        argv("restart_announce_writer", model_dir, str(ssd), *mode),
        capture_output=True,
        text=True,
        cwd=TESTS_DIR,
        timeout=300,
        check=True,
    )
    wrote = json.loads(out.stdout.strip().splitlines()[-1])
    hashes = [maybe_convert_block_hash(BlockHash(bytes.fromhex(h))) for h in wrote["hashes"]]
    tokens = wrote["tokens"]

    monkeypatch.setenv("DYNAMO_USE_FLEXKV", "1")  # publish our KV events
    e = vh.Engine(model_dir, vh.connector_transfer_config(vh.with_ssd(ssd, admission="write_back")))

    def announced() -> dict[object, BlockStored]:
        return {
            ev.block_hashes[0]: ev
            for ev in e.events
            if isinstance(ev, BlockStored) and ev.medium == "DISK" and ev.token_ids
        }

    e.run_until(lambda: set(hashes) <= set(announced()), 30, first=False)
    found = announced()
    for i, h in enumerate(hashes):
        ev = found[h]
        assert ev.token_ids == tokens[i * BS : (i + 1) * BS], i
        assert ev.block_size == BS
        assert ev.parent_block_hash == (hashes[i - 1] if i else None)
        assert ev.extra_keys == ([(SALT,)] if i == 0 else [None])
    assert len(hashes) == BLOCKS
    e.shutdown()
