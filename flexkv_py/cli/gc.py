"""`flexkv-py gc --object-store URL`: one garbage-collection pass over a bucket prefix by hand
(workers run the same pass in the background under a lease; rust/object/gc.rs has the
protocol). Safe while workers use the prefix: what a manifest used within the TTL references
is kept."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from flexkv_py.cli.object_args import add_object_args, open_object_tier, print_counts
from flexkv_py.errors import FlexKVError


def add_parser(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "gc",
        help="collect garbage in an object-store prefix",
        description="Delete manifests unused for --ttl-s (unless a used chain descends from "
        "them), then blocks no live manifest lists that are older than --grace-s; with "
        "--budget-bytes, also the least recently used chains until the rest fits.",
    )
    add_object_args(p, required=True)
    p.add_argument("--ttl-s", type=float, required=True, help="a manifest unused this long goes")
    p.add_argument(
        "--grace-s",
        type=float,
        default=600.0,
        help="unreferenced blocks younger than this stay (a writer's manifest may follow)",
    )
    p.add_argument("--budget-bytes", type=int, help="byte budget of the prefix's blocks")
    p.add_argument("--dry-run", action="store_true", help="count only, delete nothing")
    p.add_argument("--json", action="store_true", help="print one JSON line")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    tier = open_object_tier(args, "gc")
    if tier is None:
        return 2
    try:
        report = tier.gc(
            ttl_s=args.ttl_s,
            grace_s=args.grace_s,
            budget_bytes=args.budget_bytes,
            dry_run=args.dry_run,
        )
    except FlexKVError as e:
        print(f"flexkv-py gc: {e}", file=sys.stderr)
        return 1
    finally:
        tier.close()
    title = f"{args.object_store}{' (dry run)' if args.dry_run else ''}:"
    print_counts(title, dict(report), args.json)
    return 1 if report["delete_errors"] else 0
