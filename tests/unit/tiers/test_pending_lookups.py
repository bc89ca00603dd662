"""`PendingLookups` over submitted handles: "ask again later" while a handle is not done, its
count once done, a miss after `max_wait_s` (counted in `gave_up`), a failed or unsubmittable
lookup a logged miss, and `forget`/`close` dropping the handles (which aborts their lookups).
Then the native handles of a `file://` tier: the blocking lookup's answers, submitted."""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from pathlib import Path

import pytest

from flexkv_py import _native
from flexkv_py.errors import IoEngineError, StoreClosedError
from flexkv_py.tiers.object.lookups import PendingLookups


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Handle:
    """A lookup the test answers by hand."""

    def __init__(self, keys: Sequence[bytes]) -> None:
        self.keys = list(keys)
        self.answered = threading.Event()
        self.count = 0
        self.error: Exception | None = None

    def answer(self, count: int = 0, error: Exception | None = None) -> None:
        self.count, self.error = count, error
        self.answered.set()

    def done(self) -> bool:
        return self.answered.is_set()

    def result(self, timeout: float | None = None) -> int:
        if not self.answered.wait(timeout):
            raise TimeoutError("not answered")
        if self.error is not None:
            raise self.error
        return self.count


class Submit:
    def __init__(self) -> None:
        self.handles: list[Handle] = []
        self.refuse: Exception | None = None

    def __call__(self, keys: Sequence[bytes]) -> Handle:
        if self.refuse is not None:
            raise self.refuse
        self.handles.append(Handle(keys))
        return self.handles[-1]


KEYS = [b"a", b"b", b"c"]


def test_ask_later_then_count_then_kept() -> None:
    submit, clock = Submit(), Clock()
    pending = PendingLookups(submit, max_wait_s=1.0, clock=clock)
    assert pending.poll("r", KEYS) is None
    assert pending.poll("r", KEYS) is None
    assert len(submit.handles) == 1 and submit.handles[0].keys == KEYS
    submit.handles[0].answer(2)
    assert pending.poll("r", KEYS) == 2
    assert pending.poll("r", KEYS) == 2 and len(submit.handles) == 1
    assert pending.wait("r") == 2
    # A prompt that grew: a new lookup.
    assert pending.poll("r", [*KEYS, b"d"]) is None
    assert len(submit.handles) == 2
    assert pending.gave_up == 0


def test_past_max_wait_is_a_miss_that_stays() -> None:
    submit, clock = Submit(), Clock()
    pending = PendingLookups(submit, max_wait_s=1.0, clock=clock)
    assert pending.poll("r", KEYS) is None
    clock.now = 0.99
    assert pending.poll("r", KEYS) is None
    clock.now = 1.0
    assert pending.poll("r", KEYS) == 0
    assert pending.gave_up == 1
    with pytest.raises(TimeoutError, match="'r' still running"):
        pending.wait("r", 0.01)
    submit.handles[0].answer(3)
    assert pending.poll("r", KEYS) == 0, "given up: stays a miss"
    assert pending.wait("r", 1) == 3
    assert pending.gave_up == 1


def test_failures_are_logged_misses(caplog: pytest.LogCaptureFixture) -> None:
    submit = Submit()
    pending = PendingLookups(submit, max_wait_s=1.0, clock=Clock())
    caplog.set_level(logging.WARNING)
    assert pending.poll("r", KEYS) is None
    submit.handles[0].answer(error=IoEngineError("bucket gone"))
    assert pending.poll("r", KEYS) == 0
    assert pending.poll("r", KEYS) == 0
    assert caplog.text.count("bucket gone") == 1, "the failure is logged once"
    submit.refuse = StoreClosedError("object tier is closed")
    assert pending.poll("s", KEYS) == 0
    assert pending.wait("s") == 0
    assert "object tier is closed" in caplog.text


def test_forget_and_close_drop_the_handles() -> None:
    submit = Submit()
    pending = PendingLookups(submit, max_wait_s=1.0, clock=Clock())
    assert pending.poll("r", KEYS) is None and pending.poll("s", KEYS) is None
    pending.forget("r")
    assert pending.wait("r") is None
    pending.close()
    assert pending.wait("s") is None
    assert pending.poll("t", KEYS) == 0, "closed: a miss"
    assert len(submit.handles) == 2, "nothing submitted after close"


@pytest.fixture
def stored(tmp_path: Path) -> tuple[str, list[bytes]]:
    url = f"file://{tmp_path}/bucket"
    keys = [f"ns/f/{i:03d}".encode() for i in range(80)]
    with _native.ObjectTier(url) as writer:
        for chain in (keys, [b"ns/one/0"]):
            items = [(k, bytearray(k)) for k in chain]
            assert all(r.ok for r in writer.submit_put(items, chain=chain).wait(30))
    return url, keys


def test_native_handles_answer_the_blocking_lookups(stored: tuple[str, list[bytes]]) -> None:
    url, keys = stored
    for ask in (keys, keys[:33], [*keys, b"ns/f/new"], [b"ns/miss"], []):
        want = _native.ObjectTier(url).lookup_chain(ask)
        handle = _native.ObjectTier(url).submit_lookup_chain(ask)
        assert handle.result(30) == want
        assert handle.done()
    assert _native.ObjectTier(url).lookup_chain(keys) == 80
    probe = [b"ns/one/0", b"ns/absent", keys[5]] * 30  # past 64 bits
    want = sum(1 << i for i, k in enumerate(probe) if _native.ObjectTier(url).lookup_chain([k]))
    assert want & 1 and not want & 2
    assert _native.ObjectTier(url).submit_present(probe).result(30) == want
    with pytest.raises(ValueError):
        _native.ObjectTier(url).submit_present([]).result(-1.0)


def test_pending_lookups_over_a_native_tier(stored: tuple[str, list[bytes]]) -> None:
    url, keys = stored
    tier = _native.ObjectTier(url)
    pending = PendingLookups(tier.submit_lookup_chain, max_wait_s=60.0)
    assert pending.poll("r", keys) in (None, 80)
    assert pending.wait("r", 30) == 80
    assert pending.poll("r", keys) == 80
    for r in range(10):
        pending.poll(r, keys[: r + 1])
    pending.close()
    tier.close()
    with pytest.raises(StoreClosedError):
        tier.submit_lookup_chain(keys)
    after = PendingLookups(tier.submit_present, max_wait_s=60.0)
    assert after.poll("r", keys) == 0, "a closed tier's lookup is a miss"
