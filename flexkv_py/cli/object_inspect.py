"""`flexkv-py inspect --object-store URL`: what a bucket prefix holds (blocks, manifests, touch
objects, the GC lease: counts and bytes), from one listing. Read-only."""

from __future__ import annotations

import argparse
import sys

from flexkv_py.cli.object_args import open_object_tier, print_counts
from flexkv_py.errors import FlexKVError


def run(args: argparse.Namespace) -> int:
    tier = open_object_tier(args, "inspect")
    if tier is None:
        return 2
    try:
        counts = tier.inspect()
    except FlexKVError as e:
        print(f"flexkv-py inspect: {e}", file=sys.stderr)
        return 1
    finally:
        tier.close()
    print_counts(f"{args.object_store}:", dict(counts), args.json)
    return 0
