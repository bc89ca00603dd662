"""Child process for the kill -9 test of block metadata: stores chains of blocks with parents
and metadata, printing ``ACK key`` once each batch is acknowledged, until it is killed."""

from __future__ import annotations

import sys

from flexkv_py._native import BlockStore
from helpers.store_util import block

MiB = 1 << 20


def meta_of(key: bytes) -> bytes:
    return b"tokens:" + key * 3


def main() -> None:
    directory, start = sys.argv[1], int(sys.argv[2])
    store = BlockStore(directory, 512 * MiB, durability="process")
    print("READY", flush=True)
    i = start
    while True:
        keys = [b"m%d" % (i + j) for j in range(8)]
        parents = [b"m%d" % (i + j - 1) if j else None for j in range(8)]
        bufs = [block(k, 12_000) for k in keys]
        results = store.submit_put(
            list(zip(keys, bufs, strict=True)), parents=parents, metas=[meta_of(k) for k in keys]
        ).wait()
        for k, r in zip(keys, results, strict=True):
            if r.ok:
                print("ACK", k.decode(), flush=True)
        i += 8


if __name__ == "__main__":
    main()
