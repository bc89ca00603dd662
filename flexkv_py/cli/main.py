"""`flexkv-py` / `python -m flexkv_py`: argument parsing and dispatch to one module per command.

Exit codes: 0 ok, 1 the command found a problem (corrupt blocks, a failed bench, wrong KV),
2 bad usage or configuration (the message names the option or key).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from flexkv_py.cli import bench_cmd, config_cmd, gc, inspect, replay_cmd

EXIT_OK, EXIT_PROBLEM, EXIT_USAGE = 0, 1, 2

COMMANDS = (replay_cmd, inspect, config_cmd, bench_cmd, gc)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flexkv-py",
        description="KV-cache storage tier for vLLM: replay workloads through the tiers, "
        "inspect SSD cache directories, show the effective configuration, run the benches.",
    )
    parser.add_argument(
        "-v", "--verbose", action="count", default=0, help="more log output (-vv for debug)"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module in COMMANDS:
        module.add_parser(sub)
    return parser


def _setup_logging(verbosity: int) -> None:
    level = logging.WARNING if verbosity == 0 else logging.INFO if verbosity == 1 else logging.DEBUG
    logging.basicConfig(
        level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _setup_logging(args.verbose)
    try:
        code: int = args.run(args)
    except KeyboardInterrupt:
        print("flexkv-py: interrupted", file=sys.stderr)
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
