"""The object tier through the coordinator: engine A stores a
chain of N blocks and drains its object write-behind; engine B, with an empty host tier, looks
the chain up in the bucket and loads it. Requests and body bytes are counted at a proxy in
front of SeaweedFS on 127.0.0.1 (tests/helpers/s3_server.py, tests/helpers/s3_proxy.py).

    python3 benches/object_wiring_probe.py --blocks 512
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


def probe(n: int, slots: int, root: Path) -> dict[str, Any]:
    srv = start_server(root / "s3")
    try:
        proxy = CountingProxy(srv.ports["s3"])
        os.environ["AWS_ACCESS_KEY_ID"] = srv.access_key_id
        os.environ["AWS_SECRET_ACCESS_KEY"] = srv.secret_access_key
        kw = dict(
            object_store_url=f"s3://{srv.bucket}/probe",
            object_store_endpoint=proxy.endpoint,
            object_store_region=srv.region,
            object_store_allow_http=True,
        )
        ns = _ns()
        keys = _keys(ns, n)
        pages = _pages(keys)
        out: dict[str, Any] = {"blocks": n, "host_slots": slots, "block_bytes": len(pages[0])}
        with _engine(_config(root / "a", slots, **kw), ns, slots) as a:
            proxy.reset()
            t = time.perf_counter()
            a.store_pages(keys, pages)
            out["write_left"] = a.flush_write_behind(120.0, Tier.OBJECT)
            out["store_and_write_behind_s"] = round(time.perf_counter() - t, 3)
            out["write_requests"], out["write_body_bytes"] = proxy.snapshot()
        with _engine(_config(root / "b", slots, **kw), ns, slots) as b:
            proxy.reset()
            t = time.perf_counter()
            out["lookup_hit"] = b.lookup_object(keys)
            out["lookup_s"] = round(time.perf_counter() - t, 4)
            out["lookup_requests"] = proxy.snapshot()[0]
            proxy.reset()
            t = time.perf_counter()
            got = b.load_pages(keys)
            dt = time.perf_counter() - t
            out["load_s"] = round(dt, 3)
            out["load_bit_exact"] = sum(g == p for g, p in zip(got, pages, strict=True))
            out["load_requests"] = proxy.snapshot()[0]
            out["load_mb_s"] = round(n * len(pages[0]) / dt / 1e6, 1)
        proxy.close()
        return out
    finally:
        srv.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=512)
    p.add_argument("--host-slots", type=int, default=0, help="default: 2 x blocks")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        print(json.dumps(probe(args.blocks, args.host_slots or 2 * args.blocks, Path(d))))


if __name__ == "__main__":
    main()
