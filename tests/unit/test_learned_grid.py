"""The grid learned online (mux/model/learned.py, node/learning.py): the rule, the bound,
the file, and the one path from a finished grant to the grid the scheduler plans with."""

import json
import math

import pytest
from factories import GIB, NODE, synthetic_grid

from jigsaw import protocol as pr
from jigsaw.graph.plan import Assignment, Plan
from jigsaw.graph.policies import make
from jigsaw.mux.model.learned import GridLearner, LearnConfig, LearnedFileError, learned_path, load_or_fresh, scaled
from jigsaw.node.inputs import Inbox
from jigsaw.node.state import NodeState
from jigsaw.sim.run import SimConfig, simulate, true_grid

pytestmark = pytest.mark.timeout(60)

PAIR = ("training", "rollout_decode", 1, 1)
"""training beside a decode at sm 0.5, memory 0.4."""


def test_an_entry_never_moves_on_fewer_samples_than_min_samples():
    grid = synthetic_grid()
    learner = GridLearner(grid, LearnConfig(min_samples=5))
    for _ in range(4):
        learner.record(PAIR, math.log(1.5))
    assert learner.value(PAIR) == learner.base_value(PAIR)
    assert learner.refined() is grid  # nothing moved: the scheduler keeps the base grid
    learner.record(PAIR, math.log(1.5))
    assert learner.value(PAIR) == pytest.approx(1.5 * learner.base_value(PAIR), rel=1e-3)
    assert learner.refined().pair("training", "rollout_decode", 0.5, 0.4)[0] == pytest.approx(
        learner.value(PAIR))


def test_evidence_at_one_memory_level_moves_its_row_but_not_another_sm_level_or_its_own_evidence():
    grid = synthetic_grid()
    learner = GridLearner(grid, LearnConfig(min_samples=5))
    for j, x in ((0, 0.4), (1, 0.4), (2, 0.4), (0, 0.4), (1, 0.4)):  # 5 samples over the row, none with 5
        learner.record(("training", "rollout_decode", 1, j), x)
    unvisited = ("training", "rollout_decode", 1, 3)
    assert learner.correction(unvisited) == pytest.approx(0.4, rel=0.05)  # the row's pooled evidence
    assert learner.refined().pair("training", "rollout_decode", 0.5, 0.8)[0] == pytest.approx(learner.value(unvisited))
    assert learner.correction(("training", "rollout_decode", 0, 3)) == 0.0  # another SM share: its own row
    for _ in range(5):
        learner.record(unvisited, -0.2)
    assert learner.correction(unvisited) == pytest.approx(-0.2, rel=0.05)  # its own 5 samples override the row
    alone = GridLearner(grid, LearnConfig(min_samples=5, pool_memory_levels=False))
    for j in (0, 1, 2, 0, 1):
        alone.record(("training", "rollout_decode", 1, j), 0.4)
    assert alone.correction(unvisited) == 0.0 and alone.refined() is grid


def test_a_few_outliers_do_not_move_an_entry():
    learner = GridLearner(synthetic_grid(), LearnConfig(min_samples=5))
    for x in (0.0, 0.0, math.log(10), 0.0, math.log(10)):
        learner.record(PAIR, x)
    assert learner.correction(PAIR) == 0.0  # the median of five: two outliers move nothing


def test_a_correction_is_clamped_and_shrunk_by_its_spread():
    learner = GridLearner(synthetic_grid(), LearnConfig(min_samples=5, max_factor=2.0))
    for _ in range(8):
        learner.record(PAIR, math.log(5.0))
    assert learner.value(PAIR) == pytest.approx(2.0 * learner.base_value(PAIR))
    noisy = ("training", "rollout_decode", 0, 1)
    for x in (0.05, 0.25, -0.15, 0.4, 0.1):
        learner.record(noisy, x)
    assert 0.0 < learner.correction(noisy) < 0.1  # median 0.1, pulled toward the prior by a 0.2 spread


