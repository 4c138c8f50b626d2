"""Feasibility by need (issue 33): a sub-stage whose need fits its budget runs there, priced by
the grid's feasible points; a policy that cannot run a workload is refused before the run."""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import pytest
from factories import GIB, NODE, chain, colocated, states, synthetic_grid
from hypothesis import given
from hypothesis import strategies as st

from jigsaw.graph.baselines import MuxServe, Static
from jigsaw.graph.plan import Budget, Progress
from jigsaw.graph.policies import NAMES, make
from jigsaw.graph.policy import Needs, PipelineNeeds, View, refusal
from jigsaw.graph.substage import SubStageKind as K
from jigsaw.mux.model.slowdown import SlowdownGrid
from jigsaw.sim import run as sim_run
from jigsaw.sim.node import Infeasible
from jigsaw.sim.run import simulate

pytestmark = pytest.mark.timeout(120)

SM, MEM = (0.5, 1.0), (0.2, 0.4, 0.6, 0.8)
FITS = {"train": 0.6, "ref": 0.2}
"""Lowest memory level each kind fits at: a training whose state needs 0.45 of the device
does not fit the 0.4 level but does fit 0.5 of it, which the grid has no level for."""


def _alone(kind: str, sm: float, mem: float) -> float | None:
    if mem < FITS[kind] - 1e-9:
        return None
    base = {"train": 1.0, "ref": 1.0}[kind] + (0.5 if sm < 1.0 else 0.0)
    return round(base + (0.8 - mem) * (0.5 if kind == "ref" else 1.0), 6)


def _pair(a: str, b: str, sm: float, mem: float) -> float | None:
    mine = _alone(a, sm, mem)
    if mine is None or _alone(b, sm, 1.0 - mem) is None:  # either side not fitting: null
        return None
    return round(mine + (0.1 if sm < 1.0 else 0.3) + (0.05 if b == "train" else 0.0), 6)


def _grid() -> SlowdownGrid:
    kinds = list(FITS)
    return SlowdownGrid.from_dict({
        "format": "jigsaw-slowdown-grid", "version": 1,
        "device": {"sku": "TEST-GPU", "num_sms": 100, "mem_bytes": 80 * GIB, "peak_flops": 1e15,
                   "mem_bw_bytes_per_s": 3e12},
        "model": "toy", "source": {"kind": "measured", "note": "hand-made: training needs more than 0.4"},
        "sm_levels": list(SM), "mem_levels": list(MEM), "kinds": kinds,
        "alone": {k: [[_alone(k, sm, m) for m in MEM] for sm in SM] for k in kinds},
        "pairs": {a: {b: [[_pair(a, b, sm, m) for m in MEM] for sm in SM] for b in kinds} for a in kinds},
    })


GRID = _grid()


# ---------------------------------------------------------------- the grid


def test_between_an_infeasible_and_a_feasible_level_the_need_decides():
    at_06 = _alone("train", 0.5, 0.6)
    assert GRID.alone("train", 0.5, 0.5) == math.inf  # need unknown: the null corner decides, as before
    assert GRID.alone("train", 0.5, 0.5, need_frac=0.45) == pytest.approx(at_06)  # only the feasible corner
    assert GRID.alone("train", 0.5, 0.45, need_frac=0.45) == pytest.approx(at_06)
    assert GRID.alone("train", 0.5, 0.5, need_frac=0.55) == math.inf  # the need does not fit the budget
    assert GRID.alone("train", 0.75, 0.5, need_frac=0.45) == pytest.approx(
        (_alone("train", 0.5, 0.6) + _alone("train", 1.0, 0.6)) / 2)  # σ still interpolates


