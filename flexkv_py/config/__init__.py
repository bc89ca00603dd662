"""FlexKV-compatible configuration: env vars, a YAML/JSON file, vLLM extra-config overrides."""

from __future__ import annotations

from flexkv_py.config import choices
from flexkv_py.config.admission import AdmissionSpec, parse_admission
from flexkv_py.config.loader import apply_log_level, load_config, resolve_config
from flexkv_py.config.model import FlexKVConfig, ResolvedConfig
from flexkv_py.config.schema import FIELDS, FIELDS_BY_KEY
from flexkv_py.config.validate import validate

__all__ = [
    "FIELDS",
    "FIELDS_BY_KEY",
    "AdmissionSpec",
    "FlexKVConfig",
    "ResolvedConfig",
    "apply_log_level",
    "choices",
    "load_config",
    "parse_admission",
    "resolve_config",
    "validate",
]
