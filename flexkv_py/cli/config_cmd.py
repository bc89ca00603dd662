"""`flexkv-py config`: the effective configuration, where each value comes from, validated.

Same resolution as the connector: defaults < ``FLEXKV_*`` env vars (ignored when
``FLEXKV_CONFIG_PATH`` names a file) < the config file < overrides (``--set``, standing in for
vLLM's ``kv_connector_extra_config``). A bad value exits 2 with a message naming the key.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from flexkv_py.config import FIELDS_BY_KEY, resolve_config
from flexkv_py.config.schema import CONFIG_PATH_ENV
from flexkv_py.errors import ConfigError


def add_parser(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "config",
        help="print the effective configuration and the source of each value",
        description=__doc__.splitlines()[2] if __doc__ else None,
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a key, like kv_connector_extra_config (repeatable)",
    )
    p.add_argument("--json", action="store_true", help="print one JSON line")
    p.set_defaults(run=run)


def parse_overrides(pairs: list[str]) -> dict[str, str]:
    """`--set KEY=VALUE` options as config overrides (shared by `config` and `replay`)."""
    out: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--set {pair!r}: expected KEY=VALUE")
        out[key.strip()] = value
    return out


def _show(value: Any) -> str:
    if isinstance(value, tuple):
        return ";".join(value) if value else "(none)"
    return "(none)" if value is None else str(value)


def run(args: argparse.Namespace) -> int:
    try:
        resolved = resolve_config(parse_overrides(args.set) or None)
    except ConfigError as e:
        print(f"flexkv-py config: invalid configuration: {e}", file=sys.stderr)
        return 2
    rows = resolved.rows()
    if args.json:
        print(
            json.dumps(
                {
                    "config": {k: v for k, v, _ in rows},
                    "sources": {k: src for k, _, src in rows},
                    "config_path": resolved.config_path,
                },
                default=list,
            )
        )
        return 0
    print(f"config file: {resolved.config_path or f'(none; set {CONFIG_PATH_ENV})'}")
    width = max(len(k) for k, _, _ in rows)
    vwidth = max(len(_show(v)) for _, v, _ in rows)
    print(f"{'key':<{width}}  {'value':<{vwidth}}  {'source':<24}  env var")
    for key, value, source in rows:
        env = FIELDS_BY_KEY[key].env
        print(f"{key:<{width}}  {_show(value):<{vwidth}}  {source:<24}  {env}")
    print("valid: yes")
    return 0
