"""Imports go down the layers of docs/architecture.md, never up or across: drivers never
import the store, the core never imports torch or the conformance suite."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "ckptstore"

FOUNDATION = "foundation"
COMMIT = "commit strategies"
BACKENDS = "backends"
CORE = "core"
TORCH = "torch adapter"
JAX = "jax adapter"
TRAINERS = "trainer adapters"
TOOLING = "tooling"

LAYERS: dict[str, tuple[str, ...]] = {
    FOUNDATION: (
        "errors", "names", "urls", "redaction", "checksum", "driver", "manifest", "hint",
        "retention", "lineage", "jsonload", "filekind", "digest", "signing", "shardbytes",
        "safetensors_layout",
    ),
    COMMIT: ("commit",),
    BACKENDS: ("backends",),
    CORE: (
        "checkpoint", "pending", "publisher", "store", "history", "fencing", "registry",
        "interval", "tiers", "replication", "tiered", "epoch_repair", "interface", "sharing",
        "coordinated", "background_saves", "",
    ),
    TORCH: ("torch",),
    JAX: ("jax",),
    TRAINERS: ("adapters", "directory", "huggingface", "lightning"),
    TOOLING: (
        "conformance", "cli", "tools",
    ),
}  # fmt: skip
"""Each module of the package, by its first dotted component under ``ckptstore`` ("" is the
package's ``__init__``). ``directory``, ``huggingface``, ``lightning``, ``tiered`` and
``replication`` at the top are the import paths users know for modules of ``adapters/`` and
``tiers/``."""

MAY_IMPORT: dict[str, frozenset[str]] = {
    FOUNDATION: frozenset({FOUNDATION}),
    COMMIT: frozenset({FOUNDATION, COMMIT}),
    BACKENDS: frozenset({FOUNDATION, COMMIT, BACKENDS}),
    CORE: frozenset({FOUNDATION, COMMIT, CORE}),
    TORCH: frozenset({FOUNDATION, CORE, TORCH}),
    JAX: frozenset({FOUNDATION, CORE, JAX}),
    TRAINERS: frozenset({FOUNDATION, CORE, TORCH, TRAINERS}),
    TOOLING: frozenset(LAYERS),
}
"""Which layers a layer's modules may import, even lazily inside a function."""

FORBIDDEN_PACKAGES: dict[str, frozenset[str]] = {
    FOUNDATION: frozenset({"torch", "jax", "hypothesis", "pytest", "boto3", "botocore"}),
    COMMIT: frozenset({"torch", "jax", "hypothesis", "pytest", "boto3", "botocore"}),
    CORE: frozenset({"torch", "jax", "hypothesis", "pytest", "boto3", "botocore"}),
    BACKENDS: frozenset({"torch", "jax", "hypothesis", "pytest"}),
    TORCH: frozenset({"jax", "hypothesis", "pytest"}),
    JAX: frozenset({"torch", "hypothesis", "pytest", "boto3", "botocore"}),
    TRAINERS: frozenset({"jax", "hypothesis", "pytest", "boto3", "botocore"}),
}
"""Third-party packages a layer must never import (torch and JAX stay optional, and neither
adapter needs the other; the suite's tools stay out of the library)."""


def _layer_of(module: str) -> str:
    """The layer of ``ckptstore.<module>``."""
    head = module.split(".")[0] if module else ""
    for layer, heads in LAYERS.items():
        if head in heads:
            return layer
    raise AssertionError(f"ckptstore.{module} belongs to no layer: add it to LAYERS")


def _modules(root: Path = PACKAGE) -> list[tuple[str, Path]]:
    found = []
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found.append((".".join(parts), path))
    return found


def _imports(path: Path, module: str) -> list[tuple[int, str]]:
    """Every module ``path`` imports, anywhere in it, as absolute dotted names."""
    names = []
    parts = [part for part in module.split(".") if part]
    package = parts if path.name == "__init__.py" else parts[:-1]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = ["ckptstore", *package][: len(package) + 2 - node.level]
                origin = ".".join([*base, *filter(None, [node.module])])
            elif node.module:
                origin = node.module
            else:
                continue
            # ``from ckptstore.pkg import module`` imports that module, not only the package
            names.extend((node.lineno, _submodule(origin, alias.name)) for alias in node.names)
    return names


def _submodule(package: str, name: str) -> str:
    """``package.name`` where that is a module of ckptstore, else ``package``."""
    if package.split(".")[0] == "ckptstore":
        path = PACKAGE.joinpath(*package.split(".")[1:], name)
        if path.with_suffix(".py").is_file() or (path / "__init__.py").is_file():
            return f"{package}.{name}"
    return package


def _violations(root: Path = PACKAGE) -> list[str]:
    found = []
    for module, path in _modules(root):
        layer = _layer_of(module)
        for line, imported in _imports(path, module):
            top = imported.split(".")[0]
            where = f"ckptstore/{path.relative_to(root)}:{line}"
            if top == "ckptstore":
                target = _layer_of(imported.removeprefix("ckptstore").lstrip("."))
                if target not in MAY_IMPORT[layer]:
                    found.append(f"{where}: {layer} imports {imported} ({target})")
            elif top in FORBIDDEN_PACKAGES.get(layer, frozenset()):
                found.append(f"{where}: {layer} imports {imported}")
    return found


def test_imports_go_down_the_layers() -> None:
    assert _violations() == []


def test_every_module_has_a_layer() -> None:
    for module, _ in _modules():
        _layer_of(module)


@pytest.mark.parametrize(
    ("module", "source", "expected"),
    [
        ("backends/posix.py", "from ckptstore.store import Store\n", "backends imports"),
        ("store.py", "def f():\n    import torch\n", "core imports torch"),
        ("store.py", "import jax\n", "core imports jax"),
        ("jax/save.py", "from ckptstore.torch import codec\n", "jax adapter imports"),
        ("store.py", "from ckptstore.conformance import model\n", "core imports"),
        ("pending.py", "from ckptstore.backends import s3\n", "core imports"),
        ("commit/rename.py", "from ..store import Store\n", "ckptstore.store (core)"),
        ("commit/rename.py", "from ckptstore import store\n", "ckptstore.store (core)"),
        ("backends/posix.py", "from ckptstore import store\n", "ckptstore.store (core)"),
    ],
)
def test_a_wrong_way_import_is_caught(
    module: str, source: str, expected: str, tmp_path: Path
) -> None:
    fake = tmp_path / "ckptstore"
    for _, path in _modules():
        target = fake / path.relative_to(PACKAGE)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(path.read_text())
    broken = fake / module
    broken.write_text(broken.read_text() + "\n" + source)
    assert _violations(PACKAGE) == []
    found = _violations(fake)
    assert len(found) == 1 and expected in found[0], found
