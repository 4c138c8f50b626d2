"""Sub-stage merging (long-tail migration, paper §4.3) and multiplexing-aware balancing.

    low-utilisation rollout tails k_1..k_n on DP workers 1..n, each beside a partner k'_i
        │  TailWorker per worker (remaining time, steps, context tokens, slowdowns)
        ▼
    merge_decision(workers, target t)      ΔT = T_origin − T_migr     (DESIGN §2.6)
    best_merge(workers)                    target with the largest ΔT > 0 whose merged
        │                                  tail ends no later than the tails would, or None
    balance(total, slowdowns)              per-worker work so that s_i·T(bs_i) is equal (§2.7)
        → routing weights (rollout), micro-batch sizes (reference, training)

    T_origin = max_i s(k_i,k'_i)·T(k_i) + max_i s(k'_i,k_i)·T(k'_i)
    T_migr   = s(K,k'_t)·T(K) + Σ_{i≠t} M(k_i) + max( s(k'_t,K)·T(k'_t), max_{i≠t} T(k'_i) )

Two departures from the paper's formula, both measured (bench/paper_scale.py, issue 10's
note).  K still runs beside k'_t, so T(K) carries the slowdown the tails carry in
T_origin, s(K,k'_t) ≈ the target tail's present one (the paper leaves T(K) exclusive,
which prices every co-located merge as a gain).  And a merge must not end its pipeline's
rollout later: s·T(K) + ΣM ≤ max_i s_i·T(k_i).  ΔT sums tail and partner time, so a
partner's relief can outweigh a longer tail; but the tail is the pipeline's critical
path to its barrier, and successive merges onto one worker each pass the ΔT test while
together they stretch it (Qwen3-4B GSM8K on 16 A100: rollouts 2.5 s longer, −14% tokens/s).

T(K), the aggregated tail on the target, assumes tail decode is memory-bound on
weight reads, so a forward step costs about the same for any batch below the tail
bucket edge (paper Fig. 7: small-batch rollout is insensitive); a per-request term
can be added with `MergeConfig.step_time_per_request_s`.  When the pipeline's own
decode steps are known, `DecodeFit` (step = a + b·KV tokens, least squares over its
rollout sub-stages) prices the KV reads the merged batch adds: for small models with
long contexts they, not the weights, set the step time.  M is the KV-cache
recompute: FLOPs of the migrated context over the prefill MFU times peak FLOP/s.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, kw_only=True, slots=True)
class MergeConfig:
    """When and how long-tail rollout requests are migrated between DP workers."""

    prefill_mfu_frac: float = 0.4
    """MFU of prefill used to cost the KV recompute when the pipeline's own prefill
    sub-stages report no FLOPs; measured MFU replaces it when available."""
    max_merged_batch: int = 128
    """Largest aggregated batch that still counts as a tail (the lowest bucket edge):
    beyond it the target leaves the memory-bound regime and T(K) would grow."""
    step_time_per_request_s: float = 0.0
    """Extra seconds per request per decode step of the aggregated tail (0: step
    latency independent of batch inside the tail bucket)."""
    min_gain_frac: float = 0.0
    """Migrate only if ΔT is at least this share of T_origin: predicted tails are
    uncertain, and an aborted request's recompute is certain."""
    max_stretch_frac: float = 0.0
    """How much later than the tails would have, as a share of their time, the merged
    tail may end (the paper accepts "a very small latency increase"; successive merges
    onto one worker each stretch it again)."""

    def __post_init__(self) -> None:
        if not 0.0 < self.prefill_mfu_frac <= 1.0:
            raise ValueError(f"prefill_mfu_frac must be in (0, 1], got {self.prefill_mfu_frac}")
        if self.max_merged_batch < 1 or self.step_time_per_request_s < 0 or self.max_stretch_frac < 0:
            raise ValueError("max_merged_batch must be >= 1, step_time_per_request_s and max_stretch_frac >= 0")


