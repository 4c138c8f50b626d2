"""How one simulated pipeline is deployed on the node's scheduling devices.

    WorkloadSpec (+ per-pipeline flags) ─► Parallelism: rollout_tp, fsdp_degree, offload
        ─► PriorConfig ─► StepCost of ONE engine (tp GPUs) ─► Replicas(cost, n)
    a scheduling device is one group of `gpus_per_device` GPUs (the largest TP of the node);
    a pipeline with a smaller TP runs n = gpus_per_device / tp engines on it, which the
    simulator drives as one worker: requests spread evenly over the n engines, each with its
    own weights and KV pool, stepping in lockstep (its per-step batch and KV are 1/n of the
    worker's).  Training and reference are per GPU (FSDP ranks), unchanged.

Within one scheduling device the n engines are taken as balanced: the long tail of one
engine beside idle siblings is not modelled (DP imbalance across devices is).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from jigsaw.mux.model.costmodel import DecodeCoeffs, StepCost


@dataclass(frozen=True, kw_only=True, slots=True)
class Parallelism:
    """Parallelism of one pipeline on the node (mux.model.specs.Deployment is the (model, PriorConfig) pair)."""

    rollout_tp: int
    """GPUs per rollout engine (tensor parallelism)."""
    fsdp_degree: int
    """GPUs one training/reference shard group spans (FSDP; HSDP replicates across groups)."""
    gpus_per_device: int
    """GPUs of one scheduling device (the node's largest rollout_tp)."""
    offload: str = "none"
    """Training state offloaded to host memory: none | optimizer | full (verl's FSDP
    optimizer_offload / param_offload)."""

    def __post_init__(self) -> None:
        if min(self.rollout_tp, self.fsdp_degree, self.gpus_per_device) < 1:
            raise ValueError(f"rollout_tp, fsdp_degree and GPUs per device must be >= 1, got {self}")
        if self.gpus_per_device % self.rollout_tp:
            raise ValueError(f"rollout_tp {self.rollout_tp} does not divide a scheduling device of "
                             f"{self.gpus_per_device} GPUs (the node's largest TP); use TPs that divide each other")

    @property
    def replicas(self) -> int:
        return self.gpus_per_device // self.rollout_tp


class Replicas:
    """`n` identical engines of one pipeline on one scheduling device, driven as one worker
    (module docstring).  Same interface as StepCost, as the simulator uses it."""

    def __init__(self, cost: StepCost, n: int, gpus_per_device: int):
        self.base, self.n, self.gpus_per_device = cost, n, gpus_per_device
        self.device, self.spec, self.config = cost.device, cost.spec, cost.config
        self._decode: dict[int, DecodeCoeffs] = {}

    @property
    def flops_per_token(self) -> float:
        return self.base.flops_per_token

    def decode(self, batch: int) -> DecodeCoeffs:
        got = self._decode.get(batch)
        if got is None:
            if self.n == 1:
                got = self.base.decode(batch)
            else:  # each engine steps ceil(b/n) requests over 1/n of the KV
                co = self.base.decode(math.ceil(batch / self.n))
                got = DecodeCoeffs(c0_s=co.c0_s, c1_s_per_token=co.c1_s_per_token / self.n)
            self._decode[batch] = got
        return got

    def decode_s(self, batch: int, kv_tokens: int) -> float:
        co = self.decode(batch)
        return co.c0_s + co.c1_s_per_token * kv_tokens

    def prefill_s(self, tokens: int, context_tokens: int, requests: int = 1) -> float:
        n = self.n
        return self.base.prefill_s(math.ceil(tokens / n), context_tokens, max(1, math.ceil(requests / n)))

    def reference_s(self, tokens: float, micro_batches: int = 1) -> float:
        return self.base.reference_s(tokens, micro_batches)

    def training_s(self, tokens: float, micro_batches: int = 1, updates: int = 1) -> float:
        return self.base.training_s(tokens, micro_batches, updates)

    def weights_bytes(self) -> float:
        """Per GPU: every engine holds its own copy (or shard) of the weights."""
        return self.base.weights_bytes()

    def kv_bytes_per_token(self) -> float:
        """Per GPU, of the worker's KV: its tokens spread over the n engines' pools."""
        return self.base.kv_bytes_per_token() / self.n

    def rollout_mem_bytes(self, kv_pool_tokens: int) -> int:
        return int(self.weights_bytes() + kv_pool_tokens * self.kv_bytes_per_token()
                   + self.config.rollout_reserve_bytes)

    def fsdp_mem_bytes(self, *, train: bool) -> int:
        return self.base.fsdp_mem_bytes(train=train)
