"""The exact optimum over the system's decision space, for tests and bench/scheduler_quality.py.

    pipelines ─► Problem + State (the scheduler's bookkeeping: tasks, gangs, tool holds)
      dfs(state):  at the current event (time 0, then every completion)
        host tasks (tool waits, rewards) start at once, as the node admits them
        choose ANY subset of the ready device tasks to start, idling included; each one that
          joins a running partner takes a grid point (σ, memory split) per device, every
          feasible one (Pareto-dominated slowdown pairs dropped: after the start the split
          only matters through the two slowdowns)
        advance to the next completion (a survivor gets its device back) ─► dfs
      pruned by `actions.lower_bound` (no piece faster than alone, no device clearing work
      faster than its best pair) and by states already reached at the same time or earlier
    ─► Optimum(makespan, events): each event's assignments, replayable through
       `jigsaw.sim.execute` with `Replay` (validates the search against the executor)

What the system may do and the search covers: start or hold back any ready sub-stage at any
completion, co-locate two per device at any partitioned grid point (σ + (1 − σ) = 1) that
fits both memories (`Context.feasible`; the split by need it gives an urgent engine never
arises here: no instance has one), lockstep gangs whole, tool waits holding a place on their worker's
device, and room left beside a rollout that continues for its next piece (its engine
stays on the device: `actions.leaves_room`, the scheduler's own rule).  Not covered: tail
migration (instances carry no FLOPs, so nothing can be merged), unpartitioned sharing (the
scheduler never grants it) and decisions between completions.
Exponential: small instances only (1–2 devices, two pipelines, a few pieces each).
"""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from factories import GIB, sub

from jigsaw.graph import actions as act
from jigsaw.graph import state as st
from jigsaw.graph.graph import SubStageGraph
from jigsaw.graph.plan import Assignment, NodeSpec, PipelineState, Plan, SchedulerConfig
from jigsaw.graph.policy import View, colocated
from jigsaw.graph.problem import SchedulerCache
from jigsaw.graph.schedule import assignments
from jigsaw.graph.substage import SubStageKind as K

_EXACT = SchedulerConfig(min_pack_efficiency=1.0, merge=False)
SPACE = "2: an urgent rollout engine takes a memory split by need where no grid level holds its pair"
"""The decision space's version: change it with what the search may do (the scheduler's
`Context.feasible`, start rules), so that optima solved before (bench/scheduler_quality.py's
cache) are solved again."""


class SearchLimit(RuntimeError):
    """The search ran past its node or time limit (the instance is too large to solve)."""


@dataclass(frozen=True, slots=True)
class Event:
    time_s: float
    started: tuple[str, ...]
    assignments: tuple[Assignment, ...]
    """Every replica on a device after this event's starts (what the plan grants)."""


@dataclass(frozen=True, slots=True)
class Optimum:
    makespan_s: float
    events: tuple[Event, ...]
    nodes: int
    """States expanded (the search's size)."""


def solve(pipelines: Sequence[PipelineState], node: NodeSpec, model, *, node_limit: int = 2_000_000,
          time_limit_s: float | None = None, upper_s: float = float("inf")) -> Optimum:
    """The minimum makespan of `pipelines` on `node` under `model` (a slowdown grid).
    `upper_s`: the makespan of a schedule known to be in the space (a policy's), which
    prunes from the start."""
    opt = _Search(pipelines, node, model, node_limit, time_limit_s, upper_s * (1 + 1e-7)).run()
    if not opt.events:
        raise ValueError(f"no schedule reaches {upper_s} s: the upper bound is not a schedule of this space")
    return opt


