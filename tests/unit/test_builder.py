"""Records -> sub-stages: token buckets, hysteresis, chains, barriers, prediction."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from jigsaw.graph.builder import (
    BucketTracker,
    GraphBuilder,
    GraphConfig,
    bucket_of,
    build_step_graph,
    kind_of_bucket,
    predict_next,
    regime_labels,
)
from jigsaw.graph.substage import Stage, StepRecord, SubStageKind

TAIL, DECODE, PREFILL = SubStageKind.ROLLOUT_TAIL, SubStageKind.ROLLOUT_DECODE, SubStageKind.ROLLOUT_PREFILL


@pytest.mark.parametrize("tokens,bucket", [(0, 0), (127, 0), (128, 1), (1023, 1), (1024, 2), (10**6, 2)])
def test_paper_bucket_edges(tokens, bucket):
    assert bucket_of(tokens, GraphConfig().bucket_edges) == bucket


def test_bucket_kinds_follow_token_density():
    assert [kind_of_bucket(b, 3) for b in range(3)] == [TAIL, DECODE, PREFILL]
    assert [kind_of_bucket(b, 4) for b in range(4)] == [TAIL, DECODE, DECODE, PREFILL]


def test_no_transition_before_lb_stable_steps():
    tracker = BucketTracker(GraphConfig())
    assert tracker.observe(300).bucket == 1  # first step sets the regime
    for _ in range(20):
        assert tracker.observe(300) is None
    for _ in range(9):  # nine tail steps: still decode
        assert tracker.observe(5) is None
    assert tracker.current == 1
    t = tracker.observe(5)  # the tenth makes it stick, dated back to the first
    assert t is not None and t.bucket == 0 and t.kind is TAIL and t.start_index == 21


def test_interrupted_run_restarts_the_count():
    tracker = BucketTracker(GraphConfig(hysteresis_steps=3))
    tracker.observe(300)
    assert [tracker.observe(n) for n in (5, 5, 300, 5, 5)] == [None] * 5
    assert tracker.observe(5).start_index == 4


def test_fluctuations_never_split_a_substage():
    counts = [600] * 15 + [100, 2000] * 8 + [600] * 5
    assert set(regime_labels(counts)) == {1}


def test_hysteresis_and_edges_are_configurable():
    cfg = GraphConfig(bucket_edges=(16, 64), hysteresis_steps=2)
    assert regime_labels([10, 20, 20, 70, 70, 70], cfg) == [0, 1, 1, 2, 2, 2]
    with pytest.raises(ValueError, match="strictly increasing"):
        GraphConfig(bucket_edges=(128, 128))
    with pytest.raises(ValueError, match="hysteresis"):
        GraphConfig(hysteresis_steps=0)


def _rollout(rank, counts, t0=0.0, step=0, pipeline="A", dt=0.01):
    out = []
    for i, n in enumerate(counts):
        prefill = n if n >= 1024 else 0
        out.append(StepRecord(pipeline=pipeline, step=step, dp_rank=rank, t_start_s=t0 + i * dt,
                              t_end_s=t0 + (i + 1) * dt, num_prefill_tokens=prefill,
                              num_decode_reqs=0 if prefill else n, kv_tokens_used=n * 50,
                              mem_bytes=1000 + n, flops=2.0 * n))
    return out


def _stage(stage, rank, t0, t1, step=0, pipeline="A", seqs=4, tokens=400):
    return StepRecord(pipeline=pipeline, step=step, stage=stage, dp_rank=rank, t_start_s=t0, t_end_s=t1,
                      num_prefill_tokens=tokens, num_decode_reqs=seqs, mem_bytes=5000)


def _step(step=0, scale=1.0, pipeline="A"):
    recs = []
    for r in range(2):
        recs += _rollout(r, [4096] * 12 + [512] * (30 + 10 * r) + [20] * 25, step=step, pipeline=pipeline,
                         dt=0.01 * scale)
    end = max(x.t_end_s for x in recs)
    recs.append(_stage(Stage.REWARD, 0, end, end + 0.05, step, pipeline))
    for r in range(2):
        recs.append(_stage(Stage.REFERENCE, r, end + 0.1, end + 0.3, step, pipeline))
        recs.append(_stage(Stage.TRAINING, r, end + 0.3, end + 0.3 + scale, step, pipeline))
        recs.append(_stage(Stage.TRAINING, r, end + 0.3 + scale, end + 0.3 + 2 * scale, step, pipeline))
    return recs


def test_step_graph_has_rank_chains_and_barriers():
    g = build_step_graph(_step())
    r0 = [s for s in g if s.dp_rank == 0 and s.kind.is_rollout]
    assert [s.kind for s in r0] == [PREFILL, DECODE, TAIL]
    assert [s.num_steps for s in r0] == [12, 30, 25]
    assert r0[0].duration_s == pytest.approx(0.12)
    reward = next(s for s in g if s.kind is SubStageKind.REWARD)
    assert set(g.deps[reward.id]) == {s.id for s in g if s.kind is TAIL}
    refs = [s for s in g if s.kind is SubStageKind.REFERENCE]
    assert all(g.deps[s.id] == (reward.id,) for s in refs)
    train = [s for s in g if s.kind is SubStageKind.TRAINING]
    assert len(train) == 2 and all(set(g.deps[s.id]) == {x.id for x in refs} for s in train)
    assert train[0].num_steps == 2 and train[0].batch_size == 8 and train[0].seq_len == 100
    assert [len(gang) for gang in g.gangs()] == [2, 2]


def test_rollout_numbers_summarise_the_steps():
    g = build_step_graph(_step())
    decode = next(s for s in g if s.kind is DECODE and s.dp_rank == 1)
    assert decode.num_steps == 40 and decode.batch_size == 512
    assert decode.seq_len == 50 and decode.mem_bytes == 1512 and decode.num_tokens == 40 * 512
    assert decode.flops == pytest.approx(40 * 1024.0)


def test_tool_waits_cut_the_rollout_chain():
    recs = _rollout(0, [20] * 15)
    recs.append(StepRecord(pipeline="A", step=0, stage=Stage.TOOL, dp_rank=0, t_start_s=0.2, t_end_s=0.7))
    recs += _rollout(0, [20] * 5, t0=0.7)
    g = build_step_graph(recs)
    assert [s.kind for s in g] == [TAIL, SubStageKind.TOOL, TAIL]
    assert g.critical_path().length_s == pytest.approx(0.15 + 0.5 + 0.05)


def test_bad_records_are_rejected_clearly():
    with pytest.raises(ValueError, match="several pipelines"):
        build_step_graph(_rollout(0, [5], pipeline="A") + _rollout(0, [5], pipeline="B"))
    with pytest.raises(ValueError, match="before t_start_s"):
        StepRecord(pipeline="A", step=0, t_start_s=1.0, t_end_s=0.5)
    with pytest.raises(ValueError, match="pipeline name"):
        StepRecord(pipeline="a/b", step=0, t_start_s=0, t_end_s=1)
    overlap = _rollout(0, [20] * 5) + [StepRecord(pipeline="A", step=0, stage=Stage.TOOL, t_start_s=0.02,
                                                  t_end_s=0.3)]
    with pytest.raises(ValueError, match="overlaps a forward step"):
        build_step_graph(overlap)


def test_prediction_takes_the_median_of_recent_steps():
    graphs = [build_step_graph(_step(step=i, scale=s)) for i, s in enumerate([1.0, 3.0, 2.0, 9.0])]
    nxt = predict_next(graphs, GraphConfig(history_steps=3))
    assert nxt.steps == (4,)
    train = next(s for s in nxt if s.kind is SubStageKind.TRAINING and s.dp_rank == 0)
    assert train.duration_s == pytest.approx(2 * 3.0)  # median of 2·{3, 2, 9}
    assert train.id == "A/4/r0/training/0"
    assert len(nxt) == len(graphs[-1])
    assert set(nxt.deps) == {s.id for s in nxt}


def test_builder_keeps_history_per_pipeline():
    b = GraphBuilder(GraphConfig(history_steps=2))
    for i in range(4):
        b.add_step(_step(step=i, pipeline="A", scale=1 + i))
    b.add_step(_step(step=0, pipeline="B"))
    assert [g.steps for g in b.history("A")] == [(2,), (3,)]
    assert b.predict("B").steps == (1,)
    with pytest.raises(KeyError, match="no steps recorded"):
        b.predict("C")


def test_columns_and_records_build_the_same_graph():
    from jigsaw.graph.steps import StepColumns

    recs = _step()
    rollout = [r for r in recs if r.stage is Stage.ROLLOUT]
    rest = [r for r in recs if r.stage is not Stage.ROLLOUT]
    cols = [StepColumns.from_records([r for r in rollout if r.dp_rank == k]) for k in (0, 1)]
    a, b = build_step_graph(recs), build_step_graph(rest, columns=cols)
    assert [s.id for s in a] == [s.id for s in b]
    assert a.substages == b.substages and a.deps == b.deps


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([0, 5, 127, 128, 500, 1023, 1024, 5000]), min_size=1, max_size=80),
       st.integers(1, 6))
def test_vectorised_hysteresis_agrees_with_the_online_tracker(counts, lb):
    cfg = GraphConfig(hysteresis_steps=lb)
    tracker = BucketTracker(cfg)
    online: list[int] = []
    for n in counts:
        t = tracker.observe(n)
        online.append(tracker.current)
        if t is not None:
            online[t.start_index:] = [t.bucket] * (len(online) - t.start_index)
    assert regime_labels(counts, cfg) == online


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from([3, 300, 3000]), st.integers(1, 15)), min_size=1, max_size=12),
       st.integers(1, 5))
def test_bulk_observation_matches_step_by_step(runs, lb):
    cfg = GraphConfig(hysteresis_steps=lb)
    one, bulk = BucketTracker(cfg), BucketTracker(cfg)
    for tokens, count in runs:
        singles = [t for _ in range(count) if (t := one.observe(tokens)) is not None]
        got = []
        left = count
        while left:  # stop where the switch is detected, as the simulator does
            n = min(left, bulk.steps_to_switch(tokens) or left)
            if (t := bulk.observe_many(tokens, n)) is not None:
                got.append(t)
            left -= n
        assert got == singles
        assert bulk.current == one.current


def test_durations_are_exclusive_whatever_ran_beside():
    alone = [StepRecord(pipeline="A", step=0, stage=Stage.TRAINING, t_start_s=0, t_end_s=4.0, num_decode_reqs=1)]
    slowed = [StepRecord(pipeline="A", step=0, stage=Stage.TRAINING, t_start_s=0, t_end_s=8.0, num_decode_reqs=1,
                         slowdown=2.0)]
    assert build_step_graph(alone).substages[0].duration_s == pytest.approx(4.0)
    assert build_step_graph(slowed).substages[0].duration_s == pytest.approx(4.0)
    half = [StepRecord(pipeline="A", step=0, t_start_s=i * 0.02, t_end_s=(i + 1) * 0.02, num_decode_reqs=5,
                       slowdown=2.0 if i % 2 else 1.0) for i in range(20)]
    assert build_step_graph(half).substages[0].duration_s == pytest.approx(10 * 0.02 + 10 * 0.01)
