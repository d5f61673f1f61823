"""Imports between the ``tpu_train`` layers point down only (docs/architecture.md, "Layers").

    ops < device < compile < distributed < parallel < models, data < planning < trainer
        < recipes, cli

Every module of the package is parsed with ``ast``; every ``import`` / ``from ... import`` at
any depth counts, including lazy imports inside functions (a lazy import is still a
dependency: it only moves the cycle to run time). A module may import its own layer and any
layer below it; an edge to a higher layer fails with ``file:line`` and the edge.

Entry shims:

* ``tpu_train/__init__.py`` runs before any submodule (importing ``tpu_train.x`` imports the
  package first), so it must stay below everything it is imported with: it may import only the
  layers every ``import tpu_train`` needs (ops, device, and distributed for the ``tpu``
  ProcessGroup). Its layer is ``distributed``, so ``import tpu_train`` (the bare package,
  e.g. for ``tpu_train.device(0)``) is allowed from ``distributed`` up and flagged below it.
* ``tpu_train/startup.py`` is what ``tpu_train/__init__.py`` starts for the command line
  before torch is imported (the backend's early open), and ``tpu_train/api.py`` what it
  imports (torch, the ``tpu`` device: at once, except in the command's own process until its
  configuration is valid); both sit beside it, in its layer.
* ``tpu_train/launch.py`` (``python -m tpu_train.launch``) only forwards to the distributed
  launcher; it is an entry point like ``cli.py``, so it sits at the top (only the other
  entry points could import it).

``planning`` (``tpu-train plan``: the analytic model and XLA's analysis of the compiled step
for a named model config) sits above ``parallel`` and ``models``, whose plans and models it
plans, and below the trainer.

No exceptions: ``parallel`` derives plans from a model family's table of parameter roles
without importing ``models``; the family (``tpu_train.models.ModelFamily``) reaches it as a
value from the layers above (the trainer, the planner). ``models`` stays pure PyTorch and
imports no other layer, which this file asserts as well.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = "tpu_train"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE

LAYERS: dict[str, int] = {
    "ops": 0,
    "device": 1,
    "compile": 2,
    "distributed": 3,
    "__init__": 3,  # the package itself (see the module docstring)
    "startup": 3,  # what the package starts for the command line, before torch is imported
    "api": 3,  # what ``import tpu_train`` imports (the command line: once its config is valid)
    "parallel": 4,
    "models": 5,
    "data": 5,
    "planning": 6,
    "trainer": 7,
    "recipes": 8,
    "cli": 8,
    "launch": 8,
}

# Layers that must import nothing else from the package.
LEAVES = ("models",)


def _module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_module(name: str, root: Path) -> bool:
    path = root.parent.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _imported_modules(node: ast.AST, module: str, is_package: bool, root: Path) -> list[str]:
    """The ``tpu_train`` modules one import statement names (``from a import b`` names
    ``a.b`` when that is a module, else ``a``)."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:  # relative: resolve against this module's package
        base = module.split(".") if is_package else module.split(".")[:-1]
        base = base[:len(base) - (node.level - 1)]
        source = ".".join(base + ([node.module] if node.module else []))
    else:
        source = node.module or ""
    return [f"{source}.{a.name}" if _is_module(f"{source}.{a.name}", root) else source
            for a in node.names]


def layer_of(module: str) -> str:
    """The layer a ``tpu_train`` module belongs to (its top-level subpackage or module)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def import_edges(root: Path = ROOT, under: Path | None = None):
    """``(file, line, importing module, imported module)`` for every in-package import of
    the files under ``under`` (default: the whole package at ``root``)."""
    for path in sorted((under or root).rglob("*.py")):
        module = _module_name(path, root)
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            for target in _imported_modules(node, module, path.name == "__init__.py", root):
                if target == PACKAGE or target.startswith(PACKAGE + "."):
                    yield path, node.lineno, module, target


def upward_edges(root: Path = ROOT) -> list[str]:
    found = []
    for path, line, source, target in import_edges(root):
        src, dst = layer_of(source), layer_of(target)
        if src == dst:
            continue
        if src not in LAYERS or dst not in LAYERS:
            found.append(f"{path.relative_to(root.parent)}:{line}: {source} -> {target} "
                         f"(a layer missing from LAYERS: {src if src not in LAYERS else dst})")
        elif LAYERS[dst] > LAYERS[src]:
            found.append(f"{path.relative_to(root.parent)}:{line}: {source} -> {target} "
                         f"({src} imports {dst}, a higher layer)")
    return found


def test_imports_point_down_only():
    found = upward_edges()
    assert not found, "upward imports:\n" + "\n".join(found)


@pytest.mark.parametrize("leaf", LEAVES)
def test_leaf_layers_import_no_other_layer(leaf):
    found = [f"{path.relative_to(ROOT.parent)}:{line}: {source} -> {target}"
             for path, line, source, target in import_edges(ROOT, ROOT / leaf)
             if layer_of(target) != leaf]
    assert not found, f"{leaf} must stay pure PyTorch:\n" + "\n".join(found)


def test_every_top_level_part_has_a_layer():
    parts = {p.stem for p in ROOT.glob("*.py")}
    parts |= {p.parent.name for p in ROOT.glob("*/__init__.py")}
    assert parts <= set(LAYERS), f"give these a layer in LAYERS: {sorted(parts - set(LAYERS))}"


def test_an_upward_import_is_caught(tmp_path):
    """The check itself: a lazy upward import inside a function is reported with its line."""
    package = tmp_path / PACKAGE
    (package / "ops").mkdir(parents=True)
    (package / "trainer").mkdir()
    for init in (package / "__init__.py", package / "ops" / "__init__.py",
                 package / "trainer" / "__init__.py"):
        init.write_text("")
    (package / "ops" / "bad.py").write_text("def f():\n    from ..trainer import loop\n")
    (package / "trainer" / "loop.py").write_text("from tpu_train.ops import bad\n")
    found = upward_edges(package)
    assert len(found) == 1 and found[0].startswith(
        "tpu_train/ops/bad.py:2: tpu_train.ops.bad -> tpu_train.trainer.loop"), found
