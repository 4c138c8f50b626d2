"""Graph-level executor: pipelines whose graphs are known, run to completion under a policy.

    (graph, devices) × K ─► LivePipeline(static=graph) in a NodeState (node.py)
      loop: every ready sub-stage asks to start (with `continuous`, a rollout piece that
            continues its worker's rollout asks as urgent, as a live engine does)
            NodeState.decide() ─► view, policy, Plan applied: the daemon's and the simulator's path
            effect: each running replica's actual slowdown from the grid for what really
                    shares its device; a lockstep gang at the gang's rate
            advance to the next completion ─► the ledger is told it finished
    ─► Execution(makespan, finish times, intervals, plans)

It is the effect side at sub-stage granularity: what-if questions on recorded or predicted
graphs (`jigsaw sim --replay`, the scheduler's tests, `bench/`).  The simulator is the same
at forward-step granularity.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from jigsaw.node.ledger import LivePipeline, Running
from jigsaw.node.state import NodeState
from jigsaw.graph.plan import NodeSpec, PipelineState, Plan, SchedulerConfig
from jigsaw.graph.policy import Jigsaw, Policy
from jigsaw.graph.state import EPS_S, gang_rate
from jigsaw.graph.substage import SubStageKind


@dataclass(frozen=True, kw_only=True, slots=True)
class Interval:
    """A replica ran on a device (or the host, device None) with a constant budget."""

    substage: str
    pipeline: str
    device: int | None
    start_s: float
    end_s: float
    sm_frac: float
    slowdown: float


@dataclass(frozen=True, kw_only=True, slots=True)
class Execution:
    """Outcome of running pipelines to completion under a policy."""

    makespan_s: float
    finish_s: tuple[tuple[str, float], ...]
    """Completion time of each pipeline."""
    intervals: tuple[Interval, ...]
    plans: tuple[Plan, ...]


def execute(pipelines: Sequence[PipelineState], node: NodeSpec, model,
            config: SchedulerConfig = SchedulerConfig(), policy: Policy | None = None,
            max_plans: int = 1_000_000, continuous: bool = False) -> Execution:
    """Run every pipeline's graph to completion; `policy` defaults to jigsaw with `config`.
    With `continuous`, a plan that does not start an urgent rollout piece is an error."""
    state = NodeState(node, model, policy or Jigsaw(config=config), next_step=False)
    for ps in pipelines:
        if ps.done or ps.running:
            raise ValueError(f"execute() starts pipelines from scratch; {ps.graph.pipeline} has work done")
        state.register(ps.graph.pipeline, tuple(ps.devices), static=ps.graph, more_steps=False)
    run = _Run(state, model, config.balance, continuous)
    while not run.done():
        if len(run.plans) >= max_plans:
            raise RuntimeError(f"no completion after {max_plans} plans")
        run.step()
    run.close()
    finish = tuple((name, run.finish_s.get(name, 0.0)) for name in state.pipelines)
    return Execution(makespan_s=max((f for _, f in finish), default=0.0), finish_s=finish,
                     intervals=tuple(sorted(run.intervals, key=lambda iv: (iv.start_s, iv.substage))),
                     plans=tuple(run.plans))


class _Run:
    """The executor's clock, the work left of running replicas, and what it recorded."""

    def __init__(self, state: NodeState, model, balanced: bool, continuous: bool):
        self.state, self.model, self.balanced, self.continuous = state, model, balanced, continuous
        self.t = 0.0
        self.left: dict[tuple[str, str], float] = {}
        """Exclusive seconds left of each running replica (what really happens)."""
        self.asked: set[tuple[str, str]] = set()
        self.plans: list[Plan] = []
        self.intervals: list[Interval] = []
        self.open: dict[tuple[str, str], Interval] = {}
        self.finish_s: dict[str, float] = {}

    def done(self) -> bool:
        return all(len(p.finished) >= len(p.static) for p in self.state.pipelines.values())

    def step(self) -> None:
        self._ask()
        d = self.state.decide(self.t)
        if d is None:
            raise RuntimeError(f"schedule stuck at t={self.t}: nothing waits or runs and work is left")
        missed = [sid for p in self.state.pipelines.values() for sid, w in p.waiting.items() if w.urgent]
        if self.continuous and missed:
            raise RuntimeError(f"plan at t={self.t} does not continue rollout piece(s) {missed[:3]}")
        if d.notes:
            raise RuntimeError(f"plan at t={self.t} cannot take effect: {d.notes[0]}")
        self.plans.append(d.plan)
        for adm in d.admitted:
            p = self.state.pipelines[adm.assignment.pipeline]
            self.left[(p.name, adm.running.sid)] = p.static[adm.running.sid].duration_s
        for m in d.plan.migrations:  # the source's requests now run on the target
            self.left.pop((m.pipeline, m.source), None)
            self.left[(m.pipeline, m.target)] = m.target_remaining_s
            self._end_chain(self.state.pipelines[m.pipeline], m.source)
        units = self._units()
        if not units:
            raise RuntimeError(f"schedule stuck at t={self.t}: nothing runs and work is left")
        dt = min(left / rate for left, rate, _, _ in units)
        self._record(self.t + dt)
        self.t += dt
        self._advance(units, dt)

    def _end_chain(self, p: LivePipeline, source: str) -> None:
        """A merged-away worker's later rollout pieces of the step left with its requests (their
        work is in the target's merged tail): they never ask for its device."""
        g, rank = p.static, p.static[source].dp_rank
        todo = list(g.successors(source))
        while todo:
            s = g[todo.pop()]
            same_chain = s.dp_rank == rank and (s.kind.is_rollout or s.kind is SubStageKind.TOOL)
            if not same_chain or (p.name, s.id) in self.asked:
                continue
            self.asked.add((p.name, s.id))
            p.finished[s.id] = replace(s, duration_s=0.0)
            p.merged_away.add(s.id)
            todo.extend(g.successors(s.id))

    def _ask(self) -> None:
        """Every sub-stage whose dependencies are done asks to start."""
        for p in self.state.pipelines.values():
            g = p.static
            for s in g.frontier(p.finished, ()):
                key = (p.name, s.id)
                if key not in self.asked:
                    self.asked.add(key)
                    p.request(s.kind, s.dp_rank, s.step, self.t, sid=s.id, urgent=self._continues(p, s))

    def _continues(self, p: LivePipeline, s) -> bool:
        """A rollout piece right after its worker's previous piece (or tool wait) ended."""
        g = p.static
        return self.continuous and s.kind.is_rollout and any(
            g[d].dp_rank == s.dp_rank and (g[d].kind.is_rollout or g[d].kind is SubStageKind.TOOL)
            for d in g.deps[s.id])

    def _units(self) -> list[tuple[float, float, LivePipeline, list[Running]]]:
        """(work left, rate, pipeline, replicas) per unit: a replica, or a gang's replicas."""
        slow = self._slowdowns()
        units = []
        for p in self.state.pipelines.values():
            groups: dict[object, list[Running]] = {}
            for sid, r in p.running.items():
                groups.setdefault(p.gang_key(sid) if r.kind.collective else sid, []).append(r)
            for rs in groups.values():
                s = [slow.get((p.name, r.sid), 1.0) for r in rs]
                rate = gang_rate(s, self.balanced and any(r.micro_batch is not None for r in rs)) \
                    if len(rs) > 1 else 1.0 / s[0]
                units.append((max(self.left[(p.name, r.sid)] for r in rs), rate, p, rs))
        return units

    def _slowdowns(self) -> dict[tuple[str, str], float]:
        """What the grid says for what really shares each device (the plan's own prediction
        is not trusted: this is the effect side)."""
        on: dict[int, list[tuple[str, Running]]] = {}
        for p in self.state.pipelines.values():
            for r in p.running.values():
                if r.on_device:
                    on.setdefault(r.device, []).append((p.name, r))
        out = {}
        for d, group in on.items():
            got = self.model.actual(*[(r.kind.value, r.budget.sm_frac, r.budget.mem_frac) for _, r in group])
            if got is None:
                raise RuntimeError(f"plan at t={self.t} co-locates {[r.sid for _, r in group]} on device {d}, "
                                   "which the slowdown grid says does not fit")
            out.update({(name, r.sid): s for (name, r), s in zip(group, got)})
        return out

    def _advance(self, units, dt: float) -> None:
        for left, rate, p, rs in units:
            rest = left - dt * rate
            ends = rest <= EPS_S * max(1.0, max(p.static[r.sid].duration_s for r in rs))
            for r in rs:
                if ends:
                    del self.left[(p.name, r.sid)]
                    p.finish(r.sid, self.t)
                    self.finish_s[p.name] = max(self.finish_s.get(p.name, 0.0), self.t)
                else:
                    self.left[(p.name, r.sid)] = rest

    def _record(self, t1: float) -> None:
        """Extend or open one Interval per running replica; close those whose budget changed."""
        slow = self._slowdowns()
        current = {}
        for p in self.state.pipelines.values():
            for sid, r in p.running.items():
                dev = r.device if r.on_device else None
                current[(p.name, sid)] = (dev, r.budget.sm_frac if r.on_device else 0.0, slow.get((p.name, sid), 1.0))
        for key in list(self.open):
            iv = self.open[key]
            if current.get(key) != (iv.device, iv.sm_frac, iv.slowdown):
                self.intervals.append(self.open.pop(key))
        for (name, sid), (dev, sm, s) in current.items():
            iv = self.open.get((name, sid))
            self.open[(name, sid)] = Interval(substage=sid, pipeline=name, device=dev, sm_frac=sm, slowdown=s,
                                              start_s=iv.start_s if iv else self.t, end_s=t1)

    def close(self) -> None:
        self.intervals.extend(self.open.values())
        self.open = {}
