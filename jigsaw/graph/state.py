"""Compact, copyable node state that the look-ahead search simulates forward.

    PipelineState × K ─► Problem (static: tasks, deps, tails; cached per graph)
                      └► State   (dynamic: time, remaining work, who runs where)
    State ──start/place_pair/finish──► State ──advance()──► next completion event

A *task* is what the scheduler places: one sub-stage replica, or all replicas of a
collective (reference / training) stage, which run in lockstep on their devices.
Progress is measured in exclusive seconds: a task beside a partner advances at
rate 1/s; a collective advances at the balanced rate Σ_d(1/s_d)/n (micro-batches
skewed towards unhindered workers, §2.7) or at 1/max_d s_d without balancing.
Decisions live in schedule.py; this module only applies them.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from typing import NamedTuple

from jigsaw.graph.graph import SubStageGraph
from jigsaw.graph.merge import DecodeFit
from jigsaw.graph.plan import NodeSpec, PipelineState
from jigsaw.graph.substage import SubStageKind

EPS_S = 1e-9
PENDING, READY, RUNNING, DONE = 0, 1, 2, 3
SOLO = (1.0, 1.0, 1.0)
"""Split of a replica alone on its device: (sm_frac, mem_frac, slowdown)."""


class Task:
    """A schedulable unit (see module docstring); immutable once the Problem is built."""

    __slots__ = ("idx", "pipe", "kind", "ids", "ranks", "devices", "hold", "excl_s", "mem", "preds",
                 "succs", "tail_s", "batch", "mergeable", "context_tokens", "num_steps", "flops_per_token")

    def __repr__(self) -> str:
        return f"Task({self.idx}, {self.ids[0]}{'...' if len(self.ids) > 1 else ''})"


class Problem:
    """Static part of a scheduling instance: tasks of all pipelines, in one index space."""

    __slots__ = ("tasks", "names", "pipe_tasks", "num_devices", "mem_cap", "kinds", "mergeable", "prefill",
                 "decode", "dominant")

    def __init__(self, pipelines: Sequence[tuple[SubStageGraph, tuple[int, ...]]], node: NodeSpec):
        self.tasks: list[Task] = []
        self.names: list[str] = []
        self.pipe_tasks: list[tuple[int, ...]] = []
        self.num_devices = node.num_devices
        self.mem_cap = node.mem_bytes
        parts = []
        for p, (graph, devices) in enumerate(pipelines):
            start = len(self.tasks)
            part = _part(graph, devices, p, start, node)
            parts.append(part)
            self.tasks.extend(part.tasks)
            self.names.append(graph.pipeline)
            self.pipe_tasks.append(tuple(range(start, len(self.tasks))))
        self.kinds = tuple(t.kind for t in self.tasks)
        self.mergeable = tuple(tuple(i for i in ids if self.tasks[i].mergeable) for ids in self.pipe_tasks)
        # Per pipeline: (FLOPs, exclusive seconds) of its prefill sub-stages -> prefill MFU.
        self.prefill = tuple(part.prefill for part in parts)
        # Per pipeline: its decode step latency against KV tokens (prices merged tails).
        self.decode = tuple(part.decode for part in parts)
        self.dominant = tuple(k for part in parts for k in part.dominant)


class _Part(NamedTuple):
    """One pipeline's share of a Problem (its tasks never change once built)."""

    tasks: tuple[Task, ...]
    dominant: tuple[str, ...]
    prefill: tuple[float, float]
    decode: DecodeFit | None


@lru_cache(maxsize=64)
def _part(graph: SubStageGraph, devices: tuple[int, ...], pipe: int, start: int, node: NodeSpec) -> _Part:
    """Cached per pipeline: between two decisions usually only one pipeline's graph changed."""
    _check_placement(graph, devices, node)
    tasks = tuple(_tasks_of(graph, devices, pipe, start, node))
    return _Part(tasks=tasks, dominant=_dominant_kinds(tasks, start), prefill=_prefill_stats(graph),
                 decode=_decode_fit(graph))


@lru_cache(maxsize=16)
def problem_for(pipelines: tuple[tuple[SubStageGraph, tuple[int, ...]], ...], node: NodeSpec) -> Problem:
    """Problems are rebuilt only when a graph or a placement changes (graphs hash by identity)."""
    return Problem(pipelines, node)


