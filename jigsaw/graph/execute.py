"""Graph-level executor: applies Plans and advances time until every pipeline is done.

    PipelineState × K ─► policy(...) ─► Plan ─► apply (start, budgets, migrations)
          ▲                                        │ rates: 1/s per replica, balanced
          └──── done / running / remaining ◄── advance to the next completion

It is the effect side of the scheduler: it reads only Plans (never the scheduler's
internals), so any policy with the `schedule` signature can be executed and compared.
Used by the tests (makespans, Fig. 11), `bench/` and as the core of what-if runs.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from jigsaw.graph.plan import Budget, NodeSpec, PipelineState, Plan, SchedulerConfig
from jigsaw.graph.schedule import schedule
from jigsaw.graph.problem import gang_keys
from jigsaw.graph.state import EPS_S, gang_rate
from jigsaw.graph.substage import SubStageKind

Policy = Callable[..., Plan]


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


class _Tracker:
    """Mutable bookkeeping of one pipeline between plans."""

    def __init__(self, ps: PipelineState):
        self.ps = ps
        self.done = set(ps.done)
        self.running: dict[str, Budget] = dict(ps.running)
        self.remaining = {sid: ps.remaining_s.get(sid, ps.graph[sid].duration_s) for sid in ps.running}
        self.finish_s = 0.0
        self.gang = {s.id: key for s, key in zip(ps.graph, gang_keys(ps.graph)) if s.kind.collective}

    def state(self, continuous: bool) -> PipelineState:
        return PipelineState(graph=self.ps.graph, devices=self.ps.devices, done=frozenset(self.done),
                             running=dict(self.running), remaining_s=dict(self.remaining),
                             urgent=self.continuing() if continuous else frozenset())

    def continuing(self) -> frozenset[str]:
        """Ready rollout pieces that continue their worker's rollout (its previous piece, or
        the tool call it waited on, just ended): an engine does not stop between them."""
        g = self.ps.graph
        out = set()
        for s in g.frontier(self.done, self.running):
            if s.kind.is_rollout and any(g[d].dp_rank == s.dp_rank and (g[d].kind.is_rollout or
                                         g[d].kind is SubStageKind.TOOL) for d in g.deps[s.id]):
                out.add(s.id)
        return frozenset(out)


def execute(pipelines: Sequence[PipelineState], node: NodeSpec, model,
            config: SchedulerConfig = SchedulerConfig(), policy: Policy = schedule,
            max_plans: int = 1_000_000, continuous: bool = False) -> Execution:
    """Run `policy` at every completion event until all sub-stages are done.  With
    `continuous`, a rollout piece that follows its worker's previous piece is urgent (as in
    a live engine) and a plan that does not start it is an error."""
    trackers = {ps.graph.pipeline: _Tracker(ps) for ps in pipelines}
    t, plans, open_iv, intervals = 0.0, [], {}, []
    while any(len(tr.done) < len(tr.ps.graph) for tr in trackers.values()):
        if len(plans) >= max_plans:
            raise RuntimeError(f"no completion after {max_plans} plans")
        states = [tr.state(continuous) for tr in trackers.values()]
        plan = policy(states, node, model, config, t)
        missed = [sid for ps in states for sid in ps.urgent if sid not in plan.started]
        if missed:
            raise RuntimeError(f"plan at t={t} does not continue rollout piece(s) {missed[:3]}")
        plans.append(plan)
        slow = _apply(plan, trackers, t, node, model)
        units = _units(trackers, slow, config.balance)
        if not units:
            raise RuntimeError(f"schedule stuck at t={t}: nothing runs and work is left")
        dt = min(rem / rate for rem, rate, _ in units)
        _record(open_iv, intervals, plan, trackers, t, t + dt)
        t += dt
        _advance(trackers, units, dt, t)
    intervals.extend(open_iv.values())
    finish = tuple((name, tr.finish_s) for name, tr in trackers.items())
    return Execution(makespan_s=max(f for _, f in finish), finish_s=finish,
                     intervals=tuple(sorted(intervals, key=lambda iv: (iv.start_s, iv.substage))),
                     plans=tuple(plans))


def _apply(plan: Plan, trackers: dict[str, _Tracker], t: float, node: NodeSpec, model) -> dict[str, float]:
    """Take the plan's migrations, starts and budgets; return each replica's slowdown."""
    for tr in trackers.values():
        for sid in plan.started:
            if sid in tr.ps.graph:
                tr.running[sid] = Budget(sm_frac=1.0, mem_frac=1.0)
                tr.remaining.setdefault(sid, tr.ps.graph[sid].duration_s)
    for m in plan.migrations:
        tr = trackers[m.pipeline]
        tr.running.pop(m.source, None)
        tr.remaining.pop(m.source, None)
        tr.done.add(m.source)
        tr.remaining[m.target] = m.target_remaining_s
    assigned = {a.substage: a for a in plan.assignments}
    slow, kinds = {}, {}
    for tr in trackers.values():
        for sid in list(tr.running):
            if sid in assigned:
                a = assigned[sid]
                tr.running[sid] = Budget(sm_frac=a.sm_frac, mem_frac=a.mem_bytes / node.mem_bytes)
                kinds[sid] = tr.ps.graph[sid].kind.value
            elif tr.ps.graph[sid].kind.on_device:
                raise RuntimeError(f"plan at t={t} dropped running sub-stage {sid} (no preemption)")
            else:
                slow[sid] = 1.0
    by_device: dict[int, list] = {}
    for a in plan.assignments:
        if a.substage in kinds:
            by_device.setdefault(a.device, []).append(a)
    for d, group in by_device.items():
        slow.update(_slowdowns(model, group, kinds, t, d))
    return slow


def _slowdowns(model, group: list, kinds: dict[str, str], t: float, d: int) -> dict[str, float]:
    """What the grid says for what really shares the device (a plan's own prediction is not
    trusted: this is the effect side)."""
    if len(group) > 2:
        raise RuntimeError(f"plan at t={t} puts {len(group)} sub-stages on device {d}")
    if len(group) == 1:
        (a,) = group  # alone: its SM share is all that can slow it (memory bounds batch, not pace)
        return {a.substage: 1.0 if a.sm_frac >= 1.0 - 1e-9 else
                model.alone(kinds[a.substage], a.sm_frac, model.mem_levels[-1])}
    a, b = group
    mem_a = a.mem_bytes / (a.mem_bytes + b.mem_bytes)
    pair = (model.shared(kinds[a.substage], kinds[b.substage], mem_a) if a.sm_frac >= 1.0 - 1e-9
            else model.pair(kinds[a.substage], kinds[b.substage], a.sm_frac, mem_a))
    if pair is None:
        raise RuntimeError(f"plan at t={t} co-locates {a.substage} and {b.substage} on device {d}, "
                           "which the slowdown grid says does not fit")
    return {a.substage: pair[0], b.substage: pair[1]}


def _units(trackers: dict[str, _Tracker], slow: dict[str, float], balanced: bool):
    """(remaining, rate, replica ids) per unit: a replica, or a collective stage's replicas."""
    units = []
    for tr in trackers.values():
        groups: dict[tuple, list[str]] = {}
        for sid in tr.running:
            groups.setdefault(tr.gang.get(sid, sid), []).append(sid)
        for ids in groups.values():
            rate = gang_rate([slow[i] for i in ids], balanced) if len(ids) > 1 else 1.0 / slow[ids[0]]
            units.append((max(tr.remaining[i] for i in ids), rate, (tr, ids)))
    return units


