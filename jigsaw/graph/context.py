"""The scheduler's per-call constants: its options, and the slowdown lookups it searches with.

    Context(grid, config, node, cache, pipelines, pairs, host_frac)
      ├─ splits(kind_a, kind_b, σ, pa, pb)   grid points of a pair (the pipelines' own pair view
      │                                        when `pairs` knows them, else the node grid), kept
      │                                        only where every rollout regime stays feasible
      ├─ feasible(P, x, y, σ)                 ... where both tasks' memory fits (an urgent engine:
      │                                        where its partner's does)
      ├─ complementary / clearing / min_slowdown / solo   pair filter, packing bounds, solo shares
      ├─ capped                               splits alone where pipelines work on a CPU's cores
      └─ tables memoised per (grid, pairs) in the SchedulerCache, per call in `_feasible`
    ─► actions.py (the decisions and their effects) and schedule.py (the search)
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import NamedTuple

from jigsaw.graph import state as st
from jigsaw.graph.merge import MergeConfig, MergeDecision
from jigsaw.graph.model import PairModels, PairPricing, SlowdownModel
from jigsaw.graph.plan import NodeSpec, PipelineState, SchedulerConfig
from jigsaw.graph.problem import Problem, SchedulerCache
from jigsaw.graph.substage import SubStageKind, grant_need_bytes


class Verb(enum.Enum):
    START = "start"
    SOLO = "solo"
    DEFER = "defer"
    MERGE = "merge"
    KEEP = "keep"
    NO_ROOM = "cannot start: no grid split fits beside the partner"


class Option(NamedTuple):
    verb: Verb
    sm_frac: float | None = None
    """START: the share beside the running partner (None: idle devices only)."""
    merge: MergeDecision | None = None
    tails: tuple[int, ...] = ()


class PairPoint(NamedTuple):
    """A grid point of a pair at a given SM share: A's memory share, both slowdowns."""

    mem_frac: float
    slowdown: float
    partner_slowdown: float


_ROLLOUT_KINDS = ("rollout_prefill", "rollout_decode", "rollout_tail")


SOLO_GAIN = 0.02
"""Least gain of a share alone over the whole device that keeps a sub-stage on the share."""


class Packing(NamedTuple):
    """How fast devices can clear the work left on them (exclusive seconds per second)."""

    device: tuple[float, ...]
    """Per device, a bound for that device alone: a lockstep gang with balanced micro-batches
    advances at the mean of its replicas' rates, up to 1 even where its replica is slowed,
    so beside a gang a device clears up to 1 + the partner's rate."""
    node: float
    """Bound for all devices together: summed over a gang's devices, its progress is the
    sum of its replicas' 1/s, so every device counts at its best pair's 1/s_a + 1/s_b."""


def _held(d) -> tuple[int, float, float, float]:
    return d.step, d.deadline_s, d.next_exclusive_s, d.slo_slowdown


