"""Child process for the write-behind restart tests: an engine with the DEFAULT configuration
(only the tier sizes and the SSD directory are set) stores chains of blocks.

Usage: python write_behind_writer.py DIR MODE
  once     store BLOCKS blocks, close the engine (its bounded shutdown flush), print DONE.
  forever  store 4-block chains; print "STORED i" once block i is in the host tier and "ACK i"
           once the index confirms its SSD copy (and "TICK" once all are stored); never close
           (the parent kills it with -9).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from flexkv_py.index import Tier
from helpers.coordinator_util import _config, _engine, _keys, _ns, _pages

HOST_SLOTS = 16
SSD_SLOTS = 4096
BLOCKS = 8  # once
MAX_BLOCKS = 2000  # forever: then only pumps, so the SSD tier never evicts


def main() -> None:
    directory, mode = Path(sys.argv[1]), sys.argv[2]
    ns = _ns()
    eng = _engine(_config(directory, HOST_SLOTS, SSD_SLOTS), ns, HOST_SLOTS)
    if mode == "once":
        keys = _keys(ns, BLOCKS, "wb")
        assert eng.store_pages(keys, _pages(keys)).ok
        eng.close()
        print("DONE", flush=True)
        return
    keys = _keys(ns, MAX_BLOCKS, "wb")
    acked: set[int] = set()
    stored = 0
    print("READY", flush=True)
    while True:
        if stored < MAX_BLOCKS:
            batch = range(stored, min(stored + 4, MAX_BLOCKS))
            out = eng.store_pages([keys[i] for i in batch], _pages([keys[i] for i in batch]))
            for i, status in zip(batch, out.statuses, strict=True):
                if status == "ok":
                    sys.stdout.write(f"STORED {i}\n")
            stored = batch.stop
        else:
            eng.lookup([])  # pumps background jobs
            sys.stdout.write("TICK\n")  # the parent reads lines until its deadline: never silent
        for i in range(max(0, stored - 64), stored):
            if i not in acked and eng.manager.index.readable_on(keys[i], Tier.SSD):
                acked.add(i)
                sys.stdout.write(f"ACK {i}\n")
        sys.stdout.flush()
        time.sleep(0.02)


if __name__ == "__main__":
    main()
