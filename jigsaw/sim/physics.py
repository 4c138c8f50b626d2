"""What really happens to sub-stages sharing a device: the simulator's ground-truth slowdowns.

    units on one device: (pipeline's deployment key, kind, sm_frac, mem_frac), one or two
        │ every pipeline the same model and deployment ─► the node grid (what policies plan with)
        │ otherwise, each side priced by its OWN model beside the other's:
        ▼     (s_a, s_b) = prior_mix.pair_actual(pair prior A|B, pair prior B|A, ...)
    slowdowns, or None when a side does not fit

Policies plan with one grid (for a mix of models, the conservative mix prior); the physics
never uses that approximation, so a plan that trusted it is charged what really happens.
Pair priors are analytic (jigsaw.mux.prior), built once per ordered pair of deployments.
"""

from __future__ import annotations

from functools import lru_cache

from jigsaw.mux.prior_mix import pair_actual
from jigsaw.mux.slowdown import LEVEL_TOL, SlowdownGrid


@lru_cache(maxsize=64)
def pair_grid(device_name: str, a: tuple, b: tuple) -> SlowdownGrid:
    """Model a's kinds (first axis) beside model b's (second axis); a, b = (model, PriorConfig)."""
    from jigsaw.mux.prior import DEVICES
    from jigsaw.mux.prior_mix import analytic_pair_prior

    return analytic_pair_prior(DEVICES[device_name], a, b)


@lru_cache(maxsize=64)
def own_grid(device_name: str, a: tuple) -> SlowdownGrid:
    from jigsaw.mux.prior import DEVICES, analytic_prior

    return analytic_prior(DEVICES[device_name], *a)


class Physics:
    """Slowdowns of what shares a device (module docstring)."""

    def __init__(self, grid: SlowdownGrid, device_name: str, keys: list[tuple]):
        self.grid, self.device_name, self.keys = grid, device_name, keys
        self.uniform = len(set(keys)) <= 1

    def actual(self, units: list[tuple[int, str, float, float]]) -> tuple[float, ...] | None:
        """`units`: (pipeline index, kind, sm_frac, mem_frac) of everything on one device."""
        if self.uniform:
            return self.grid.actual(*(u[1:] for u in units))
        keys = {self.keys[u[0]] for u in units}
        if len(keys) == 1:
            return own_grid(self.device_name, keys.pop()).actual(*(u[1:] for u in units))
        (i, *a), (j, *b) = units
        return pair_actual(pair_grid(self.device_name, self.keys[i], self.keys[j]),
                           pair_grid(self.device_name, self.keys[j], self.keys[i]), _unit(a), _unit(b))


    def max_pack_efficiency(self) -> float:
        """max over every pairing the node can have of 1/s_a + 1/s_b (the lower bound's packing)."""
        if self.uniform:
            return self.grid.max_pack_efficiency()
        best = 1.0
        keys = sorted(set(self.keys), key=repr)
        for a in keys:
            for b in keys:
                if a == b and self.keys.count(a) < 2:
                    continue
                best = max(best, _pack(pair_grid(self.device_name, a, b), pair_grid(self.device_name, b, a)))
        return best


def _pack(ab: SlowdownGrid, ba: SlowdownGrid) -> float:
    best = 1.0
    for x in ab.kinds:
        for y in ab.kinds:
            for sm in ab.sm_levels[:-1]:
                for mem in ab.mem_levels:
                    got = pair_actual(ab, ba, (x, sm, mem), (y, 1.0 - sm, 1.0 - mem))
                    if got is not None:
                        best = max(best, 1.0 / got[0] + 1.0 / got[1])
    return best


def _unit(u: list) -> tuple[str, float, float]:
    kind, sm, mem = u
    return kind, 1.0 if sm >= 1.0 - LEVEL_TOL else sm, mem
