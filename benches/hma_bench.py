"""Sliding-window model with HMA on vs off, through FlexKVConnectorV1 (vLLM 0.33's Scheduler and
KV planning on CPU, tests/helpers/vllm_harness.py's Gemma-3-shaped model: 4 layers, odd ones
sliding-window, W = 128).

Same KV cache memory for both runs; same workload: `--prefixes` distinct prompts of `--blocks`
blocks each are computed and stored (round 1), the GPU prefix cache is dropped, and the same
prompts come back (round 2) and load from FlexKV. Reported per run: GPU blocks the plan gives,
token hit rate of round 2 (prompt tokens not recomputed), and bytes stored and loaded
per cached prefix. HMA off stores every layer as full attention; HMA on loads the sliding
layers' window only; with `--sliding-interval N` (sliding_store_interval_blocks) it also stores
only the window before every N-th block boundary and each prompt's last window.

    python3 benches/hma_bench.py [--prefixes 6] [--blocks 24] [--sliding-interval 1] [--json]
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from helpers import vllm_harness as vh

BS = 16


def run(
    model_dir: str,
    hma: bool,
    prefixes: int,
    blocks: int,
    memory_blocks: int,
    tail: int,
    interval: int = 1,
) -> dict[str, Any]:
    cfg = vh.make_vllm_config(model_dir, vh.connector_transfer_config(), disable_hma=not hma)
    # The same memory for both: HMA-on's block count at that memory, and what HMA off gets.
    memory = memory_blocks * vh.hybrid_block_bytes(cfg)
    per_block = vh.hybrid_block_bytes(cfg) * (1 if hma else 2)
    num_blocks = memory // per_block
    e = vh.Engine(
        model_dir,
        vh.connector_transfer_config(
            {"cpu_cache_gb": 0.05, "sliding_store_interval_blocks": interval}
        ),
        hybrid=True,
        num_blocks=num_blocks,
        disable_hma=not hma,
        max_model_len=blocks * BS + 32,
    )
    # `tail` tokens past the last full block (0: block-aligned prompts, which hit in full: vLLM
    # recomputes their last token).
    prompts = [vh.prompt_tokens(100 + i, blocks * BS + tail) for i in range(prefixes)]
    for i, p in enumerate(prompts):
        e.add(vh.make_request(f"A{i}", p, max_tokens=2))
    e.run()
    stored = sum(s.get("store_bytes", 0) for s in e.stats)
    e.reset_gpu_prefix_cache()
    before = len(e.stats)
    for i, p in enumerate(prompts):
        e.add(vh.make_request(f"B{i}", p, max_tokens=2))
    e.run()
    round2 = e.stats[before:]
    loaded = sum(s.get("load_bytes", 0) for s in round2)
    # Prompt tokens round 2 did not recompute (FakeModel writes = recomputed + 1 decode token).
    written = e.workers[0].model.written
    recomputed = sum(written[f"B{i}"] - 1 for i in range(prefixes))
    total = sum(len(p) for p in prompts)
    assert not e.mismatches()
    out = {
        "hma": hma,
        "kv_cache_groups": len(e.kv_cache_config.kv_cache_groups),
        "gpu_blocks": e.kv_cache_config.num_blocks,
        "hit_rate": (total - recomputed) / total,
        "store_bytes_per_prefix": stored / prefixes,
        "load_bytes_per_prefix": loaded / prefixes,
    }
    e.shutdown()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prefixes", type=int, default=6)
    ap.add_argument("--blocks", type=int, default=24)
    ap.add_argument("--memory-blocks", type=int, default=256, help="HMA-on blocks of memory")
    ap.add_argument("--tail", type=int, default=5, help="prompt tokens past the last block")
    ap.add_argument("--sliding-interval", type=int, default=1, help="sliding_store_interval_blocks")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    logging.getLogger("vllm").setLevel(logging.ERROR)
    model_dir = vh.hybrid_model_dir(Path(tempfile.mkdtemp(prefix="hma-bench-")))
    rows = [
        run(
            model_dir,
            hma,
            args.prefixes,
            args.blocks,
            args.memory_blocks,
            args.tail,
            args.sliding_interval,
        )
        for hma in (False, True)
    ]
    for r in rows:
        print(
            f"HMA {'on ' if r['hma'] else 'off'}: groups {r['kv_cache_groups']} "
            f"gpu_blocks {r['gpu_blocks']} hit_rate {r['hit_rate']:.3f} "
            f"stored/prefix {r['store_bytes_per_prefix'] / 1024:.1f} KiB "
            f"loaded/prefix {r['load_bytes_per_prefix'] / 1024:.1f} KiB"
        )
    off, on = rows
    print(
        f"HMA on vs off: gpu blocks x{on['gpu_blocks'] / off['gpu_blocks']:.2f}, "
        f"loaded bytes x{on['load_bytes_per_prefix'] / max(1, off['load_bytes_per_prefix']):.2f}, "
        f"stored bytes x{on['store_bytes_per_prefix'] / max(1, off['store_bytes_per_prefix']):.2f}"
    )
    if args.json:  # one object on one line, as `flexkv-py bench` reads every bench
        print(
            json.dumps(
                {
                    "rows": rows,
                    "gpu_blocks_on_vs_off": on["gpu_blocks"] / off["gpu_blocks"],
                    "load_bytes_on_vs_off": on["load_bytes_per_prefix"]
                    / max(1, off["load_bytes_per_prefix"]),
                }
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
