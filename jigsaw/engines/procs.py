"""Where the CPU engines' processes start: a fork server that has imported torch once.

    DPRollout workers, Trainer ranks ─ process() ─► fork server (one per parent process, started
        by `warm` or the first engine: torch, transformers' Qwen3 and the engine modules
        imported, no torch op run)
                                                 └► one fork per worker / rank: the caller's
                                                    environment and cores applied, then its target

With `spawn` every worker and rank imported torch and transformers itself: about 4 CPU-s each,
four processes per GRPO pipeline, most of a CPU pipeline's start-up (a 2-step recipe run took
15 s, 7 s with the fork server).  A fork of the parent itself would copy its threads and torch's
thread pools; the fork server has run no torch op, so it has none to copy.

A forked child would see the fork server's environment and cores, fixed when the server
started; `process` hands it the caller's at the time of the call instead, as spawn does (a test
that sets JIGSAW_FAKE_GPU for one engine, a caller pinned after the server started).  What torch
reads once at import (OMP_NUM_THREADS) is the server's: a worker's thread count is set by
`bind.follow_threads` (torch.set_num_threads).
"""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Callable
from multiprocessing import forkserver
from multiprocessing.context import BaseContext
from multiprocessing.process import BaseProcess

from jigsaw.engines import forkserver_exit

PRELOAD = ("torch", "transformers.models.qwen3.modeling_qwen3", "jigsaw.engines.model", "jigsaw.engines.rollout",
           "jigsaw.engines.training", "jigsaw.engines.forkserver_exit")
"""Imported once in the fork server (an import that fails there is left to the child, as spawn
would); the last one makes the server's own exit quick."""


def _context() -> BaseContext:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def warm() -> None:
    """Start the fork server now, so that its imports run beside the caller's own (a recipe
    imports torch and builds its tokenizer meanwhile)."""
    _context()
    os.environ[forkserver_exit.MARK] = "1"  # the server's environment alone: forkserver_exit.py
    try:
        forkserver.ensure_running()
    finally:
        os.environ.pop(forkserver_exit.MARK, None)


def process(target: Callable[..., None], args: tuple, *, name: str) -> BaseProcess:
    """A daemonic engine process (not started) that runs target(*args) from the fork server,
    with this process's environment and cores as of now."""
    warm()
    return _context().Process(target=_as_spawned, name=name, daemon=True,
                              args=(dict(os.environ), sorted(os.sched_getaffinity(0)), target, *args))


def _as_spawned(environ: dict[str, str], cores: list[int], target: Callable[..., None], *args) -> None:
    os.environ.clear()
    os.environ.update(environ)
    os.sched_setaffinity(0, cores)  # the only thread yet: every later one starts from it
    target(*args)
