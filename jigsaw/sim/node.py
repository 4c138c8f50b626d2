"""Discrete-event simulation of K RL pipelines sharing one node under a policy.

    heap of Events keyed (time_s, priority, seq)        frozen records; ties fire in that order
        segment   a rollout worker's batch segment ended  ─► commit, re-plan the worker
        reward / gang   a host reward or a reference / training stage ended ─► next stage or step
    each engine's client sends the node the protocol requests a live worker would (report.py,
    through node/inputs.py as the daemon does): a worker's regime changes finish one
    sub-stage and ask for the next (urgent), stages ask and finish, engines say what they hold
    after all events at one time, if anything changed:
        NodeState.decide()  (node/state.py: the daemon's view, policy and applier) ─► Decision
        ─► admitted: workers and gangs start; migrations move requests; budgets from the
           Decision's holders ─► each worker's KV pool follows its memory budget ─► actual
           slowdowns (physics.py) for what really shares a device ─► workers re-timed
           (interrupt), gangs re-rated; requests an interrupt finished are counted; the one
           capacity check (node/effects.py) on what the engines hold
    every grant, release, migration and finished step goes to the Trace (a step with its
    exclusive time and SLO as the node state measured it: node/slo.py)

The simulator is the ground truth: slowdowns come from each model's own prior for what
really runs side by side (or from a true grid the run is given), not from the plan's
predictions.  A deployment no engine could run
(a response larger than a device's KV) or a plan a policy cannot make raises Infeasible.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import asdict, dataclass
from enum import IntEnum

from jigsaw.graph.plan import Budget, NodeSpec
from jigsaw.graph.state import gang_rate
from jigsaw.graph.substage import Stage, SubStageKind
from jigsaw.node.effects import Decision, overcommitted
from jigsaw.node.inputs import Inbox
from jigsaw.node.slo import step_fields
from jigsaw.node.state import NodeState
from jigsaw.sim.physics import Physics, floors
from jigsaw.sim.pipeline import DONE, REFERENCE, ROLLOUT, TRAINING, WAITING, PipelineRun
from jigsaw.sim.report import Clients, Decided
from jigsaw.sim.rollout import DoesNotFit
from jigsaw.trace import Trace, TraceEvent

EPS = 1e-9


class Priority(IntEnum):
    """Order of events at the same time: stages end before segments (they free devices)."""

    STAGE = 0
    SEGMENT = 1


@dataclass(frozen=True, slots=True)
class Event:
    time_s: float
    priority: Priority
    seq: int
    kind: str
    pipe: int
    rank: int = -1
    version: int = 0


@dataclass
class _Slot:
    """A unit holding a device: a rollout worker or a gang replica."""

    key: tuple
    kind: SubStageKind
    budget: Budget
    slowdown: float = 1.0
    sid: str = ""
    """Live sub-stage id it was granted for (a worker moves through several)."""


class Infeasible(ValueError):
    """The policy cannot run this deployment (its plan failed); the simulation stops."""


class Cut(RuntimeError):
    """The run passed the time it was given (`NodeSim.run(until_s=...)`) and was stopped."""


class NodeSim:
    """Runs pipelines to completion under `policy`; see the module docstring."""

    def __init__(self, runs: list[PipelineRun], node: NodeSpec, grid, policy, *, trace: bool = True,
                 next_step: bool = True, record: list | None = None, truth=None, learner=None):
        """`record`: a list that receives every request the clients send and every decision
        (report.Sent, report.Decided), to feed a daemon the same messages and compare.
        `truth`: the grid the physics runs by instead of `grid` (the policy still plans with
        `grid`); `learner`: a GridLearner over `grid`, fed as the daemon's is (NodeState)."""
        self.runs, self.node, self.grid, self.policy = runs, node, grid, policy
        self.physics = Physics.of(grid, runs) if truth is None else Physics(truth, None, [r.name for r in runs],
                                                                           floors(runs))
        # One set of pair views for the plan and the physics: a plan is priced as it runs.
        self.state = NodeState(node, grid, policy, next_step=next_step, fallback=False, pairs=self.physics.pairs,
                               learner=learner)
        self.clients = Clients(Inbox(self.state), record)
        self.heap: list[tuple] = []
        self.seq = itertools.count()
        self.t = 0.0
        self.versions: dict[tuple, int] = {}
        self.slots: dict[int, list[_Slot]] = {d: [] for d in range(node.num_devices)}
        self.trace = Trace() if trace else None
        self.decisions = 0
        self.violations: list[str] = []
        self.balanced_gangs = False
        self.fired: list[Event] = []
        self._routing: dict[str, tuple[float, ...]] = {}

    # ------------------------------------------------------------ loop

    def run(self, until_s: float | None = None) -> None:
        """Every pipeline to its last step; past `until_s` of simulated time, Cut."""
        self.until_s = until_s
        for run in self.runs:
            self._trace("pipeline", run.name, data={"workload": run.spec.name, "model": run.spec.model,
                                                    "device": run.spec.device, "devices": list(run.devices),
                                                    "prior": asdict(run.cost.config),
                                                    **({"job": run.job, "mode": run.spec.mode} if run.job else {}),
                                                    **({"model_config": run.spec.model_config}
                                                       if run.spec.model_config else {})})
            if run.job:  # what the daemon traces when a side's client says it
                self._trace("job", run.name, data={"job": run.job, "mode": run.spec.mode,
                                                   "staleness": run.spec.staleness_bound})
            self.clients.register(run)
            self._begin_step(run, 0.0)
        self._decide(0.0)
        try:
            self._loop()
        except DoesNotFit as exc:  # the deployment, not the policy: no engine could run it
            raise Infeasible(str(exc)) from exc
        unfinished = [r.name for r in self.runs if not r.finished_all]
        if unfinished:
            raise RuntimeError(f"simulation stalled at t={self.t:.3f}s: {unfinished} never finished; the policy "
                               f"{self.policy.name!r} left work unstarted with nothing running")

    def _loop(self) -> None:
        while self.heap:
            t = self.heap[0][0]
            if self.until_s is not None and t > self.until_s:
                raise Cut(f"past {self.until_s:.1f} s of simulated time")
            self.t = t
            changed = False
            while self.heap and self.heap[0][0] == t:
                ev = heapq.heappop(self.heap)[3]
                if self.versions.get((ev.kind, ev.pipe, ev.rank)) == ev.version:
                    self.fired.append(ev)
                    changed |= self._handle(ev)
            if changed:
                self._decide(t)

    def push(self, time_s: float, priority: Priority, kind: str, pipe: int, rank: int = -1) -> None:
        key = (kind, pipe, rank)
        self.versions[key] = version = self.versions.get(key, 0) + 1
        ev = Event(time_s=time_s, priority=priority, seq=next(self.seq), kind=kind, pipe=pipe, rank=rank,
                   version=version)
        heapq.heappush(self.heap, (ev.time_s, ev.priority, ev.seq, ev))

    def _handle(self, ev: Event) -> bool:
        run = self.runs[ev.pipe]
        if ev.kind == "segment":
            return self._segment_end(run, ev.rank)
        if ev.kind == "reward":
            self.clients.finish_stage(run, self.t)
            self._next_gang(run)
            if run.stage == WAITING:  # an asynchronous rollout side's step ends at its reward
                self._step_ended(run)
            else:
                self.clients.ask_gang(run, self.t)
            return True
        if ev.kind == "gang":
            self._gang_end(run)
            return True
        if ev.kind == "wake":  # a worker asked for a new sub-stage outside its own event
            return True
        raise ValueError(f"unknown event kind {ev.kind!r}")

    def _begin_step(self, run: PipelineRun, t: float) -> None:
        if not run.may_begin():  # an asynchronous side waits for its buffer: _step_ended retries
            return
        run.begin_step(t, self._routing.get(run.name))
        if run.stage != DONE:
            self.clients.begin_step(run, t, first=run.step == 0)

    def _next_gang(self, run: PipelineRun) -> None:
        """The pipeline's next stage (or step); its engines now know every finished turn."""
        run.next_gang(self.t)
        self.clients.observe(run, self.t)

    def _segment_end(self, run: PipelineRun, rank: int) -> bool:
        wk = run.workers[rank]
        was_on = wk.on_device
        out = wk.commit()
        abort = run.on_completed(wk.drain())
        if abort:
            self._abort(run, abort)
        self._reschedule_worker(run, rank)
        self.clients.sync_worker(run, rank, self.t)
        changed = out.switched or out.idle_ended or out.finished or was_on != wk.on_device or bool(abort)
        if run.stage == ROLLOUT and run.rollout_done():
            self._end_rollout(run)
            changed = True
        return changed

    def _abort(self, run: PipelineRun, rids: set[int]) -> None:
        for r, wk in enumerate(run.workers):
            if run.keeps_aborted:  # the requests go on elsewhere: what they generated so far counts
                wk.settle(self.t)
                rids = rids | run.on_completed(wk.drain())
            taken = wk.take(rids)
            if run.keeps_aborted and taken:
                run.aborted(r, taken)
            if taken and r in run.started_workers:
                wk.segment = None
                self._reschedule_worker(run, r)
                self.clients.sync_worker(run, r, self.t)

    def _reschedule_worker(self, run: PipelineRun, rank: int) -> None:
        wk = run.workers[rank]
        end = wk.plan() if rank in run.started_workers else None
        if end is not None:
            self.push(end, Priority.SEGMENT, "segment", run.index, rank)
        else:
            self.versions[("segment", run.index, rank)] = self.versions.get(("segment", run.index, rank), 0) + 1

    def _end_rollout(self, run: PipelineRun) -> None:
        for r in range(len(run.workers)):
            self._release(run, ("w", run.index, r))
        end = run.end_rollout(self.t)
        self.clients.ask_reward(run, self.t, end)
        self.push(end, Priority.STAGE, "reward", run.index)

    def _gang_end(self, run: PipelineRun) -> None:
        g = run.gang
        g.advance(self.t)
        self._release(run, ("g", run.index))
        self.clients.finish_stage(run, self.t, gang=g)
        was = run.stage
        self._next_gang(run)
        if was != TRAINING:
            self.clients.ask_gang(run, self.t)
            return
        self._step_ended(run)

    def _step_ended(self, run: PipelineRun) -> None:
        """Trace the step, begin the next; a side that waited on this one's buffer begins too,
        and a fully async rollout picks up the new weights."""
        self._trace_host(run)
        m = run.metrics[-1]
        self._trace("step", run.name, data={"step": m.step, "latency_s": m.end_s - m.start_s, "tokens": m.tokens,
                                            "samples": m.samples, "round": m.round,
                                            "flops": run.cost.flops_per_token * m.tokens * 4,
                                            **run.step_facts(), **self._slo_fields(run, m.step)})
        self._begin_step(run, self.t)
        for other in self.runs:
            if other is not run and other.stage == WAITING:
                self._begin_step(other, self.t)
        if (picks := run.new_weights()) is not None:
            self._reload(picks)

    def _reload(self, run: PipelineRun) -> None:
        """New weights reach a running rollout (AReaL): every worker stops where it is and
        resumes its requests with what they generated, their KV recomputed."""
        abort: set[int] = set()
        resumed = 0
        for r in sorted(run.started_workers):
            wk = run.workers[r]
            wk.settle(self.t)
            abort |= run.on_completed(wk.drain())
            computing = {q.rid for q in [*wk.queue, *wk.decoding]}  # a tool wait holds no KV to redo
            if computing:
                wk.add(wk.take(computing), self.t)
                resumed += len(computing)
            wk.segment = None
            self._reschedule_worker(run, r)
            self.clients.sync_worker(run, r, self.t)
        self._trace("weights", run.name, data={"step": run.step, "resumed": resumed})
        if abort:
            self._abort(run, abort)
        if run.stage == ROLLOUT and run.rollout_done():
            self._end_rollout(run)

    def _slo_fields(self, run: PipelineRun, step: int) -> dict:
        """The step's exclusive time and SLO as the node measured it (node/slo.py; none untraced)."""
        return step_fields(self.state.pipeline(run.name), step) if self.trace is not None else {}

    def _trace_host(self, run: PipelineRun) -> None:
        """Host sub-stages of the finished step (tool waits, reward), numbered as the builder does."""
        if self.trace is None:
            return
        from jigsaw.graph.ids import SubStageId

        seen: dict[tuple, int] = {}
        for r in sorted((r for r in run.records if r.stage in (Stage.TOOL, Stage.REWARD)), key=lambda r: r.t_start_s):
            kind = SubStageKind.TOOL if r.stage is Stage.TOOL else SubStageKind.REWARD
            n = seen[(r.dp_rank, kind)] = seen.get((r.dp_rank, kind), -1) + 1
            self.trace.add(TraceEvent(t_s=r.t_start_s, event="host", pipeline=run.name,
                                      substage=str(SubStageId(run.name, run.step, r.dp_rank, kind, n)),
                                      data={"end_s": r.t_end_s}))

    # ------------------------------------------------------------ decisions

    def _decide(self, t: float) -> None:
        for run in self.runs:
            if run.stage == ROLLOUT:
                self.clients.live_numbers(run, t)
        try:
            d = self.state.decide(t)
        except (ValueError, RuntimeError) as exc:
            # The daemon falls back so live pipelines go on; a simulated fallback would
            # measure the fallback, not the policy: the policy cannot run this deployment.
            raise Infeasible(f"{self.policy.name} cannot plan at t={t:.3f} s: {exc}") from exc
        if self.clients.record is not None:
            self.clients.record.append(Decided(t, d.record() if d is not None else None))
        if d is None:
            return
        self.decisions += 1
        self.violations += [f"t={t:.3f}: {n}" for n in d.notes]
        self._apply(d, t)

    def _apply(self, d: Decision, t: float) -> None:
        self._routing = d.routing  # the latest plan's
        handed = {h.sid for h in d.moved}
        for m in d.plan.migrations:
            if m.source in handed:  # one the applier refused is in the notes (a violation)
                self._migrate(m, t)
        by_name = {r.name: r for r in self.runs}
        for adm in d.admitted:
            self._start(by_name[adm.held.pipeline], adm.held, t)
        self.balanced_gangs = any(a.micro_batch is not None for a in d.plan.assignments) or self.balanced_gangs
        self._enact_budgets(d, t)

    def _start(self, run: PipelineRun, r, t: float) -> None:
        if run.stage == ROLLOUT and r.kind.is_rollout and r.rank < len(run.workers) \
                and r.rank not in run.started_workers:
            run.started_workers.add(r.rank)
            run.workers[r.rank].t = max(run.workers[r.rank].t, t)
            self._reschedule_worker(run, r.rank)
            self.clients.sync_worker(run, r.rank, t)
        elif run.gang is not None and run.gang.started_s is None and r.sid in run.gang.ids:
            g = run.gang
            g.started_s, g.t_last = t, t
            self.push(g.end_time(), Priority.STAGE, "gang", run.index)

    def _migrate(self, m, t: float) -> None:
        run = next(r for r in self.runs if r.name == m.pipeline)
        src, dst = run.workers[m.source_rank], run.workers[m.target_rank]
        # Both stop where they are before anything is re-planned: a target planned first
        # could start a tool wait just as the migrated requests arrive.
        src.settle(t)
        dst.settle(t)
        abort = run.on_completed(src.drain() + dst.drain())
        moved = src.take({q.rid for q in src._active()} - abort)
        dst.add(moved, t)
        self._trace("migration", run.name, m.source, data={"target": m.target, "requests": len(moved),
                                                            "delta_s": m.delta_s})
        for r in (m.source_rank, m.target_rank):
            self._reschedule_worker(run, r)
            self.clients.sync_worker(run, r, t)
        self._release(run, ("w", run.index, m.source_rank))
        if abort:
            self._abort(run, abort)
        if run.rollout_done() and run.stage == ROLLOUT:
            self._end_rollout(run)

    # ------------------------------------------------------------ budgets

    def _enact_budgets(self, d: Decision, t: float) -> None:
        """The physics of a decision (the daemon's counterpart sends Grants): budgets of every
        unit on a device, as the decision's holders have them, their actual slowdowns, re-timing."""
        held = {h.sid: h for h in d.holders}
        new_slots: dict[int, list[_Slot]] = {dev: [] for dev in range(self.node.num_devices)}
        ungranted = set()
        for key, _, sid, kind, device in self._occupants():
            r = held.get(sid)
            if r is None or r.device != device:
                self.violations.append(f"t={t:.3f}: {sid} runs on device {device} without a grant")
                ungranted.add(device)
                budget = Budget(sm_frac=1.0, mem_frac=1.0)
            else:
                budget = r.budget
            new_slots[device].append(_Slot(key=key, kind=kind, budget=budget, sid=sid))
        for d in ungranted:  # the plan missed a running unit: share the device evenly
            for slot in new_slots[d]:
                slot.budget = Budget(sm_frac=1.0 / len(new_slots[d]), mem_frac=1.0 / len(new_slots[d]))
        self._check(new_slots, t)
        for slots in new_slots.values():
            self._slowdowns(slots)
        self._retime(new_slots, t)

    def _occupants(self):
        """(unit key, run, live sub-stage id, live kind, device) for everything holding a device now."""
        out = []
        for run in self.runs:
            if run.stage == ROLLOUT:
                for r in sorted(run.started_workers):
                    wk = run.workers[r]
                    if wk.on_device or (wk.segment is not None and wk.segment.kind != "idle"):
                        sid = self.clients.asked.get((run.index, r)) or wk.piece_id()
                        kind = wk.piece.kind if wk.piece and wk.piece.kind.on_device else _kind(sid)
                        out.append((("w", run.index, r), run, sid, kind, run.rollout_devices[r]))
            g = run.gang
            if run.stage in (REFERENCE, TRAINING) and g is not None and g.started_s is not None:
                for sid, d in zip(g.ids, g.devices):
                    out.append((("g", run.index, d), run, sid, g.kind, d))
        return out

    @staticmethod
    def _check(slots: dict[int, list[_Slot]], t: float) -> None:
        """What the engines hold, by the node state's own capacity check."""
        over = overcommitted(slots, name_of=lambda s: s.sid)
        if over:
            raise AssertionError(f"t={t:.3f}: {over[0]}")

    def _slowdowns(self, ss: list[_Slot]) -> None:
        if not ss:
            return
        got = self.physics.actual([(s.key[1], s.kind.value, s.budget.sm_frac, s.budget.mem_frac) for s in ss])
        if got is None:
            self.violations.append(f"{ss[0].key} beside {ss[1].key}: infeasible in the grid; charged 2x")
            got = (2.0, 2.0)
        for s, slow in zip(ss, got):
            s.slowdown = slow

    def _retime(self, slots: dict[int, list[_Slot]], t: float) -> None:
        gangs: dict[int, dict[int, float]] = {}
        finished: dict[int, dict[int, list]] = {}  # pipeline -> rank -> what an interrupt finished
        old = {s.key: s for ss in self.slots.values() for s in ss}
        for d, ss in slots.items():
            for s in ss:
                prev = old.get(s.key)
                if (prev is None or prev.budget != s.budget or prev.sid != s.sid
                        or abs(prev.slowdown - s.slowdown) > EPS):
                    run = self.runs[s.key[1]]
                    need = (int(run.workers[s.key[2]].need_bytes(run.workers[s.key[2]].held_kv_tokens()))
                            if s.key[0] == "w" else run.gang.mem_bytes)
                    self._trace("grant", run.name, s.sid, d, s, data={"need_bytes": need})
                pool = s.key[0] == "w" and self._grant_pool(s, t)
                if s.key[0] == "w" and (prev is None or pool or abs(prev.slowdown - s.slowdown) > EPS):
                    run = self.runs[s.key[1]]
                    end = run.workers[s.key[2]].interrupt(t, s.slowdown)
                    if end is not None:
                        self.push(end, Priority.SEGMENT, "segment", run.index, s.key[2])
                    finished.setdefault(s.key[1], {})[s.key[2]] = run.workers[s.key[2]].drain()
                elif s.key[0] == "g":
                    gangs.setdefault(s.key[1], {})[d] = s.slowdown
        now = {s.key for ss in slots.values() for s in ss}
        for d, ss in self.slots.items():
            for s in ss:
                if s.key not in now:  # stopped holding the device (tool wait, migrated, done)
                    self._trace("release", self.runs[s.key[1]].name, "", d, s)
        for pipe, slow in gangs.items():
            g = self.runs[pipe].gang
            rate = gang_rate(list(slow.values()), self.balanced_gangs)
            if abs(rate - g.rate) > EPS or slow != g.slowdowns:
                g.advance(t)
                g.rate, g.slowdowns = rate, slow
                self.push(g.end_time(), Priority.STAGE, "gang", pipe)
        self.slots = slots
        for pipe, ranks in finished.items():
            self._report_finished(self.runs[pipe], ranks)

    def _report_finished(self, run: PipelineRun, ranks: dict[int, list]) -> None:
        """What interrupted segments finished: counted, tail batching's aborts applied, and
        each worker's client told (its last sub-stage may have ended)."""
        abort = run.on_completed([r for reqs in ranks.values() for r in reqs])
        if abort:
            self._abort(run, abort)
        for rank in ranks:
            was = self.clients.asked.get((run.index, rank))
            self.clients.sync_worker(run, rank, self.t)
            if self.clients.asked.get((run.index, rank)) != was:  # a new regime asks now: decide again
                self.push(self.t, Priority.SEGMENT, "wake", run.index, rank)
        if run.stage == ROLLOUT and run.rollout_done():
            self._end_rollout(run)
    def _grant_pool(self, s: _Slot, t: float) -> bool:
        """A worker's KV pool follows its memory budget; whether its capacity changed."""
        wk = self.runs[s.key[1]].workers[s.key[2]]
        changed = wk.grant(s.budget.mem_frac * self.node.mem_bytes)
        if wk.undersized:
            self.violations.append(f"t={t:.3f}: {s.sid} granted {s.budget.mem_frac:.0%} of device memory, less than "
                                   "one whole response of its needs")
        return changed

    def _release(self, run: PipelineRun, key: tuple) -> None:
        for d, ss in self.slots.items():
            for s in [s for s in ss if s.key[:len(key)] == key]:
                ss.remove(s)
                self._trace("release", run.name, "", d, s)

    def _trace(self, event: str, pipeline: str, substage: str = "", device: int | None = None,
               slot: _Slot | None = None, data: dict | None = None) -> None:
        if self.trace is None:
            return
        self.trace.add(TraceEvent(t_s=self.t, event=event, pipeline=pipeline, substage=substage, device=device,
                                  sm_frac=slot.budget.sm_frac if slot else 0.0,
                                  mem_bytes=int(slot.budget.mem_frac * self.node.mem_bytes) if slot else 0,
                                  slowdown=slot.slowdown if slot else 1.0, data=data or {}))


def _kind(sid: str) -> SubStageKind:
    from jigsaw.graph.ids import SubStageId

    return SubStageId.parse(sid).kind
