"""ΔT migration decision (DESIGN §2.6) and multiplexing-aware balancing (§2.7)."""

import pytest

from jigsaw.graph.merge import (
    DecodeFit,
    MergeConfig,
    TailWorker,
    aggregated_time_s,
    balance,
    best_merge,
    merge_decision,
    migration_cost_s,
    steps_in,
)

PEAK = 1e15
FPT = 8e9  # FLOPs per token of a 4B model (2 × params)


def workers():
    # Worker 0: tail 10 s (40 steps, 8 requests), slowed 1.1× beside training that needs 20 s (1.5×).
    # Worker 1: tail  6 s (20 steps, 4 requests), slowed 1.2× beside training that needs 20 s (1.4×).
    return [
        TailWorker(dp_rank=0, remaining_s=10.0, num_steps=40, batch_size=8, context_tokens=8 * 3000,
                   slowdown=1.1, partner_remaining_s=20.0, partner_slowdown=1.5),
        TailWorker(dp_rank=1, remaining_s=6.0, num_steps=20, batch_size=4, context_tokens=4 * 2500,
                   slowdown=1.2, partner_remaining_s=20.0, partner_slowdown=1.4),
    ]


def test_migration_cost_is_recompute_flops_over_prefill_throughput():
    assert migration_cost_s(10_000, FPT, PEAK, 0.4) == pytest.approx(10_000 * 8e9 / 4e14)


def test_delta_t_matches_hand_computation():
    d = merge_decision(workers(), 0, flops_per_token=FPT, peak_flops=PEAK, config=MergeConfig())
    # T_origin = max(1.1·10, 1.2·6) + max(1.5·20, 1.4·20) = 11 + 30 = 41
    assert d.t_origin_s == pytest.approx(41.0)
    # T(K): 40 steps at the slowest step latency max(10/40, 6/20) = 0.3 s -> 12 s
    # M(k_1) = 10_000 tokens · 8e9 / (0.4 · 1e15) = 0.2 s
    # T_migr = 1.1·12 + 0.2 + max(1.5·20, 20) = 43.4 (K runs on beside worker 0's partner)
    assert d.aggregated_s == pytest.approx(12.2)
    assert d.merged_s == pytest.approx(13.4) and d.tails_s == pytest.approx(11.0)
    assert d.t_migr_s == pytest.approx(43.4)
    assert d.delta_s == pytest.approx(-2.4)
    assert d.source_ranks == (1,) and d.lengthens_rollout


def short_tail_beside_a_fast_worker():
    # Worker 0: 10 s, 1.5× beside a partner; worker 1: 2 s (20 steps) beside a light one (1.05×).
    return [
        TailWorker(dp_rank=0, remaining_s=10.0, num_steps=100, batch_size=2, context_tokens=2 * 3000,
                   slowdown=1.5, partner_remaining_s=20.0, partner_slowdown=1.5),
        TailWorker(dp_rank=1, remaining_s=2.0, num_steps=20, batch_size=2, context_tokens=2 * 2500,
                   slowdown=1.05, partner_remaining_s=20.0, partner_slowdown=1.05),
    ]


def test_target_choice_and_positive_gain():
    # Onto worker 1: T(K) = 100 steps at 0.1 s = 10 s, beside its partner 1.05·10 = 10.5,
    # M(k_0) = 6_000·8e9/4e14 = 0.12: merged 10.62 ≤ tails 1.5·10 = 15.
    # T_migr = 10.62 + max(1.05·20, 20) = 31.62; T_origin = 15 + 1.5·20 = 45.
    d = merge_decision(short_tail_beside_a_fast_worker(), 1, flops_per_token=FPT, peak_flops=PEAK)
    assert d.merged_s == pytest.approx(10.62) and not d.lengthens_rollout
    assert d.delta_s == pytest.approx(45.0 - 31.62)
    best = best_merge(short_tail_beside_a_fast_worker(), flops_per_token=FPT, peak_flops=PEAK)
    assert best is not None and best.target_rank == 1 and best.source_ranks == (0,)


def test_a_merge_that_would_end_the_rollout_later_is_refused_whatever_its_gain():
    # Two 10 s tails; worker 0's partner runs 3x slower beside it.  Onto worker 1:
    # T_origin = 10 + 3·10 = 40, T_migr = 10 + 0.12 + 10 = 20.12: ΔT ≈ 20 s of partner
    # relief, but the merged tail (10.12 s, the recompute on top) ends after the tails would.
    ws = [TailWorker(dp_rank=r, remaining_s=10.0, num_steps=100, batch_size=2, context_tokens=2 * 3000,
                     slowdown=1.0, partner_remaining_s=10.0, partner_slowdown=ps) for r, ps in ((0, 3.0), (1, 1.0))]
    d = merge_decision(ws, 1, flops_per_token=FPT, peak_flops=PEAK)
    assert d.delta_s == pytest.approx(40.0 - 20.12) and d.lengthens_rollout
    assert best_merge(ws, flops_per_token=FPT, peak_flops=PEAK) is None


