"""Helpers for the block-store tests: deterministic block contents and data-file surgery."""

from __future__ import annotations

import hashlib
import struct
import subprocess
from pathlib import Path

import numpy as np

DATA_FILE = "flexkv-blocks.dat"
HEADER_MAGIC = b"FLXKVBLK"
PAGE = 4096


def block(key: bytes, size: int) -> bytes:
    """Deterministic pseudo-random bytes derived from the key (so any mix-up is visible)."""
    seed = int.from_bytes(hashlib.sha256(key).digest()[:8], "little")
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


def stored_blocks(directory: Path) -> dict[bytes, int]:
    """Scan a data file for block headers: key -> byte offset of its header page."""
    data = (directory / DATA_FILE).read_bytes()
    found: dict[bytes, int] = {}
    for off in range(PAGE, len(data), PAGE):
        if data[off : off + 8] != HEADER_MAGIC:
            continue
        # magic 8 | version 2 | flags 2 | algo 1 | raw 8 | stored 8 | seq 8 | hash 16 | key_len 2
        (key_len,) = struct.unpack_from("<H", data, off + 8 + 2 + 2 + 1 + 8 + 8 + 8 + 16)
        key_start = off + 8 + 2 + 2 + 1 + 8 + 8 + 8 + 16 + 2
        found[data[key_start : key_start + key_len]] = off
    return found


def flip_byte(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def start_writer(script: str, *args: str) -> subprocess.Popen[str]:
    """Start a writer child (tests/helpers/writers/<script>) and wait for its READY line."""
    from helpers.writers import TESTS_DIR, argv

    proc = subprocess.Popen(argv(script, *args), stdout=subprocess.PIPE, text=True, cwd=TESTS_DIR)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "READY"
    return proc
