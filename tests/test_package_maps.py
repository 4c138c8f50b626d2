"""A package's __init__ docstring is its map: it names every module and sub-package it holds."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "jigsaw"
CHECKED = ("mux", "mux/model", "mux/profiling", "mux/partition", "sim")
"""Packages whose maps are complete (the others still list only some of their modules)."""


@pytest.mark.parametrize("package", CHECKED)
def test_the_package_map_names_every_module(package):
    directory = ROOT / package
    doc = ast.get_docstring(ast.parse((directory / "__init__.py").read_text())) or ""
    children = [p.stem for p in directory.glob("*.py") if p.name != "__init__.py"]
    children += [p.parent.name for p in directory.glob("*/__init__.py")]
    missing = [name for name in sorted(children) if not re.search(rf"(?<![\w.]){re.escape(name)}\b", doc)]
    assert not missing, f"jigsaw/{package}/__init__.py does not name {missing}"
