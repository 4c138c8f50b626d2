"""Graph-level executor: pipelines whose graphs are known, run to completion under a policy.

    (graph, devices) × K ─► registered with their static graph in a NodeState (node/state.py)
      loop: every ready sub-stage asks to start (with `continuous`, a rollout piece that
            continues its worker's rollout asks as urgent, as a live engine does)
            NodeState.decide() ─► view, policy, Plan applied: the daemon's and the simulator's path
            effect, from the Decision alone (node/effects.py): each holder's actual slowdown
                    from the grid for what really shares its device; a lockstep gang at the
                    gang's rate
            advance to the next completion ─► the node state is told it finished
    ─► Execution(makespan, finish times, intervals, plans, the fallback's plans)
    a policy that raises, whose plan cannot take effect, leaves an urgent piece waiting or
    starts nothing ─► PolicyFailed carrying Refused(policy, time, first line of why)
        (`fallback` on: where the policy raised, the node state's fallback decides instead,
        as a live node's does, and Execution.fallbacks says so)

It is a simulator at sub-stage granularity: what-if questions on recorded or predicted
graphs (`jigsaw sim --replay`, the scheduler's tests, `bench/`).  The node simulator
(node.py) is the same at forward-step granularity.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType

from jigsaw.graph.buffer import TRAIN_SUFFIX, buffer_edges, train_side
from jigsaw.graph.graph import SubStageGraph
from jigsaw.graph.ids import pipeline_of
from jigsaw.graph.plan import NodeSpec, PipelineState, Plan, SchedulerConfig
from jigsaw.graph.policy import Jigsaw, Policy
from jigsaw.graph.slo import StepOutcome
from jigsaw.graph.state import EPS_S, gang_rate
from jigsaw.graph.substage import SubStageKind, grant_need_bytes
from jigsaw.node.effects import Decision, Held, layout
from jigsaw.node.ledger import LivePipeline
from jigsaw.node.state import NodeState


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
    fallbacks: tuple[str, ...] = ()
    """Why the node state's fallback decided instead of the policy, once per such plan (a
    makespan with any is not the policy's alone); always empty with `fallback` off."""
    steps: tuple[tuple[str, tuple[StepOutcome, ...]], ...] = ()
    """Each pipeline's steps as its step clock measured them (node/slo.py: first request to
    last end, against the step's exclusive work), with its SLO if it had one."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Refused:
    """A policy that could not run the pipelines, and why: what stands where its makespan
    would (`jigsaw.sim.replay.replay` returns it; never a makespan another scheduler made)."""

    policy: str
    time_s: float
    """Simulated time of the plan that failed."""
    reason: str
    """The first line of the error (a traceback's detail is not a reason)."""

    def __str__(self) -> str:
        return f"{self.policy} failed at t={self.time_s:.3f} s: {self.reason}"


class PolicyFailed(RuntimeError):
    """The policy could not run the pipelines: its plan raised, could not take effect, left
    an urgent rollout piece waiting, or started nothing while work was left."""

    def __init__(self, refused: Refused):
        super().__init__(str(refused))
        self.refused = refused


def execute(pipelines: Sequence[PipelineState], node: NodeSpec, model,
            config: SchedulerConfig = SchedulerConfig(), policy: Policy | None = None,
            max_plans: int = 1_000_000, continuous: bool = False, fallback: bool = True,
            pairs=None, slo: Mapping[str, float] | None = None,
            computes: frozenset[tuple[str, str]] = frozenset(),
            jobs: Mapping[str, tuple[str, int]] = MappingProxyType({})) -> Execution:
    """Run every pipeline's graph to completion; `policy` defaults to jigsaw with `config`.
    `pairs` (PairGrids, by pipeline name): pipelines of different models, each pair planned and
    timed by its own view, as the node simulator's physics does; None: `model` prices every pair.
    With `continuous`, a plan that does not start an urgent rollout piece is an error.
    `fallback` off: a policy that raises is a PolicyFailed, not a plan of the node state's
    fallback (what measuring the policy needs); on, the node goes on as a live one does.
    `slo`: a slowdown SLO per pipeline name (graph/slo.py), registered as `jigsaw run --slo`.
    `computes`: (pipeline, sub-stage id) of tools that compute on the node's CPU, asked for as a
    live client asks for them (protocol.Admit.computes): the policy sees their pipeline at work
    on the host (view.host_frac), which a CPU node's config keeps cores free for.
    `jobs`: asynchronous jobs, job -> (mode its sides tell the node, "" for none; staleness
    bound): pipeline `job` is its rollout side, `job.train` its training side, and a piece of
    one starts only once the sample buffer lets it (graph/buffer.py `buffer_edges`)."""
    state = NodeState(node, model, policy or Jigsaw(config=config), next_step=False, fallback=fallback,
                      pairs=pairs)
    for ps in pipelines:
        if ps.done or ps.running:
            raise ValueError(f"execute() starts pipelines from scratch; {ps.graph.pipeline} has work done")
        name = ps.graph.pipeline
        job = name.removesuffix(TRAIN_SUFFIX)
        job = job if job in jobs else ""
        mode, bound = jobs.get(job, ("", 0))
        state.register(name, tuple(ps.devices), static=ps.graph, steps=1, slo_slowdown=(slo or {}).get(name),
                       job=job, mode=mode, staleness=bound)
    footprints = {(ps.graph.pipeline, s.id): s.mem_bytes for ps in pipelines for s in ps.graph.substages}
    run = _Run(state, model, config.balance, continuous, fallback, footprints, pairs, computes)
    run.waits = _buffer_waits({ps.graph.pipeline: ps.graph for ps in pipelines}, jobs)
    while not run.done():
        if len(run.plans) >= max_plans:
            raise run.failed(f"no completion after {max_plans} plans")
        run.step()
    run.close()
    finish = tuple((name, run.finish_s.get(name, 0.0)) for name in state.pipelines)
    return Execution(makespan_s=max((f for _, f in finish), default=0.0), finish_s=finish,
                     intervals=tuple(sorted(run.intervals, key=lambda iv: (iv.start_s, iv.substage))),
                     plans=tuple(run.plans), fallbacks=tuple(run.fallbacks),
                     steps=tuple((name, p.step_outcomes()) for name, p in state.pipelines.items()))


def _buffer_waits(graphs: Mapping[str, SubStageGraph], jobs: Mapping[str, tuple[str, int]]) -> dict:
    """(pipeline, id) -> the (pipeline, id) of the other side it waits for through the buffer."""
    waits: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for job, (_, bound) in jobs.items():
        if job not in graphs or train_side(job) not in graphs:
            raise ValueError(f"job {job!r} needs pipelines {job!r} and {train_side(job)!r}")
        for a, b in buffer_edges(graphs[job], graphs[train_side(job)], bound):
            waits.setdefault((pipeline_of(b), b), []).append((pipeline_of(a), a))
    return waits


class _Run:
    """The executor's clock, the work left of running replicas, and what it recorded."""

    def __init__(self, state: NodeState, model, balanced: bool, continuous: bool, fallback: bool,
                 footprint_bytes: dict[tuple[str, str], int], pairs=None,
                 computes: frozenset[tuple[str, str]] = frozenset()):
        self.state, self.model, self.balanced, self.continuous = state, model, balanced, continuous
        self.computes = computes
        self.pairs = pairs
        self.fallback = fallback
        self.fallbacks: list[str] = []
        self.footprint_bytes = footprint_bytes
        """Each sub-stage's memory footprint, from the graphs it was given (what acting needs)."""
        self.t = 0.0
        self.left: dict[tuple[str, str], float] = {}
        """Exclusive seconds left of each running replica (what really happens)."""
        self.asked: set[tuple[str, str]] = set()
        self.plans: list[Plan] = []
        self.intervals: list[Interval] = []
        self.open: dict[tuple[str, str], Interval] = {}
        self.finish_s: dict[str, float] = {}
        self.waits: dict[tuple[str, str], list[tuple[str, str]]] = {}
        """What a piece of an asynchronous job's side waits for on the other (`_buffer_waits`)."""

    def done(self) -> bool:
        return all(len(p.finished) >= len(p.static) for p in self.state.pipelines.values())

    def failed(self, reason: str) -> PolicyFailed:
        first = (reason.strip().splitlines() or [""])[0]
        return PolicyFailed(Refused(policy=self.state.policy.name, time_s=self.t, reason=first))

    def step(self) -> None:
        self._ask()
        d = self._decide()
        self.plans.append(d.plan)
        for adm in d.admitted:
            p = self.state.pipelines[adm.held.pipeline]
            self.left[(p.name, adm.sid)] = p.static[adm.sid].duration_s
        handed = {h.sid for h in d.moved}
        for m in d.plan.migrations:  # the source's requests now run on the target
            if m.source in handed:
                self.left.pop((m.pipeline, m.source), None)
                self.left[(m.pipeline, m.target)] = m.target_remaining_s
                self._end_chain(self.state.pipelines[m.pipeline], m.source)
        units = self._units(d)
        if not units:
            raise self.failed("the schedule is stuck: nothing runs and work is left")
        dt = min(left / rate for left, rate, _, _ in units)
        self._record(d, self.t + dt)
        self.t += dt
        self._advance(units, dt)

    def _decide(self) -> Decision:
        """The node state's decision now, one the policy made and the node can enact; else a
        PolicyFailed saying why."""
        try:
            d = self.state.decide(self.t)
        except Exception as exc:  # noqa: BLE001 - whatever the policy raised is why it failed
            raise self.failed(f"{type(exc).__name__}: {exc}") from exc
        if d is None:
            raise self.failed("the schedule is stuck: nothing waits or runs and work is left")
        if d.fallback:
            if not self.fallback:  # the node state's liveness guard falls back on its own
                raise self.failed(d.fallback)
            self.fallbacks.append(f"t={self.t:.6f}: {d.fallback}")
        missed = [sid for p in self.state.pipelines.values() for sid, w in p.waiting.items() if w.urgent]
        if self.continuous and missed:
            raise self.failed(f"the plan does not continue rollout piece(s) {missed[:3]}")
        if d.notes:
            raise self.failed(f"the plan cannot take effect: {d.notes[0]}")
        return d

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
            self.state.skip(p.name, s.id)
            todo.extend(g.successors(s.id))

    def _ask(self) -> None:
        """Every sub-stage whose dependencies are done asks to start."""
        for p in self.state.pipelines.values():
            g = p.static
            for s in g.frontier(p.finished, ()):
                key = (p.name, s.id)
                if key not in self.asked and self._buffered(key):
                    self.asked.add(key)
                    self.state.request(p.name, s.kind, s.dp_rank, s.step, self.t, sid=s.id,
                                       urgent=self._continues(p, s), computes=key in self.computes)

    def _buffered(self, key: tuple[str, str]) -> bool:
        """The sample buffer lets the piece start: what it waits for on the other side is done."""
        pipes = self.state.pipelines
        return all(sid in pipes[name].finished for name, sid in self.waits.get(key, ()))

    def _continues(self, p: LivePipeline, s) -> bool:
        """A rollout piece right after its worker's previous piece (or tool wait) ended."""
        g = p.static
        return self.continuous and s.kind.is_rollout and any(
            g[d].dp_rank == s.dp_rank and (g[d].kind.is_rollout or g[d].kind is SubStageKind.TOOL)
            for d in g.deps[s.id])

    def _units(self, d: Decision) -> list[tuple[float, float, str, list[Held]]]:
        """(work left, rate, pipeline, holders) per unit: a holder, or a gang's holders."""
        slow = self._slowdowns(d)
        groups: dict[tuple, list[Held]] = {}
        for h in d.holders:
            p = self.state.pipelines[h.pipeline]
            groups.setdefault((h.pipeline, p.gang_key(h.sid) if h.kind.collective else h.sid), []).append(h)
        units = []
        for (name, _), hs in groups.items():
            s = [slow.get((name, h.sid), 1.0) for h in hs]
            rate = gang_rate(s, self.balanced and any(h.micro_batch is not None for h in hs)) \
                if len(hs) > 1 else 1.0 / s[0]
            units.append((max(self.left[(name, h.sid)] for h in hs), rate, name, hs))
        return units

    def _slowdowns(self, d: Decision) -> dict[tuple[str, str], float]:
        """What the grid says for what really shares each device (the plan's own prediction
        is not trusted: this is the effect side)."""
        out = {}
        for dev, group in layout(d.holders).items():
            view = self.model if self.pairs is None else self.pairs.between(group[0].pipeline, group[-1].pipeline)
            got = view.actual(*[self._unit(h) for h in group])
            if got is None or not all(math.isfinite(x) for x in got):  # a holder alone says inf
                raise self.failed(f"the plan gives {[h.sid for h in group]} budgets on device {dev} that the "
                                  "slowdown grid says do not fit")
            out.update({(h.pipeline, h.sid): s for h, s in zip(group, got)})
        return out

    def _unit(self, h: Held) -> tuple:
        """A holder as the grid prices it, (kind, σ, m, need over the device's memory), as the
        node simulator's physics does and the baselines plan: whether it fits is its need's
        to say, not the grid's nearest memory level (a training of 47% runs in half a device
        whose 40% level cannot hold it)."""
        need = grant_need_bytes(h.kind, self.footprint_bytes[(h.pipeline, h.sid)])
        return h.kind.value, h.budget.sm_frac, h.budget.mem_frac, need / self.state.node.mem_bytes

    def _advance(self, units, dt: float) -> None:
        for left, rate, name, hs in units:
            rest = left - dt * rate
            static = self.state.pipelines[name].static
            ends = rest <= EPS_S * max(1.0, max(static[h.sid].duration_s for h in hs))
            for h in hs:
                if ends:
                    del self.left[(name, h.sid)]
                    self.state.finish(name, h.sid, self.t)
                    self.finish_s[name] = max(self.finish_s.get(name, 0.0), self.t)
                else:
                    self.left[(name, h.sid)] = rest

    def _record(self, d: Decision, t1: float) -> None:
        """Extend or open one Interval per holder; close those whose budget changed."""
        slow = self._slowdowns(d)
        current = {}
        for h in d.holders:
            dev = h.device if h.on_device else None
            current[(h.pipeline, h.sid)] = (dev, h.budget.sm_frac if h.on_device else 0.0,
                                            slow.get((h.pipeline, h.sid), 1.0))
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
