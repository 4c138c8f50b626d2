"""What really happens to sub-stages sharing a device: the simulator's ground-truth slowdowns.

    units on one device: (pipeline index, kind, sm_frac, mem_frac), one or two
        │ every pipeline the same model and deployment ─► the node grid
        │ otherwise ─► PairGrids.between(a, b).actual(...): each side priced by its OWN
        ▼             model beside the other's (jigsaw.mux.model.pairing)
    slowdowns, or None when a side does not fit

The scheduler plans with the same PairGrids (NodeSim hands one object to both), whole-stage
baselines with the node grid (for a mix of models, the conservative mix prior); the physics
never uses that approximation, so a plan that trusted it is charged what really happens.
"""

from __future__ import annotations

from functools import lru_cache

from jigsaw.mux.model.pairing import PairGrids, pair_prior
from jigsaw.mux.model.slowdown import SlowdownGrid


@lru_cache(maxsize=64)
def own_grid(device_name: str, a: tuple) -> SlowdownGrid:
    """The analytic prior of one deployment a = (model, PriorConfig) on a named device."""
    from jigsaw.mux.model.prior import DEVICES

    return pair_prior(DEVICES[device_name], a, a)


def pair_grids(runs) -> PairGrids | None:
    """The exact per-pair views of the pipelines (PipelineRun) of a node, None when they
    all run one deployment (the node grid is then exact)."""
    from jigsaw.mux.model.prior import DEVICES

    deployments = {r.name: (r.spec.model, r.cost.config) for r in runs}
    if len(set(deployments.values())) <= 1:
        return None
    return PairGrids(DEVICES[runs[0].spec.device], deployments)


class Physics:
    """Slowdowns of what shares a device (module docstring)."""

    def __init__(self, grid: SlowdownGrid, pairs: PairGrids | None, names: list[str]):
        self.grid, self.pairs, self.names = grid, pairs, names
        """`names[i]`: pipeline i's name in `pairs`."""

    def actual(self, units: list[tuple[int, str, float, float]]) -> tuple[float, ...] | None:
        """`units`: (pipeline index, kind, sm_frac, mem_frac) of everything on one device."""
        if self.pairs is None:
            return self.grid.actual(*(u[1:] for u in units))
        a = self.names[units[0][0]]
        b = self.names[units[-1][0]]
        return self.pairs.between(a, b).actual(*(u[1:] for u in units))

    def max_pack_efficiency(self) -> float:
        """max over every pairing the node can have of 1/s_a + 1/s_b (the lower bound's packing)."""
        return self.grid.max_pack_efficiency() if self.pairs is None else self.pairs.max_pack_efficiency()
