"""The static side of a scheduling instance: tasks of every pipeline in one index space.

    (SubStageGraph, devices) per pipeline ─► Part: its Tasks, dominant kinds, prefill MFU,
                                             decode step fit (cached per graph; patched when
                                             only a few sub-stages changed since last time)
    Parts ─► Problem (tasks, kinds, mergeable tails, ...)            used by state.py
      + links (PipelineState.waits_for): edges between two pipelines' tasks (an asynchronous
        job's sample buffer); the linked tasks and their ancestors are copied, their tails
        filled again across the links, so the critical path crosses them
    SchedulerCache: those caches, owned by whoever calls the scheduler on one node (a policy)

A *task* is what the scheduler places: one sub-stage replica, or all replicas of a
collective (reference / training) stage, which run in lockstep on their devices.
Tasks never change once built, so Problems built from mostly the same graphs share them.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from graphlib import CycleError, TopologicalSorter
from typing import NamedTuple

from jigsaw.graph.graph import SubStageGraph
from jigsaw.graph.ids import pipeline_of
from jigsaw.graph.merge import DecodeFit
from jigsaw.graph.plan import NodeSpec
from jigsaw.graph.substage import SubStageKind


class Task:
    """A schedulable unit (see module docstring); immutable once the Problem is built."""

    __slots__ = ("idx", "pipe", "kind", "ids", "ranks", "devices", "hold_device", "excl_s", "mem_bytes", "preds",
                 "succs", "tail_s", "step", "step_tail_s", "batch_size", "mergeable", "context_tokens", "num_steps",
                 "flops_per_token")

    def __repr__(self) -> str:
        return f"Task({self.idx}, {self.ids[0]}{'...' if len(self.ids) > 1 else ''})"


class Problem:
    """Static part of a scheduling instance: tasks of all pipelines, in one index space."""

    __slots__ = ("tasks", "names", "pipe_tasks", "num_devices", "mem_bytes", "kinds", "mergeable", "prefill_work",
                 "decode", "dominant", "task_of", "singles_on", "gangs", "first_device")

    def __init__(self, pipelines: Sequence[tuple[SubStageGraph, tuple[int, ...]]], node: NodeSpec,
                 cache: SchedulerCache | None = None, links: Sequence[tuple[str, str]] = ()):
        cache = cache or SchedulerCache()
        self.tasks: list[Task] = []
        self.names: list[str] = []
        self.pipe_tasks: list[tuple[int, ...]] = []
        self.num_devices = node.num_devices
        self.mem_bytes = node.mem_bytes
        parts = []
        for p, (graph, devices) in enumerate(pipelines):
            start = len(self.tasks)
            part = cache.part(graph, devices, p, start, node)
            parts.append(part)
            self.tasks.extend(part.tasks)
            self.names.append(graph.pipeline)
            self.pipe_tasks.append(tuple(range(start, len(self.tasks))))
        self.kinds = tuple(t.kind for t in self.tasks)
        self.mergeable = tuple(frozenset(i for i in ids if self.tasks[i].mergeable) for ids in self.pipe_tasks)
        # Per pipeline: (FLOPs, exclusive seconds) of its prefill sub-stages -> prefill MFU.
        self.prefill_work = tuple(part.prefill for part in parts)
        # Per pipeline: its decode step latency against KV tokens (prices merged tails).
        self.decode = tuple(part.decode for part in parts)
        self.dominant = tuple(k for part in parts for k in part.dominant)
        self.task_of = tuple(part.task_of for part in parts)
        """Per pipeline, the task index of each of its sub-stage ids."""
        on: list[list[int]] = [[] for _ in range(node.num_devices)]
        for t in self.tasks:
            if len(t.devices) == 1:
                on[t.devices[0]].append(t.idx)
        self.singles_on = tuple(frozenset(ids) for ids in on)
        """Per device, the tasks that run on it alone (one replica, one device)."""
        self.gangs = frozenset(t.idx for t in self.tasks if len(t.devices) > 1)
        self.first_device = tuple(t.devices[0] if t.devices else -1 for t in self.tasks)
        """Per task, its first device (-1: a host task)."""
        if links:
            _link(self, links)


class _Part(NamedTuple):
    """One pipeline's share of a Problem (its tasks never change once built)."""

    tasks: tuple[Task, ...]
    dominant: tuple[str, ...]
    prefill: tuple[float, float]
    decode: DecodeFit | None
    task_of: dict[str, int]
    """The task index of every sub-stage id."""


