"""No import cycles in jigsaw/: between modules, and between its sub-packages.

    every jigsaw/**.py ─ast─► imports anywhere in the file (module level, inside functions,
        under `if TYPE_CHECKING:`), relative ones resolved, importlib.import_module("literal")
        ─► module graph: a ─► b when a imports b (`from p import x` is p.x when x is a module)
        ├─► strongly connected components of more than one module       ─► module cycles
        └─► contracted to second-level packages (jigsaw.mux.model.prior is jigsaw.mux,
            jigsaw.trace is itself) ─► strongly connected components      ─► package cycles

An import is counted whether or not it runs at import time: a cycle hidden inside a function
still ties the two modules together (neither can be read, moved or tested without the other).
Importing a.b.c also runs the __init__ of a and a.b; those edges are not added, each __init__
is checked as a module of its own.  The only cycles allowed are listed in ALLOWED.
"""

from __future__ import annotations

import ast
import itertools
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2] / "jigsaw"

ALLOWED: set[frozenset[str]] = set()
"""Module cycles tolerated for now, each exactly as it is (one that grows fails too): none."""

Edges = dict[str, dict[str, str]]
"""importer ─► {imported module: where (file:line of the first such import)}."""


def modules(root: Path) -> dict[str, Path]:
    """Dotted name of every module of the package at `root` (a package by its __init__)."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def import_graph(root: Path) -> Edges:
    mods = modules(root)
    edges: Edges = defaultdict(dict)
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for target in _targets(node, package):
                found = _nearest(target, mods)
                if found and found != name:
                    edges[name].setdefault(found, f"{path.relative_to(root.parent)}:{node.lineno}")
    return edges


def _targets(node: ast.AST, package: str) -> list[str]:
    """Dotted names one AST node imports (candidates: `_nearest` keeps the module part)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:  # relative: up level-1 packages from the importer's own
            up = package.split(".")[:len(package.split(".")) - (node.level - 1)]
            base = ".".join(up + ([base] if base else []))
        return [f"{base}.{a.name}" for a in node.names]
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "import_module"
            and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
        return [node.args[0].value]
    return []


def _nearest(dotted: str, mods: dict[str, Path]) -> str | None:
    """The longest prefix of `dotted` that is a module here (None: not a jigsaw import)."""
    while dotted and dotted not in mods:
        dotted = dotted.rpartition(".")[0]
    return dotted or None


def cycles(edges: Edges) -> list[frozenset[str]]:
    """Strongly connected components of more than one node (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    counter = itertools.count()
    for start in sorted(set(edges) | {b for bs in edges.values() for b in bs}):
        if start in index:
            continue
        work = [(start, iter(sorted(edges.get(start, ()))))]
        index[start] = low[start] = next(counter)
        stack.append(start)
        on_stack.add(start)
        while work:
            v, children = work[-1]
            w = next(children, None)
            if w is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = set()
                    while not comp or w != v:
                        w = stack.pop()
                        on_stack.discard(w)
                        comp.add(w)
                    if len(comp) > 1:
                        found.append(frozenset(comp))
            elif w not in index:
                index[w] = low[w] = next(counter)
                stack.append(w)
                on_stack.add(w)
                work.append((w, iter(sorted(edges.get(w, ())))))
            elif w in on_stack:
                low[v] = min(low[v], index[w])
    return found


def package_of(module: str) -> str:
    return ".".join(module.split(".")[:2])


def package_graph(edges: Edges) -> Edges:
    out: Edges = defaultdict(dict)
    for a, bs in edges.items():
        for b, where in bs.items():
            if package_of(a) != package_of(b):
                out[package_of(a)].setdefault(package_of(b), f"{a} -> {b} ({where})")
    return out


def describe(cycle: frozenset[str], edges: Edges) -> str:
    """The imports that close a cycle, one per line."""
    lines = [f"  {a} -> {b}  ({where})" for a in sorted(cycle) for b, where in sorted(edges.get(a, {}).items())
             if b in cycle]
    return "\n".join([f"cycle {sorted(cycle)}:", *lines])


GRAPH = import_graph(ROOT)


def test_no_module_cycles_but_the_allowed_ones():
    bad = [c for c in cycles(GRAPH) if c not in ALLOWED]
    assert not bad, "import cycles between modules:\n" + "\n".join(describe(c, GRAPH) for c in bad)


def test_no_cycles_between_packages():
    packages = package_graph(GRAPH)
    bad = cycles(packages)
    assert not bad, "import cycles between packages:\n" + "\n".join(describe(c, packages) for c in bad)


def test_the_rooms_of_mux_import_one_way():
    """profiling ─► partition ─► model (jigsaw/mux/__init__.py): no cycle between the rooms
    even where no two modules form one."""
    def room(m: str) -> str:
        return ".".join(m.split(".")[:3])
    rooms: Edges = defaultdict(dict)
    for a, bs in GRAPH.items():
        for b, where in bs.items():
            if a.startswith("jigsaw.mux.") and b.startswith("jigsaw.mux.") and room(a) != room(b):
                rooms[room(a)].setdefault(room(b), f"{a} -> {b} ({where})")
    assert not cycles(rooms), "\n".join(describe(c, rooms) for c in cycles(rooms))
    assert "jigsaw.mux.profiling" not in rooms["jigsaw.mux.model"] | rooms["jigsaw.mux.partition"]
    assert "jigsaw.mux.partition" not in rooms["jigsaw.mux.model"]


def test_allowed_cycles_still_exist():
    """An allowed cycle that is gone must leave ALLOWED, or it could come back unnoticed."""
    gone = ALLOWED - set(cycles(GRAPH))
    assert not gone, f"these cycles are gone: remove them from ALLOWED: {[sorted(c) for c in gone]}"


def test_the_checker_sees_imports_in_functions_relative_and_type_checking(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.b import B\n",
        "b.py": "def f():\n    from .a import x\n",  # a <-> b: one side only under TYPE_CHECKING
        "c.py": "import importlib\nimportlib.import_module('pkg.sub.d')\n",
        "sub/__init__.py": "",
        "sub/d.py": "from .. import c\n",  # c <-> sub.d: relative, and by import_module
        "e.py": "import pkg.sub\n",  # a package is its __init__: no cycle
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    edges = import_graph(pkg)
    assert set(cycles(edges)) == {frozenset({"pkg.a", "pkg.b"}), frozenset({"pkg.c", "pkg.sub.d"})}
    assert edges["pkg.e"] == {"pkg.sub": "pkg/e.py:1"}
    # second level: pkg.sub.d counts as pkg.sub, a top-level module as itself
    assert set(cycles(package_graph(edges))) == {frozenset({"pkg.a", "pkg.b"}), frozenset({"pkg.c", "pkg.sub"})}
