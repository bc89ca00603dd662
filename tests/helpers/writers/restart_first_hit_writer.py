"""Child process for the first-request-after-a-restart tests: an engine with an SSD tier (the
default admission, write-behind) computes a 200-token prompt, waits until its blocks are on the
SSD, prints how many blocks the SSD holds as JSON, and shuts down.

Usage: python restart_first_hit_writer.py MODEL_DIR SSD_DIR [TP_SIZE PP_SIZE]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from helpers import vllm_harness as vh

BS = 16
PROMPT_TOKENS = 200  # 12 full blocks and 8 tokens
SEED = 2201


def config(ssd: Path) -> dict[str, object]:
    """The connector config of both runs: the user's, write-behind admission."""
    return vh.connector_transfer_config(vh.with_ssd(ssd, admission="write_back"))


def main() -> None:
    model_dir, ssd = sys.argv[1], Path(sys.argv[2])
    tp, pp = (int(sys.argv[3]), int(sys.argv[4])) if len(sys.argv) > 4 else (1, 1)
    e = vh.Engine(model_dir, config(ssd), tp_size=tp, pp_size=pp)
    e.add(vh.make_request("A", vh.prompt_tokens(SEED, PROMPT_TOKENS), max_tokens=2))
    e.run()
    (side,) = e.flexkv_scheduler_sides()
    e.run_until(lambda: side._mgr.write_behind_pending() == 0 and not side._jobs, 60, first=False)
    on_ssd = side._mgr.index.counts()["on_ssd"]
    assert not e.mismatches(), e.mismatches()
    e.shutdown()
    print(json.dumps({"on_ssd": on_ssd}), flush=True)


if __name__ == "__main__":
    main()