def test_a_pair_at_half_memory_runs_when_both_needs_fit_and_not_when_one_does_not():
    assert GRID.pair("train", "ref", 0.5, 0.5) is None
    s_train, s_ref = GRID.pair("train", "ref", 0.5, 0.5, need_frac_a=0.45, need_frac_b=0.1)
    assert s_train == pytest.approx(_pair("train", "ref", 0.5, 0.6))  # its feasible corner above
    assert s_ref == pytest.approx(_pair("ref", "train", 0.5, 0.4))  # below: at 0.6 the training got 0.4
    assert GRID.pair("train", "ref", 0.5, 0.5, need_frac_a=0.55, need_frac_b=0.1) is None
    assert GRID.pair("train", "ref", 0.5, 0.5, need_frac_a=0.45, need_frac_b=None) is None
    assert GRID.actual(("train", 0.5, 0.5, 0.45), ("ref", 0.5, 0.5, 0.1)) == (s_train, s_ref)


def test_two_trainings_that_fit_halves_run_where_the_grid_has_no_split_for_both():
    # 0.4/0.6 and 0.6/0.4 each leave one training short: the pair table is null everywhere.
    assert all(GRID.slowdown("train", "train", sm, m) == math.inf for sm in SM for m in MEM)
    got = GRID.pair("train", "train", 0.5, 0.5, need_frac_a=0.45, need_frac_b=0.45)
    # behind a partition, the slowest partner the grid prices there
    assert got == pytest.approx((_pair("train", "ref", 0.5, 0.6),) * 2)
    assert GRID.pair("train", "train", 0.5, 0.5, need_frac_a=0.45, need_frac_b=0.55) is None
    assert GRID.shared("train", "train", 0.5, need_frac_a=0.45, need_frac_b=0.45) is None  # time-shared: no proxy


@pytest.mark.parametrize("grid", [GRID, synthetic_grid()], ids=["toy", "synthetic"])
def test_exact_grid_points_keep_their_stored_values(grid):
    for a, sm, mem in itertools.product(grid.kinds, grid.sm_levels, grid.mem_levels):
        assert grid.alone(a, sm, mem, need_frac=0.0) == grid.alone(a, sm, mem)
        for b in grid.kinds:
            before = grid.pair(a, b, sm, mem)
            if before is not None:
                assert grid.pair(a, b, sm, mem, need_frac_a=0.0, need_frac_b=0.0) == before
    # a null point stays infeasible for a side whose need does not fit there
    assert GRID.pair("ref", "train", 0.5, 0.6, need_frac_a=0.1, need_frac_b=0.45) is None


@given(sm=st.floats(0.5, 1.0), mem=st.floats(0.2, 1.0), need=st.floats(0.0, 0.2))
def test_where_every_corner_is_feasible_a_known_need_changes_nothing(sm, mem, need):
    assert GRID.alone("ref", sm, mem, need_frac=need) == GRID.alone("ref", sm, mem)
    sm_pair = 1.0 if sm > 0.75 else 0.5
    assert GRID.shared("ref", "ref", mem, need_frac_a=need, need_frac_b=need) == GRID.shared("ref", "ref", mem)
    assert GRID.slowdown("ref", "ref", sm_pair, mem, need_frac_a=need) == GRID.slowdown("ref", "ref", sm_pair, mem)


def test_a_need_must_be_a_fraction():
    with pytest.raises(ValueError, match="need_frac"):
        GRID.alone("ref", 0.5, 0.5, need_frac=float("nan"))


# ---------------------------------------------------------------- refusals


def _needs(*pipes: tuple[str, tuple[int, ...], float, float], cap_gib: float = 80.0) -> Needs:
    """(name, devices, rollout GiB, training GiB) per pipeline."""
    return Needs(device_mem_bytes=int(cap_gib * GIB), pipelines=tuple(
        PipelineNeeds(name=n, rollout_devices=d, train_devices=d,
                      mem_bytes={"rollout_tail": int(r * GIB), "reference": int(t * GIB / 2),
                                 "training": int(t * GIB)}) for n, d, r, t in pipes))


