"""Calibrating a grid from the pipelines' own runs (jigsaw.sim.calibrate): an alone run and a
shared run of the same work give, per kind, the factor by which the grid misjudges a partition,
and the shared run read with the calibrated grid takes back the alone run's times."""

import pytest

from jigsaw.mux.model.slowdown import SlowdownGrid
from jigsaw.profiles import CPU_DEFAULT
from jigsaw.sim.calibrate import calibrate
from jigsaw.sim.replay import recorded
from jigsaw.trace import Trace, TraceEvent

pytestmark = pytest.mark.timeout(60)

def _uncalibrated(name: str) -> SlowdownGrid:
    """A grid with no calibration on record (the shipped CPU grid, its entries as they are)."""
    doc = SlowdownGrid.load(name).to_dict()
    doc["source"].pop("calibration", None)
    return SlowdownGrid.from_dict(doc)


GRID = _uncalibrated(CPU_DEFAULT)
WORK_S = {"rollout_tail": 1.0, "training": 2.0}
"""Whole-device seconds of each sub-stage, every step."""
TRUE = {"rollout_tail": 1.6, "training": 0.7}
"""How much slower than the grid says each kind really runs on a partition."""
PARTNER = {"rollout_tail": "training", "training": "rollout_tail"}


def _sid(p: str, step: int, kind: str) -> str:
    return f"{p}/{step}/r0/{kind}/0"


def _alone_run(steps: int = 3, warm_up_s: float = 9.0) -> Trace:
    """Every sub-stage on the whole device, one after another (the daemon's serial policy)."""
    t, ev = 0.0, []
    for p in ("a", "b"):
        for step in range(steps):
            for kind, work in WORK_S.items():
                dur = work + (warm_up_s if step == 0 else 0.0)  # a slow first step must not count
                ev.append(TraceEvent(t_s=t, event="grant", pipeline=p, substage=_sid(p, step, kind), device=0,
                                     sm_frac=1.0, slowdown=1.0))
                t += dur
                ev.append(TraceEvent(t_s=t, event="release", pipeline=p, substage=_sid(p, step, kind), device=0))
    return Trace(ev)


def _shared_run(steps: int = 3) -> Trace:
    """The same work on halves: each sub-stage first alone on its half, then beside its partner
    (two intervals, two recorded slowdowns), each interval as long as the true grid makes it."""
    ev = []
    for p in ("a", "b"):
        t = 0.0
        for step in range(steps):
            for kind, work in WORK_S.items():
                sid = _sid(p, step, kind)
                for share, slow in ((0.3, GRID.alone(kind, 0.5, 0.5)),
                                    (0.7, GRID.slowdown(kind, PARTNER[kind], 0.5, 0.5))):
                    ev.append(TraceEvent(t_s=t, event="grant", pipeline=p, substage=sid, device=0, sm_frac=0.5,
                                         slowdown=slow))
                    t += share * work * slow * TRUE[kind]
                ev.append(TraceEvent(t_s=t, event="release", pipeline=p, substage=sid, device=0))
    return Trace(sorted(ev, key=lambda e: e.t_s))


def test_the_factor_is_how_far_the_grid_misjudged_each_kind_and_the_grid_is_scaled_by_it():
    cal = calibrate(GRID, [_alone_run()], [_shared_run()], first_step=1)
    assert cal.factors == pytest.approx(TRUE, rel=1e-6)
    for kind, f in TRUE.items():
        assert cal.grid.alone(kind, 0.5, 0.5) == pytest.approx(GRID.alone(kind, 0.5, 0.5) * f, abs=1e-4)
        assert cal.grid.slowdown(kind, PARTNER[kind], 0.5, 0.5) == pytest.approx(
            GRID.slowdown(kind, PARTNER[kind], 0.5, 0.5) * f, abs=1e-4)
        # The whole device alone and unpartitioned sharing are not what the runs measured.
        assert cal.grid.alone(kind, 1.0, 0.5) == GRID.alone(kind, 1.0, 0.5)
        assert cal.grid.slowdown(kind, PARTNER[kind], 1.0, 0.5) == GRID.slowdown(kind, PARTNER[kind], 1.0, 0.5)
    assert cal.grid.alone("reference", 0.5, 0.5) == GRID.alone("reference", 0.5, 0.5)  # not in the runs
    assert cal.grid.source["calibration"]["factors"] == pytest.approx(TRUE, abs=1e-4)


