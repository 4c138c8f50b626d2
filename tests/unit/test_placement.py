"""Placement: the shapes pipelines are placed by, the `split` baseline, and how the simulator
chooses jigsaw's shape (a short trial of each on samples of its own)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from jigsaw.graph import placement as pl
from jigsaw.graph.baselines import Split
from jigsaw.graph.policies import make
from jigsaw.sim import placement as choose_mod
from jigsaw.sim import run
from jigsaw.sim.node import Infeasible
from jigsaw.sim.run import SimConfig, build, lower_bound, simulate

pytestmark = pytest.mark.timeout(300)

# Qwen3-4B on 8 A100: FSDP over 8 GPUs is no faster than over 4, so two pipelines on halves of
# their own beat sharing all 8 (the simulator's cost model; bench/paper_scale.py's first row).
APART = SimConfig(workload=("qwen3-4b-gsm8k-a100",) * 2, gpus=8, steps=3, trace=False)


def test_every_shape_places_k_pipelines_on_its_devices_or_says_why():
    assert pl.split(3, 8) == [((0, 1, 2),) * 2, ((3, 4, 5),) * 2, ((6, 7),) * 2]
    assert pl.paired(3, 4) == [((0, 1),) * 2, ((0, 1),) * 2, ((2, 3),) * 2]
    assert pl.disaggregated(2, 8) == [((0, 1, 2, 3), (4, 5, 6, 7))] * 2
    assert pl.shared_pool(2, 8) == [((0, 1), (4, 5, 6, 7)), ((2, 3), (4, 5, 6, 7))]
    assert pl.crossed(3, 4) == [((0, 1), (2, 3)), ((2, 3), (0, 1)), ((0, 1), (2, 3))]
    assert pl.crossed(2, 1) == [((0,), (0,))] * 2
    with pytest.raises(ValueError, match="3 pipelines need 3 devices"):
        pl.split(3, 2)
    with pytest.raises(ValueError, match="unknown placement 'ring'"):
        pl.shape("ring")


def test_distinct_shapes_drop_a_placement_an_earlier_shape_already_gave():
    got = pl.distinct(tuple(pl.SHAPES), 2, 8)
    assert "paired" not in got  # two pipelines paired on one group of all 8 is colocated
    assert list(got) == ["colocated", "split", "disaggregated", "shared-pool", "crossed"]
    assert pl.distinct(("colocated", "split"), 3, 2)["split"] == "3 pipelines need 3 devices (one group each), " \
                                                                  "the node has 2"


def test_the_split_baseline_runs_each_pipeline_alone_on_its_own_devices():
    res = simulate(replace(APART, policy="split", trace=True))
    assert not res.violations
    devices = {p.name: set() for p in res.pipelines}
    for e in res.trace.events:
        if e.event == "grant":
            devices[e.pipeline].add(e.device)
            assert e.sm_frac == 1.0  # whole devices: nothing is shared
    assert sorted(map(sorted, devices.values())) == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_live_pipelines_that_share_a_device_take_it_one_at_a_time_under_split():
    from factories import NODE, chain, states, synthetic_grid

    from jigsaw.graph.substage import SubStageKind as K
    from jigsaw.sim.execute import execute

    a = chain("A", [("train", K.TRAINING, 4.0, 10)])
    b = chain("B", [("train", K.TRAINING, 3.0, 10)])
    ex = execute(states(a, b), NODE, synthetic_grid(), policy=Split())
    on = sorted((iv.start_s, iv.end_s, iv.pipeline) for iv in ex.intervals if iv.device is not None)
    assert [p for *_, p in on] == ["A", "B"] and on[1][0] == pytest.approx(on[0][1])  # back to back, alone
    assert ex.makespan_s == pytest.approx(7.0)


def test_jigsaw_is_placed_by_a_trial_on_samples_the_run_never_draws(monkeypatch):
    seen = []
    real = run.simulate

    def spy(config, until_s=None, **kw):
        seen.append((config.seed, config.steps, config.placement, config.trace, config.sched.window))
        return real(config, until_s, **kw)

    monkeypatch.setattr(run, "simulate", spy)  # simulate() hands itself to the trials (sim/placement.py)
    res = real(replace(APART, policy="jigsaw", seed=3))
    trials = {t.shape: t for t in res.placement.trials}
    assert set(trials) == {"colocated", "split", "disaggregated", "shared-pool"}
    assert seen and all(seed == choose_mod.TRIAL_SEED + 3 and steps == 3 and not trace
                        for seed, steps, _, trace, _ in seen)
    assert sorted(shape for *_, shape, _, _ in seen) == sorted(trials)
    # on split, which shares no device, no other window is tried (sim/placement.py `_window`)
    assert {w for *_, w in seen} == {APART.sched.window} and res.placement.window_trials == ()
    # the shortest trial wins here by far more than the least gain: split; the shapes tried
    # after it were stopped once they passed it
    ran = {s: t.makespan_s for s, t in trials.items() if t.makespan_s is not None}
    assert res.placement.shape == min(ran, key=ran.get) == "split"
    assert res.config.placement == "split"
    assert all(trials[s].cut_s == pytest.approx(ran["split"] * 1.02) for s in ("disaggregated", "shared-pool"))


def test_the_run_is_simulated_on_the_shape_chosen():
    res = simulate(replace(APART, policy="jigsaw", trace=True))
    runs, *_ = build(res.config)
    assert [(r.rollout_devices, r.train_devices) for r in runs] == pl.split(2, 8)
    used = {(e.pipeline, e.device) for e in res.trace.events if e.event == "grant"}
    assert {d for p, d in used if p == runs[0].name} == {0, 1, 2, 3}
    assert {d for p, d in used if p == runs[1].name} == {4, 5, 6, 7}
    # and jigsaw on the shape it would choose is not slower than the split baseline there
    assert res.makespan_s <= simulate(replace(APART, policy="split")).makespan_s * (1 + 1e-9)


def test_a_trial_that_can_no_longer_win_is_stopped_and_the_choice_is_the_same():
    got = simulate(replace(APART, policy="jigsaw"))
    full = {}
    for shape in ("colocated", "split", "disaggregated", "shared-pool"):
        full[shape] = simulate(replace(APART, policy="jigsaw", placement=shape, steps=3,
                                       seed=choose_mod.TRIAL_SEED + APART.seed)).makespan_s
    assert got.placement.shape == min(full, key=full.get)
    for t in got.placement.trials:
        if t.cut_s is not None:  # stopped only where the whole trial would have lost
            assert full[t.shape] > t.cut_s
        else:
            assert t.makespan_s == full[t.shape]


def test_sharing_must_beat_the_unshared_split_by_the_least_gain():
    t = choose_mod.Trial
    close = [t(shape="colocated", makespan_s=99.0), t(shape="split", makespan_s=100.0)]
    assert choose_mod._fastest(close, 0.02) == "split"  # 1% is within the model's error
    assert choose_mod._fastest(close, 0.0) == "colocated"
    clear = [t(shape="colocated", makespan_s=90.0), t(shape="split", makespan_s=100.0)]
    assert choose_mod._fastest(clear, 0.02) == "colocated"
    no_split = [t(shape="colocated", makespan_s=99.0), t(shape="paired", makespan_s=100.0)]
    assert choose_mod._fastest(no_split, 0.02) == "colocated"


def test_a_configured_shape_is_used_and_one_jigsaw_cannot_run_is_refused():
    res = simulate(replace(APART, policy="jigsaw", placement="colocated", steps=1))
    assert res.placement is None and res.config.placement == "colocated"
    with pytest.raises(Infeasible, match="jigsaw runs on colocated, paired, split, disaggregated, shared-pool, "
                                         "crossed, not on placement 'ring'"):
        simulate(replace(APART, policy="jigsaw", placement="ring", steps=1))
    # a baseline keeps its own placement whatever is configured
    assert simulate(replace(APART, policy="rollmux", placement="split", steps=1)).placement is None


def test_no_shape_that_holds_the_pipelines_is_infeasible_with_every_reason():
    # two Qwen3-32B trainings on 2 scheduling devices: only colocated holds them; on one, none
    tight = SimConfig(workload=("qwen3-32b-math",) * 2, gpus=4, steps=1, trace=False, policy="jigsaw")
    with pytest.raises(Infeasible, match=r"no placement holds these pipelines: colocated: .*; split: "):
        simulate(tight)


def test_the_lower_bound_counts_a_pipeline_alone_on_every_group_a_shape_gives_it():
    places = run._alone_placements(replace(APART, policy="serial"), 0)
    assert ((0, 1, 2, 3), (0, 1, 2, 3)) in places  # split's half, renumbered
    assert ((0, 1, 2, 3), (4, 5, 6, 7)) in places  # rollmux's pools
    assert len(places) == len(set(places))
    bound = lower_bound(APART)
    for policy in ("jigsaw", "split", "rollmux"):
        assert simulate(replace(APART, policy=policy)).makespan_s >= bound.makespan_s * (1 - 1e-9)


def test_greedy_chooses_its_shape_too():
    assert getattr(make("greedy"), "shapes", ()) == tuple(pl.SHAPES)
    assert simulate(replace(APART, policy="greedy", steps=2)).placement is not None


def test_a_close_sharing_choice_is_tried_again_and_kept_only_if_both_trials_say_so():
    t = choose_mod.Trial
    ran = [t(shape="colocated", makespan_s=97.0), t(shape="split", makespan_s=100.0)]  # 3% ahead
    assert choose_mod._close(ran, "colocated", 0.05) and not choose_mod._close(ran, "colocated", 0.02)
    assert not choose_mod._close(ran, "split", 0.05)  # split shares nothing to mispredict
    assert not choose_mod._close([t(shape="colocated", makespan_s=90.0), t(shape="split", makespan_s=100.0)],
                                 "colocated", 0.05)  # 10% ahead: one trial is enough
    turned = (t(shape="colocated", makespan_s=104.0), t(shape="split", makespan_s=100.0))
    assert choose_mod._fastest(choose_mod._summed(ran, turned), 0.02) == "split"
    agrees = (t(shape="colocated", makespan_s=96.0), t(shape="split", makespan_s=100.0))
    assert choose_mod._fastest(choose_mod._summed(ran, agrees), 0.02) == "colocated"
    # both trials count: 4% then 0.5% ahead is 2.3% ahead together (the second alone would say split)
    ahead = [t(shape="colocated", makespan_s=96.0), t(shape="split", makespan_s=100.0)]
    barely = (t(shape="colocated", makespan_s=99.5), t(shape="split", makespan_s=100.0))
    assert choose_mod._fastest(choose_mod._summed(ahead, barely), 0.02) == "colocated"


def test_sharing_ahead_by_one_trials_noise_is_tried_on_other_samples_before_it_is_kept(monkeypatch):
    # DeepSeek-R1-Distill-14B MATH ×2 on 8 A100: on the trial seed sharing is 4.4% ahead of
    # split, inside the 5% a second trial is asked for; on the second seed's samples it is
    # 2.8% ahead, and over both 3.6%: kept.  (The turn-around case, where the second trial
    # sends it to split, is test_a_close_sharing_choice_is_tried_again_and_kept_only_if_both_trials_say_so.)
    seen = []
    real = run.simulate

    def spy(config, until_s=None, **kw):
        seen.append((config.seed, config.placement))
        return real(config, until_s, **kw)

    monkeypatch.setattr(run, "simulate", spy)
    cfg = SimConfig(workload=("deepseek-r1-distill-qwen-14b-math",) * 2, steps=8, trace=False)
    res = real(replace(cfg, policy="jigsaw"))
    first = {t.shape: t.makespan_s for t in res.placement.trials}
    assert first["colocated"] * 1.02 <= first["split"] < first["colocated"] * 1.05  # close, past the least gain
    assert sorted(s for s in seen if s[0] == choose_mod.CONFIRM_SEED) == [
        (choose_mod.CONFIRM_SEED, "colocated"), (choose_mod.CONFIRM_SEED, "split")]
    again = {t.shape: t.makespan_s for t in res.placement.confirm}
    shared, apart = first["colocated"] + again["colocated"], first["split"] + again["split"]
    kept = "colocated" if shared * 1.02 <= apart else "split"
    assert res.placement.shape == kept == "colocated" and "again on other samples" in res.placement.summary()
    assert res.makespan_s == real(replace(cfg, policy="jigsaw", placement=kept)).makespan_s


def test_jigsaw_runs_the_window_whose_trial_on_the_kept_shape_beats_its_own_by_the_least_gain(monkeypatch):
    # Search-R1 beside Llama-3.1-8B, 3 steps: on the trial samples W = 1 ends 2.3% before the
    # default W = 2 (46.7 s, 47.8 s), W = 3 no sooner than W = 1 (the 32B SWE-agent pair of
    # bench/shipped_pairs.py is the same at 8 steps, 2-5% on three seeds, too slow for a test).
    seen = []
    real = run.simulate

    def spy(config, until_s=None, **kw):
        seen.append((config.seed, config.placement, config.sched.window, until_s))
        return real(config, until_s, **kw)

    monkeypatch.setattr(run, "simulate", spy)
    cfg = SimConfig(workload=("qwen3-4b-search-r1", "llama-3.1-8b-instruct-gsm8k"), steps=3, trace=False,
                    policy="jigsaw", trial_windows=(1, 3))
    res = real(cfg)
    choice = res.placement
    kept = next(t.makespan_s for t in choice.trials if t.shape == choice.shape)
    tried = dict(choice.window_trials)
    assert set(tried) == {1, 3}
    assert [(seed, shape) for seed, shape, w, _ in seen if w != 2] == [(choose_mod.TRIAL_SEED, choice.shape)] * 2
    w1 = tried[1].makespan_s
    assert w1 * 1.01 <= kept  # the least gain, past it
    assert choice.window == 1 and res.config.sched.window == 1 and "window 1" in choice.summary()
    # W = 3 was stopped once it could no longer beat W = 1 by the least gain; run whole, it does not
    assert tried[3].cut_s == pytest.approx(w1 / 1.01)
    full3 = real(replace(cfg, placement=choice.shape, steps=3, seed=choose_mod.TRIAL_SEED,
                         sched=replace(cfg.sched, window=3))).makespan_s
    assert full3 > tried[3].cut_s
    # the run is W = 1 on that shape: greedy's run there, to the event
    greedy = real(replace(cfg, policy="greedy", placement=choice.shape))
    assert res.makespan_s == greedy.makespan_s
    # a gain below the least one keeps the scheduler's window
    strict = real(replace(cfg, trial_window_min_gain_frac=0.05))
    assert strict.placement.window is None and strict.config.sched.window == 2


def test_no_window_trial_for_greedy_or_without_other_windows(monkeypatch):
    windows = []
    real = run.simulate

    def spy(config, until_s=None, **kw):
        windows.append(config.sched.window)
        return real(config, until_s, **kw)

    monkeypatch.setattr(run, "simulate", spy)
    # placed on a shape that shares devices (APART is placed split, where no window is tried)
    shared = SimConfig(workload=("qwen3-4b-search-r1", "llama-3.1-8b-instruct-gsm8k"), steps=2, trace=False)
    greedy = real(replace(shared, policy="greedy")).placement
    assert greedy.shape != "split" and greedy.window_trials == ()
    jigsaw = real(replace(shared, policy="jigsaw", trial_windows=(2,))).placement
    assert jigsaw.shape != "split" and jigsaw.window_trials == ()
    assert set(windows) == {2}  # greedy's trials are W = 1 by its policy, not by its config


@pytest.mark.parametrize("field, value", [("placement_trial_steps", 0), ("placement_min_gain_frac", -0.01),
                                          ("placement_confirm_frac", 1.0), ("trial_window_min_gain_frac", 1.0),
                                          ("trial_windows", (0,))])
def test_placement_trial_settings_out_of_range_are_refused_with_the_flag_named(field, value):
    with pytest.raises(ValueError, match=f"--{field.replace('_', '-')}"):
        replace(APART, **{field: value})