def test_no_merge_when_it_does_not_pay_or_leaves_the_tail():
    expensive = best_merge(workers(), flops_per_token=FPT * 100, peak_flops=PEAK)
    assert expensive is None
    assert best_merge(workers(), flops_per_token=FPT, peak_flops=PEAK, config=MergeConfig(max_merged_batch=8)) is None
    assert best_merge(workers()[:1], flops_per_token=FPT, peak_flops=PEAK) is None
    with pytest.raises(ValueError, match="no tail"):
        merge_decision(workers(), 7, flops_per_token=FPT, peak_flops=PEAK)


def test_per_request_step_cost_grows_the_merged_tail():
    cfg = MergeConfig(step_time_per_request_s=0.001)
    # worker 0 is the longest; worker 1 adds 4 requests × 20 steps.
    assert aggregated_time_s(workers(), cfg) == pytest.approx(12.0 + 0.001 * 80)


@pytest.mark.parametrize("slowdowns", [[1.0] * 8, [1.6] + [1.0] * 7, [1.3, 2.2, 1.0, 1.0, 1.1, 1.0, 1.7, 1.0]])
def test_balance_equalises_predicted_times_within_one_percent(slowdowns):
    b = balance(1024, slowdowns)
    assert sum(b.batch_sizes) == 1024
    assert max(b.predicted_s) / min(b.predicted_s) < 1.01
    assert sum(b.weights) == pytest.approx(1.0)
    # The worker under interference gets the least work.
    assert b.batch_sizes[slowdowns.index(max(slowdowns))] == min(b.batch_sizes)


def test_balance_with_a_nonlinear_time_model():
    def time_fn(bs):  # fixed launch cost plus linear work
        return 0.5 + 0.01 * bs

    b = balance(2048, [1.5, 1.0, 1.0, 1.2], time_fn)
    assert sum(b.batch_sizes) == 2048
    assert max(b.predicted_s) / min(b.predicted_s) < 1.01
    ratio = time_fn(b.batch_sizes[0]) / time_fn(b.batch_sizes[1])
    assert ratio == pytest.approx(1 / 1.5, rel=0.01)  # T(bs_t)/T(bs_i) ≈ 1/s


def test_balance_rejects_bad_slowdowns():
    with pytest.raises(ValueError):
        balance(10, [1.0, 0.0])
    with pytest.raises(ValueError):
        balance(10, [])


def test_best_merge_agrees_with_the_reference_formula_for_every_target():
    import random

    rng = random.Random(3)
    for _ in range(200):
        ws = [TailWorker(dp_rank=r, remaining_s=rng.uniform(0.5, 20), num_steps=rng.randint(1, 400),
                         batch_size=rng.randint(1, 20), context_tokens=rng.randint(100, 50_000),
                         slowdown=rng.uniform(1, 2), partner_remaining_s=rng.choice([0.0, rng.uniform(0, 30)]),
                         partner_slowdown=rng.uniform(1, 2)) for r in range(rng.randint(2, 6))]
        fpt = rng.choice([1e9, 8e9, 6e10])
        allowed = [d for d in (merge_decision(ws, w.dp_rank, flops_per_token=fpt, peak_flops=PEAK) for w in ws)
                   if not d.lengthens_rollout]
        ref = max(allowed, key=lambda d: (d.delta_s, -d.target_rank), default=None)
        fast = best_merge(ws, flops_per_token=fpt, peak_flops=PEAK, config=MergeConfig(max_merged_batch=10**6))
        if ref is None or ref.delta_s <= 0:
            assert fast is None
        else:
            assert fast.target_rank == ref.target_rank
            assert fast.t_migr_s == pytest.approx(ref.t_migr_s) and fast.aggregated_s == pytest.approx(ref.aggregated_s)


def test_the_merged_tail_is_priced_with_the_model_its_members_are():
    fit = DecodeFit(base_s=0.008, per_kv_token_s=1.3e-7)
    # steps_in inverts T(k) of one worker: its own remaining time comes back
    n = steps_in(3.0, 32, 32 * 150, fit)
    one = TailWorker(dp_rank=0, remaining_s=3.0, num_steps=round(n), batch_size=32, context_tokens=32 * 150,
                     slowdown=1.0, partner_remaining_s=0.0, partner_slowdown=1.0)
    assert aggregated_time_s([one], decode=fit) == pytest.approx(3.0, rel=0.01)
    # a worker whose reported pace is slower than the fit's still bounds the merged tail from below
    slow = TailWorker(dp_rank=1, remaining_s=9.0, num_steps=100, batch_size=4, context_tokens=400,
                      slowdown=1.0, partner_remaining_s=0.0, partner_slowdown=1.0)
    assert aggregated_time_s([one, slow], decode=fit) >= 9.0