def test_the_normalisation_point_never_moves_and_refined_grids_stay_valid():
    grid = synthetic_grid()
    learner = GridLearner(grid, LearnConfig(min_samples=1))
    top = ("training", None, len(grid.sm_levels) - 1, len(grid.mem_levels) - 1)
    for _ in range(3):
        learner.record(top, math.log(1.8))
        learner.record(("rollout_tail", None, 0, 0), math.log(0.1))  # below the noise floor: clamped
    refined = learner.refined()
    assert refined.alone("training", 1.0, 0.8) == 1.0
    assert refined.alone("rollout_tail", 0.25, 0.2) >= 0.5
    assert refined.kinds == grid.kinds and refined.sm_levels == grid.sm_levels


def test_a_learned_file_round_trips(tmp_path):
    grid = synthetic_grid()
    learner = GridLearner(grid)
    for x in (0.3, 0.31, 0.29, 0.3, 0.3, 0.32):
        learner.record(PAIR, x)
    path = learned_path(grid, node="n1", root=tmp_path)
    assert path == tmp_path / "learned" / "n1" / "synthetic" / "synthetic.json"
    learner.save(path)
    back = GridLearner.load(path, grid)
    assert back.report() == learner.report()
    assert back.refined() == learner.refined()
    rebased = GridLearner.load(path, scaled(grid, {("training", "rollout_decode"): 1.2}))
    assert rebased.value(PAIR) == pytest.approx(learner.value(PAIR), rel=1e-3)  # the evidence, not the offset


def test_a_malformed_learned_file_names_itself_and_the_node_starts_from_the_base(tmp_path):
    grid = synthetic_grid()
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"format": "jigsaw-learned-grid", "version": 1, "device": "synthetic",
                                "model": "synthetic", "entries": [{"kind": "training", "partner": None,
                                                                   "sm_frac": 0.3, "mem_frac": 0.4}]}))
    with pytest.raises(LearnedFileError, match="bad.json.*sm_frac 0.3"):
        GridLearner.load(path, grid)
    learner, said = load_or_fresh(path, grid)
    assert "bad.json" in said and "base grid" in said
    assert learner.refined() is grid and not path.exists() and (tmp_path / "bad.rejected.json").exists()


def _two_on_one_device(learner):
    state = NodeState(NODE, learner.base, make("jigsaw"), fallback=False, learner=learner)
    inbox = Inbox(state)
    for name, kind in (("a", "training"), ("b", "rollout_decode")):
        inbox.register(pr.Register(pipeline=name, pid=1, devices=(0,)))
        inbox.take(name, pr.Admit(session="", kind=kind, dp_rank=0, step=0, expected_s=10.0), 0.0)
    ids = {name: next(iter(state.pipeline(name).waiting)) for name in ("a", "b")}
    mem = NODE.mem_bytes
    state.apply(Plan(time_s=0.0, started=tuple(ids.values()), assignments=(
        Assignment(substage=ids["a"], pipeline="a", device=0, sm_frac=0.5, mem_bytes=int(0.4 * mem), slowdown=1.2),
        Assignment(substage=ids["b"], pipeline="b", device=0, sm_frac=0.5, mem_bytes=int(0.6 * mem),
                   slowdown=1.1))), 0.0)
    return state, inbox, ids


def test_a_finished_grant_reaches_the_learner_through_the_daemons_path():
    learner = GridLearner(synthetic_grid(), LearnConfig(min_samples=1))
    state, inbox, ids = _two_on_one_device(learner)
    base = learner.base_value(PAIR)
    inbox.take("a", pr.Done(session="", substage=ids["a"]), 10.0 * base * 1.3)  # a Done, as a worker sends it
    assert learner.observed == 1
    assert learner.value(PAIR) == pytest.approx(1.3 * base, rel=1e-2)  # one sample: shrunk a little
    assert state.grid.pair("training", "rollout_decode", 0.5, 0.4)[0] == pytest.approx(learner.value(PAIR))
    got = state.grants.history[-1]
    assert got.entry == PAIR and got.error_log == pytest.approx(math.log(10.0 * base * 1.3 / 1.2 / 10.0))