@dataclass(frozen=True, kw_only=True, slots=True)
class TailWorker:
    """A low-utilisation rollout sub-stage k_i on one DP worker and what runs beside it."""

    dp_rank: int
    """Worker index."""
    remaining_s: float
    """T(k_i): exclusive time left of the tail."""
    num_steps: int
    """Decode steps left (set by the longest request on the worker)."""
    batch_size: float
    """Active requests."""
    context_tokens: int
    """Prompt + generated tokens of those requests: what a target must recompute."""
    slowdown: float = 1.0
    """s(k_i, k'_i) under the current split (1 if alone)."""
    partner_remaining_s: float = 0.0
    """T(k'_i): exclusive time left of the partner (0 if none)."""
    partner_slowdown: float = 1.0
    """s(k'_i, k_i): the partner's slowdown beside the tail (1 if none)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MergeDecision:
    """Outcome of the ΔT test for one target."""

    target_rank: int
    """Worker that receives the migrated requests."""
    source_ranks: tuple[int, ...]
    """Workers whose requests are aborted and resubmitted on the target."""
    t_origin_s: float
    """Predicted time without migration."""
    t_migr_s: float
    """Predicted time with migration."""
    aggregated_s: float
    """T(K) plus the recompute cost: the target's new exclusive remaining time."""
    tails_s: float = 0.0
    """When the tails end without migration: max_i s_i·T(k_i)."""
    merged_s: float = 0.0
    """When the merged tail ends: s(K,k'_t)·T(K) plus the recompute."""

    @property
    def delta_s(self) -> float:
        return self.t_origin_s - self.t_migr_s

    @property
    def lengthens_rollout(self) -> bool:
        """The merged tail ends after the tails would have: the pipeline waits longer."""
        return self.merged_s > self.tails_s + 1e-9


@dataclass(frozen=True, kw_only=True, slots=True)
class DecodeFit:
    """Decode step latency of one pipeline's engine: base_s + per_kv_token_s · KV tokens."""

    base_s: float
    """Seconds per step that do not depend on the batch (weight reads, launches)."""
    per_kv_token_s: float
    """Seconds per step per token of KV cache read (attention over the batch's context)."""

    @classmethod
    def fit(cls, points: Sequence[tuple[float, float]]) -> DecodeFit | None:
        """Least squares over (KV tokens, seconds per step) points, both terms kept ≥ 0;
        None with fewer than two distinct KV sizes."""
        if len({round(x) for x, _ in points}) < 2:
            return None
        x = np.array([p[0] for p in points], dtype=float)
        y = np.array([p[1] for p in points], dtype=float)
        slope = float(np.cov(x, y, bias=True)[0, 1] / np.var(x))
        slope = max(slope, 0.0)
        base = float(y.mean() - slope * x.mean())
        if base < 0.0:  # all of it is KV-bound: a line through the origin
            base, slope = 0.0, float((x @ y) / (x @ x))
        return cls(base_s=base, per_kv_token_s=slope)


def steps_in(remaining_s: float, batch_size: float, context_tokens: float, decode: DecodeFit) -> float:
    """Decode steps a worker runs in `remaining_s` at the fit's pace, its KV cache
    (`context_tokens` now) growing by `batch_size` tokens a step: the inverse of T(k) for
    one worker, so that T(K) of a merge and the T(k_i) it replaces share one model."""
    a = decode.per_kv_token_s * batch_size / 2
    b = decode.base_s + decode.per_kv_token_s * context_tokens
    if remaining_s <= 0.0 or b <= 0.0:
        return 0.0
    if a <= 0.0:
        return remaining_s / b
    return (-b + math.sqrt(b * b + 4 * a * remaining_s)) / (2 * a)


def migration_cost_s(context_tokens: int, flops_per_token: float, peak_flops: float,
                     prefill_mfu_frac: float) -> float:
    """M(k): seconds to recompute the KV cache of `context_tokens` on the target."""
    return context_tokens * flops_per_token / (prefill_mfu_frac * peak_flops)


