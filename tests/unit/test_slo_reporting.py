"""SLO attainment and given-up SLOs, made visible: the "step" trace events of a simulated and
a daemon run, the plan events' "slo" records, the daemon's status reply and `jigsaw daemon
status` lines, its Prometheus gauges, and the timeline page."""

from __future__ import annotations

import logging
import re
from dataclasses import replace

import pytest
from factories import NODE, chain, colocated, states
from recorder import Recorder, admit

from jigsaw import protocol as pr
from jigsaw import timeline as tlm
from jigsaw.cli.daemon import describe
from jigsaw.graph.schedule import schedule
from jigsaw.graph.slo import TOLERANCE_S, Deadline
from jigsaw.graph.substage import SubStageKind as K
from jigsaw.mux.model.slowdown import load_grid
from jigsaw.node.effects import Decision
from jigsaw.runtime import plumbing
from jigsaw.runtime.housekeeping import status_reply
from jigsaw.sim.run import simulate
from jigsaw.trace import Trace, TraceEvent

pytestmark = pytest.mark.timeout(120)

PRIOR = load_grid("h100/qwen3-4b")
SLO = 1.5


def _page(trace: Trace) -> str:
    return re.sub(r"base64,[A-Za-z0-9+/=]+", "", tlm.html_page(tlm.build(trace)))


def _steps(trace: Trace, pipeline: str) -> list[TraceEvent]:
    return [e for e in trace.events if e.event == "step" and e.pipeline == pipeline]


# ------------------------------------------------------------------ the simulator's step events


def test_simulated_step_events_carry_their_exclusive_time_and_slo_and_the_page_shows_attainment():
    """The trace's steps are the run's steps (its latencies), each with the exclusive time the
    node measured and, for the pipeline with an SLO, whether that latency kept it."""
    r = simulate(colocated(workload=("qwen3-4b-gsm8k", "qwen3-4b-gsm8k"), policy="jigsaw", steps=3, slo=(1.3, 0),
                           trace=True))
    held, free = r.pipelines
    assert held.slo_slowdown == 1.3 and free.slo_slowdown is None
    for p in r.pipelines:
        steps = _steps(r.trace, p.name)
        assert [e.data["step"] for e in steps] == list(range(3))
        assert [e.data["latency_s"] for e in steps] == pytest.approx(list(p.step_latency_s))
        assert all(e.data["exclusive_s"] > 0 for e in steps)
        assert [e.data["step_slowdown"] for e in steps] == pytest.approx(
            [lat / e.data["exclusive_s"] for lat, e in zip(p.step_latency_s, steps)])
        assert {e.data["slo_slowdown"] for e in steps} == {p.slo_slowdown or 0.0}
    steps = _steps(r.trace, held.name)
    kept = [e.data["slo_kept"] for e in steps]
    assert kept == [lat <= 1.3 * e.data["exclusive_s"] + TOLERANCE_S for lat, e in zip(held.step_latency_s, steps)]
    assert all(e.data["slo_kept"] is None for e in _steps(r.trace, free.name))

    page = _page(r.trace)
    assert f"{held.name}: SLO 1.3×: {sum(kept)}/{len(kept)} steps kept, mean step " in page
    mean = sum(e.data["step_slowdown"] for e in steps) / len(steps)
    assert f"mean step {mean:.2f}× exclusive" in page
    assert f"{free.name}: no SLO, mean step " in page


def test_an_untraced_step_or_one_without_slo_data_adds_no_slo_line():
    trace = Trace([TraceEvent(t_s=0.0, event="grant", pipeline="a", substage="a/0/r0/training/0", device=0,
                              sm_frac=1.0),
                   TraceEvent(t_s=1.0, event="release", pipeline="a", device=0),
                   TraceEvent(t_s=1.0, event="step", pipeline="a", data={"step": 0, "latency_s": 1.0})])
    assert tlm.build(trace).slo == {} and "Steps against exclusive time" not in _page(trace)


# ------------------------------------------------------------------ plan records


def _infeasible_plan():
    """A's step ends long past its deadline whatever the plan; B has no SLO."""
    a, b = (chain(n, [("rollout_prefill/0", K.ROLLOUT_PREFILL, 1.0, 10), ("training/0", K.TRAINING, 2.0, 10)])
            for n in "AB")
    pa, pb = states(a, b)
    pa = replace(pa, deadline=Deadline(step=0, slo_slowdown=1.0, start_s=-100.0, exclusive_s=1.0))
    return schedule([pa, pb], NODE, PRIOR), schedule([replace(pa, deadline=None), pb], NODE, PRIOR)