def _dominant_kinds(tasks: Sequence[Task], start: int = 0) -> tuple[str, ...]:
    """What each task mostly is: for a rollout piece, the kind with the most exclusive time in
    its worker's rollout chain from there on (a rollout opens with a short prefill but is
    mostly its tail); other tasks are their own kind.  Task indices start at `start`."""
    chain: dict[int, dict[str, float]] = {}
    out = [t.kind for t in tasks]
    for t in reversed(tasks):  # topological order reversed: a task's successors come first
        if not t.kind.startswith("rollout") and t.kind != "tool":
            continue
        totals = {t.kind: t.excl_s} if t.devices else {}
        for j in t.succs:
            if j in chain and tasks[j - start].ranks == t.ranks:
                for kind, sec in chain[j].items():
                    totals[kind] = totals.get(kind, 0.0) + sec
        chain[t.idx] = totals
        if t.devices and totals:
            out[t.idx - start] = max(totals, key=totals.get)
    return tuple(out)


def _prefill_stats(graph: SubStageGraph) -> tuple[float, float]:
    pre = [s for s in graph if s.kind.value == "rollout_prefill" and s.flops > 0]
    return sum(s.flops for s in pre), sum(s.duration_s for s in pre)


def _decode_fit(graph: SubStageGraph) -> DecodeFit | None:
    """Fit over the graph's last step: predicted pieces, whose batch, context and step time
    all come from the same measured history (a live piece pairs the engine's current batch
    with a predicted duration)."""
    last = max((s.step for s in graph), default=0)
    points = [(s.batch_size * s.seq_len, s.duration_s / s.num_steps) for s in graph
              if s.step == last and s.kind.value in ("rollout_decode", "rollout_tail")
              and s.num_steps > 1 and s.batch_size > 0]
    return DecodeFit.fit(points)


def _check_placement(graph: SubStageGraph, devices: tuple[int, ...], node: NodeSpec) -> None:
    if len(devices) < graph.num_dp_ranks:
        raise ValueError(f"pipeline {graph.pipeline!r} has {graph.num_dp_ranks} DP ranks but "
                         f"{len(devices)} devices were given")
    if len(set(devices)) != len(devices) or any(not 0 <= d < node.num_devices for d in devices):
        raise ValueError(f"pipeline {graph.pipeline!r}: devices {devices} must be distinct and in "
                         f"[0, {node.num_devices})")
    for s in graph:
        if s.kind.on_device and s.mem_bytes > node.mem_bytes:
            raise ValueError(f"sub-stage {s.id} needs {s.mem_bytes} bytes; a device has {node.mem_bytes}")


def _tasks_of(graph: SubStageGraph, devices: tuple[int, ...], pipe: int, start: int,
              node: NodeSpec) -> list[Task]:
    members: list[list] = []
    task_of: dict[str, int] = {}
    gang_slot: dict[tuple, int] = {}
    for s, key in zip(graph, gang_keys(graph)):  # topological order, so tasks are sorted too
        if s.kind.collective and key in gang_slot:
            slot = gang_slot[key]
        else:
            slot = len(members)
            members.append([])
            if s.kind.collective:
                gang_slot[key] = slot
        members[slot].append(s)
        task_of[s.id] = start + slot
    tasks = [_make_task(graph, group, devices, pipe, start + i, task_of) for i, group in enumerate(members)]
    _fill_tails(tasks, start)
    if any(t.kind == "tool" for t in tasks):
        # Multi-turn requests may come back from a tool for more turns: migrating them moves
        # their later turns and tool calls onto one worker, which ΔT does not price.
        for t in tasks:
            t.mergeable = False
    return tasks


def gang_keys(graph: SubStageGraph) -> list[tuple]:
    """Lockstep key of each sub-stage (in graph order): the k-th collective sub-stage of a
    kind in a step on every worker forms one gang."""
    seen: dict[tuple, int] = {}
    keys = []
    for s in graph:
        base = (s.step, s.kind.value, s.dp_rank)
        k = seen.get(base, 0)
        seen[base] = k + 1
        keys.append((s.step, s.kind.value, k))
    return keys


_KIND = {k: (k.value, k.on_device, k.is_rollout) for k in SubStageKind}
"""Enum properties looked up once: task construction runs at every scheduling call."""


