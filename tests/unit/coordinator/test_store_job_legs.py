"""A store job is its legs: GPU -> host, then one write leg per lower tier (host slots -> tier),
each a subset of the job's blocks in job order. No per-block column of tiers travels with it."""

from __future__ import annotations

import pickle

import pytest

from flexkv_py.coordinator.jobs import WRITE_NONE, WRITE_SSD, StoreJob, store_job
from flexkv_py.coordinator.legs import Blocks, Gpu, Host, Leg, OnTier
from flexkv_py.index.tier_names import Tier

KEYS = tuple(bytes([i]) * 8 for i in range(5))
BOTH = (Tier.SSD, Tier.OBJECT)


def _job() -> StoreJob:
    blocks = Blocks(KEYS, parents=(None, *KEYS[:-1]))
    tiers = [WRITE_SSD, BOTH, WRITE_NONE, (Tier.OBJECT,), WRITE_SSD]
    return store_job(7, blocks, (10, 11, 12, 13, 14), (0, 1, 2, 3, 4), tiers, streamed=2)


def test_per_block_tiers_become_one_write_leg_per_tier_in_tier_order() -> None:
    job = _job()
    assert [leg.tier for leg in job.writes] == [Tier.SSD, Tier.OBJECT]
    ssd, obj = job.writes
    assert ssd.keys == (KEYS[0], KEYS[1], KEYS[4]) and ssd.src == Host((0, 1, 4))
    assert obj.keys == (KEYS[1], KEYS[3]) and obj.src == Host((1, 3))
    assert ssd.blocks.parents == (None, KEYS[0], KEYS[3])  # the chain goes with the blocks
    assert job.writes_to(Tier.SSD) == [0, 1, 4] and job.writes_to(Tier.OBJECT) == [1, 3]
    assert job.writes_to(Tier.HOST) == []
    assert pickle.loads(pickle.dumps(job)) == job  # crosses to the worker processes as is


def test_write_back_carries_no_write_leg() -> None:
    job = store_job(1, Blocks(KEYS), None, range(5), None)
    assert job.writes == () and job.gpu is None and job.gpu_block_ids is None


def test_take_keeps_each_leg_aligned_with_the_blocks_kept() -> None:
    part = _job().take([1, 2, 4])
    assert part.keys == (KEYS[1], KEYS[2], KEYS[4])
    assert part.gpu == Gpu((11, 12, 14)) and part.host_slots == (1, 2, 4)
    assert [(leg.tier, leg.keys) for leg in part.writes] == [
        (Tier.SSD, (KEYS[1], KEYS[4])),
        (Tier.OBJECT, (KEYS[1],)),
    ]
    assert part.writes_to(Tier.SSD) == [0, 2]
    assert part.streamed == 1  # of the two streamed blocks, only position 1 is kept


def test_a_write_that_is_not_the_jobs_blocks_is_refused_at_construction() -> None:
    blocks = Blocks(KEYS[:2])
    host = Host((0, 1))
    wrong_slot = Leg(Blocks(KEYS[:1]), Host((5,)), OnTier(Tier.SSD))
    with pytest.raises(ValueError, match="not one of its blocks in that slot"):
        StoreJob(1, blocks, None, host, (wrong_slot,))
    out_of_order = Leg(Blocks(KEYS[1::-1]), Host((1, 0)), OnTier(Tier.SSD))
    with pytest.raises(ValueError, match="not in the job's order"):
        StoreJob(1, blocks, None, host, (out_of_order,))
    to_gpu = Leg(blocks, host, Gpu((3, 4)))
    with pytest.raises(ValueError, match="not host slots -> lower tier"):
        StoreJob(1, blocks, None, host, (to_gpu,))
    twice = Leg(Blocks(KEYS[:1]), Host((0,)), OnTier(Tier.SSD))
    with pytest.raises(ValueError, match="two writes to one tier"):
        StoreJob(1, blocks, None, host, (twice, twice))
    with pytest.raises(ValueError, match="2 blocks but 1 tiers"):
        store_job(1, blocks, None, (0, 1), [WRITE_SSD])


def test_with_blocks_gives_the_write_legs_the_new_parents_and_metas() -> None:
    """The scheduler side fills in parents and metas after planning (block_meta.py): a write
    leg that kept the old blocks would write them to the SSD without their token ids."""
    job = _job()
    metas = tuple(b"meta%d" % i for i in range(5))
    filled = job.with_blocks(Blocks(KEYS, parents=job.blocks.parents, metas=metas))
    ssd, obj = filled.writes
    assert ssd.blocks.metas == (metas[0], metas[1], metas[4])
    assert obj.blocks.metas == (metas[1], metas[3])
    assert filled.host == job.host and filled.streamed == job.streamed
    with pytest.raises(ValueError, match="own keys"):
        job.with_blocks(Blocks(KEYS[::-1]))


def test_a_leg_of_every_block_shares_the_jobs_columns_and_pickles_without_positions() -> None:
    blocks = Blocks(KEYS)
    job = store_job(3, blocks, None, range(5), [WRITE_SSD] * 5)
    (leg,) = job.writes
    assert leg.blocks is job.blocks and leg.src is job.host  # no copy of the columns
    assert job.write_positions == [[0, 1, 2, 3, 4]]
    state = job.__getstate__()
    assert "write_positions" not in state  # worked out again by the receiver
    back = pickle.loads(pickle.dumps(job))
    assert back == job and back.write_positions == [[0, 1, 2, 3, 4]]
    assert back.writes[0].blocks is back.blocks  # shared references survive the trip
