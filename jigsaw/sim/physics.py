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


def _unit(u: list) -> tuple[str, float, float]:
    kind, sm, mem = u
    return kind, 1.0 if sm >= 1.0 - LEVEL_TOL else sm, mem