def _advance(trackers, units, dt: float, t: float) -> None:
    for rem, rate, (tr, ids) in units:
        left = rem - dt * rate
        ends = left <= EPS_S * max(1.0, max(tr.ps.graph[i].duration_s for i in ids))
        for sid in ids:
            if ends:
                tr.running.pop(sid)
                tr.remaining.pop(sid)
                tr.done.add(sid)
                tr.finish_s = max(tr.finish_s, t)
            else:
                tr.remaining[sid] = left


def _record(open_iv: dict, intervals: list, plan: Plan, trackers, t0: float, t1: float) -> None:
    """Extend or open one Interval per running replica; close those whose budget changed."""
    current = {a.substage: (a.pipeline, a.device, a.sm_frac, a.slowdown) for a in plan.assignments}
    for tr in trackers.values():
        for sid in tr.running:
            if sid not in current:
                current[sid] = (tr.ps.graph.pipeline, None, 0.0, 1.0)
    for sid in list(open_iv):
        iv = open_iv[sid]
        if sid not in current or current[sid] != (iv.pipeline, iv.device, iv.sm_frac, iv.slowdown):
            intervals.append(open_iv.pop(sid))
    for sid, (pipe, dev, sm, s) in current.items():
        iv = open_iv.get(sid)
        open_iv[sid] = Interval(substage=sid, pipeline=pipe, device=dev, sm_frac=sm, slowdown=s,
                                start_s=iv.start_s if iv else t0, end_s=t1)
