"""Child process for the restart-announcement test: an engine with an SSD tier (default
admission, write-behind) computes one prompt, waits until write-behind put its blocks on the
SSD, prints the blocks' hashes and token ids as JSON, and shuts down.

With `inline-spill`: write-behind and the shutdown drain off, and a second, longer prompt
whose store evicts the first prompt's host blocks: they reach the SSD only through the spill
that store job runs first (`spill_keys`).

With `write-through`: the store job itself writes the blocks to the SSD (its write legs), the
shutdown drain off.

Usage: python restart_announce_writer.py MODEL_DIR SSD_DIR [inline-spill | write-through]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from helpers import vllm_harness as vh

BS = 16
BLOCKS = 4
SALT = "tenant-9"


def main() -> None:
    model_dir, ssd = sys.argv[1], Path(sys.argv[2])
    inline_spill = sys.argv[3:] == ["inline-spill"]
    write_through = sys.argv[3:] == ["write-through"]
    extra = vh.with_ssd(ssd, admission="write_through" if write_through else "write_back")
    if write_through:
        extra.update(shutdown_drain_s=0)
    if inline_spill:  # a host tier of 8 slots: the second prompt's store evicts the first's
        page = 2 * vh.NUM_LAYERS * vh.NUM_KV_HEADS * BS * vh.HEAD_SIZE * 2
        extra.update(write_behind_lag_s=0, shutdown_drain_s=0, cpu_cache_gb=8 * page / (1 << 30))
    e = vh.Engine(model_dir, vh.connector_transfer_config(extra))
    req = e.add(vh.make_request("A", vh.prompt_tokens(901, BLOCKS * BS), cache_salt=SALT))
    e.run()
    (side,) = e.flexkv_scheduler_sides()
    if inline_spill:
        slots = side._mgr.index.num_host_slots
        e.add(vh.make_request("B", vh.prompt_tokens(902, slots * BS)))
        assert slots == 8, slots
        e.run()
    e.run_until(lambda: side._mgr.write_behind_pending() == 0 and not side._jobs, 60, first=False)
    out = {
        "hashes": [bytes(h).hex() for h in req.block_hashes[:BLOCKS]],
        "tokens": list(req.all_token_ids[: BLOCKS * BS]),
    }
    e.shutdown()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