@dataclass
class _Search:
    pipelines: Sequence[PipelineState]
    node: NodeSpec
    model: object
    node_limit: int
    time_limit_s: float | None
    best_s: float
    best: tuple[Event, ...] = ()
    nodes: int = 0
    seen: dict = field(default_factory=dict)

    def __post_init__(self):
        cache = SchedulerCache()
        self.P = cache.problem(tuple((ps.graph, tuple(ps.devices)) for ps in self.pipelines), self.node,
                               tuple(edge for ps in self.pipelines for edge in ps.waits_for))
        self.ctx = act.Context(self.model, _EXACT, self.node, cache, self.pipelines)
        self.levels = [s for s in self.model.sm_levels if s < 1.0]
        self.min_s = self.ctx.min_slowdown
        self.deadline = None if self.time_limit_s is None else time.monotonic() + self.time_limit_s
        self.fronts: dict[tuple, object] = {}

    def run(self) -> Optimum:
        S = st.initial_state(self.P, self.pipelines, 0.0, True)
        self.pack = act.packing(self.P, S, self.ctx)
        self._dfs(S, ())
        return Optimum(makespan_s=self.best_s, events=self.best, nodes=self.nodes)

    def _dfs(self, S: st.State, events: tuple[tuple, ...]) -> None:
        self._tick()
        for i in sorted(S.ready):
            if not self.P.tasks[i].devices:
                st.start(self.P, S, i)
                st.refresh_rate(self.P, S, i, True)
        if not S.running and not S.ready:
            if max(S.end_s) < self.best_s - 1e-9:
                self.best_s, self.best = max(S.end_s), tuple(self._event(*ev) for ev in events)
            return
        if self._bound(S) >= self.best_s - 1e-9 or self._reached(S):
            return
        candidates = sorted(i for i in S.ready if self.P.tasks[i].devices)
        for after, started in self._choices(S, candidates, 0, ()):
            if not after.running:
                continue  # nothing started and nothing runs: no time can pass
            ev = (after.now_s, started, after.dev[:], dict(after.split))  # made an Event only if it is the best
            st.advance(self.P, after, True)
            self._dfs(after, (*events, ev))

    def _event(self, time_s: float, started: tuple[int, ...], dev: list, split: dict) -> Event:
        S = st.State.__new__(st.State)
        S.dev, S.split = dev, split
        return Event(time_s=time_s, started=tuple(s for i in started for s in self.P.tasks[i].ids),
                     assignments=assignments(self.P, S, self.ctx))

    def _choices(self, S: st.State, cands: list[int], k: int,
                 started: tuple[int, ...]) -> Iterator[tuple[st.State, tuple[int, ...]]]:
        """Every subset of cands[k:] started now, each with every placement (starting first:
        good incumbents early prune the rest)."""
        if k == len(cands):
            yield S, started
            return
        i = cands[k]
        for placement in self._placements(S, i):
            branch = S.copy()
            self._start(branch, i, placement)
            yield from self._choices(branch, cands, k + 1, (*started, i))
        yield from self._choices(S, cands, k + 1, started)

    def _placements(self, S: st.State, i: int) -> list[tuple]:
        """Per device of task i: None (alone) or the grid point beside the partner there."""
        per_device = []
        for d in self.P.tasks[i].devices:
            if st.places_taken(self.P, S, i, d) >= 2 or not act.leaves_room(self.P, S, self.ctx, i, d):
                return []
            if not S.dev[d]:
                per_device.append([None])
                continue
            points = self._front(i, S.dev[d][0])
            if not points:
                return []
            per_device.append(points)
        return list(itertools.product(*per_device))

    def _front(self, x: int, y: int) -> list[tuple[float, act.PairPoint]]:
        """Every feasible (σ, point) for x beside y, less those whose slowdowns another beats."""
        key = (x, y)
        got = self.fronts.get(key)
        if got is None:
            pts = [(sm, pt) for sm in self.levels for pt in self.ctx.feasible(self.P, x, y, sm)]
            got = self.fronts[key] = [
                (sm, pt) for sm, pt in pts
                if not any(q.slowdown <= pt.slowdown and q.partner_slowdown <= pt.partner_slowdown
                           and (q.slowdown, q.partner_slowdown) != (pt.slowdown, pt.partner_slowdown)
                           for _, q in pts)]
            got = list({(pt.slowdown, pt.partner_slowdown): (sm, pt) for sm, pt in got}.values())
        return got

    def _start(self, S: st.State, i: int, placement: tuple) -> None:
        partners = {d: S.dev[d][0] for d in self.P.tasks[i].devices if S.dev[d]}
        st.start(self.P, S, i)
        for d, choice in zip(self.P.tasks[i].devices, placement):
            if choice is None:
                continue
            sm, pt = choice
            st.place_pair(S, i, partners[d], d, (sm, *pt))
        for j in {*partners.values(), i}:
            st.refresh_rate(self.P, S, j, True)

    def _bound(self, S: st.State) -> float:
        return act.lower_bound(self.P, S, self.min_s, self.pack)

    def _reached(self, S: st.State) -> bool:
        """Was this exact configuration reached before at the same time or earlier?"""
        key = (tuple(S.status), tuple(round(r, 9) for r in S.rem_s), tuple(S.dev),
               tuple(sorted((k, v.slowdown) for k, v in S.split.items())), tuple(round(e - S.now_s, 9)
                                                                                for e in S.end_s))
        prev = self.seen.get(key)
        if prev is not None and prev <= S.now_s + 1e-9:
            return True
        self.seen[key] = S.now_s
        return False

    def _tick(self) -> None:
        self.nodes += 1
        if self.nodes > self.node_limit:
            raise SearchLimit(f"exact search passed {self.node_limit} states")
        if self.deadline is not None and self.nodes % 256 == 0 and time.monotonic() > self.deadline:
            raise SearchLimit(f"exact search passed {self.time_limit_s} s")


