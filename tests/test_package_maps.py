"""Every package's `__init__` docstring is a map of its rooms: it names each of its modules
and sub-packages, so a newcomer reading it finds every file (and a file nobody listed fails)."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "jigsaw"
PACKAGES = sorted(p.parent for p in PACKAGE.rglob("__init__.py") if "__pycache__" not in p.parts)


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: str(p.relative_to(PACKAGE.parent)))
def test_the_package_docstring_names_every_module(package: Path):
    doc = ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""
    rooms = [p.name for p in package.glob("*.py") if p.name != "__init__.py"]
    rooms += [p.name + "/" for p in package.iterdir() if (p / "__init__.py").exists()]
    missing = [r for r in sorted(rooms) if r not in doc and r.removesuffix("/") + "/" not in doc]
    assert not missing, f"{package.relative_to(PACKAGE.parent)}/__init__.py does not name {missing}"