def aggregated_time_s(workers: Sequence[TailWorker], config: MergeConfig = MergeConfig(),
                      decode: DecodeFit | None = None) -> float:
    """T(K): the merged tail runs as long as its longest request; each step costs the
    slowest worker's step latency plus the per-request term for the added requests.
    With a decode fit, a step costs its base plus the KV reads of every worker's requests
    (their context growing as they decode) for the steps they still run."""
    if decode is not None:  # each request's context grows by one token a step: n/2 on average
        steps = max(w.num_steps for w in workers)
        kv_steps = sum(w.num_steps * (w.context_tokens + w.batch_size * w.num_steps / 2) for w in workers)
        # never sooner than its longest member alone: the same steps, none of them faster
        # (the fit can price a step below the pace a worker's remaining time reports)
        return max(steps * decode.base_s + decode.per_kv_token_s * kv_steps, max(w.remaining_s for w in workers))
    step_s = max(w.remaining_s / w.num_steps for w in workers if w.num_steps > 0)
    steps = max(w.num_steps for w in workers)
    merged_req_steps = sum(w.batch_size * w.num_steps for w in workers)
    largest = max(workers, key=lambda w: w.remaining_s)
    extra = merged_req_steps - largest.batch_size * largest.num_steps
    return steps * step_s + config.step_time_per_request_s * extra


def _origin(workers: Sequence[TailWorker]) -> tuple[float, float]:
    """(when the tails end, T_origin) without migration."""
    tails_s = max(w.slowdown * w.remaining_s for w in workers)
    return tails_s, tails_s + max(w.partner_slowdown * w.partner_remaining_s for w in workers)


def merge_decision(workers: Sequence[TailWorker], target_rank: int, *, flops_per_token: float,
                   peak_flops: float, partner_slowdown_beside_merged: float | None = None,
                   config: MergeConfig = MergeConfig(), decode: DecodeFit | None = None) -> MergeDecision:
    """ΔT of migrating every tail in `workers` onto `target_rank` (DESIGN §2.6).

    `partner_slowdown_beside_merged` is s(k'_t, K); by default the target partner's
    current slowdown beside its own tail (K is a tail of the same kind)."""
    if len(workers) < 2:
        raise ValueError("merging needs tails on at least two workers")
    by_rank = {w.dp_rank: w for w in workers}
    if target_rank not in by_rank:
        raise ValueError(f"target rank {target_rank} has no tail among {sorted(by_rank)}")
    tgt = by_rank[target_rank]
    others = [w for w in workers if w.dp_rank != target_rank]
    tails_s, t_origin = _origin(workers)
    recompute = sum(migration_cost_s(w.context_tokens, flops_per_token, peak_flops, config.prefill_mfu_frac)
                    for w in others)
    t_k = aggregated_time_s(workers, config, decode)
    s_pt = tgt.partner_slowdown if partner_slowdown_beside_merged is None else partner_slowdown_beside_merged
    merged_s = tgt.slowdown * t_k + recompute
    t_migr = merged_s + max(s_pt * tgt.partner_remaining_s, max(w.partner_remaining_s for w in others))
    return MergeDecision(target_rank=target_rank, source_ranks=tuple(w.dp_rank for w in others),
                         t_origin_s=t_origin, t_migr_s=t_migr, aggregated_s=t_k + recompute,
                         tails_s=tails_s, merged_s=merged_s)


