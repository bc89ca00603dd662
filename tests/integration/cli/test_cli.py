"""The `flexkv-py` CLI end to end, in subprocesses (`python -m flexkv_py ...`).

Replay runs the real tier stack (CacheEngine, host pool, native SSD store on a real directory);
inspect reads what replay left behind; corruption is injected into the data file by hand.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

from helpers.store_util import DATA_FILE, PAGE, flip_byte, stored_blocks

from flexkv_py import BlockStore
from flexkv_py.cli.replay_cmd import QUICK_SYNTHETIC
from flexkv_py.cli.workloads import generate_synthetic

ROOT = Path(__file__).resolve().parents[3]
TRACE = Path(__file__).resolve().parents[2] / "data" / "mooncake_small.jsonl"
SMALL_MODEL = ["--layers", "2", "--kv-heads", "1", "--head-dim", "32", "--no-progress"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def cli(*args: str | Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("FLEXKV_")}
    return subprocess.run(
        [sys.executable, "-m", "flexkv_py", *map(str, args)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=180,
        env={**base, **(env or {})},
    )


def one_json_line(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 1, proc.stdout  # --json: exactly one line on stdout
    out: dict[str, Any] = json.loads(lines[0])
    return out


def check_replay_schema(r: dict[str, Any]) -> None:
    for key in ("requests", "blocks", "hits", "misses", "tokens_saved", "prompt_tokens"):
        assert type(r[key]) is int and r[key] >= 0, key
    assert isinstance(r["hit_rate"], float) and 0.0 <= r["hit_rate"] <= 1.0
    tiers = r["hits_by_tier"]
    assert set(tiers) == {"gpu", "cpu", "ssd"}
    assert all(type(n) is int and n >= 0 for n in tiers.values())
    assert sum(tiers.values()) == r["hits"]
    assert r["hits"] + r["misses"] == r["blocks"]
    assert abs(r["hit_rate"] - r["hits"] / r["blocks"]) < 1e-12
    assert r["tokens_saved"] == r["hits"] * r["block_tokens"]
    assert set(r["bytes_by_tier"]) == {"cpu", "ssd"}
    for moved in r["bytes_by_tier"].values():
        assert set(moved) == {"read", "write"}
        assert all(type(n) is int and n >= 0 for n in moved.values())
    # Every block served by a tier crossed it once (SSD reads also count header pages).
    assert r["bytes_by_tier"]["cpu"]["read"] == tiers["cpu"] * r["page_bytes"]
    assert r["bytes_by_tier"]["ssd"]["read"] >= tiers["ssd"] * r["page_bytes"]
    assert all(isinstance(v, float) and v >= 0 for v in r["gbps"].values())
    assert isinstance(r["dedup_ratio"], float) and r["dedup_ratio"] >= 1.0
    assert r["mismatches"] == 0  # every loaded block was bit-exact
    assert r["load_failures"] == 0
    assert r["false_hits"] == r["load_failures"]
    refs = r["references"]
    assert len(refs) == 2 and all(0.0 <= v <= 1.0 for v in refs.values())
    small, large = refs.values()  # GPU + SSD blocks, then every tier's blocks
    assert small <= large
    wear = r["ssd_written_per_served"]
    assert wear is None or wear >= 0.0


def trace_lines() -> list[dict[str, Any]]:
    return [json.loads(line) for line in TRACE.read_text().splitlines() if line.strip()]


def test_replay_synthetic_quick_json_and_plot(tmp_path: Path) -> None:
    png = tmp_path / "replay.png"
    r = one_json_line(cli("replay", "--quick", "--json", "--no-progress", "--plot", png))
    check_replay_schema(r)
    expected = generate_synthetic(QUICK_SYNTHETIC)  # the CLI replays exactly this workload
    assert r["workload"] == "synthetic"
    assert r["requests"] == QUICK_SYNTHETIC.users * QUICK_SYNTHETIC.turns
    assert r["blocks"] == expected.num_blocks
    assert r["prompt_tokens"] == sum(q.prompt_tokens for q in expected.requests)
    assert r["misses"] >= expected.unique_blocks  # each distinct block is computed at least once
    # Sized so that every tier matters: each one serves some hits.
    assert all(n > 0 for n in r["hits_by_tier"].values()), r["hits_by_tier"]
    assert r["tokens_saved_by_offload"] > 0
    assert r["dedup_ratio"] == 1.0  # every block has distinct KV: nothing to dedup
    data = png.read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 1000
    width, height = struct.unpack(">II", data[16:24])  # IHDR
    assert (width, height) == (900, 600)


def test_replay_tenants_dedup_on_ssd() -> None:
    # Three tenants salt their keys: equal KV under different keys is stored once on SSD.
    r = one_json_line(cli("replay", "--quick", "--json", "--tenants", "3", *SMALL_MODEL))
    check_replay_schema(r)
    assert r["dedup_ratio"] > 1.05  # the single-tenant run stores no duplicates (1.0)


def test_replay_trace_then_inspect_and_verify(tmp_path: Path) -> None:
    ssd = tmp_path / "ssd"
    r = one_json_line(cli("replay", "--trace", TRACE, "--json", "--ssd-dir", ssd, *SMALL_MODEL))
    check_replay_schema(r)
    lines = trace_lines()
    assert r["requests"] == len(lines)
    assert r["block_tokens"] == 512
    assert r["blocks"] == sum(min(len(x["hash_ids"]), x["input_length"] // 512) for x in lines)
    assert r["hits_by_tier"]["ssd"] > 0 and r["hits_by_tier"]["cpu"] > 0

    shard = ssd / "tp0-pp0"
    on_disk = stored_blocks(shard)  # independent of the store: scan the data file's headers
    report = one_json_line(cli("inspect", ssd, "--json", "--verify"))
    (info,) = report["shards"]
    assert info["name"] == "tp0-pp0" and info["blocks"] == len(on_disk) > 0
    assert info["logical_bytes"] == r["ssd_logical_bytes"]
    assert info["ranks"] == {"tp0-pp0": len(on_disk)}
    assert list(info["namespaces"].values()) == [len(on_disk)]  # one model namespace
    assert info["last_clean_shutdown_unix"] > 0  # replay closed the store
    assert info["in_use_by"] is None and info["corrupt_keys"] == []
    assert report["disk"][str(ssd)]["free_bytes"] > 0

    victims = sorted(on_disk)[:2]
    for i, key in enumerate(victims):  # one byte inside each payload (after the header page)
        flip_byte(shard / DATA_FILE, on_disk[key] + PAGE + 100 * (i + 1))
    bad = cli("inspect", ssd, "--verify")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    listed = {line.split("corrupt: ")[1] for line in bad.stdout.splitlines() if "corrupt: " in line}
    assert listed == {k.hex() for k in victims}
    assert "2 corrupt blocks" in bad.stderr
    assert "clean, at" in bad.stdout


def test_replay_trace_matches_the_gpu_plus_ssd_lru_with_write_behind() -> None:
    # The vendored slice is 40 requests (104 distinct blocks), so the tiers are scaled down
    # from the 1000/2000/8000 in the same 1:2:8 ratio.
    sizes = ["--gpu-blocks", "10", "--cpu-blocks", "20", "--ssd-blocks", "80"]
    r = one_json_line(cli("replay", "--trace", TRACE, "--json", *sizes, *SMALL_MODEL))
    check_replay_schema(r)
    first = next(iter(r["references"].values()))
    assert r["hit_rate"] >= first - 1e-9, (r["hit_rate"], r["references"])
    assert r["false_hits"] == 0
    assert r["ssd_written_per_served"] is not None and r["ssd_written_per_served"] < 1.0


def test_replay_without_ssd_tier_gets_no_ssd_hits() -> None:
    r = one_json_line(cli("replay", "--trace", TRACE, "--json", "--ssd-blocks", "0", *SMALL_MODEL))
    check_replay_schema(r)
    assert r["hits_by_tier"]["ssd"] == 0
    assert r["bytes_by_tier"]["ssd"] == {"read": 0, "write": 0}
    assert r["tiers"]["ssd_dirs"] == []


def test_replay_rejects_a_bad_trace_line(tmp_path: Path) -> None:
    trace = tmp_path / "bad.jsonl"
    good = TRACE.read_text().splitlines()[0]
    trace.write_text(good + "\n" + '{"timestamp": 5, "input_length": 900, "output_length": 3}\n')
    proc = cli("replay", "--trace", trace, "--json", *SMALL_MODEL)
    assert proc.returncode == 2 and proc.stdout == ""
    assert f"{trace}:2" in proc.stderr and "hash_ids" in proc.stderr


def test_inspect_is_read_only_while_a_store_is_open(tmp_path: Path) -> None:
    shard = tmp_path / "tp0-pp0"
    shard.mkdir()
    with BlockStore(str(shard), 16 << 20) as store:
        assert store.put(b"key-1", b"x" * PAGE).ok
        report = one_json_line(cli("inspect", tmp_path, "--json"))
        (info,) = report["shards"]
        assert info["blocks"] == 1
        assert info["in_use_by"] is not None and str(os.getpid()) in info["in_use_by"]
        assert info["last_clean_shutdown_unix"] == 0  # open right now
        assert store.put(b"key-2", b"y" * PAGE).ok  # the owner is undisturbed
    after = one_json_line(cli("inspect", tmp_path, "--json"))["shards"][0]
    assert after["blocks"] == 2 and after["in_use_by"] is None
    assert after["last_clean_shutdown_unix"] > 0


def test_inspect_without_a_store_is_a_usage_error(tmp_path: Path) -> None:
    proc = cli("inspect", tmp_path)
    assert proc.returncode == 2 and "no cache store" in proc.stderr


def test_config_reports_sources(tmp_path: Path) -> None:
    r = one_json_line(cli("config", "--json", env={"FLEXKV_CPU_CACHE_GB": "3"}))
    assert r["config"]["cpu_cache_gb"] == 3.0
    assert r["sources"]["cpu_cache_gb"] == "env:FLEXKV_CPU_CACHE_GB"
    assert r["sources"]["eviction_policy"] == "default"
    path = tmp_path / "flexkv.yaml"
    path.write_text("cpu_cache_gb: 2\neviction_policy: fifo\n")
    proc = cli("config", "--set", "eviction_policy=lfu", env={"FLEXKV_CONFIG_PATH": str(path)})
    assert proc.returncode == 0, proc.stderr
    rows = {line.split()[0]: line.split()[1:] for line in proc.stdout.splitlines()[2:-1]}
    assert rows["cpu_cache_gb"][:2] == ["2.0", f"file:{path}"]
    assert rows["eviction_policy"][:2] == ["lfu", "override"]


def test_config_unknown_key_in_file_exits_2_naming_it(tmp_path: Path) -> None:
    path = tmp_path / "flexkv.yaml"
    path.write_text("cpu_cache_gb: 2\ncpu_cache_gib: 4\n")
    proc = cli("config", env={"FLEXKV_CONFIG_PATH": str(path)})
    assert proc.returncode == 2 and proc.stdout == ""
    assert "cpu_cache_gib" in proc.stderr and "unknown configuration key" in proc.stderr
    bad = cli("config", "--set", "cpu_cache_gb=-1")
    assert bad.returncode == 2 and "cpu_cache_gb" in bad.stderr


def test_config_accepts_an_object_store_url_and_refuses_a_bad_one() -> None:
    proc = cli("config", "--set", "object_store_url=s3://bucket/kv")
    assert proc.returncode == 0 and "s3://bucket/kv" in proc.stdout
    env = cli("config", env={"FLEXKV_OBJECT_STORE_URL": "ftp://bucket/kv"})
    assert env.returncode == 2 and "object_store_url" in env.stderr


def test_bench_runs_each_bench_and_tabulates_ratios(tmp_path: Path) -> None:
    (tmp_path / "fast_bench.py").write_text(
        "import json, sys\n"
        '# accepts "--quick"\n'
        "print('human line')\n"
        "print(json.dumps({'write_gbps': 2.0, 'raw_write_gbps': 4.0, 'write_ratio': 0.5,"
        " 'argv': sys.argv[1:]}))\n"
    )
    (tmp_path / "broken_bench.py").write_text("import sys\nsys.exit(3)\n")
    proc = cli("bench", "--benches-dir", tmp_path, "--quick")
    assert proc.returncode == 1  # one bench failed
    row = next(line.split() for line in proc.stdout.splitlines() if line.startswith("fast"))
    assert row == ["fast", "write_ratio", "2.00", "4.00", "0.500"]
    assert any(line.split()[:2] == ["broken", "FAILED"] for line in proc.stdout.splitlines())
    assert "human line" in proc.stderr  # bench output is forwarded, stdout keeps the table
    r = one_json_line(cli("bench", "--benches-dir", tmp_path, "--only", "fast", "--json"))
    assert r["failed"] == [] and r["benches"]["fast"]["argv"] == ["--json"]
