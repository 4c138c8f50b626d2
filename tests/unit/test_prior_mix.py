"""MoE models in the roofline, and priors of different models sharing a device (jigsaw.mux.model.prior)."""

from __future__ import annotations

import dataclasses
import itertools
import random

import numpy as np
import pytest

from jigsaw.mux.model.costmodel import StepCost
from jigsaw.mux.model.prior import analytic_pair_prior, analytic_prior, mix_prior, pair_actual
from jigsaw.mux.model.roofline import Roofline
from jigsaw.mux.model.slowdown import SlowdownGrid
from jigsaw.mux.model.specs import H100, MODELS, ModelSpec, PriorConfig

MOE = "qwen3-30b-a3b"
MOE_CFG = PriorConfig(rollout_tp=4, fsdp_degree=8)
"""TP 4 holds a 768-request decode batch beside 15 GB of weights per rank; FSDP 8 stays on NVLink."""
SMALL = ("qwen3-0.6b", PriorConfig())
BIG = ("qwen3-32b", PriorConfig(rollout_tp=4, fsdp_degree=16))
MID = ("qwen3-4b", PriorConfig())


def _dense_twin(name: str) -> ModelSpec:
    """The MoE's shapes as a dense model of the same total parameters (every expert active)."""
    return dataclasses.replace(MODELS[name], num_experts=0, experts_per_token=0, moe_intermediate_size=0,
                               active_params=0.0)


def _table(grid: SlowdownGrid, x: str, y: str | None = None) -> np.ndarray:
    d = grid.to_dict()
    raw = d["alone"][x] if y is None else d["pairs"][x][y]
    return np.array([[np.nan if v is None else v for v in row] for row in raw])


@pytest.fixture(scope="module")
def views() -> tuple[SlowdownGrid, SlowdownGrid]:
    """(small's view beside big, big's view beside small)."""
    return analytic_pair_prior(H100, SMALL, BIG), analytic_pair_prior(H100, BIG, SMALL)


# --- MoE ------------------------------------------------------------------------------------


def test_moe_shapes_match_the_model_card():
    spec = MODELS[MOE]
    assert spec.derived_params() == pytest.approx(30.5e9, rel=0.02)
    assert spec.derived_active_params() == pytest.approx(3.3e9, rel=0.03)
    assert spec.flop_params == 3.3e9 and spec.weight_bytes == 2 * 30.5e9  # FLOPs active, memory total


def test_moe_decode_at_batch_one_reads_few_experts():
    spec = MODELS[MOE]
    assert spec.weight_read_bytes(768) == pytest.approx(spec.weight_bytes, rel=1e-9)
    # One row routes to 8 of 128 experts per layer: about 1/9 of the weights.
    assert spec.weight_read_bytes(1) < 0.15 * spec.weight_read_bytes(768)
    assert spec.weight_read_bytes(1) < spec.weight_read_bytes(32) < spec.weight_read_bytes(768)
    moe = StepCost(H100, MOE, MOE_CFG)
    # A step's weight-read time grows with the batch, so per-token cost falls steeply.
    assert moe.decode_s(1, 1024) > 100 * moe.decode_s(768, 768 * 1024) / 768


def test_dense_model_of_the_same_size_is_much_slower_at_batch_one(monkeypatch):
    monkeypatch.setitem(MODELS, "dense-twin", _dense_twin(MOE))
    cfg = PriorConfig(rollout_tp=1, fsdp_degree=8)
    moe, dense = StepCost(H100, MOE, cfg), StepCost(H100, "dense-twin", cfg)
    assert dense.decode_s(1, 1024) > 4 * moe.decode_s(1, 1024)
    assert moe.weights_bytes() == dense.weights_bytes()  # every expert stays resident


def test_moe_training_flops_by_active_memory_by_total(monkeypatch):
    monkeypatch.setitem(MODELS, "dense-twin", _dense_twin(MOE))
    moe_roof, dense_roof = Roofline(H100, MODELS[MOE], MOE_CFG), Roofline(H100, MODELS["dense-twin"], MOE_CFG)
    moe, dense = moe_roof.work("training", 0.8), dense_roof.work("training", 0.8)
    # 2 FLOPs per active parameter per forward-equivalent: forward + backward (6x active), plus
    # the activation-checkpoint recompute (8x active in all).
    assert moe.kernels[0].flops == 2 * MOE_CFG.train_forward_passes * 3.3e9
    assert dense.kernels[0].flops / moe.kernels[0].flops == pytest.approx(30.5 / 3.3)
    # FSDP gathers, copies and shards every expert: bytes and memory go by the total.
    assert moe.kernels[0].bytes == dense.kernels[0].bytes and moe.kernels[3].bytes == dense.kernels[3].bytes
    assert StepCost(H100, MOE, MOE_CFG).fsdp_mem_bytes(train=True) == \
        StepCost(H100, "dense-twin", MOE_CFG).fsdp_mem_bytes(train=True)
    assert StepCost(H100, MOE, MOE_CFG).flops_per_token == 2 * 3.3e9


