"""The store's exceptions: one class per Rust error kind, under FlexKVError, with the OS error
behind an I/O failure kept as ``__cause__``."""

from __future__ import annotations

import contextlib
import errno
from pathlib import Path

import pytest

from flexkv_py import _native
from flexkv_py._native import BlockStore, ConfigError, FlexKVError, IoEngineError

MiB = 1 << 20


def test_closed_store_raises_store_closed_error(tmp_path: Path) -> None:
    store = BlockStore(str(tmp_path), 16 * MiB)
    store.put(b"k", b"x" * 4096)
    store.close()
    for call in (
        lambda: store.submit_put([(b"k2", b"y" * 4096)]),
        lambda: store.submit_get([(b"k", bytearray(4096))]),
        lambda: store.delete(b"k"),
        lambda: store.checkpoint(),
        lambda: store.verify(),
    ):
        with pytest.raises(_native.StoreClosedError, match="store is closed") as info:
            call()
        assert isinstance(info.value, FlexKVError)
        assert not isinstance(info.value, ConfigError)


def test_io_error_keeps_the_os_error_as_cause(tmp_path: Path) -> None:
    # A directory where the journal belongs: reading it fails with EISDIR.
    (tmp_path / "flexkv-journal.log").mkdir()
    with pytest.raises(IoEngineError) as info:
        BlockStore(str(tmp_path), 16 * MiB)
    cause = info.value.__cause__
    assert isinstance(cause, OSError)
    assert cause.errno == errno.EISDIR
    assert "flexkv-journal.log" in str(info.value)


def test_option_names_are_exported_and_accepted(tmp_path: Path) -> None:
    assert _native.IO_ENGINES == ("auto", "io_uring", "psync")
    assert set(_native.STATUSES) == {
        "ok",
        "deduped",
        "not_found",
        "corrupt",
        "io_error",
        "rejected",
        "no_space",
        "bad_buffer",
    }
    for i, (engine, codec, algo, durability) in enumerate(
        zip(
            _native.IO_ENGINES,
            _native.COMPRESSIONS * 2,
            _native.CONTENT_HASHES * 2,
            _native.DURABILITIES * 2,
            strict=False,
        )
    ):
        if engine == "io_uring" and not _native.io_uring_available():
            engine = "psync"
        d = tmp_path / str(i)
        d.mkdir()
        with BlockStore(
            str(d),
            16 * MiB,
            io_engine=engine,
            compression=codec,
            content_hash=algo,
            durability=durability,
        ) as store:
            assert store.put(b"k", b"z" * 8192).ok
    for target in _native.FAULT_TARGETS:
        for code in _native.FAULT_ERRNOS:
            d = tmp_path / f"{target}-{code}"
            d.mkdir()
            store = BlockStore(str(d), 16 * MiB, fault_injection=f"{target}:{code}:1")
            with contextlib.suppress(IoEngineError):  # the plan may fail the closing rewrite
                store.close()
    with pytest.raises(ConfigError, match="io_engine"):
        BlockStore(str(tmp_path), 16 * MiB, io_engine="spdk")


def test_index_nbytes_grows_with_the_blocks(tmp_path: Path) -> None:
    with BlockStore(str(tmp_path), 16 * MiB) as store:
        empty = store.index_nbytes()
        store.submit_put([(b"key-%04d" % i, b"%04d" % i * 1024) for i in range(200)]).wait(30)
        assert len(store) == 200
        per_block = (store.index_nbytes() - empty) / 200
        assert 16 < per_block < 1024
