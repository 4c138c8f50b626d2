"""Compact, copyable node state that the look-ahead search simulates forward.

    PipelineState × K ─► Problem (static, problem.py: tasks, deps, tails)
                      └► State   (dynamic: time, remaining work, who runs where)
    State ──start/place_pair/finish──► State ──advance()──► next completion event

A *task* (problem.py) is one sub-stage replica, or all replicas of a collective stage.
Progress is measured in exclusive seconds: a task beside a partner advances at
rate 1/s; a collective advances at the balanced rate Σ_d(1/s_d)/n (micro-batches
skewed towards unhindered workers, §2.7) or at 1/max_d s_d without balancing.
Decisions live in schedule.py; this module only applies them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from jigsaw.graph.plan import PipelineState
from jigsaw.graph.problem import Problem, Task

EPS_S = 1e-9
PENDING, READY, RUNNING, DONE = 0, 1, 2, 3


class Split(NamedTuple):
    """A replica's share of its device and its predicted slowdown there."""

    sm_frac: float
    mem_frac: float
    slowdown: float


SOLO = Split(1.0, 1.0, 1.0)
"""A replica alone on its device (unless its kind runs faster on a share: `State.solo`)."""


def gang_rate(slowdowns: Sequence[float], balanced: bool) -> float:
    """Progress rate (exclusive seconds per second) of replicas running in lockstep."""
    if balanced:
        return sum(1.0 / s for s in slowdowns) / len(slowdowns)
    return 1.0 / max(slowdowns)


class State:
    """Mutable simulation state; `copy()` is cheap enough to branch on."""

    __slots__ = ("now_s", "rem_s", "status", "npred", "dev", "split", "rate", "ready", "running",
                 "closed", "deferred", "touched", "end_s", "started", "log", "load_s", "urgent", "held", "merged",
                 "alone", "solo", "capped", "pace", "watch", "slo_end")

    def copy(self, history: bool = True) -> State:
        """A state to branch on; without `history`, its starts and log begin empty (a branch of
        the search is valued, never made into a plan: only the call's own state needs them)."""
        c = State.__new__(State)
        c.now_s, c.rem_s, c.status, c.npred = self.now_s, self.rem_s[:], self.status[:], self.npred[:]
        c.dev, c.split, c.rate = self.dev[:], dict(self.split), self.rate[:]
        c.ready, c.running = set(self.ready), set(self.running)
        c.closed, c.deferred, c.touched = set(self.closed), set(self.deferred), set(self.touched)
        c.end_s = self.end_s[:]
        c.started, c.log = (self.started[:], self.log[:]) if history else ([], [])
        c.load_s, c.held = self.load_s[:], self.held[:]
        c.urgent, c.alone = self.urgent, self.alone  # fixed for the whole call: never mutated
        c.merged = self.merged  # replaced, never mutated, by a merge
        c.solo, c.capped, c.pace = self.solo, self.capped, self.pace  # fixed for the whole call
        c.watch = self.watch  # fixed for the whole call
        c.slo_end = None if self.slo_end is None else self.slo_end[:]
        return c


