"""The pipelines of one demo run begin their first step together.

    jigsaw demo ─ JIGSAW_START_GATE=DIR:N ─► each recipe, once its model and workers are up:
        touch DIR/<pid> ─► wait until DIR holds N entries (or the deadline) ─► step 0

Loading a model takes seconds and varies with the machine's load; a step of the demo's small
runs can take less.  Without the gate, a co-located mode can end up measuring two pipelines that
never overlapped (one finished before the other had loaded), and the tokens/s of its measured
span would be set by when the second one loaded, not by how the two shared the node.  A
partner that dies while loading holds nobody up past the deadline: the pipeline goes on and
says so.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

ENV = "JIGSAW_START_GATE"
"""DIR:N, set by the demo on every pipeline of a run it starts at once."""
DEADLINE_S = 300.0
"""Longest a pipeline waits for its partners (a loaded 2-core machine loads four models in ~30 s)."""
POLL_S = 0.02


def gate_env(directory: Path, num_pipelines: int) -> dict[str, str]:
    """The environment that makes `num_pipelines` pipelines meet in `directory` (created here)."""
    directory.mkdir(parents=True, exist_ok=True)
    return {ENV: f"{directory}:{num_pipelines}"}


def wait_at_gate(say=lambda _: None, deadline_s: float = DEADLINE_S) -> float | None:
    """Arrive at the run's gate and wait for the others; the seconds waited, or None without a gate."""
    spec = os.environ.get(ENV)
    if not spec:
        return None
    where, _, count = spec.rpartition(":")
    if not where or not count.isdigit():
        raise ValueError(f"{ENV}={spec!r}: expected DIR:N")
    gate, expected = Path(where), int(count)
    (gate / str(os.getpid())).touch()
    t0 = time.monotonic()
    while (arrived := sum(1 for _ in gate.iterdir())) < expected:
        if time.monotonic() - t0 > deadline_s:
            say(f"start gate: {arrived} of {expected} pipelines arrived in {deadline_s:g} s; starting anyway")
            break
        time.sleep(POLL_S)
    return time.monotonic() - t0