def test_static_refuses_a_training_larger_than_its_share_with_kind_need_and_share():
    why = Static().refusal(_needs(("A", (0,), 10.0, 20.0), ("B", (0,), 10.0, 42.3)))
    assert why == "static: training of B needs 42.3 GiB; its share of a device is 40.0 GiB (50% of 80.0 GiB)"
    assert Static().refusal(_needs(("A", (0,), 10.0, 37.9), ("B", (0,), 10.0, 37.9))) is None


def test_muxserve_refuses_two_rollouts_that_cannot_share_a_device():
    why = MuxServe().refusal(_needs(("A", (0, 1), 45.0, 20.0), ("B", (0, 1), 41.0, 20.0)))
    assert why is not None and "A (45.0 GiB)" in why and "B (41.0 GiB)" in why and "80.0 GiB" in why
    assert MuxServe().refusal(_needs(("A", (0,), 45.0, 20.0), ("B", (1,), 41.0, 20.0))) is None  # never meet
    assert MuxServe().refusal(_needs(("A", (0, 1), 38.0, 20.0), ("B", (0, 1), 38.0, 20.0))) is None


def test_a_policy_without_a_refusal_is_never_refused():
    class Bare:
        name, separable = "bare", True

    huge = _needs(("A", (0,), 79.0, 79.0), ("B", (0,), 79.0, 79.0))
    assert refusal(Bare(), huge) is None
    assert {n for n in NAMES if refusal(make(n), huge) is not None} == {"static", "muxserve"}


def test_static_is_refused_before_any_simulated_time_passes(monkeypatch):
    def no_run(*_, **__):
        raise AssertionError("the refused policy was simulated")

    monkeypatch.setattr(sim_run, "NodeSim", no_run)
    # Qwen3-32B's training on 8 H100 needs 42.3 GiB, more than its 40 GiB half.
    with pytest.raises(Infeasible) as exc:
        simulate(colocated(workload=("qwen3-32b-math",) * 2, policy="static", steps=1, trace=False))
    why = str(exc.value)
    assert why.startswith("static: training of p0-qwen3-32b-math needs ")
    assert " GiB; its share of a device is 40.0 GiB" in why
    assert "t=" not in why


def test_static_runs_the_14b_pair_to_completion_since_its_training_fits_its_half():
    config = colocated(workload=("deepseek-r1-distill-qwen-14b-math",) * 2, policy="static", steps=2, trace=False)
    runs, node, grid, _ = sim_run.build(config)
    need = runs[0].cost.fsdp_mem_bytes(train=True)
    assert grid.mem_levels[1] * node.mem_bytes < need <= node.mem_bytes / 2  # between the levels: 0.4 < need ≤ 0.5
    assert grid.actual(("training", 0.5, 0.5), ("training", 0.5, 0.5)) is None  # what failed it before
    res = simulate(config)
    assert not res.violations, res.violations[:3]
    assert [p.steps for p in res.pipelines] == [2, 2]


# ---------------------------------------------------------------- muxserve's split


def test_muxserve_gives_two_urgent_engines_a_split_off_the_grid_levels_that_holds_both():
    # Two engines needing 38 GiB each: no 0.2-step level split holds both, 50/50 does.
    a = chain("A", [("tail", K.ROLLOUT_TAIL, 10.0, 38.0)])
    b = chain("B", [("tail", K.ROLLOUT_TAIL, 10.0, 38.0)])
    pipes = [replace(ps, running={next(iter(ps.graph)).id: Budget(sm_frac=0.5, mem_frac=0.5)})
             for ps in states(a, b)]
    prog = tuple(Progress(stage="rollout", step=0, rollout_done_frac=0.0, ready_since_s=0.0) for _ in pipes)
    view = View(time_s=0.0, pipelines=tuple(pipes), progress=prog, node=NODE, model=synthetic_grid())
    plan = MuxServe().plan(view)
    assert sorted(x.mem_bytes for x in plan.assignments) == [40 * GIB, 40 * GIB]
    assert [x.sm_frac for x in plan.assignments] == [0.5, 0.5]
