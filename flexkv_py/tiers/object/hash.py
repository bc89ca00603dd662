"""A shared object tier keys blocks by the engine's block hash alone, so that hash must resist
collisions: with vLLM's xxhash variants (and a fixed ``PYTHONHASHSEED``) one tenant could craft
a prompt whose block hash equals another tenant's and be served — or serve — someone else's KV.
The sha256 variants are required unless the operator overrides it explicitly."""

from __future__ import annotations

from flexkv_py.errors import ConfigError

ENGINE_HASH_KEY = "prefix_caching_hash_algo"  # vLLM's cache config
OVERRIDE_KEY = "object_store_allow_weak_hash"  # ours: the operator accepts the risk
COLLISION_RESISTANT = frozenset({"sha256", "sha256_cbor"})


def require_collision_resistant(hash_algo: str, allow_weak: bool = False) -> None:
    """Raise `ConfigError` naming both keys unless `hash_algo` is a sha256 variant or the
    operator set the override."""
    if hash_algo in COLLISION_RESISTANT or allow_weak:
        return
    raise ConfigError(
        f"{ENGINE_HASH_KEY}: the shared object tier needs a collision-resistant engine block "
        f"hash, got {hash_algo!r}; start vLLM with --prefix-caching-hash-algo sha256 (or "
        f"sha256_cbor), or set {OVERRIDE_KEY}=true to accept that one tenant could craft "
        f"hash collisions into another's cache"
    )
