"""How `restore_vs_recompute.py` reports: the markdown table and the `--plot` chart."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def table(rows: list[dict[str, Any]]) -> str:
    head = (
        "| P tokens | KV GB | prefill ms | host restore ms | host GB/s (memcpy) | host/memcpy | "
        "host speedup | SSD restore ms | SSD GB/s (raw O_DIRECT) | SSD/raw | SSD speedup | "
        "break-even disk GB/s | transfer-only GB/s | bit-exact + logits equal |\n"
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n"
    )
    lines = [
        f"| {r['tokens']} | {r['bytes'] / 1e9:.2f} | {r['prefill_ms']:.1f} | "
        f"{r['restore_host_ms']:.1f} | {r['restore_host_gbps']:.1f} ({r['memcpy_h2d_gbps']:.1f}) | "
        f"{r['host_vs_memcpy']:.3f} | {r['speedup_host']:.1f}x | {r['restore_ssd_ms']:.0f} | "
        f"{r['restore_ssd_gbps']:.2f} ({r['raw_read_gbps']:.2f}) | {r['ssd_vs_raw']:.2f} | "
        f"{r['speedup_ssd']:.2f}x | {r['breakeven_disk_gbps']:.2f} | "
        f"{r['transfer_only_gbps']:.1f} ({r['transfer_only_vs_memcpy']:.3f}) | "
        f"{'yes' if r['ok'] else 'NO'} |"
        for r in rows
    ]
    return head + "\n".join(lines)


def tok_label(t: int) -> str:
    return f"{t / 1024:g}K" if t >= 1024 else str(t)


def plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    toks = [r["tokens"] for r in rows]
    xs = range(len(rows))
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5))
    w = 0.27
    for i, (key, label) in enumerate(
        (
            ("prefill_ms", "recompute (prefill)"),
            ("restore_host_ms", "restore from host"),
            ("restore_ssd_ms", "restore from SSD"),
        )
    ):
        vals = [r[key] for r in rows]
        bars = a1.bar([x + (i - 1) * w for x in xs], vals, w, label=label)
        a1.bar_label(bars, fmt="%.3g", fontsize=7)
    a1.set_yscale("log")
    a1.set_xticks(list(xs), [tok_label(t) for t in toks])
    a1.set_xlabel("prompt tokens")
    a1.set_ylabel("ms (log)")
    a1.set_title("time to have the KV on the GPU")
    a1.legend(fontsize=8)
    for key, label, style in (
        ("restore_host_gbps", "host restore", "o-"),
        ("memcpy_h2d_gbps", "pinned memcpy H2D", "k--"),
        ("restore_ssd_gbps", "SSD restore", "s-"),
        ("raw_read_gbps", "raw O_DIRECT read", "k:"),
        ("breakeven_disk_gbps", "break-even disk (bytes / prefill)", "r-."),
    ):
        a2.plot(toks, [r[key] for r in rows], style, label=label)
    a2.set_xscale("log", base=2)
    a2.set_yscale("log")
    a2.set_xticks(toks, [tok_label(t) for t in toks])
    a2.set_xlabel("prompt tokens")
    a2.set_ylabel("GB/s (log)")
    a2.set_title("achieved bandwidth vs ceilings")
    a2.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