def _make_task(graph: SubStageGraph, group: list, devices: tuple[int, ...], pipe: int, idx: int,
               task_of: dict[str, int]) -> Task:
    t = Task()
    first = group[0]
    kind, on_device, _ = _KIND[first.kind]
    t.idx, t.pipe, t.kind = idx, pipe, kind
    deps, succ = graph.deps, graph._succ
    if len(group) == 1:
        t.ids, t.ranks = (first.id,), (first.dp_rank,)
        t.excl_s, t.mem, t.batch = first.duration_s, first.mem_bytes, first.batch_size
        t.preds = tuple(sorted({task_of[d] for d in deps[first.id]}))
        t.succs = tuple(sorted({task_of[n] for n in succ[first.id]}))
    else:
        t.ids = tuple(s.id for s in group)
        t.ranks = tuple(s.dp_rank for s in group)
        t.excl_s = max(s.duration_s for s in group)
        t.mem = max(s.mem_bytes for s in group)
        t.batch = sum(s.batch_size for s in group)
        t.preds = tuple(sorted({task_of[d] for s in group for d in deps[s.id]} - {idx}))
        t.succs = tuple(sorted({task_of[n] for s in group for n in succ[s.id]} - {idx}))
    t.devices = tuple(devices[r] for r in t.ranks) if on_device else ()
    # A worker waiting on a tool keeps its engine (and the waiting requests' KV cache) on
    # its device: it holds one of the device's two places for its return.
    t.hold = devices[first.dp_rank] if kind == "tool" else None
    t.mergeable = kind == "rollout_tail" and not any(_KIND[graph[n].kind][2] for n in succ[first.id])
    t.context_tokens = int(first.batch_size * first.seq_len)
    t.num_steps = first.num_steps
    t.flops_per_token = first.flops / first.num_tokens if first.num_tokens and first.flops else 0.0
    return t


def _fill_tails(tasks: list[Task], start: int) -> None:
    """tail_s: longest chain of exclusive durations after the task (to its pipeline's sink)."""
    for t in reversed(tasks):
        t.tail_s = max((tasks[j - start].excl_s + tasks[j - start].tail_s for j in t.succs), default=0.0)


def gang_rate(slowdowns: Sequence[float], balanced: bool) -> float:
    """Progress rate (exclusive seconds per second) of replicas running in lockstep."""
    if balanced:
        return sum(1.0 / s for s in slowdowns) / len(slowdowns)
    return 1.0 / max(slowdowns)


class State:
    """Mutable simulation state; `copy()` is cheap enough to branch on."""

    __slots__ = ("t", "rem", "status", "npred", "dev", "split", "rate", "ready", "running",
                 "closed", "deferred", "touched", "pipe_end", "started", "log", "load", "urgent", "held")

    def copy(self) -> State:
        c = State.__new__(State)
        c.t, c.rem, c.status, c.npred = self.t, self.rem[:], self.status[:], self.npred[:]
        c.dev, c.split, c.rate = self.dev[:], dict(self.split), self.rate[:]
        c.ready, c.running = set(self.ready), set(self.running)
        c.closed, c.deferred, c.touched = set(self.closed), set(self.deferred), set(self.touched)
        c.pipe_end, c.started, c.log = self.pipe_end[:], self.started[:], self.log[:]
        c.load, c.held = self.load[:], self.held[:]
        c.urgent = self.urgent  # fixed for the whole call: never mutated
        return c


def initial_state(P: Problem, pipelines: Sequence[PipelineState], time_s: float, balanced: bool) -> State:
    """State at `time_s` from the pipelines' done / running / remaining bookkeeping."""
    S = State()
    n = len(P.tasks)
    S.t, S.rem, S.status, S.npred = time_s, [t.excl_s for t in P.tasks], [PENDING] * n, [0] * n
    S.dev, S.split, S.rate = [()] * P.num_devices, {}, [0.0] * n
    S.held = [()] * P.num_devices
    S.ready, S.running, S.closed, S.deferred = set(), set(), set(), set()
    S.touched = set(range(P.num_devices))
    S.pipe_end, S.started, S.log = [time_s] * len(pipelines), [], []
    for p, ps in enumerate(pipelines):
        for i in P.pipe_tasks[p]:
            _init_task(P, S, P.tasks[i], ps)
    S.load = [0.0] * P.num_devices  # exclusive seconds of unfinished work per device
    S.urgent = frozenset(i for p, ps in enumerate(pipelines) if ps.urgent
                         for i in P.pipe_tasks[p] if set(P.tasks[i].ids) & ps.urgent)
    for t in P.tasks:
        if S.status[t.idx] != DONE:
            for d in t.devices:
                S.load[d] += S.rem[t.idx]
        S.npred[t.idx] = sum(S.status[j] != DONE for j in t.preds)
        if S.status[t.idx] == PENDING and S.npred[t.idx] == 0:
            S.status[t.idx] = READY
            S.ready.add(t.idx)
    for i in S.running:
        refresh_rate(P, S, i, balanced)
    late = [P.tasks[i].ids[0] for i in S.urgent if S.status[i] != READY]
    if late:
        raise ValueError(f"urgent sub-stages must be ready (dependencies done, not started): {late[:3]}")
    return S


