"""Roofline timing of a sub-stage kind's work, alone or beside another kind on one device.

    DeviceInfo + ModelSpec + PriorConfig (specs.py)
        │  Roofline.work(kind, mem_frac): kernel classes (FLOPs, bytes) + fixed s, per token
        ▼
    Roofline.parts(work, σ) ─► (compute s, memory s, fixed s) ─► alone / partitioned / shared
                                                  (a pair: two Sides, each its own roofline)
    prior.py turns these times into grids; costmodel.py into the simulator's step times.

The model, per unit of work (one prefilled, generated, referenced or trained token):
  * a kernel class costs max(F / (σ'·peak·η), B / (bw·η_bw·min(1, σ'/σ_sat))), where
    σ' = min(1, σ/o) and o = min(1, rows/fill_rows) is the kind's SM demand: a forward over
    few rows cannot keep every SM busy, so SMs it could not use cost nothing to take away.
    σ_sat is the SM share needed to saturate HBM (higher for decode attention);
  * plus an SM-insensitive fixed part: host time, per-layer launch latency, TP all-reduce
    latency, exposed FSDP collectives;
  * MoE: FLOPs by the active parameters, memory (weights, KV pool, FSDP state, gathers) by
    the total; a rollout forward over r rows reads the experts it touches, an expected
    1-(1-k/E)^r of them (few at small-batch decode, all at a large batch);
  * attention is quadratic in the sequence: a causal sequence of L tokens costs
    4·layers·heads·head_dim·L²/2 FLOPs per forward, so a training or reference micro-batch
    costs 4·layers·heads·head_dim·ΣL²/2 over its ΣL tokens, i.e. per token
    4·layers·heads·head_dim·seq/2 with seq = ΣL²/ΣL (its token-weighted mean length).  The
    simulator passes seq per micro-batch (`fsdp_micro_batch_s`); the prior's grids, which
    know no samples, use `train_seq_tokens`;
  * memory: the rollout KV pool is mem·capacity − weights/tp − reserve; a pool below the
    representative working set shrinks the running batch (more steps, less weight-read
    amortisation); training/reference shrink the micro-batch (η and amortisation fall);
    weights or sharded training state that do not fit are infeasible (null);
  * partitioned pair: SMs split, HBM shared: if the two sides' average bandwidth demands sum
    above 1, both memory-bound parts stretch by that sum; busy parts pay a small interference;
  * unpartitioned pair (σ = 1.0): the GPU-busy parts (compute and memory-bound kernels both
    hold SMs) time-share and stretch by max(1, u_A + u_B)·(1 + ε), u = busy fraction × o;
    host/latency parts do not stretch.  Each side of a pair is timed by its own roofline
    (model, config and ε), so two different models can share the device.
Slowdown = time per unit / time per unit alone on the whole device at the top memory level.
Constants are calibrated to JigsawRL §4.2, Fig. 7 and Fig. 8 (see PriorConfig).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from jigsaw.mux.model.slowdown import DeviceInfo
from jigsaw.mux.model.specs import (
    CPU_ADAM_PARAMS_PER_S,
    GPUS_PER_NODE,
    LINK_BW_BYTES_PER_S,
    NET_BW_BYTES_PER_S,
    PCIE_BW_BYTES_PER_S,
    ModelSpec,
    PriorConfig,
)


@dataclass(frozen=True, slots=True)
class _Kernel:
    flops: float
    bytes: float
    sat_sm_frac: float
    """SM share this class needs to saturate HBM."""


@dataclass(frozen=True, slots=True)
class _Work:
    """Cost of one token of a kind's work at one memory share."""

    kernels: tuple[_Kernel, ...]
    fixed_s: float
    sm_demand_frac: float
    gemm_eff: float


@dataclass(frozen=True, slots=True)
class _Parts:
    compute_s: float
    memory_s: float
    fixed_s: float
    bw_s: float
    """Memory-bound seconds weighted by the fraction of device bandwidth drawn meanwhile."""

    @property
    def total_s(self) -> float:
        return self.compute_s + self.memory_s + self.fixed_s


