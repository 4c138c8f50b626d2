"""A pipeline's step clock: when each step began and ended, measured against its SLO.

    LivePipeline.request (first of a step) ─► StepClock.begin(now)
    LivePipeline.finish  (a piece of it)   ─► StepClock.end(now)
    the step closes (a later step's request) ─► StepClock.close(pieces) ─► StepOutcome
        latency = last end − first request; exclusive = the finished pieces' longest chain
        of exclusive work (graph/slo.py), so the same pieces give the same outcome live,
        simulated and replayed
    view.pipeline_state ─► StepClock.deadline(base graph) ─► PipelineState.deadline
    a step's end (daemon StepEnd, simulator) ─► step_fields ─► the trace's "step" event
        (exclusive_s, step_slowdown, slo_slowdown, slo_kept); NodeState.summary ─► status
        replies and Prometheus gauges (attainment, the last finished step's slowdown)

Attainment (steps kept / steps held to the SLO) is counted over the whole run; the last
outcomes are kept for status pages, bounded.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping

from jigsaw.graph.builder import assemble_step_graph
from jigsaw.graph.graph import SubStageGraph
from jigsaw.graph.slo import Deadline, StepOutcome, check_slo, exclusive_step_s
from jigsaw.graph.substage import SubStage

KEPT_OUTCOMES = 256
"""Finished steps whose outcome is kept (status, timeline); the counts cover every step."""


class StepClock:
    """One pipeline's step timing (see the module docstring)."""

    __slots__ = ("slo_slowdown", "began_s", "ended_s", "outcomes", "kept", "held")

    def __init__(self, slo_slowdown: float | None = None):
        self.slo_slowdown = None if slo_slowdown is None else check_slo(slo_slowdown)
        self.began_s: float | None = None
        """When the current step's first request came (None: none yet)."""
        self.ended_s: float | None = None
        """When a piece of the current step last ended."""
        self.outcomes: deque[StepOutcome] = deque(maxlen=KEPT_OUTCOMES)
        self.kept = 0
        """Finished steps within the SLO."""
        self.held = 0
        """Finished steps held to an SLO."""

    def begin(self, now_s: float) -> None:
        if self.began_s is None:
            self.began_s = now_s

    def end(self, now_s: float) -> None:
        if self.ended_s is None or now_s > self.ended_s:
            self.ended_s = now_s

    def outcome(self, step: int, pieces: Iterable[SubStage], first_start_s: Mapping[str, float]) -> StepOutcome | None:
        """The current step as it stands, if it began and a piece of it ended."""
        mine = [s for s in pieces if s.step == step and s.id in first_start_s]
        if self.began_s is None or self.ended_s is None or not mine:
            return None
        graph = assemble_step_graph(mine, dict(first_start_s))
        return StepOutcome(step=step, latency_s=self.ended_s - self.began_s, exclusive_s=exclusive_step_s(graph),
                           slo_slowdown=self.slo_slowdown)

    def close(self, step: int, pieces: Iterable[SubStage], first_start_s: Mapping[str, float]) -> None:
        """The step is over: its outcome is counted; the next step's clock starts unset."""
        got = self.outcome(step, pieces, first_start_s)
        if got is not None:
            self.outcomes.append(got)
            if got.kept is not None:
                self.held += 1
                self.kept += bool(got.kept)
        self.began_s = self.ended_s = None

    def deadline(self, step: int, base: SubStageGraph | None, measured: Mapping[str, float] | None = None,
                 graph: SubStageGraph | None = None) -> Deadline | None:
        """The current step's deadline: its start + SLO × the base graph's exclusive step, the
        pieces in `measured` at that exclusive time (finished: their work; running: work done
        and left), so the deadline follows what the step turns out to be; `graph`: the
        scheduler's, whose next step (if any) prices what runs past this one (None: no SLO,
        the step has not begun, or nothing predicts it)."""
        if self.slo_slowdown is None or self.began_s is None or base is None:
            return None
        exclusive = exclusive_step_s(base, step, measured)
        if exclusive <= 0.0:
            return None
        return Deadline(step=step, slo_slowdown=self.slo_slowdown, start_s=self.began_s, exclusive_s=exclusive,
                        next_exclusive_s=exclusive_step_s(graph, step + 1) if graph is not None else 0.0)

    def attainment(self) -> tuple[int, int]:
        """(finished steps within the SLO, finished steps held to one)."""
        return self.kept, self.held


def step_fields(pipeline, step: int) -> dict:
    """A "step" trace event's SLO fields for `step` of `pipeline` (a LivePipeline), as it stands
    at its end: its exclusive time and measured slowdown (when a piece of it ended), its SLO
    (0: none) and whether it kept it (None: no SLO, or nothing measured); {} for a pipeline
    with neither an SLO nor a measured step."""
    got = next((o for o in reversed(pipeline.step_outcomes()) if o.step == step), None)
    slo = pipeline.clock.slo_slowdown
    if got is None and slo is None:
        return {}
    out = {"slo_slowdown": slo or 0.0, "slo_kept": None if got is None else got.kept}
    if got is not None:
        out |= {"exclusive_s": got.exclusive_s, "step_slowdown": got.slowdown}
    return out
