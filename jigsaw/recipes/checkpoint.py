"""The recipe's checkpoints: a pipeline stopped, or re-placed on other nodes with other ranks,
goes on from its last whole step.

    after step k ─► DIR/step-k/           the trainer's policy and AdamW shards
                                          (torch.distributed.checkpoint: any world size loads them)
                    DIR/step-k/jigsaw.json  the steps' results so far and who the pipeline is,
                                          written last, renamed into place: a step directory
                                          without it is a save cut short, never loaded
                    older step directories removed (the newest KEEP stay)
    start ─► newest(DIR): the last whole step ─► Trainer.load, the rollout workers get its
             weights, the run goes on at k + 1 (prompts and length caps are functions of
             (seed, step), so the steps after it ask what they would have asked)
    asynchronous modes: the same after each trained step, with the buffer's ledger; batches
             generated and not yet trained are not saved, and are generated again after it
             (async_grpo.py: every sample still trained once, within the bound)

A checkpoint of another pipeline (model, task, seed, prompts or group differ) is refused with
the difference named: going on from it would train one pipeline on another's weights.

    SIGTERM (a launcher placing the pipeline again, a user) ─► StopAtStepEnd: within a step, the
        step ends and is saved, then the run stops; between steps, it stops at once (Stopped)
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

KEEP = 2
"""Whole step checkpoints kept (the newest): one more than needed, so a save cut short never
leaves none."""
META = "jigsaw.json"
IDENTITY = ("model", "task", "seed", "prompts", "group", "max_new_tokens")
"""The config fields a checkpoint must share with the run that goes on from it."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Resume:
    """Where a run goes on from."""

    path: Path
    """The step directory (the trainer loads it)."""
    step: int
    """The last step it holds; the run goes on at step + 1."""
    steps: list[dict]
    """The results of steps 0..step, as the run that saved them wrote them."""
    saved: dict
    """What else the run saved with them (an asynchronous run: its buffer's ledger, its batches)."""


def identity(cfg) -> dict:
    return {k: getattr(cfg, k) for k in IDENTITY}


def save(directory: Path, step: int, trainer, steps: list[dict], cfg, **saved) -> Path:
    """Step `step` done: the trainer's shards and the results so far (and `saved`, JSON: what
    Resume.saved gives back); older ones pruned."""
    path = directory / f"step-{step}"
    if path.exists():  # a save of this step cut short before its metadata: start it again
        shutil.rmtree(path)
    trainer.save(path)
    tmp = path / (META + ".tmp")
    tmp.write_text(json.dumps({"step": step, "identity": identity(cfg), "steps": steps, "saved": saved}))
    os.replace(tmp, path / META)
    for old in _whole(directory)[:-KEEP]:
        shutil.rmtree(old[1])
    return path


def newest(directory: Path, cfg) -> Resume | None:
    """The last whole step saved under `directory`, or None (nothing saved yet)."""
    whole = _whole(directory)
    if not whole:
        return None
    step, path = whole[-1]
    meta = json.loads((path / META).read_text())
    if (saved := meta["identity"]) != (now := identity(cfg)):
        diff = {k: (saved.get(k), now[k]) for k in now if saved.get(k) != now[k]}
        raise ValueError(f"{path} is a checkpoint of another pipeline (saved vs this run: {diff}); "
                         "use another --checkpoint-dir")
    return Resume(path=path, step=step, steps=meta["steps"], saved=meta.get("saved", {}))


def resume(cfg, trainer, say) -> Resume | None:
    """The newest whole step under cfg.checkpoint_dir loaded into `trainer` (policy and
    optimizer), or None: no directory given, or nothing saved there yet."""
    if cfg.checkpoint_dir is None or (got := newest(cfg.checkpoint_dir, cfg)) is None:
        return None
    trainer.load(got.path)
    say(f"resumed after step {got.step} from {got.path}")
    return got


def _whole(directory: Path) -> list[tuple[int, Path]]:
    """(step, path) of every step directory with its metadata, oldest first."""
    if not directory.is_dir():
        return []
    out = []
    for p in directory.glob("step-*"):
        if (p / META).is_file() and p.name.removeprefix("step-").isdigit():
            out.append((int(p.name.removeprefix("step-")), p))
    return sorted(out)


class Stopped(Exception):
    """SIGTERM arrived between two steps: the run stops there."""


class StopAtStepEnd:
    """SIGTERM handling of a run made of steps (see the module docstring); `requested` once it
    came.  Only the main thread can take signals: elsewhere it changes nothing."""

    def __init__(self):
        self.requested = False
        self._in_step = False
        self._installed = False
        self._old = None

    def __enter__(self) -> StopAtStepEnd:
        if threading.current_thread() is threading.main_thread():
            self._old, self._installed = signal.signal(signal.SIGTERM, self._handle), True
        return self

    def __exit__(self, *exc: object) -> None:
        if self._installed:  # None: the previous handler was not Python's (the default, then)
            signal.signal(signal.SIGTERM, signal.SIG_DFL if self._old is None else self._old)

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        """A step and its checkpoint: a SIGTERM within lets it finish."""
        self._in_step = True
        try:
            yield
        finally:
            self._in_step = False
        if self.requested:
            raise Stopped

    @contextlib.contextmanager
    def steps(self, done: list, saving: bool, say) -> Iterator[None]:
        """A run's loop of steps: a SIGTERM between two ends it there (said, with `done` the
        steps it did); after it, ended()."""
        try:
            yield
        except Stopped:
            say(f"stopped (SIGTERM) after {len(done)} step(s)" + (", all saved" if saving else ""))
        self.ended()

    def ended(self) -> None:
        """The steps are over: a SIGTERM now only marks the run stopped (the processes' clean-up
        is not cut short)."""
        self._in_step = True

    def _handle(self, signum, frame) -> None:
        self.requested = True
        if not self._in_step:
            raise Stopped
