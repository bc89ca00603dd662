"""Child process: puts batches into a store whose journal writes fail now and then (half a
record reaches the file, as on a failing disk), reports each acknowledged key, then kills
itself with SIGKILL. A second thread keeps calling the store's lock-taking methods throughout,
so a deadlock between logging, the GIL and the store lock would hang this process.

Usage: python journal_fault_writer.py DIR SPEC BATCHES
"""

from __future__ import annotations

import os
import signal
import sys
import threading

from flexkv_py import BlockStore
from helpers.store_util import block


def main() -> None:
    directory, spec, batches = sys.argv[1], sys.argv[2], int(sys.argv[3])
    store = BlockStore(directory, 64 << 20, fault_injection=spec)
    stop = threading.Event()

    def poke() -> None:
        while not stop.is_set():
            store.contains(b"k0")
            store.stats()
            store.drain_evicted()

    poker = threading.Thread(target=poke, daemon=True)
    poker.start()
    shared = block(b"shared", 8192)  # many keys dedup onto this content
    for b in range(batches):
        items = []
        for j in range(6):
            key = b"k%d" % (b * 6 + j)
            items.append((key, shared if j % 2 else block(key, 8192)))
        results = store.submit_put(items).wait(60)
        acked = [k.decode() for (k, _), r in zip(items, results, strict=True) if r.ok]
        print("ACK " + " ".join(acked) if acked else "NONE", flush=True)
    stop.set()
    poker.join()
    print("DONE", flush=True)
    os.kill(os.getpid(), signal.SIGKILL)


if __name__ == "__main__":
    main()
