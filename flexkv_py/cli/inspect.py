"""`flexkv-py inspect DIR...`: what an SSD cache directory holds, without disturbing its owner.

The store is opened read-only (no lock, no writes), so this is safe while a server uses the
directory. A directory holds one store per worker rank (``tp{r}-pp{p}`` subdirectories, see
flexkv_py.tiers.ssd.tier) or is itself a store. Give every directory of a striped
``ssd_cache_dir`` to see its shards whole. Within a store, keys are ``rank tag + 16-byte
namespace digest + block hash``: blocks are grouped by namespace digest. It also warns when
group/others can reach the directories or their files (KV blocks reveal prompts).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from flexkv_py import _native
from flexkv_py.cli import object_inspect
from flexkv_py.cli.object_args import add_object_args
from flexkv_py.index.namespace import PREFIX_LEN, SHARD_TAG
from flexkv_py.tiers.private_files import Exposed, exposed

DATA_FILE = "flexkv-blocks.dat"
LOCK_FILE = "flexkv.lock"


def add_parser(sub: Any) -> None:
    p: argparse.ArgumentParser = sub.add_parser(
        "inspect",
        help="show what an SSD cache directory holds (read-only)",
        description="Blocks, namespaces, logical/physical bytes, dedup, last clean shutdown and "
        "free space of SSD cache directories. Read-only: safe while a server uses them.",
    )
    p.add_argument(
        "dirs", nargs="*", type=Path, metavar="DIR", help="cache directory (all stripes)"
    )
    add_object_args(p, required=False)  # --object-store URL: a bucket prefix instead
    p.add_argument(
        "--verify",
        action="store_true",
        help="read every block and check its checksum; exit 1 if any is corrupt",
    )
    p.add_argument("--json", action="store_true", help="print one JSON line")
    p.set_defaults(run=run)


@dataclass
class ShardReport:
    name: str
    paths: list[str]
    stats: dict[str, Any] = field(default_factory=dict)
    namespaces: dict[str, int] = field(default_factory=dict)  # digest hex -> blocks
    ranks: dict[str, int] = field(default_factory=dict)  # "tp0-pp0" -> blocks
    holder: str | None = None  # who holds the directory lock, if anyone
    corrupt: list[str] | None = None  # --verify: hex keys
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "paths": self.paths,
            "blocks": self.stats.get("blocks"),
            "unique_blocks": self.stats.get("unique_blocks"),
            "logical_bytes": self.stats.get("logical_bytes"),
            "physical_bytes": self.stats.get("physical_bytes"),
            "dedup_ratio": self.stats.get("dedup_ratio"),
            "compression_ratio": self.stats.get("compression_ratio"),
            "last_clean_shutdown_unix": self.stats.get("last_clean_shutdown_unix"),
            "namespaces": self.namespaces,
            "ranks": self.ranks,
            "in_use_by": self.holder,
            "corrupt_keys": self.corrupt,
            "error": self.error,
        }


def find_shards(dirs: list[Path]) -> dict[str, list[Path]]:
    """Shard name -> its directory in each given dir ("." when a dir is itself a store)."""
    shards: dict[str, list[Path]] = {}
    for d in dirs:
        if not d.is_dir():
            raise FileNotFoundError(f"{d}: not a directory")
        if (d / DATA_FILE).exists():
            shards.setdefault(".", []).append(d)
            continue
        for child in sorted(d.iterdir()):
            if child.is_dir() and (child / DATA_FILE).exists():
                shards.setdefault(child.name, []).append(child)
    return shards


def lock_holder(directory: Path) -> str | None:
    """The holder of the store's flock, from /proc/locks (looking takes no lock)."""
    try:
        st = (directory / LOCK_FILE).stat()
        locks = Path("/proc/locks").read_text().splitlines()
    except OSError:
        return None
    for line in locks:
        parts = line.split()
        # "1: FLOCK  ADVISORY  WRITE 4545 fd:00:10010901 0 EOF"
        if (
            len(parts) >= 6
            and parts[1] == "FLOCK"
            and parts[5].rsplit(":", 1)[-1] == str(st.st_ino)
        ):
            pid = parts[4]
            try:
                text = (directory / LOCK_FILE).read_text().strip()
            except OSError:
                text = ""
            return text or f"pid {pid}"  # the file names the holder: "pid N on host"
    return None


def exposures(dirs: list[Path], shards: dict[str, list[Path]]) -> list[Exposed]:
    """The given directories, their shard directories and every file in those that group or
    others can reach."""
    paths = [str(d) for d in dirs]
    for shard_dirs in shards.values():
        for d in shard_dirs:
            paths.append(str(d))
            try:
                paths += [str(c) for c in sorted(d.iterdir()) if c.is_file()]
            except OSError:
                pass  # unreadable: the store open reports it
    return [e for e in map(exposed, dict.fromkeys(paths)) if e is not None]


