"""A fingerprint clash in the scheduler's cold-block set is a false hit, never wrong KV.

The SSD tier's cold blocks are kept as 8-byte fingerprints (rust/index/block_set.rs). Two keys
with one fingerprint (~2^-64 per pair) cannot be found by search, so the clash is forced: the
fingerprint of a block that was never stored is planted in the real set next to the stored
blocks, which is what the set holds when a stored block's fingerprint equals that key's. The
store below looks every load up by its full key, so the false hit reads nothing: the block is
`not_found`, the engine drops it from the index and the caller recomputes it, and the blocks
around it load bit-exact.
"""

from __future__ import annotations

from pathlib import Path

from helpers.coordinator_util import _config, _engine, _keys, _ns, _pages

from flexkv_py._native import BlockSet
from flexkv_py.index import Tier


def test_a_planted_fingerprint_clash_is_recomputed_never_served(tmp_path: Path) -> None:
    cfg = _config(tmp_path, 4, 32, admission="write_through")
    ns = _ns()
    stored = _keys(ns, 3)
    clash = _keys(ns, 1, tag="never-stored-")[0]
    with _engine(cfg, ns, 4) as eng:
        assert eng.store_pages(stored, _pages(stored)).ok
    with _engine(cfg, ns, 4) as eng:  # a restart: the stored blocks are cold on the SSD
        assert eng.lookup(stored) == 3
        cold = eng.manager.index._cold
        assert all(cold.on(k, Tier.SSD) for k in stored) and not cold.has(clash)
        ssd_set = cold._by_tier[Tier.SSD]
        assert ssd_set.add_digests([BlockSet.digest(clash, b"")]) == 1
        asked = [stored[0], stored[1], clash, stored[2]]
        assert eng.lookup(asked) == 4  # the clash answers a false "present"
        got = eng.load_pages(asked)
        assert got[2] is None  # nothing was served for it: vLLM recomputes it
        want = _pages(stored)
        assert [got[0], got[1], got[3]] == want
        assert eng.stats()["manager"]["ssd_read_not_found_blocks"] == 1
        assert eng.lookup(asked) == 2 and not cold.has(clash)  # dropped from the index
        assert eng.load_pages(stored) == want
