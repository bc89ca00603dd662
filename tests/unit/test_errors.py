"""Every exception flexkv-py raises on purpose is a `FlexKVError`; the tree is documented."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path
from types import ModuleType

import pytest

import flexkv_py
from flexkv_py import _native, errors
from flexkv_py.errors import FlexKVError

PACKAGE = Path(flexkv_py.__file__).parent

# Classes whose owners re-parent them on their own branches; the lead empties this at
# merge. Each name must still exist and still be outside the tree, so the list cannot go stale.
PENDING_REPARENT: set[str] = set()


def _exception_classes(module: ModuleType) -> dict[str, type[BaseException]]:
    return {
        name: obj
        for name in dir(module)
        if isinstance(obj := getattr(module, name), type) and issubclass(obj, BaseException)
    }


@pytest.mark.parametrize("module", [flexkv_py, errors, _native], ids=lambda m: m.__name__)
def test_every_exported_exception_is_a_flexkv_error(module: ModuleType) -> None:
    found = _exception_classes(module)
    assert found, f"{module.__name__} exports no exception class"
    outside = sorted(name for name, cls in found.items() if not issubclass(cls, FlexKVError))
    assert outside == []


def _defined_exceptions() -> list[tuple[str, str]]:
    """(module, class) for every public class in the package whose base names an error."""
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in tree.body:
            if not isinstance(node, ast.ClassDef) or node.name.startswith("_"):
                continue
            bases = [ast.unparse(b) for b in node.bases]
            if any(b.endswith(("Error", "Exception")) for b in bases):
                rel = path.relative_to(PACKAGE.parent).with_suffix("")
                out.append((".".join(rel.parts), node.name))
    return out


def test_every_exception_defined_in_the_package_is_a_flexkv_error() -> None:
    defined = _defined_exceptions()
    assert ("flexkv_py.errors", "ClosedError") in defined  # the scan sees the package
    outside = []
    for module_name, name in defined:
        cls = getattr(importlib.import_module(module_name), name)
        qualified = f"{module_name}.{name}"
        if qualified in PENDING_REPARENT:
            continue
        if not issubclass(cls, FlexKVError):
            outside.append(qualified)
    assert outside == []
    for qualified in PENDING_REPARENT:
        module_name, name = qualified.rsplit(".", 1)
        cls = getattr(importlib.import_module(module_name), name)
        assert not issubclass(cls, FlexKVError), f"{qualified} is re-parented: drop it here"


def test_the_documented_tree_names_every_class() -> None:
    doc = errors.__doc__ or ""
    for name in errors.__all__:
        assert name in doc, f"{name} is missing from the tree in flexkv_py/errors.py"


@pytest.mark.parametrize(
    ("cls", "builtin"),
    [
        (errors.ConfigError, ValueError),
        (errors.UnsupportedKVLayoutError, ValueError),
        (errors.TraceFormatError, ValueError),
        (errors.TransferError, RuntimeError),
        (errors.InternalStateError, RuntimeError),
        (errors.ClosedError, RuntimeError),
        (errors.IoEngineError, OSError),
        (errors.BlockNotFoundError, KeyError),
    ],
)
def test_builtin_second_bases_stay(cls: type[Exception], builtin: type[Exception]) -> None:
    # Callers that caught the builtin before the tree existed still catch these.
    assert issubclass(cls, FlexKVError) and issubclass(cls, builtin)


def test_the_transfer_and_cli_names_are_the_tree_classes() -> None:
    from flexkv_py.cli.workloads import TraceFormatError
    from flexkv_py.transfer.errors import TransferError, UnsupportedKVLayoutError

    assert TransferError is errors.TransferError
    assert UnsupportedKVLayoutError is errors.UnsupportedKVLayoutError
    assert TraceFormatError is errors.TraceFormatError
    err = TransferError("d2h failed", direction="d2h", block_ids=(1, 2))
    assert (err.direction, err.block_ids, str(err)) == ("d2h", (1, 2), "d2h failed")
