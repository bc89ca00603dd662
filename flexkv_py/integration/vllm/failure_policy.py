"""A failed load recomputes unless the user asked for "fail".

vLLM's `kv_load_failure_policy` defaults to "fail": a block that cannot be loaded ends its request
with an error. For a cache that is wrong: a corrupt, unreadable or vanished block is just a miss.
The published launch lines do not set the policy, and vLLM cannot tell a default "fail" from an
explicit one, so flexkv-py decides with its own key `load_failure_policy` (default "recompute";
`FLEXKV_LOAD_FAILURE_POLICY=fail` or `"load_failure_policy":"fail"` in
`kv_connector_extra_config` keeps vLLM's "fail").

vLLM's scheduler reads the policy from the top-level `KVTransferConfig` right after it built the
connector: inside a MultiConnector that is the enclosing connector's (see `composition`).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from flexkv_py.integration.vllm.composition import ParentLink

logger = logging.getLogger(__name__)


def apply_load_failure_policy(
    vllm_config: VllmConfig, parent: ParentLink | None, policy: str
) -> None:
    """Set `policy` where the scheduler reads it: the enclosing MultiConnector's config when
    there is one, else this connector's own."""
    ktc = (parent.config if parent is not None else vllm_config).kv_transfer_config
    assert ktc is not None, "a connector is built only with a kv_transfer_config"
    current = ktc.kv_load_failure_policy
    if current == policy:
        return
    ktc.kv_load_failure_policy = policy
    scope = (
        f" for every connector of {parent.name} (its other children's failed loads too)"
        if parent is not None
        else ""
    )
    # A warning inside a MultiConnector: the change reaches the user's other connectors.
    log = logger.warning if parent is not None else logger.info
    if policy == "recompute":
        log(
            "kv_load_failure_policy: %r -> 'recompute'%s: a block that fails to load is "
            "recomputed; set FLEXKV_LOAD_FAILURE_POLICY=fail to fail the request instead",
            current,
            scope,
        )
    else:
        log("kv_load_failure_policy: %r -> %r%s (load_failure_policy)", current, policy, scope)
