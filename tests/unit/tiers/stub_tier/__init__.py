"""A test-only lower tier: blocks in a dict of this process, declared the way a real tier is
(its `LowerTier`, its `TierSpec`, registered with the tier registry) and touching nothing else.
It stands for the next tier (GPU Direct Storage, a peer's memory): if this one works end to end
through the cache engine with no change outside its package, so can that one.
"""
