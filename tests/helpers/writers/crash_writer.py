"""Child process for the crash test: writes batches forever and reports each acknowledged key.

Usage: python crash_writer.py DIR START_INDEX
Prints "ACK <key>" (flushed) for every block whose batch completed successfully, "DELETING <key>"
before a delete and "DEL <key>" once it returned (killed in between, the key may be either).
"""

from __future__ import annotations

import sys

from flexkv_py import BlockStore
from helpers.store_util import block


def expected_size(n: int) -> int:
    return 4096 * (1 + n % 40) + (n % 3) * 100


def main() -> None:
    directory, start = sys.argv[1], int(sys.argv[2])
    store = BlockStore(directory, 512 << 20)  # never evicts during the test
    print("READY", flush=True)
    i = start
    while True:
        items = [(b"c%d" % n, block(b"c%d" % n, expected_size(n))) for n in range(i, i + 8)]
        results = store.submit_put(items).wait(60)
        acked = [k for (k, _), r in zip(items, results, strict=True) if r.ok]
        sys.stdout.write("".join(f"ACK {k.decode()}\n" for k in acked))
        sys.stdout.flush()
        # Deletes too, so the journal holds removals and reused extents.
        if i % 5 == 0 and i > start:
            sys.stdout.write(f"DELETING c{i - 3}\n")
            sys.stdout.flush()
            store.delete(b"c%d" % (i - 3))
            sys.stdout.write(f"DEL c{i - 3}\n")
            sys.stdout.flush()
        i += len(items)


if __name__ == "__main__":
    main()