class SchedulerCache:
    """What the scheduler keeps between calls on one node (owned by a policy instance).

    Graphs hash by identity: a pipeline whose graph did not change since the last call reuses
    its tasks; one whose graph kept its shape (same ids and dependencies: the next decision
    of a running pipeline) has only its changed tasks rebuilt.  Each table is bounded.
    """

    __slots__ = ("tables_of", "tables", "_parts", "_shapes", "_problems")
    MAX_PARTS, MAX_SHAPES, MAX_PROBLEMS = 64, 32, 16

    def __init__(self):
        self.tables_of: tuple | None = None
        """(grid, pairs) the tables are of."""
        self.tables: dict = {}
        """Lookups on them (context.Context): pair points by SM share, packing efficiencies."""
        self._parts: OrderedDict[tuple, _Part] = OrderedDict()
        self._shapes: OrderedDict[tuple, _Shape] = OrderedDict()
        self._problems: OrderedDict[tuple, Problem] = OrderedDict()

    def tables_for(self, grid, pairs=None) -> dict:
        if self.tables_of is None or grid is not self.tables_of[0] or pairs is not self.tables_of[1]:
            self.tables_of, self.tables = (grid, pairs), {}
        return self.tables

    def problem(self, pipelines: tuple[tuple[SubStageGraph, tuple[int, ...]], ...], node: NodeSpec,
                links: tuple[tuple[str, str], ...] = ()) -> Problem:
        """Problems are rebuilt only when a graph, a placement or a link changes."""
        key = (pipelines, node, links)
        got = _lru(self._problems, key, self.MAX_PROBLEMS)
        if got is None:
            got = self._problems[key] = Problem(pipelines, node, self, links)
        return got

    def part(self, graph: SubStageGraph, devices: tuple[int, ...], pipe: int, start: int, node: NodeSpec) -> _Part:
        key = (graph, devices, pipe, start, node)
        got = _lru(self._parts, key, self.MAX_PARTS)
        if got is None:
            _check_placement(graph, devices, node)
            shape_key = (pipe, start, devices, node, tuple(s.id for s in graph))
            shape = _lru(self._shapes, shape_key, self.MAX_SHAPES)
            if shape is None or shape.graph.deps != graph.deps:
                shape = self._shapes[shape_key] = _Shape.build(graph, devices, pipe, start, node)
            else:
                shape.patch(graph, devices)
            got = self._parts[key] = shape.part
        return got


def _lru(table: OrderedDict, key, limit: int):
    """table[key] marked most recent, or None (dropping the oldest entries past `limit`)."""
    got = table.get(key)
    if got is not None:
        table.move_to_end(key)
    else:
        while len(table) >= limit:
            table.popitem(last=False)
    return got


