"""Imports flow downwards (serve/decode/train -> serving -> inference -> models -> layers -> ops):
no package imports one above it (`BELOW`), no command imports another (`APART`), and no chain
of k3text modules imports itself (imports inside functions included); every k3text import in
the repository is absolute and names a module that exists. Checked on the source, and in a
fresh interpreter that imports every module."""

import ast
import json
import os
import subprocess
import sys

from helpers import ROOT

SRC = ROOT / "src"
# Package prefix -> prefixes its modules must never import.
_ENTRY_POINTS = ("k3text.decode", "k3text.serve", "k3text.train", "k3text.tools")
BELOW = {
    "k3text.ops": ("k3text.layers", "k3text.models", "k3text.inference", "k3text.serving",
                   "k3text.checkpoint", *_ENTRY_POINTS),
    "k3text.layers": ("k3text.models", "k3text.inference", "k3text.serving",
                      "k3text.checkpoint", *_ENTRY_POINTS),
    "k3text.models": ("k3text.inference", "k3text.serving", "k3text.checkpoint",
                      *_ENTRY_POINTS),
    "k3text.inference": ("k3text.serving", *_ENTRY_POINTS),
    "k3text.serving": _ENTRY_POINTS,
}
# The commands share what they need through the library, never through each other.
APART = {
    "k3text.decode": ("k3text.serve", "k3text.train"),
    "k3text.serve": ("k3text.decode", "k3text.train"),
    "k3text.train": ("k3text.decode", "k3text.serve"),
}


def modules() -> dict[str, ast.Module]:
    """{dotted name: parsed source} of every k3text module."""
    found = {}
    for path in sorted((SRC / "k3text").rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = ast.parse(path.read_text(encoding="utf-8"), str(path))
    return found


def imported(sources: dict[str, ast.Module]) -> dict[str, set[str]]:
    """{module: k3text names its import statements import from, wherever they stand}."""
    found = {}
    for name, tree in sources.items():
        targets = set()
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                targets |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                # `from package import module` names the module; otherwise the package.
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    targets.add(full if full in sources else node.module)
        found[name] = {t for t in targets if is_under(t, "k3text") and t != name}
    return found


def import_graph() -> dict[str, set[str]]:
    """{module: k3text modules it imports}."""
    sources = modules()
    return {name: targets & sources.keys() for name, targets in imported(sources).items()}


def closure(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for target in graph[todo.pop()] - seen:
            seen.add(target)
            todo.append(target)
    return seen


def is_under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_every_import_names_a_module_that_exists():
    """In the package, tests, benchmarks and tools, lazy imports included: a moved module
    leaves no stale import behind."""
    sources = modules()
    users = {str(path.relative_to(ROOT)): ast.parse(path.read_text(encoding="utf-8"))
             for folder in ("tests", "benchmarks", "tools")
             for path in (ROOT / folder).rglob("*.py")}
    missing = sorted((name, target) for name, targets in imported({**sources, **users}).items()
                     for target in targets if target not in sources)
    assert missing == []


def test_imports_are_absolute():
    """The checks here read absolute names; a relative import would pass them unseen."""
    relative = sorted(name for name, tree in modules().items() for node in ast.walk(tree)
                      if isinstance(node, ast.ImportFrom) and node.level)
    assert relative == []


def test_imports_flow_downwards_in_the_source():
    graph = import_graph()
    wrong = sorted(
        (name, target) for name in graph for top, banned in (BELOW | APART).items()
        if is_under(name, top)
        for target in closure(graph, name) if any(is_under(target, b) for b in banned))
    assert wrong == []


def test_no_import_cycles():
    graph = import_graph()
    # A package's __init__ importing its own submodules is how packages are built, not a loop.
    graph = {name: {t for t in targets if not is_under(t, name)} for name, targets in graph.items()}
    cycles = sorted(name for name in graph if name in closure(graph, name))
    assert cycles == []


def test_fresh_interpreter_imports_every_module_in_layer_order():
    names = sorted(modules())
    script = f"""
import importlib, json, sys
names = {names!r}
loaded = {{}}
for phase, prefix in {[(top, top) for top in BELOW] + [("all", "k3text")]!r}:
    for name in names:
        if name == prefix or name.startswith(prefix + "."):
            importlib.import_module(name)
    loaded[phase] = sorted(m for m in sys.modules if m.startswith("k3text"))
print(json.dumps(loaded))
"""
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"},
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    loaded = json.loads(run.stdout.splitlines()[-1])
    for top, banned_below in BELOW.items():  # each package alone, in layer order
        banned = [m for m in loaded[top] if any(is_under(m, b) for b in banned_below)]
        assert banned == [], top
    assert set(names) <= set(loaded["all"])
