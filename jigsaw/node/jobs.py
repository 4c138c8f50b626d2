"""An asynchronous job's two sides on one node, and the sample buffer between them in the view.

    LivePipeline × K  (job, mode, staleness: as each side's client said them)
      ├─ couplings(): job ─► (rollout side, training side, bound) where both sides are here
      │  and one of them said its mode (the larger bound when they differ: the looser one)
      ├─ idle_sides(): a coupled side that asks for nothing while the other side is live
      └─ planned_together(): pipelines joined by devices and jobs (the node's groups)
    PipelineState × K ─► with_buffers(): each side's `waits_for` gains the buffer's edges
         (graph/buffer.py `buffer_edges`) into its pieces that have not asked yet; an idle side
         joins the view (View.waiting) where every first piece of it waits on the other side
      ─► the scheduler's Problem links the two sides' tasks: the critical path crosses the
         buffer (training waits for its batch, a rollout round for its weights)

A piece that asked or runs waits on nothing: its client knows the buffer let it go, and a
side's report may reach the node after the other side's request (two clients, two sockets).
An idle side is what the look-ahead counts on coming, never what a plan may start now: none
of its pieces is ready until the other side's piece it waits for ends.  The same view is the
daemon's, the simulator's and the graph executor's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import NamedTuple

from jigsaw.graph.buffer import buffer_edges, train_side
from jigsaw.graph.ids import pipeline_of
from jigsaw.graph.plan import PipelineState
from jigsaw.node.ledger import LivePipeline


class Coupling(NamedTuple):
    """One job's sides on the node (by position in the caller's list) and its bound."""

    rollout: int
    train: int
    staleness: int


def couplings(live: Sequence[LivePipeline]) -> list[Coupling]:
    """Jobs whose rollout side (the job's own name) and training side (`<job>.train`) are both
    in `live` and whose mode a side said; a job whose mode nobody said is not coupled."""
    at = {p.name: i for i, p in enumerate(live)}
    out = []
    for i, p in enumerate(live):
        if p.job != p.name or (j := at.get(train_side(p.name))) is None or live[j].job != p.name:
            continue
        said = [q.staleness for q in (p, live[j]) if q.mode]
        if said:
            out.append(Coupling(rollout=i, train=j, staleness=max(said)))
    return out


def idle_sides(pipelines: Sequence[LivePipeline]) -> list[LivePipeline]:
    """Sides of a coupled job that ask for nothing while the other side is live: what they do
    next waits on it through the buffer (a training side between steps, a rollout side
    waiting for weights).  Only one with a graph to show (a known one, or steps behind it)."""
    out = []
    for c in couplings(pipelines):
        for mine, other in ((c.rollout, c.train), (c.train, c.rollout)):
            p = pipelines[mine]
            if not p.live and pipelines[other].live and (p.static is not None or p.started):
                out.append(p)
    return out


def with_buffers(states: list[PipelineState], pipelines: Sequence[LivePipeline],
                 live: int) -> tuple[list[PipelineState], list[PipelineState]]:
    """`states` (one per pipeline of `pipelines`, the first `live` of them live, the rest idle
    sides) with each coupled side waiting on the other: (the live ones, the idle ones whose
    every first piece waits on a piece of the other side still to end; no other may be
    counted on, since nothing of it asked)."""
    held = []
    for c in couplings(pipelines):
        edges = buffer_edges(states[c.rollout].graph, states[c.train].graph, c.staleness)
        for mine, other in ((c.rollout, c.train), (c.train, c.rollout)):
            p = pipelines[mine]
            waits = tuple((a, b) for a, b in edges
                          if pipeline_of(b) == p.name and b not in p.waiting and b not in p.running)
            if waits:
                states[mine] = replace(states[mine], waits_for=states[mine].waits_for + waits)
            if mine >= live and _held(states[mine], states[other]):
                held.append(mine)
    return states[:live], [states[i] for i in sorted(held)]


def _held(idle: PipelineState, other: PipelineState) -> bool:
    pending = {b for a, b in idle.waits_for if a in other.graph and a not in other.done}
    first = idle.graph.frontier(idle.done)
    return bool(first) and all(s.id in pending for s in first)


def planned_together(pipelines: Sequence[LivePipeline]) -> list[list[LivePipeline]]:
    """Pipelines joined by the devices they share, and a job's sides by their buffer (they wait
    on each other wherever they run): the groups a node plans apart (connected components)."""
    root = {d: d for p in pipelines for d in p.devices}

    def find(d: int) -> int:
        while root[d] != d:
            root[d] = d = root[root[d]]
        return d

    first: dict[str, LivePipeline] = {}
    for p in pipelines:
        for d in p.devices[1:]:
            root[find(d)] = find(p.devices[0])
        other = first.setdefault(p.job, p)
        root[find(p.devices[0])] = find(other.devices[0])
    out: dict[int, list[LivePipeline]] = {}
    for p in pipelines:
        out.setdefault(find(p.devices[0]), []).append(p)
    return list(out.values())