class _Shape:
    """The structure of one pipeline's graph (which sub-stages form which task) and the
    part last built on it."""

    __slots__ = ("graph", "pipe", "start", "members", "task_of", "slot_of", "chain", "tools", "part")

    @classmethod
    def build(cls, graph: SubStageGraph, devices: tuple[int, ...], pipe: int, start: int, node: NodeSpec) -> _Shape:
        sh = cls()
        sh.graph, sh.pipe, sh.start = graph, pipe, start
        sh.members, sh.task_of = _groups(graph, start)
        sh.slot_of = [0] * len(graph)
        for slot, group in enumerate(sh.members):
            for k in group:
                sh.slot_of[k] = slot
        nodes = graph.substages
        tasks = [_make_task(graph, [nodes[k] for k in group], devices, pipe, start + i, sh.task_of)
                 for i, group in enumerate(sh.members)]
        _fill_tails(tasks, start)
        sh.tools = any(t.kind == "tool" for t in tasks)
        if sh.tools:  # multi-turn: no merging (see _make_task)
            for t in tasks:
                t.mergeable = False
        sh.chain = {}
        dominant = [_dominant(t, tasks, start, sh.chain) for t in reversed(tasks)][::-1]
        sh.part = _Part(tasks=tuple(tasks), dominant=tuple(dominant), prefill=prefill_stats(graph),
                        decode=decode_fit(graph), task_of=sh.task_of)
        return sh

    def patch(self, graph: SubStageGraph, devices: tuple[int, ...]) -> None:
        """Rebuild the tasks whose sub-stages changed, and re-derive what depends on them
        (tails and dominant kinds of their ancestors); the rest are shared."""
        old, new, start = self.graph.substages, graph.substages, self.start
        changed = {self.slot_of[k] for k, (a, b) in enumerate(zip(old, new)) if a is not b and a != b}
        tasks = list(self.part.tasks)
        dirty = _with_ancestors(changed, tasks, start)
        for i in dirty:
            tasks[i] = (_make_task(graph, [new[k] for k in self.members[i]], devices, self.pipe, start + i,
                                   self.task_of) if i in changed else _copy(tasks[i]))
        dominant = list(self.part.dominant)
        for i in sorted(dirty, reverse=True):  # successors first
            t = tasks[i]
            _fill_tail(t, tasks, start)
            dominant[i] = _dominant(t, tasks, start, self.chain)
        if self.tools:
            for i in changed:
                tasks[i].mergeable = False
        self.graph = graph
        self.part = _Part(tasks=tuple(tasks), dominant=tuple(dominant), prefill=prefill_stats(graph),
                          decode=decode_fit(graph), task_of=self.task_of)


def _with_ancestors(changed: set[int], tasks: Sequence[Task], start: int) -> set[int]:
    out, stack = set(changed), list(changed)
    while stack:
        for j in tasks[stack.pop()].preds:
            if j - start not in out:
                out.add(j - start)
                stack.append(j - start)
    return out


def _copy(t: Task) -> Task:
    c = Task.__new__(Task)
    for name in Task.__slots__:
        setattr(c, name, getattr(t, name))
    return c


def problem_for(pipelines: tuple[tuple[SubStageGraph, tuple[int, ...]], ...], node: NodeSpec,
                cache: SchedulerCache | None = None, links: tuple[tuple[str, str], ...] = ()) -> Problem:
    """The Problem of these graphs and placements (from `cache` when it has it); `links`:
    (before, after) sub-stage ids of two pipelines (PipelineState.waits_for)."""
    return (cache or SchedulerCache()).problem(pipelines, node, links)


def _link(P: Problem, links: Sequence[tuple[str, str]]) -> None:
    """Dependencies between pipelines' tasks: the linked tasks, and every task whose tail now
    runs through a link, are copied (a part's tasks are shared with other Problems) and their
    tails filled again over the whole Problem."""
    index = {name: p for p, name in enumerate(P.names)}
    edges = {(a, b) for a, b in ((_task_of(P, index, x), _task_of(P, index, y)) for x, y in links)
             if a is not None and b is not None and P.tasks[a].pipe != P.tasks[b].pipe}
    if not edges:
        return
    tasks = P.tasks
    linked = {i for edge in edges for i in edge}
    for i in linked:
        tasks[i] = _copy(tasks[i])
    for a, b in edges:
        tasks[a].succs = tuple(sorted({*tasks[a].succs, b}))
        tasks[b].preds = tuple(sorted({*tasks[b].preds, a}))
    dirty = _with_ancestors({a for a, _ in edges}, tasks, 0)  # across links too: they are in place
    for i in dirty - linked:
        tasks[i] = _copy(tasks[i])
    for i in _successors_first(dirty, tasks):
        _fill_tail(tasks[i], tasks, 0)