def _rank_name(tag: bytes) -> str:
    tp, pp = SHARD_TAG.unpack(tag)
    return f"tp{tp}-pp{pp}"


def inspect_shard(name: str, paths: list[Path], verify: bool) -> ShardReport:
    report = ShardReport(name, [str(p) for p in paths])
    report.holder = lock_holder(paths[0])
    try:
        store = _native.BlockStore([str(p) for p in paths], 0, read_only=True)
    except Exception as e:  # a foreign or damaged directory: report it, inspect the others
        report.error = f"{type(e).__name__}: {e}"
        return report
    try:
        report.stats = dict(store.stats())
        namespaces: Counter[str] = Counter()
        ranks: Counter[str] = Counter()
        tag_len = SHARD_TAG.size
        for key in store.keys():
            if len(key) > tag_len + PREFIX_LEN:
                ranks[_rank_name(key[:tag_len])] += 1
                namespaces[key[tag_len : tag_len + PREFIX_LEN].hex()] += 1
            else:
                namespaces["(other keys)"] += 1
        report.namespaces = dict(namespaces.most_common())
        report.ranks = dict(sorted(ranks.items()))
        if verify:
            report.corrupt = [k.hex() for k in store.verify()]
    finally:
        store.close()
    return report


def _bytes(n: float | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    raise AssertionError("unreachable")


def _shutdown_text(unix: Any, holder: str | None) -> str:
    if isinstance(unix, (int, float)) and unix > 0:
        when = time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(unix))
        return f"clean, at {when}"
    return "store open now" if holder else "NOT clean (crashed or killed; recovered from journal)"


def _text(report: ShardReport) -> list[str]:
    s = report.stats
    lines = [f"shard {report.name}: {', '.join(report.paths)}"]
    if report.error:
        return [*lines, f"  error           {report.error}"]
    lines += [
        f"  blocks          {s.get('blocks')} ({s.get('unique_blocks')} unique contents)",
        f"  bytes           logical {_bytes(s.get('logical_bytes'))}, physical "
        f"{_bytes(s.get('physical_bytes'))} (capacity {_bytes(s.get('capacity_bytes'))})",
        f"  dedup ratio     {float(s.get('dedup_ratio', 1.0)):.2f}x, compression "
        f"{float(s.get('compression_ratio', 1.0)):.2f}x",
        f"  last shutdown   {_shutdown_text(s.get('last_clean_shutdown_unix'), report.holder)}",
        f"  in use          {report.holder or 'no'}",
        f"  ranks           {', '.join(f'{r}: {n}' for r, n in report.ranks.items()) or '-'}",
        f"  namespaces      {len(report.namespaces)}",
    ]
    lines += [f"    {ns[:16]}…  {n} blocks" for ns, n in report.namespaces.items()]
    if report.corrupt is not None:
        lines.append(f"  verify          {len(report.corrupt)} corrupt blocks")
        lines += [f"    corrupt: {k}" for k in report.corrupt]
    return lines


def run(args: argparse.Namespace) -> int:
    if args.object_store:
        return object_inspect.run(args)
    if not args.dirs:
        print("flexkv-py inspect: give a cache DIR or --object-store URL", file=sys.stderr)
        return 2
    try:
        shards = find_shards(args.dirs)
    except OSError as e:
        print(f"flexkv-py inspect: {e}", file=sys.stderr)
        return 2
    if not shards:
        print(
            f"flexkv-py inspect: no cache store ({DATA_FILE}) in {', '.join(map(str, args.dirs))}",
            file=sys.stderr,
        )
        return 2
    reports = [inspect_shard(name, paths, args.verify) for name, paths in sorted(shards.items())]
    open_paths = exposures(args.dirs, shards)
    for found in open_paths:
        print(f"flexkv-py inspect: warning: {found.message}", file=sys.stderr)
    free = {}
    for d in args.dirs:
        usage = shutil.disk_usage(d)
        free[str(d)] = {"free_bytes": usage.free, "total_bytes": usage.total}
    if args.json:
        privacy = [{**x.as_dict(), "message": x.message} for x in open_paths]
        out: dict[str, Any] = {"shards": [r.as_dict() for r in reports], "disk": free}
        out.update(private=not open_paths, privacy_warnings=privacy)
        print(json.dumps(out))
    else:
        for r in reports:
            print("\n".join(_text(r)))
        for d, u in free.items():
            print(f"disk {d}: {_bytes(u['free_bytes'])} free of {_bytes(u['total_bytes'])}")
    bad = sum(len(r.corrupt or ()) for r in reports)
    if bad:
        print(f"flexkv-py inspect: {bad} corrupt blocks", file=sys.stderr)
    return 1 if bad or any(r.error for r in reports) else 0