def initial_state(P: Problem, pipelines: Sequence[PipelineState], time_s: float, balanced: bool,
                  solo: dict[str, Split] | None = None, capped: dict[int, dict[str, Split]] | None = None,
                  rates: bool = True) -> State:
    """State at `time_s` from the pipelines' done / running / remaining bookkeeping; `solo`
    and `capped` are the call's splits alone (Context.solo, Context.capped).  Without `rates`,
    the running tasks' rates are the caller's to set (once it knows their slowdowns)."""
    S = State()
    n = len(P.tasks)
    S.now_s, S.rem_s, S.status, S.npred = time_s, [t.excl_s for t in P.tasks], [PENDING] * n, [0] * n
    S.dev, S.split, S.rate = [()] * P.num_devices, {}, [0.0] * n
    S.held = [()] * P.num_devices
    S.merged = {}
    S.solo = solo or {}
    """Kinds that run faster alone on a share of the device than on all of it, and that split
    (the grid's); every other kind alone takes the whole device."""
    S.capped = capped or {}
    """Devices a host-busy pipeline keeps its share of: every kind's split alone there."""
    S.pace = _pace(P, S.solo)
    S.watch, S.slo_end = frozenset(), None
    """Tasks of a step held to a deadline, and per pipeline the latest end of one of them in
    this search (-inf: none ended yet); set by the caller (actions.initial) when SLOs exist."""
    S.ready, S.running, S.closed, S.deferred = set(), set(), set(), set()
    S.touched = set(range(P.num_devices))
    S.end_s, S.started, S.log = [time_s] * len(pipelines), [], []
    tasks, status, rem = P.tasks, S.status, S.rem_s
    for p, ps in enumerate(pipelines):
        done, running, left = ps.done, ps.running, ps.remaining_s
        for i in P.pipe_tasks[p]:
            task = tasks[i]
            if len(task.ids) == 1 and task.ids[0] not in running:  # most tasks: written out
                sid = task.ids[0]
                if sid in done:
                    status[i] = DONE
                elif sid in left:
                    rem[i] = max(0.0, left[sid])
            else:
                _init_task(P, S, task, ps)
    S.load_s = [0.0] * P.num_devices  # seconds of unfinished work per device, alone at each one's pace
    S.urgent = frozenset(P.task_of[p][sid] for p, ps in enumerate(pipelines) for sid in ps.urgent
                         if sid in P.task_of[p])
    S.alone = frozenset(P.task_of[p][sid] for p, ps in enumerate(pipelines) for sid in ps.alone
                        if sid in P.task_of[p])
    status, rem, load, npred, pace = S.status, S.rem_s, S.load_s, S.npred, S.pace
    for t in P.tasks:  # done tasks (most of a long graph) need nothing: skip them fast
        i = t.idx
        if status[i] == DONE:
            continue
        for d in t.devices:
            load[d] += rem[i] if pace is None else rem[i] * pace[i]
        if status[i] == PENDING:
            left = 0
            for j in t.preds:
                if status[j] != DONE:
                    left += 1
            npred[i] = left
            if left == 0:
                status[i] = READY
                S.ready.add(i)
    for i in S.running if rates else ():
        refresh_rate(P, S, i, balanced)
    late = [P.tasks[i].ids[0] for i in S.urgent if S.status[i] != READY]
    if late:
        raise ValueError(f"urgent sub-stages must be ready (dependencies done, not started): {late[:3]}")
    return S


def _init_task(P: Problem, S: State, task: Task, ps: PipelineState) -> None:
    """A gang, or a running task (`initial_state` writes out the rest)."""
    ids, done, run = task.ids, ps.done.__contains__, ps.running.__contains__  # mapped in C: a gang has a
    if all(map(done, ids)):                                                  # replica per worker
        S.status[task.idx] = DONE
        return
    running = any(map(run, ids))
    if any(map(done, ids)) or (running and not all(map(run, ids))):
        raise ValueError(f"replicas of {task.ids[0]} are partly done/running; a collective stage "
                         "starts and ends on all its workers together")
    if ps.remaining_s:
        rem = [v for v in map(ps.remaining_s.get, ids) if v is not None]
        if rem:
            S.rem_s[task.idx] = max(0.0, max(rem))
    if not running:
        return
    S.status[task.idx] = RUNNING
    S.running.add(task.idx)
    if task.hold_device is not None:
        S.held[task.hold_device] = S.held[task.hold_device] + (task.idx,)
    for sid, d in zip(task.ids, task.devices):
        if len(S.dev[d]) >= 2:
            raise ValueError(f"more than two sub-stages running on device {d}")
        S.dev[d] = S.dev[d] + (task.idx,)
        b = ps.running[sid]
        S.split[(task.idx, d)] = Split(b.sm_frac, b.mem_frac, 1.0)


def places_taken(P: Problem, S: State, i: int, d: int) -> int:
    """Places of device d's two that task i cannot have: running partners, and workers of
    other pipelines waiting on a tool there (task i's own pipeline's hold is its own)."""
    held = S.held[d]
    if not held:
        return len(S.dev[d])
    pipe = P.tasks[i].pipe
    return len(S.dev[d]) + sum(1 for h in held if P.tasks[h].pipe != pipe)


def refresh_rate(P: Problem, S: State, i: int, balanced: bool) -> None:
    devs = P.tasks[i].devices
    if not devs:
        S.rate[i] = 1.0
    elif len(devs) == 1:
        S.rate[i] = 1.0 / S.split[(i, devs[0])].slowdown
    else:
        S.rate[i] = gang_rate([S.split[(i, d)].slowdown for d in devs], balanced)


