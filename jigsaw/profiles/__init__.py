"""Slowdown grids shipped with jigsaw, and the user's own, addressable by name.

    name "h100/qwen3-4b" ─► user dir   <JIGSAW_PROFILE_DIR | XDG_DATA_HOME/jigsaw/profiles>/h100/qwen3-4b[.prior].json
                        └─► shipped    SHIPPED_DIR/h100/qwen3-4b[.prior].json
    a path that exists  ─► itself

    SHIPPED_DIR: the repository's top-level profiles/ (see its README for the format)
        installed from a wheel ─► jigsaw/profiles/data/   (setup.py maps profiles/ to the package jigsaw.profiles.data)
        a clone (editable)     ─► <clone>/profiles/       itself

A measured grid (`<model>.json`) is preferred over the analytic prior (`<model>.prior.json`), and
the user's directory over the shipped one, so `jigsaw profile` (which writes to the user's
directory) changes what a name means without ever touching an installed file.
"""

from __future__ import annotations

import os
from pathlib import Path


def _shipped_dir() -> Path:
    here = Path(__file__).resolve().parent
    installed = here / "data"
    return installed if installed.is_dir() else here.parents[1] / "profiles"


SHIPPED_DIR = _shipped_dir()
"""The grids installed with the package (read-only for jigsaw's own commands)."""
CPU_DEFAULT = "cpu/tiny-qwen3"
"""The CPU grid the demo and an on-demand daemon on a CPU-only node use."""
CPU_PER_CORE = "cpu/tiny-qwen3-1c"
"""The CPU grid of a device per core (`jigsaw daemon --devices` = the cores): two sub-stages
on a device time-share its core (verl's jobs on this CPU: one replica per core)."""
GPU_DEFAULT_MODEL = "qwen3-4b"
"""The model whose prior an on-demand daemon uses on a GPU node when the user names none."""


def user_dir() -> Path:
    """Where `jigsaw profile` writes measured grids by default."""
    if os.environ.get("JIGSAW_PROFILE_DIR"):
        return Path(os.environ["JIGSAW_PROFILE_DIR"])
    data = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(data) / "jigsaw" / "profiles"


def resolve(ref: str | os.PathLike) -> Path:
    """The grid file `ref` names: an existing path, else a name like "h100/qwen3-4b"."""
    path = Path(ref)
    if path.is_file():
        return path
    name = str(ref).removesuffix(".json").removesuffix(".prior")
    for root in (user_dir(), SHIPPED_DIR):
        for suffix in (".json", ".prior.json"):
            if (root / f"{name}{suffix}").is_file():
                return root / f"{name}{suffix}"
    raise FileNotFoundError(f"no slowdown grid {str(ref)!r}: neither a file nor one of the names "
                            f"{', '.join(available())} (run `jigsaw profile` to measure one)")


def available() -> list[str]:
    """Every grid name the user's and the shipped directories hold."""
    names = set()
    for root in (user_dir(), SHIPPED_DIR):
        if root.is_dir():
            names.update(str(p.relative_to(root)).removesuffix(".json").removesuffix(".prior")
                         for p in root.glob("*/*.json") if not p.name.endswith(".rejected.json"))
    return sorted(names)


def is_shipped(path: str | os.PathLike) -> bool:
    """Whether `path` is one of the installed grids."""
    try:
        return Path(path).resolve().is_relative_to(SHIPPED_DIR)
    except OSError:
        return False
