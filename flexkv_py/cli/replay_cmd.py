"""`flexkv-py replay`: options, workload choice, and output (text, `--json`, `--plot`)."""

from __future__ import annotations

import argparse
import sys
from dataclasses import fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flexkv_py.cli import object_replay
from flexkv_py.cli.config_cmd import parse_overrides
from flexkv_py.cli.model_shape import DTYPE_BYTES, ModelShape
from flexkv_py.cli.workloads import (
    SyntheticSpec,
    TraceFormatError,
    Workload,
    generate_synthetic,
    read_mooncake_trace,
)
from flexkv_py.cli.workloads.mooncake import MOONCAKE_BLOCK_TOKENS
from flexkv_py.errors import ConfigError

if TYPE_CHECKING:
    from flexkv_py.cli.replay import ReplayOptions

# `--quick`: a few seconds on a laptop, still enough reuse for every tier to get hits.
QUICK_SYNTHETIC = SyntheticSpec(users=12, turns=4, prefix_tokens=512, docs=4, doc_tokens=2048)
QUICK_SHAPE = ModelShape(layers=4)
QUICK_TRACE_REQUESTS = 200

_SYNTHETIC_FLAGS = {
    "users": "chat users",
    "turns": "turns per user",
    "prefix_tokens": "shared system prompt length (tokens)",
    "docs": "shared long documents",
    "doc_tokens": "tokens per document",
    "doc_fraction": "share of users chatting about a document (0..1)",
    "zipf": "document popularity skew, Zipf exponent (0 = uniform)",
    "message_tokens": "tokens per user message",
    "output_tokens": "tokens per answer (joins the next turn's prompt)",
    "tenants": "tenants salting their cache keys (>1: same content, other keys -> SSD dedup)",
    "block_tokens": "tokens per cache block",
    "seed": "random seed",
}


def add_parser(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "replay",
        help="replay a KV-reuse workload through GPU -> host -> SSD tiers",
        description="Replay a workload (synthetic, or a Mooncake JSONL trace) through the full "
        "tier stack with CPU tensors shaped like a vLLM KV cache; report hit rates per tier, "
        "bytes moved, GB/s, prefill tokens saved and SSD dedup. Every loaded block is checked "
        "bit for bit.",
    )
    p.add_argument("--quick", action="store_true", help="a small run (seconds)")
    p.add_argument("--json", action="store_true", help="print one final JSON line on stdout")
    p.add_argument("--plot", type=Path, metavar="PNG", help="write hit rate/bandwidth over time")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")

    w = p.add_argument_group("workload (default: synthetic multi-turn chat + shared documents)")
    w.add_argument("--trace", type=Path, metavar="JSONL", help="Mooncake FAST'25 trace file")
    w.add_argument(
        "--trace-block-tokens",
        type=int,
        default=MOONCAKE_BLOCK_TOKENS,
        help="tokens per hash_id in the trace (default %(default)s)",
    )
    w.add_argument("--limit", type=int, metavar="N", help="replay at most this many trace requests")
    for name, text in _SYNTHETIC_FLAGS.items():
        default = getattr(SyntheticSpec(), name)
        w.add_argument(
            "--" + name.replace("_", "-"),
            type=type(default),
            default=None,
            metavar="N" if isinstance(default, int) else "X",
            help=f"{text} (default {default}; --quick {getattr(QUICK_SYNTHETIC, name)})",
        )

    m = p.add_argument_group("model shape (KV bytes per token)")
    for name in ("layers", "kv_heads", "head_dim"):
        m.add_argument(
            "--" + name.replace("_", "-"),
            type=int,
            default=None,
            metavar="N",
            help=f"default {getattr(ModelShape(), name)}",
        )
    m.add_argument("--dtype", choices=tuple(DTYPE_BYTES), default=None, help="default float16")

    t = p.add_argument_group("tiers (default: sized from the workload's unique blocks)")
    t.add_argument(
        "--gpu-blocks", type=int, metavar="N", help="simulated GPU prefix cache, in blocks"
    )
    t.add_argument("--cpu-blocks", type=int, metavar="N", help="host tier, in blocks")
    t.add_argument(
        "--ssd-blocks", type=int, metavar="N", help="SSD tier, in blocks (0 = no SSD tier)"
    )
    t.add_argument(
        "--ssd-dir", type=Path, help="SSD tier directory, kept afterwards (default: a temp dir)"
    )
    t.add_argument(
        "--use-config",
        action="store_true",
        help="host and SSD tiers from the FlexKV configuration (env / FLEXKV_CONFIG_PATH)",
    )
    t.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="configuration override, e.g. --set ssd_compression=zstd (repeatable)",
    )
    object_replay.add_args(p)
    p.set_defaults(run=run)


def _workload(args: argparse.Namespace) -> Workload:
    if args.trace is not None:
        limit = (
            args.limit if args.limit is not None else (QUICK_TRACE_REQUESTS if args.quick else None)
        )
        return read_mooncake_trace(args.trace, args.trace_block_tokens, limit)
    spec = QUICK_SYNTHETIC if args.quick else SyntheticSpec()
    given = {f.name: getattr(args, f.name) for f in fields(SyntheticSpec)}
    return generate_synthetic(replace(spec, **{k: v for k, v in given.items() if v is not None}))


def _options(args: argparse.Namespace) -> ReplayOptions:
    from flexkv_py.cli.replay import ReplayOptions, TierSizes

    shape = QUICK_SHAPE if args.quick else ModelShape()
    given = {f.name: getattr(args, f.name) for f in fields(ModelShape)}
    shape = replace(shape, **{k: v for k, v in given.items() if v is not None})
    for name in ("gpu_blocks", "cpu_blocks"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')}: must be >= 1")
    if args.ssd_blocks is not None and args.ssd_blocks < 0:
        raise ConfigError("--ssd-blocks: must be >= 0")
    return ReplayOptions(
        shape=shape,
        sizes=TierSizes(args.gpu_blocks, args.cpu_blocks, args.ssd_blocks),
        ssd_dir=args.ssd_dir,
        use_config=args.use_config,
        overrides=parse_overrides(args.set),
        progress=not args.no_progress,
    )


def run(args: argparse.Namespace) -> int:
    # torch loads here, not at startup: `config`, `inspect` and `bench` stay fast.
    from flexkv_py.cli import report
    from flexkv_py.cli.replay import replay

    if args.object_store:
        try:
            return object_replay.run(args, _workload(args))
        except (ConfigError, TraceFormatError, ValueError) as e:
            print(f"flexkv-py replay: {e}", file=sys.stderr)
            return 2
    try:
        workload = _workload(args)
        opts = _options(args)
        result = replay(workload, opts)
    except (ConfigError, TraceFormatError, ValueError) as e:
        print(f"flexkv-py replay: {e}", file=sys.stderr)
        return 2
    if args.plot is not None:
        report.plot(result, args.plot)
    if args.json:
        print(report.to_json(result))
    else:
        print(report.to_text(result))
        if args.plot is not None:
            print(f"plot            {args.plot}")
    if result.mismatches:
        print(
            f"flexkv-py replay: {result.mismatches} loaded blocks had wrong KV bytes",
            file=sys.stderr,
        )
        return 1
    return 0
