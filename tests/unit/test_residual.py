"""Live tail length: mean residual life of observed turn lengths, and the decode step fit."""

import numpy as np
import pytest

from jigsaw.graph.merge import DecodeFit, TailWorker, aggregated_time_s
from jigsaw.graph.residual import ResidualLength


def test_residual_of_one_request_is_the_conditional_mean():
    r = ResidualLength(max_tokens=8192)
    assert not r.known
    r.observe([100, 200, 300, 400])
    assert r.residual(0) == pytest.approx(250.0)
    assert r.residual(250) == pytest.approx(350.0 - 250)  # mean of {300, 400} minus 250
    assert r.residual(400) == pytest.approx((8192 - 400) / 2)  # past every observed length


def test_expected_end_of_a_batch_matches_monte_carlo():
    rng = np.random.default_rng(0)
    lengths = np.minimum(8192, np.round(rng.lognormal(6.5, 0.8, 20_000))).astype(int)
    r = ResidualLength(max_tokens=8192)
    r.observe(lengths)
    generated = [300.0, 800.0, 1500.0, 50.0]
    draws = []
    for g in generated:  # residuals of each request, sampled from the same lengths
        above = lengths[lengths > g]
        draws.append(rng.choice(above, 20_000) - g)
    mc = np.max(np.vstack(draws), axis=0).mean()
    assert r.steps_left(generated) == pytest.approx(mc, rel=0.03)
    # The batch ends after its typical request: more than any one expectation.
    assert r.steps_left(generated) > max(r.residual(g) for g in generated)


def test_only_recent_steps_count():
    r = ResidualLength(max_tokens=1000, window_steps=2)
    r.observe([10] * 5)
    r.observe([20] * 5)
    r.observe([30] * 5)
    assert r.residual(0) == pytest.approx(25.0)


def test_decode_fit_recovers_a_linear_step_model_and_refuses_a_single_point():
    a, b = 0.003, 5e-8
    points = [(kv, a + b * kv) for kv in (1_000, 20_000, 100_000, 300_000)]
    fit = DecodeFit.fit(points)
    assert fit.base_s == pytest.approx(a) and fit.per_kv_token_s == pytest.approx(b)
    assert DecodeFit.fit([(5_000, 0.004), (5_000, 0.005)]) is None
    falling = DecodeFit.fit([(1_000, 0.01), (100_000, 0.005)])
    assert falling.per_kv_token_s == 0.0 and falling.base_s == pytest.approx(0.0075)


def test_merged_tail_pays_for_the_kv_it_reads():
    # each worker's remaining time is what the fit says its own steps take
    ws = [TailWorker(dp_rank=0, remaining_s=1.42, num_steps=100, batch_size=4, context_tokens=4_000),
          TailWorker(dp_rank=1, remaining_s=0.5525, num_steps=50, batch_size=2, context_tokens=1_000)]
    fit = DecodeFit(base_s=0.01, per_kv_token_s=1e-6)
    # 100 steps × 0.01 + 1e-6 × (100·(4000 + 4·50) + 50·(1000 + 2·25))
    expected = 1.0 + 1e-6 * (100 * 4_200 + 50 * 1_050)
    assert aggregated_time_s(ws, decode=fit) == pytest.approx(expected)
    # More than the longest part alone under the same fit: the added requests' KV is read too.
    assert aggregated_time_s(ws, decode=fit) > aggregated_time_s(ws[:1], decode=fit)
