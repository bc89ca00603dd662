"""The object tier's policy: engine A (a small host tier,
an SSD, a trickle write-behind rate while it stores) stores C chains of L blocks, then drains
its object write-behind: blocks evicted from host before their turn go up from the SSD. Engine
B, with an empty host tier, looks every chain up and loads it, once straight from the bucket
and once after a prefetch into host memory. Requests are counted at a proxy in front of
SeaweedFS on 127.0.0.1 (tests/helpers/s3_server.py, tests/helpers/s3_proxy.py).

    python3 benches/object_policy_probe.py --chains 16 --length 32 --host-slots 64 --json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from helpers.coordinator_util import _config, _engine, _keys, _ns, _pages
from helpers.s3_proxy import CountingProxy
from helpers.s3_server import start_server

from flexkv_py.index import Tier


def _load_all(b: Any, chains: list[list[bytes]], pages: list[list[bytes]], prefetch: bool) -> int:
    """Look up and load every chain; returns the blocks that came back bit-exact."""
    exact = 0
    for keys, want in zip(chains, pages, strict=True):
        assert b.lookup_object(keys) == len(keys)
        if prefetch:
            assert b.manager.prefetch_object(keys) is not None
            b.flush()
        got = b.load_pages(keys)
        exact += sum(g == w for g, w in zip(got, want, strict=True))
    return exact


def probe(c: int, length: int, slots: int, root: Path) -> dict[str, Any]:
    srv = start_server(root / "s3")
    try:
        proxy = CountingProxy(srv.ports["s3"])
        os.environ["AWS_ACCESS_KEY_ID"] = srv.access_key_id
        os.environ["AWS_SECRET_ACCESS_KEY"] = srv.secret_access_key
        kw: dict[str, Any] = dict(
            object_store_url=f"s3://{srv.bucket}/policy",
            object_store_endpoint=proxy.endpoint,
            object_store_region=srv.region,
            object_store_allow_http=True,
        )
        ns = _ns()
        chains = [_keys(ns, length, f"c{i}-") for i in range(c)]
        pages = [_pages(k) for k in chains]
        n = c * length
        out: dict[str, Any] = {"blocks": n, "host_slots": slots, "chain_blocks": length}
        (root / "a").mkdir()
        cfg = _config(root / "a", slots, 4 * n, write_behind_mib_s=0.0001, **kw)
        with _engine(cfg, ns, slots) as a:
            for keys, want in zip(chains, pages, strict=True):
                assert a.store_pages(keys, want).ok
            proxy.reset()
            t = time.perf_counter()
            out["write_left"] = a.flush_write_behind(300.0, Tier.OBJECT)
            out["drain_s"] = round(time.perf_counter() - t, 3)
            out["drain_requests"], out["drain_body_bytes"] = proxy.snapshot()
            m = a.stats()["manager"]
            for k in ("object_write_behind_blocks", "object_write_behind_from_ssd_blocks"):
                out[k] = m.get(k, 0)
            out["lost_blocks"] = m.get("object_write_behind_lost_blocks", 0)
        for prefetch in (False, True):
            tag = "prefetch" if prefetch else "direct"
            with _engine(_config(root / tag, 2 * n, **kw), ns, 2 * n) as b:
                proxy.reset()
                t = time.perf_counter()
                out[f"{tag}_exact_blocks"] = _load_all(b, chains, pages, prefetch)
                out[f"{tag}_s"] = round(time.perf_counter() - t, 3)
                out[f"{tag}_requests"] = proxy.snapshot()[0]
                m = b.stats()["manager"]
                out[f"{tag}_load_host_blocks"] = m.get("load_host_blocks", 0)
                out[f"{tag}_load_object_blocks"] = m.get("load_object_blocks", 0)
        proxy.close()
        return out
    finally:
        srv.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chains", type=int, default=16)
    p.add_argument("--length", type=int, default=32)
    p.add_argument("--host-slots", type=int, default=64)
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        out = probe(a.chains, a.length, a.host_slots, Path(d))
    print(json.dumps(out) if a.json else "\n".join(f"{k}: {v}" for k, v in out.items()))


if __name__ == "__main__":
    main()
