"""A node's pipelines, their decisions, and the one place a Plan takes effect.

    register / request / finish / drop        (the daemon from messages; the simulator and the
        │                                      graph executor from their engines; no I/O here)
        ▼
    LivePipeline × K (live.py) ─► pipeline_state (view.py) ─► View ─► policy.plan ─► Plan
        │  guards: host work admitted at once; a request waiting max_wait_s turns urgent; a
        │  node where nothing runs admits its oldest request (liveness); a failing policy
        │  falls back to the oldest request per idle device, alone
        ▼
    apply(plan): admissions (waiting → running), budget changes of running sub-stages,
                 merge targets' new sizes, rates; what the plan got wrong is noted, not obeyed
    ─► Decision(plan, admitted, changed, notes) ─► grants (daemon) / engine starts (simulator)

Decision is kept apart from effect: `decide` returns what changed; sending grants, starting
engines and writing traces is the caller's.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace

from jigsaw.node.ledger import HOST, LivePipeline, Running, Waiting
from jigsaw.graph.plan import Assignment, Budget, Migration, NodeSpec, Plan
from jigsaw.graph.policy import Policy, View
from jigsaw.node.view import host_frac, pipeline_state

log = logging.getLogger("jigsaw.node")
EPS = 1e-9
MAX_MICRO_BATCH = 1 << 20


@dataclass(frozen=True, slots=True)
class Admission:
    waiting: Waiting
    """The request as it waited (its owner is who to answer)."""
    running: Running
    assignment: Assignment


@dataclass(frozen=True, slots=True)
class Decision:
    plan: Plan
    admitted: tuple[Admission, ...]
    changed: tuple[tuple[Running, Assignment], ...]
    """Running sub-stages whose budget the plan changes."""
    moved: tuple[Running, ...] = ()
    """Running sources of the plan's migrations, ended by it: their owners must be told where
    their requests go (nothing else of theirs changes)."""
    notes: tuple[str, ...] = ()
    """What the plan got wrong and the applier did not obey (kept budgets, refused pairs)."""
    fallback: str = ""
    """Why the policy's plan was not used ("" when it was)."""

    def record(self) -> dict:
        """The decision as plain data (a trace's plan event): enough to compare a replay with."""
        return {"started": list(self.plan.started),
                "assignments": [[a.substage, a.device, a.sm_frac, a.mem_bytes, a.slowdown, a.micro_batch]
                                for a in self.plan.assignments],
                "decisions": list(self.plan.decisions), "fallback": self.fallback, "notes": list(self.notes)}


