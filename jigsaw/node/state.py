"""A node's pipelines, their decisions, and the one place a Plan takes effect.

    register / request / finish / report / …  (worker messages through inputs.py, the daemon's,
        │                                      the simulator's and a replay's alike; the graph
        ▼                                      executor's static graphs; no I/O here)
    LivePipeline × K (ledger.py) ─► pipeline_state (view.py) ─► View ─► policy.plan ─► Plan
        │  guards: host work admitted at once; a request waiting max_wait_s turns urgent; a
        │  node where nothing runs admits its oldest request (liveness); a failing policy
        │  falls back to the oldest request per idle device, alone
        ▼
    apply(plan): admissions (waiting → running), budget changes of running sub-stages,
                 merge targets' new sizes, rates; what the plan got wrong is noted, not obeyed
    ─► Decision (effects.py: admitted, changed, moved, every holder after it, notes)
       ─► grants (daemon) / engine starts and physics (simulator) / timeline (graph executor)
    with a learner: every decision and finish notes where grants run on the grid; a finished
    grant is evidence for it (learning.py), and the refined grid is planned with from the
    next decision on; a pipeline with nothing to measure its grants against has its next
    ones run alone as probes (the view's PipelineState.alone)

Decision is kept apart from effect: `decide` returns what changed, complete and frozen;
sending grants, starting engines and writing traces is the caller's, which never reads the
ledger again to do it.  Outside this package the node's facts are read through `pipelines`
(read-only views) and changed only through the methods below.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace

from jigsaw.graph.graph import SubStageGraph
from jigsaw.graph.model import PairModels, SlowdownModel
from jigsaw.graph.plan import Assignment, Budget, Migration, NodeSpec, Plan
from jigsaw.graph.policy import Policy, View
from jigsaw.graph.substage import SubStageKind
from jigsaw.node.effects import Admission, Decision, Held, layout, merged, overcommitted
from jigsaw.node.jobs import idle_sides, planned_together, with_buffers
from jigsaw.node.learning import GrantLog
from jigsaw.node.ledger import HOST, LiveNumbers, LivePipeline, Running, Saved, Waiting
from jigsaw.node.view import ViewMemo, host_frac, pipeline_state

log = logging.getLogger("jigsaw.node")
EPS = 1e-9
MAX_MICRO_BATCH = 1 << 20


@dataclass(frozen=True, kw_only=True, slots=True)
class Summary:
    """One pipeline as the node sees it now."""

    name: str
    step: int
    running: tuple[str, ...]
    waiting: tuple[str, ...]
    slo_slowdown: float | None = None
    """Its step SLO (None: none)."""
    slo_kept: int = 0
    """Finished steps within the SLO."""
    slo_steps: int = 0
    """Finished steps held to the SLO."""
    last_slowdown: float | None = None
    """The last finished step's latency over its exclusive time (None: no step finished)."""


def _summary(p: LivePipeline) -> Summary:
    kept, held = p.clock.attainment()
    last = p.clock.outcomes[-1].slowdown if p.clock.outcomes else None
    return Summary(name=p.name, step=p.step, running=tuple(p.running), waiting=tuple(p.waiting),
                   slo_slowdown=p.clock.slo_slowdown, slo_kept=kept, slo_steps=held, last_slowdown=last)


class _Changes:
    """What one decision of one group changed, as ledger objects (snapshotted into the
    Decision once the whole node is decided)."""

    def __init__(self, plan: Plan, fallback: str = ""):
        self.plan, self.fallback = plan, fallback
        self.admitted: list[tuple[LivePipeline, Running, Assignment]] = []
        self.changed: list[tuple[LivePipeline, Running]] = []
        self.moved: list[tuple[LivePipeline, Running]] = []
        self.orders: dict[str, tuple[Migration, ...]] = {}
        self.notes: list[str] = []

    def absorb(self, host: list[tuple[LivePipeline, Running, Assignment]]) -> _Changes:
        self.admitted[:0] = host
        return self


