"""The exact slowdowns of a node whose pipelines run different models: one view per pair.

    {pipeline name: (model, PriorConfig)} ─► PairGrids
        between(a, b) ─► a's own prior              (a and b deploy the same model)
                     └─► PairView(G_ab, G_ba)       (prior.analytic_pair_prior both ways)
    PairView answers what a scheduler asks a SlowdownGrid (pair, pair_options, actual, alone),
    each side timed by its own model beside the other's.

Both the simulator's physics (what really happens) and the scheduler (what it plans with)
read the same views, so a plan is priced by the slowdowns the run will see; the mix prior
(prior.mix_prior, entrywise the worst pairing) stays the grid for whatever asks about
a kind without knowing whose it is (whole-stage baselines, packing bounds).
"""

from __future__ import annotations

from collections.abc import Mapping
from functools import lru_cache

from jigsaw.mux.model.prior import analytic_pair_prior, check_views, pair_slowdowns
from jigsaw.mux.model.slowdown import LEVEL_TOL, DeviceInfo, SlowdownGrid
from jigsaw.mux.model.specs import Deployment


@lru_cache(maxsize=64)
def pair_prior(device: DeviceInfo, a: Deployment, b: Deployment) -> SlowdownGrid:
    """analytic_pair_prior, built once per (device, A, B): A's kinds beside B's.  With
    A == B it is A's own analytic prior."""
    return analytic_pair_prior(device, a, b)


class PairView:
    """A beside B as one grid: pair(x, y, σ, m) is (A's x at σ, m; B's y at the complement)."""

    __slots__ = ("ab", "ba", "kinds", "sm_levels", "mem_levels", "device", "_options", "_actual")

    def __init__(self, ab: SlowdownGrid, ba: SlowdownGrid):
        check_views(ab, ba)
        self.ab, self.ba = ab, ba
        self.kinds, self.sm_levels, self.mem_levels, self.device = ab.kinds, ab.sm_levels, ab.mem_levels, ab.device
        self._options: dict[tuple[str, str], tuple] = {}
        self._actual: dict[tuple, tuple[float, ...] | None] = {}

    def alone(self, kind: str, sm_frac: float, mem_frac: float, *, need_frac: float | None = None) -> float:
        return self.ab.alone(kind, sm_frac, mem_frac, need_frac=need_frac)

    def pair(self, kind_a: str, kind_b: str, sm_frac_a: float, mem_frac_a: float, *,
             need_frac_a: float | None = None, need_frac_b: float | None = None) -> tuple[float, float] | None:
        """(s_a, s_b), B's kind holding the complement (σ = 1.0: both share every SM); with the
        sides' memory needs, feasibility is decided by them (SlowdownGrid.slowdown)."""
        sm_b = 1.0 if sm_frac_a >= 1.0 - LEVEL_TOL else 1.0 - sm_frac_a
        unit_a = (kind_a, sm_frac_a, mem_frac_a) + (() if need_frac_a is None else (need_frac_a,))
        unit_b = (kind_b, sm_b, 1.0 - mem_frac_a) + (() if need_frac_b is None else (need_frac_b,))
        return pair_slowdowns(self.ab, self.ba, unit_a, unit_b)

    def pair_options(self, kind_a: str, kind_b: str) -> tuple[tuple[float, float, float, float], ...]:
        """Every partitioned grid point where both sides fit, as (σ_a, m_a, s_a, s_b)."""
        got = self._options.get((kind_a, kind_b))
        if got is None:
            got = self._options[(kind_a, kind_b)] = tuple(
                (sm, mem, *pr) for sm in self.sm_levels[:-1] for mem in self.mem_levels
                if (pr := self.pair(kind_a, kind_b, sm, mem)) is not None)
        return got

    def actual(self, *units: tuple) -> tuple[float, ...] | None:
        """SlowdownGrid.actual of A's unit (and B's, second): one alone, or the pair; a unit is
        (kind, σ, m) or (kind, σ, m, need_frac)."""
        if units not in self._actual:
            if len(units) == 1:
                self._actual[units] = self.ab.actual(*units)
            else:
                (ka, sa, ma, *na), (kb, _, _, *nb) = units
                self._actual[units] = self.pair(ka, kb, 1.0 if sa >= 1.0 - LEVEL_TOL else sa, ma,
                                                need_frac_a=na[0] if na else None, need_frac_b=nb[0] if nb else None)
        return self._actual[units]


class PairGrids:
    """Per ordered pair of a node's pipelines, the grid of the two as deployed (module docstring)."""

    def __init__(self, device: DeviceInfo, deployments: Mapping[str, Deployment]):
        self.device = device
        self.deployments = dict(deployments)
        ranked = sorted(set(self.deployments.values()), key=repr)
        self._class = {name: ranked.index(d) for name, d in self.deployments.items()}
        self._views: dict[tuple[int, int], SlowdownGrid | PairView] = {}

    def deployment_class(self, name: str) -> int | None:
        """Pipelines of one class run one deployment (the same view); None: unknown here."""
        return self._class.get(name)

    def between(self, a: str, b: str) -> SlowdownGrid | PairView:
        """Pipeline a's kinds (first axis) beside pipeline b's."""
        key = (self._class[a], self._class[b])
        got = self._views.get(key)
        if got is None:
            da, db = self.deployments[a], self.deployments[b]
            got = self._views[key] = pair_prior(self.device, da, da) if da == db else \
                PairView(pair_prior(self.device, da, db), pair_prior(self.device, db, da))
        return got

    def max_pack_efficiency(self) -> float:
        """max over the pairings this node can have of 1/s_a + 1/s_b (at least 1.0)."""
        names = sorted(self.deployments)
        best = 1.0
        seen = set()
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                key = tuple(sorted((self._class[a], self._class[b])))
                if key not in seen:
                    seen.add(key)
                    best = max(best, _pack(self.between(a, b)))
        return best


def _pack(view: SlowdownGrid | PairView) -> float:
    return max([1.0] + [1.0 / sa + 1.0 / sb for x in view.kinds for y in view.kinds
                        for _, _, sa, sb in view.pair_options(x, y)])
