"""Device faults (EIO, ENOSPC) injected under the store's I/O engine: they become per-block
errors, an unacknowledged put is never visible, acknowledged blocks survive, and the store and
the coordinator keep serving (the engine recomputes what it could not load)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers.coordinator_util import PAGE_BYTES, _config, _engine, _keys, _ns, _pages
from helpers.store_util import block
from helpers.writers import TESTS_DIR, argv

from flexkv_py import BlockStore, ConfigError
from flexkv_py._native import StoreClosedError
from flexkv_py.coordinator import CacheEngine
from flexkv_py.errors import FlexKVError
from flexkv_py.tiers.host_pool import HostPool

MiB = 1 << 20


@pytest.mark.parametrize("engine", ["io_uring", "psync"])
def test_write_faults_are_never_acknowledged(tmp_path: Path, engine: str) -> None:
    keys = [b"k%d" % i for i in range(12)]
    # Separate 1-block batches: every other write fails with EIO.
    with BlockStore(str(tmp_path), 16 * MiB, io_engine=engine, fault_injection="write:EIO:2") as s:
        statuses = [s.put(k, block(k, 8192)).status for k in keys]
        assert statuses == ["io_error", "ok"] * 6
        assert s.stats()["io_errors"] == 6
        acked = {k for k, st in zip(keys, statuses, strict=True) if st == "ok"}
        assert set(s.keys()) == acked
    with BlockStore(str(tmp_path), 16 * MiB) as s:  # no faults now: what was acked is there
        assert set(s.keys()) == acked
        assert all(s.read(k) == block(k, 8192) for k in acked)
        # the space of the failed writes was released and is usable
        assert all(s.put(k, block(k, 8192)).ok for k in keys if k not in acked)


def test_enospc_on_write_is_a_per_block_error(tmp_path: Path) -> None:
    with BlockStore(str(tmp_path), 16 * MiB, fault_injection="write:ENOSPC:1") as s:
        r = s.put(b"a", block(b"a", 4096))
        assert r.status == "io_error" and "No space left" in (r.error or "")
        assert not s.contains(b"a")


def test_read_faults_report_io_error_and_the_store_keeps_serving(tmp_path: Path) -> None:
    with BlockStore(str(tmp_path), 16 * MiB) as s:
        for i in range(4):
            s.put(b"k%d" % i, block(b"k%d" % i, 8192))
    with BlockStore(str(tmp_path), 16 * MiB, fault_injection="read:EIO:2") as s:
        outs = [bytearray(8192) for _ in range(4)]
        statuses = [s.get(b"k%d" % i, outs[i]).status for i in range(4)]
        assert statuses == ["io_error", "ok", "io_error", "ok"]
        assert bytes(outs[1]) == block(b"k1", 8192)
        # a read error does not drop the block: read 5 fails (1 in 2), read 6 succeeds
        assert s.get(b"k0", outs[0]).status == "io_error"
        assert s.get(b"k0", outs[0]).status == "ok" and bytes(outs[0]) == block(b"k0", 8192)


def test_bad_fault_spec_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="fault_injection"):
        BlockStore(str(tmp_path), 16 * MiB, fault_injection="sometimes")


def test_coordinator_load_faults_degrade_to_recompute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = _config(tmp_path, 8, 64, admission="write_through")
    ns = _ns()
    keys = _keys(ns, 4)
    pages = _pages(keys)
    with _engine(cfg, ns, 8) as eng:
        assert eng.store_pages(keys, pages).ok
    # The SSD tier of the restarted engine fails every read (the environment variable reaches
    # the native store through the coordinator's SsdTier unchanged).
    monkeypatch.setenv("FLEXKV_FAULT_INJECTION", "read:EIO:1")
    with _engine(cfg, ns, 8) as eng:
        assert eng.lookup(keys) == 4
        out = eng.submit_load(keys, None).result()
        assert out.statuses == ("io_error",) * 4  # per block, nothing served
        assert eng.lookup(keys) == 0  # dropped: the engine recomputes them
        # and it keeps serving: the recomputed blocks are stored and load again from host
        assert eng.store_pages(keys, pages).ok
        assert eng.load_pages(keys) == pages


@pytest.mark.parametrize("spec", ["journal:ENOSPC:3", "journal:EIO:1"])
def test_journal_faults_never_lose_an_acknowledged_block(tmp_path: Path, spec: str) -> None:
    import subprocess

    out = subprocess.run(
        argv("journal_fault_writer", str(tmp_path), spec, "30"),
        capture_output=True,
        text=True,
        timeout=120,  # a deadlock (logging vs GIL vs store lock) would hit this
        cwd=TESTS_DIR,
    )
    assert out.returncode == -9, out.stderr[-2000:]
    lines = out.stdout.splitlines()
    assert lines[-1] == "DONE"
    acked = {k.encode() for line in lines if line.startswith("ACK ") for k in line[4:].split()}
    shared = block(b"shared", 8192)
    with BlockStore(str(tmp_path), 64 * MiB) as s:
        present = set(s.keys())
        assert acked <= present, sorted(acked - present)[:5]
        for key in present:  # whatever is visible is complete and correct
            n = int(key[1:])
            assert s.read(key) == (shared if n % 6 % 2 else block(key, 8192))
    if spec.endswith(":1"):
        assert not acked  # every journal write failed: nothing may be acknowledged
    else:
        assert len(acked) > 60  # failed appends were healed by rewriting the journal


def test_closed_handle_never_touches_the_journal(tmp_path: Path) -> None:
    a = BlockStore(str(tmp_path), 16 * MiB)
    a.put(b"old", block(b"old", 4096))
    a.close()
    with BlockStore(str(tmp_path), 16 * MiB) as b:  # a new owner of the directory
        for i in range(10):
            assert b.put(b"new%d" % i, block(b"new%d" % i, 4096)).ok
        for call in (lambda: a.delete(b"old"), a.clear, a.checkpoint, a.verify):
            with pytest.raises(StoreClosedError, match="closed"):
                call()
        with pytest.raises(StoreClosedError, match="closed"):
            a.put(b"late", b"x")
    with BlockStore(str(tmp_path), 16 * MiB) as c:
        assert {b"old", *(b"new%d" % i for i in range(10))} <= set(c.keys())


def test_interpreter_exit_while_rust_logs_does_not_abort(tmp_path: Path) -> None:
    import subprocess

    for run in range(5):
        d = tmp_path / str(run)
        d.mkdir()
        out = subprocess.run(
            argv("exit_while_logging", str(d)),
            capture_output=True,
            text=True,
            timeout=120,
            cwd=TESTS_DIR,
        )
        assert out.returncode == 0, (out.returncode, out.stderr[-1500:])
        assert out.stdout.strip() == "exiting"


def test_a_tier_that_fails_to_close_leaves_nothing_else_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An SSD whose journal cannot be written fails its close (the clean-shutdown record): the
    engine still closes what it owns (the host pool here) and then raises that error."""
    ns = _ns()
    cfg = _config(tmp_path, 4, 64)
    keys = _keys(ns, 2)
    with _engine(cfg, ns, 4) as eng:
        assert eng.store_pages(keys, _pages(keys)).ok
    monkeypatch.setenv("FLEXKV_FAULT_INJECTION", "journal:EIO:1")  # every journal write fails
    pool = HostPool(4, PAGE_BYTES, pin=False)
    eng = CacheEngine(cfg, ns, pool, owns=(pool,))
    with pytest.raises(FlexKVError, match="journal"):
        eng.close()
    assert pool.closed
