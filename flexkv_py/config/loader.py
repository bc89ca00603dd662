"""Build the effective configuration: defaults < env < config file < overrides, then validate.

FlexKV semantics: when ``FLEXKV_CONFIG_PATH`` is set, the file is used and the other ``FLEXKV_*``
env vars are ignored (we log which). vLLM's ``kv_connector_extra_config`` (the `overrides`) takes
the same keys and is applied last.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from flexkv_py.config.model import FlexKVConfig, ResolvedConfig
from flexkv_py.config.schema import (
    CONFIG_PATH_ENV,
    ENV_PREFIX,
    FIELDS,
    FIELDS_BY_KEY,
    INERT_ENV,
    coerce,
)
from flexkv_py.config.validate import validate
from flexkv_py.errors import ConfigError

logger = logging.getLogger(__name__)
PACKAGE_LOGGER = "flexkv_py"


def _read_file(path: str) -> dict[str, Any]:
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix not in (".yml", ".yaml", ".json"):
        raise ConfigError(f"{CONFIG_PATH_ENV}: {path!r} must end in .yml, .yaml or .json")
    try:
        text = p.read_text()
    except OSError as e:
        raise ConfigError(f"{CONFIG_PATH_ENV}: cannot read {path!r}: {e.strerror or e}") from e
    try:
        data = json.loads(text) if suffix == ".json" else yaml.safe_load(text)
    except (json.JSONDecodeError, yaml.YAMLError) as e:
        raise ConfigError(f"{CONFIG_PATH_ENV}: {path!r} is not valid {suffix[1:]}: {e}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{CONFIG_PATH_ENV}: {path!r} must hold a mapping of keys to values")
    return data


def _apply(
    values: dict[str, Any], sources: dict[str, str], raw: Mapping[str, Any], source: str, where: str
) -> None:
    for key, value in raw.items():
        if not isinstance(key, str) or key not in FIELDS_BY_KEY:
            raise ConfigError(
                f"{key}: unknown configuration key in {where}; "
                f"known keys: {', '.join(FIELDS_BY_KEY)}"
            )
        values[key] = coerce(key, value)
        sources[key] = source


def resolve_config(
    overrides: Mapping[str, Any] | None = None, *, env: Mapping[str, str] | None = None
) -> ResolvedConfig:
    """The validated configuration and the origin of every value. `env` defaults to os.environ.

    Every configuration (vLLM's connector, the CLI) is resolved here, so this is also where an
    explicitly set `log_level` takes effect (see `apply_log_level`)."""
    env = os.environ if env is None else env
    values: dict[str, Any] = {f.key: f.default for f in FIELDS}
    sources: dict[str, str] = {f.key: "default" for f in FIELDS}

    env_values = {f.key: env[f.env] for f in FIELDS if f.env in env and env[f.env].strip() != ""}
    unknown_env = sorted(
        name
        for name in env
        if name.startswith(ENV_PREFIX)
        and name != CONFIG_PATH_ENV
        and name not in INERT_ENV
        and name.removeprefix(ENV_PREFIX).lower() not in FIELDS_BY_KEY
    )
    for name in sorted(n for n in INERT_ENV if n in env):
        logger.info("%s is ignored: %s", name, INERT_ENV[name])
    if unknown_env:
        logger.warning("ignoring unknown FLEXKV_* env vars: %s", ", ".join(unknown_env))

    config_path = env.get(CONFIG_PATH_ENV, "").strip() or None
    if config_path is not None:
        if env_values:
            logger.warning(
                "%s is set: ignoring env vars %s (FlexKV semantics: the file wins)",
                CONFIG_PATH_ENV,
                ", ".join(FIELDS_BY_KEY[k].env for k in env_values),
            )
        _apply(values, sources, _read_file(config_path), f"file:{config_path}", config_path)
    else:
        for key, raw in env_values.items():
            try:
                values[key] = coerce(key, raw)
            except ConfigError as e:
                raise ConfigError(f"{FIELDS_BY_KEY[key].env}: {e}") from e
            sources[key] = f"env:{FIELDS_BY_KEY[key].env}"

    if overrides:
        _apply(values, sources, overrides, "override", "kv_connector_extra_config")

    config = validate(FlexKVConfig(**values))
    if sources["log_level"] != "default":
        apply_log_level(config)
    return ResolvedConfig(config=config, sources=sources, config_path=config_path)


def apply_log_level(config: FlexKVConfig) -> None:
    """Set the `flexkv_py` logger to the configured level.

    Called for a `log_level` that was set (env, file, override); left unset, the host
    application's logging decides (vLLM's, or the CLI's ``-v``), so the default never makes a
    quiet host chatty. Handlers stay the host's; only when no handler at all would receive the
    records (vLLM configures its own ``vllm`` logger, not the root) is one stderr handler added,
    or a DEBUG level would show nothing.
    """
    root = logging.getLogger(PACKAGE_LOGGER)
    root.setLevel(config.log_level)
    if not root.hasHandlers():
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))
        root.addHandler(handler)


def load_config(
    overrides: Mapping[str, Any] | None = None, *, env: Mapping[str, str] | None = None
) -> FlexKVConfig:
    return resolve_config(overrides, env=env).config
