"""Analytic roofline prior (jigsaw.mux.model.specs, roofline, prior): calibration to the paper and shipped files."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import math
from pathlib import Path

import numpy as np
import pytest

from jigsaw.mux.model.prior import SHIPPED, analytic_prior, shipped_path
from jigsaw.mux.model.roofline import Roofline
from jigsaw.mux.model.slowdown import DeviceInfo, SlowdownGrid, load_grid
from jigsaw.mux.model.specs import DEVICE_KIND_NAMES, DEVICES, H100, MODELS, ModelSpec, PriorConfig
from jigsaw.profiles import SHIPPED_DIR

PROFILES = SHIPPED_DIR
COMPUTE_BOUND = ("training", "reference", "rollout_prefill", "rollout_decode")


@pytest.fixture(scope="module")
def qwen4b() -> SlowdownGrid:
    return load_grid(shipped_path(PROFILES, "h100", "qwen3-4b"))


@pytest.fixture(scope="module")
def qwen32b() -> SlowdownGrid:
    return load_grid(shipped_path(PROFILES, "h100", "qwen3-32b"))


@pytest.fixture(scope="module", params=SHIPPED, ids=lambda s: f"{s[0]}/{s[1]}")
def shipped(request) -> tuple[str, str, PriorConfig, SlowdownGrid]:
    device_dir, model, config = request.param
    return device_dir, model, config, load_grid(shipped_path(PROFILES, device_dir, model))


# --- the four paper figures (JigsawRL §4.2, Fig. 7, Fig. 8) --------------------------------


def test_fig7_compute_bound_kinds_at_quarter_sms(qwen4b):
    # Training and large-batch rollout (> 256 requests): up to 2.7x slower with 25% SMs.
    assert 2.4 <= qwen4b.alone("training", 0.25, 0.8) <= 3.0
    assert PriorConfig().decode_max_batch > 256
    assert 2.4 <= qwen4b.alone("rollout_decode", 0.25, 0.8) <= 3.0


def test_decode_batch_at_top_memory_is_large(qwen4b):
    # The representative decode batch is pool-limited; it must still be a > 256 batch.
    work = Roofline(H100, MODELS["qwen3-4b"], PriorConfig()).work("rollout_decode", 0.8)
    rows = 1.0 / work.kernels[0].bytes * MODELS["qwen3-4b"].weight_bytes
    assert rows > 256


def test_fig7_small_batch_rollout_is_sm_insensitive(qwen4b):
    assert PriorConfig().tail_batch < 128
    assert qwen4b.alone("rollout_tail", 0.25, 0.8) <= 1.2


def _best_split_max(grid: SlowdownGrid, a: str, b: str) -> float | None:
    """max(s_a, s_b) of an unpartitioned pair under its best feasible memory split."""
    values = [max(p) for m in grid.mem_levels if (p := grid.shared(a, b, m)) is not None]
    return min(values) if values else None


def test_fig8_two_compute_bound_kinds_sharing_sms(qwen4b):
    # Co-locating two compute-bound sub-stages without partitions: up to 2.19x.
    worst = max(v for a, b in itertools.combinations_with_replacement(COMPUTE_BOUND, 2)
                if (v := _best_split_max(qwen4b, a, b)) is not None)
    assert 2.0 <= worst <= 2.4


def test_qwen3_32b_rollout_memory_sensitivity(qwen32b):
    # Qwen3-32B on 4 H100 (TP 4): 1.43x slower when memory drops from 80% to 40%.
    assert qwen32b.source["parameters"]["config"]["rollout_tp"] == 4
    ratio = qwen32b.alone("rollout_decode", 1.0, 0.4) / qwen32b.alone("rollout_decode", 1.0, 0.8)
    assert 1.3 <= ratio <= 1.55


def test_complementary_partition_beats_compute_bound_sharing(qwen4b):
    partitioned = min(max(s_a, s_b) for _, _, s_a, s_b in qwen4b.pair_options("training", "rollout_tail"))
    shared = _best_split_max(qwen4b, "training", "training")
    assert partitioned < shared - 0.2
    assert qwen4b.max_pack_efficiency() > 1.3


# --- sanity of every shipped prior --------------------------------------------------------


def test_shipped_prior_is_labelled(shipped):
    device_dir, model, config, grid = shipped
    assert grid.source["kind"] == "analytic-prior"
    assert "not a measurement" in grid.source["note"]
    assert grid.source["parameters"]["config"]["rollout_tp"] == config.rollout_tp
    assert grid.device == DEVICES[device_dir] and grid.model == model
    assert grid.kinds == DEVICE_KIND_NAMES


def test_alone_is_monotone_in_sm_and_memory(shipped):
    grid = shipped[3]
    for kind in grid.kinds:
        table = np.array([[np.nan if x is None else x for x in row] for row in grid.to_dict()["alone"][kind]])
        feasible = ~np.isnan(table)
        assert (feasible[:, 1:] >= feasible[:, :-1]).all(), kind  # fits at m => fits above m
        assert (feasible == feasible[0]).all(), kind  # SMs never decide feasibility
        with np.errstate(invalid="ignore"):
            assert not (np.diff(table, axis=0) > 0).any(), kind
            assert not (np.diff(table, axis=1) > 0).any(), kind
        assert table[-1, -1] == 1.0


def test_slowdowns_are_at_least_one(shipped):
    grid = shipped[3]
    for a, b in itertools.product(grid.kinds, repeat=2):
        for sm, mem in itertools.product(grid.sm_levels, grid.mem_levels):
            assert grid.slowdown(a, b, sm, mem) >= grid.alone(a, sm, mem) >= 1.0


def test_shipped_files_equal_regeneration(tmp_path):
    one = analytic_prior(H100, "qwen3-4b", PriorConfig())
    assert one == load_grid(shipped_path(PROFILES, "h100", "qwen3-4b"))
    from jigsaw.cli.main import main

    assert main(["prior", "--shipped", "--profiles-dir", str(tmp_path)]) == 0
    for device_dir, model, _ in SHIPPED:
        fresh = Path(shipped_path(tmp_path, device_dir, model))
        assert fresh.read_bytes() == Path(shipped_path(PROFILES, device_dir, model)).read_bytes(), fresh


def test_device_kinds_match_graph():
    from jigsaw.graph.substage import DEVICE_KINDS

    assert DEVICE_KIND_NAMES == tuple(k.value for k in DEVICE_KINDS)


# --- model and config -----------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(MODELS))
def test_model_params_match_their_shapes(name):
    spec = MODELS[name]
    assert spec.derived_params() == pytest.approx(spec.params, rel=0.02)


def test_unknown_model_and_unfit_deployment():
    with pytest.raises(KeyError, match="qwen3-4b"):
        analytic_prior(H100, "gpt-5")
    with pytest.raises(ValueError, match="NVLink"):
        analytic_prior(dataclasses.replace(H100, sku="X"), "qwen3-4b")
    with pytest.raises(ValueError, match="does not fit"):
        analytic_prior(H100, "qwen3-32b", PriorConfig(rollout_tp=1, fsdp_degree=1))


def test_tail_is_infeasible_only_when_weights_do_not_fit():
    grid = analytic_prior(H100, "llama-3.1-8b", PriorConfig(fsdp_degree=8))
    assert grid.alone("rollout_tail", 1.0, 0.2) == math.inf  # 16 GB of weights in 17 GB
    assert grid.alone("rollout_tail", 1.0, 0.4) < math.inf


@pytest.mark.parametrize("cls", [PriorConfig, ModelSpec, DeviceInfo])
def test_every_field_has_a_docstring(cls):
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body
    fields = [n.target.id for n in body if isinstance(n, ast.AnnAssign)]
    documented = {body[i].target.id for i in range(len(body) - 1) if isinstance(body[i], ast.AnnAssign)
                  and isinstance(body[i + 1], ast.Expr) and isinstance(body[i + 1].value, ast.Constant)}
    assert fields and set(fields) == documented
    if cls is PriorConfig:
        PriorConfig()  # every field has a default
