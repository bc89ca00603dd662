"""Content-hash choice: xxh3-128 (default) vs blake3 over KV-sized blocks, one core, GIL released.

Baseline: a plain memory copy of the same bytes (what any store must at least pay once).
Prints GB/s of each and ratios; `--json` prints one final JSON line.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np

from flexkv_py._native import content_hash


def rate(fn, data: bytes, seconds: float) -> float:  # type: ignore[no-untyped-def]
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        fn(data)
        n += 1
    return n * len(data) / (time.perf_counter() - start) / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    seconds = 0.3 if args.quick else 2.0
    out: dict[str, float] = {}
    for size in (64 * 1024, 2 << 20):
        data = np.random.default_rng(0).integers(0, 256, size, dtype=np.uint8).tobytes()
        buf = bytearray(size)

        def copy(d: bytes, buf: bytearray = buf) -> None:
            buf[:] = d

        xxh = rate(lambda d: content_hash(d, "xxh3-128"), data, seconds)
        b3 = rate(lambda d: content_hash(d, "blake3"), data, seconds)
        cp = rate(copy, data, seconds)
        tag = f"{size // 1024}k"
        out.update({f"xxh3_gbps_{tag}": xxh, f"blake3_gbps_{tag}": b3, f"memcpy_gbps_{tag}": cp})
        out[f"xxh3_over_blake3_{tag}"] = xxh / b3
        if not args.json:
            print(
                f"{size // 1024:>5} KiB: xxh3-128 {xxh:6.2f} GB/s  blake3 {b3:6.2f} GB/s  "
                f"memcpy {cp:6.2f} GB/s  xxh3/blake3 {xxh / b3:.2f}x"
            )
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
