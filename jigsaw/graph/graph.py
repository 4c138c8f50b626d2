"""Per-pipeline sub-stage DAG: dependencies, frontier, critical path.

    SubStage nodes + dependency edges ─► SubStageGraph
        .frontier(done, running)   ready sub-stages (what the scheduler may start)
        .critical_path()           longest chain of exclusive durations
        .gangs()                   collective replicas that must run in lockstep
        .then(next_step_graph)     steps chained by a barrier (multi-step horizon)

A synchronous GRPO step looks like

    r0: prefill ─► decode ─► tail ─┐                 ┌─► ref r0 ─┐     ┌─► train r0
    r1: prefill ─► decode ──────── ┼─► (reward) ─────┼─► ref r1 ──┼─────┼─► train r1
    ...                            ┘                 └─► ...     ┘     └─► ...

one replica of the rollout chain per DP worker, barriers between stages.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass

from jigsaw.graph.substage import SubStage


@dataclass(frozen=True, kw_only=True, slots=True)
class CriticalPath:
    """Longest dependency chain of a graph, by exclusive duration."""

    length_s: float
    """Sum of the chain's durations."""
    ids: tuple[str, ...]
    """Sub-stage ids along the chain, first to last."""


class SubStageGraph:
    """Immutable DAG of one pipeline's sub-stages (one or more RL steps).

    `deps[id]` lists the sub-stages that must finish before `id` may start.
    Construction checks that ids are unique, every dependency exists and there is
    no cycle; `substages` is stored in a topological order.
    """

    __slots__ = ("pipeline", "substages", "deps", "_index", "_succ", "__weakref__")

    def __init__(self, substages: Iterable[SubStage], deps: Mapping[str, Sequence[str]]):
        nodes = tuple(substages)
        index = {s.id: s for s in nodes}
        if len(index) != len(nodes):
            raise ValueError("duplicate sub-stage id in graph")
        pipelines = {s.pipeline for s in nodes}
        if len(pipelines) > 1:
            raise ValueError(f"a graph holds one pipeline, got {sorted(pipelines)}")
        clean = {sid: tuple(dict.fromkeys(deps.get(sid, ()))) for sid in index}
        for sid in deps:
            if sid not in index:
                raise ValueError(f"dependencies given for unknown sub-stage {sid!r}")
        for sid, ds in clean.items():
            for d in ds:
                if d not in index:
                    raise ValueError(f"sub-stage {sid!r} depends on unknown {d!r}")
        order = _toposort(index, clean)
        self.pipeline = pipelines.pop() if pipelines else ""
        self.substages = tuple(index[i] for i in order)
        self.deps = clean
        self._index = index
        succ: dict[str, list[str]] = {sid: [] for sid in order}
        for sid in order:
            for d in clean[sid]:
                succ[d].append(sid)
        self._succ = {k: tuple(v) for k, v in succ.items()}

    @classmethod
    def from_ordered(cls, substages: Sequence[SubStage], deps: Mapping[str, tuple[str, ...]]) -> SubStageGraph:
        """Trusted construction for a caller that lists sub-stages in a topological order with
        unique ids and duplicate-free deps on earlier ids, all of one pipeline (the simulator's
        view, rebuilt at every decision); skips the checks and the sort."""
        g = cls.__new__(cls)
        g.substages = tuple(substages)
        g._index = {s.id: s for s in g.substages}
        g.pipeline = g.substages[0].pipeline if g.substages else ""
        g.deps = {sid: deps.get(sid, ()) for sid in g._index}
        succ: dict[str, list[str]] = {sid: [] for sid in g._index}
        for sid, ds in g.deps.items():
            for d in ds:
                succ[d].append(sid)
        g._succ = {k: tuple(v) for k, v in succ.items()}
        return g

    def __len__(self) -> int:
        return len(self.substages)

    def __iter__(self) -> Iterator[SubStage]:
        return iter(self.substages)

    def __getitem__(self, sid: str) -> SubStage:
        return self._index[sid]

    def __contains__(self, sid: object) -> bool:
        return sid in self._index

    def __repr__(self) -> str:
        return f"SubStageGraph({self.pipeline!r}, {len(self)} sub-stages, steps={self.steps})"

    @property
    def steps(self) -> tuple[int, ...]:
        return tuple(sorted({s.step for s in self.substages}))

    @property
    def num_dp_ranks(self) -> int:
        return 1 + max((s.dp_rank for s in self.substages), default=-1)

    def successors(self, sid: str) -> tuple[str, ...]:
        return self._succ[sid]

    def sources(self) -> tuple[SubStage, ...]:
        return tuple(s for s in self.substages if not self.deps[s.id])

    def sinks(self) -> tuple[SubStage, ...]:
        return tuple(s for s in self.substages if not self._succ[s.id])

    def frontier(self, done: Iterable[str] = (), running: Iterable[str] = ()) -> tuple[SubStage, ...]:
        """Sub-stages not done or running whose dependencies are all done."""
        done_set, busy = set(done), set(running)
        return tuple(
            s for s in self.substages
            if s.id not in done_set and s.id not in busy and all(d in done_set for d in self.deps[s.id])
        )

    def critical_path(self, durations_s: Mapping[str, float] | None = None) -> CriticalPath:
        """Longest chain; `durations_s` overrides the exclusive duration of some nodes."""
        if not self.substages:
            return CriticalPath(length_s=0.0, ids=())
        finish: dict[str, float] = {}
        via: dict[str, str | None] = {}
        for s in self.substages:
            d = s.duration_s if durations_s is None else durations_s.get(s.id, s.duration_s)
            best = max(self.deps[s.id], key=finish.__getitem__, default=None)
            finish[s.id] = d + (finish[best] if best is not None else 0.0)
            via[s.id] = best
        end = max(finish, key=finish.__getitem__)
        chain = [end]
        while (prev := via[chain[-1]]) is not None:
            chain.append(prev)
        return CriticalPath(length_s=finish[end], ids=tuple(reversed(chain)))

    def gangs(self) -> tuple[tuple[SubStage, ...], ...]:
        """Collective sub-stages in lockstep: the k-th one of a kind in a step on every worker."""
        groups: dict[tuple, list[SubStage]] = {}
        seen: dict[tuple, int] = {}
        for s in self.substages:
            if s.kind.collective:
                base = (s.step, s.kind.value, s.dp_rank)
                k = seen[base] = seen.get(base, -1) + 1
                groups.setdefault((s.step, s.kind.value, k), []).append(s)
        return tuple(tuple(sorted(g, key=lambda s: s.dp_rank)) for g in groups.values())

    def then(self, nxt: SubStageGraph) -> SubStageGraph:
        """This graph followed by `nxt`: every source of `nxt` waits for every sink here."""
        if self.pipeline and nxt.pipeline and self.pipeline != nxt.pipeline:
            raise ValueError(f"cannot chain {self.pipeline!r} with {nxt.pipeline!r}")
        sinks = tuple(s.id for s in self.sinks())
        deps = dict(self.deps)
        for s in nxt.substages:
            deps[s.id] = nxt.deps[s.id] if nxt.deps[s.id] else sinks
        return SubStageGraph(self.substages + nxt.substages, deps)

    def total_work_s(self, on_device_only: bool = True) -> float:
        """Sum of exclusive durations (device sub-stages only by default)."""
        return sum(s.duration_s for s in self.substages if s.kind.on_device or not on_device_only)


def _toposort(index: Mapping[str, SubStage], deps: Mapping[str, tuple[str, ...]]) -> list[str]:
    # Kahn's algorithm; ties broken by insertion order so the result is deterministic.
    indeg = {sid: len(ds) for sid, ds in deps.items()}
    succ: dict[str, list[str]] = {sid: [] for sid in index}
    for sid, ds in deps.items():
        for d in ds:
            succ[d].append(sid)
    ready = deque(sid for sid in index if indeg[sid] == 0)
    order: list[str] = []
    while ready:
        sid = ready.popleft()
        order.append(sid)
        for nxt in succ[sid]:
            indeg[nxt] -= 1
            if indeg[nxt] == 0:
                ready.append(nxt)
    if len(order) != len(index):
        stuck = sorted(sid for sid, n in indeg.items() if n > 0)
        raise ValueError(f"dependency cycle among sub-stages {stuck[:5]}")
    return order