def _task_of(P: Problem, index: dict[str, int], sid: str) -> int | None:
    p = index.get(pipeline_of(sid))
    return None if p is None else P.task_of[p].get(sid)


def _successors_first(subset: set[int], tasks: Sequence[Task]) -> tuple[int, ...]:
    """`subset` ordered so that each task comes after its successors in it; ValueError on a
    cycle (links that make one pipeline wait on itself)."""
    after = TopologicalSorter({i: [j for j in tasks[i].succs if j in subset] for i in subset})
    try:
        return tuple(after.static_order())
    except CycleError as exc:
        raise ValueError(f"links between pipelines make a cycle through {tasks[exc.args[1][0]].ids[0]}") from None


def _dominant(t: Task, tasks: Sequence[Task], start: int, chain: dict[int, dict[str, float]]) -> str:
    """What task t mostly is: for a rollout piece, the kind with the most exclusive time in
    its worker's rollout chain from there on (a rollout opens with a short prefill but is
    mostly its tail); other tasks are their own kind.  Needs its successors' entries in
    `chain` (call in reverse topological order); records its own."""
    if not t.kind.startswith("rollout") and t.kind != "tool":
        return t.kind
    totals = {t.kind: t.excl_s} if t.devices else {}
    for j in t.succs:
        if j in chain and tasks[j - start].ranks == t.ranks:
            for kind, sec in chain[j].items():
                totals[kind] = totals.get(kind, 0.0) + sec
    chain[t.idx] = totals
    return max(totals, key=totals.get) if t.devices and totals else t.kind


def prefill_stats(graph: SubStageGraph) -> tuple[float, float]:
    """(FLOPs, exclusive seconds) of the graph's prefill sub-stages that report FLOPs."""
    pre = [s for s in graph if s.kind is SubStageKind.ROLLOUT_PREFILL and s.flops > 0]
    return sum(s.flops for s in pre), sum(s.duration_s for s in pre)


def decode_fit(graph: SubStageGraph) -> DecodeFit | None:
    """Fit over the graph's last step: predicted pieces, whose batch, context and step time
    all come from the same measured history (a live piece pairs the engine's current batch
    with a predicted duration)."""
    last = max((s.step for s in graph), default=0)
    points = [(s.batch_size * s.seq_len, s.duration_s / s.num_steps) for s in graph
              if s.step == last and s.kind in _DECODING and s.num_steps > 1 and s.batch_size > 0]
    return DecodeFit.fit(points)


def _check_placement(graph: SubStageGraph, devices: tuple[int, ...], node: NodeSpec) -> None:
    if len(devices) < graph.num_dp_ranks:
        raise ValueError(f"pipeline {graph.pipeline!r} has {graph.num_dp_ranks} DP ranks but "
                         f"{len(devices)} devices were given")
    if len(set(devices)) != len(devices) or any(not 0 <= d < node.num_devices for d in devices):
        raise ValueError(f"pipeline {graph.pipeline!r}: devices {devices} must be distinct and in "
                         f"[0, {node.num_devices})")
    for s in graph:
        if s.mem_bytes > node.mem_bytes and _KIND[s.kind][1]:
            raise ValueError(f"sub-stage {s.id} needs {s.mem_bytes} bytes; a device has {node.mem_bytes}")


def _groups(graph: SubStageGraph, start: int) -> tuple[list[list[int]], dict[str, int]]:
    """Positions of the sub-stages of each task (a collective's replicas form one: the k-th
    sub-stage of a collective kind in a step on every worker), and every id's task index."""
    members: list[list[int]] = []
    task_of: dict[str, int] = {}
    gang_slot: dict[tuple, int] = {}
    seen: dict[tuple, int] = {}
    for k, s in enumerate(graph):  # topological order, so tasks are sorted too
        if _KIND[s.kind][3]:
            base = (s.step, s.kind, s.dp_rank)
            nth = seen[base] = seen.get(base, -1) + 1
            key = (s.step, s.kind, nth)
            slot = gang_slot.get(key)
            if slot is None:
                slot = gang_slot[key] = len(members)
                members.append([])
        else:
            slot = len(members)
            members.append([])
        members[slot].append(k)
        task_of[s.id] = start + slot
    return members, task_of


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