def test_a_grant_without_a_reference_is_not_evidence():
    learner = GridLearner(synthetic_grid(), LearnConfig(min_samples=1))
    state = NodeState(NODE, learner.base, make("jigsaw"), fallback=False, learner=learner)
    inbox = Inbox(state)
    inbox.register(pr.Register(pipeline="a", pid=1, devices=(0,)))
    inbox.take("a", pr.Admit(session="", kind="training", dp_rank=0, step=0, mem_bytes=GIB), 0.0)
    sid = next(iter(state.pipeline("a").waiting))
    state.apply(Plan(time_s=0.0, started=(sid,), assignments=(
        Assignment(substage=sid, pipeline="a", device=0, sm_frac=0.5, mem_bytes=int(0.4 * NODE.mem_bytes),
                   slowdown=1.5),)), 0.0)
    inbox.take("a", pr.Done(session="", substage=sid), 30.0)
    assert learner.observed == 0 and learner.skipped["no reference"] == 1


def test_a_pipelines_own_rate_alone_is_the_reference_of_its_later_grants():
    """No expected_s (jigsaw's engines send none): a training that ran alone on the whole device
    gives its pipeline's seconds per token, the reference of a later training on half of it."""
    learner = GridLearner(synthetic_grid(), LearnConfig(min_samples=1))
    state = NodeState(NODE, learner.base, make("jigsaw"), fallback=False, learner=learner)
    inbox = Inbox(state)
    inbox.register(pr.Register(pipeline="a", pid=1, devices=(0,)))

    def train(step: int, t0: float, sm_frac: float, mem_frac: float, tokens: int, wall_s: float) -> None:
        inbox.take("a", pr.Admit(session="", kind="training", dp_rank=0, step=step, mem_bytes=GIB), t0)
        sid = next(iter(state.pipeline("a").waiting))
        state.apply(Plan(time_s=t0, started=(sid,), assignments=(
            Assignment(substage=sid, pipeline="a", device=0, sm_frac=sm_frac, mem_bytes=int(mem_frac * NODE.mem_bytes),
                       slowdown=learner.base.alone("training", sm_frac, mem_frac)),)), t0)
        inbox.take("a", pr.Done(session="", substage=sid, num_tokens=tokens), t0 + wall_s)

    train(0, 0.0, 1.0, 0.8, tokens=1000, wall_s=10.0)  # alone, whole device: 10 ms a token
    assert learner.observed == 0  # never evidence about the point its own reference was measured at
    train(1, 20.0, 0.5, 0.4, tokens=2000, wall_s=30.0)  # half the SMs: 1.5x its 20 s alone
    half = ("training", None, 1, 1)
    assert learner.observed == 1
    assert learner.value(half) == pytest.approx(1.5, rel=0.02)  # not the base's 1.9, nor 30 / 10


