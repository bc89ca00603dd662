"""Child process for the restart tests across processes and vLLM releases: one engine (SSD tier,
write-through) on SSD_DIR either stores a fixed prompt (`store`) or, as the first request of a
fresh process, asks for it (`load`). Prints one JSON line: vLLM's version, the prompt's block
hashes, and for `load` the blocks loaded from our tiers and any KV mismatch (the harness's model
checks every loaded position bit for bit before the request computes on).

Usage: python vllm_restart_child.py MODEL_DIR SSD_DIR store|load
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from helpers import vllm_harness as vh

BS = 16
BLOCKS = 4
PROMPT_SEED = 4242


def main() -> None:
    model_dir, ssd, mode = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    e = vh.Engine(model_dir, vh.connector_transfer_config(vh.with_ssd(ssd)))
    prompt = vh.prompt_tokens(PROMPT_SEED, BLOCKS * BS + 3)
    req = e.add(vh.make_request("R", prompt, max_tokens=2))
    e.run()
    hit_blocks = sum(s.get("hit_blocks", 0) for s in e.stats)
    out = {
        "vllm": vh.vllm_version(),
        "mode": mode,
        "hashes": [bytes(h).hex() for h in req.block_hashes[:BLOCKS]],
        "hit_blocks": hit_blocks,
        "mismatches": e.mismatches(),
        "outputs": e.outputs.get("R", []),
    }
    e.shutdown()
    print(json.dumps(out))


if __name__ == "__main__":
    main()