class NodeState:
    """The pipelines sharing one node, and the decisions about them (module docstring)."""

    def __init__(self, node: NodeSpec, grid, policy: Policy, *, next_step: bool = True,
                 max_wait_s: float | None = None, liveness: bool = False, fallback: bool = True, pairs=None):
        self.node, self.grid, self.policy, self.pairs = node, grid, policy, pairs
        self.next_step, self.max_wait_s, self.liveness = next_step, max_wait_s, liveness
        self.fallback = fallback
        """A failing policy's group is decided by the fallback (live pipelines go on); False:
        the facts are restored and the error raised (a simulation measures the policy)."""
        self.pipelines: dict[str, LivePipeline] = {}
        self.failures = 0
        """Decisions in which the policy or the applier failed (the fallback decided)."""

    # ------------------------------------------------------------ facts

    def register(self, name: str, devices: tuple[int, ...] = (), **facts) -> LivePipeline:
        """A pipeline joins (its name is checked); `devices[r]` hosts DP rank r (default: r)."""
        if name in self.pipelines:
            raise ValueError(f"pipeline {name!r} is already registered")
        devs = tuple(devices) or tuple(range(self.node.num_devices))
        if len(set(devs)) != len(devs) or any(not 0 <= d < self.node.num_devices for d in devs):
            raise ValueError(f"devices {devs} must be distinct and on this node's 0..{self.node.num_devices - 1}")
        p = self.pipelines[name] = LivePipeline(name=name, devices=devs, **facts)
        return p

    def remove(self, name: str) -> LivePipeline | None:
        return self.pipelines.pop(name, None)

    def budget(self, a: Assignment) -> Budget:
        return Budget(sm_frac=a.sm_frac, mem_frac=a.mem_bytes / self.node.mem_bytes)

    def advance(self, now_s: float) -> None:
        """Bring every running sub-stage's work up to `now_s` (before budgets change)."""
        for p in self.pipelines.values():
            p.integrate(now_s)

    def finish(self, name: str, sid: str, now_s: float, *, final: bool = False, **numbers):
        """A sub-stage ended; (its Running, the finished SubStage)."""
        return self.pipelines[name].finish(sid, now_s, final=final, **numbers)

    # ------------------------------------------------------------ decisions

    def view(self, now_s: float) -> tuple[View, list[LivePipeline]]:
        live = [p for p in self.pipelines.values() if p.live]
        built = [pipeline_state(p, now_s, next_step=self.next_step) for p in live]
        view = View(time_s=now_s, pipelines=tuple(s for s, _ in built), progress=tuple(g for _, g in built),
                    node=self.node, model=self.grid, pairs=self.pairs, host_frac=host_frac(self.pipelines.values()))
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
        if not getattr(self.policy, "separable", False):
            return self._decide_safely(now_s)
        parts = [self._part(group) for group in self.groups()]
        decisions = [part._decide_safely(now_s) for part in parts if any(p.live for p in part.pipelines.values())]
        self.failures += sum(part.failures for part in parts if part is not self)
        return _merged(decisions, now_s)

    def groups(self) -> list[list[LivePipeline]]:
        """Pipelines joined by the devices they share (connected components)."""
        root = {d: d for p in self.pipelines.values() for d in p.devices}

        def find(d: int) -> int:
            while root[d] != d:
                root[d] = d = root[root[d]]
            return d

        for p in self.pipelines.values():
            for d in p.devices[1:]:
                root[find(d)] = find(p.devices[0])
        out: dict[int, list[LivePipeline]] = {}
        for p in self.pipelines.values():
            out.setdefault(find(p.devices[0]), []).append(p)
        return list(out.values())

    def _part(self, group: list[LivePipeline]) -> NodeState:
        """This node's state seen through one group of pipelines (the same objects)."""
        if len(group) == len(self.pipelines):
            return self
        part = NodeState(self.node, self.grid, self.policy, next_step=self.next_step, max_wait_s=self.max_wait_s,
                         liveness=self.liveness, fallback=self.fallback, pairs=self.pairs)
        part.pipelines = {p.name: p for p in group}
        return part

    def _decide_safely(self, now_s: float) -> Decision:
        before = _Snapshot(self.pipelines)
        try:
            return self._decide(now_s)
        except Exception as exc:  # noqa: BLE001 - a failing policy must not take the node down
            if not self.fallback:
                before.restore()
                raise
            log.exception("policy %s failed; admitting the oldest request per idle device alone", self.policy.name)
            before.restore()
            self.failures += 1
            why = f"{type(exc).__name__}: {exc}"
        try:
            return self._fallback(now_s, self._admit_host(now_s), why)
        except Exception:
            before.restore()
            raise

    def _decide(self, now_s: float) -> Decision:
        host = self._admit_host(now_s)
        plan = self._plan(now_s)
        if self.liveness and not self._admits(plan) and self._stalled() is not None:
            # even its urgent request was not started (a plan of sub-stages nobody asked for)
            return self._fallback(now_s, host, f"policy {self.policy.name} started nothing while nothing runs")
        d = self.apply(plan, now_s)
        return Decision(plan=d.plan, admitted=host + d.admitted, changed=d.changed, moved=d.moved, notes=d.notes)

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
            w.urgent = True  # nothing runs and nothing starts: the node would wait forever
            view, _ = self.view(now_s)
            plan = self.policy.plan(view)
        return plan

    def _admit_host(self, now_s: float) -> tuple[Admission, ...]:
        """Rewards and tool waits run on the host and hold no budget: admitted at once."""
        out = []
        for p in self.pipelines.values():
            for sid, w in list(p.waiting.items()):
                if not w.kind.on_device:
                    a = Assignment(substage=sid, pipeline=p.name, device=p.devices[w.rank], sm_frac=0.0,
                                   mem_bytes=0, slowdown=1.0)
                    out.append(Admission(waiting=w, running=p.admit(sid, a, HOST, now_s), assignment=a))
        return tuple(out)

    def _age(self, now_s: float) -> None:
        if self.max_wait_s is None:
            return
        for p in self.pipelines.values():
            for w in p.waiting.values():
                if now_s - w.since_s >= self.max_wait_s:
                    w.urgent = True

    def _admits(self, plan: Plan) -> bool:
        ids = {a.substage for a in plan.assignments}
        return any(sid in ids for p in self.pipelines.values() for sid in p.waiting)

    def _stalled(self) -> Waiting | None:
        """The oldest request, if nothing runs on the whole node."""
        if any(r.on_device for p in self.pipelines.values() for r in p.running.values()):
            return None
        waiting = [w for p in self.pipelines.values() for w in p.waiting.values()]
        return min(waiting, key=lambda w: w.since_s) if waiting else None

    def _fallback(self, now_s: float, host: tuple[Admission, ...], why: str) -> Decision:
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
                admitted.append(Admission(waiting=w, running=p.admit(w.sid, a, self.budget(a), now_s), assignment=a))
        for p in self.pipelines.values():
            p.refresh_rates(balanced=False)
        plan = Plan(time_s=now_s, started=tuple(x.assignment.substage for x in admitted),
                    assignments=tuple(x.assignment for x in admitted))
        return Decision(plan=plan, admitted=host + tuple(admitted), changed=(), fallback=why)

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
        self._check(plan)
        self.advance(now_s)
        by_id = {a.substage: a for a in plan.assignments}
        admitted, changed = [], []
        for p in self.pipelines.values():
            for sid, w in list(p.waiting.items()):
                a = by_id.get(sid)
                if a is not None and a.device == p.devices[w.rank]:
                    admitted.append(Admission(waiting=w, running=p.admit(sid, a, self.budget(a), now_s), assignment=a))
        moved: list[Running] = []
        notes = self._merge(plan, now_s, admitted, moved)
        for p in self.pipelines.values():
            for sid, r in p.running.items():
                if not r.on_device:
                    continue
                a = by_id.get(sid)
                if a is None or a.device != r.device:
                    notes.append(f"{sid} keeps its budget on device {r.device}: the plan "
                                 + ("left it out" if a is None else f"moved it to device {a.device}"))
                elif p.regrant(r, a, self.budget(a)):
                    changed.append((r, a))
        balanced = any(a.micro_batch is not None for a in plan.assignments)
        for p in self.pipelines.values():
            p.refresh_rates(balanced)
        notes += self.overcommitted()
        return Decision(plan=plan, admitted=tuple(admitted), changed=tuple(changed), moved=tuple(moved),
                        notes=tuple(notes))

    def _check(self, plan: Plan) -> None:
        for a in plan.assignments:
            ok = (0.0 <= a.sm_frac <= 1.0 and 0 <= a.mem_bytes <= self.node.mem_bytes
                  and math.isfinite(a.slowdown) and a.slowdown > 0.0
                  and (a.micro_batch is None or 1 <= a.micro_batch <= MAX_MICRO_BATCH))
            if not ok:
                raise ValueError(f"plan assigns {a.substage} a budget no device has: {a.sm_frac} SMs, "
                                 f"{a.mem_bytes} bytes, slowdown {a.slowdown}, micro-batch {a.micro_batch}")

    def _merge(self, plan: Plan, now_s: float, admitted: list[Admission], moved: list[Running]) -> list[str]:
        """Migrations: a source is done (its requests go to the target, whose exclusive time
        left becomes the merged tail's) and goes to `moved`, so its owner learns of the order;
        its later report of the end is a no-op.  A source still waiting (the plan merged it
        away as it began) is answered with no budget and the order, so its owner is never left
        waiting."""
        notes = []
        for m in plan.migrations:
            p = self.pipelines.get(m.pipeline)
            if p is not None and m.source in p.waiting:
                w = p.waiting[m.source]
                a = Assignment(substage=m.source, pipeline=p.name, device=p.devices[w.rank], sm_frac=0.0,
                               mem_bytes=0, slowdown=1.0)
                admitted.append(Admission(waiting=w, running=p.admit(m.source, a, HOST, now_s), assignment=a))
            if p is None or m.source not in p.running or m.target not in p.running:
                notes.append(f"migration {m.source} -> {m.target} ignored: both must be running")
                continue
            self._hand_over(p, m, now_s, moved)
        return notes

    @staticmethod
    def _hand_over(p: LivePipeline, m: Migration, now_s: float, moved: list[Running]) -> None:
        """The source ends now (into `moved`; its owner's report of the end comes later and is a
        no-op) and the target, if running and priced, is expected to take what it took on."""
        moved.append(p.running[m.source])
        p.finish(m.source, now_s)
        p.merged_away.add(m.source)
        target = p.running.get(m.target)
        if target is not None and m.target_remaining_s > 0:
            target.expected_s = target.work_s + m.target_remaining_s

    def migrate(self, pipeline: str, source_rank: int, target_rank: int, now_s: float) -> Decision:
        """An operator's order (not the scheduler's): the rollout regime running on DP rank
        `source_rank` hands its requests to `target_rank`, whose regime (if one runs) takes
        them on; a ValueError says why nothing can move, and nothing changes then."""
        p = self.pipelines.get(pipeline)
        if p is None:
            raise ValueError(f"no pipeline {pipeline!r} on this node")
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
        moved: list[Running] = []
        self._hand_over(p, m, now_s, moved)
        return Decision(plan=Plan(time_s=now_s, started=(), assignments=(), migrations=(m,)), admitted=(), changed=(),
                        moved=tuple(moved))

    def overcommitted(self) -> list[str]:
        """Devices holding more than two sub-stages, SMs or memory beyond capacity."""
        on: dict[int, list[Running]] = {}
        for p in self.pipelines.values():
            for r in p.running.values():
                if r.on_device:
                    on.setdefault(r.device, []).append(r)
        out = []
        for d, rs in sorted(on.items()):
            sm = sum(r.budget.sm_frac for r in rs)
            shared = len(rs) == 2 and all(r.budget.sm_frac >= 1.0 - EPS for r in rs)  # unpartitioned (MPS) pair
            if len(rs) > 2 or (sm > 1.0 + EPS and not shared) or sum(r.budget.mem_frac for r in rs) > 1.0 + EPS:
                out.append(f"device {d} is overcommitted: " + ", ".join(
                    f"{r.sid} ({r.budget.sm_frac:.0%} SMs, {r.budget.mem_frac:.0%} memory)" for r in rs))
        return out