class Roofline:
    """One (device, model, config): builds work per kind and memory share, and times it.

    The prior grid and the simulator's step times (`jigsaw.mux.model.costmodel`) both come from
    here, so what the simulator charges and what the scheduler predicts agree."""

    def __init__(self, device: DeviceInfo, model: ModelSpec, cfg: PriorConfig):
        self.device, self.model, self.cfg = device, model, cfg
        if device.sku not in LINK_BW_BYTES_PER_S:
            raise ValueError(f"no NVLink bandwidth known for {device.sku!r}; add it to LINK_BW_BYTES_PER_S")
        # FSDP collectives cross nodes once the shard group is larger than a node.
        inside = cfg.fsdp_degree <= (cfg.node_gpus or GPUS_PER_NODE[device.sku])
        self.link_bw = LINK_BW_BYTES_PER_S[device.sku] if inside else NET_BW_BYTES_PER_S[device.sku]

    def work(self, kind: str, mem_frac: float) -> _Work | None:
        """Per-token cost of `kind` holding `mem_frac` of device memory; None if it does not fit."""
        c = self.cfg
        if kind == "training":
            return self._fsdp(mem_frac, train=True)
        if kind == "reference":
            return self._fsdp(mem_frac, train=False)
        shape = {"rollout_prefill": (c.prefill_tokens, c.prefill_context_tokens // 2, 1),
                 "rollout_decode": (c.decode_max_batch, c.decode_context_tokens, c.decode_context_tokens),
                 "rollout_tail": (c.tail_batch, c.tail_context_tokens, c.tail_context_tokens)}[kind]
        return self._rollout(mem_frac, *shape)

    def _rollout(self, mem_frac: float, rows: int, attn_context: int, kv_tokens_per_row: int) -> _Work | None:
        m, c, tp = self.model, self.cfg, self.cfg.rollout_tp
        # NOTE: with more TP ranks than KV heads the heads are replicated, not split further.
        kv_row_bytes = kv_tokens_per_row * m.kv_bytes_per_token / min(tp, m.num_kv_heads)
        # NOTE: the SM demand belongs to the kind (its token bucket), not to the batch a small
        # pool leaves; otherwise more memory could look slower at a small SM share.
        sm_demand = min(1.0, rows / c.fill_rows)
        pool = mem_frac * self.device.mem_bytes - m.weight_bytes / tp - c.rollout_reserve_bytes
        rows = min(rows, math.floor(pool / kv_row_bytes)) if pool > 0 else 0
        if rows < 1:
            return None
        # An MoE forward multiplies the active parameters but reads the experts its rows touch.
        gemm = _Kernel(2 * m.flop_params * rows / tp, m.weight_read_bytes(rows) / tp, c.bw_sat_sm_frac)
        # Decode reads each row's whole KV; prefill (one KV token per row) writes its own.
        attn = _Kernel(4 * m.num_layers * m.num_heads * m.head_dim * attn_context * rows / tp, rows * kv_row_bytes,
                       c.attn_bw_sat_sm_frac)
        elementwise = _Kernel(0.0, rows * self._activation_bytes(1) + rows * m.vocab * 4 * c.logits_passes / tp,
                              c.bw_sat_sm_frac)
        fixed = c.host_s_per_forward + m.num_layers * c.layer_latency_s
        if tp > 1:
            fixed += 2 * m.num_layers * c.allreduce_latency_s
        per_row = tuple(_Kernel(k.flops / rows, k.bytes / rows, k.sat_sm_frac) for k in (gemm, attn, elementwise))
        return _Work(per_row, fixed / rows, sm_demand, c.gemm_eff)

    def _fsdp(self, mem_frac: float, *, train: bool, micro_tokens: float | None = None,
              optimizer: bool = True, seq_tokens: float | None = None) -> _Work | None:
        """Training (fwd + recompute + bwd + Adam) or reference (fwd) under FSDP, per token.

        `micro_tokens` fixes the micro-batch (default: the largest that fits `mem_frac`);
        `optimizer=False` leaves out the Adam update, amortised otherwise over a step;
        `seq_tokens` is the micro-batch's ΣL²/ΣL (default `train_seq_tokens`), what its
        attention costs per token (module docstring)."""
        m, c, f = self.model, self.cfg, self.cfg.fsdp_degree
        tokens = micro_tokens or self._micro_batch_tokens(mem_frac, train=train)
        if tokens is None:
            return None
        passes, collectives = (c.train_forward_passes, 3.0) if train else (1.0, 1.0)
        seq = c.train_seq_tokens if seq_tokens is None else seq_tokens
        sat = c.bw_sat_sm_frac
        kernels = [
            # FLOPs by the active parameters; an MoE micro-batch (thousands of rows) touches
            # every expert, and FSDP gathers and copies them all, so bytes go by the total.
            _Kernel(2 * passes * m.flop_params, passes * m.weight_bytes / tokens, sat),
            # Causal: a token attends to half its sequence on average.
            _Kernel(passes * 4 * m.num_layers * m.num_heads * m.head_dim * seq / 2, 0.0, sat),
            _Kernel(0.0, passes * (self._activation_bytes(1) + m.vocab * 4 * c.logits_passes), sat),
            # FSDP copies each gathered weight out of, and each gradient into, flat buffers.
            _Kernel(0.0, c.fsdp_copy_passes * collectives * m.weight_bytes / tokens, sat),
        ]
        if train and optimizer:
            kernels.append(_Kernel(0.0, m.params / f * c.optimizer_bytes_per_param / c.train_tokens_per_step, sat))
        # All-gather for the forward, again for recompute + backward, reduce-scatter of the
        # gradients: three weight-sized collectives per micro-batch (one for reference).  FSDP
        # prefetches the next layer while this one computes, so only communication beyond the
        # micro-batch's GEMM time shows (all of it for tiny micro-batches across nodes).
        comm_total = collectives * m.weight_bytes * (f - 1) / f / self.link_bw
        gemm_s = 2 * passes * m.flop_params * tokens / (self.device.peak_flops * c.gemm_eff)
        comm_s = max(0.0, comm_total - gemm_s)
        host_s = c.train_host_s_per_micro_batch if train else c.ref_host_s_per_micro_batch
        fixed = comm_s + passes * m.num_layers * c.layer_latency_s + host_s + self._offload_copy_s(train)
        eff = c.gemm_eff * tokens / (tokens + c.gemm_half_tokens)
        return _Work(tuple(kernels), fixed / tokens, 1.0, eff)

    def _micro_batch_tokens(self, mem_frac: float, *, train: bool) -> float | None:
        """Micro-batch that fits beside the sharded state; None below the smallest useful one."""
        m, c = self.model, self.cfg
        state = m.params * c.state_bytes_per_param(train=train) / c.fsdp_degree
        gathered = 2 * m.weight_bytes / m.num_layers  # current + prefetched layer, unsharded
        budget = mem_frac * self.device.mem_bytes - state - gathered - c.train_reserve_bytes
        if train and c.offload == "optimizer" and budget + gathered < m.params * 8.0 / c.fsdp_degree:
            return None  # the update copies m, v back in beside the state (no layer gathered then)
        # 34·hidden bytes per token: one layer's live activations with flash attention
        # (Korthikanti et al. 2022), plus FP32 logits (and their gradient when training).
        act_per_token = m.hidden_size * 34 + m.vocab * 4 * (2 if train else 1)
        if train:
            act_per_token += m.num_layers * m.hidden_size * 2  # checkpointed layer inputs
        tokens = min(c.train_micro_batch_tokens if train else c.ref_micro_batch_tokens, budget / act_per_token)
        return tokens if tokens >= c.train_min_micro_batch_tokens else None

    def fsdp_micro_batch_s(self, micro_tokens: float, *, train: bool, seq_tokens: float | None = None) -> float:
        """Exclusive seconds of one micro-batch of `micro_tokens` on one FSDP rank (no optimizer);
        `seq_tokens`: its sequences' ΣL²/ΣL (default `train_seq_tokens`)."""
        tokens = max(1.0, micro_tokens)
        work = self._fsdp(self.cfg_top_mem, train=train, micro_tokens=tokens, optimizer=False, seq_tokens=seq_tokens)
        return self.parts(work, 1.0).total_s * tokens

    def optimizer_step_s(self) -> float:
        """Exclusive seconds of one Adam update of a rank's parameter shard."""
        m, c = self.model, self.cfg
        shard = m.params / c.fsdp_degree
        if c.offload == "full":
            return shard / CPU_ADAM_PARAMS_PER_S
        on_device = shard * c.optimizer_bytes_per_param / (self.device.mem_bw_bytes_per_s * c.bw_eff)
        if c.offload == "optimizer":  # m, v (FP32) copied in and back out around the update
            on_device += 2 * 8.0 * shard / PCIE_BW_BYTES_PER_S[self.device.sku]
        return on_device

    def _offload_copy_s(self, train: bool) -> float:
        """Host copies per micro-batch under full offload: the FP32 shard in for each gather
        (forward, and backward when training) and the gradient shard out."""
        if self.cfg.offload != "full":
            return 0.0
        copies = 3.0 if train else 1.0
        return copies * 4.0 * self.model.params / self.cfg.fsdp_degree / PCIE_BW_BYTES_PER_S[self.device.sku]

    cfg_top_mem = 0.8

    def _activation_bytes(self, tokens: int) -> float:
        m = self.model
        return tokens * m.num_layers * self.cfg.elementwise_passes * (m.hidden_size + m.mlp_width) * 2

    def parts(self, work: _Work, sm_frac: float) -> _Parts:
        """Time of one unit of `work` on an SM share, split by what bounds it."""
        d, c = self.device, self.cfg
        eff_sm = min(1.0, sm_frac / work.sm_demand_frac)
        flops_rate = eff_sm * d.peak_flops * work.gemm_eff
        compute = memory = bw_s = 0.0
        for k in work.kernels:
            bw_frac = min(1.0, eff_sm / k.sat_sm_frac)
            t_compute, t_memory = k.flops / flops_rate, k.bytes / (bw_frac * d.mem_bw_bytes_per_s * c.bw_eff)
            if t_compute >= t_memory:
                compute += t_compute
            else:
                memory += t_memory
                bw_s += t_memory * bw_frac
        return _Parts(compute, memory, work.fixed_s, bw_s)


class Side(NamedTuple):
    """One side of a co-located pair: its own roofline (model, config) and one unit of its work."""

    roof: Roofline
    work: _Work

    def parts(self, sm_frac: float) -> _Parts:
        return self.roof.parts(self.work, sm_frac)


def partitioned(a: Side, b: Side, sm_a: float) -> tuple[float, float]:
    """Seconds per unit of A and B in green-context partitions sm_a / 1-sm_a of one device."""
    _same_device(a, b)
    pa, pb = a.parts(sm_a), b.parts(1.0 - sm_a)
    # Bandwidth is not partitioned: oversubscription stretches both memory-bound parts.
    stretch = max(1.0, _bw_demand(pa) + _bw_demand(pb))
    return tuple((p.compute_s + p.memory_s * stretch) * (1.0 + side.roof.cfg.partition_interference) + p.fixed_s
                 for p, side in ((pa, a), (pb, b)))


def shared(a: Side, b: Side) -> tuple[float, float]:
    """Seconds per unit of A and B sharing every SM of one device (MPS-style, no partition)."""
    _same_device(a, b)
    pa, pb = a.parts(1.0), b.parts(1.0)
    # Memory-bound kernels occupy SMs too, so both kinds of busy time are time-shared;
    # a kind that cannot fill the device (demand o < 1) leaves room beside it.
    busy = sum((p.compute_s + p.memory_s) / p.total_s * side.work.sm_demand_frac for p, side in ((pa, a), (pb, b)))
    bw = _bw_demand(pa) + _bw_demand(pb)
    out = []
    for p, side in ((pa, a), (pb, b)):
        sm_stretch = max(1.0, busy) * (1.0 + side.roof.cfg.shared_interference)
        out.append(p.compute_s * sm_stretch + p.memory_s * max(sm_stretch, bw) + p.fixed_s)
    return out[0], out[1]


def _same_device(a: Side, b: Side) -> None:
    if a.roof.device != b.roof.device:
        raise ValueError(f"a pair shares one device; got {a.roof.device.sku} and {b.roof.device.sku}")


def _bw_demand(p: _Parts) -> float:
    """Average fraction of device bandwidth drawn: memory-bound share of time x draw while bound."""
    return p.bw_s / p.total_s

