"""The first request after a restart hits: an engine in a new process stored a
200-token prompt on its SSD; a restarted engine (recover=False: not one idle step) gets a prompt
sharing its first 192 tokens as its very first request and loads those from the SSD, bit for bit,
before any worker reported its inventory. The scheduler read the shards itself at construction;
the workers' reports then settle what it adopted. A shard it cannot read is a miss until they
report (never an error or a stall), and a block a worker no longer holds is never served."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import vllm_harness as vh
from helpers.writers import TESTS_DIR, argv
from helpers.writers.restart_first_hit_writer import BS, PROMPT_TOKENS, SEED, config
from vllm.v1.request import RequestStatus

from flexkv_py import BlockStore
from flexkv_py.cli.inspect import DATA_FILE, LOCK_FILE
from flexkv_py.index.joined_keys import JoinedKeys
from flexkv_py.index.namespace import SHARD_TAG
from flexkv_py.integration.vllm import restart_inventory
from flexkv_py.tiers.ssd import inventory as ssd_inventory
from flexkv_py.tiers.ssd.inventory import JOURNAL_FILE, SsdInventory

SHARED = 192  # 12 full blocks of the stored prompt
BLOCKS = SHARED // BS


def write_in_child(model_dir: str, ssd: Path, tp: int = 1, pp: int = 1) -> int:
    """Run the storing engine in its own process; returns the blocks it left on the SSD."""
    out = subprocess.run(
        argv("restart_first_hit_writer", model_dir, str(ssd), str(tp), str(pp)),
        capture_output=True,
        text=True,
        cwd=TESTS_DIR,
        timeout=300,
        check=True,
    )
    on_ssd: int = json.loads(out.stdout.strip().splitlines()[-1])["on_ssd"]
    return on_ssd


def second_prompt() -> list[int]:
    stored = vh.prompt_tokens(SEED, PROMPT_TOKENS)
    return vh.prompt_tokens(SEED + 1, SHARED + 40, prefix=stored[:SHARED])


def record_lookups(e: vh.Engine) -> list[tuple[str, tuple[int | None, bool]]]:
    """What the connector answers vLLM's scheduler, per lookup (the real method runs)."""
    answers: list[tuple[str, tuple[int | None, bool]]] = []
    connector = e.scheduler.connector
    real = connector.get_num_new_matched_tokens

    def recording(request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        got: tuple[int | None, bool] = real(request, num_computed_tokens)
        answers.append((request.request_id, got))
        return got

    connector.get_num_new_matched_tokens = recording  # type: ignore[method-assign]
    return answers


def loaded(e: vh.Engine, req_id: str) -> bool:
    return any(req_id in rec.finished_recving for rec in e.history)


def prompt_done(req: Any) -> Any:
    return lambda: (
        req.status == RequestStatus.RUNNING and req.num_computed_tokens >= len(req.prompt_token_ids)
    )


def side_stats(e: vh.Engine) -> dict[str, Any]:
    (side,) = e.flexkv_scheduler_sides()
    side._inventory.wait_read()  # as every scheduler call does first: the read runs on a thread
    return side._mgr.stats()  # type: ignore[no-any-return]


@pytest.fixture
def restarted(model_dir: str, tmp_path: Path) -> Iterator[tuple[Any, Path]]:
    """(a function that restarts the engine on the stored SSD, the SSD directory)."""
    ssd = tmp_path / "ssd"
    assert write_in_child(model_dir, ssd) == BLOCKS
    engines: list[vh.Engine] = []

    def start(**kw: Any) -> vh.Engine:
        engines.append(vh.Engine(model_dir, config(ssd), recover=False, **kw))
        return engines[-1]

    yield start, ssd
    for e in engines:
        e.shutdown()


@pytest.mark.parametrize(("tp", "pp"), [(1, 1), (2, 2)], ids=["tp1", "tp2xpp2"])
def test_the_first_request_after_a_restart_loads_the_shared_prefix_bit_exact(
    model_dir: str, tmp_path: Path, tp: int, pp: int
) -> None:
    ssd = tmp_path / "ssd"
    assert write_in_child(model_dir, ssd, tp, pp) == BLOCKS
    e = vh.Engine(model_dir, config(ssd), tp_size=tp, pp_size=pp, recover=False)
    (side,) = e.flexkv_scheduler_sides()
    assert not side.recovered  # no worker reported: the hit is the scheduler's own read
    answers = record_lookups(e)
    b = e.add(vh.make_request("B", second_prompt(), max_tokens=2))
    e.step()
    assert answers[0] == ("B", (SHARED, True)), answers
    assert side.recovered  # the workers' first output settled it
    e.run_until(prompt_done(b))
    assert loaded(e, "B")
    e.run()
    for w in e.workers:
        assert w.model.checked["B"] == SHARED  # the loaded KV, position by position, bit-exact
        assert w.model.written["B"] == 40 + 1  # the new suffix and one decode token
    assert not e.mismatches()
    stats = side_stats(e)
    assert stats["ssd_adopted_blocks"] == BLOCKS  # the reports added nothing twice
    assert stats.get("ssd_forgotten_blocks", 0) == 0
    vh.assert_no_leaks(e)
    e.shutdown()


def computed_in_first_step(e: vh.Engine) -> None:
    """The old behaviour: the first request misses and is computed in the very first step
    (never "ask again later"); after it, the workers' reports are in."""
    (side,) = e.flexkv_scheduler_sides()
    answers = record_lookups(e)
    b = e.add(vh.make_request("B", second_prompt(), max_tokens=2))
    first = e.step()
    assert answers[0] == ("B", (0, False)), answers
    assert first.scheduled.get("B", 0) > 0, "the request waited"
    assert side.recovered
    e.run()
    assert b.is_finished() and not loaded(e, "B")
    assert e.workers[0].model.written["B"] == SHARED + 40 + 1
    assert not e.mismatches()


def test_a_corrupt_journal_is_a_miss_and_the_engine_serves(restarted: Any) -> None:
    start, ssd = restarted
    journal = ssd / "tp0-pp0" / JOURNAL_FILE
    journal.write_bytes(b"\xff" * 64 + journal.read_bytes()[64:])
    e = start()
    (side,) = e.flexkv_scheduler_sides()
    side._inventory.wait_read()
    assert side._inventory.adopted_early == 0
    computed_in_first_step(e)
    assert side_stats(e).get("ssd_adopted_blocks", 0) == 0  # the worker cannot open it either


def test_an_unreadable_shard_misses_until_the_workers_report_then_hits(
    restarted: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scheduler's read-only open fails (an I/O error), the worker's open does not: a miss
    in the first step, a hit once the workers reported."""
    start, _ = restarted

    def failing(*args: Any) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(ssd_inventory, "_open", failing)
    e = start()
    (side,) = e.flexkv_scheduler_sides()
    computed_in_first_step(e)
    assert side._inventory.adopted_early == 0
    assert side_stats(e)["ssd_adopted_blocks"] == BLOCKS  # from the reports
    answers = record_lookups(e)
    c = e.add(vh.make_request("C", vh.prompt_tokens(SEED, PROMPT_TOKENS), max_tokens=2))
    e.reset_gpu_prefix_cache()
    e.run_until(prompt_done(c))
    assert answers[0][1][0] == SHARED and loaded(e, "C")
    e.run()
    assert not e.mismatches()


def test_a_shard_locked_by_another_process_never_serves_its_blocks(restarted: Any) -> None:
    """Another live process holds the shard (a misconfigured second engine): the read-only
    read adopts its blocks, the worker cannot open it (no SSD tier). The promised load fails
    on the worker and vLLM recomputes it; the worker's empty report takes the blocks away."""
    start, ssd = restarted
    fd = os.open(ssd / "tp0-pp0" / LOCK_FILE, os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        e = start()
        (side,) = e.flexkv_scheduler_sides()
        side._inventory.wait_read()  # the read runs on a thread; scheduler calls wait for it
        assert side._inventory.adopted_early == BLOCKS
        b = e.add(vh.make_request("B", second_prompt(), max_tokens=2))
        e.run()
        assert b.is_finished()
        assert side._mgr.index.counts()["on_ssd"] == 0
        assert e.workers[0].model.written["B"] == SHARED + 40 + 1  # recomputed in full
        assert not e.mismatches()
    finally:
        os.close(fd)


def test_a_block_the_worker_no_longer_holds_leaves_the_index_at_its_report(
    restarted: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The scheduler's read lists block 5, the worker's store no longer has it (as a worker's
    recovery may drop blocks): its report takes it away, later lookups stop before it."""
    start, ssd = restarted
    shard = ssd / "tp0-pp0"
    with BlockStore([str(shard)], 0, read_only=True) as view:
        dropped = view.keys()[5]  # oldest first: the prompt's sixth block
    size = (shard / DATA_FILE).stat().st_size  # the same size: the file is not resized
    with BlockStore([str(shard)], size) as store:
        assert store.delete(dropped)
    real = restart_inventory.read_ssd_inventory

    def stale_read(*args: Any, **kw: Any) -> SsdInventory | None:
        inv = real(*args, **kw)
        assert inv is not None and len(inv.keys) == BLOCKS - 1
        keys = list(inv.keys)
        keys.insert(5, dropped[len(SHARD_TAG.pack(0, 0)) :])
        # As the read hands its keys over: joined when they have one width (they do here).
        joined = JoinedKeys.of(keys)
        assert joined is not None
        inv.keys = joined
        return inv

    monkeypatch.setattr(restart_inventory, "read_ssd_inventory", stale_read)
    e = start()
    (side,) = e.flexkv_scheduler_sides()
    e.step()  # the workers' first output: their reports
    assert side._inventory.adopted_early == BLOCKS
    stats = side_stats(e)
    assert stats["ssd_forgotten_blocks"] == 1 and stats["ssd_adopted_blocks"] == BLOCKS
    answers = record_lookups(e)
    b = e.add(vh.make_request("B", second_prompt(), max_tokens=2))
    e.run_until(prompt_done(b))
    assert answers[0] == ("B", (5 * BS, True)), answers
    e.run()
    assert not any(rec.invalid_block_ids for rec in e.history), "a promised block failed"
    assert e.workers[0].model.checked["B"] == 5 * BS
    assert not e.mismatches()
