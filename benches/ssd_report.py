"""ssd_bench's text report of one block size: GB/s per path (median [min-max] of the paired
runs), the ratios ours/vLLM and ours/raw, CPU seconds per GB and disk bytes per payload byte."""

from __future__ import annotations

from typing import Any

from ssd_paths import PATHS


def fmt(row: dict, key: str) -> str:
    if key not in row:
        return "-"
    lo, hi = row.get(f"{key}_min"), row.get(f"{key}_max")
    if lo is None or row["runs"] == 1:
        return f"{row[key]:.2f}"
    return f"{row[key]:.2f} [{lo:.2f}-{hi:.2f}]"


def print_row(row: dict, out: Any) -> None:
    print(
        f"{row['block_size'] // 1024:>6} KiB blocks ({row['engine']}, {row['blocks']} blocks, "
        f"{row['runs']} run(s): median [min-max])",
        file=out,
    )
    for d in ("write", "read"):
        print(
            f"    {d:<5} GB/s  ours {fmt(row, f'ours_{d}_gbps')}  vllm {fmt(row, f'vllm_{d}_gbps')}"
            f"  raw {fmt(row, f'raw_{d}_gbps')}  |  ours/vllm {fmt(row, f'{d}_vs_vllm')}"
            f"  ours/raw {fmt(row, f'{d}_ratio')}",
            file=out,
        )
        cpu = "  ".join(
            f"{p} {row[f'{p}_{d}_cpu_s_per_gb']:.2f}" for p in PATHS if f"{p}_{d}_gbps" in row
        )
        moved = "  ".join(
            f"{p} {row[f'{p}_{d}_disk_bytes_ratio']:.3f}" for p in PATHS if f"{p}_{d}_gbps" in row
        )
        print(f"          CPU s/GB (this process, all threads): {cpu}", file=out)
        print(f"          disk bytes / payload bytes: {moved}", file=out)
    for v, label in (
        ("ours_1batch", "ours, one batch"),
        ("ours_parts", "ours, coordinator parts"),
        ("ours_coord", "ours, one batch, QD 512, restart"),
    ):
        if f"{v}_read_gbps" in row:
            print(
                f"    read  {label}: {fmt(row, f'{v}_read_gbps')} GB/s, "
                f"/raw {fmt(row, f'{v}_read_ratio')}, /ours {fmt(row, f'{v}_vs_pipelined')}",
                file=out,
            )