def test_moe_prior_is_a_valid_grid():
    grid = analytic_prior(H100, MOE, MOE_CFG)
    assert SlowdownGrid.from_dict(grid.to_dict()) == grid
    assert grid.source["parameters"]["model"]["num_experts"] == 128
    assert "num_experts" not in analytic_prior(H100, *MID).source["parameters"]["model"]  # dense files unchanged


# --- pair prior -----------------------------------------------------------------------------


def test_pair_prior_of_a_deployment_with_itself_is_its_prior():
    for name, cfg in (SMALL, BIG, (MOE, MOE_CFG)):
        twin = dataclasses.replace(cfg)  # equal, not the same object
        assert analytic_pair_prior(H100, (name, cfg), (name, twin)) == analytic_prior(H100, name, cfg)


def test_pair_prior_keeps_its_own_alone_and_names_the_partner(views):
    small_big, _ = views
    own = analytic_prior(H100, *SMALL)
    assert small_big.to_dict()["alone"] == own.to_dict()["alone"]
    assert small_big.model == SMALL[0] and small_big.source["partner"]["model"] == BIG[0]
    assert small_big != own
    # Same model, another deployment: a different partner, a different grid.
    other = analytic_pair_prior(H100, MID, ("qwen3-4b", PriorConfig(rollout_tp=2)))
    assert other.to_dict()["alone"] == analytic_prior(H100, *MID).to_dict()["alone"]
    assert other.to_dict()["pairs"] != analytic_prior(H100, *MID).to_dict()["pairs"]


def test_partner_is_priced_by_its_own_roofline(views):
    # The 0.6B's 768-request decode streams KV almost all the time (bandwidth demand ~0.6-0.9);
    # the 32B's TP-4 decode has compute-bound GEMMs and all-reduce latency (~0.4-0.6).  So the
    # 32B is the gentler neighbour: the 0.6B suffers less beside it than beside a copy of itself,
    # and the 32B suffers more beside the 0.6B than beside a copy of itself.
    small_big, big_small = views
    small, big = analytic_prior(H100, *SMALL), analytic_prior(H100, *BIG)
    d = "rollout_decode"
    for sm in (0.5, 1.0):
        assert small_big.slowdown(d, d, sm, 0.4) < small.slowdown(d, d, sm, 0.4) - 0.05
        assert big_small.slowdown(d, d, sm, 0.6) > big.slowdown(d, d, sm, 0.6)


def test_pair_grid_feasibility_is_symmetric_and_matches_the_mix(views):
    small_big, big_small = views
    assert SlowdownGrid.from_dict(small_big.to_dict()) == small_big  # the file validator accepts it
    mix = mix_prior(H100, [SMALL, BIG])
    small, big = analytic_prior(H100, *SMALL), analytic_prior(H100, *BIG)
    kinds = small_big.kinds
    for x, y in itertools.product(kinds, repeat=2):
        ab, ba = np.isnan(_table(small_big, x, y)), np.isnan(_table(big_small, y, x))
        assert (ab == ba[:, ::-1][[2, 1, 0, 3]]).all(), (x, y)  # B's view at (1-σ or 1.0, 1-m)
        assert (ab == np.isnan(_table(mix, x, y))).all(), (x, y)
        fits = ~np.isnan(_table(small, x))[0] & ~np.isnan(_table(big, y))[0][::-1]
        assert not (~ab & ~fits).any(), (x, y)  # never feasible where a side does not fit
    # The documented price of the symmetry: the 0.6B's decode in 20% beside the 32B's training
    # in 80% fits, but is null because the 32B's decode would not fit 20%.
    assert small.alone("rollout_decode", 1.0, 0.2) < np.inf and big.alone("training", 1.0, 0.8) < np.inf
    assert small_big.slowdown("rollout_decode", "training", 1.0, 0.2) == np.inf


