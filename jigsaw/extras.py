"""Optional dependencies: the extra that installs each, and the one error that names it.

    pip install jigsaw              the scheduler library, the simulator, the daemon, `jigsaw run`
    pip install 'jigsaw[cpu]'       + the CPU engines and recipes (`jigsaw demo`, `jigsaw profile --device cpu`)
    pip install 'jigsaw[gpu]'       + green contexts, NVML, `jigsaw doctor`, `jigsaw profile --device cuda`
    pip install 'jigsaw[timeline]'  + `jigsaw timeline` as PNG or HTML
    pip install 'jigsaw[verl]'      + the verl integration
    pip install 'jigsaw[logs]'      + parquet logs for `jigsaw sim --lengths-from`
    pip install 'jigsaw[cluster]'   + the cluster controller on Ray (jigsaw/cluster/controller.py)

    require("cpu", "jigsaw demo") ─► None, or MissingExtra("jigsaw demo needs torch, psutil, which are not
                                      installed: pip install 'jigsaw[cpu]'")

A command checks its extra before it starts, so a user without it reads what to install instead of
a traceback from deep inside a worker.  `tests/integration/test_extras.py` checks that pyproject.toml's extras
install every module listed here.
"""

from __future__ import annotations

import importlib.util

MODULES = {
    "cpu": ("torch", "transformers", "reasoning_gym", "psutil", "matplotlib"),
    "gpu": ("torch", "cuda.bindings", "pynvml"),
    "timeline": ("matplotlib",),
    "verl": ("verl", "torch", "transformers", "psutil"),
    "logs": ("pyarrow",),
    "cluster": ("ray",),
}
"""Extra -> the modules jigsaw imports from it."""
DISTRIBUTIONS = {"reasoning_gym": "reasoning-gym", "cuda.bindings": "cuda-python", "pynvml": "nvidia-ml-py"}
"""Module -> the distribution that installs it, where the names differ."""


class MissingExtra(ImportError):
    """An optional dependency is not installed; the message names the extra that installs it."""


def missing(extra: str) -> list[str]:
    """The modules of `extra` that cannot be imported here (found, never imported)."""
    return [m for m in MODULES[extra] if not _found(m)]


def require(extra: str, what: str, otherwise: str = "") -> None:
    """Raise MissingExtra, saying what to install (and `otherwise`, what works without it), unless
    every module of `extra` is installed."""
    absent = missing(extra)
    if absent:
        names = ", ".join(DISTRIBUTIONS.get(m, m) for m in absent)
        verb = "is" if len(absent) == 1 else "are"
        raise MissingExtra(f"{what} needs {names}, which {verb} not installed: pip install 'jigsaw[{extra}]'"
                           + (f"; {otherwise}" if otherwise else ""))


def _found(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package missing or broken
        return False
