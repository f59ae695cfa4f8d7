"""The package's architecture, as its imports show it: the floors of
docs/development.md, one module for JAX's private names, and no module reaching
into another's private names."""

import ast
import pathlib

import pytest

from .doc_blocks import REPO_ROOT


PACKAGE = REPO_ROOT / "eqx_amp"

# Each part of the package, with the parts it may import (the floors below it).
FLOORS = {
    "_core": set(),
    "_jaxpr": {"_core"},
    "_optim": {"_core"},
    "_fp8": {"_core", "_jaxpr"},
    "_sharding": {"_core", "_jaxpr"},
    "_filter_amp": {"_core", "_jaxpr", "_sharding"},
    "_autocast": {"_core", "_jaxpr", "_fp8", "_sharding"},
    "_loss_scaling": {"_core", "_jaxpr", "_optim", "_sharding"},
    "_bimodel": {"_core", "_filter_amp", "_fp8", "_loss_scaling", "_optim"},
}


def _modules() -> dict[str, tuple[pathlib.Path, ast.Module]]:
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(REPO_ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = (path, ast.parse(path.read_text()))
    return modules


def _imports(name: str, path: pathlib.Path, tree: ast.Module):
    """(imported module, imported names) for every import of eqx_amp's own code."""
    here = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level > 0:
            base = here[: len(here) - (node.level - 1)]
            target = ".".join(base + ([node.module] if node.module else []))
            yield target, [alias.name for alias in node.names]


def _part(module: str) -> str:
    return module.split(".")[1] if "." in module else module


def test_each_part_imports_only_the_floors_below_it():
    modules = _modules()
    wrong = []
    for name, (path, tree) in modules.items():
        part = _part(name)
        if part not in FLOORS:
            continue  # the public namespaces re-export from every part
        for target, _ in _imports(name, path, tree):
            if _part(target) != part and _part(target) not in FLOORS[part]:
                wrong.append(f"{name} imports {target}")
    assert not wrong, wrong
    parts = {_part(name) for name in modules if _part(name).startswith("_")}
    # A new part must be given its floor here (and in docs/development.md).
    assert parts - {"_diagnostics"} == set(FLOORS), parts


def test_no_module_imports_another_modules_private_names():
    modules = _modules()
    wrong = []
    for name, (path, tree) in modules.items():
        for target, names in _imports(name, path, tree):
            if target == name:
                continue
            private = [n for n in names if n.startswith("_") and n not in modules]
            private = [n for n in private if f"{target}.{n}" not in modules]
            if private:
                wrong.append(f"{name} imports {private} from {target}")
    assert not wrong, wrong


def test_jax_internals_are_named_in_one_module():
    users = []
    for name, (path, tree) in _modules().items():
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module or ""]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            if any(n.startswith(("jax._src", "jaxlib")) for n in names):
                users.append(name)
        if "jax._src" in path.read_text() and name not in users:
            users.append(name)
    assert set(users) == {"eqx_amp._jaxpr._compat"}, users


@pytest.mark.parametrize("limit", [560])  # "about 500" (DESIGN.md)
def test_modules_are_short_enough_to_read(limit):
    long = {
        name: n
        for name, (path, _) in _modules().items()
        if (n := len(path.read_text().splitlines())) > limit
    }
    assert not long, long
