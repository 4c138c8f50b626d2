"""Replay a recorded trace (simulator or runtime, one format) under any policy.

    Trace ─► per sub-stage: grant/release intervals on devices (exclusive time = Σ interval /
    │        slowdown), host intervals, memory held ─► SubStage
    └─► assemble_step_graph per (pipeline, step) ─► steps chained ─► PipelineState per pipeline
        ─► jigsaw.graph.execute.execute(policy adapted to the View interface) ─► Replay

What replays is the recorded work at sub-stage granularity: the same sub-stages with
their exclusive durations, re-packed by another policy (no forward-step re-simulation,
so rollout regimes and tails are as recorded).  The placement is the recorded one:
policies that split the node into pools (rollmux, hrrs) keep their ordering rules but
not their pools, and a consolidated tail keeps its worker's later pieces.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, replace

from jigsaw.graph.builder import assemble_step_graph
from jigsaw.graph.execute import Execution, execute
from jigsaw.graph.plan import NodeSpec, PipelineState, Plan, SchedulerConfig
from jigsaw.graph.substage import SubStage, SubStageKind
from jigsaw.sim.view import Progress, View
from jigsaw.trace import Trace


@dataclass(frozen=True, kw_only=True, slots=True)
class Recorded:
    """What a trace says about its pipelines."""

    pipelines: tuple[PipelineState, ...]
    tokens: dict[str, int]
    meta: dict[str, dict]
    num_devices: int


def recorded(trace: Trace) -> Recorded:
    """Rebuild every pipeline's step graphs from a trace."""
    pieces, starts = _pieces(trace)
    tokens: dict[str, int] = defaultdict(int)
    meta = {e.pipeline: e.data for e in trace.events if e.event == "pipeline"}
    for e in trace.events:
        if e.event == "step":
            tokens[e.pipeline] += int(e.data.get("tokens", 0))
    by_step: dict[tuple[str, int], list[SubStage]] = defaultdict(list)
    for s in pieces:
        by_step[(s.pipeline, s.step)].append(s)
    states, devices = [], [e.device for e in trace.events if e.device is not None]
    for name in sorted({p for p, _ in by_step}):
        graph = None
        for step in sorted(st for p, st in by_step if p == name):
            g = assemble_step_graph(by_step[(name, step)], starts)
            graph = g if graph is None else graph.then(g)
        placed = meta.get(name, {}).get("devices") or list(range(graph.num_dp_ranks))
        states.append(PipelineState(graph=graph, devices=tuple(placed)))
    if not states:
        raise ValueError("the trace holds no sub-stage: nothing to replay")
    return Recorded(pipelines=tuple(states), tokens=dict(tokens), meta=meta, num_devices=max(devices, default=0) + 1)


def _pieces(trace: Trace) -> tuple[list[SubStage], dict[str, float]]:
    """SubStages with exclusive durations from grant/release pairs and host events."""
    excl: dict[str, float] = defaultdict(float)
    mem: dict[str, int] = defaultdict(int)
    first: dict[str, float] = {}
    held: dict[tuple[str, int], tuple[str, float, float]] = {}
    for e in trace.events:
        if e.event == "grant":
            _close(held, excl, (e.pipeline, e.device), e.t_s)
            held[(e.pipeline, e.device)] = (e.substage, e.t_s, e.slowdown)
            # The footprint, not the budget (a sub-stage alone is granted the whole device).
            mem[e.substage] = max(mem[e.substage], int(e.data.get("need_bytes", e.mem_bytes)))
            first.setdefault(e.substage, e.t_s)
        elif e.event == "release":
            _close(held, excl, (e.pipeline, e.device), e.t_s)
        elif e.event == "host":
            excl[e.substage] += float(e.data["end_s"]) - e.t_s
            first.setdefault(e.substage, e.t_s)
    end = max((e.t_s for e in trace.events), default=0.0)
    for key in list(held):  # a trace cut short: what still held a device ran until its end
        _close(held, excl, key, end)
    out = []
    for sid, dur in excl.items():
        name, step, rank, kind = _parse_id(sid)
        out.append(SubStage(id=sid, pipeline=name, step=step, kind=kind, dp_rank=rank,
                            duration_s=dur, mem_bytes=mem.get(sid, 0)))
    return _one_per_replica(out), first