class NodeState:
    """The pipelines sharing one node, and the decisions about them (module docstring)."""

    def __init__(self, node: NodeSpec, grid: SlowdownModel, policy: Policy, *, next_step: bool = True,
                 max_wait_s: float | None = None, liveness: bool = False, fallback: bool = True,
                 pairs: PairModels | None = None, learner=None):
        """`learner`: a GridLearner over `grid` (mux/model/learned.py) fed by every finished
        grant; `grid` then follows its refined grid."""
        if learner is not None and (pairs is not None or learner.base != grid):
            raise ValueError("a learner refines the node grid it was built over, and only without pair views")
        self.node, self.grid, self.policy, self.pairs = node, grid, policy, pairs
        self.learner = learner
        self.grants = GrantLog(learner) if learner is not None else None
        """Where grants run on the grid, and what the learner took (None: no learner)."""
        if learner is not None:
            self.grid = learner.refined()  # a learner loaded from its file plans with what it knows
        self.next_step, self.max_wait_s, self.liveness = next_step, max_wait_s, liveness
        self.fallback = fallback
        """A failing policy's group is decided by the fallback (live pipelines go on); False:
        the facts are restored and the error raised (a simulation measures the policy)."""
        self.pipelines: dict[str, LivePipeline] = {}
        """Read them; change them only through the methods of this class."""
        self.failures = 0
        """Decisions in which the policy or the applier failed (the fallback decided)."""
        self._memos: dict[str, ViewMemo] = {}

    # ------------------------------------------------------------ facts

    def pipeline(self, name: str) -> LivePipeline:
        """Pipeline `name`'s facts (read-only views); ValueError if it is not on this node."""
        p = self.pipelines.get(name)
        if p is None:
            raise ValueError(f"no pipeline {name!r} on this node")
        return p

    def register(self, name: str, devices: tuple[int, ...] = (), *, steps: int | None = None, max_tokens: int = 0,
                 static: SubStageGraph | None = None, slo_slowdown: float | None = None, job: str = "",
                 mode: str = "", staleness: int = 0) -> LivePipeline:
        """A pipeline joins (its name is checked); `devices[r]` hosts DP rank r (default: r).
        `steps`: how many it runs (None: unknown); `max_tokens`: its response cap (turn
        lengths then tell how long a tail runs on); `static`: its whole graph, known ahead;
        `slo_slowdown`: its steps may take at most this × their exclusive time (graph/slo.py);
        `job`: the asynchronous job it is one side of ("": a job of its own), `mode` and
        `staleness` how that job's sides are coupled (graph/buffer.py; "": not said)."""
        if name in self.pipelines:
            raise ValueError(f"pipeline {name!r} is already registered")
        devs = tuple(devices) or tuple(range(self.node.num_devices))
        if len(set(devs)) != len(devs) or any(not 0 <= d < self.node.num_devices for d in devs):
            raise ValueError(f"devices {devs} must be distinct and on this node's 0..{self.node.num_devices - 1}")
        p = self.pipelines[name] = LivePipeline(name, devs, steps=steps, max_tokens=max_tokens, static=static,
                                                slo_slowdown=slo_slowdown, job=job, mode=mode,
                                                staleness=staleness)
        self._memos[name] = ViewMemo()
        return p

    def couple(self, name: str, mode: str, staleness: int) -> None:
        """A client of registered pipeline `name` says its job's coupling (a side registered
        first by `jigsaw run`, which does not know it)."""
        self.pipeline(name).couple(mode, staleness)

    def remove(self, name: str) -> LivePipeline | None:
        self._memos.pop(name, None)
        return self.pipelines.pop(name, None)

    def request(self, name: str, kind: SubStageKind, rank: int, step: int, now_s: float, **facts) -> Waiting:
        """A sub-stage of pipeline `name` asks to start (LivePipeline.request's facts)."""
        return self.pipeline(name).request(kind, rank, step, now_s, **facts)

    def finish(self, name: str, sid: str, now_s: float, *, final: bool = False, **numbers):
        """A sub-stage ended; (its Running, the finished SubStage), or None (see LivePipeline.finish).
        With a learner, the grant is offered as evidence and the grid refined."""
        p = self.pipeline(name)
        got = p.finish(sid, now_s, final=final, **numbers)
        if got is not None and self.grants is not None:
            self.grants.close(p, got[0], now_s, got[1])
            self.grants.note(now_s, self.pipelines.values())  # its partner now runs alone
            self.grid = self.learner.refined()
        return got

    def withdraw(self, name: str, sids: Iterable[str]) -> list[Waiting | Running]:
        """Requests and grants whose requester left; what was withdrawn."""
        p = self.pipeline(name)
        if self.grants is not None:
            for sid in sids:
                self.grants.forget(name, sid)
        return [f for sid in sids if (f := p.withdraw(sid)) is not None]

    def drop(self, name: str, whose: Callable[[object], bool]) -> list[Waiting | Running]:
        """Withdraw every request and grant of `name` whose owner `whose` names (its
        requesters left); what was withdrawn."""
        p = self.pipeline(name)
        gone = [f for f in (*p.waiting.values(), *p.running.values()) if f.owner is not None and whose(f.owner)]
        return self.withdraw(name, [f.sid for f in gone])

    def report(self, name: str, sid: str, live: LiveNumbers | None, need_bytes: int | None) -> None:
        """What an engine knows now of its piece `sid` (a piece a migration ended: nothing)."""
        p = self.pipeline(name)
        if sid not in p.merged_away:
            p.report(sid, live, need_bytes)

    def count(self, name: str, step: int, done: int, total: int) -> None:
        self.pipeline(name).count(step, done, total)

    def observe(self, name: str, turn_lengths: Iterable[int]) -> None:
        self.pipeline(name).observe(turn_lengths)

    def forecast(self, name: str, graph: SubStageGraph) -> None:
        self.pipeline(name).set_forecast(graph)

    def ran_open(self, name: str, rank: int, step: int, kind: SubStageKind | None) -> list[Waiting | Running]:
        """A worker of `name` ran a piece of `step` without the daemon; the requests it gave
        up on, withdrawn (see LivePipeline.ran_open)."""
        return self.pipeline(name).ran_open(rank, step, kind)

    def rollout_over(self, name: str, rank: int, step: int) -> None:
        self.pipeline(name).rollout_over(rank, step)

    def skip(self, name: str, sid: str) -> None:
        """A node of `name`'s static graph will not run (its work left with a migration)."""
        self.pipeline(name).skip(sid)


    # ------------------------------------------------------------ reading

    def owner(self, name: str, sid: str):
        """Who asked for `sid` while it waits or runs; None for one a migration ended;
        KeyError for any other."""
        p = self.pipeline(name)
        if sid in p.merged_away:
            return None
        f = p.running.get(sid) or p.waiting.get(sid)
        if f is None:
            raise KeyError(sid)
        return f.owner

    def waiting_requests(self) -> list[tuple[str, str, object]]:
        """(pipeline, id, owner) of every request waiting on the node."""
        return [(p.name, w.sid, w.owner) for p in self.pipelines.values() for w in p.waiting.values()]

    def summary(self) -> tuple[Summary, ...]:
        """Each pipeline's step, what of it runs and waits, and its finished steps against its SLO
        (status replies, metrics)."""
        return tuple(_summary(p) for p in self.pipelines.values())

    def budget(self, a: Assignment) -> Budget:
        return Budget(sm_frac=a.sm_frac, mem_frac=a.mem_bytes / self.node.mem_bytes)

    def advance(self, now_s: float) -> None:
        """Bring every running sub-stage's work up to `now_s` (before budgets change)."""
        for p in self.pipelines.values():
            p.integrate(now_s)

    # ------------------------------------------------------------ decisions

    def view(self, now_s: float) -> tuple[View, list[LivePipeline]]:
        live = [p for p in self.pipelines.values() if p.live]
        built = [pipeline_state(p, now_s, next_step=self.next_step, memo=self._memos[p.name]) for p in live]
        if self.grants is not None:  # a learner's probes (node/learning.py)
            built = [(replace(s, alone=a), g) if (a := self.grants.probes(p)) else (s, g)
                     for (s, g), p in zip(built, live)]
        idle = idle_sides(list(self.pipelines.values()))
        states = [s for s, _ in built] + [pipeline_state(p, now_s, next_step=self.next_step,
                                                         memo=self._memos[p.name])[0] for p in idle]
        states, waiting = with_buffers(states, live + idle, len(live))
        view = View(time_s=now_s, pipelines=tuple(states), progress=tuple(g for _, g in built),
                    waiting=tuple(waiting), node=self.node, model=self.grid, pairs=self.pairs,
                    host_frac=host_frac(self.pipelines.values()))
        return view, live

    def decide(self, now_s: float) -> Decision | None:
        """Re-plan the node at `now_s`; None when nothing waits or runs.  Pipelines that share
        no device are planned group by group when the policy is separable (time grows with
        the size of a group, not of the node).  All or nothing per group: a policy or
        applier that fails leaves the group's facts as they were and the fallback decides
        for that group alone; should even that fail, the facts are restored and the error
        raised."""
        self.advance(now_s)
        if not any(p.live for p in self.pipelines.values()):
            return None
        self._age(now_s)
        if not self.policy.separable:
            return self._snapshot([self._decide_safely(now_s)], now_s)
        parts = [self._part(group) for group in self.groups()]
        changes = [part._decide_safely(now_s) for part in parts if any(p.live for p in part.pipelines.values())]
        self.failures += sum(part.failures for part in parts if part is not self)
        return self._snapshot(changes, now_s)

    def groups(self) -> list[list[LivePipeline]]:
        """Pipelines joined by the devices they share, and an asynchronous job's sides by their
        buffer (connected components)."""
        return planned_together(list(self.pipelines.values()))

    def _part(self, group: list[LivePipeline]) -> NodeState:
        """This node's state seen through one group of pipelines (the same objects)."""
        if len(group) == len(self.pipelines):
            return self
        part = NodeState(self.node, self.grid, self.policy, next_step=self.next_step, max_wait_s=self.max_wait_s,
                         liveness=self.liveness, fallback=self.fallback, pairs=self.pairs)
        part.pipelines = {p.name: p for p in group}
        part._memos, part.grants = self._memos, self.grants  # a migration in the group taints the node's log
        return part

    def _decide_safely(self, now_s: float) -> _Changes:
        before = {p: p.save() for p in self.pipelines.values()}
        try:
            return self._decide(now_s)
        except Exception as exc:  # noqa: BLE001 - a failing policy must not take the node down
            if not self.fallback:
                _restore(before)
                raise
            log.exception("policy %s failed; admitting the oldest request per idle device alone", self.policy.name)
            _restore(before)
            self.failures += 1
            why = f"{type(exc).__name__}: {exc}"
        try:
            return self._fallback(now_s, self._admit_host(now_s), why)
        except Exception:
            _restore(before)
            raise

    def _decide(self, now_s: float) -> _Changes:
        host = self._admit_host(now_s)
        plan = self._plan(now_s)
        if self.liveness and not self._admits(plan) and self._stalled() is not None:
            # even its urgent request was not started (a plan of sub-stages nobody asked for)
            why = f"policy {self.policy.name} started nothing while nothing runs"
            if not self.fallback:  # a replay reports the policy's own failure, nobody else's plan
                raise RuntimeError(why)
            return self._fallback(now_s, host, why)
        return self._apply(plan, now_s).absorb(host)

    def due(self, now_s: float) -> bool:
        """A request has waited max_wait_s and is not urgent yet: decide now, whatever else
        happens (the daemon asks at every tick of its loop)."""
        return self.max_wait_s is not None and any(
            not w.urgent and now_s - w.since_s >= self.max_wait_s for p in self.pipelines.values()
            for w in p.waiting.values())

    def _plan(self, now_s: float) -> Plan:
        view, _ = self.view(now_s)
        plan = self.policy.plan(view)
        if self.liveness and not self._admits(plan) and (w := self._stalled()) is not None:
            self.pipelines[w[0]].urge(w[1].sid)  # nothing runs and nothing starts: the node would wait forever
            view, _ = self.view(now_s)
            plan = self.policy.plan(view)
        return plan

    def _admit_host(self, now_s: float) -> list[tuple[LivePipeline, Running, Assignment]]:
        """Rewards and tool waits run on the host and hold no budget: admitted at once."""
        out = []
        for p in self.pipelines.values():
            for sid, w in list(p.waiting.items()):
                if not w.kind.on_device:
                    a = Assignment(substage=sid, pipeline=p.name, device=p.devices[w.rank], sm_frac=0.0,
                                   mem_bytes=0, slowdown=1.0)
                    out.append((p, p.admit(sid, a, HOST, now_s), a))
        return out

    def _age(self, now_s: float) -> None:
        if self.max_wait_s is None:
            return
        for p in self.pipelines.values():
            for w in list(p.waiting.values()):
                if now_s - w.since_s >= self.max_wait_s:
                    p.urge(w.sid, aged=True)

    def _admits(self, plan: Plan) -> bool:
        ids = {a.substage for a in plan.assignments}
        return any(sid in ids for p in self.pipelines.values() for sid in p.waiting)

    def _stalled(self) -> tuple[str, Waiting] | None:
        """The oldest request (and its pipeline), if nothing runs on the whole node."""
        if any(r.on_device for p in self.pipelines.values() for r in p.running.values()):
            return None
        waiting = [(p.name, w) for p in self.pipelines.values() for w in p.waiting.values()]
        return min(waiting, key=lambda x: x[1].since_s) if waiting else None

    def _fallback(self, now_s: float, host: list, why: str) -> _Changes:
        """Per idle device, its oldest request alone on the whole device; a lockstep gang only
        whole, once every device its replicas need is idle (a part of a gang started beside
        another pipeline's work is a state no plan can continue)."""
        busy = {r.device for p in self.pipelines.values() for r in p.running.values() if r.on_device}
        order = sorted(((w.since_s, w.sid, p) for p in self.pipelines.values() for w in p.waiting.values()),
                       key=lambda x: (x[0], x[1]))
        admitted = []
        for _, sid, p in order:
            if sid not in p.waiting:  # started with its gang
                continue
            devices, members = self._needs(p, p.waiting[sid])
            if devices & busy:
                continue
            busy |= devices
            for w in members:
                a = Assignment(substage=w.sid, pipeline=p.name, device=p.devices[w.rank], sm_frac=1.0,
                               mem_bytes=self.node.mem_bytes, slowdown=1.0)
                admitted.append((p, p.admit(w.sid, a, self.budget(a), now_s), a))
        for p in self.pipelines.values():
            p.refresh_rates(balanced=False)
        plan = Plan(time_s=now_s, started=tuple(a.substage for _, _, a in admitted),
                    assignments=tuple(a for _, _, a in admitted))
        out = _Changes(plan, fallback=why)
        out.admitted = host + admitted
        return out

    @staticmethod
    def _needs(p: LivePipeline, w: Waiting) -> tuple[set[int], list[Waiting]]:
        """The devices a request needs idle to start alone, and the requests starting with it."""
        if not w.kind.collective:
            return {p.devices[w.rank]}, [w]
        key = p.gang_key(w.sid)
        on = {r.device for r in p.running.values() if r.kind.collective and p.gang_key(r.sid) == key}
        members = [m for m in p.waiting.values() if m.kind.collective and p.gang_key(m.sid) == key]
        return set(p.devices) - on, members

    # ------------------------------------------------------------ the applier

    def apply(self, plan: Plan, now_s: float) -> Decision:
        """Make `plan` the node's state (work integrated up to `now_s` first); a plan whose
        budgets are not physical raises before anything changes."""
        return self._snapshot([self._apply(plan, now_s)], now_s)

    def _apply(self, plan: Plan, now_s: float) -> _Changes:
        self._check(plan)
        self.advance(now_s)
        by_id = {a.substage: a for a in plan.assignments}
        out = _Changes(plan)
        for p in self.pipelines.values():
            for sid, w in list(p.waiting.items()):
                a = by_id.get(sid)
                if a is not None and a.device == p.devices[w.rank]:
                    out.admitted.append((p, p.admit(sid, a, self.budget(a), now_s), a))
        self._merge(plan, now_s, out)
        for p in self.pipelines.values():
            for sid, r in p.running.items():
                if not r.on_device:
                    continue
                a = by_id.get(sid)
                if a is None or a.device != r.device:
                    out.notes.append(f"{sid} keeps its budget on device {r.device}: the plan "
                                     + ("left it out" if a is None else f"moved it to device {a.device}"))
                elif p.regrant(sid, a, self.budget(a)):
                    out.changed.append((p, r))
        balanced = any(a.micro_batch is not None for a in plan.assignments)
        for p in self.pipelines.values():
            p.refresh_rates(balanced)
        out.notes += self.overcommitted()
        return out

    def _check(self, plan: Plan) -> None:
        for a in plan.assignments:
            ok = (0.0 <= a.sm_frac <= 1.0 and 0 <= a.mem_bytes <= self.node.mem_bytes
                  and math.isfinite(a.slowdown) and a.slowdown > 0.0
                  and (a.micro_batch is None or 1 <= a.micro_batch <= MAX_MICRO_BATCH))
            if not ok:
                raise ValueError(f"plan assigns {a.substage} a budget no device has: {a.sm_frac} SMs, "
                                 f"{a.mem_bytes} bytes, slowdown {a.slowdown}, micro-batch {a.micro_batch}")

    def _merge(self, plan: Plan, now_s: float, out: _Changes) -> None:
        """Migrations: a source is done (its requests go to the target, whose exclusive time
        left becomes the merged tail's) and goes to `moved`, so its owner learns of the order;
        its later report of the end is a no-op.  A source still waiting (the plan merged it
        away as it began) is answered with no budget and the order, so its owner is never left
        waiting."""
        done: dict[str, list[Migration]] = {}
        for m in plan.migrations:
            p = self.pipelines.get(m.pipeline)
            if p is not None and m.source in p.waiting:
                w = p.waiting[m.source]
                a = Assignment(substage=m.source, pipeline=p.name, device=p.devices[w.rank], sm_frac=0.0,
                               mem_bytes=0, slowdown=1.0)
                out.admitted.append((p, p.admit(m.source, a, HOST, now_s), a))
            if p is None or m.source not in p.running or m.target not in p.running:
                out.notes.append(f"migration {m.source} -> {m.target} ignored: both must be running")
                continue
            out.moved.append((p, p.hand_over(m.source, m.target, m.target_remaining_s, now_s)))
            self._taint(p.name, m.source, m.target)
            done.setdefault(m.pipeline, []).append(m)
        out.orders = {name: tuple(ms) for name, ms in done.items()}

    def migrate(self, pipeline: str, source_rank: int, target_rank: int, now_s: float) -> Decision:
        """An operator's order (not the scheduler's): the rollout regime running on DP rank
        `source_rank` hands its requests to `target_rank`, whose regime (if one runs) takes
        them on; a ValueError says why nothing can move, and nothing changes then."""
        p = self.pipeline(pipeline)
        if source_rank == target_rank or not all(0 <= r < len(p.devices) for r in (source_rank, target_rank)):
            raise ValueError(f"{pipeline} has DP ranks 0..{len(p.devices) - 1}: a migration moves requests from "
                             f"one to another (asked {source_rank} -> {target_rank})")
        source = _rollout_on(p, source_rank)
        if source is None:
            raise ValueError(f"{pipeline} has no rollout running on DP rank {source_rank}: nothing to migrate")
        target = _rollout_on(p, target_rank)
        m = Migration(pipeline=pipeline, source=source.sid, target=target.sid if target else "",
                      source_rank=source_rank, target_rank=target_rank, delta_s=0.0, target_remaining_s=0.0)
        self.advance(now_s)
        out = _Changes(Plan(time_s=now_s, started=(), assignments=(), migrations=(m,)))
        out.moved.append((p, p.hand_over(m.source, m.target, 0.0, now_s)))
        self._taint(pipeline, m.source, m.target)
        out.orders = {pipeline: (m,)}
        return self._snapshot([out], now_s)

    def overcommitted(self) -> list[str]:
        """Devices holding more than two sub-stages, SMs or memory beyond capacity."""
        return overcommitted(layout(self._holders()))

    def _taint(self, name: str, source: str, target: str) -> None:
        """A migration: its source ended early, its target took on requests (neither is evidence)."""
        if self.grants is not None:
            self.grants.forget(name, source)
            self.grants.taint(name, target)

    # ------------------------------------------------------------ snapshots

    def _snapshot(self, changes: list[_Changes], now_s: float) -> Decision:
        """The decision as frozen data: what changed, and every holder after it."""
        plans = [c.plan for c in changes]
        plan = plans[0] if len(plans) == 1 else Plan(
            time_s=now_s, started=sum((p.started for p in plans), ()),
            assignments=sum((p.assignments for p in plans), ()), migrations=sum((p.migrations for p in plans), ()),
            routing=sum((p.routing for p in plans), ()), cost_s=max(p.cost_s for p in plans),
            decisions=sum((p.decisions for p in plans), ()), slo=sum((p.slo for p in plans), ()))
        parts = [self._decision(c) for c in changes]
        d = merged(parts, plan)
        if self.grants is not None:
            self.grants.note(now_s, self.pipelines.values())
        return Decision(plan=d.plan, admitted=d.admitted, changed=d.changed, moved=d.moved,
                        holders=tuple(self._holders()), touched=d.touched, notes=d.notes, fallback=d.fallback,
                        orders=d.orders)

    def _decision(self, c: _Changes) -> Decision:
        admitted = tuple(Admission(held=_held(p, r), assignment=a) for p, r, a in c.admitted)
        changed = tuple(_held(p, r) for p, r in c.changed)
        touched = frozenset({x.held.device for x in admitted if x.held.on_device} | {h.device for h in changed})
        return Decision(plan=c.plan, admitted=admitted, changed=changed, moved=tuple(_held(p, r) for p, r in c.moved),
                        touched=touched, notes=tuple(c.notes), fallback=c.fallback, orders=c.orders)

    def _holders(self):
        for p in self.pipelines.values():
            for r in p.running.values():
                yield _held(p, r)


def _held(p: LivePipeline, r: Running) -> Held:
    return Held(sid=r.sid, pipeline=p.name, kind=r.kind, rank=r.rank, device=r.device, budget=r.budget,
                mem_bytes=r.mem_bytes, slowdown=r.slowdown, micro_batch=r.micro_batch, need_bytes=r.need_bytes,
                pids=r.pids, owner=r.owner, computes=r.computes)


def _restore(saved: dict[LivePipeline, Saved]) -> None:
    for p, s in saved.items():
        p.restore(s)


def _rollout_on(p: LivePipeline, rank: int) -> Running | None:
    """The rollout regime running on DP rank `rank` (the latest begun, if several)."""
    on = [r for r in p.running.values() if r.rank == rank and r.kind.is_rollout]
    return max(on, key=lambda r: r.start_s) if on else None
