"""An SLO the scheduler could meet is met, on every shipped workload pair (issue 36).

    shipped pair ─► simulate() under jigsaw, 2 steps, traced ─► the recorded graphs
        ─► replayed one pipeline after the other (serial): the first pipeline's worst step
           against its exclusive time is an SLO a schedule keeps (serial keeps it)
        ─► replayed under jigsaw with that SLO on the first pipeline: every step keeps it

The replay knows every sub-stage's exclusive time, so a step missed here is the scheduler's
choice, not a prediction's error (the node simulator's misses, with predicted graphs, are
measured by bench/slo.py).  Steps are measured by the node's step clock (node/slo.py), the
same one the daemon reports from."""

from __future__ import annotations

import pytest

from jigsaw.graph.policies import make
from jigsaw.sim import workload as wl
from jigsaw.sim.replay import grid_of, recorded, replay
from jigsaw.sim.run import SimConfig, simulate

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("pair", wl.shipped_pairs(), ids=lambda p: f"{p[0]}+{p[1]}")
def test_an_slo_a_schedule_keeps_is_kept_by_the_look_ahead(pair):
    res = simulate(SimConfig(workload=pair, policy="jigsaw", steps=2, trace=True, placement="colocated"))
    rec = recorded(res.trace)
    grid = grid_of(rec)
    name = rec.pipelines[0].graph.pipeline
    serial = dict(replay(rec, make("serial"), grid).steps)[name]
    slo = max(1.0, *(o.slowdown for o in serial))
    held = replay(rec, make("jigsaw"), grid, slo={name: slo})
    steps = dict(held.steps)[name]
    assert len(steps) == len(serial) == 2
    for o in steps:
        assert o.kept, (pair, slo, o)
    free = dict(replay(rec, make("jigsaw"), grid).steps)[name]
    assert [o.exclusive_s for o in free] == pytest.approx([o.exclusive_s for o in steps]), \
        "the SLO changes when the work runs, not what it is"
