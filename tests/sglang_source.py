"""SGLang's source read from its wheel with `ast`, for contract tests on machines where sglang cannot import.

    $JIGSAW_SGLANG_WHEEL, else <repo>/.wheels/sglang-<version>-*.whl, else `pip download` into .wheels/
        (the first run; under a lock, so parallel runs fetch it once) ─► zipfile ─► ast.Module per file
    check(module, contract) ─► list of problems ([] when SGLang still has what jigsaw hooks)

A contract is (kind, file, dotted target, expectation); `check` returns a problem naming the target when
the name is gone, renamed, or has other leading parameters, so a drifted SGLang fails the test that names it.
No wheel and no way to fetch one is WheelUnavailable, which says how to provide it offline: the contract
tests fail then, they never skip, so `python -m pytest -q` runs them on a fresh clone as CI does.
"""

from __future__ import annotations

import ast
import fcntl
import functools
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

SGLANG_VERSION = "0.5.12"
REPO = Path(__file__).resolve().parent.parent
WHEELS = REPO / ".wheels"
"""Where the fetched wheel is kept (ignored by git)."""
FETCH = (sys.executable, "-m", "pip", "download", "--no-deps", f"sglang=={SGLANG_VERSION}", "-d")
"""The download, completed with a directory."""
FETCH_TIMEOUT_S = 45.0
"""Below the contract tests' 60 s limit, so a stalled download fails with the offline hint, not a timeout."""
OFFLINE_HINT = (f"to provide the wheel offline, fetch it where PyPI is reachable "
                f"(pip download --no-deps sglang=={SGLANG_VERSION} -d DIR) and set JIGSAW_SGLANG_WHEEL to the .whl, "
                f"or put it in {WHEELS}")


class WheelUnavailable(RuntimeError):
    """The pinned wheel is neither given, nor in .wheels/, nor downloadable; the message says what to do."""


def find_wheel(wheels: Path = WHEELS, fetch: tuple[str, ...] = FETCH) -> Path:
    """The pinned wheel: $JIGSAW_SGLANG_WHEEL, else the one in `wheels`, downloaded there the first time."""
    env = os.environ.get("JIGSAW_SGLANG_WHEEL")
    if env:
        if not Path(env).is_file():
            raise WheelUnavailable(f"JIGSAW_SGLANG_WHEEL={env} is not a file; {OFFLINE_HINT}")
        return Path(env)
    if found := _kept(wheels):
        return found
    wheels.mkdir(parents=True, exist_ok=True)
    with open(wheels / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        return _kept(wheels) or _download(wheels, fetch)  # a run we waited for may have fetched it


def _kept(wheels: Path) -> Path | None:
    found = sorted(wheels.glob(f"sglang-{SGLANG_VERSION}-*.whl"))
    return found[-1] if found else None


def _download(wheels: Path, fetch: tuple[str, ...]) -> Path:
    """Download into a private directory, then move the wheel in: a killed run leaves no partial wheel."""
    with tempfile.TemporaryDirectory(dir=wheels, prefix=".download-") as tmp:
        said = " ".join(fetch)
        try:
            done = subprocess.run([*fetch, tmp], capture_output=True, text=True, timeout=FETCH_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            raise WheelUnavailable(f"`{said}` did not finish in {FETCH_TIMEOUT_S:g} s; {OFFLINE_HINT}") from None
        got = _kept(Path(tmp))
        if done.returncode != 0 or got is None:
            why = (done.stderr.strip().splitlines() or [f"exit {done.returncode}, no wheel"])[-1]
            raise WheelUnavailable(f"`{said}` failed ({why}); {OFFLINE_HINT}")
        os.replace(got, wheels / got.name)
    return wheels / got.name


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
