"""The graph↔mux seam is typed: mux's grids answer what graph/model.py says the scheduler asks."""

from jigsaw.graph.model import DeviceSpec, PairModels, PairPricing, SlowdownModel
from jigsaw.mux.model.pairing import PairGrids
from jigsaw.mux.model.slowdown import load_grid
from jigsaw.mux.model.specs import DEVICES, PriorConfig


def test_grids_and_pair_views_are_what_the_scheduler_asks_for():
    grid = load_grid("h100/qwen3-4b")
    assert isinstance(grid, SlowdownModel) and isinstance(grid.device, DeviceSpec)
    pairs = PairGrids(DEVICES["h100"], {"a": ("qwen3-0.6b", PriorConfig()), "b": ("qwen3-4b", PriorConfig())})
    assert isinstance(pairs, PairModels)
    view = pairs.between("a", "b")
    assert isinstance(view, PairPricing) and not isinstance(view, SlowdownModel)  # no device-wide `shared`
    assert view.pair_options("rollout_tail", "training")  # and it answers
    assert isinstance(pairs.between("a", "a"), SlowdownModel)  # one model beside itself: its own grid
