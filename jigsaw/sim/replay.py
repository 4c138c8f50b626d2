"""Replay a recorded trace (simulator or runtime, one format): its work, or its decisions.

    re-pack:   Trace ─► per sub-stage: grant/release intervals on devices (exclusive time =
               Σ interval / slowdown), host intervals, memory held ─► SubStage
               └─► assemble_step_graph per (pipeline, step) ─► steps chained ─► PipelineState
                   ─► jigsaw.sim.execute.execute(any policy, no fallback) ─► Execution, or
                      Refused(policy, time, why) where the policy failed (never a row another
                      scheduler computed)
    decisions: a daemon's trace ─► the requests it took (node/inputs.py reads them back:
               Admit, Done, Progress, …; registrations, drops, operator migrations) fed in
               order through the daemon's own Inbox to a fresh NodeState with the recorded
               policy and configuration ─► at each recorded plan, decide() again (an
               operator's migration: applied as the daemon did) ─► the same plans, or the
               first difference

What re-packs is the recorded work at sub-stage granularity: the same sub-stages with
their exclusive durations, re-packed by another policy (no forward-step re-simulation,
so rollout regimes and tails are as recorded).  The placement is the recorded one:
policies that split the node into pools (rollmux, hrrs) keep their ordering rules but
not their pools, and a consolidated tail keeps its worker's later pieces.  A piece needs
the memory it reported: a stage its largest, a rollout engine, whose pool follows its
grant, its smallest (`_footprints`).  A policy that fails is Refused, with why.  A decision
replay runs the daemon's own code path (view, policy, applier) on the daemon's own inputs,
so it must reproduce every plan exactly.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, replace

from jigsaw.graph.builder import assemble_step_graph
from jigsaw.graph.ids import SubStageId
from jigsaw.graph.plan import NodeSpec, PipelineState, SchedulerConfig
from jigsaw.graph.policy import Needs, PipelineNeeds, refusal
from jigsaw.graph.substage import SubStage, SubStageKind
from jigsaw.sim.execute import Execution, PolicyFailed, Refused, execute
from jigsaw.trace import Trace, TraceEvent


@dataclass(frozen=True, kw_only=True, slots=True)
class Recorded:
    """What a trace says about its pipelines."""

    pipelines: tuple[PipelineState, ...]
    tokens: dict[str, int]
    meta: dict[str, dict]
    num_devices: int
    node: dict | None = None
    """A daemon trace's node event (policy, scheduler config, profile), None for a simulator's."""
    computes: frozenset[tuple[str, str]] = frozenset()
    """(pipeline, sub-stage id) of every tool that computed on the node's CPU (a host event's
    `computes`: protocol.Admit.computes), replayed as such."""

    @property
    def config(self) -> SchedulerConfig:
        """The scheduler configuration the daemon decided with (its node event), else the
        default: on a CPU node it keeps cores free for host work (host_on_device)."""
        return _sched(self.node["sched"]) if self.node and "sched" in self.node else SchedulerConfig()


def recorded(trace: Trace, first_step: int = 0, factors: Mapping[str, float] | None = None) -> Recorded:
    """Rebuild every pipeline's step graphs from a trace; steps before `first_step` (a
    warm-up a measurement left out) are left out too.  `factors` (a calibration's, per kind)
    read every partitioned interval as the calibrated grid would have timed it."""
    pieces, starts = _pieces(trace, factors or {})
    pieces = [s for s in pieces if s.step >= first_step]
    tokens: dict[str, int] = defaultdict(int)
    meta = {e.pipeline: e.data for e in trace.events if e.event == "pipeline"}
    if sides := sorted(name for name, data in meta.items() if data.get("job")):
        raise ValueError(f"the trace holds asynchronous pipelines ({', '.join(sides)}): their sides wait on each "
                         "other's sample buffer, which the graphs a trace gives do not hold; they cannot be replayed")
    for e in trace.events:
        if e.event == "step" and int(e.data.get("step", 0)) >= first_step:
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
    node = next((e.data for e in trace.events if e.event == "node"), None)
    computes = frozenset((e.pipeline, e.substage) for e in trace.events if e.event == "host" and e.data.get("computes"))
    return Recorded(pipelines=tuple(states), tokens=dict(tokens), meta=meta, num_devices=max(devices, default=0) + 1,
                    node=node, computes=computes)


def _pieces(trace: Trace, factors: Mapping[str, float]) -> tuple[list[SubStage], dict[str, float]]:
    """SubStages with exclusive durations from grant/release pairs and host events."""
    times, first = held_times(trace, factors)
    mem = _footprints(trace)
    out = []
    for sid, t in times.items():
        name, step, rank, kind = _parse_id(sid)
        out.append(SubStage(id=sid, pipeline=name, step=step, kind=kind, dp_rank=rank,
                            duration_s=t.exclusive_s, mem_bytes=mem.get(sid, 0)))
    return _one_per_replica(out), first


def _footprints(trace: Trace) -> dict[str, int]:
    """Per sub-stage, the memory it needs to run: the footprint its grants reported, not the
    budget (a sub-stage alone is granted the whole device).  A training or reference stage
    needs its largest.  A rollout engine's KV pool follows its grant, so what it reported
    under a whole device is that device again (76 of 80 GiB for a long-CoT tail that ran on
    at 32): it needs its smallest, which it did run with and which holds its longest
    response; under a smaller budget the grid's memory axis prices the smaller batch."""
    mem: dict[str, int] = {}
    for e in trace.events:
        if e.event == "grant":
            need, was = int(e.data.get("need_bytes", e.mem_bytes)), mem.get(e.substage)
            pick = min if SubStageId.parse(e.substage).kind.is_rollout else max
            mem[e.substage] = need if was is None else pick(was, need)
    return mem


@dataclass(slots=True)
class Held:
    """How long one sub-stage of a trace ran, in all its intervals."""

    held_s: float = 0.0
    """Wall time under its grants (a host sub-stage: its host interval)."""
    exclusive_s: float = 0.0
    """The same intervals, each over the slowdown the grid gave it: its time on a whole device
    alone, as the grid sees it."""
    min_sm_frac: float = 1.0
    """The smallest share of a device it was granted."""


def held_times(trace: Trace, factors: Mapping[str, float] | None = None) -> tuple[dict[str, Held], dict[str, float]]:
    """Per sub-stage id, its `Held` times, and when it first started.  A kind in `factors` has
    each interval on a partition (σ < 1) over its recorded slowdown × the factor: what a grid
    calibrated by jigsaw.sim.calibrate gives that interval."""
    factors = factors or {}
    times: dict[str, Held] = defaultdict(Held)
    first: dict[str, float] = {}
    held: dict[tuple[str, int], tuple[str, float, float]] = {}
    for e in trace.events:
        if e.event == "grant":
            _close(held, times, (e.pipeline, e.device), e.t_s)
            scale = factors.get(SubStageId.parse(e.substage).kind.value, 1.0) if e.sm_frac < 1.0 else 1.0
            held[(e.pipeline, e.device)] = (e.substage, e.t_s, e.slowdown * scale)
            times[e.substage].min_sm_frac = min(times[e.substage].min_sm_frac, e.sm_frac)
            first.setdefault(e.substage, e.t_s)
        elif e.event == "release":
            _close(held, times, (e.pipeline, e.device), e.t_s)
        elif e.event == "host":
            dur = float(e.data["end_s"]) - e.t_s
            times[e.substage].held_s += dur
            times[e.substage].exclusive_s += dur
            first.setdefault(e.substage, e.t_s)
    end = max((e.t_s for e in trace.events), default=0.0)
    for key in list(held):  # a trace cut short: what still held a device ran until its end
        _close(held, times, key, end)
    return dict(times), first


def _parse_id(sid: str) -> tuple[str, int, int, SubStageKind]:
    """(pipeline, step, rank, kind) of a sub-stage id in a trace."""
    i = SubStageId.parse(sid)
    return i.pipeline, i.step, i.rank, i.kind


def _close(held: dict, times: dict[str, Held], key: tuple, t: float) -> None:
    got = held.pop(key, None)
    if got is not None:
        sid, t0, slow = got
        times[sid].held_s += t - t0
        times[sid].exclusive_s += (t - t0) / slow


def _one_per_replica(pieces: list[SubStage]) -> list[SubStage]:
    """Collective replicas ran in lockstep: give them their common (longest) exclusive time."""
    gang: dict[tuple, float] = {}
    for s in pieces:
        if s.kind.collective:
            key = (s.pipeline, s.step, s.kind)
            gang[key] = max(gang.get(key, 0.0), s.duration_s)
    return [replace(s, duration_s=gang[(s.pipeline, s.step, s.kind)]) if s.kind.collective else s for s in pieces]


def grid_of(rec: Recorded):
    """The slowdown grid the recording was decided with: a daemon's (its profile, or its
    default prior), else the analytic prior of the first simulated pipeline's model, device
    and deployment (pipeline events of the trace)."""
    from jigsaw.mux.model.grids import node_grid
    from jigsaw.mux.model.prior import analytic_prior
    from jigsaw.mux.model.specs import DEVICES, PriorConfig, model_from_config, register_model

    if rec.node is not None:
        return node_grid(rec.node.get("profile"))
    first = rec.meta.get(rec.pipelines[0].graph.pipeline) or {}
    missing = [k for k in ("model", "device", "prior") if k not in first]
    if missing:
        raise ValueError(f"the trace does not say the pipelines' {', '.join(missing)}: pass a profiled grid")
    if first["device"] not in DEVICES:
        raise ValueError(f"unknown device {first['device']!r} in the trace; known: {sorted(DEVICES)}")
    if "model_config" in first:  # a model the workload described by its shape
        register_model(first["model"], model_from_config(first["model_config"], "the trace's model_config"))
    return analytic_prior(DEVICES[first["device"]], first["model"], PriorConfig(**first["prior"]))


def recorded_tokens_per_s(trace: Trace, first_step: int = 0) -> float:
    """Tokens/s a recorded run measured over its steps from `first_step` on: their tokens over
    the earliest of those steps' starts to the latest end (what `jigsaw demo` reports of
    pipelines that ran at once; of a run one after the other the span holds start-ups too)."""
    steps = [e for e in trace.events if e.event == "step" and int(e.data.get("step", 0)) >= first_step]
    if not steps:
        raise ValueError(f"the trace has no step from step {first_step} on")
    span = max(e.t_s for e in steps) - min(e.t_s - float(e.data["latency_s"]) for e in steps)
    return sum(int(e.data.get("tokens", 0)) for e in steps) / span


def recorded_makespan_s(trace: Trace) -> float:
    """When the recorded run's last step ended."""
    return max((e.t_s for e in trace.events if e.event == "step"), default=0.0)


def replay(rec: Recorded, policy, grid, config: SchedulerConfig = SchedulerConfig(),
           pairs=None, slo=None) -> Execution | Refused:
    """Run the recorded pipelines' work to completion under `policy` alone: the node state's
    fallback is off, so a policy that fails is Refused, never a row the fallback computed.
    `pairs`: each pair of pipelines of different models priced by its own view (execute);
    `slo`: a slowdown SLO per pipeline name (execute)."""
    node = NodeSpec(num_devices=rec.num_devices, mem_bytes=grid.device.mem_bytes)
    why = refusal(policy, needs(rec, node.mem_bytes))
    if why is not None:  # what the simulator says before a run it would refuse
        return Refused(policy=policy.name, time_s=0.0, reason=why)
    try:
        return execute(rec.pipelines, node, grid, config, policy=policy, continuous=True, fallback=False,
                       pairs=pairs, slo=slo, computes=rec.computes)
    except PolicyFailed as exc:
        return exc.refused


def step_latencies(ex: Execution) -> dict[str, list[float]]:
    """Per pipeline, the latency of each of its steps in a replay: first sub-stage start to
    last end of that step."""
    spans: dict[tuple[str, int], list[float]] = defaultdict(lambda: [float("inf"), 0.0])
    for iv in ex.intervals:
        span = spans[(iv.pipeline, SubStageId.parse(iv.substage).step)]
        span[0], span[1] = min(span[0], iv.start_s), max(span[1], iv.end_s)
    out: dict[str, list[float]] = defaultdict(list)
    for (name, _), (start, end) in sorted(spans.items()):
        out[name].append(end - start)
    return dict(out)


def needs(rec: Recorded, device_mem_bytes: int) -> Needs:
    """What the recorded pipelines needed of one device: each reference and training stage
    the largest footprint it ran with (`_footprints`), the simulator's refusal asked of a
    recording.  A rollout engine's footprint is whatever its grant let its KV pool fill, not
    a need: rollouts are left out, as the planning leaves them (baselines._need_frac)."""
    out = []
    for ps in rec.pipelines:
        by_kind: dict[str, int] = {}
        for s in (s for s in ps.graph.substages if s.kind.on_device and not s.kind.is_rollout):
            by_kind[s.kind.value] = max(by_kind.get(s.kind.value, 0), s.mem_bytes)
        out.append(PipelineNeeds(name=ps.graph.pipeline, rollout_devices=tuple(ps.devices),
                                 train_devices=tuple(ps.devices), mem_bytes=by_kind))
    return Needs(device_mem_bytes=device_mem_bytes, pipelines=tuple(out))


@dataclass(frozen=True, kw_only=True, slots=True)
class DecisionReplay:
    """How a replay of a daemon's inputs compared with the daemon's plans."""

    plans: int
    """Recorded plans replayed."""
    differ: int
    """Inputs or plans that came out differently."""
    mismatches: tuple[str, ...]
    """The first few differences, empty when every plan was reproduced."""
    fallbacks: tuple[str, ...] = ()
    """Replayed plans the policy failed to make (the node's fallback decided), and why."""
    linked: int = 0
    """Replayed plans whose view linked an asynchronous job's sides through their buffer (a
    piece of one side waiting on a piece of the other): the plans its coupling entered."""


def replay_decisions(trace: Trace, grid=None, sched: SchedulerConfig | None = None,
                     compare: tuple[str, ...] = ("started", "assignments", "fallback")) -> DecisionReplay:
    """Feed a daemon trace's inputs to a fresh NodeState and re-decide at every plan event.
    `sched` replaces the recorded scheduler config (what would another setting have decided?);
    `compare`: the fields of a plan that must come out as recorded (without "assignments", a
    trace recorded by a scheduler that priced shares otherwise still checks what it started)."""
    from jigsaw.node.inputs import Inbox

    replaying = _Replaying(Inbox(_node_state(trace, grid, sched)))
    plans, linked, mismatches, fallbacks = 0, 0, [], []
    for e in trace.events:
        try:
            got = replaying.apply(e)
        except (KeyError, ValueError) as exc:
            mismatches.append(f"t={e.t_s:.6f} {e.event} {e.substage}: {exc}")
            continue
        if e.event == "request" and got != e.substage:
            mismatches.append(f"t={e.t_s:.6f}: request became {got}, recorded {e.substage}")
        if e.event == "plan":
            plans += 1
            linked += replaying.linked(e.t_s)
            mine = got.record() if got is not None else None
            if got is not None and got.fallback:
                fallbacks.append(f"t={e.t_s:.6f}: {got.fallback}")
            if mine is None or any(mine[k] != e.data.get(k) for k in compare):
                mismatches.append(f"t={e.t_s:.6f}: plan {_brief(mine)} differs from the recorded {_brief(e.data)}")
    return DecisionReplay(plans=plans, differ=len(mismatches), mismatches=tuple(mismatches[:20]),
                          fallbacks=tuple(fallbacks), linked=linked)


def _node_state(trace: Trace, grid, sched: SchedulerConfig | None):
    from jigsaw.graph.policies import make
    from jigsaw.node.state import NodeState

    node = next((e for e in trace.events if e.event == "node"), None)
    if node is None:
        raise ValueError("the trace has no node event: only a daemon's trace (jigsaw daemon --trace) replays "
                         "its decisions")
    cfg = node.data
    if grid is None:
        from jigsaw.mux.model.grids import node_grid

        grid = node_grid(cfg.get("profile"))
    sched = sched or _sched(cfg["sched"])
    return NodeState(NodeSpec(num_devices=cfg["devices"], mem_bytes=grid.device.mem_bytes), grid,
                     make(cfg["policy"], sched), next_step=sched.next_step, max_wait_s=cfg["max_wait_s"],
                     liveness=True)


def _sched(d: dict) -> SchedulerConfig:
    from jigsaw.graph.merge import MergeConfig

    d = dict(d)
    d["merge_config"] = MergeConfig(**d["merge_config"])
    if d.get("sm_budgets_frac") is not None:
        d["sm_budgets_frac"] = tuple(d["sm_budgets_frac"])
    return SchedulerConfig(**d)


class _Replaying:
    """One recorded input at a time, as the daemon took it (node/inputs.py's mapping)."""

    def __init__(self, inbox):
        self.inbox, self.state = inbox, inbox.state
        self.ordered = None
        """The decision an operator's migration made, for the plan event the daemon wrote of it."""

    def apply(self, e: TraceEvent):
        """For a request its new id, for a plan the Decision."""
        from jigsaw import protocol as pr
        from jigsaw.node import inputs

        if e.event == "pipeline" and e.pipeline not in self.state.pipelines:
            self.inbox.register(pr.Register(pipeline=e.pipeline, pid=1, devices=tuple(e.data["devices"]),
                                            steps=e.data.get("steps", 0), max_tokens=e.data.get("max_tokens", 0),
                                            slo_slowdown=e.data.get("slo_slowdown", 0.0),
                                            job=e.data.get("job", "")))
        elif e.event == "job" and e.pipeline in self.state.pipelines:  # the coupling its side's client said
            self.state.couple(e.pipeline, e.data["mode"], int(e.data["staleness"]))
        elif e.event == "migrate":
            m = inputs.message(e.event, e.data)
            self.ordered = self.state.migrate(m.pipeline, m.source_rank, m.target_rank, e.t_s)
        elif e.event == "done" and e.data.get("report") is False:  # a Done refused for its report
            self.inbox.release(e.pipeline, e.substage, e.t_s)
        elif (msg := inputs.message(e.event, {"substage": e.substage, **e.data})) is not None:
            # traces before protocol v7 kept a Done's sub-stage on the event only
            got = self.inbox.take(e.pipeline, msg, e.t_s)
            return got.sid if e.event == "request" else None
        elif e.event == "drop":
            if e.pipeline in self.state.pipelines:
                self.state.withdraw(e.pipeline, e.data["withdrawn"])
                if e.data["removed"]:
                    self.state.remove(e.pipeline)
                    self.inbox.forget(e.pipeline)
        elif e.event == "plan":
            if e.data.get("operator"):
                ordered, self.ordered = self.ordered, None
                return ordered
            return self.state.decide(e.t_s)
        return None


    def linked(self, now_s: float) -> bool:
        """Whether the node's view after the plan at `now_s` linked a job's sides."""
        view, _ = self.state.view(now_s)
        return any(ps.waits_for for ps in (*view.pipelines, *view.waiting))


def _brief(record: dict | None) -> str:
    if record is None:
        return "(none)"
    granted = ", ".join(f"{a[0]}@{a[2]:g}" for a in record["assignments"])
    return f"started {record['started']}, granted [{granted}]"