def test_pair_actual_reads_each_side_from_its_own_view(views):
    small_big, big_small = views
    d, t = "rollout_decode", "training"
    got = pair_actual(small_big, big_small, (d, 0.5, 0.4), (t, 0.5, 0.6))
    assert got == (small_big.slowdown(d, t, 0.5, 0.4), big_small.slowdown(t, d, 0.5, 0.6))
    assert pair_actual(small_big, big_small, (d, 1.0, 0.2), (t, 1.0, 0.8)) is None
    own = analytic_prior(H100, *SMALL)
    assert pair_actual(own, own, (d, 0.25, 0.6), (t, 0.75, 0.4)) == own.pair(d, t, 0.25, 0.6)
    with pytest.raises(ValueError, match="two views"):
        pair_actual(small_big, own, (d, 0.5, 0.4), (t, 0.5, 0.6))


# --- mix prior ------------------------------------------------------------------------------


def test_mix_prior_is_order_independent():
    deployments = [SMALL, BIG, MID, (MOE, MOE_CFG)]
    first = mix_prior(H100, deployments).to_dict()
    shuffled = list(deployments)
    random.Random(7).shuffle(shuffled)
    assert shuffled != deployments
    assert mix_prior(H100, shuffled).to_dict() == first
    assert mix_prior(H100, reversed(deployments)).to_dict() == first
    # two pipelines of one deployment pair it with itself: a different node
    assert mix_prior(H100, deployments + [SMALL]).to_dict() != first


def test_mix_prior_of_one_deployment_is_its_prior():
    assert mix_prior(H100, [MID]) == analytic_prior(H100, *MID)
    assert mix_prior(H100, [MID, MID, ("qwen3-4b", PriorConfig())]) == analytic_prior(H100, *MID)
    with pytest.raises(ValueError, match="at least one"):
        mix_prior(H100, [])


def test_mix_prior_is_the_entrywise_max_of_the_pair_priors():
    # One pipeline each: only the two real pairings count (neither model shares with itself).
    mix = mix_prior(H100, [SMALL, MID])
    views = [analytic_pair_prior(H100, SMALL, MID), analytic_pair_prior(H100, MID, SMALL)]
    for x in mix.kinds:
        alone = np.maximum(_table(views[0], x), _table(views[1], x))  # NaN (infeasible) wins
        assert np.array_equal(_table(mix, x), alone, equal_nan=True)
        for y in mix.kinds:
            stack = np.stack([_table(v, x, y) for v in views])
            want = stack.max(axis=0)  # NaN (infeasible in any pairing) propagates
            assert np.array_equal(_table(mix, x, y), want, equal_nan=True), (x, y)
    # It is strictly more pessimistic than the 0.6B's own grid somewhere: the 4B is a heavier neighbour.
    small = analytic_prior(H100, *SMALL)
    assert (_table(mix, "rollout_tail", "training") > _table(small, "rollout_tail", "training") + 0.05).any()


# --- the pair views the scheduler and the physics share (jigsaw.mux.model.pairing) ---------------------


def test_pair_view_answers_as_pair_actual_and_as_the_own_prior_for_one_model(views):
    from jigsaw.mux.model.pairing import PairGrids, PairView

    ab, ba = views
    view = PairView(ab, ba)
    opts = view.pair_options("rollout_decode", "training")
    assert opts  # the small decode fits beside the big training somewhere
    for sm, mem, sa, sb in opts:
        assert (sa, sb) == pair_actual(ab, ba, ("rollout_decode", sm, mem), ("training", 1.0 - sm, 1.0 - mem))
    assert view.actual(("rollout_decode", 1.0, 0.5), ("training", 1.0, 0.5)) == \
        pair_actual(ab, ba, ("rollout_decode", 1.0, 0.5), ("training", 1.0, 0.5))
    # Options where only the mix is infeasible are kept: the mix has fewer points.
    mix = mix_prior(H100, [SMALL, BIG])
    assert len(mix.pair_options("rollout_decode", "training")) <= len(opts)
    with pytest.raises(ValueError, match="not the two views"):
        PairView(ab, ab)
    grids = PairGrids(H100, {"p0": SMALL, "p1": BIG, "p2": SMALL})
    assert grids.between("p0", "p2") == analytic_prior(H100, *SMALL)  # one model: its own prior
    assert grids.between("p0", "p1").ab == ab and grids.between("p1", "p0").ab == ba
    assert grids.deployment_class("p0") == grids.deployment_class("p2") != grids.deployment_class("p1")
