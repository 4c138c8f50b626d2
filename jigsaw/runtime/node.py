"""The daemon's view of its node: registered pipelines, their live graphs, and decisions.

    Register / Admit / Done / StepEnd / lease expiry           (from daemon.py, no I/O here)
        │
        ▼
    LivePipeline × K: history of step graphs (finished sub-stages, exclusive time =
        │             measured time / granted slowdown), this step's done / running / pending
        ▼
    live_state(): predicted graph of this step (predict_next) + what really happened
        │          (requested sub-stages are ready; skipped predictions count as done)
        ▼
    schedule() ─► Plan ─► admissions (pending → running) and budget changes
        (liveness: a device with waiting requests and nothing running admits the oldest)

Decision is kept apart from effect: `NodeState.decide` returns the Plan and the grants
it implies; daemon.py sends them and writes the trace.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field, replace

from jigsaw.graph.builder import assemble_step_graph, predict_next
from jigsaw.graph.graph import SubStageGraph
from jigsaw.graph.plan import Assignment, Budget, NodeSpec, PipelineState, Plan, SchedulerConfig
from jigsaw.graph.schedule import schedule
from jigsaw.graph.substage import SubStage, SubStageKind

DEFAULT_DURATION_S = 1.0
"""Exclusive time assumed for a sub-stage kind never seen before."""
MIN_REMAINING_FRAC = 0.05


@dataclass(slots=True)
class Pending:
    sid: str
    session: str
    ident: bytes
    req: int
    since_s: float
    urgent: bool = False
    need_bytes: int = 0
    """Memory the client says the sub-stage needs (0: unknown; the grid's levels decide)."""


@dataclass(slots=True)
class Running:
    sid: str
    session: str
    device: int
    budget: Budget
    slowdown: float
    start_s: float
    mem_bytes: int
    """Granted memory budget."""
    need_bytes: int = 0


@dataclass(slots=True)
class LivePipeline:
    name: str
    devices: tuple[int, ...]
    step: int = 0
    clients: set[str] = field(default_factory=set)
    history: deque = field(default_factory=lambda: deque(maxlen=5))
    pieces: dict[str, SubStage] = field(default_factory=dict)
    first_start_s: dict[str, float] = field(default_factory=dict)
    ordinals: dict[tuple[int, str], int] = field(default_factory=dict)
    pending: dict[str, Pending] = field(default_factory=dict)
    running: dict[str, Running] = field(default_factory=dict)

    def close_step(self, new_step: int) -> None:
        """Finished sub-stages of the old step become one history graph."""
        if self.pieces:
            self.history.append(assemble_step_graph(self.pieces.values(), self.first_start_s))
        self.pieces, self.first_start_s, self.ordinals = {}, {}, {}
        self.step = new_step


@dataclass(frozen=True, slots=True)
class Admission:
    pending: Pending
    assignment: Assignment


@dataclass(frozen=True, slots=True)
class Decision:
    plan: Plan
    admitted: tuple[Admission, ...]
    changed: tuple[tuple[Running, Assignment], ...]
    """Running sub-stages whose budget the plan changes."""


class NodeState:
    def __init__(self, node: NodeSpec, grid, config: SchedulerConfig = SchedulerConfig()):
        self.node, self.grid, self.config = node, grid, config
        self.pipelines: dict[str, LivePipeline] = {}
        self.session_pipeline: dict[str, str] = {}

    # ------------------------------------------------------------ bookkeeping

    def register(self, pipeline: str, session: str, devices: tuple[int, ...]) -> LivePipeline:
        devs = devices or tuple(range(self.node.num_devices))
        if any(not 0 <= d < self.node.num_devices for d in devs):
            raise ValueError(f"devices {devs} outside this node's 0..{self.node.num_devices - 1}")
        p = self.pipelines.get(pipeline)
        if p is None:
            p = self.pipelines[pipeline] = LivePipeline(name=pipeline, devices=devs)
        p.clients.add(session)
        self.session_pipeline[session] = pipeline
        return p

    def pipeline_of(self, session: str) -> LivePipeline:
        name = self.session_pipeline.get(session)
        if name is None:
            raise KeyError(session)
        return self.pipelines[name]

    def request(self, session: str, kind: str, dp_rank: int, step: int, ident: bytes, req: int,
                now_s: float, urgent: bool = False, need_bytes: int = 0) -> str:
        """A sub-stage asks to start; returns its id (`<pipeline>/<step>/r<rank>/<kind>/<n>`)."""
        p = self.pipeline_of(session)
        k = SubStageKind(kind)
        if not 0 <= dp_rank < len(p.devices):
            raise ValueError(f"dp_rank {dp_rank} outside pipeline {p.name}'s 0..{len(p.devices) - 1}")
        if step < p.step:
            raise ValueError(f"step {step} of {p.name} already finished (now at step {p.step})")
        if step > p.step:
            p.close_step(step)
        n = p.ordinals.get((dp_rank, k.value), 0)
        p.ordinals[(dp_rank, k.value)] = n + 1
        sid = f"{p.name}/{step}/r{dp_rank}/{k.value}/{n}"
        p.pending[sid] = Pending(sid=sid, session=session, ident=ident, req=req, since_s=now_s, urgent=urgent,
                                 need_bytes=need_bytes)
        return sid

    def finish(self, session: str, sid: str, now_s: float, **numbers) -> tuple[Running, SubStage]:
        p = self.pipeline_of(session)
        r = p.running.pop(sid, None)
        if r is None or r.session != session:
            if r is not None:
                p.running[sid] = r
            raise ValueError(f"{sid} is not running for this session")
        rank, kind = int(sid.split("/")[2][1:]), SubStageKind(sid.split("/")[3])
        exclusive_s = max(now_s - r.start_s, 0.0) / max(r.slowdown, 1.0)
        piece = SubStage(id=sid, pipeline=p.name, step=int(sid.split("/")[1]), kind=kind, dp_rank=rank,
                         duration_s=exclusive_s, mem_bytes=r.need_bytes, **numbers)
        if int(sid.split("/")[1]) == p.step:
            p.pieces[sid] = piece
            p.first_start_s[sid] = r.start_s
        return r, piece

    def drop(self, session: str) -> tuple[list[Running], list[Pending], bool]:
        """A client left or its lease expired: its grants go back; the pipeline goes with
        its last client.  Returns (reclaimed, abandoned requests, pipeline removed)."""
        name = self.session_pipeline.pop(session, None)
        if name is None:
            return [], [], False
        p = self.pipelines[name]
        p.clients.discard(session)
        runs = [r for r in p.running.values() if r.session == session]
        pend = [q for q in p.pending.values() if q.session == session]
        for r in runs:
            del p.running[r.sid]
        for q in pend:
            del p.pending[q.sid]
        gone = not p.clients
        if gone:
            del self.pipelines[name]
        return runs, pend, gone

    # ------------------------------------------------------------ decisions

    def decide(self, now_s: float, max_wait_s: float = 2.0) -> Decision | None:
        live = [p for p in self.pipelines.values() if p.pending or p.running]
        if not any(p.pending for p in live):
            return None
        host = self._admit_host(live, now_s)
        if not any(p.pending for p in live):
            return Decision(plan=Plan(time_s=now_s, started=(), assignments=()), admitted=host, changed=())
        for p in live:  # a request that waited long enough starts whatever the plan says
            for q in p.pending.values():
                q.urgent = q.urgent or now_s - q.since_s >= max_wait_s
        plan = self._plan(live, now_s)
        if not self._admits(plan, live) and (q := self._stalled(live, plan)) is not None:
            q.urgent = True  # liveness: its device would stay idle otherwise
            plan = self._plan(live, now_s)
        d = self.effects(plan, live, now_s)
        return replace(d, admitted=host + d.admitted) if host else d

    @staticmethod
    def _admit_host(live: list[LivePipeline], now_s: float) -> tuple[Admission, ...]:
        """Rewards and tool calls run on the host: admitted at once, holding no budget."""
        out = []
        for p in live:
            for sid, q in list(p.pending.items()):
                if not SubStageKind(sid.split("/")[3]).on_device:
                    dev = p.devices[int(sid.split("/")[2][1:])]
                    a = Assignment(substage=sid, pipeline=p.name, device=dev, sm_frac=0.0, mem_bytes=0, slowdown=1.0)
                    del p.pending[sid]
                    p.running[sid] = Running(sid=sid, session=q.session, device=dev, budget=Budget(sm_frac=0.0,
                                             mem_frac=0.0), slowdown=1.0, start_s=now_s, mem_bytes=0)
                    out.append(Admission(pending=q, assignment=a))
        return tuple(out)

    def _plan(self, live: list[LivePipeline], now_s: float) -> Plan:
        states = [live_state(p, now_s) for p in live]
        return schedule(states, self.node, self.grid, self.config, time_s=now_s)

    @staticmethod
    def _admits(plan: Plan, live: list[LivePipeline]) -> bool:
        ids = {a.substage for a in plan.assignments}
        return any(sid in ids for p in live for sid in p.pending)

    @staticmethod
    def _stalled(live: list[LivePipeline], plan: Plan) -> Pending | None:
        busy = {r.device for p in live for r in p.running.values()}
        waiting = [(q.since_s, q, p) for p in live for q in p.pending.values()
                   if p.devices[int(q.sid.split("/")[2][1:])] not in busy]
        return min(waiting, key=lambda w: w[0])[1] if waiting else None

    def effects(self, plan: Plan, live: list[LivePipeline], now_s: float) -> Decision:
        by_id = {a.substage: a for a in plan.assignments}
        admitted, changed = [], []
        for p in live:
            for sid, r in list(p.running.items()):
                a = by_id.get(sid)
                if a is not None and (a.sm_frac, a.mem_bytes) != (r.budget.sm_frac, r.mem_bytes):
                    r.budget, r.mem_bytes, r.slowdown = self._budget(a), a.mem_bytes, a.slowdown
                    changed.append((r, a))
            for sid, q in list(p.pending.items()):
                if (a := by_id.get(sid)) is not None:
                    del p.pending[sid]
                    p.running[sid] = Running(sid=sid, session=q.session, device=a.device, budget=self._budget(a),
                                             slowdown=a.slowdown, start_s=now_s, mem_bytes=a.mem_bytes,
                                             need_bytes=q.need_bytes)
                    admitted.append(Admission(pending=q, assignment=a))
        return Decision(plan=plan, admitted=tuple(admitted), changed=tuple(changed))

    def _budget(self, a: Assignment) -> Budget:
        return Budget(sm_frac=a.sm_frac, mem_frac=a.mem_bytes / self.node.mem_bytes)


# ---------------------------------------------------------------- live graph

def live_state(p: LivePipeline, now_s: float) -> PipelineState:
    """The scheduler's input for one pipeline: the predicted step, corrected by what ran."""
    nodes, deps = _predicted(p)
    requested = set(p.pending) | set(p.running)
    skipped = _ancestors(requested | set(p.pieces), deps) - requested
    for sid in requested | set(p.pieces):
        deps[sid] = ()  # it is ready (it asked) or done, whatever the prediction said
        if sid not in nodes:
            nodes[sid] = p.pieces.get(sid) or _estimate(p, sid)
    graph = SubStageGraph(nodes.values(), {s: tuple(d for d in ds if d in nodes) for s, ds in deps.items()})
    on_device = {sid: r for sid, r in p.running.items() if r.budget.sm_frac > 0.0}
    done = skipped | set(p.pieces) | (set(p.running) - set(on_device))  # host work leaves the device free
    running = {sid: r.budget for sid, r in on_device.items()}
    remaining = {sid: max(nodes[sid].duration_s - (now_s - r.start_s) / max(r.slowdown, 1.0),
                          MIN_REMAINING_FRAC * nodes[sid].duration_s) for sid, r in on_device.items()}
    _lockstep(graph, done, running, remaining)
    urgent = frozenset(sid for sid, q in p.pending.items() if q.urgent and sid not in running)
    return PipelineState(graph=graph, devices=p.devices, done=frozenset(done), running=running,
                         remaining_s=remaining, urgent=urgent)


def _lockstep(graph: SubStageGraph, done: set[str], running: dict, remaining: dict) -> None:
    """A collective stage starts and ends on all its workers together in the scheduler's
    model; live workers ask and finish one by one.  Once one replica has started, the
    others count as running beside it (admitted as soon as they ask), and finished ones
    as running for a moment longer until the last one is done."""
    for gang in graph.gangs():
        ids = [s.id for s in gang]
        started = [sid for sid in ids if sid in running or sid in done]
        if not started or all(sid in done for sid in ids):
            continue
        budget = next((running[sid] for sid in ids if sid in running), None)
        for s in gang:
            if s.id not in running:
                done.discard(s.id)
                running[s.id] = budget or Budget(sm_frac=1.0, mem_frac=1.0)
                remaining[s.id] = remaining.get(s.id, MIN_REMAINING_FRAC * s.duration_s)


def _predicted(p: LivePipeline) -> tuple[dict[str, SubStage], dict[str, tuple[str, ...]]]:
    if not p.history:
        return {}, {}
    pred = predict_next(list(p.history))
    rename = {s.id: f"{p.name}/{p.step}/{s.id.split('/', 2)[2]}" for s in pred}
    nodes = {rename[s.id]: replace(s, id=rename[s.id], step=p.step) for s in pred}
    deps = {rename[s]: tuple(rename[d] for d in ds) for s, ds in pred.deps.items()}
    return nodes, deps


def _estimate(p: LivePipeline, sid: str) -> SubStage:
    kind, rank = SubStageKind(sid.split("/")[3]), int(sid.split("/")[2][1:])
    seen = [s.duration_s for g in p.history for s in g if s.kind is kind]
    seen += [s.duration_s for s in p.pieces.values() if s.kind is kind]
    return SubStage(id=sid, pipeline=p.name, step=p.step, kind=kind, dp_rank=rank,
                    duration_s=statistics.median(seen) if seen else DEFAULT_DURATION_S)


def _ancestors(ids: set[str], deps: dict[str, tuple[str, ...]]) -> set[str]:
    """Predicted sub-stages before something that already asked or finished: the client
    went past them, so they will not be asked for in this step."""
    seen: set[str] = set()
    stack = [d for s in ids for d in deps.get(s, ())]
    while stack:
        s = stack.pop()
        if s not in seen:
            seen.add(s)
            stack.extend(deps.get(s, ()))
    return seen
