"""Persistence: clean reopen, kill -9 at random moments, torn journals, corruption, bad input."""

from __future__ import annotations

import hashlib
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.store_util import DATA_FILE, PAGE, block, flip_byte, start_writer, stored_blocks
from helpers.writers.crash_writer import expected_size

from flexkv_py import (
    BlockNotFoundError,
    BlockStore,
    ConfigError,
    CorruptBlockError,
    StorageFullError,
    StoreLockedError,
)

MiB = 1 << 20


def test_clean_reopen_recovers_everything(tmp_path: Path) -> None:
    keys = [b"k%d" % i for i in range(50)]
    with BlockStore(str(tmp_path), 32 * MiB) as store:
        store.submit_put([(k, block(k, 4096 * (1 + i % 7))) for i, k in enumerate(keys)]).wait(30)
        store.delete(b"k3")
    with BlockStore(str(tmp_path), 32 * MiB) as store:
        s = store.stats()
        assert s["blocks"] == 49
        assert s["last_clean_shutdown_unix"] > 0
        assert s["recovery_seconds"] < 5
        for i, k in enumerate(keys):
            if k == b"k3":
                with pytest.raises(BlockNotFoundError):
                    store.read(k)
            else:
                assert store.read(k) == block(k, 4096 * (1 + i % 7))


def test_sigkill_never_loses_acknowledged_blocks(tmp_path: Path) -> None:
    rng = random.Random(1234)
    acked: set[bytes] = set()
    deleted: set[bytes] = set()
    next_index = 0
    for _round in range(12):
        proc = start_writer("crash_writer.py", str(tmp_path), str(next_index))
        assert proc.stdout is not None
        # Let it run for a random number of acknowledged batches, then kill it mid-flight.
        target = rng.randint(1, 40)
        seen = 0

        def take(line: str) -> None:
            kind, key = line.split()
            if kind == "ACK":
                acked.add(key.encode())
                deleted.discard(key.encode())
            elif kind == "DELETING":  # killed before the delete returned: present or not
                acked.discard(key.encode())
            else:
                deleted.add(key.encode())

        for line in proc.stdout:
            take(line)
            seen += line.startswith("ACK")
            if seen >= target * 8:
                break
        proc.send_signal(signal.SIGKILL)
        # Keys acknowledged after our last read are unknown to us: read the rest of the pipe.
        rest = proc.stdout.read()
        proc.wait()
        for line in rest.splitlines():
            take(line)
        with BlockStore(str(tmp_path), 512 * MiB) as store:
            stats = store.stats()
            assert stats["evictions"] == 0
            assert stats["last_clean_shutdown_unix"] == 0  # it was a crash
            present = set(store.keys())
            for key in acked:
                assert key in present, f"acknowledged {key!r} lost after SIGKILL"
            for key in present:
                # Every visible block, acknowledged or not, is complete and correct.
                assert store.read(key) == block(key, expected_size(int(key[1:]))), key
            for key in deleted & present:
                pytest.fail(f"deleted key {key!r} came back")
            next_index = max(int(k[1:]) for k in present | {b"c0"}) + 64
    assert len(acked) > 50


def test_torn_journal_tail_is_cut(tmp_path: Path) -> None:
    with BlockStore(str(tmp_path), 16 * MiB) as store:
        for i in range(5):
            store.put(b"k%d" % i, block(b"k%d" % i, 8192))
    journal = tmp_path / "flexkv-journal.log"
    with open(journal, "ab") as f:
        f.write(b"\x40\x00\x00\x00garbage-of-a-half-written-record")
    with BlockStore(str(tmp_path), 16 * MiB) as store:
        assert store.stats()["torn_journal_bytes"] > 0
        assert len(store) == 5
        assert all(store.read(b"k%d" % i) == block(b"k%d" % i, 8192) for i in range(5))