class Context:
    """Per-call constants of the search: config, node, slowdown lookups."""

    __slots__ = ("config", "balanced", "mem_bytes", "sm_budgets_frac", "model", "_table", "peak_flops", "_feasible",
                 "min_pack_efficiency", "decode", "prefill_work", "multi_turn", "start_beside", "_merge_configs",
                 "bound_weight", "min_slowdown", "pack", "solo", "capped", "_pairs", "_names", "_cls", "elastic", "slo",
                 "given_up", "deadlines")

    def __init__(self, model: SlowdownModel, config: SchedulerConfig, node: NodeSpec, cache: SchedulerCache,
                 pipelines: Sequence[PipelineState] = (), pairs: PairModels | None = None,
                 host_frac: Mapping[int, float] | None = None):
        self.config, self.balanced, self.model = config, config.balance, model
        self.mem_bytes, self.sm_budgets_frac = node.mem_bytes, config.budgets(model)
        self.min_pack_efficiency = config.min_pack_efficiency
        self.bound_weight = config.bound_weight
        self.pack: Packing | None = None
        """`packing()` of the call's initial state (set by `initial`)."""
        self.elastic: frozenset[int] = frozenset()
        """Urgent rollout engines (set by `initial`): they cannot wait, and their KV pool
        follows the memory they are given, so where their whole need fits nowhere beside the
        partner they take what the partner leaves (a smaller batch, priced by the grid)."""
        # Per pipeline, what its history says (PipelineState): decode fit, prefill work, multi-turn.
        self.decode = tuple(ps.decode_fit for ps in pipelines)
        self.prefill_work = tuple(ps.prefill_work for ps in pipelines)
        self.multi_turn = tuple(ps.multi_turn for ps in pipelines)
        self.slo = {p: _held(ps.deadline) for p, ps in enumerate(pipelines) if ps.deadline is not None} or None
        """Per pipeline with an SLO: (the step held to it, its deadline, the next step's
        exclusive time, its SLO); None: no SLO held."""
        self.given_up: dict[int, str] = {}
        """Deadlines given up before the search (actions.initial), and why."""
        self.deadlines = dict(self.slo or {})
        """Every pipeline's deadline, held or given up (the plan reports each)."""
        self.peak_flops = model.device.peak_flops
        self.start_beside = {b: Option(Verb.START, b) for b in self.sm_budgets_frac}
        self._table = cache.tables_for(model, pairs)
        self._pairs, self._names = pairs, tuple(ps.graph.pipeline for ps in pipelines)
        # Per pipeline, its deployment class in `pairs` (None: priced by `model`).
        self._cls = tuple(None if pairs is None else pairs.deployment_class(n) for n in self._names)
        self._feasible: dict[tuple, list] = {}
        self._merge_configs: dict[tuple[float, float], MergeConfig] = {}
        self.solo = self._solo()
        self.capped = self._capped(host_frac or {}) if config.host_on_device else {}
        self.min_slowdown = self._min_slowdown()
        missing = [b for b in self.sm_budgets_frac if not any(abs(b - s) < 1e-9 for s in model.sm_levels)]
        if missing:
            raise ValueError(f"SM budgets {missing} are not levels of the slowdown grid {model.sm_levels}")

    def _grid(self, pa: int, pb: int) -> tuple[PairPricing, tuple[int, int] | None]:
        """The grid pricing pipeline pa's sub-stage beside pb's, and its tag in the tables
        (None: the node grid, for everything when the pipelines run one model)."""
        if self._pairs is None or pa < 0 or pb < 0 or self._cls[pa] is None or self._cls[pb] is None:
            return self.model, None
        return self._pairs.between(self._names[pa], self._names[pb]), (self._cls[pa], self._cls[pb])

    def splits(self, kind_a: str, kind_b: str, sm_a: float, pa: int = -1, pb: int = -1) -> list[PairPoint]:
        """Feasible grid points for A (of pipeline pa) at SM share sm_a beside B (of pb)."""
        grid, tag = self._grid(pa, pb)
        key = (kind_a, kind_b, tag)
        table = self._table.get(key)
        if table is None:
            table = self._table[key] = {}
            for sm, mem, sa, sb in grid.pair_options(kind_a, kind_b):
                if self._lasting(grid, tag, kind_a, kind_b, sm, mem):
                    table.setdefault(round(sm, 9), []).append(PairPoint(mem, sa, sb))
        return table.get(round(sm_a, 9), [])

    def _lasting(self, grid, tag, kind_a: str, kind_b: str, sm_a: float, mem_a: float) -> bool:
        """A rollout moves through every rollout kind on the budget it was given (a running
        engine cannot pause when its regime changes): a pair is only formed at a point where
        every regime of each rollout side stays feasible beside the other.  The same for
        every regime of a side, so kept per point for the sides' classes."""
        ka = _ROLLOUT_KINDS if kind_a in _ROLLOUT_KINDS else (kind_a,)
        kb = _ROLLOUT_KINDS if kind_b in _ROLLOUT_KINDS else (kind_b,)
        if len(ka) == len(kb) == 1:
            return True
        key = ("lasting", ka, kb, tag, round(sm_a, 9), round(mem_a, 9))
        got = self._table.get(key)
        if got is None:
            known = set(grid.kinds)
            got = self._table[key] = all(grid.pair(x, y, sm_a, mem_a) is not None
                                         for x in ka for y in kb if x in known and y in known)
        return got

    def _grids(self) -> list:
        """Every grid a pair of this call's pipelines is priced by (bounds take the best)."""
        if self._pairs is None or None in self._cls:
            return [self.model]
        first = {c: n for n, c in zip(self._names, self._cls)}
        return [self._pairs.between(first[a], first[b]) for a in sorted(first) for b in sorted(first)]

    def _min_slowdown(self) -> float:
        got = self._table.get("min_slowdown")
        if got is None:
            got = self._table["min_slowdown"] = min(
                [1.0] + [v for m in self._grids() for a in m.kinds for b in m.kinds
                         for _, _, x, y in m.pair_options(a, b) for v in (x, y)]
                + [s.slowdown for s in self.solo.values()])
        return got

    def _solo(self) -> dict[str, st.Split]:
        """Kinds the grid says run at least SOLO_GAIN faster alone on a partition level than on
        the whole device (a tiny CPU decode on one core of two), and at which level: such a
        sub-stage alone keeps that share, the rest stays free for a partner."""
        got = self._table.get("solo")
        if got is None:
            got = {}
            for kind in self.model.kinds:
                best = self._best_alone(kind, self.model.sm_levels)
                if best.slowdown < 1.0 - SOLO_GAIN:
                    got[kind] = best
            self._table["solo"] = got
        return got

    def _capped(self, host_frac: Mapping[int, float]) -> dict[int, dict[str, st.Split]]:
        """Devices where pipelines work on the host (SchedulerConfig.host_on_device), and on
        each every kind's best split alone within what their share leaves: a sub-stage alone
        there grows no further."""
        out = {}
        for d, frac in host_frac.items():
            levels = [sm for sm in self.model.sm_levels if sm <= 1.0 - frac + 1e-9]
            if levels:
                out[d] = {k: self._best_alone(k, levels) for k in self.model.kinds}
        return out

    def _best_alone(self, kind: str, levels) -> st.Split:
        """`kind` alone at the fastest of these SM levels (all the memory)."""
        m = self.model
        s, sm = min((m.alone(kind, sm, m.mem_levels[-1]), sm) for sm in levels)
        return st.Split(sm, 1.0, s)

    def clearing(self, a: tuple[str, bool], b: tuple[str, bool]) -> float:
        """Most exclusive seconds per second one device clears running (kind, is a gang) a
        beside b: 1/s_a + 1/s_b at the grid's best point, a gang counting up to 1 (see
        `packing`); at least 1.0 (either alone)."""
        key = ("clearing", a, b)
        got = self._table.get(key)
        if got is None:
            (ka, gang_a), (kb, gang_b) = a, b
            got = self._table[key] = max([1.0] + [(1.0 if gang_a else 1 / x) + (1.0 if gang_b else 1 / y)
                                                  for m in self._grids() for _, _, x, y in m.pair_options(ka, kb)])
        return got

    def continuations(self, P: Problem, h: int, d: int) -> tuple[int, ...]:
        """The rollout pieces on device d that go on from task h (a rollout piece or a tool
        wait of that worker); none for any other kind."""
        key = ("continues", h, d)  # per call (one Problem): the tables of `feasible`
        got = self._feasible.get(key)
        if got is None:
            if P.kinds[h] != "tool" and not P.kinds[h].startswith("rollout"):
                got = ()
            else:
                got = tuple(c for c in P.tasks[h].succs if P.kinds[c].startswith("rollout") and d in P.tasks[c].devices)
            self._feasible[key] = got
        return got

    def leaves_room(self, P: Problem, i: int, d: int, there: tuple[int, ...]) -> bool:
        """Does task i on device d leave room beside it for the next rollout piece of every
        other pipeline's task `there` (running, or waiting on a tool) that goes on?"""
        key = ("leaves", i, d, there)
        got = self._feasible.get(key)
        if got is None:
            pipe = P.tasks[i].pipe
            got = self._feasible[key] = all(self.room(P, i, c) for h in there if P.tasks[h].pipe != pipe
                                            for c in self.continuations(P, h, d))
        return got

    def room(self, P: Problem, i: int, c: int) -> bool:
        """Can task i and task c share a device at some offered SM share?"""
        key = ("room", i, c)
        got = self._feasible.get(key)
        if got is None:
            got = self._feasible[key] = any(self.feasible(P, i, c, b) for b in self.sm_budgets_frac)
        return got

    def clearing_of(self, kinds: frozenset[tuple[str, bool]]) -> tuple[float, float]:
        """(with gangs as gangs, every replica on its own) best `clearing` among `kinds`."""
        key = ("clearing_of", kinds)
        got = self._table.get(key)
        if got is None:
            got = self._table[key] = (
                max([1.0] + [self.clearing(a, b) for a in kinds for b in kinds]),
                max([1.0] + [self.clearing((a, False), (b, False)) for a, _ in kinds for b, _ in kinds]))
        return got

    def merge_config(self, prefill_flops: float, prefill_s: float) -> MergeConfig:
        """The merge pricing, with the pipeline's own measured prefill MFU where it is known
        (it beats the default); memoised, since the search asks at every completion."""
        key = (prefill_flops, prefill_s)
        cfg = self._merge_configs.get(key)
        if cfg is None:
            cfg = self.config.merge_config
            if prefill_flops > 0 and prefill_s > 0:
                cfg = replace(cfg, prefill_mfu_frac=min(1.0, prefill_flops / (prefill_s * self.peak_flops)))
            self._merge_configs[key] = cfg
        return cfg

    def complementary(self, kind_a: str, kind_b: str, pa: int = -1, pb: int = -1) -> bool:
        """Do these kinds (of pipelines pa, pb) pack well enough to share a device
        (SchedulerConfig.min_pack_efficiency)?"""
        if self.min_pack_efficiency <= 1.0:
            return True
        grid, tag = self._grid(pa, pb)
        key = ("eta", kind_a, kind_b, tag)
        eta = self._table.get(key)
        if eta is None:
            eta = self._table[key] = max((1 / sa + 1 / sb for _, _, sa, sb in grid.pair_options(kind_a, kind_b)),
                                         default=0.0)
        return eta >= self.min_pack_efficiency

    def grid_pair(self, P: Problem, a: int, b: int, sm_a: float, mem_a: float) -> tuple[float, float] | None:
        """(s_a, s_b) of tasks a and b running as a pair: a table hit for grid budgets, else
        the grid between its levels (budgets set by someone else, or a split by need), by
        need where the levels around it do not hold both."""
        kind_a, kind_b, pa, pb = P.kinds[a], P.kinds[b], P.tasks[a].pipe, P.tasks[b].pipe
        for mem, sa, sb in self.splits(kind_a, kind_b, sm_a, pa, pb):
            if abs(mem - mem_a) < 1e-9:
                return sa, sb
        grid = self._grid(pa, pb)[0]
        return grid.pair(kind_a, kind_b, sm_a, mem_a) or grid.pair(
            kind_a, kind_b, sm_a, mem_a, need_frac_a=self._need_frac(P, a), need_frac_b=self._need_frac(P, b))

    def feasible(self, P: Problem, x: int, y: int, sm_x: float) -> list[PairPoint]:
        """Grid splits at which task x (share sm_x) and task y both fit in memory.  For an
        urgent rollout engine (`elastic`) where no level holds both: the split by need
        (`_by_need`), else the points where its partner fits (it takes what is left)."""
        key = (x, y, sm_x)
        out = self._feasible.get(key)
        if out is None:
            tx, ty = P.tasks[x], P.tasks[y]
            # What the answer depends on: replicas of one gang or group mostly share it.
            same = (P.kinds[x], P.kinds[y], tx.mem_bytes, ty.mem_bytes, tx.pipe, ty.pipe, x in self.elastic, sm_x)
            out = self._feasible.get(same)
            if out is None:
                out = self._feasible[same] = self._fitting(P, x, y, sm_x)
            self._feasible[key] = out
        return out

    def _fitting(self, P: Problem, x: int, y: int, sm_x: float) -> list[PairPoint]:
        mx, my, cap = P.tasks[x].mem_bytes, P.tasks[y].mem_bytes, self.mem_bytes
        points = self.splits(P.kinds[x], P.kinds[y], sm_x, P.tasks[x].pipe, P.tasks[y].pipe)
        out = [pt for pt in points if mx <= pt[0] * cap + 0.5 and my <= (1.0 - pt[0]) * cap + 0.5]
        if not out and x in self.elastic:  # an engine that cannot wait: by need, else what is left
            out = self._by_need(P, x, y, sm_x) or [pt for pt in points if my <= (1.0 - pt[0]) * cap + 0.5]
        return out

    def _by_need(self, P: Problem, x: int, y: int, sm_x: float) -> list[PairPoint]:
        """The memory split off the grid's levels where no level holds both tasks (engines
        expecting 49 and 24 GiB of 80: levels 0.2..0.8 leave one of them short): each side
        its hard need (a rollout's is none, its KV pool follows its grant), the rest in
        proportion to what each expects to hold beyond it, so both hold what they expect; priced by
        the grid by need, every rollout regime of either side included (`_lasting`).  None
        where they cannot both hold what they expect."""
        mx, my, cap = P.tasks[x].mem_bytes, P.tasks[y].mem_bytes, self.mem_bytes
        if mx + my > cap or mx + my <= 0:
            return []
        need_x, need_y = self._need_frac(P, x), self._need_frac(P, y)
        more_x, more_y = max(0.0, mx / cap - need_x), max(0.0, my / cap - need_y)  # held beyond the need
        mem = need_x + (1.0 - need_x - need_y) * (more_x / (more_x + more_y) if more_x + more_y > 0 else 0.5)
        grid = self._grid(P.tasks[x].pipe, P.tasks[y].pipe)[0]
        kx, ky = P.kinds[x], P.kinds[y]
        regimes_x = _ROLLOUT_KINDS if kx in _ROLLOUT_KINDS else (kx,)
        regimes_y = _ROLLOUT_KINDS if ky in _ROLLOUT_KINDS else (ky,)
        known = set(grid.kinds)
        for a in regimes_x:
            for b in regimes_y:
                if a in known and b in known and grid.pair(a, b, sm_x, mem, need_frac_a=need_x,
                                                           need_frac_b=need_y) is None:
                    return []
        got = grid.pair(kx, ky, sm_x, mem, need_frac_a=need_x, need_frac_b=need_y)
        return [] if got is None else [PairPoint(mem, *got)]

    def _need_frac(self, P: Problem, i: int) -> float:
        return grant_need_bytes(SubStageKind(P.kinds[i]), P.tasks[i].mem_bytes) / self.mem_bytes
