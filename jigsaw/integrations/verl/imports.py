"""Run a function right after a module is first imported (Python has no post-import hook).

    after_import("verl.trainer.ppo.v1.trainer_sync", fn)
        already imported ─► fn(module) now
        otherwise ─► a finder in front of sys.meta_path wraps that module's loader once:
                     exec_module(module) ─► fn(module)

It lets a process patch verl only where verl's trainer is actually loaded (the trainer's Ray
actor), without importing the trainer into every Ray worker.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
from collections.abc import Callable

log = logging.getLogger("jigsaw.verl")


def after_import(name: str, fn: Callable) -> None:
    if name in sys.modules:
        fn(sys.modules[name])
        return
    sys.meta_path.insert(0, _Finder(name, fn))


class _Finder(importlib.abc.MetaPathFinder):
    def __init__(self, name: str, fn: Callable):
        self.name, self.fn, self.busy = name, fn, False

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name or self.busy:
            return None
        self.busy = True  # the real finders below answer for the module itself
        try:
            spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        finally:
            self.busy = False
        if spec is None or spec.loader is None:
            return None
        sys.meta_path.remove(self)
        spec.loader = _Loader(spec.loader, self.fn)
        return spec


class _Loader(importlib.abc.Loader):
    def __init__(self, loader, fn: Callable):
        self.loader, self.fn = loader, fn

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        try:
            self.fn(module)
        except Exception as exc:  # noqa: BLE001 - the import itself succeeded: verl runs without jigsaw
            log.warning("jigsaw: patching %s failed (%s: %s); verl runs without it", module.__name__,
                        type(exc).__name__, exc)
