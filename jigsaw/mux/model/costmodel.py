"""Exclusive time of the work a simulated pipeline does, from the prior's roofline.

    DeviceInfo + ModelSpec + PriorConfig (specs.py) ─► Roofline (roofline.py) ─► StepCost
        decode step    t = c0(batch) + c1 · kv_tokens        (exact: attention is linear in KV;
                       c0 holds the weight reads, which for an MoE grow with the batch)
        prefill step   t(tokens, context)
        reference / training   per micro-batch (FSDP collectives, host) + per optimizer step:
            a rank's sequence lengths L ─► micro_batch_shapes ─► per micro-batch (ΣL, ΣL²/ΣL)
            ─► Roofline.fsdp_micro_batch_s (GEMMs ∝ ΣL, causal attention ∝ ΣL²); a bare token
            total (no samples known) is priced at the representative `train_seq_tokens`
        memory footprints of the rollout engine, reference and training

"Exclusive" means alone on the whole device at the top memory level; the simulator
multiplies by the slowdown grid for co-location and memory shares, so interference
and memory effects have one source (the grid, built from the same roofline).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from jigsaw.mux.model.roofline import Roofline
from jigsaw.mux.model.slowdown import DeviceInfo
from jigsaw.mux.model.specs import MODELS, PriorConfig

SeqTokens = float | Sequence[float] | np.ndarray
"""A rank's work in reference or training: its sequence lengths (prompt + response + appended
tool/observation tokens, one per sample, in batch order), or only their total."""


def micro_batch_shapes(seq_tokens: SeqTokens, micro_batches: int) -> list[tuple[float, float | None]]:
    """(ΣL tokens, ΣL²/ΣL) of every micro-batch of a rank.

    Sequences: consecutive runs of near-equal count (verl splits a rank's batch by sequence
    count); a micro-batch left without a sequence does not run.  A bare total: `micro_batches`
    equal shares at the representative sequence length (None: `train_seq_tokens`)."""
    mb = max(1, micro_batches)
    if np.ndim(seq_tokens) == 0:
        return [(float(seq_tokens) / mb, None)] * mb
    shapes = []
    for part in np.array_split(np.asarray(seq_tokens, dtype=float), mb):
        tokens = float(part.sum())
        if tokens > 0:
            shapes.append((tokens, float(np.dot(part, part)) / tokens))
    return shapes


@dataclass(frozen=True, slots=True)
class DecodeCoeffs:
    """A decode step of `batch` requests holding `kv` KV tokens takes c0 + c1·kv seconds."""

    c0_s: float
    c1_s_per_token: float


class StepCost:
    """Exclusive step times of one model deployment on one device."""

    def __init__(self, device: DeviceInfo, model: str, config: PriorConfig = PriorConfig()):
        if model not in MODELS:
            raise KeyError(f"unknown model {model!r}; known: {sorted(MODELS)}")
        self.device, self.spec, self.config = device, MODELS[model], config
        self._roof = Roofline(device, self.spec, config)
        self._decode: dict[int, DecodeCoeffs] = {}
        if self._roof.work("training", Roofline.cfg_top_mem) is None:
            raise ValueError(f"{model} does not fit {device.sku} for training with fsdp_degree {config.fsdp_degree}")

    @property
    def flops_per_token(self) -> float:
        """Forward FLOPs per token (2 × parameters a token multiplies: an MoE's active ones)."""
        return 2.0 * self.spec.flop_params

    def decode(self, batch: int) -> DecodeCoeffs:
        """Coefficients of a decode step of `batch` requests (cached per batch)."""
        got = self._decode.get(batch)
        if got is None:
            got = self._decode[batch] = self._decode_coeffs(batch)
        return got

    def _decode_coeffs(self, batch: int) -> DecodeCoeffs:
        m, c, d, tp = self.spec, self.config, self.device, self.config.rollout_tp
        flops_rate, bw = d.peak_flops * c.gemm_eff, d.mem_bw_bytes_per_s * c.bw_eff
        # An MoE step multiplies the active parameters but reads every expert its batch touches.
        gemm = max(2 * m.flop_params * batch / tp / flops_rate, m.weight_read_bytes(batch) / tp / bw)
        act = batch * self._roof._activation_bytes(1) + batch * m.vocab * 4 * c.logits_passes / tp
        fixed = c.host_s_per_forward + m.num_layers * c.layer_latency_s
        if tp > 1:
            fixed += 2 * m.num_layers * c.allreduce_latency_s
        kv_bytes = m.kv_bytes_per_token / min(tp, m.num_kv_heads)
        attn_per_token = max(4 * m.num_layers * m.num_heads * m.head_dim / tp / flops_rate, kv_bytes / bw)
        return DecodeCoeffs(c0_s=gemm + act / bw + fixed, c1_s_per_token=attn_per_token)

    def decode_s(self, batch: int, kv_tokens: int) -> float:
        co = self.decode(batch)
        return co.c0_s + co.c1_s_per_token * kv_tokens

    def prefill_s(self, tokens: int, context_tokens: int, requests: int = 1) -> float:
        """A chunk of `tokens` new tokens from `requests` requests (an even share each) that
        already hold `context_tokens` on average."""
        m, c, d, tp = self.spec, self.config, self.device, self.config.rollout_tp
        flops_rate, bw = d.peak_flops * c.gemm_eff, d.mem_bw_bytes_per_s * c.bw_eff
        gemm = max(2 * m.flop_params * tokens / tp / flops_rate, m.weight_read_bytes(tokens) / tp / bw)
        # Each new token attends to its own request's context plus half that request's share of
        # the chunk on average (not to the other requests' tokens: a batched prefill is causal
        # per sequence).
        own = tokens / max(1, requests)
        attn_flops = 4 * m.num_layers * m.num_heads * m.head_dim * tokens * (context_tokens + own / 2) / tp
        kv_write = tokens * m.kv_bytes_per_token / min(tp, m.num_kv_heads)
        attn = max(attn_flops / flops_rate, kv_write / bw)
        act = tokens * self._roof._activation_bytes(1) + tokens * m.vocab * 4 * c.logits_passes / tp
        fixed = c.host_s_per_forward + m.num_layers * c.layer_latency_s
        if tp > 1:
            fixed += 2 * m.num_layers * c.allreduce_latency_s
        return gemm + attn + act / bw + fixed

    def reference_s(self, seq_tokens: SeqTokens, micro_batches: int = 1) -> float:
        """One log-prob forward on one FSDP rank in `micro_batches` micro-batches, over the
        rank's sequences (`seq_tokens`: one length per sample) or a token total (see
        `micro_batch_shapes`)."""
        return sum(self._roof.fsdp_micro_batch_s(tokens, train=False, seq_tokens=seq)
                   for tokens, seq in micro_batch_shapes(seq_tokens, micro_batches))

    def training_s(self, seq_tokens: SeqTokens, micro_batches: int = 1, updates: int = 1) -> float:
        """Forward, recompute, backward on one FSDP rank in `micro_batches` micro-batches over
        the rank's sequences or a token total (as `reference_s`), plus `updates` optimizer
        steps (verl: one per PPO mini-batch)."""
        passes = sum(self._roof.fsdp_micro_batch_s(tokens, train=True, seq_tokens=seq)
                     for tokens, seq in micro_batch_shapes(seq_tokens, micro_batches))
        return passes + updates * self._roof.optimizer_step_s()

    def weights_bytes(self) -> float:
        """Rollout weights per TP rank: every parameter (an MoE keeps all experts resident)."""
        return self.spec.weight_bytes / self.config.rollout_tp

    def kv_bytes_per_token(self) -> float:
        return self.spec.kv_bytes_per_token / min(self.config.rollout_tp, self.spec.num_kv_heads)

    def rollout_mem_bytes(self, kv_pool_tokens: int) -> int:
        """Rollout engine: weights, a KV pool of `kv_pool_tokens`, and its reserve."""
        return int(self.weights_bytes() + kv_pool_tokens * self.kv_bytes_per_token()
                   + self.config.rollout_reserve_bytes)

    def fsdp_mem_bytes(self, *, train: bool) -> int:
        """Reference or training footprint at the configured micro-batch (state by total parameters)."""
        m, c = self.spec, self.config
        state = m.params * c.state_bytes_per_param(train=train) / c.fsdp_degree
        tokens = c.train_micro_batch_tokens if train else c.ref_micro_batch_tokens
        act = m.hidden_size * 34 + m.vocab * 4 * (2 if train else 1)
        if train:
            act += m.num_layers * m.hidden_size * 2
        return int(state + 2 * m.weight_bytes / m.num_layers + c.train_reserve_bytes + tokens * act)