_DECODING = frozenset({SubStageKind.ROLLOUT_DECODE, SubStageKind.ROLLOUT_TAIL})
_KIND = {k: (k.value, k.on_device, k.is_rollout, k.collective) for k in SubStageKind}
"""Enum properties looked up once: task construction runs at every scheduling call."""


def _make_task(graph: SubStageGraph, group: list, devices: tuple[int, ...], pipe: int, idx: int,
               task_of: dict[str, int]) -> Task:
    t = Task()
    first = group[0]
    kind, on_device, _, _ = _KIND[first.kind]
    t.idx, t.pipe, t.kind, t.step = idx, pipe, kind, first.step
    deps, succ = graph.deps, graph._succ
    if len(group) == 1:  # most tasks: written out, this runs for every task at every decision
        sid, rank = first.id, first.dp_rank
        t.ids, t.ranks = (sid,), (rank,)
        t.excl_s, t.mem_bytes, t.batch_size = first.duration_s, first.mem_bytes, first.batch_size
        pre, nxt = deps[sid], succ[sid]
        t.preds = (task_of[pre[0]],) if len(pre) == 1 else tuple(sorted({task_of[d] for d in pre}))
        t.succs = (task_of[nxt[0]],) if len(nxt) == 1 else tuple(sorted({task_of[n] for n in nxt}))
        t.devices = (devices[rank],) if on_device else ()
    else:
        t.ids = tuple(s.id for s in group)
        t.ranks = tuple(s.dp_rank for s in group)
        t.excl_s = max(s.duration_s for s in group)
        t.mem_bytes = max(s.mem_bytes for s in group)
        t.batch_size = sum(s.batch_size for s in group)
        # The ids first (a gang after a DP barrier: every member depends on every worker's tail).
        t.preds = tuple(sorted({task_of[d] for d in set().union(*[deps[s.id] for s in group])} - {idx}))
        t.succs = tuple(sorted({task_of[n] for n in set().union(*[succ[s.id] for s in group])} - {idx}))
        t.devices = tuple(devices[r] for r in t.ranks) if on_device else ()
    # A worker waiting on a tool keeps its engine (and the waiting requests' KV cache) on
    # its device: it holds one of the device's two places for its return.
    t.hold_device = devices[first.dp_rank] if kind == "tool" else None
    # A tail with no rollout after it on its worker may take other workers' requests; not in
    # a multi-turn pipeline, whose requests may come back from a tool for more turns (moving
    # their later turns and tool calls onto one worker, which ΔT does not price): the
    # caller clears the flag there.
    t.mergeable = kind == "rollout_tail" and not any(_KIND[graph[n].kind][2] for n in succ[first.id])
    t.context_tokens = int(first.batch_size * first.seq_len)
    t.num_steps = first.num_steps
    t.flops_per_token = first.flops / first.num_tokens if first.num_tokens and first.flops else 0.0
    return t


def _fill_tails(tasks: list[Task], start: int) -> None:
    """tail_s: longest chain of exclusive durations after the task (to its pipeline's sink);
    step_tail_s: the same within the task's own step (to the step's end: its SLO deadline)."""
    for t in reversed(tasks):
        _fill_tail(t, tasks, start)


def _fill_tail(t: Task, tasks: Sequence[Task], start: int) -> None:
    tail = step_tail = 0.0  # one pass, written out: a cold Problem fills thousands
    step = t.step
    for j in t.succs:
        u = tasks[j - start]
        v = u.excl_s + u.tail_s
        if v > tail:
            tail = v
        if u.step == step and u.pipe == t.pipe:  # a link leaves the step (another pipeline's)
            v = u.excl_s + u.step_tail_s
            if v > step_tail:
                step_tail = v
    t.tail_s, t.step_tail_s = tail, step_tail
