"""The pipelines of one demo run begin their first measured step together.

    jigsaw demo ─ JIGSAW_START_GATE=DIR:N:STEP ─► each recipe, before its step STEP (the first
        one the demo measures, after the warm-up steps):
        touch DIR/<pid> ─► wait until DIR holds N entries (or the deadline) ─► step STEP

Loading a model takes seconds and varies with the machine's load, and a warm-up step of one
pipeline can take several of another's (a multi-turn pipeline beside a one-turn one).  The
demo measures a co-located mode from the first measured step to the last step's end; without
the gate, that span could hold one pipeline's measured steps beside the other's warm-up (work
that is not counted, slowing work that is), or two pipelines that never overlapped at all.
A partner that dies before the gate holds nobody up past the deadline: the pipeline goes on
and says so.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

ENV = "JIGSAW_START_GATE"
"""DIR:N:STEP, set by the demo on every pipeline of a run it starts at once."""
DEADLINE_S = 300.0
"""Longest a pipeline waits for its partners (a loaded 2-core machine loads four models in ~30 s)."""
POLL_S = 0.02


def gate_env(directory: Path, num_pipelines: int, step: int = 0) -> dict[str, str]:
    """The environment that makes `num_pipelines` pipelines meet in `directory` (created here)
    before their step `step`."""
    directory.mkdir(parents=True, exist_ok=True)
    return {ENV: f"{directory}:{num_pipelines}:{step}"}


def wait_at_gate(say=lambda _: None, deadline_s: float = DEADLINE_S, step: int = 0) -> float | None:
    """Before step `step`: arrive at the run's gate if it stands before this step, and wait for
    the others; the seconds waited, or None (no gate, or not before this step)."""
    spec = os.environ.get(ENV)
    if not spec:
        return None
    where, count, at = _parse(spec)
    if step != at:
        return None
    gate, expected = Path(where), count
    (gate / str(os.getpid())).touch()
    t0 = time.monotonic()
    while (arrived := sum(1 for _ in gate.iterdir())) < expected:
        if time.monotonic() - t0 > deadline_s:
            say(f"start gate: {arrived} of {expected} pipelines arrived in {deadline_s:g} s; starting anyway")
            break
        time.sleep(POLL_S)
    return time.monotonic() - t0


def _parse(spec: str) -> tuple[str, int, int]:
    parts = spec.rsplit(":", 2)
    if len(parts) != 3 or not parts[0] or not parts[1].isdigit() or not parts[2].isdigit():
        raise ValueError(f"{ENV}={spec!r}: expected DIR:N:STEP")
    return parts[0], int(parts[1]), int(parts[2])