def _init_task(P: Problem, S: State, task: Task, ps: PipelineState) -> None:
    if len(task.ids) == 1 and task.ids[0] not in ps.running:  # fast path: most tasks
        sid = task.ids[0]
        if sid in ps.done:
            S.status[task.idx] = DONE
        elif sid in ps.remaining_s:
            S.rem[task.idx] = max(0.0, ps.remaining_s[sid])
        return
    done = [sid in ps.done for sid in task.ids]
    run = [sid in ps.running for sid in task.ids]
    if all(done):
        S.status[task.idx] = DONE
        return
    if any(done) or (any(run) and not all(run)):
        raise ValueError(f"replicas of {task.ids[0]} are partly done/running; a collective stage "
                         "starts and ends on all its workers together")
    rem = [ps.remaining_s[sid] for sid in task.ids if sid in ps.remaining_s]
    if rem:
        S.rem[task.idx] = max(0.0, max(rem))
    if not any(run):
        return
    S.status[task.idx] = RUNNING
    S.running.add(task.idx)
    if task.hold is not None:
        S.held[task.hold] = S.held[task.hold] + (task.idx,)
    for sid, d in zip(task.ids, task.devices):
        if len(S.dev[d]) >= 2:
            raise ValueError(f"more than two sub-stages running on device {d}")
        S.dev[d] = S.dev[d] + (task.idx,)
        b = ps.running[sid]
        S.split[(task.idx, d)] = (b.sm_frac, b.mem_frac, 1.0)


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
        S.rate[i] = 1.0 / S.split[(i, devs[0])][2]
    else:
        S.rate[i] = gang_rate([S.split[(i, d)][2] for d in devs], balanced)


def start(P: Problem, S: State, i: int) -> None:
    """Mark task i running on its devices alone (pairing, if any, is set by place_pair)."""
    S.status[i] = RUNNING
    S.ready.discard(i)
    S.running.add(i)
    S.started.append(i)
    if (h := P.tasks[i].hold) is not None:
        S.held[h] = S.held[h] + (i,)
    for d in P.tasks[i].devices:
        S.dev[d] = S.dev[d] + (i,)
        S.split[(i, d)] = SOLO
        S.touched.add(d)


def finish(P: Problem, S: State, i: int, balanced: bool) -> None:
    task = P.tasks[i]
    for d in task.devices:
        S.load[d] -= S.rem[i]  # rounding residue, or the whole tail of a merged-away source
    S.status[i] = DONE
    S.running.discard(i)
    S.rem[i] = 0.0
    if task.hold is not None:
        S.held[task.hold] = tuple(j for j in S.held[task.hold] if j != i)
    if S.t > S.pipe_end[task.pipe]:
        S.pipe_end[task.pipe] = S.t
    for d in task.devices:
        S.dev[d] = tuple(j for j in S.dev[d] if j != i)
        del S.split[(i, d)]
        S.touched.add(d)
        for j in S.dev[d]:  # the survivor gets the whole device back
            S.split[(j, d)] = SOLO
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
    dt = min(S.rem[i] / S.rate[i] for i in S.running)
    S.t += dt
    ended = []
    load, tasks = S.load, P.tasks
    for i in S.running:
        done_s = dt * S.rate[i]
        S.rem[i] -= done_s
        for d in tasks[i].devices:
            load[d] -= done_s
        if S.rem[i] <= EPS_S * max(1.0, tasks[i].excl_s):
            ended.append(i)
    S.closed.clear()
    S.deferred.clear()
    S.touched.clear()
    for i in sorted(ended):
        finish(P, S, i, balanced)


def set_remaining(P: Problem, S: State, i: int, rem_s: float) -> None:
    """Change a task's exclusive time left (a merge grows the target's tail)."""
    for d in P.tasks[i].devices:
        S.load[d] += rem_s - S.rem[i]
    S.rem[i] = rem_s
