"""Every package's `__init__` docstring is a map of its rooms: it names each of its modules
and sub-packages, so a newcomer reading it finds every file (and a file nobody listed fails)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "jigsaw"
PACKAGES = sorted(p.parent for p in ROOT.rglob("__init__.py") if "__pycache__" not in p.parts)


@pytest.mark.parametrize("directory", PACKAGES, ids=lambda p: str(p.relative_to(ROOT.parent)))
def test_the_package_map_names_every_module(directory: Path):
    doc = ast.get_docstring(ast.parse((directory / "__init__.py").read_text())) or ""
    children = [p.stem for p in directory.glob("*.py") if p.name != "__init__.py"]
    children += [p.parent.name for p in directory.glob("*/__init__.py")]
    missing = [name for name in sorted(children) if not re.search(rf"(?<![\w.]){re.escape(name)}\b", doc)]
    assert not missing, f"{directory.relative_to(ROOT.parent)}/__init__.py does not name {missing}"