def test_flipped_bytes_are_reported_for_exactly_those_blocks(tmp_path: Path) -> None:
    keys = [b"k%d" % i for i in range(12)]
    with BlockStore(str(tmp_path), 16 * MiB) as store:
        store.submit_put([(k, block(k, 3 * PAGE)) for k in keys]).wait(30)
    where = stored_blocks(tmp_path)
    assert set(where) == set(keys)
    victims = {
        b"k2": PAGE + 100,
        b"k7": PAGE + 3 * PAGE - 1,
        b"k9": 20,
    }  # payload, payload end, header
    for key, delta in victims.items():
        flip_byte(tmp_path / DATA_FILE, where[key] + delta)
    with BlockStore(str(tmp_path), 16 * MiB) as store:
        assert sorted(store.verify()) == sorted(victims)
        for k in keys:
            if k in victims:
                assert not store.contains(k)  # dropped: recomputed, never served
            else:
                assert store.read(k) == block(k, 3 * PAGE)
        assert store.stats()["corrupt_reads"] == 3


def test_corrupt_get_reports_status_and_raises_on_read(tmp_path: Path) -> None:
    with BlockStore(str(tmp_path), 16 * MiB) as store:
        store.put(b"a", block(b"a", 8192))
        store.put(b"b", block(b"b", 8192))
    flip_byte(tmp_path / DATA_FILE, stored_blocks(tmp_path)[b"a"] + PAGE + 5)
    with BlockStore(str(tmp_path), 16 * MiB) as store:
        out = bytearray(8192)
        res = store.get(b"a", out)
        assert res.status == "corrupt" and not res.ok and "hash" in (res.error or "")
        assert store.read(b"b") == block(b"b", 8192)
        store.put(b"a2", block(b"a", 8192))  # same content again: written fresh, not deduped
        assert store.read(b"a2") == block(b"a", 8192)
    flip_byte(tmp_path / DATA_FILE, stored_blocks(tmp_path)[b"b"] + PAGE + 5)
    with BlockStore(str(tmp_path), 16 * MiB) as store, pytest.raises(CorruptBlockError):
        store.read(b"b")


def test_truncated_data_file_reports_blocks_past_the_cut(tmp_path: Path) -> None:
    keys = [b"k%d" % i for i in range(8)]
    with BlockStore(str(tmp_path), 16 * MiB, preallocate=False) as store:
        store.submit_put([(k, block(k, 4 * PAGE)) for k in keys]).wait(30)
    where = stored_blocks(tmp_path)
    cut = sorted(where.values())[5] + 2 * PAGE  # inside the 6th block
    os.truncate(tmp_path / DATA_FILE, cut)
    with BlockStore(str(tmp_path), 16 * MiB, read_only=True) as ro:
        bad = set(ro.verify())
    expected_bad = {k for k, off in where.items() if off + 5 * PAGE > cut}
    assert bad == expected_bad and len(bad) == 3


def test_read_only_open_sees_a_live_store(tmp_path: Path) -> None:
    with BlockStore(str(tmp_path), 16 * MiB) as store:
        store.put(b"x", block(b"x", 8192))
        ro = BlockStore(str(tmp_path), 0, read_only=True)  # no lock taken
        assert ro.read(b"x") == block(b"x", 8192)
        with pytest.raises(ConfigError, match="read-only"):
            ro.put(b"y", b"1")
        ro.close()


# ---------------------------------------------------------------- bad input


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        BlockStore(str(tmp_path / "nope"), 16 * MiB)


def test_unwritable_directory() -> None:
    # /sys refuses new files even for root.
    with pytest.raises(ConfigError, match="not writable"):
        BlockStore("/sys", 16 * MiB)


def test_capacity_larger_than_free_space(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"only .* are free"):
        BlockStore(str(tmp_path), 1 << 60)


def test_zero_capacity(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="capacity"):
        BlockStore(str(tmp_path), 0)


def test_unknown_options(tmp_path: Path) -> None:
    for kwargs, name in [
        ({"io_engine": "spdk"}, "io_engine"),
        ({"compression": "lz4"}, "compression"),
        ({"content_hash": "md5"}, "content_hash"),
        ({"durability": "never"}, "durability"),
        ({"queue_depth": 0}, "queue_depth"),
    ]:
        with pytest.raises(ConfigError, match=name):
            BlockStore(str(tmp_path), 16 * MiB, **kwargs)  # type: ignore[arg-type]