def _pace(P: Problem, solo: dict[str, Split]) -> list[float] | None:
    """Per task, its seconds alone at its kind's best share per exclusive second (`solo`'s
    slowdown, else 1); None when all are 1.  Device loads count work in that time: a kind
    faster on a share (a CPU tail on one core) clears its work in less than its exclusive
    time, and a load in exclusive seconds would make idling beside it look as cheap as pairing."""
    if not solo:
        return None
    pace = [min(1.0, solo[k].slowdown) if k in solo else 1.0 for k in P.kinds]
    return None if all(x == 1.0 for x in pace) else pace


def alone(S: State, kind: str, d: int) -> Split:
    """A replica's split alone on device d: the whole device, its kind's better share, or what
    a host-busy pipeline there leaves."""
    return (S.capped.get(d) or S.solo).get(kind, SOLO)


def start(P: Problem, S: State, i: int) -> None:
    """Mark task i running on its devices alone (pairing, if any, is set by place_pair)."""
    S.status[i] = RUNNING
    S.ready.discard(i)
    S.running.add(i)
    S.started.append(i)
    if (h := P.tasks[i].hold_device) is not None:
        S.held[h] = S.held[h] + (i,)
    for d in P.tasks[i].devices:
        S.dev[d] = S.dev[d] + (i,)
        S.split[(i, d)] = alone(S, P.kinds[i], d)
        S.touched.add(d)


def place_pair(S: State, i: int, y: int, d: int, point: tuple[float, float, float, float]) -> None:
    """Task i, just started, shares device d with running task y at `point` = (i's SM share,
    i's memory share, i's slowdown, y's slowdown); y keeps the rest.  Rates are the caller's
    to refresh, once all of a start's pairs are placed."""
    sm, mem, s_i, s_y = point
    S.split[(i, d)] = tuple.__new__(Split, (sm, mem, s_i))  # without Split's Python __new__: hot in the search
    S.split[(y, d)] = tuple.__new__(Split, (1.0 - sm, 1.0 - mem, s_y))


def finish(P: Problem, S: State, i: int, balanced: bool) -> None:
    task = P.tasks[i]
    left = S.rem_s[i] * (1.0 if S.pace is None else S.pace[i])
    for d in task.devices:
        S.load_s[d] -= left  # rounding residue, or the whole tail of a merged-away source
    S.status[i] = DONE
    S.running.discard(i)
    S.rem_s[i] = 0.0
    if task.hold_device is not None:
        S.held[task.hold_device] = tuple(j for j in S.held[task.hold_device] if j != i)
    if S.now_s > S.end_s[task.pipe]:
        S.end_s[task.pipe] = S.now_s
    if i in S.watch and S.now_s > S.slo_end[task.pipe]:
        S.slo_end[task.pipe] = S.now_s
    for d in task.devices:
        S.dev[d] = tuple(j for j in S.dev[d] if j != i)
        del S.split[(i, d)]
        S.touched.add(d)
        for j in S.dev[d]:  # the survivor gets the whole device back (or its best share alone)
            S.split[(j, d)] = alone(S, P.kinds[j], d)
            refresh_rate(P, S, j, balanced)
    for j in task.succs:
        S.npred[j] -= 1
        if S.npred[j] == 0 and S.status[j] == PENDING:
            S.status[j] = READY
            S.ready.add(j)


def advance(P: Problem, S: State, balanced: bool) -> None:
    """Run until the next task completes; new time point, so per-point marks reset."""
    if not S.running:
        raise RuntimeError("advance() with nothing running: the schedule is stuck")
    rem, rate, running = S.rem_s, S.rate, S.running  # written out: every event of the search steps them all
    dt = min([rem[i] / rate[i] for i in running])
    S.now_s += dt
    ended = []
    load, tasks = S.load_s, P.tasks
    pace = S.pace
    for i in running:
        done_s = dt * rate[i]
        rem[i] -= done_s
        if pace is not None:
            done_s *= pace[i]
        task = tasks[i]
        for d in task.devices:
            load[d] -= done_s
        if rem[i] <= EPS_S * max(1.0, task.excl_s):
            ended.append(i)
    S.closed.clear()
    S.deferred.clear()
    S.touched.clear()
    for i in sorted(ended):
        finish(P, S, i, balanced)


def set_remaining(P: Problem, S: State, i: int, rem_s: float) -> None:
    """Change a task's exclusive time left (a merge grows the target's tail)."""
    more = (rem_s - S.rem_s[i]) * (1.0 if S.pace is None else S.pace[i])
    for d in P.tasks[i].devices:
        S.load_s[d] += more
    S.rem_s[i] = rem_s