def test_a_given_up_slo_reaches_the_plan_record_and_the_timeline_counts_it():
    given_up, without = _infeasible_plan()
    rec = Decision(plan=given_up).record()
    ((name, step, deadline_s, end_s, kept, reason),) = rec["slo"]
    assert (name, step, deadline_s, kept) == ("A", 0, -99.0, False)
    assert end_s > 0.0 and reason.startswith("infeasible")
    assert "slo" not in Decision(plan=without).record()  # no deadline: the record is as before

    grant = TraceEvent(t_s=0.0, event="grant", pipeline="A", substage="A/0/r0/rollout_prefill/0", device=0,
                       sm_frac=1.0)
    plans = [TraceEvent(t_s=t, event="plan", pipeline="", data=rec) for t in (0.0, 0.5)]
    kept_plan = TraceEvent(t_s=0.7, event="plan", pipeline="", data=Decision(plan=without).record())
    trace = Trace([grant, *plans, kept_plan, TraceEvent(t_s=1.0, event="release", pipeline="A", device=0)])
    assert tlm.build(trace).slo["A"].given_up_plans == 2
    assert "A: no SLO, 2 plans gave its SLO up" in _page(trace)


def test_a_malformed_slo_record_is_a_clear_error():
    trace = Trace([TraceEvent(t_s=0.0, event="grant", pipeline="A", substage="A/0/r0/training/0", device=0,
                              sm_frac=1.0),
                   TraceEvent(t_s=0.5, event="plan", pipeline="", data={"slo": [["A", 0, 1.0, 2.0, "no", ""]]}),
                   TraceEvent(t_s=1.0, event="release", pipeline="A", device=0)])
    with pytest.raises(ValueError, match="data.slo"):
        tlm.build(trace)


# ------------------------------------------------------------------ the daemon


@pytest.fixture
def d(tmp_path, monkeypatch):
    """A daemon of two devices (pipelines on device 0 alone), tracing, its metrics readable."""
    d = Recorder(tmp_path, devices=2, trace=tmp_path / "trace.jsonl")
    monkeypatch.setattr(d, "_metrics", plumbing.Metrics(None))  # the registry, not served
    return d


def _piece(d: Recorder, s: str, kind: str, step: int, run_s: float, req: int, wait_s: float = 0.0) -> None:
    """After `wait_s`, `kind` asks and is granted at once (the node is idle), runs `run_s`, is done."""
    d.time.t += wait_s
    (g,) = d.ask(admit(s, kind, step=step, req=req))
    assert isinstance(g, pr.Grant) and g.sm_frac == 1.0, g  # alone: its exclusive time is its run time
    d.time.t += run_s
    assert d.ask(pr.Done(session=s, substage=g.substage, req=req + 1)) == [pr.Ok(req=req + 1)]


def _gauge(d: Recorder, name: str, pipeline: str = "A") -> float | None:
    return d._metrics.registry.get_sample_value(name, {"pipeline": pipeline})


