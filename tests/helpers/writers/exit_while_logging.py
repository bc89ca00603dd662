"""Child process: Rust keeps logging (every journal write fails) from store threads while the
interpreter exits. The process must exit normally, not abort.

Usage: python exit_while_logging.py DIR
"""

from __future__ import annotations

import logging
import os
import sys

from flexkv_py import BlockStore


def main() -> None:
    logging.basicConfig(level=logging.INFO, stream=open(os.devnull, "w"))
    store = BlockStore(sys.argv[1], 16 << 20, fault_injection="journal:EIO:1")
    # Queue many batches and leave without waiting: store threads are still failing journal
    # writes, and logging each failure, while the interpreter finalizes.
    for i in range(2000):
        store.submit_put([(b"k%d" % i, b"x" * 4096)])
    print("exiting", flush=True)


if __name__ == "__main__":
    main()
