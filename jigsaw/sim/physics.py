"""What really happens to sub-stages sharing a device: the simulator's ground-truth slowdowns.

    units on one device: (pipeline index, kind, sm_frac, mem_frac), one or two
        │ every pipeline the same model and deployment ─► the node grid
        │ otherwise ─► PairGrids.between(a, b).actual(...): each side priced by its OWN
        ▼             model beside the other's (jigsaw.mux.model.grids.pair_grids)
    slowdowns, or None when a side does not fit

The scheduler plans with the same PairGrids (NodeSim hands one object to both), whole-stage
baselines with the node grid (for a mix of models, the conservative mix prior); the physics
never uses that approximation, so a plan that trusted it is charged what really happens.
"""

from __future__ import annotations

from jigsaw.mux.model.grids import pair_grids
from jigsaw.mux.model.pairing import PairGrids
from jigsaw.mux.model.slowdown import SlowdownGrid


class Physics:
    """Slowdowns of what shares a device (module docstring)."""

    def __init__(self, grid: SlowdownGrid, pairs: PairGrids | None, names: list[str]):
        self.grid, self.pairs, self.names = grid, pairs, names
        """`names[i]`: pipeline i's name in `pairs`."""

    @classmethod
    def of(cls, grid: SlowdownGrid, runs) -> Physics:
        """The physics of a node's pipelines (PipelineRun): each priced by its deployment."""
        deployments = {r.name: (r.spec.model, r.cost.config) for r in runs}
        pairs = pair_grids(runs[0].spec.device, deployments) if runs else None
        return cls(grid, pairs, [r.name for r in runs])

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
