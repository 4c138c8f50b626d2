"""The static split baseline: half of every device per pipeline, every stage, the whole run."""

from __future__ import annotations

import pytest
from factories import NODE, chain, states, synthetic_grid

from jigsaw.graph.baselines import Static
from jigsaw.graph.policies import make
from jigsaw.graph.substage import SubStageKind as K
from jigsaw.sim.execute import execute

pytestmark = pytest.mark.timeout(60)
GRID = synthetic_grid()


def _two():
    a = chain("A", [("tail", K.ROLLOUT_TAIL, 10.0, 10), ("train", K.TRAINING, 5.0, 10)])
    b = chain("B", [("train", K.TRAINING, 3.0, 10)])
    return states(a, b)


def test_every_substage_holds_half_the_device_even_when_its_partner_is_idle():
    ex = execute(_two(), NODE, GRID, policy=make("static"))
    on = [iv for iv in ex.intervals if iv.device is not None]
    assert on and all(iv.sm_frac == 0.5 for iv in on)
    assert not any(p.migrations for p in ex.plans)
    assert all(a.mem_bytes == NODE.mem_bytes // 2 for p in ex.plans for a in p.assignments)
    # the predicted slowdown (what the daemon integrates work with) is the half's, alone or paired
    kind = {s.id: s.kind.value for ps in _two() for s in ps.graph}
    for p in ex.plans:
        a = p.assignments
        want = [GRID.alone(kind[a[0].substage], 0.5, 0.5)] if len(a) == 1 else \
            list(GRID.pair(kind[a[0].substage], kind[a[1].substage], 0.5, 0.5))
        assert [x.slowdown for x in a] == pytest.approx(want)
    # the makespan follows from the grid at half the device: B's training beside A's tail,
    # then the rest of A's tail alone on its half, then A's training alone on its half
    s_tail, s_train = GRID.pair("rollout_tail", "training", 0.5, 0.5)
    together_s = 3.0 * s_train
    tail_left_s = 10.0 - together_s / s_tail
    expect = together_s + tail_left_s * GRID.alone("rollout_tail", 0.5, 0.5) + 5.0 * GRID.alone("training", 0.5, 0.5)
    assert ex.makespan_s == pytest.approx(expect, rel=1e-6)
    # what a regrowing policy would do instead: A's training on the whole device
    assert ex.makespan_s > together_s + tail_left_s * GRID.alone("rollout_tail", 0.5, 0.5) + 5.0 + 1.0


def test_a_substage_larger_than_its_half_is_refused_with_the_reason():
    big = chain("A", [("train", K.TRAINING, 1.0, 50)])  # 50 GiB of an 80 GiB device
    with pytest.raises(ValueError, match=r"static: A/0/r0/train on device 0 needs 50\.0 GiB; its share of a device "
                                         r"is 40\.0 GiB \(50% of 80\.0 GiB\)"):
        Static().plan(_view(states(big)))


def test_a_rollout_whose_pool_exceeds_its_half_runs_with_a_pool_sized_to_the_half():
    # An engine sizes its KV pool from the memory it is given; training cannot shrink its state.
    big = chain("A", [("tail", K.ROLLOUT_TAIL, 1.0, 70)])
    plan = Static().plan(_view(states(big)))
    assert [a.mem_bytes for a in plan.assignments] == [NODE.mem_bytes // 2]
    assert plan.assignments[0].slowdown == pytest.approx(GRID.alone("rollout_tail", 0.5, 0.5))


def test_placement_pairs_pipelines_on_equal_groups_of_devices():
    assert Static().placement(2, 8) == [(tuple(range(8)),) * 2] * 2
    three = Static().placement(3, 4)
    assert [p[0] for p in three] == [(0, 1), (0, 1), (2, 3)]
    with pytest.raises(ValueError, match="static: 3 pipelines need 2 devices"):
        Static().placement(3, 1)


def _view(pipelines):
    from jigsaw.graph.plan import Progress
    from jigsaw.graph.policy import View

    prog = tuple(Progress(stage="rollout", step=0, rollout_done_frac=0.0, ready_since_s=0.0) for _ in pipelines)
    return View(time_s=0.0, pipelines=tuple(pipelines), progress=prog, node=NODE, model=GRID)