def test_where_nothing_runs_on_a_whole_device_a_pair_is_learned_against_its_kind_alone_at_that_share():
    learner = GridLearner(synthetic_grid(), LearnConfig(min_samples=1))
    state = NodeState(NODE, learner.base, make("jigsaw"), fallback=False, learner=learner)
    inbox = Inbox(state)
    for name in ("a", "b"):
        inbox.register(pr.Register(pipeline=name, pid=1, devices=(0,)))
    half, mem = 0.5, int(0.4 * NODE.mem_bytes)
    alone = learner.base.alone("training", half, 0.4)  # 1.9: the grid's training alone on half

    def grant(t0: float, *asks: tuple[str, str, int]) -> dict[str, str]:
        for name, kind, step in asks:
            inbox.take(name, pr.Admit(session="", kind=kind, dp_rank=0, step=step, mem_bytes=GIB), t0)
        ids = {name: next(iter(state.pipeline(name).waiting)) for name, _, _ in asks}
        state.apply(Plan(time_s=t0, started=tuple(ids.values()), assignments=tuple(
            Assignment(substage=sid, pipeline=name, device=0, sm_frac=half, mem_bytes=mem, slowdown=alone)
            for name, sid in ids.items())), t0)
        return ids

    a0 = grant(0.0, ("a", "training", 0))["a"]
    inbox.take("a", pr.Done(session="", substage=a0, num_tokens=1000), 19.0)  # alone on half: 10 s exclusive
    ids = grant(20.0, ("a", "training", 1), ("b", "rollout_decode", 0))
    inbox.take("a", pr.Done(session="", substage=ids["a"], num_tokens=1000), 46.0)  # beside the decode: 26 s
    assert learner.observed == 1
    assert learner.value(PAIR) == pytest.approx(2.6, rel=0.02)  # 26 s over 10 s exclusive, not over 19 s


@pytest.mark.timeout(120)
def test_the_learned_grid_converges_to_a_known_true_grid_in_simulation():
    config = SimConfig(workload=("qwen3-0.6b-gsm8k", "qwen3-0.6b-gsm8k"), steps=24, placement="colocated",
                       trace=False, learn_grid=True,
                       true_grid_scale=("reference/rollout_tail=1.5", "reference/training=1.5",
                                        "training/rollout_tail=1.5", "training/reference=1.5"))
    result = simulate(config)
    truth = true_grid(config, result.learner.base)
    true_tables = truth.to_dict()
    settled = [e for e in result.learner.report() if e.count >= result.learner.config.min_samples]
    moved = [e for e in settled if abs(e.learned / e.prior - 1.0) > 0.1]
    assert len(moved) >= 2
    for e in settled:
        kind, partner, i, j = e.entry
        want = (true_tables["alone"][kind] if partner is None else true_tables["pairs"][kind][partner])[i][j]
        assert e.learned == pytest.approx(want, rel=0.01), e


def test_a_daemon_that_learns_survives_a_malformed_file_and_saves_what_it_learned(tmp_path, caplog):
    from jigsaw.runtime.daemon import Daemon, DaemonConfig

    grid = Daemon(DaemonConfig(), directory=tmp_path / "a").grid
    path = learned_path(grid)
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    daemon = Daemon(DaemonConfig(learn_grid=True), directory=tmp_path / "b")
    assert str(path) in caplog.text and daemon.state.learner is daemon.learner
    daemon.learner.record(("training", "rollout_decode", 1, 1), 0.2)
    daemon.learner.observed = 1
    daemon.save_learned()
    assert GridLearner.load(path, grid).report() == daemon.learner.report()
    assert not daemon.learner.config.frozen
    watching = Daemon(DaemonConfig(watch_grid=True), directory=tmp_path / "c").learner
    assert watching is not None and watching.config.frozen  # --watch-grid: measured, never moved
    assert Daemon(DaemonConfig(), directory=tmp_path / "d").learner is None


def _probing_node(config: LearnConfig):
    learner = GridLearner(synthetic_grid(), config)
    state = NodeState(NODE, learner.base, make("jigsaw"), fallback=False, learner=learner, max_wait_s=2.0)
    inbox = Inbox(state)
    for name in ("a", "b"):
        inbox.register(pr.Register(pipeline=name, pid=1, devices=(0,)))
    return learner, state, inbox


def _ask(state, inbox, name: str, kind: str, step: int, t: float, **facts) -> str:
    inbox.take(name, pr.Admit(session="", kind=kind, dp_rank=0, step=step, mem_bytes=GIB, **facts), t)
    return next(sid for sid in state.pipeline(name).waiting if f"/{kind}/" in sid)


