"""Where blocks live: key namespace, tier index, eviction and admission policies."""

from __future__ import annotations

from flexkv_py.index.entry import Entry, IndexStateError, Located, Victim
from flexkv_py.index.namespace import Namespace
from flexkv_py.index.policies import (
    AdmissionPolicy,
    EvictionPolicy,
    FIFOPolicy,
    LFUPolicy,
    LRUPolicy,
    make_eviction_policy,
)
from flexkv_py.index.tier_index import TierIndex
from flexkv_py.index.tier_names import LOWER_TIERS, Tier

__all__ = [
    "LOWER_TIERS",
    "AdmissionPolicy",
    "Entry",
    "EvictionPolicy",
    "FIFOPolicy",
    "IndexStateError",
    "LFUPolicy",
    "LRUPolicy",
    "Located",
    "Namespace",
    "Tier",
    "TierIndex",
    "Victim",
    "make_eviction_policy",
]
