"""Our KV events through vLLM's own KV-event stream (`--kv-events-config`, its ZMQ publisher and
msgspec encoding), decoded by a subscriber, and fed to Dynamo's router index (`RadixTree` from
PyPI `ai-dynamo-runtime`): the overlap scores a router would compute."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from helpers import vllm_harness as vh
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

pytestmark = pytest.mark.usefixtures("connector_form")

BS = 16


# --------------------------------------------------------------- vLLM's own KV-event stream
def _replay_all(replay_endpoint: str, timeout_s: float = 10.0) -> list[KVEventBatch]:
    """Every batch vLLM's ZMQ publisher sent, through its replay socket, msgspec-decoded."""
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.connect(replay_endpoint)
    try:
        sock.send_multipart([b"", (0).to_bytes(8, "big")])
        batches: list[KVEventBatch] = []
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not sock.poll(100):
                continue
            # [_, topic, seq, payload]; before vLLM 0.31 the replay sends no topic frame.
            seq, payload = sock.recv_multipart()[-2:]
            if seq == (-1).to_bytes(8, "big", signed=True) or not payload:
                return batches
            batches.append(decoder.decode(payload))
        raise AssertionError("the publisher's replay did not end")
    finally:
        sock.close(linger=0)


def test_kv_events_through_vllms_zmq_publisher(model_dir: str, tmp_path: Path) -> None:
    # No DYNAMO_USE_FLEXKV: vLLM's --kv-events-config alone turns our events on.
    events_cfg = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"ipc://{tmp_path}/kv-events",
        "replay_endpoint": f"ipc://{tmp_path}/kv-replay",
        "topic": "kv",
    }
    # A host tier of 8 slots: the second prompt spills the first to SSD.
    extra = vh.with_ssd(tmp_path / "ssd", cpu_cache_gb=8 * 4096 / 2**30, admission="write_back")
    e = vh.Engine(model_dir, vh.connector_transfer_config(extra), kv_events=events_cfg)
    a = e.add(vh.make_request("A", vh.prompt_tokens(320, 4 * BS), cache_salt="tenant-7"))
    e.run()
    e.add(vh.make_request("C", vh.prompt_tokens(321, 8 * BS)))
    e.run()
    assert e.scheduler.reset_prefix_cache(reset_connector=True)
    e.step()  # the step that publishes reset_cache's removals
    publisher = e.scheduler.kv_event_publisher
    publisher._event_queue.join()  # every queued batch was sent (publish is asynchronous)
    batches = _replay_all(events_cfg["replay_endpoint"])
    e.shutdown()

    events = [ev for batch in batches for ev in batch.events]
    a_hashes = [maybe_convert_block_hash(h) for h in a.block_hashes]
    stored = {
        m: [ev for ev in events if isinstance(ev, BlockStored) and ev.medium == m]
        for m in ("CPU", "DISK")
    }
    removed = {
        m: {
            h
            for ev in events
            if isinstance(ev, BlockRemoved) and ev.medium == m
            for h in ev.block_hashes
        }
        for m in ("CPU", "DISK")
    }
    by_hash = {ev.block_hashes[0]: ev for ev in stored["CPU"]}
    assert set(a_hashes[:4]) <= set(by_hash), "A's blocks were not announced in host memory"
    first, second = by_hash[a_hashes[0]], by_hash[a_hashes[1]]
    assert first.parent_block_hash is None and second.parent_block_hash == a_hashes[0]
    assert second.token_ids == a.all_token_ids[BS : 2 * BS] and second.block_size == BS
    assert first.extra_keys == [("tenant-7",)]  # cache_salt keys the first block only
    assert second.extra_keys == [None]  # one entry per block, as vLLM's own events
    assert first.group_idx == 0
    spilled = set(a_hashes) & {h for ev in stored["DISK"] for h in ev.block_hashes}
    assert spilled, "no SSD store event for A's spilled blocks"
    # The spill removed them from host memory only; the SSD lost them at reset_cache.
    assert spilled <= removed["CPU"]
    assert spilled <= removed["DISK"]
    last_ssd_store = max(
        i for i, ev in enumerate(events) if isinstance(ev, BlockStored) and ev.medium == "DISK"
    )
    first_ssd_removal = min(
        i for i, ev in enumerate(events) if isinstance(ev, BlockRemoved) and ev.medium == "DISK"
    )
    assert first_ssd_removal > last_ssd_store, "an SSD removal came before reset_cache"

    # Dynamo's router index (PyPI ai-dynamo-runtime's RadixTree, no NATS/etcd) takes the disk
    # tier's events, converted here as Dynamo's vLLM relay converts them (kv-router's
    # zmq_wire/convert.rs: 64-bit block hashes, its own hash of each block's tokens); the relay
    # itself needs a running Dynamo runtime. Spills arrive parent first, so every block attaches.
    from dynamo._core import RadixTree, compute_block_hash_for_seq

    tree = RadixTree()
    ssd_events = [(i, ev) for i, ev in enumerate(events) if getattr(ev, "medium", None) == "DISK"]
    for i, ev in ssd_events:
        if i < first_ssd_removal:
            tree.apply_event(2, _dynamo_event(i, ev))
    a_seq = compute_block_hash_for_seq(list(a.all_token_ids[: 4 * BS]), BS)
    on_ssd_prefix = next(i for i, h in enumerate([*a_hashes[:4], None]) if h not in spilled)
    assert on_ssd_prefix >= 1
    assert tree.find_matches(a_seq).scores.get((2, 0), 0) == on_ssd_prefix
    other = compute_block_hash_for_seq(vh.prompt_tokens(399, 4 * BS), BS)
    assert not any(tree.find_matches(other).scores.values())
    for i, ev in ssd_events:
        if i >= first_ssd_removal:
            tree.apply_event(2, _dynamo_event(i, ev))
    assert tree.find_matches(a_seq).scores.get((2, 0), 0) == 0  # reset_cache reached the router


def _u64(block_hash: Any) -> int:
    if isinstance(block_hash, bytes):
        return int.from_bytes(block_hash, "big") & ((1 << 64) - 1)
    return int(block_hash) & ((1 << 64) - 1)


def _dynamo_event(event_id: int, ev: Any) -> bytes:
    """A vLLM KV event as Dynamo's router event (what its vLLM ZMQ relay hands the indexer):
    its own hash of each block's token ids, our block hash as the block's identity."""
    from dynamo._core import compute_block_hash_for_seq

    if isinstance(ev, BlockStored):
        tokens_hash = compute_block_hash_for_seq(list(ev.token_ids), ev.block_size)
        parent = ev.parent_block_hash
        data: dict[str, Any] = {
            "stored": {
                "parent_hash": _u64(parent) if parent is not None else None,
                "blocks": [
                    {"block_hash": _u64(h), "tokens_hash": t}
                    for h, t in zip(ev.block_hashes, tokens_hash, strict=True)
                ],
            }
        }
    else:
        data = {"removed": {"block_hashes": [_u64(h) for h in ev.block_hashes]}}
    return json.dumps({"event_id": event_id, "data": data}).encode()