def test_with_nothing_to_measure_against_a_grant_runs_alone_as_a_probe_and_nothing_joins_it():
    """jigsaw's engines send no estimate and the demo's pipelines never run alone by themselves:
    the first trainings of each run alone (probes), one after the other; a request that is no
    probe waits beside a running one until it has waited max_wait_s.  Without probes the two
    trainings start side by side at once."""
    _, state, inbox = _probing_node(LearnConfig(min_samples=1, probes_per_kind=4))
    ids = {n: _ask(state, inbox, n, "training", 0, 0.0) for n in ("a", "b")}
    state.decide(0.0)
    running = [n for n in ("a", "b") if state.pipeline(n).running]
    assert len(running) == 1, "two probes on one device: one runs, the other waits for the device"
    first, second = running[0], "b" if running == ["a"] else "a"
    state.decide(1.0)
    assert not state.pipeline(second).running
    inbox.take(first, pr.Done(session="", substage=ids[first], num_tokens=1000), 1.5)
    assert state.grants.last_probe == (first, ids[first], True)
    state.decide(1.5)
    assert ids[second] in state.pipeline(second).running  # the device emptied: the other probe, alone

    _, state, inbox = _probing_node(LearnConfig(min_samples=1, probes_per_kind=4))
    probe = _ask(state, inbox, "a", "training", 0, 0.0)
    state.decide(0.0)
    late = _ask(state, inbox, "b", "reference", 0, 0.1, expected_s=1.0)  # its own estimate: no probe
    state.decide(0.2)
    assert probe in state.pipeline("a").running and late not in state.pipeline("b").running
    state.decide(2.2)  # it waited max_wait_s: urgent, it starts beside the probe
    assert late in state.pipeline("b").running
    inbox.take("a", pr.Done(session="", substage=probe, num_tokens=1000), 5.0)
    assert state.grants.last_probe == ("a", probe, False) and state.grants.probed[("a", "training")] == 1

    _, plain, inbox = _probing_node(LearnConfig(min_samples=1, probes_per_kind=0))
    for n in ("a", "b"):
        _ask(plain, inbox, n, "training", 0, 0.0)
    plain.decide(0.0)
    assert all(plain.pipeline(n).running for n in ("a", "b"))


def test_probes_give_the_rate_alone_that_makes_a_co_located_grant_evidence_then_stop():
    learner, state, inbox = _probing_node(LearnConfig(min_samples=2, probes_per_kind=3))
    t = 0.0
    for step in range(2):  # two probes of a's training, alone: 10 ms a token
        sid = _ask(state, inbox, "a", "training", step, t)
        state.decide(t)
        assert sid in state.pipeline("a").running and not state.pipeline("b").running
        inbox.take("a", pr.Done(session="", substage=sid, num_tokens=1000), t + 10.0)
        assert state.grants.last_probe == ("a", sid, True)
        t += 20.0
    assert state.grants.rates.known("a", "training") and learner.observed == 0
    sid = _ask(state, inbox, "a", "training", 2, t)
    assert sid not in state.grants.probes(state.pipeline("a"))  # known: no more probes
    b = _ask(state, inbox, "b", "rollout_decode", 0, t, expected_s=30.0)
    state.decide(t)
    assert sid in state.pipeline("a").running and b in state.pipeline("b").running  # side by side
    inbox.take("a", pr.Done(session="", substage=sid, num_tokens=1000), t + 26.0)
    got = state.grants.history[-1]
    assert learner.observed == 1 and got.sid == sid and got.entry[:2] == ("training", "rollout_decode")


def test_a_pipeline_gets_at_most_probes_per_kind_probes_even_if_none_ran_alone():
    learner, state, inbox = _probing_node(LearnConfig(min_samples=1, probes_per_kind=2))
    for step in range(3):
        sid = _ask(state, inbox, "a", "reference", step, 10.0 * step)
        assert (sid in state.grants.probes(state.pipeline("a"))) == (step < 2)
        other = _ask(state, inbox, "b", "training", step, 10.0 * step, expected_s=5.0)
        state.decide(10.0 * step + 3.0)  # b's request aged: it runs beside a's probe
        inbox.take("a", pr.Done(session="", substage=sid, num_tokens=100), 10.0 * step + 4.0)
        inbox.take("b", pr.Done(session="", substage=other, num_tokens=100), 10.0 * step + 5.0)
    assert state.grants.probed[("a", "reference")] == 2 and not state.grants.rates.known("a", "reference")