class _Snapshot:
    """The facts a decision may change, to put back when it fails (the view's memo is
    invalidated: versions move on past anything the failed attempt cached)."""

    def __init__(self, pipelines: dict[str, LivePipeline]):
        self.saved = [(p, dict(p.waiting), {sid: replace(r) for sid, r in p.running.items()}, set(p.merged_away),
                       set(p.ended), dict(p.finished), dict(p.first_start_s)) for p in pipelines.values()]

    def restore(self) -> None:
        for p, waiting, running, merged_away, ended, finished, first_start_s in self.saved:
            p.waiting, p.merged_away, p.ended = dict(waiting), set(merged_away), set(ended)
            p.running = {sid: replace(r) for sid, r in running.items()}
            p.finished, p.first_start_s = dict(finished), dict(first_start_s)
            p.version += 1


def _rollout_on(p: LivePipeline, rank: int) -> Running | None:
    """The rollout regime running on DP rank `rank` (the latest begun, if several)."""
    on = [r for r in p.running.values() if r.rank == rank and r.kind.is_rollout]
    return max(on, key=lambda r: r.start_s) if on else None


def _merged(decisions: list[Decision], now_s: float) -> Decision:
    """The decisions of separately planned groups as one."""
    if len(decisions) == 1:
        return decisions[0]
    plans = [d.plan for d in decisions]
    plan = Plan(time_s=now_s, started=sum((p.started for p in plans), ()),
                assignments=sum((p.assignments for p in plans), ()), migrations=sum((p.migrations for p in plans), ()),
                routing=sum((p.routing for p in plans), ()), cost_s=max(p.cost_s for p in plans),
                decisions=sum((p.decisions for p in plans), ()))
    return Decision(plan=plan, admitted=sum((d.admitted for d in decisions), ()),
                    changed=sum((d.changed for d in decisions), ()), moved=sum((d.moved for d in decisions), ()),
                    notes=sum((d.notes for d in decisions), ()),
                    fallback="; ".join(d.fallback for d in decisions if d.fallback))
