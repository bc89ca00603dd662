"""Turn a replay result into a human summary, one JSON line, or a plot over time."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

from flexkv_py.cli.replay import ReplayResult, Sample


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def to_json(result: ReplayResult) -> str:
    return json.dumps(result.summary(), sort_keys=False, default=str)


def to_text(result: ReplayResult) -> str:
    s = result.summary()
    hits, tiers = s["hits_by_tier"], s["tiers"]
    by_tier = s["bytes_by_tier"]
    lines = [
        f"workload        {s['workload']}: {s['requests']} requests, {s['blocks']} blocks of "
        f"{s['block_tokens']} tokens ({_bytes(s['page_bytes'])} KV each)",
        f"tiers           GPU {tiers['gpu_blocks']} blocks (simulated prefix cache), host "
        f"{tiers['cpu_blocks']} blocks, SSD {_bytes(tiers['ssd_bytes'])}"
        + (
            f" in {', '.join(tiers['ssd_dirs'])}{'' if tiers['ssd_kept'] else ' (temporary)'}"
            if tiers["ssd_dirs"]
            else " (off)"
        ),
        f"hit rate        {s['hit_rate']:.1%}  (GPU {hits['gpu']}, CPU {hits['cpu']}, "
        f"SSD {hits['ssd']} of {s['blocks']} blocks; {s['misses']} recomputed)",
        "references      "
        + ", ".join(f"{name} {rate:.1%}" for name, rate in s["references"].items())
        + "  (one LRU of that many blocks)",
        f"per tier        GPU {s['hit_rate_by_tier']['gpu']:.1%}  CPU "
        f"{s['hit_rate_by_tier']['cpu']:.1%}  SSD {s['hit_rate_by_tier']['ssd']:.1%}",
        f"tokens saved    {s['tokens_saved']} of {s['prompt_tokens']} prompt tokens "
        f"({s['tokens_saved_fraction']:.1%} of prefill skipped; "
        f"{s['tokens_saved_by_offload']} thanks to the host/SSD tiers)",
        f"bytes moved     host: {_bytes(by_tier['cpu']['read'])} loaded, "
        f"{_bytes(by_tier['cpu']['write'])} stored;  SSD: {_bytes(by_tier['ssd']['read'])} read, "
        f"{_bytes(by_tier['ssd']['write'])} written",
        f"bandwidth       load (tiers->GPU) {s['gbps']['load']:.2f} GB/s, store (GPU->tiers) "
        f"{s['gbps']['store']:.2f} GB/s  [CPU tensors: figures of this host, not of a GPU]",
        f"SSD dedup       {s['dedup_ratio']:.2f}x  (logical {_bytes(s['ssd_logical_bytes'])}, "
        f"physical {_bytes(s['ssd_physical_bytes'])})",
        f"integrity       {s['mismatches']} loaded blocks differed from the stored KV; "
        f"{s['load_failures']} claimed blocks could not be loaded (recomputed)",
        "SSD wear        "
        + (
            f"{s['ssd_written_per_served']:.2f} bytes written per byte served"
            if s["ssd_written_per_served"] is not None
            else "nothing served from the SSD"
        ),
        f"time            {s['seconds']:.2f} s",
    ]
    return "\n".join(lines)


def _window(samples: Sequence[Sample], size: int) -> tuple[list[float], list[float], list[float]]:
    """Per request: hit rate, load GB/s and store GB/s over the trailing `size` requests."""
    rate, load, store = [], [], []
    for i in range(len(samples)):
        w = samples[max(0, i - size + 1) : i + 1]
        blocks = sum(x.blocks for x in w)
        rate.append(sum(x.hits for x in w) / blocks if blocks else math.nan)
        ls, ss = sum(x.load_s for x in w), sum(x.store_s for x in w)
        load.append(sum(x.load_bytes for x in w) / ls / 1e9 if ls else math.nan)
        store.append(sum(x.store_bytes for x in w) / ss / 1e9 if ss else math.nan)
    return rate, load, store


def plot(result: ReplayResult, path: str | Path) -> Path:
    """Hit rate and bandwidth over the replay, as a PNG (matplotlib, no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    samples = result.samples
    t = [x.t for x in samples]
    window = min(len(samples), max(4, len(samples) // 15))
    rate, load, store = _window(samples, window)
    cum: list[float] = []
    hits = blocks = 0
    for x in samples:
        hits, blocks = hits + x.hits, blocks + x.blocks
        cum.append(hits / blocks if blocks else math.nan)

    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    ax1.plot(t, rate, label=f"hit rate (last {window} requests)")
    ax1.plot(t, cum, label="hit rate (cumulative)", linestyle="--")
    ax1.set_ylim(0, 1.02)
    ax1.set_ylabel("block hit rate")
    ax1.legend(loc="lower right")
    ax1.set_title(f"flexkv-py replay: {result.workload}")
    ax2.plot(t, load, label="load: tiers -> GPU")
    ax2.plot(t, store, label="store: GPU -> tiers")
    ax2.set_ylabel("GB/s")
    ax2.set_xlabel("seconds since start")
    ax2.legend(loc="upper right")
    fig.tight_layout()
    out = Path(path)
    fig.savefig(out, format="png", dpi=100)
    plt.close(fig)
    return out