class Replay:
    """A policy that grants exactly the events of an `Optimum`: `execute` under it must reach
    the optimum's makespan, or the search's cost model is not the executor's."""

    name, separable = "replay", False

    def __init__(self, opt: Optimum):
        self.events = list(opt.events)

    def placement(self, k: int, devices: int):
        return colocated(k, devices)

    def plan(self, view: View) -> Plan:
        ev = next((e for e in self.events if abs(e.time_s - view.time_s) <= 1e-6 * max(1.0, e.time_s)), None)
        if ev is None:
            raise AssertionError(f"the executor decides at t={view.time_s}, which the search never reached")
        return Plan(time_s=view.time_s, started=ev.started, assignments=ev.assignments)


# ---------------------------------------------------------------- instance families

ROLLOUT = (K.ROLLOUT_PREFILL, K.ROLLOUT_DECODE, K.ROLLOUT_TAIL, K.TOOL)
MEM_GIB = {K.ROLLOUT_PREFILL: (10, 30), K.ROLLOUT_DECODE: (10, 30), K.ROLLOUT_TAIL: (5, 20),
           K.REFERENCE: (10, 40), K.TRAINING: (30, 55), K.TOOL: (0, 0)}


def grpo(rng: random.Random, name: str, ranks: int, pieces: Sequence[K] | int, step: int = 0, *,
         roll_s: tuple[float, float] = (1, 10), ref_s: tuple[float, float] = (1, 8),
         train_s: tuple[float, float] = (1, 8)) -> SubStageGraph:
    """One GRPO step: a rollout chain per worker (`pieces` kinds, or that many drawn: a
    prefill first, then any rollout kind or tool wait), then reference and training in
    lockstep on every worker.  Durations are drawn uniformly from `roll_s` (each rollout
    piece), `ref_s` and `train_s`."""
    nodes, deps, sinks = [], {}, []
    for r in range(ranks):
        kinds = pieces if not isinstance(pieces, int) else \
            [ROLLOUT[0]] + [rng.choice(ROLLOUT) for _ in range(pieces - 1)]
        prev = None
        for i, kind in enumerate(kinds):
            s = sub(name, f"roll{i}", kind, round(rng.uniform(*roll_s), 2), rank=r, step=step,
                    mem_gib=rng.uniform(*MEM_GIB[kind]))
            nodes.append(s)
            deps[s.id] = (prev,) if prev else ()
            prev = s.id
        sinks.append(prev)
    layer = sinks
    for kind, span in ((K.REFERENCE, ref_s), (K.TRAINING, train_s)):
        dur, mem = round(rng.uniform(*span), 2), rng.uniform(*MEM_GIB[kind])
        nxt = []
        for r in range(ranks):
            s = sub(name, kind.value, kind, dur, rank=r, step=step, mem_gib=mem)
            nodes.append(s)
            deps[s.id] = tuple(layer)
            nxt.append(s.id)
        layer = nxt
    return SubStageGraph(nodes, deps)


def _one_gpu(rng):
    return [PipelineState(graph=grpo(rng, n, 1, rng.randint(2, 3)), devices=(0,)) for n in "AB"], 1


def _multi_turn(rng):
    turns = [K.ROLLOUT_PREFILL, K.ROLLOUT_DECODE, K.TOOL, K.ROLLOUT_DECODE, K.TOOL, K.ROLLOUT_TAIL]
    a = grpo(rng, "A", 1, turns[:rng.choice((4, 6))])
    b = grpo(rng, "B", 1, rng.randint(2, 3))
    return [PipelineState(graph=a, devices=(0,)), PipelineState(graph=b, devices=(0,))], 1


def _gangs(rng):
    a, b = grpo(rng, "A", 2, 2), grpo(rng, "B", 2, 1)
    return [PipelineState(graph=a, devices=(0, 1)), PipelineState(graph=b, devices=(0, 1))], 2