def test_mismatched_buffers(tmp_path: Path) -> None:
    with BlockStore(str(tmp_path), 16 * MiB) as store:
        store.put(b"k", block(b"k", 8192))
        res = store.get(b"k", bytearray(100))
        assert res.status == "bad_buffer" and "smaller" in (res.error or "")
        with pytest.raises(ValueError, match="read-only"):
            store.get(b"k", b"immutable bytes" * 1000)
        with pytest.raises(ValueError, match="NULL"):
            store.put(b"k", (0, 4096))
        with pytest.raises(TypeError):
            store.submit_put([b"not-a-pair"])  # type: ignore[list-item]
        with pytest.raises(ConfigError, match="longer than"):
            store.put(b"x" * 5000, b"1")


def test_second_opener_gets_a_clear_error(tmp_path: Path) -> None:
    with BlockStore(str(tmp_path), 16 * MiB):
        with pytest.raises(StoreLockedError, match=f"pid {os.getpid()}"):
            BlockStore(str(tmp_path), 16 * MiB)
        code = (
            "import sys\nfrom flexkv_py import BlockStore, StoreLockedError\n"
            "try:\n    BlockStore(sys.argv[1], 16 << 20)\nexcept StoreLockedError as e:\n"
            "    print(e); sys.exit(3)\n"
        )
        out = subprocess.run(
            [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True
        )
        assert out.returncode == 3 and "in use by another process" in out.stdout
    BlockStore(str(tmp_path), 16 * MiB).close()  # released on close


def test_directory_list_changes(tmp_path: Path) -> None:
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    for d in (a, b, c):
        d.mkdir()
    with BlockStore([str(a), str(b)], 16 * MiB) as store:
        store.submit_put([(b"k%d" % i, block(b"k%d" % i, 8192)) for i in range(10)]).wait(10)
    with pytest.raises(ConfigError, match="spans 2 directories"):
        BlockStore([str(a)], 16 * MiB)
    with pytest.raises(ConfigError, match="already holds data"):
        BlockStore([str(b), str(a)], 16 * MiB)
    # A replaced disk: its blocks are dropped, the other directory's blocks survive.
    with BlockStore([str(a), str(c)], 16 * MiB) as store:
        assert len(store) == 5
        for key in store.keys():
            assert store.read(key) == block(key, 8192)


def test_storage_full_error_class_exists() -> None:
    assert issubclass(StorageFullError, Exception)


def _distinct_blocks(keys: list[bytes], start: int, n: int) -> list[tuple[bytes, bytes]]:
    return [(k, b"%06d" % (start + i) * 16) for i, k in enumerate(keys[start : start + n])]


def test_connector_shaped_keys_are_packed_and_come_back_whole(tmp_path: Path) -> None:
    # Rank tag + 24-byte namespace head + sha256 block hash: the layout the index packs.
    head = b"\0\1\0\0" + bytes(range(24))
    keys = [head + hashlib.sha256(b"%d" % i).digest() for i in range(3000)]
    with BlockStore(str(tmp_path), 64 * MiB) as store:
        empty = store.index_nbytes()
        for start in range(0, len(keys), 500):
            store.submit_put(_distinct_blocks(keys, start, 500)).wait(30)
        assert len(store) == len(keys)
        per_block = (store.index_nbytes() - empty) / len(keys)
        assert per_block < 140, per_block
    with BlockStore(str(tmp_path), 64 * MiB) as store:
        assert store.keys() == keys  # whole, and in write order
    # A store too small for them all evicts some (a clock sweep), and reports them whole.
    (tmp_path / "small").mkdir()
    with BlockStore(str(tmp_path / "small"), 1 * MiB) as small:
        for start in range(0, 400, 100):
            small.submit_put(_distinct_blocks(keys, start, 100)).wait(30)
        evicted = small.drain_evicted()
        assert evicted and set(evicted) <= set(keys[:400])
        assert set(evicted) | set(small.keys()) == set(keys[:400])