def test_an_unsettled_other_entry_may_hold_a_moment_of_a_grant_or_the_references_own_point_no_more():
    """A grant mostly at PAIR with the rest at its kind alone on half (no samples there): a
    moment (10%) of it still makes it evidence about PAIR, priced at that entry's value; 30% does
    not, unless that point is the one its reference was measured at (exact by construction)."""
    from jigsaw.mux.model.learned import Segment

    half = ("training", None, 1, 1)
    for other_frac, exact, evidence in ((0.1, None, True), (0.3, None, False), (0.3, half, True)):
        learner = GridLearner(synthetic_grid(), LearnConfig(min_samples=5))
        pair_s, alone_s = 10.0 * (1 - other_frac), 10.0 * other_frac
        reference = pair_s / (1.3 * learner.base_value(PAIR)) + alone_s / learner.value(half)
        got = learner.observe([Segment(entry=PAIR, wall_s=pair_s, slowdown=1.0),
                               Segment(entry=half, wall_s=alone_s, slowdown=1.0)], reference, exact=exact)
        assert (got == PAIR) is evidence, (other_frac, exact)
        if evidence:  # the sample is what the pair really cost: 1.3x its base
            assert learner._stats[PAIR].window[-1] == pytest.approx(math.log(1.3))
        else:
            assert learner.skipped["mixed with unsettled"] == 1


def test_a_frozen_learner_measures_the_grid_but_moves_nothing():
    """`jigsaw daemon --watch-grid`: the same samples and errors as a learner, the base grid planned with."""
    frozen = GridLearner(synthetic_grid(), LearnConfig(min_samples=2, frozen=True))
    for _ in range(5):
        frozen.record(PAIR, math.log(1.5))
    assert frozen.value(PAIR) == frozen.base_value(PAIR) and frozen.refined() is frozen.base
    (entry,) = [e for e in frozen.report() if e.entry == PAIR]
    assert entry.count == 5 and entry.learned == entry.prior


def test_a_probe_re_granted_at_a_new_share_still_gives_its_rate_at_the_share_that_held_it():
    """A probe that starts on half the device and gets all of it a moment later ran wholly alone:
    its rate is at the whole device, its half-share second counted at that point's speed (1 s
    there is 1 / 1.9 s on the whole device), not as a wall second and not thrown away."""
    learner, state, inbox = _probing_node(LearnConfig(min_samples=1, probes_per_kind=2))
    sid = _ask(state, inbox, "a", "training", 0, 0.0)
    mem = int(0.8 * NODE.mem_bytes)
    half, whole = learner.base.alone("training", 0.5, 0.8), learner.base.alone("training", 1.0, 0.8)

    def grant(t: float, sm_frac: float, slowdown: float) -> None:
        state.apply(Plan(time_s=t, started=(sid,) if t == 0.0 else (), assignments=(
            Assignment(substage=sid, pipeline="a", device=0, sm_frac=sm_frac, mem_bytes=mem, slowdown=slowdown),)), t)

    grant(0.0, 0.5, half)
    grant(1.0, 1.0, whole)
    inbox.take("a", pr.Done(session="", substage=sid, num_tokens=1000), 10.0)
    top = ("training", None, len(learner.base.sm_levels) - 1, len(learner.base.mem_levels) - 1)
    assert state.grants.last_probe == ("a", sid, True)
    assert state.grants.rates.rate(("a", top)) == pytest.approx((9.0 + 1.0 * whole / half) / 1000)
