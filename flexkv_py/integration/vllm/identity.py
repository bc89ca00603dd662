"""What identifies the KV a model computes, beyond the path it was loaded from.

A namespace keyed by `model_config.model` alone serves wrong tokens whenever two different
checkpoints share a path (Kubernetes mounts every model at `/model`), a checkpoint is
republished under the same name, or a LoRA adapter is replaced in place. So the model part of
the namespace digests:

- the model's own config (the parsed HF config: architecture, sizes, rope, quantization);
- its weights' identity, read cheaply at start: for a local checkpoint every weight and index
  file's name, size and modification time, plus the index files' contents; for a hub id the
  resolved snapshot commit when the local cache knows it, else the requested revision;
- the served model name and an operator-set epoch (`model_epoch`: bump it after changing weights
  in place, e.g. RL updates, to leave the old blocks behind);
- or, instead of all of that, an explicit `model_identity` chosen by the operator, for sharing
  a cache across renamed copies of one checkpoint.

A LoRA adapter gets its own 8-byte variant in every key (adapter name, path, config and weight
files' identity), so a republished adapter never hits the old one's blocks.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections import OrderedDict
from pathlib import Path
from typing import Any

from flexkv_py.index.namespace import BASE_VARIANT, VARIANT_LEN

logger = logging.getLogger(__name__)

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".index.json")
_MAX_FILES = 4096  # a checkpoint directory is a few hundred files at most


def _digest(obj: Any, size: int = 16) -> str:
    canonical = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.blake2b(canonical, digest_size=size).hexdigest()


def files_identity(directory: Path, suffixes: tuple[str, ...] = _WEIGHT_SUFFIXES) -> list[Any]:
    """(name, size, mtime_ns) of the directory's weight files, and the content of its index
    files (small JSON maps of tensor to file), in name order."""
    out: list[Any] = []
    try:
        entries = sorted(os.scandir(directory), key=lambda e: e.name)[:_MAX_FILES]
    except OSError as e:
        return [f"unreadable: {e.strerror or e}"]
    for entry in entries:
        if not entry.name.endswith(suffixes) or not entry.is_file():
            continue
        st = entry.stat()
        item: list[Any] = [entry.name, st.st_size, st.st_mtime_ns]
        if entry.name.endswith(".index.json") and st.st_size < (64 << 20):
            item.append(hashlib.blake2b(Path(entry.path).read_bytes(), digest_size=16).hexdigest())
        out.append(item)
    return out


def _hub_snapshot(model: str, revision: str | None) -> str:
    """The snapshot commit the local HF cache resolves `model`@`revision` to, if it knows."""
    try:
        from huggingface_hub import try_to_load_from_cache

        path = try_to_load_from_cache(model, "config.json", revision=revision)
    except Exception:  # no hub package, or a malformed id: fall back to the revision
        return f"revision:{revision or 'main'}"
    if isinstance(path, str) and "/snapshots/" in path:
        return "snapshot:" + path.split("/snapshots/")[1].split("/")[0]
    return f"revision:{revision or 'main'}"


def weights_identity(model: str, revision: str | None) -> Any:
    path = Path(model)
    if path.is_dir():
        return {"local": files_identity(path)}
    return {"hub": model, "at": _hub_snapshot(model, revision)}


def _hf_config_digest(model_config: Any) -> str:
    hf = getattr(model_config, "hf_config", None)
    if hf is None:
        return ""
    to_dict = getattr(hf, "to_dict", None)
    data = to_dict() if callable(to_dict) else vars(hf)
    # Paths and names of this copy say nothing about the KV it computes.
    for noise in ("_name_or_path", "transformers_version", "_commit_hash"):
        data.pop(noise, None)
    return _digest(data)


def model_identity(model_config: Any, *, override: str | None, epoch: int) -> str:
    """The model part of the namespace (see the module docstring)."""
    if override:
        return "override:" + override
    served = getattr(model_config, "served_model_name", None)
    return _digest(
        {
            "config": _hf_config_digest(model_config),
            "weights": weights_identity(str(model_config.model), model_config.revision),
            "served": served if isinstance(served, str) else list(served or ()),
            "quantization": getattr(model_config, "quantization", None),
            "epoch": epoch,
        }
    )


def kv_cache_format(cache_config: Any, spec_dtype: Any) -> str:
    """vLLM's cache dtype name (every fp8 format is torch.uint8 in the tensors) and how its
    scales are kept, with the tensors' dtype."""
    dtype = str(spec_dtype).removeprefix("torch.")
    cache_dtype = str(getattr(cache_config, "cache_dtype", "auto"))
    scales = "computed" if getattr(cache_config, "calculate_kv_scales", False) else "static"
    skip = sorted(getattr(cache_config, "kv_cache_dtype_skip_layers", None) or ())
    suffix = f":skip={_digest(skip, 4)}" if skip else ""
    return f"{cache_dtype}:{dtype}:scales={scales}{suffix}"


class AdapterVariants:
    """Per-request key variant: the base model's for requests without LoRA, a digest of the
    adapter's identity otherwise (memoized per adapter: the files are read once)."""

    def __init__(self, capacity: int = 1024) -> None:
        self._cache: OrderedDict[tuple[str, int, str], bytes] = OrderedDict()
        self._capacity = capacity

    def variant(self, lora_request: Any) -> bytes:
        if lora_request is None:
            return BASE_VARIANT
        name = str(getattr(lora_request, "lora_name", ""))
        int_id = int(getattr(lora_request, "lora_int_id", 0))
        path = str(getattr(lora_request, "lora_path", "") or "")
        memo = (name, int_id, path)
        got = self._cache.get(memo)
        if got is None:
            ident: Any = {"name": name, "path": path}
            if path and Path(path).is_dir():
                ident["files"] = files_identity(Path(path), (".json", ".safetensors", ".bin"))
                config = Path(path) / "adapter_config.json"
                if config.is_file():
                    ident["config"] = hashlib.blake2b(config.read_bytes()).hexdigest()
            got = bytes.fromhex(_digest(ident, VARIANT_LEN))
            if got == BASE_VARIANT:  # astronomically unlikely; keep the base model's apart
                got = b"\x01" + got[1:]
            self._cache[memo] = got
            while len(self._cache) > self._capacity:
                self._cache.popitem(last=False)
        self._cache.move_to_end(memo)
        return got
