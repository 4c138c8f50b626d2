"""Reference and training cost what their sequences cost (issue 33), checked against an
independent roofline of the same work written here from first principles.

    sequence lengths L (one per sample) ─┬─► StepCost.reference_s / training_s (the model)
                                         └─► independent_s (below) ─► ratio within ±30%

Independent roofline of one forward over sequences L_i, from the model card's numbers (N the
parameters a token multiplies) and the device's datasheet (peak FLOPs, HBM bandwidth):
    linear GEMMs   2·N·ΣL FLOPs
    attention      causal QKᵀ and PV: 2·2·layers·(heads·head_dim)·ΣL²/2 FLOPs (flash
                   attention: no L² traffic)
    elementwise    ΣL·layers·(hidden + MLP width)·2 B, ELEMENTWISE_PASSES times (norms, rotary,
                   SwiGLU, residuals, casts: memory-bound, they add to the GEMMs' time)
    logits         ΣL·vocab·4 B (FP32), LOGITS_PASSES times
    seconds = FLOPs / (peak·GEMM_EFF) + bytes / (bandwidth·BW_EFF)
reference = 1 forward, training = 3 forward-equivalents (forward, backward worth two), 4 with
gradient checkpointing's recompute.  The efficiency constants are the model's own (checked
below), so the comparison tests the counting, not the calibration.

Left out, and so inside the ±30%: per-micro-batch host time and launch latency, FSDP
collectives beyond the GEMMs and their copies, weight reads, the optimizer, and the lower GEMM
efficiency of small micro-batches.  The cases run at micro-batches of about 20k tokens per GPU
(verl's dynamic batch size, `ppo_max_token_len_per_gpu`), where these are a few percent.  At
verl's fixed 8/16-sequence micro-batches of 600-token sequences they are not: the model then
charges 1.3-1.7x this roofline (2.9x for Qwen3-32B training, whose FSDP spans two nodes), the
per-micro-batch costs the Table 1 stage shares rest on (tests/unit/test_calibration.py).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
from factories import colocated

from jigsaw.mux.model.costmodel import StepCost
from jigsaw.mux.model.specs import DEVICES, MODELS, ModelSpec, PriorConfig
from jigsaw.sim import workload as wl
from jigsaw.sim.node import NodeSim
from jigsaw.sim.run import build

GEMM_EFF = 0.75
"""Fraction of the datasheet BF16 peak large GEMMs reach (cuBLAS on Hopper/Ampere)."""
BW_EFF = 0.7
"""Fraction of peak HBM bandwidth eager elementwise kernels reach."""
ELEMENTWISE_PASSES = 12.0
"""HBM passes over a token's (hidden + MLP) activations per layer and forward (unfused eager ops)."""
LOGITS_PASSES = 3.0
"""FP32 passes over a token's vocab logits per forward (write, softmax, gather)."""
TOLERANCE = 0.30
MICRO_BATCH_TOKENS = 20_000
"""Tokens per micro-batch per GPU (verl's dynamic batch size)."""
H100 = DEVICES["h100"]

DEPLOYMENTS = {  # (model, config): FSDP as the shipped priors deploy them; 3 passes = verl's default
    "qwen3-4b": ("qwen3-4b", PriorConfig(fsdp_degree=8, train_forward_passes=3.0)),
    "qwen3-4b-recompute": ("qwen3-4b", PriorConfig(fsdp_degree=8, train_forward_passes=4.0)),
    "llama-3.1-8b": ("llama-3.1-8b", PriorConfig(fsdp_degree=8, train_forward_passes=3.0)),
    "qwen3-32b": ("qwen3-32b", PriorConfig(rollout_tp=4, fsdp_degree=16, train_forward_passes=3.0)),
}
LENGTHS = (600, 9_000, 21_000)


def independent_s(m: ModelSpec, seq_tokens: np.ndarray, forwards: float) -> float:
    """Seconds of `forwards` forward-equivalents over sequences `seq_tokens` (module docstring)."""
    lengths = np.asarray(seq_tokens, dtype=float)
    tokens, squares = lengths.sum(), np.dot(lengths, lengths)
    flops = 2 * m.params * tokens + 2 * 2 * m.num_layers * m.num_heads * m.head_dim * squares / 2
    hbm_bytes = tokens * (m.num_layers * (m.hidden_size + m.intermediate_size) * 2 * ELEMENTWISE_PASSES
                          + m.vocab * 4 * LOGITS_PASSES)
    return forwards * (flops / (H100.peak_flops * GEMM_EFF) + hbm_bytes / (H100.mem_bw_bytes_per_s * BW_EFF))


def _rank_work(length_tokens: int) -> tuple[np.ndarray, int]:
    """One rank's sequences around `length_tokens` (±50%, so ΣL² is not (ΣL)²/n) and its
    micro-batch count at about MICRO_BATCH_TOKENS each (four micro-batches)."""
    per_micro = max(1, round(MICRO_BATCH_TOKENS / length_tokens))
    micro_batches = 4
    return length_tokens * np.linspace(0.5, 1.5, per_micro * micro_batches), micro_batches


