"""What really happens to sub-stages sharing a device: the simulator's ground-truth slowdowns.

    units on one device: (pipeline index, kind, sm_frac, mem_frac), one or two
        │ + each unit's floor: the least memory its pipeline's kind runs in (`floors`)
        │ every pipeline the same model and deployment ─► the node grid, feasibility by need
        │ otherwise ─► PairGrids.between(a, b).actual(...): each side priced by its OWN
        ▼             model beside the other's (jigsaw.mux.model.grids.pair_grids)
    slowdowns, or None when a side does not fit

The scheduler plans with the same PairGrids (NodeSim hands one object to both), whole-stage
baselines with the node grid (for a mix of models, the conservative mix prior); the physics
never uses that approximation, so a plan that trusted it is charged what really happens.

A unit fits its budget when its floor does, and the grid prices the budget from its feasible
points (SlowdownGrid, feasibility by need): a training whose state fits half the device runs
there although the grid's level below half cannot hold it.  A pair view of two models
(pairing.PairView) takes no need yet and keeps the grid's own feasibility.
"""

from __future__ import annotations

from jigsaw.graph.substage import DEVICE_KINDS, SubStageKind
from jigsaw.mux.model.grids import pair_grids
from jigsaw.mux.model.pairing import PairGrids
from jigsaw.mux.model.slowdown import SlowdownGrid


class Physics:
    """Slowdowns of what shares a device (module docstring)."""

    def __init__(self, grid: SlowdownGrid, pairs: PairGrids | None, names: list[str],
                 floors: dict[tuple[int, str], float] | None = None):
        self.grid, self.pairs, self.names = grid, pairs, names
        """`names[i]`: pipeline i's name in `pairs`."""
        self.floors = floors or {}
        """(pipeline index, kind) ─► its floor over the device's memory (`floors`); absent: unknown."""

    @classmethod
    def of(cls, grid: SlowdownGrid, runs) -> Physics:
        """The physics of a node's pipelines (PipelineRun): each priced by its deployment."""
        deployments = {r.name: (r.spec.model, r.cost.config) for r in runs}
        pairs = pair_grids(runs[0].spec.device, deployments) if runs else None
        return cls(grid, pairs, [r.name for r in runs], floors(runs))

    def actual(self, units: list[tuple[int, str, float, float]]) -> tuple[float, ...] | None:
        """`units`: (pipeline index, kind, sm_frac, mem_frac) of everything on one device."""
        view = self.grid if self.pairs is None else self.pairs.between(self.names[units[0][0]],
                                                                       self.names[units[-1][0]])
        return view.actual(*((*u[1:], self.floors.get(u[:2])) for u in units))

    def max_pack_efficiency(self) -> float:
        """max over every pairing the node can have of 1/s_a + 1/s_b (the lower bound's packing)."""
        return self.grid.max_pack_efficiency() if self.pairs is None else self.pairs.max_pack_efficiency()


def floors(runs) -> dict[tuple[int, str], float]:
    """Per (pipeline index, kind), the least memory it runs in, over the device's: reference
    and training their FSDP footprint (state and micro-batch do not shrink to a grant); a
    rollout engine its weights and reserve (its KV pool follows the grant, and the KV pool
    model judges a pool too small for its requests)."""
    out = {}
    for i, r in enumerate(runs):
        cost, cap = r.cost, r.device_mem_bytes
        for kind in DEVICE_KINDS:
            need = cost.rollout_mem_bytes(0) if kind.is_rollout else \
                cost.fsdp_mem_bytes(train=kind is SubStageKind.TRAINING)
            out[(i, kind.value)] = need / cap
    return out