def _parse_id(sid: str) -> tuple[str, int, int, SubStageKind]:
    """(pipeline, step, rank, kind) of a builder id `pipeline/step/rRANK/kind/n`."""
    parts = sid.split("/")
    try:
        if len(parts) != 5 or not parts[2].startswith("r"):
            raise ValueError
        return parts[0], int(parts[1]), int(parts[2][1:]), SubStageKind(parts[3])
    except ValueError:
        raise ValueError(f"trace sub-stage id {sid!r} is not pipeline/step/rRANK/kind/n") from None


def _close(held: dict, excl: dict, key: tuple, t: float) -> None:
    got = held.pop(key, None)
    if got is not None:
        sid, t0, slow = got
        excl[sid] += (t - t0) / slow


def _one_per_replica(pieces: list[SubStage]) -> list[SubStage]:
    """Collective replicas ran in lockstep: give them their common (longest) exclusive time."""
    gang: dict[tuple, float] = {}
    for s in pieces:
        if s.kind.collective:
            key = (s.pipeline, s.step, s.kind)
            gang[key] = max(gang.get(key, 0.0), s.duration_s)
    return [replace(s, duration_s=gang[(s.pipeline, s.step, s.kind)]) if s.kind.collective else s for s in pieces]


class ViewAdapter:
    """Calls a View policy from the graph executor (which passes PipelineStates)."""

    def __init__(self, policy):
        self.policy = policy
        self.since: dict[str, tuple[str, float]] = {}

    def __call__(self, states, node: NodeSpec, model, config: SchedulerConfig, time_s: float) -> Plan:
        states = [ps for ps in states if len(ps.done) < len(ps.graph)]  # as the simulator: finished ones leave
        progress = tuple(self._progress(ps, time_s) for ps in states)
        return self.policy.plan(View(time_s=time_s, pipelines=tuple(states), progress=progress, node=node, model=model))

    def _progress(self, ps: PipelineState, t: float) -> Progress:
        left = [s for s in ps.graph if s.id not in ps.done]
        step = min((s.step for s in left), default=0)
        now = [s for s in left if s.step == step]
        stage = next((name for name, kinds in (("rollout", ("rollout", "tool")), ("reward", ("reward",)),
                                                ("reference", ("reference",)), ("training", ("training",)))
                      if any(s.kind.value.startswith(kinds) for s in now)), "training")
        prev = self.since.get(ps.graph.pipeline)
        if prev is None or prev[0] != (stage, step):
            self.since[ps.graph.pipeline] = prev = ((stage, step), t)
        rollout = [s for s in ps.graph if s.step == step and s.kind.is_rollout]
        done = sum(s.id in ps.done for s in rollout)
        return Progress(stage=stage, step=step, rollout_done_frac=done / len(rollout) if rollout else 1.0,
                        ready_since_s=prev[1])


def grid_of(rec: Recorded):
    """The slowdown grid the recording pipelines were simulated with: the analytic prior of
    the first pipeline's model, device and deployment (pipeline events of the trace)."""
    from jigsaw.mux.prior import DEVICES, PriorConfig, analytic_prior

    first = rec.meta.get(rec.pipelines[0].graph.pipeline) or {}
    missing = [k for k in ("model", "device", "prior") if k not in first]
    if missing:
        raise ValueError(f"the trace does not say the pipelines' {', '.join(missing)}: pass a profiled grid")
    if first["device"] not in DEVICES:
        raise ValueError(f"unknown device {first['device']!r} in the trace; known: {sorted(DEVICES)}")
    return analytic_prior(DEVICES[first["device"]], first["model"], PriorConfig(**first["prior"]))


def recorded_makespan_s(trace: Trace) -> float:
    """When the recorded run's last step ended."""
    return max((e.t_s for e in trace.events if e.event == "step"), default=0.0)


def replay(rec: Recorded, policy, grid, config: SchedulerConfig = SchedulerConfig()) -> Execution:
    """Run the recorded pipelines' work to completion under `policy` (a View policy)."""
    node = NodeSpec(num_devices=rec.num_devices, mem_bytes=grid.device.mem_bytes)
    return execute(rec.pipelines, node, grid, config, policy=ViewAdapter(policy), continuous=True)
