"""`flexkv-py bench`: run the benches in `benches/` (each measures our path and its baseline side
by side) and print one table of their ratios.

Each bench runs in its own process with ``--json`` (and ``--quick`` when asked and supported);
its human output is forwarded to stderr as it runs, its final JSON line is collected.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import flexkv_py
from flexkv_py.errors import ConfigError


def add_parser(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "bench",
        help="run benches/*_bench.py and print their ratio table",
        description=__doc__.splitlines()[0] if __doc__ else None,
    )
    p.add_argument("--quick", action="store_true", help="pass --quick to benches that take it")
    p.add_argument("--json", action="store_true", help="print one JSON line with every result")
    p.add_argument(
        "--only", default="", help="comma-separated bench names, e.g. ssd,transfer (default: all)"
    )
    p.add_argument(
        "--benches-dir",
        type=Path,
        default=None,
        help="folder with *_bench.py (default: the source checkout's benches/)",
    )
    p.set_defaults(run=run)


def default_benches_dir() -> Path | None:
    """benches/ next to the package (a source checkout), else under the current directory."""
    for base in (Path(flexkv_py.__file__).resolve().parent.parent, Path.cwd()):
        if (base / "benches").is_dir():
            return base / "benches"
    return None


def find_benches(directory: Path, only: str) -> list[Path]:
    found = sorted(directory.glob("*_bench.py"))
    wanted = {w.strip().removesuffix("_bench") for w in only.split(",") if w.strip()}
    if wanted:
        names = {p.stem.removesuffix("_bench") for p in found}
        unknown = wanted - names
        if unknown:
            raise ConfigError(
                f"--only: unknown bench {', '.join(sorted(unknown))}; "
                f"have {', '.join(sorted(names))}"
            )
        found = [p for p in found if p.stem.removesuffix("_bench") in wanted]
    return found


def run_bench(path: Path, quick: bool) -> tuple[int, dict[str, Any] | None]:
    """Run one bench; (exit status, its final JSON object or None)."""
    cmd = [sys.executable, str(path), "--json"]
    if quick and '"--quick"' in path.read_text():
        cmd.append("--quick")
    print(f"== {path.stem}: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    last: dict[str, Any] | None = None
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            text = line.strip()
            if text.startswith("{"):
                try:
                    last = json.loads(text)
                    continue
                except json.JSONDecodeError:
                    pass
            print(line, end="", file=sys.stderr, flush=True)
    return proc.returncode, last


def _flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for k, v in obj.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: obj}


def ratio_rows(name: str, result: dict[str, Any]) -> list[tuple[str, str, str, str, float]]:
    """(bench, metric, ours, baseline, ratio) for every numeric ratio figure ("*ratio*",
    "*_vs_*", "*_over_*")."""
    flat = {k: v for k, v in _flatten(result).items() if not k.startswith("rows.")}
    rows = []
    for key, value in flat.items():
        leaf = key.rsplit(".", 1)[-1]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if not any(m in leaf for m in ("ratio", "_vs_", "_over_")):
            continue
        scope = key[: len(key) - len(leaf)]
        stem = leaf.removesuffix("_ratio")
        ours = flat.get(f"{scope}{stem}_gbps")
        base = next(
            (
                flat[f"{scope}{p}{stem}_gbps"]
                for p in ("raw_", "ceiling_")
                if f"{scope}{p}{stem}_gbps" in flat
            ),
            None,
        )
        rows.append(
            (
                name,
                key,
                f"{ours:.2f}" if isinstance(ours, (int, float)) else "",
                f"{base:.2f}" if isinstance(base, (int, float)) else "",
                float(value),
            )
        )
    return rows


def run(args: argparse.Namespace) -> int:
    directory = args.benches_dir or default_benches_dir()
    if directory is None or not directory.is_dir():
        print(
            "flexkv-py bench: no benches/ folder found (benches ship with the source checkout; "
            "run from it or pass --benches-dir)",
            file=sys.stderr,
        )
        return 2
    try:
        benches = find_benches(directory, args.only)
    except ValueError as e:
        print(f"flexkv-py bench: {e}", file=sys.stderr)
        return 2
    if not benches:
        print(f"flexkv-py bench: no *_bench.py in {directory}", file=sys.stderr)
        return 2
    results: dict[str, Any] = {}
    failed: list[str] = []
    rows: list[tuple[str, str, str, str, float]] = []
    for path in benches:
        name = path.stem.removesuffix("_bench")
        code, result = run_bench(path, args.quick)
        if code != 0 or result is None:
            failed.append(name)
            results[name] = {"error": f"exit status {code}" if code else "no JSON line"}
            continue
        results[name] = result
        rows += ratio_rows(name, result)
    if args.json:
        print(json.dumps({"benches": results, "failed": failed}, default=str))
    else:
        print(f"{'bench':<10} {'metric':<40} {'ours GB/s':>10} {'base GB/s':>10} {'ratio':>7}")
        for bench, metric, ours, base, ratio in rows:
            print(f"{bench:<10} {metric:<40} {ours:>10} {base:>10} {ratio:>7.3f}")
        for name in failed:
            print(f"{name:<10} FAILED ({results[name]['error']})")
    return 1 if failed else 0