def _model_s(cost: StepCost, stage: str, seq_tokens, micro_batches: int) -> float:
    if stage == "reference":
        return cost.reference_s(seq_tokens, micro_batches)
    return cost.training_s(seq_tokens, micro_batches, updates=0)  # the optimizer is not in the roofline


def _forwards(cfg: PriorConfig, stage: str) -> float:
    return 1.0 if stage == "reference" else cfg.train_forward_passes


def test_constants_are_the_models():
    c = PriorConfig()
    assert (c.gemm_eff, c.bw_eff, c.elementwise_passes, c.logits_passes) == (
        GEMM_EFF, BW_EFF, ELEMENTWISE_PASSES, LOGITS_PASSES)
    assert all(not MODELS[m].num_experts for m, _ in DEPLOYMENTS.values())  # dense: N = params


@pytest.mark.parametrize("stage", ("reference", "training"))
@pytest.mark.parametrize("length_tokens", LENGTHS)
@pytest.mark.parametrize("deployment", sorted(DEPLOYMENTS))
def test_stage_time_matches_independent_roofline(deployment, length_tokens, stage):
    name, cfg = DEPLOYMENTS[deployment]
    cost = StepCost(H100, name, cfg)
    seqs, micro_batches = _rank_work(length_tokens)
    ratio = _model_s(cost, stage, seqs, micro_batches) / independent_s(MODELS[name], seqs, _forwards(cfg, stage))
    assert abs(ratio - 1.0) <= TOLERANCE, f"{deployment} {stage} at {length_tokens} tokens: {ratio:.2f}x the roofline"


@pytest.mark.parametrize("stage", ("reference", "training"))
@pytest.mark.parametrize("deployment", sorted(DEPLOYMENTS))
def test_same_tokens_in_long_sequences_cost_their_attention(deployment, stage):
    # Equal tokens per micro-batch: GEMMs, traffic and per-micro-batch costs cancel, the
    # difference is the attention of 21k-token sequences over 600-token ones.
    name, cfg = DEPLOYMENTS[deployment]
    cost = StepCost(H100, name, cfg)
    short, long = np.full(70, 600.0), np.full(2, 21_000.0)
    extra_s = _model_s(cost, stage, long, 2) - _model_s(cost, stage, short, 2)
    expected_s = (independent_s(MODELS[name], long, _forwards(cfg, stage))
                  - independent_s(MODELS[name], short, _forwards(cfg, stage)))
    assert extra_s > 0, f"{deployment} {stage}: short sequences cost as much as long ones of the same tokens"
    assert abs(extra_s / expected_s - 1.0) <= TOLERANCE, f"{deployment} {stage}: {extra_s / expected_s:.2f}x"


def test_a_token_total_alone_keeps_the_representative_length():
    # Callers without samples (the prior's grids) price sequences of train_seq_tokens.
    cost = StepCost(H100, *DEPLOYMENTS["qwen3-4b"])
    seq = PriorConfig().train_seq_tokens
    assert cost.training_s(np.full(8, float(seq)), 2, 1) == pytest.approx(cost.training_s(8 * seq, 2, 1))
    assert cost.reference_s(np.full(8, float(seq)), 2) == pytest.approx(cost.reference_s(8 * seq, 2))


def _stage_s(response_tokens: int) -> tuple[float, float, int]:
    """Reference and training seconds of one serial step of Qwen3-4B on 4 H100 whose 64
    samples all respond `response_tokens` tokens, and its tokens."""
    base = wl.get("qwen3-4b-aime")
    lengths = replace(base.lengths, median_tokens=float(response_tokens), prompt_sigma=0.0, response_sigma=0.0,
                      max_tokens=response_tokens)
    spec = replace(base, prompts=16, mini_batch_prompts=16, prompt_sigma=0.0, lengths=lengths)
    runs, node, grid, policy = build(colocated(workload=(base.name,), policy="serial", gpus=4, steps=1, trace=False))
    runs[0].spec = spec
    NodeSim(runs, node, grid, policy, trace=False).run()
    step = runs[0].metrics[0]
    return step.stage_s["reference"], step.stage_s["training"], step.tokens


def test_long_responses_cost_more_than_linearly_in_reference_and_training():
    steps = {r: _stage_s(r) for r in (4_000, 8_000, 16_000)}
    for stage in (0, 1):
        per_token = [steps[r][stage] / steps[r][2] for r in sorted(steps)]
        assert per_token == sorted(per_token) and per_token[0] < per_token[-1], per_token
        # Doubling the response more than doubles the time: attention is quadratic.
        assert steps[16_000][stage] > 2.1 * steps[8_000][stage]
