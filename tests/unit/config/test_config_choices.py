"""The closed value sets in `flexkv_py.config.choices` are the ones every layer accepts.

Each Literal must equal: the schema's accepted values, the config model's field type, the
`.pyi`'s parameter type and, where Rust parses the value, what the native store accepts.
"""

from __future__ import annotations

import ast
import logging
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from flexkv_py import _native
from flexkv_py.config import FIELDS_BY_KEY, FlexKVConfig, choices, load_config
from flexkv_py.config.admission import ADMISSION_MODES
from flexkv_py.errors import ConfigError

MiB = 1 << 20


@pytest.fixture(autouse=True)
def _keep_package_log_level() -> Iterator[None]:
    # Resolving log_level=X sets the flexkv_py logger: do not leak it into later tests.
    logger = logging.getLogger("flexkv_py")
    level = logger.level
    yield
    logger.setLevel(level)


# config key -> its Literal
KEYED = {
    "eviction_policy": choices.EvictionPolicy,
    "ssd_io_engine": choices.IoEngine,
    "ssd_compression": choices.Compression,
    "content_hash": choices.ContentHash,
    "durability": choices.Durability,
    "log_level": choices.LogLevel,
    "transfer_engine": choices.TransferEngine,
    "load_failure_policy": choices.LoadFailurePolicy,
    "host_pool_init": choices.HostPoolInit,
    "cache_size_scope": choices.CacheSizeScope,
}


@pytest.mark.parametrize("key", sorted(KEYED))
def test_schema_and_model_use_the_literal(key: str) -> None:
    literal = KEYED[key]
    assert FIELDS_BY_KEY[key].choices == choices.values(literal)
    assert typing.get_type_hints(FlexKVConfig)[key] == literal
    for value in choices.values(literal):
        assert getattr(load_config({key: value}, env={}), key) == value
    with pytest.raises(ConfigError, match=key):
        load_config({key: "no-such-value"}, env={})


def test_every_closed_set_key_is_covered() -> None:
    closed = {key for key, field in FIELDS_BY_KEY.items() if field.choices is not None}
    assert closed == set(KEYED)


def test_admission_modes_are_the_literal() -> None:
    assert ADMISSION_MODES == choices.values(choices.AdmissionMode)


def test_python_side_consumers_accept_the_same_names() -> None:
    from flexkv_py.index.policies import EVICTION_POLICIES
    from flexkv_py.transfer.engine import BACKENDS

    assert set(choices.values(choices.EvictionPolicy)) == set(EVICTION_POLICIES)
    assert set(choices.values(choices.TransferEngine)) == set(BACKENDS)


def test_load_failure_policy_is_vllms() -> None:
    from vllm.config.kv_transfer import KVTransferConfig

    hint = typing.get_type_hints(KVTransferConfig)["kv_load_failure_policy"]
    assert set(typing.get_args(hint)) == set(choices.values(choices.LoadFailurePolicy))


# BlockStore keyword -> (Literal, a name Rust must refuse)
STORE_ARGS: dict[str, tuple[Any, str]] = {
    "io_engine": (choices.IoEngine, "spdk"),
    "compression": (choices.Compression, "lz4"),
    "content_hash": (choices.ContentHash, "md5"),
    "durability": (choices.Durability, "forever"),
}


@pytest.mark.parametrize("arg", sorted(STORE_ARGS))
def test_rust_accepts_exactly_the_literal(tmp_path: Path, arg: str) -> None:
    literal, bad = STORE_ARGS[arg]
    for i, value in enumerate(choices.values(literal)):
        d = tmp_path / f"{arg}-{i}"
        d.mkdir()
        with _native.BlockStore(str(d), 16 * MiB, **{arg: value}) as store:
            assert store.put(b"k", b"v" * 100).ok
            assert store.read(b"k") == b"v" * 100
    d = tmp_path / f"{arg}-bad"
    d.mkdir()
    with pytest.raises(ConfigError, match=bad):
        _native.BlockStore(str(d), 16 * MiB, **{arg: bad})


def test_native_name_lists_when_present() -> None:
    # The native module's own lists (when it exports them) are the Literals too.
    for attr, literal in (("IO_ENGINES", choices.IoEngine), ("COMPRESSIONS", choices.Compression)):
        names = getattr(_native, attr, None)
        if names is not None:
            assert set(names) == set(choices.values(literal)), attr


def test_content_hash_function_accepts_the_literal() -> None:
    for algorithm in choices.values(choices.ContentHash):
        assert len(_native.content_hash(b"abc", algorithm)) == 16
    with pytest.raises(ConfigError, match="md5"):
        _native.content_hash(b"abc", "md5")  # type: ignore[arg-type]


def test_the_stub_types_are_the_literals() -> None:
    stub = Path(_native.__file__).with_name("_native.pyi")
    tree = ast.parse(stub.read_text())
    store = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "BlockStore")
    new = next(n for n in store.body if isinstance(n, ast.FunctionDef) and n.name == "__new__")
    annotations = {a.arg: ast.unparse(a.annotation) for a in new.args.kwonlyargs if a.annotation}
    expected = {
        "io_engine": "IoEngine",
        "compression": "Compression",
        "content_hash": "ContentHash",
        "durability": "Durability",
    }
    assert {k: annotations[k] for k in expected} == expected
    imported = {
        alias.name
        for n in tree.body
        if isinstance(n, ast.ImportFrom) and n.module == "flexkv_py.config.choices"
        for alias in n.names
    }
    assert set(expected.values()) <= imported
