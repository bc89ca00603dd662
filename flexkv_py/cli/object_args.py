"""The options every object-store command takes, and the tier they open. Credentials come
only from the ``AWS_*`` environment (never an argument: it would show in `ps` and shell
history) and are never printed."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from flexkv_py import _native
from flexkv_py.errors import FlexKVError


def add_object_args(p: argparse.ArgumentParser, required: bool) -> None:
    p.add_argument(
        "--object-store",
        metavar="URL",
        required=required,
        help="bucket prefix: s3://bucket/prefix, gs://, az://, file:///path",
    )
    p.add_argument("--endpoint", help="S3-compatible endpoint (MinIO, SeaweedFS, Ceph RGW)")
    p.add_argument("--region", help="S3 region")
    p.add_argument("--allow-http", action="store_true", help="allow a plain-HTTP endpoint")


def open_object_tier(args: argparse.Namespace, command: str) -> _native.ObjectTier | None:
    """The tier, or None after printing why it could not be opened (no credential in it)."""
    kw: dict[str, Any] = {"allow_http": args.allow_http}
    if args.endpoint:
        kw["endpoint"] = args.endpoint
    if args.region:
        kw["region"] = args.region
    try:
        return _native.ObjectTier(args.object_store, **kw)
    except FlexKVError as e:
        print(f"flexkv-py {command}: {e}", file=sys.stderr)
        return None


def print_counts(title: str, counts: dict[str, Any], as_json: bool) -> None:
    if as_json:
        import json

        print(json.dumps(counts, sort_keys=True))
        return
    print(title)
    for name in sorted(counts):
        print(f"  {name}: {counts[name]}")