def best_merge(workers: Sequence[TailWorker], *, flops_per_token: float, peak_flops: float,
               config: MergeConfig = MergeConfig(), decode: DecodeFit | None = None) -> MergeDecision | None:
    """The target with the largest positive ΔT among those whose merged tail does not
    lengthen the rollout, or None when there is none or the merged batch would leave the
    tail regime.

    Same formula as `merge_decision`, evaluated for every target in O(n): T_origin and
    T(K) do not depend on the target, the recompute sum is the total minus the target's."""
    if len(workers) < 2 or sum(w.batch_size for w in workers) > config.max_merged_batch:
        return None
    tails_s, t_origin = _origin(workers)
    t_k = aggregated_time_s(workers, config, decode)
    costs = [migration_cost_s(w.context_tokens, flops_per_token, peak_flops, config.prefill_mfu_frac)
             for w in workers]
    total = sum(costs)
    partners = sorted((w.partner_remaining_s for w in workers), reverse=True)
    best = None
    for w, m in zip(workers, costs):
        merged_s = w.slowdown * t_k + total - m
        if merged_s > tails_s * (1.0 + config.max_stretch_frac) + 1e-9:
            continue
        others_max = partners[1] if w.partner_remaining_s == partners[0] else partners[0]
        t_migr = merged_s + max(w.partner_slowdown * w.partner_remaining_s, others_max)
        key = (t_origin - t_migr, -w.dp_rank)
        if best is None or key > best[0]:
            best = (key, w, t_migr, total - m, merged_s)
    if best is None:
        return None
    (delta, _), tgt, t_migr, recompute, merged_s = best
    if delta <= max(0.0, config.min_gain_frac * t_origin):
        return None
    return MergeDecision(target_rank=tgt.dp_rank, source_ranks=tuple(w.dp_rank for w in workers if w is not tgt),
                         t_origin_s=t_origin, t_migr_s=t_migr, aggregated_s=t_k + recompute,
                         tails_s=tails_s, merged_s=merged_s)


@dataclass(frozen=True, kw_only=True, slots=True)
class Balance:
    """Per-worker share of a stage's work under multiplexing (DESIGN §2.7)."""

    weights: tuple[float, ...]
    """Continuous shares summing to 1: rollout routing weights."""
    batch_sizes: tuple[int, ...]
    """Integer sizes summing to the total: per-worker (micro-)batch sizes."""
    predicted_s: tuple[float, ...]
    """s_i · T(bs_i) per worker with the integer sizes."""


def balance(total: int, slowdowns: Sequence[float],
            time_fn: Callable[[float], float] | None = None) -> Balance:
    """Split `total` samples so that every worker finishes together: s_i·T(bs_i) equal.

    `time_fn(bs)` is the exclusive time of a batch (monotone increasing); linear
    by default, in which case bs_i ∝ 1/s_i.  Integers by largest remainder."""
    s = np.asarray(slowdowns, dtype=float)
    if total < 0 or s.size == 0 or np.any(~np.isfinite(s)) or np.any(s <= 0):
        raise ValueError(f"balance needs total >= 0 and finite positive slowdowns, got {total}, {slowdowns}")
    if time_fn is None:
        cont = total * (1.0 / s) / np.sum(1.0 / s)
        time_fn = float
    else:
        cont = _solve_equal_time(total, s, time_fn)
    sizes = _largest_remainder(cont, total)
    weights = tuple(float(c / total) if total else 1.0 / s.size for c in cont)
    predicted = tuple(float(si * time_fn(b)) for si, b in zip(s, sizes))
    return Balance(weights=weights, batch_sizes=sizes, predicted_s=predicted)


def _solve_equal_time(total: int, s: np.ndarray, time_fn: Callable[[float], float]) -> np.ndarray:
    from scipy.optimize import brentq  # here: config modules stay light for the CLI

    def batch_for(level: float, si: float) -> float:
        # Inverse of time_fn at level/si, on [0, total].
        if si * time_fn(total) <= level:
            return float(total)
        if si * time_fn(0.0) >= level:
            return 0.0
        return brentq(lambda b: si * time_fn(b) - level, 0.0, float(total), xtol=1e-9)

    lo, hi = 0.0, float(np.max(s) * time_fn(total))
    level = brentq(lambda lv: sum(batch_for(lv, si) for si in s) - total, lo, hi, xtol=1e-12)
    return np.array([batch_for(level, si) for si in s])


def _largest_remainder(cont: np.ndarray, total: int) -> tuple[int, ...]:
    floor = np.floor(cont).astype(int)
    short = total - int(floor.sum())
    order = np.argsort(-(cont - floor), kind="stable")
    floor[order[:short]] += 1
    return tuple(int(x) for x in floor)
