"""The layout docs/architecture.md draws: no import cycles, and imports pointing down the layers.

Read from the source with ``ast`` (nothing is imported): every ``import`` and ``from ...
import`` of a qllama module, at module level or inside a function (a function-level import
that only hides a cycle is a cycle), with backends/ named qllama.backends as installed.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# each package of a layer, and the layers below it that it may import (the leaves: every
# top-level module of qllama/ that is not listed here, which imports no package)
LAYERS: dict[str, set[str]] = {
    "quants": set(),
    "gguf": {"quants"},
    "backends": {"quants"},
    "runtime": {"quants", "gguf", "backends"},
    "measure": {"quants", "gguf", "backends", "runtime"},
    "study": {"quants", "gguf", "backends", "runtime", "measure", "serve"},
    "serve": {"quants", "gguf", "backends", "runtime", "measure"},
    "hf": {"quants", "gguf", "backends", "runtime", "measure"},
    "recipe": {"quants", "gguf", "backends", "runtime", "measure", "study"},
    "cli": {"quants", "gguf", "backends", "runtime", "measure", "study", "serve", "hf", "recipe"},
}
MAX_TOP_LEVEL = 12
# the top-level modules that use packages: the package's root (its public names), the
# command line's entry point (python -m qllama), and the two that build model files
TOP_LEVEL_USERS = ("qllama", "qllama.__main__", "qllama.model_files", "qllama.synthetic")


def modules() -> dict[str, Path]:
    """Every module's dotted name (as installed) and file."""
    out = {}
    for base, prefix in (
        (ROOT / "qllama", ("qllama",)),
        (ROOT / "backends", ("qllama", "backends")),
    ):
        for path in base.rglob("*.py"):
            parts = (*prefix, *path.relative_to(base).with_suffix("").parts)
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


MODULES = modules()


def imports(name: str, path: Path) -> set[str]:
    """The qllama modules ``name`` imports (a package's ``__init__`` where a name is not a
    module of its own)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        targets: list[str] = []
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            targets = [f"{base}.{a.name}" for a in node.names]  # a module, or a name in base
        elif isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        for t in targets:
            while t and t not in MODULES:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


GRAPH = {name: imports(name, path) for name, path in MODULES.items()}


def layer(name: str) -> str:
    """The layer of a module: its package under qllama (or "" for a top-level module)."""
    parts = name.split(".")
    return parts[1] if len(parts) > 2 or name in {f"qllama.{p}" for p in LAYERS} else ""


def test_no_module_imports_one_that_imports_it_back() -> None:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_imports_point_down_the_layers() -> None:
    wrong = []
    for name, deps in GRAPH.items():
        mine = layer(name)
        for dep in deps:
            theirs = layer(dep)
            if not theirs or theirs == mine:
                continue  # a leaf, or a neighbour in the same package
            if mine == "" and name not in TOP_LEVEL_USERS:
                wrong.append((name, dep))  # a leaf imports no package
            elif mine and theirs not in LAYERS[mine]:
                wrong.append((name, dep))
    assert not wrong, f"imports against the layers: {sorted(wrong)}"


def test_the_package_root_stays_small() -> None:
    top = [p.name for p in (ROOT / "qllama").glob("*.py") if p.name != "__init__.py"]
    assert len(top) <= MAX_TOP_LEVEL, sorted(top)


def test_the_wheel_lists_every_package():
    """pyproject.toml names its packages one by one: a new one left out would import from a
    checkout and be missing from the installed wheel."""
    import tomllib

    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    packages = {name for name, path in MODULES.items() if path.name == "__init__.py"}
    assert packages == listed