def _mixed(rng):
    a = grpo(rng, "A", 2, 2)
    b = grpo(rng, "B", 1, rng.randint(2, 3))
    return [PipelineState(graph=a, devices=(0, 1)), PipelineState(graph=b, devices=(rng.randint(0, 1),))], 2


def _two_steps(rng):
    a = grpo(rng, "A", 1, 2).then(grpo(rng, "A", 1, 2, step=1))
    b = grpo(rng, "B", 1, rng.randint(2, 3))
    return [PipelineState(graph=a, devices=(0,)), PipelineState(graph=b, devices=(0,))], 1


# Unlike pipelines (issue 32): one train-heavy (short rollout, long reference and training),
# one tail-heavy (long rollout ending in a tail, short reference and training).
_TRAIN_HEAVY = {"roll_s": (1, 4), "ref_s": (3, 6), "train_s": (8, 15)}
_TAIL_HEAVY = {"roll_s": (4, 12), "ref_s": (1, 2), "train_s": (1, 3)}
_TAIL_CHAIN = [K.ROLLOUT_PREFILL, K.ROLLOUT_DECODE, K.ROLLOUT_TAIL]


def _unlike_one_gpu(rng):
    a = grpo(rng, "A", 1, 2, **_TRAIN_HEAVY)
    b = grpo(rng, "B", 1, _TAIL_CHAIN, **_TAIL_HEAVY)
    return [PipelineState(graph=a, devices=(0,)), PipelineState(graph=b, devices=(0,))], 1


def _unlike_gangs(rng):
    a = grpo(rng, "A", 2, 1, **_TRAIN_HEAVY)
    b = grpo(rng, "B", 2, _TAIL_CHAIN[2:], **_TAIL_HEAVY)
    return [PipelineState(graph=a, devices=(0, 1)), PipelineState(graph=b, devices=(0, 1))], 2


def _unlike_mixed(rng):
    """Mixed DP: which of the two is the wide one is drawn."""
    wide, narrow = ("A", "B") if rng.random() < 0.5 else ("B", "A")
    shape = {"A": _TRAIN_HEAVY, "B": _TAIL_HEAVY}
    chain = {"A": 2, "B": _TAIL_CHAIN[1:]}
    w = grpo(rng, wide, 2, chain[wide], **shape[wide])
    n = grpo(rng, narrow, 1, chain[narrow], **shape[narrow])
    return [PipelineState(graph=w, devices=(0, 1)), PipelineState(graph=n, devices=(rng.randint(0, 1),))], 2


def _unequal_steps(rng):
    """Very different step times: two short steps beside one long tail-heavy step."""
    short = {"roll_s": (1, 3), "ref_s": (1, 2), "train_s": (2, 4)}
    a = grpo(rng, "A", 1, 2, **short).then(grpo(rng, "A", 1, 2, step=1, **short))
    b = grpo(rng, "B", 1, _TAIL_CHAIN, roll_s=(6, 16), ref_s=(2, 5), train_s=(4, 10))
    return [PipelineState(graph=a, devices=(0,)), PipelineState(graph=b, devices=(0,))], 1


def _three(rng):
    """Three pipelines on one device: train-heavy, tail-heavy and a plain one."""
    a = grpo(rng, "A", 1, 1, **_TRAIN_HEAVY)
    b = grpo(rng, "B", 1, _TAIL_CHAIN[2:], **_TAIL_HEAVY)
    c = grpo(rng, "C", 1, 1)
    return [PipelineState(graph=g, devices=(0,)) for g in (a, b, c)], 1


FAMILIES = {"one-gpu": _one_gpu, "multi-turn": _multi_turn, "gangs": _gangs, "mixed-dp": _mixed,
            "two-steps": _two_steps, "unlike-1gpu": _unlike_one_gpu, "unlike-gangs": _unlike_gangs,
            "unlike-mixed": _unlike_mixed, "unequal-steps": _unequal_steps, "three": _three}
"""Small GRPO-shaped instance families: two (or three) pipelines of different shapes on 1–2
devices; the `unlike-*`, `unequal-steps` and `three` ones are issue 32's, a pipeline whose
training must hide under another's rollout."""


def instances(family: str, count: int, seed: int = 0) -> list[tuple[list[PipelineState], NodeSpec]]:
    """`count` instances of one family, the same for the same seed."""
    rng = random.Random(f"{family}/{seed}")
    out = []
    for _ in range(count):
        pipes, devices = FAMILIES[family](rng)
        out.append((pipes, NodeSpec(num_devices=devices, mem_bytes=80 * GIB)))
    return out
