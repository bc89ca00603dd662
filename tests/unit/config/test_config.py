"""Configuration: FlexKV env vars, YAML/JSON file, kv_connector_extra_config overrides, errors."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from flexkv_py.config import (
    FIELDS,
    AdmissionSpec,
    FlexKVConfig,
    load_config,
    parse_admission,
    resolve_config,
)
from flexkv_py.config.schema import EVICTION_POLICIES
from flexkv_py.errors import ConfigError
from flexkv_py.index.policies import EVICTION_POLICIES as POLICY_CLASSES


def test_defaults_match_flexkv() -> None:
    resolved = resolve_config(env={})
    cfg = resolved.config
    assert cfg.cpu_cache_gb == 16.0
    assert cfg.ssd_cache_gb == 0.0
    assert not cfg.ssd_enabled
    assert cfg.eviction_policy == "lru"
    assert cfg.iouring_entries == 512
    assert set(resolved.sources.values()) == {"default"}
    assert [r[0] for r in resolved.rows()] == [f.key for f in FIELDS]


def test_every_field_is_a_config_attribute() -> None:
    assert {f.key for f in FIELDS} == set(FlexKVConfig().as_dict())
    for f in FIELDS:
        assert getattr(FlexKVConfig(), f.key) == f.default, f.key


def test_env_vars(tmp_path: Path) -> None:
    d1, d2 = tmp_path / "a", tmp_path / "b"
    d1.mkdir()
    d2.mkdir()
    env = {
        "FLEXKV_CPU_CACHE_GB": "2.5",
        "FLEXKV_SSD_CACHE_GB": "10",
        "FLEXKV_SSD_CACHE_DIR": f"{d1};{d2};",
        "FLEXKV_EVICTION_POLICY": "LFU",
        "FLEXKV_ENABLE_METRICS": "1",
        "FLEXKV_IOURING_ENTRIES": "128",
        "FLEXKV_ADMISSION": "min_hits:3",
    }
    resolved = resolve_config(env=env)
    cfg = resolved.config
    assert cfg.cpu_cache_gb == 2.5
    assert cfg.ssd_cache_bytes == 10 << 30
    assert cfg.ssd_cache_dir == (str(d1), str(d2))
    assert cfg.eviction_policy == "lfu"
    assert cfg.enable_metrics is True
    assert cfg.iouring_entries == 128
    assert cfg.admission_spec == AdmissionSpec("write_back", 3)
    assert resolved.sources["cpu_cache_gb"] == "env:FLEXKV_CPU_CACHE_GB"
    assert resolved.sources["log_level"] == "default"


@pytest.mark.parametrize("suffix", [".yml", ".yaml", ".json"])
def test_file_wins_and_env_is_ignored(tmp_path: Path, suffix: str) -> None:
    ssd = tmp_path / "ssd"
    ssd.mkdir()
    data = {"cpu_cache_gb": 1, "ssd_cache_gb": 4, "ssd_cache_dir": [str(ssd)], "zstd_level": 3}
    path = tmp_path / f"flexkv{suffix}"
    path.write_text(json.dumps(data))  # JSON is valid YAML too
    env = {
        "FLEXKV_CONFIG_PATH": str(path),
        "FLEXKV_CPU_CACHE_GB": "8",
        "FLEXKV_LOG_LEVEL": "debug",
    }
    resolved = resolve_config(env=env)
    assert resolved.config.cpu_cache_gb == 1.0
    assert resolved.config.zstd_level == 3
    assert resolved.config.ssd_cache_dir == (str(ssd),)
    # FlexKV semantics: with a config file the other env vars are ignored entirely.
    assert resolved.config.log_level == "INFO"
    assert resolved.sources["cpu_cache_gb"] == f"file:{path}"
    assert resolved.sources["log_level"] == "default"
    assert resolved.config_path == str(path)


def test_overrides_apply_last(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("cpu_cache_gb: 4\neviction_policy: fifo\n")
    resolved = resolve_config(
        {"cpu_cache_gb": "3", "admission": "write_through"}, env={"FLEXKV_CONFIG_PATH": str(path)}
    )
    assert resolved.config.cpu_cache_gb == 3.0
    assert resolved.config.eviction_policy == "fifo"
    assert resolved.config.admission == "write_through"
    assert resolved.sources["cpu_cache_gb"] == "override"
    assert resolved.sources["eviction_policy"] == f"file:{path}"


def test_empty_yaml_file_means_defaults(tmp_path: Path) -> None:
    path = tmp_path / "empty.yml"
    path.write_text("")
    assert load_config(env={"FLEXKV_CONFIG_PATH": str(path)}) == FlexKVConfig()


def _ssd_env(tmp_path: Path, **extra: str) -> dict[str, str]:
    d = tmp_path / "ssd"
    d.mkdir(exist_ok=True)
    env = {"FLEXKV_CPU_CACHE_GB": "1", "FLEXKV_SSD_CACHE_GB": "2", "FLEXKV_SSD_CACHE_DIR": str(d)}
    env.update(extra)
    return env


def test_valid_ssd_config(tmp_path: Path) -> None:
    cfg = load_config(env=_ssd_env(tmp_path))
    assert cfg.ssd_enabled and cfg.ssd_cache_dir == (str(tmp_path / "ssd"),)
    # just above the 1 GiB host tier is fine; the size check is strict, not off by one
    assert load_config({"ssd_cache_gb": 1.5}, env=_ssd_env(tmp_path)).ssd_cache_gb == 1.5


# Each bad input -> ConfigError whose message names the key.
@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        ({"cpu_cache_gb": 0}, "cpu_cache_gb"),
        ({"cpu_cache_gb": -1}, "cpu_cache_gb"),
        ({"cpu_cache_gb": "lots"}, "cpu_cache_gb"),
        ({"cpu_cache_gb": True}, "cpu_cache_gb"),
        ({"cpu_cache_gb": float("nan")}, "cpu_cache_gb"),
        ({"ssd_cache_gb": -2}, "ssd_cache_gb"),
        ({"ssd_cache_gb": 0.5}, "ssd_cache_gb"),  # SSD smaller than host tier
        ({"ssd_cache_gb": 1}, "ssd_cache_gb"),  # equal is not larger
        ({"eviction_policy": "random"}, "eviction_policy"),
        ({"admission": "write_sideways"}, "admission"),
        ({"admission": "min_hits:0"}, "admission"),
        ({"admission": "write_back+write_through"}, "admission"),
        ({"ssd_io_engine": "spdk"}, "ssd_io_engine"),
        ({"iouring_entries": 0}, "iouring_entries"),
        ({"iouring_entries": 1 << 20}, "iouring_entries"),
        ({"iouring_entries": 2.5}, "iouring_entries"),
        ({"ssd_compression": "lz4"}, "ssd_compression"),
        ({"zstd_level": 23}, "zstd_level"),
        ({"content_hash": "md5"}, "content_hash"),
        ({"durability": "forever"}, "durability"),
        ({"log_level": "chatty"}, "log_level"),
        ({"enable_metrics": "maybe"}, "enable_metrics"),
        ({"object_store_url": "ftp://bucket/x"}, "object_store_url"),
        ({"object_store_url": 42}, "object_store_url"),
        ({"transfer_engine": "dma"}, "transfer_engine"),
        ({"enable_gds": True}, "enable_gds"),
        ({"max_file_size_gb": 0}, "max_file_size_gb"),
        ({"ssd_cache_dir": 5}, "ssd_cache_dir"),
        ({"no_such_key": 1}, "no_such_key"),
        ({"load_failure_policy": "retry"}, "load_failure_policy"),
        ({"instance_num": 0}, "instance_num"),
        ({"instance_num": 4, "instance_id": 4}, "instance_id"),
        ({"cache_size_scope": "rack"}, "cache_size_scope"),
        ({"share_node_shards": "maybe"}, "share_node_shards"),
        ({"instance_id": 1}, "instance_id"),
    ],
)
def test_bad_values_name_the_key(tmp_path: Path, overrides: dict[str, object], key: str) -> None:
    env = _ssd_env(tmp_path)
    with pytest.raises(ConfigError, match=key):
        load_config(overrides, env=env)


def test_ssd_without_dir(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="ssd_cache_dir: required"):
        load_config(env={"FLEXKV_CPU_CACHE_GB": "1", "FLEXKV_SSD_CACHE_GB": "2"})


def test_missing_dir(tmp_path: Path) -> None:
    env = _ssd_env(tmp_path, FLEXKV_SSD_CACHE_DIR=str(tmp_path / "nope"))
    with pytest.raises(ConfigError, match=r"ssd_cache_dir: directory .*nope.* does not exist"):
        load_config(env=env)


def test_dir_is_a_file(tmp_path: Path) -> None:
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ConfigError, match="not a directory"):
        load_config(env=_ssd_env(tmp_path, FLEXKV_SSD_CACHE_DIR=str(f)))


def _config_error_as(uid: int | None, overrides: dict[str, object]) -> str:
    """The ConfigError message load_config raises, checked as user `uid` (forked child)."""
    if uid is None:
        with pytest.raises(ConfigError) as info:
            load_config(overrides, env={})
        return str(info.value)
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: drop root, run the check, report through the pipe
        try:
            os.setgid(uid)
            os.setuid(uid)
            try:
                load_config(overrides, env={})
                msg = "no error"
            except ConfigError as e:
                msg = str(e)
            os.write(write_fd, msg.encode())
        finally:
            os._exit(0)
    os.close(write_fd)
    with os.fdopen(read_fd) as f:
        msg = f.read()
    os.waitpid(pid, 0)
    return msg


def test_unwritable_dir() -> None:
    # A directory its user cannot write. Root passes every permission check, so as root the
    # check runs in a forked child that became "nobody".
    base = Path(tempfile.mkdtemp(prefix="flexkv-ro-"))
    try:
        base.chmod(0o755)
        ro = base / "ssd"
        ro.mkdir()
        ro.chmod(0o555)
        overrides = {"cpu_cache_gb": 1, "ssd_cache_gb": 2, "ssd_cache_dir": str(ro)}
        msg = _config_error_as(65534 if os.geteuid() == 0 else None, overrides)
        assert msg.startswith("ssd_cache_dir:") and "not writable" in msg, msg
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_duplicate_dirs(tmp_path: Path) -> None:
    d = tmp_path / "ssd"
    d.mkdir()
    with pytest.raises(ConfigError, match="same directory"):
        load_config(env=_ssd_env(tmp_path, FLEXKV_SSD_CACHE_DIR=f"{d};{d}/"))


def test_bad_env_value_names_the_env_var() -> None:
    with pytest.raises(ConfigError, match="FLEXKV_IOURING_ENTRIES"):
        load_config(env={"FLEXKV_IOURING_ENTRIES": "many"})


def test_unknown_key_in_file(tmp_path: Path) -> None:
    path = tmp_path / "c.yml"
    path.write_text("cpu_cache_gb: 1\ncpu_cahce_gb: 2\n")
    with pytest.raises(ConfigError, match="cpu_cahce_gb: unknown configuration key"):
        load_config(env={"FLEXKV_CONFIG_PATH": str(path)})


@pytest.mark.parametrize(
    ("name", "text", "match"),
    [
        ("c.toml", "cpu_cache_gb = 1", "must end in"),
        ("c.json", "{not json", "not valid json"),
        ("c.yml", "- a\n- b\n", "mapping"),
        ("c.yaml", "a: [1, 2", "not valid yaml"),
    ],
)
def test_bad_config_files(tmp_path: Path, name: str, text: str, match: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError, match=f"FLEXKV_CONFIG_PATH: .*{match}"):
        load_config(env={"FLEXKV_CONFIG_PATH": str(path)})


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(env={"FLEXKV_CONFIG_PATH": str(tmp_path / "absent.yml")})


def test_unknown_env_vars_are_only_warned(caplog: pytest.LogCaptureFixture) -> None:
    cfg = load_config(env={"FLEXKV_EVICTON_POLICY": "lfu"})
    assert cfg.eviction_policy == "lru"
    assert "FLEXKV_EVICTON_POLICY" in caplog.text


def test_admission_grammar() -> None:
    assert parse_admission("write_back") == AdmissionSpec("write_back", 1)
    assert parse_admission("Write-Through") == AdmissionSpec("write_through", 1)
    assert parse_admission("min_hits:4") == AdmissionSpec("write_back", 4)
    assert parse_admission("write_through+min_hits:2") == AdmissionSpec("write_through", 2)
    assert parse_admission("min_hits:2, write_through") == AdmissionSpec("write_through", 2)
    assert str(parse_admission("min_hits:2,write_through")) == "write_through+min_hits:2"
    # normalised text round-trips through the config
    assert load_config({"admission": "min_hits:2,write_through"}, env={}).admission == (
        "write_through+min_hits:2"
    )
    for bad in ("", "min_hits:", "min_hits:x", "min_hits:1+min_hits:2", "lru"):
        with pytest.raises(ConfigError, match="admission"):
            parse_admission(bad)


def test_apply_log_level() -> None:
    import logging

    from flexkv_py.config import apply_log_level

    logger = logging.getLogger("flexkv_py")
    old = logger.level
    try:
        apply_log_level(load_config({"log_level": "debug"}, env={}))
        assert logger.level == logging.DEBUG
    finally:
        logger.setLevel(old)


def test_config_policy_names_match_policy_classes() -> None:
    assert set(EVICTION_POLICIES) == set(POLICY_CLASSES)


def test_dirs_accept_list_and_semicolon_string(tmp_path: Path) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    base = {"cpu_cache_gb": 1, "ssd_cache_gb": 2}
    from_list = load_config({**base, "ssd_cache_dir": [str(a), str(b)]}, env={})
    from_str = load_config({**base, "ssd_cache_dir": f" {a} ; {b} "}, env={})
    assert from_list.ssd_cache_dir == from_str.ssd_cache_dir == (str(a), str(b))


@pytest.mark.parametrize("policy", ["lru", "fifo", "lfu"])
def test_every_valid_eviction_policy_opens_an_ssd_tier(tmp_path: Path, policy: str) -> None:
    from flexkv_py.index.namespace import Namespace
    from flexkv_py.tiers.ssd.tier import SsdTier

    cfg = load_config(
        {
            "cpu_cache_gb": 0.01,
            "ssd_cache_gb": 0.05,
            "ssd_cache_dir": str(tmp_path),
            "eviction_policy": policy,
        },
        env={},
    )
    ns = Namespace(model="m", revision=None, kv_dtype="bfloat16", kv_layout="LBNHC", block_size=16)
    tier = SsdTier(cfg, ns)
    try:
        assert tier.store.put(b"k", b"x" * 4096).ok
    finally:
        tier.close()


def test_flexkv_single_instance_and_server_mode_vars(caplog: pytest.LogCaptureFixture) -> None:
    env = {
        "FLEXKV_INSTANCE_NUM": "1",
        "FLEXKV_INSTANCE_ID": "0",
        "FLEXKV_LOAD_FAILURE_POLICY": "fail",
        "FLEXKV_SERVER_RECV_PORT": "ipc:///tmp/x",
    }
    with caplog.at_level("INFO", logger="flexkv_py.config"):
        cfg = load_config(env=env)
    assert (cfg.instance_num, cfg.instance_id, cfg.load_failure_policy) == (1, 0, "fail")
    notes = [r for r in caplog.records if "FLEXKV_SERVER_RECV_PORT" in r.getMessage()]
    assert len(notes) == 1 and notes[0].levelname == "INFO"


@pytest.mark.parametrize("source", ["env", "file", "override"])
def test_object_store_keys_are_accepted_from_every_source(tmp_path: Path, source: str) -> None:
    url = "s3://bucket/kv"
    env: dict[str, str] = {}
    overrides: dict[str, object] | None = None
    if source == "env":
        env["FLEXKV_OBJECT_STORE_URL"] = url
        env["FLEXKV_OBJECT_STORE_ENDPOINT"] = "http://127.0.0.1:9"
        env["FLEXKV_OBJECT_STORE_ALLOW_HTTP"] = "1"
    elif source == "file":
        path = tmp_path / "c.yml"
        path.write_text(
            f"object_store_url: {url}\nobject_store_endpoint: http://127.0.0.1:9\n"
            "object_store_allow_http: true\n"
        )
        env["FLEXKV_CONFIG_PATH"] = str(path)
    else:
        overrides = {
            "object_store_url": url,
            "object_store_endpoint": "http://127.0.0.1:9",
            "object_store_allow_http": True,
        }
    cfg = load_config(overrides, env=env)
    assert (cfg.object_store_url, cfg.object_store_endpoint) == (url, "http://127.0.0.1:9")
    assert cfg.object_store_allow_http and cfg.object_enabled
    # Unset (or an empty env var) is off.
    assert load_config(env={"FLEXKV_OBJECT_STORE_URL": ""}).object_store_url is None
    for bad in ("ftp://x/y", "bucket/kv"):
        with pytest.raises(ConfigError, match=r"object_store_url: .* is not an object-store URL"):
            load_config({"object_store_url": bad}, env={})
    with pytest.raises(ConfigError, match=r"object_store_lookup_wait_s"):
        load_config({"object_store_url": url, "object_store_lookup_wait_s": 0}, env={})


@pytest.mark.parametrize(
    ("how", "level"),
    [("env", "DEBUG"), ("file", "ERROR"), ("override", "WARNING")],
)
def test_a_set_log_level_drives_the_package_logger(tmp_path: Path, how: str, level: str) -> None:
    import logging

    logger = logging.getLogger("flexkv_py")
    old = logger.level
    try:
        logger.setLevel(logging.NOTSET)
        load_config(env={})  # the default leaves the host's logging alone
        assert logger.level == logging.NOTSET
        if how == "env":
            resolve_config(env={"FLEXKV_LOG_LEVEL": level.lower()})
        elif how == "file":
            path = tmp_path / "c.json"
            path.write_text(json.dumps({"log_level": level}))
            resolve_config(env={"FLEXKV_CONFIG_PATH": str(path)})
        else:
            resolve_config({"log_level": level}, env={})
        assert logger.level == getattr(logging, level)
    finally:
        logger.setLevel(old)
