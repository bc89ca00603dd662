"""Package names imported on first use (PEP 562), so importing a package stays cheap: the
transfer package must not pay for torch on CPU-only paths, and the vLLM integration package must
not import the connector where only its plugin is loaded."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any


def lazy_exports(
    package: str, homes: Mapping[str, str], namespace: dict[str, Any]
) -> Callable[[str], Any]:
    """A module `__getattr__` for `package`: `homes` maps each exported name to the submodule
    defining it; a name is imported once, then kept in the package's `namespace`."""

    def __getattr__(name: str) -> Any:
        home = homes.get(name)
        if home is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{home}"), name)
        namespace[name] = value
        return value

    return __getattr__
