"""Per-pipeline slowdown SLOs: a step may take at most `slo_slowdown` × its exclusive step.

    the step's graph ─► exclusive_step_s (longest chain of exclusive durations in that step)
    step start + slo × exclusive ─► Deadline (PipelineState.deadline; node/view.py builds it)
    schedule(): the look-ahead values every option first by the SLO lateness it leads to
      (Σ over pipelines with a deadline of how far their step is predicted to end past it),
      then by the makespan as before: an option that keeps every SLO always beats one that
      breaks one, whatever it gains; among options that all break some, the least lateness
    Plan.slo: per deadline, the step end the plan predicts and, for one it gives up, why
    finished steps ─► StepOutcome (node/ledger.py): latency against exclusive, SLO kept or not

The exclusive step is the pipeline alone on its own devices: each sub-stage at its exclusive
duration, one after another along its dependencies (what `SubStageGraph.critical_path` is
for one step).  Pure: no clock, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from jigsaw.graph.graph import SubStageGraph

TOLERANCE_S = 1e-6
"""A predicted step end this close past its deadline keeps it (rounding, not lateness)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Deadline:
    """When one pipeline's current step must end to keep its SLO."""

    step: int
    """The step it is for (sub-stages of later steps in the graph are not held to it)."""
    slo_slowdown: float
    """The step may take at most this × its exclusive step."""
    start_s: float
    """When the step began (its first request)."""
    exclusive_s: float
    """The step alone on the pipeline's devices, as known now (graph/slo.exclusive_step_s)."""
    next_exclusive_s: float = 0.0
    """The next step's exclusive time as predicted (0: no next step in view): its own SLO
    starts when this step ends, and what runs past this step's end is decided now."""

    def __post_init__(self) -> None:
        check_slo(self.slo_slowdown)
        if self.exclusive_s < 0.0:
            raise ValueError(f"exclusive step time must be >= 0, got {self.exclusive_s}")

    @property
    def deadline_s(self) -> float:
        return self.start_s + self.slo_slowdown * self.exclusive_s


@dataclass(frozen=True, kw_only=True, slots=True)
class SloForecast:
    """What one plan predicts for one pipeline's deadline."""

    pipeline: str
    step: int
    deadline_s: float
    predicted_end_s: float
    """The step's end on the plan's critical path (running work at its pace, the rest alone)."""
    kept: bool
    reason: str = ""
    """Why the plan gives the SLO up (empty when kept)."""

    @property
    def late_s(self) -> float:
        return max(0.0, self.predicted_end_s - self.deadline_s)


@dataclass(frozen=True, kw_only=True, slots=True)
class StepOutcome:
    """One finished step of a pipeline, measured."""

    step: int
    latency_s: float
    """First request of the step to the end of its last sub-stage."""
    exclusive_s: float
    """The step's finished sub-stages' exclusive work along its longest chain."""
    slo_slowdown: float | None = None

    @property
    def slowdown(self) -> float:
        return self.latency_s / self.exclusive_s if self.exclusive_s > 0.0 else 1.0

    @property
    def kept(self) -> bool | None:
        """Within the SLO (None: the pipeline has none, or the step measured no work)."""
        if self.slo_slowdown is None or self.exclusive_s <= 0.0:
            return None
        return within(self.latency_s, self.exclusive_s, self.slo_slowdown)


def within(latency_s: float, exclusive_s: float, slo_slowdown: float) -> bool:
    """A step of `latency_s` keeps an SLO of `slo_slowdown` against its `exclusive_s` alone."""
    return latency_s <= slo_slowdown * exclusive_s + TOLERANCE_S


def check_slo(slo_slowdown: float) -> float:
    """An SLO is a slowdown: at least 1 (a step cannot beat itself alone)."""
    if not slo_slowdown >= 1.0 or slo_slowdown == float("inf"):
        raise ValueError(f"an SLO is a step slowdown >= 1.0 against the step alone (e.g. 1.3), got {slo_slowdown}")
    return slo_slowdown


def exclusive_step_s(graph: SubStageGraph, step: int | None = None,
                     measured: Mapping[str, float] | None = None) -> float:
    """Longest chain of exclusive durations among the sub-stages of `step` (None: the graph's
    first step), along dependencies within that step; a sub-stage in `measured` counts at
    that duration instead of the graph's (a finished one's work, a running one's work done
    and left)."""
    steps = graph.steps
    if not steps:
        return 0.0
    step = steps[0] if step is None else step
    longest: dict[str, float] = {}
    for s in graph.substages:  # topological order
        if s.step != step:
            continue
        before = max((longest[d] for d in graph.deps[s.id] if d in longest), default=0.0)
        known = measured.get(s.id) if measured else None
        longest[s.id] = before + (s.duration_s if known is None else known)
    return max(longest.values(), default=0.0)


def attainment(outcomes) -> tuple[int, int]:
    """(steps that kept their SLO, steps held to one) of `outcomes`."""
    held = [o for o in outcomes if o.kept is not None]
    return sum(1 for o in held if o.kept), len(held)
