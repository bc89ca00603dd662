"""Identity that never mixes KV: the same model path or name with another config, other weights,
another fp8 cache format or another LoRA adapter never hits blocks stored by the first; an
operator's explicit identity shares across renamed copies; an epoch bump leaves old blocks."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from helpers import vllm_harness as vh
from vllm.config import CacheConfig
from vllm.lora.request import LoRARequest

from flexkv_py.index.namespace import BASE_VARIANT, FORMAT_VERSION, Namespace
from flexkv_py.integration.vllm.engine_info import read_engine_info
from flexkv_py.integration.vllm.identity import AdapterVariants, kv_cache_format

pytestmark = pytest.mark.usefixtures("connector_form")

BS = 16


def _model(root: Path, **config: Any) -> str:
    """A model directory at a fixed path (as Kubernetes mounts /model), rewritten in place."""
    d = root / "model"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({**vh.TINY_CONFIG, **config}))
    vh._model_config.cache_clear()  # vLLM parses the config again, as a new pod would
    return str(d)


def _store_then_restart(model_dir: str, extra: dict[str, Any], prompt: list[int]) -> vh.Engine:
    e1 = vh.Engine(model_dir, vh.connector_transfer_config(extra))
    e1.add(vh.make_request("A", prompt))
    e1.run()
    e1.shutdown()
    return e1


def _hits_after_restart(model_dir: str, extra: dict[str, Any], prompt: list[int]) -> bool:
    e2 = vh.Engine(model_dir, vh.connector_transfer_config(extra))
    e2.add(vh.make_request("B", prompt))
    e2.run()
    hit = any("B" in rec.finished_recving for rec in e2.history)
    assert not e2.mismatches()
    e2.shutdown()
    return hit


def test_restart_with_the_same_model_still_hits(tmp_path: Path) -> None:
    model = _model(tmp_path)
    extra = vh.with_ssd(tmp_path / "ssd")
    prompt = vh.prompt_tokens(601, 4 * BS)
    _store_then_restart(model, extra, prompt)
    assert _hits_after_restart(_model(tmp_path), extra, prompt)  # same config rewritten


@pytest.mark.parametrize(
    "change",
    ["config", "weights", "epoch"],
)
def test_same_path_other_model_never_hits(tmp_path: Path, change: str) -> None:
    model = _model(tmp_path)
    weights = Path(model) / "model.safetensors"
    weights.write_bytes(b"\x00" * 4096)
    extra = vh.with_ssd(tmp_path / "ssd")
    prompt = vh.prompt_tokens(602, 4 * BS)
    _store_then_restart(model, extra, prompt)
    if change == "config":  # same shapes, other numerics: its KV differs
        model = _model(tmp_path, rope_theta=5e5)
    elif change == "weights":  # a new checkpoint under the same path
        weights.write_bytes(b"\x01" * 8192)
        os.utime(weights, ns=(1, 1))
        vh._model_config.cache_clear()
    else:  # weights changed in place (RL): the operator bumps the epoch
        extra = {**extra, "model_epoch": 1}
    assert not _hits_after_restart(model, extra, prompt)


def test_explicit_identity_shares_across_renamed_copies(tmp_path: Path) -> None:
    a = vh.tiny_model_dir(tmp_path / "a")
    b = vh.tiny_model_dir(tmp_path / "b")
    extra = vh.with_ssd(tmp_path / "ssd", model_identity="qwen3-8b@2026-11")
    prompt = vh.prompt_tokens(603, 4 * BS)
    _store_then_restart(a, extra, prompt)
    assert _hits_after_restart(b, extra, prompt)
    # Without the override the two copies' paths differ, so they would not share.
    plain = vh.with_ssd(tmp_path / "ssd2")
    _store_then_restart(a, plain, prompt)
    assert not _hits_after_restart(b, plain, prompt)


def _namespace(model_dir: str, cache_dtype: str) -> Namespace:
    cfg = vh.make_vllm_config(model_dir, vh.connector_transfer_config({"cpu_cache_gb": 0.004}))
    cfg.cache_config.cache_dtype = cache_dtype
    return read_engine_info(cfg, vh.make_kv_cache_config(cfg, 64)).namespace


def test_every_fp8_cache_format_has_its_own_namespace(model_dir: str) -> None:
    # In the KV tensors every fp8 format is torch.uint8: the namespace uses vLLM's name for it.
    prefixes = {d: _namespace(model_dir, d).prefix for d in ("auto", "fp8_e4m3", "fp8_e5m2")}
    assert len(set(prefixes.values())) == 3
    e4m3, e5m2 = CacheConfig(block_size=BS), CacheConfig(block_size=BS)
    e4m3.cache_dtype, e5m2.cache_dtype = "fp8_e4m3", "fp8_e5m2"
    assert kv_cache_format(e4m3, "torch.uint8") != kv_cache_format(e5m2, "torch.uint8")
    assert FORMAT_VERSION >= 2


def test_lora_adapters_are_keyed_by_identity_not_name(tmp_path: Path) -> None:
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text('{"r": 8}')
    (adapter / "adapter_model.safetensors").write_bytes(b"\x00" * 1024)
    req = LoRARequest("support-bot", 1, str(adapter))
    first = AdapterVariants().variant(req)
    assert first != BASE_VARIANT and AdapterVariants().variant(None) == BASE_VARIANT
    assert AdapterVariants().variant(req) == first  # stable across engines
    # Republished under the same name and path: a new engine keys it apart.
    (adapter / "adapter_model.safetensors").write_bytes(b"\x02" * 2048)
    assert AdapterVariants().variant(req) != first
    ns = Namespace(
        model="m", revision=None, kv_dtype="auto:bfloat16", kv_layout="LBNHC", block_size=BS
    )
    h = b"\x11" * 32
    base, lora = ns.key(h), ns.key(h, first)
    assert base != lora and ns.block_hash(base) == ns.block_hash(lora) == h
    assert ns.owns(base) and ns.owns(lora)