def test_the_shared_run_read_with_the_calibrated_grid_takes_the_alone_runs_times():
    cal = calibrate(GRID, [_alone_run()], [_shared_run()], first_step=1)
    for factors, right in ((cal.factors, True), (None, False)):
        rec = recorded(_shared_run(), first_step=1, factors=factors)
        pieces = [s for ps in rec.pipelines for s in ps.graph.substages]
        assert len(pieces) == 2 * 2 * len(WORK_S)
        got = [s.duration_s == pytest.approx(WORK_S[s.kind.value], rel=1e-6) for s in pieces]
        assert all(got) if right else not any(got)
    # The whole device alone is the grid's normalisation point: the factors leave it alone.
    whole = recorded(_alone_run(), first_step=1, factors=cal.factors)
    assert all(s.duration_s == pytest.approx(WORK_S[s.kind.value], rel=1e-6)
               for ps in whole.pipelines for s in ps.graph.substages)


def test_a_kind_with_too_little_time_keeps_its_entries():
    cal = calibrate(GRID, [_alone_run()], [_shared_run()], first_step=1, min_matched_s=5.0)
    (tail,) = [f for f in cal.fits if f.kind == "rollout_tail"]  # 4 × 1 s matched: below 5 s
    assert not tail.applied and tail.factor == 1.0 and tail.matched == 4
    assert cal.grid.alone("rollout_tail", 0.5, 0.5) == GRID.alone("rollout_tail", 0.5, 0.5)
    assert cal.factors == pytest.approx({"training": TRUE["training"]}, rel=1e-6)


def test_runs_that_cannot_calibrate_are_refused_with_the_reason():
    with pytest.raises(ValueError, match="policy serial"):
        calibrate(GRID, [_shared_run()], [_shared_run()])  # not an alone run
    with pytest.raises(ValueError, match="in pairs"):
        calibrate(GRID, [_alone_run()], [])
    with pytest.raises(ValueError, match="no sub-stage in common"):
        calibrate(GRID, [_alone_run(steps=1)], [_shared_run(steps=1)], first_step=1)


def test_jigsaw_profile_calibrate_writes_the_calibrated_grid_of_the_shared_runs_profile(tmp_path, capsys):
    from jigsaw.cli.main import main

    alone, shared = tmp_path / "alone.jsonl", tmp_path / "shared.jsonl"
    _alone_run().write(alone)
    base = tmp_path / "grid.json"
    GRID.save(base)
    node = TraceEvent(t_s=0.0, event="node", pipeline="", data={"profile": str(base)})
    Trace([node, *_shared_run().events]).write(shared)
    out = tmp_path / "calibrated.json"
    assert main(["profile", "--calibrate", str(alone), str(shared), "--out", str(out)]) == 0
    got = SlowdownGrid.load(out)
    assert got.source["calibration"]["runs"] == [str(alone), str(shared)]
    for kind, f in TRUE.items():  # the CLI leaves the warm-up step out as well
        assert got.alone(kind, 0.5, 0.5) == pytest.approx(GRID.alone(kind, 0.5, 0.5) * f, abs=1e-3)
    assert "rollout_tail" in capsys.readouterr().out
    _shared_run().write(shared)  # no node event: not a daemon's trace
    assert main(["profile", "--calibrate", str(alone), str(shared), "--out", str(out)]) != 0
    assert main(["profile", "--calibrate", str(alone), "--out", str(out)]) != 0  # not a pair


def test_calibrating_a_calibrated_grid_records_the_product_of_the_factors():
    from jigsaw.sim.calibrate import scaled

    once = scaled(GRID, {"training": 2.0}, ("run 1",))
    twice = scaled(once, {"training": 0.25, "reference": 3.0}, ("run 2",))
    assert twice.source["calibration"] == {"factors": {"training": 0.5, "reference": 3.0}, "runs": ["run 1", "run 2"]}
    assert twice.source["note"].count("calibrated") == 1
    assert twice.alone("training", 0.5, 0.5) == pytest.approx(max(0.5, GRID.alone("training", 0.5, 0.5) * 0.5),
                                                              abs=1e-3)
