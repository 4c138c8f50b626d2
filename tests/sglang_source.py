"""SGLang's source read from its wheel with `ast`, for contract tests on machines where sglang cannot import.

    $JIGSAW_SGLANG_WHEEL or <repo>/.wheels/sglang-<version>-*.whl ─► zipfile ─► ast.Module per file
    check(module, contract) ─► list of problems ([] when SGLang still has what jigsaw hooks)

A contract is (kind, file, dotted target, expectation); `check` returns a problem naming the target when
the name is gone, renamed, or has other leading parameters, so a drifted SGLang fails the test that names it.
"""

from __future__ import annotations

import ast
import functools
import glob
import os
import zipfile
from dataclasses import dataclass
from pathlib import Path

SGLANG_VERSION = "0.5.12"
REPO = Path(__file__).resolve().parent.parent
FETCH_HINT = f"pip download --no-deps sglang=={SGLANG_VERSION} -d .wheels"


def find_wheel() -> Path | None:
    env = os.environ.get("JIGSAW_SGLANG_WHEEL")
    if env:
        return Path(env) if Path(env).is_file() else None
    found = sorted(glob.glob(str(REPO / ".wheels" / f"sglang-{SGLANG_VERSION}-*.whl")))
    return Path(found[-1]) if found else None


@functools.cache
def parse(wheel: Path, file: str) -> ast.Module:
    with zipfile.ZipFile(wheel) as zf:
        return ast.parse(zf.read(file), filename=file)


@dataclass(frozen=True, kw_only=True)
class Contract:
    kind: str
    """def: leading parameter names; base: a base class name; calls: a function called in the body;
    uses: a name or attribute read in the body; const: a module constant's value; field: an annotated
    class field; member: an enum member's assignment; selfattr: `self.<name> = ...` in the method;
    decorated: a decorator name."""
    file: str
    target: str
    expect: object

    @property
    def id(self) -> str:
        if self.kind == "def":
            return f"def:{self.target}({','.join(self.expect)})"
        return f"{self.kind}:{self.target}:{self.expect}"


def _find(node: ast.AST, name: str) -> ast.AST | None:
    for child in getattr(node, "body", []):
        if isinstance(child, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and child.name == name:
            return child
    return None


def resolve(module: ast.Module, dotted: str) -> ast.AST | None:
    node: ast.AST | None = module
    for part in dotted.split("."):
        node = _find(node, part) if node is not None else None
    return node


def _names_in(node: ast.AST) -> set[str]:
    out = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name):
            out.add(sub.id)
        elif isinstance(sub, ast.Attribute):
            out.add(sub.attr)
    return out


def _calls_in(node: ast.AST) -> set[str]:
    calls = [sub.func for sub in ast.walk(node) if isinstance(sub, ast.Call)]
    return {f.id if isinstance(f, ast.Name) else f.attr for f in calls if isinstance(f, ast.Name | ast.Attribute)}


def _class_level(module: ast.Module, target: str) -> tuple[ast.ClassDef | None, str]:
    owner, _, name = target.rpartition(".")
    cls = resolve(module, owner)
    return (cls if isinstance(cls, ast.ClassDef) else None), name


def check(module: ast.Module, c: Contract) -> list[str]:
    if c.kind == "const":
        values = [n.value for n in module.body if isinstance(n, ast.Assign)
                  and any(isinstance(t, ast.Name) and t.id == c.target for t in n.targets)]
        ok = any(isinstance(v, ast.Constant) and v.value == c.expect for v in values)
        return [] if ok else [f"{c.file}: no module constant {c.target} = {c.expect!r}"]
    if c.kind in ("field", "member"):
        cls, name = _class_level(module, f"{c.target}.{c.expect}")
        body = cls.body if cls else []
        if c.kind == "field":
            ok = any(isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name) and n.target.id == name
                     for n in body)
        else:
            ok = any(isinstance(n, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in n.targets)
                     for n in body)
        return [] if ok else [f"{c.file}: class {c.target} has no {c.kind} {c.expect}"]
    node = resolve(module, c.target)
    if node is None:
        return [f"{c.file}: {c.target} not found"]
    if c.kind == "def":
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            return [f"{c.file}: {c.target} is not a function"]
        params = tuple(a.arg for a in node.args.posonlyargs + node.args.args)
        want = tuple(c.expect)
        return [] if params[:len(want)] == want else [f"{c.file}: {c.target}{params} does not start with {want}"]
    if c.kind == "base":
        bases = {b.id if isinstance(b, ast.Name) else getattr(b, "attr", "") for b in getattr(node, "bases", [])}
        return [] if c.expect in bases else [f"{c.file}: {c.target} bases {sorted(bases)} lack {c.expect}"]
    if c.kind == "decorated":
        names = _names_in(ast.Module(body=[ast.Expr(d) for d in node.decorator_list], type_ignores=[]))
        return [] if c.expect in names else [f"{c.file}: {c.target} not decorated with {c.expect}"]
    if c.kind == "calls":
        return [] if c.expect in _calls_in(node) else [f"{c.file}: {c.target} does not call {c.expect}()"]
    if c.kind == "uses":
        return [] if c.expect in _names_in(node) else [f"{c.file}: {c.target} does not use {c.expect}"]
    if c.kind == "selfattr":
        assigned = {t.attr for sub in ast.walk(node) if isinstance(sub, ast.Assign | ast.AnnAssign)
                    for t in (sub.targets if isinstance(sub, ast.Assign) else [sub.target])
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
        return [] if c.expect in assigned else [f"{c.file}: {c.target} does not set self.{c.expect}"]
    raise ValueError(f"unknown contract kind {c.kind!r}")


def module_file(dotted_module: str) -> str:
    return dotted_module.replace(".", "/") + ".py"


def resolve_method(wheel: Path, dotted: str) -> tuple[str, str] | None:
    """Where `pkg.mod.Class.method` is defined, following `from X import Base` bases; (file, Class.method)."""
    module_path, cls_name, method = dotted.rsplit(".", 2)
    return _resolve_in(wheel, module_file(module_path), cls_name, method, depth=3)


def _resolve_in(wheel: Path, file: str, cls_name: str, method: str, depth: int) -> tuple[str, str] | None:
    try:
        module = parse(wheel, file)
    except KeyError:
        return None
    cls = resolve(module, cls_name)
    if not isinstance(cls, ast.ClassDef):
        return None
    if isinstance(_find(cls, method), ast.FunctionDef):
        return file, f"{cls_name}.{method}"
    if depth == 0:
        return None
    imported = {alias.asname or alias.name: node.module for node in module.body if isinstance(node, ast.ImportFrom)
                and node.module for alias in node.names}
    for base in cls.bases:
        name = base.id if isinstance(base, ast.Name) else None
        where = module_file(imported[name]) if name in imported else file
        found = _resolve_in(wheel, where, name, method, depth - 1) if name else None
        if found:
            return found
    return None
