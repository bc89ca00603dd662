"""Block store round trips, dedup accounting, eviction when full, and compression."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
from helpers.store_util import block

from flexkv_py._native import BlockStore, HostPool, content_hash, io_uring_available

MiB = 1 << 20


@pytest.fixture(params=["io_uring", "psync"])
def engine(request: pytest.FixtureRequest) -> str:
    return str(request.param)


def test_io_uring_is_available_here() -> None:
    # CI machines and the dev box support io_uring; the store must really use it there.
    assert io_uring_available()


@pytest.mark.parametrize(
    "size", [0, 1, 511, 4095, 4096, 4097, 65536, 100_000, 2 * MiB, 2 * MiB + 3]
)
def test_roundtrip_sizes(tmp_path: Path, engine: str, size: int) -> None:
    with BlockStore(str(tmp_path), 64 * MiB, io_engine=engine) as store:
        assert store.io_engine == engine
        data = block(b"k%d" % size, size)
        assert store.put(b"k", data).status == "ok"
        assert store.block_len(b"k") == size
        assert store.read(b"k") == data
        out = bytearray(size + 100)
        res = store.get(b"k", out)
        assert res.status == "ok" and res.nbytes == size
        assert bytes(out[:size]) == data


def test_zero_copy_from_host_pool_slots(tmp_path: Path) -> None:
    slot = 64 * 1024
    pool = HostPool(8 * slot)
    try:
        view = np.frombuffer(pool.memoryview(), np.uint8)
        assert pool.address % 4096 == 0
        for i in range(4):
            view[i * slot : (i + 1) * slot] = np.frombuffer(block(b"s%d" % i, slot), np.uint8)
        with BlockStore(str(tmp_path), 16 * MiB) as store:
            items = [(b"s%d" % i, (pool.address + i * slot, slot)) for i in range(4)]
            assert all(r.ok for r in store.submit_put(items).wait(10))
            back = [(b"s%d" % i, (pool.address + (4 + i) * slot, slot)) for i in range(4)]
            assert [r.status for r in store.submit_get(back).wait(10)] == ["ok"] * 4
            for i in range(4):
                assert view[(4 + i) * slot : (5 + i) * slot].tobytes() == block(b"s%d" % i, slot)
    finally:
        del view
        pool.close()


def test_batch_striped_across_directories(tmp_path: Path) -> None:
    dirs = [tmp_path / "d0", tmp_path / "d1", tmp_path / "d2"]
    for d in dirs:
        d.mkdir()
    with BlockStore(";".join(map(str, dirs)), 48 * MiB) as store:
        items = [(b"b%d" % i, block(b"b%d" % i, 65536)) for i in range(30)]
        results = store.submit_put(items).wait(30)
        assert all(r.status == "ok" for r in results)
        outs = [bytearray(65536) for _ in items]
        got = store.submit_get([(k, o) for (k, _), o in zip(items, outs, strict=True)]).wait(30)
        assert all(r.status == "ok" for r in got)
        assert [bytes(o) for o in outs] == [d for _, d in items]
    from helpers.store_util import stored_blocks

    per_dir = [len(stored_blocks(d)) for d in dirs]
    assert per_dir == [10, 10, 10]


def test_dedup_accounting(tmp_path: Path) -> None:
    with BlockStore(str(tmp_path), 32 * MiB) as store:
        data = block(b"same", 256 * 1024)
        first = store.put(b"a", data)
        assert first.status == "ok"
        written = store.stats()["bytes_written"]
        others = store.submit_put([(b"k%d" % i, data) for i in range(9)]).wait(10)
        assert [r.status for r in others] == ["deduped"] * 9
        s = store.stats()
        assert s["bytes_written"] == written  # no data bytes for duplicates
        assert s["blocks"] == 10 and s["unique_blocks"] == 1
        assert s["logical_bytes"] == 10 * len(data)
        assert s["dedup_ratio"] == pytest.approx(10.0)
        phys = s["physical_bytes"]
        for i in range(9):
            assert store.delete(b"k%d" % i)
        assert store.stats()["physical_bytes"] == phys  # still referenced by "a"
        assert store.read(b"a") == data
        assert store.delete(b"a")
        assert store.stats()["physical_bytes"] == 0
        assert not store.delete(b"a")


def test_duplicates_within_one_batch_are_written_once(tmp_path: Path) -> None:
    with BlockStore(str(tmp_path), 32 * MiB) as store:
        data = block(b"dup", 65536)
        res = store.submit_put([(b"x%d" % i, data) for i in range(5)]).wait(10)
        assert [r.status for r in res] == ["ok"] + ["deduped"] * 4
        assert store.stats()["unique_blocks"] == 1
        assert all(store.read(b"x%d" % i) == data for i in range(5))


def test_overwrite_remaps_key(tmp_path: Path) -> None:
    with BlockStore(str(tmp_path), 32 * MiB) as store:
        store.put(b"k", block(b"v1", 8192))
        store.put(b"k", block(b"v2", 8192))
        assert store.read(b"k") == block(b"v2", 8192)
        assert store.stats()["unique_blocks"] == 1


def test_a_full_store_evicts_and_reports_it(tmp_path: Path) -> None:
    blk = 64 * 1024
    # Room for ~14 extents of (1 header page + 16 data pages): the owner deletes before this
    # happens; when it did not, the store evicts (a clock sweep) and says which keys went.
    with BlockStore(str(tmp_path), 1 * MiB) as store:
        for i in range(20):
            assert store.put(b"k%d" % i, block(b"k%d" % i, blk)).ok
        s = store.stats()
        assert s["evictions"] >= 5
        assert s["physical_bytes"] <= store.capacity_bytes
        evicted = set(store.drain_evicted())
        assert len(evicted) == s["evictions"] and store.contains(b"k19")
        for key in evicted:
            assert not store.contains(key)
        assert store.drain_evicted() == []
        for i in range(20):
            key = b"k%d" % i
            if store.contains(key):
                assert store.read(key) == block(key, blk)


def test_block_larger_than_budget_is_no_space(tmp_path: Path) -> None:
    with BlockStore(str(tmp_path), 1 * MiB) as store:
        res = store.put(b"big", b"\x01" * (2 * MiB))
        assert res.status == "no_space" and "does not fit" in (res.error or "")
        assert store.stats()["no_space"] == 1


def test_zstd_compression_stores_compressible_blocks_smaller(tmp_path: Path) -> None:
    zeros = bytes(256 * 1024)
    noisy = block(b"noise", 256 * 1024)
    with BlockStore(str(tmp_path), 16 * MiB, compression="zstd", zstd_level=3) as store:
        store.put(b"z", zeros)
        store.put(b"n", noisy)
        s = store.stats()
        assert s["compressed_blocks"] == 1
        assert s["compression_ratio"] > 1.5
        assert store.read(b"z") == zeros and store.read(b"n") == noisy


def test_match_prefix_and_keys(tmp_path: Path) -> None:
    with BlockStore(str(tmp_path), 8 * MiB) as store:
        for k in (b"p0", b"p1", b"p3"):
            store.put(k, block(k, 4096))
        assert store.match_prefix([b"p0", b"p1", b"p2", b"p3"]) == 2
        assert store.match_prefix([b"x"]) == 0
        assert sorted(store.keys()) == [b"p0", b"p1", b"p3"]
        assert len(store) == 3
        assert store.clear() == 3 and len(store) == 0


def test_content_hash_algorithms() -> None:
    data = block(b"h", 10000)
    a = content_hash(data)
    assert len(a) == 16 and a == content_hash(bytearray(data))
    assert content_hash(data, "blake3") != a
    assert content_hash(data[:-1]) != a


def test_blake3_store_roundtrip(tmp_path: Path) -> None:
    with BlockStore(str(tmp_path), 8 * MiB, content_hash="blake3") as store:
        data = block(b"b3", 70000)
        store.put(b"b3", data)
        assert store.read(b"b3") == data
        assert store.stats()["content_hash"] == "blake3"


def test_concurrent_threads(tmp_path: Path) -> None:
    errors: list[BaseException] = []
    with BlockStore(str(tmp_path), 64 * MiB) as store:

        def worker(t: int) -> None:
            try:
                for round_ in range(10):
                    items = [
                        (b"t%d-%d-%d" % (t, round_, i), block(b"%d-%d-%d" % (t, round_, i), 16384))
                        for i in range(8)
                    ]
                    assert all(r.ok for r in store.submit_put(items).wait(30))
                    outs = [bytearray(16384) for _ in items]
                    got = store.submit_get(
                        [(k, o) for (k, _), o in zip(items, outs, strict=True)]
                    ).wait(30)
                    assert all(r.status == "ok" for r in got)
                    assert [bytes(o) for o in outs] == [d for _, d in items]
            except BaseException as e:  # surfaced below
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert not errors, errors
        assert store.stats()["blocks"] == 8 * 10 * 8


def test_handle_poll_and_timeout(tmp_path: Path) -> None:
    with BlockStore(str(tmp_path), 64 * MiB) as store:
        handle = store.submit_put([(b"k%d" % i, block(b"k%d" % i, MiB)) for i in range(16)])
        assert len(handle) == 16
        results = handle.wait(timeout=60)
        assert handle.done() and all(r.ok for r in results)
        with pytest.raises(ValueError):
            handle.wait(timeout=-1)
