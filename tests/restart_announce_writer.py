"""Child process for the restart-announcement test: an engine with an SSD tier (default
admission, write-behind) computes one prompt, waits until write-behind put its blocks on the
SSD, prints the blocks' hashes and token ids as JSON, and shuts down.

Usage: python restart_announce_writer.py MODEL_DIR SSD_DIR
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import vllm_harness as vh

BS = 16
BLOCKS = 4
SALT = "tenant-9"


def main() -> None:
    model_dir, ssd = sys.argv[1], Path(sys.argv[2])
    extra = vh.with_ssd(ssd, admission="write_back")  # the default admission
    e = vh.Engine(model_dir, vh.connector_transfer_config(extra))
    req = e.add(vh.make_request("A", vh.prompt_tokens(901, BLOCKS * BS), cache_salt=SALT))
    e.run()
    (side,) = e.flexkv_scheduler_sides()
    e.run_until(lambda: side._mgr.write_behind_pending() == 0 and not side._jobs, 60, first=False)
    out = {
        "hashes": [bytes(h).hex() for h in req.block_hashes[:BLOCKS]],
        "tokens": list(req.all_token_ids[: BLOCKS * BS]),
    }
    e.shutdown()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