def test_the_daemon_reports_steps_kept_slowdown_and_a_given_up_slo(d, caplog):
    """Step 0: 1 s rollout + 1 s training back to back (latency 2 s, exclusive 2 s: kept under
    1.5×).  Step 1: the training asks 2 s after the rollout ended (latency 4 s: 2× its
    exclusive 2 s, not kept); its deadline (start + 1.5 × 2 s) passes as it asks, so the plan
    that admits it gives the SLO up, and so does the next one (B, on the other device, asks:
    the node's plan joins both devices' plans)."""
    caplog.set_level(logging.WARNING, logger="jigsaw.daemon")
    s = d.register("A", slo_slowdown=SLO, devices=(0,))
    b = d.register("B", devices=(1,))
    _piece(d, s, "rollout_decode", 0, 1.0, req=1)
    _piece(d, s, "training", 0, 1.0, req=3)
    d.ask(pr.StepEnd(session=s, step=0, req=5))
    _piece(d, s, "rollout_decode", 1, 1.0, req=6)
    d.time.t += 2.0
    (g,) = d.ask(admit(s, "training", step=1, req=8))
    d.time.t += 0.5
    (r,) = d.ask(admit(b, "training", step=0, req=10))  # a second plan while A's training runs
    assert isinstance(g, pr.Grant) and isinstance(r, pr.Grant) and r.device == 1

    mid, _ = status_reply(d, 1).pipelines
    assert (mid.slo_slowdown, mid.slo_kept, mid.slo_steps, mid.last_slowdown) == (SLO, 1, 1, pytest.approx(1.0))
    assert mid.slo_given_up.startswith("infeasible")
    assert f"      given up: {mid.slo_given_up}" in describe(status_reply(d, 1), "ep")
    assert _gauge(d, "jigsaw_slo_given_up") == 1.0 and _gauge(d, "jigsaw_slo_attainment") == 1.0

    d.time.t += 0.5
    d.ask(pr.Done(session=s, substage=g.substage, req=11))
    d.ask(pr.Done(session=b, substage=r.substage, req=12))
    d.ask(pr.StepEnd(session=s, step=1, req=13))
    (nxt,) = d.ask(admit(s, "rollout_decode", step=2, req=14))  # step 1 closes
    assert isinstance(nxt, pr.Grant)

    end, other = status_reply(d, 1).pipelines
    assert (other.name, other.slo_slowdown, other.slo_steps) == ("B", 0.0, 0)
    assert (end.slo_kept, end.slo_steps, end.last_slowdown) == (1, 2, pytest.approx(2.0))
    assert end.slo_given_up == ""  # step 2's plan keeps it
    assert "      SLO 1.5×: 1/2 steps kept, last step 2.00× exclusive" in describe(status_reply(d, 1), "ep")
    assert _gauge(d, "jigsaw_slo_attainment") == pytest.approx(0.5)
    assert _gauge(d, "jigsaw_step_slowdown") == pytest.approx(2.0)
    assert _gauge(d, "jigsaw_slo_given_up") == 0.0

    warned = [m for m in caplog.messages if "gives up the SLO of A for step 1" in m]
    assert len(warned) == 1 and "infeasible" in warned[0]

    d.trace_writer.close()
    trace = Trace.read(d.config.trace)
    steps = [e.data for e in _steps(trace, "A")]
    assert [(e["slo_slowdown"], e["slo_kept"], e["exclusive_s"]) for e in steps] == [
        (SLO, True, pytest.approx(2.0)), (SLO, False, pytest.approx(2.0))]
    gave_up = [e for e in trace.events if e.event == "plan" and any(not rec[4] for rec in e.data.get("slo", []))]
    assert len(gave_up) >= 2  # the training's plan and B's: one warning all the same
    assert f"A: SLO 1.5×: 1/2 steps kept, mean step 1.50× exclusive, {len(gave_up)} plans gave its SLO up" \
        in _page(trace)


def test_a_pipeline_without_an_slo_has_a_slowdown_but_no_attainment_and_leaves_no_gauges(d):
    s = d.register("A", devices=(0,))
    _piece(d, s, "training", 0, 1.0, req=1)
    d.ask(pr.StepEnd(session=s, step=0, req=3))
    (g,) = d.ask(admit(s, "training", step=1, req=4))
    (p,) = status_reply(d, 1).pipelines
    assert (p.slo_slowdown, p.slo_kept, p.slo_steps, p.slo_given_up) == (0.0, 0, 0, "")
    assert p.last_slowdown == pytest.approx(1.0)
    assert not any("SLO" in line for line in describe(status_reply(d, 1), "ep"))
    assert _gauge(d, "jigsaw_step_slowdown") == pytest.approx(1.0)
    assert _gauge(d, "jigsaw_slo_attainment") is None and _gauge(d, "jigsaw_slo_given_up") is None
    step = _steps(Trace.read(d.config.trace), "A")[0].data  # the writer is line-buffered
    assert (step["slo_slowdown"], step["slo_kept"]) == (0.0, None)

    d.ask(pr.Unregister(session=s, pipeline_done=True, req=9))
    assert _gauge(d, "jigsaw_step_slowdown") is None  # its label set left with it


def test_gauges_of_a_pipeline_that_left_are_removed(d):
    s = d.register("A", slo_slowdown=SLO, devices=(0,))
    _piece(d, s, "training", 0, 1.0, req=1)
    d.ask(admit(s, "training", step=1, req=3))
    assert _gauge(d, "jigsaw_slo_attainment") == 1.0 and _gauge(d, "jigsaw_slo_given_up") == 0.0
    d.ask(pr.Unregister(session=s, pipeline_done=True, req=4))
    assert [_gauge(d, n) for n in ("jigsaw_slo_attainment", "jigsaw_step_slowdown", "jigsaw_slo_given_up")] \
        == [None, None, None]
    assert status_reply(d, 1).pipelines == ()
