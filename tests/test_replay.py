"""Replaying recorded traces: the sub-stage graphs a trace implies, re-packed by each policy."""

from __future__ import annotations

from dataclasses import replace

import pytest

from jigsaw.sim import policies
from jigsaw.sim.replay import grid_of, recorded, recorded_makespan_s, replay
from jigsaw.sim.run import SimConfig, simulate
from jigsaw.trace import Trace, TraceEvent

CFG = SimConfig(workload=("qwen3-4b-gsm8k-multiturn", "qwen3-0.6b-gsm8k"), gpus=4, steps=2, seed=3)


@pytest.fixture(scope="module")
def serial_trace() -> Trace:
    return simulate(replace(CFG, policy="serial")).trace


def test_replaying_a_serial_trace_under_serial_gives_the_simulated_makespan(serial_trace):
    rec = recorded(serial_trace)
    ex = replay(rec, policies.make("serial"), grid_of(rec))
    assert ex.makespan_s == pytest.approx(recorded_makespan_s(serial_trace), rel=1e-6)


@pytest.mark.parametrize("policy", ["muxserve", "rollmux", "hrrs", "greedy", "jigsaw"])
def test_every_policy_runs_every_recorded_substage_within_device_budgets(serial_trace, policy):
    rec = recorded(serial_trace)
    ex = replay(rec, policies.make(policy), grid_of(rec))
    ran = {iv.substage for iv in ex.intervals}
    every = {s.id for ps in rec.pipelines for s in ps.graph}
    migrated = {m.source for p in ex.plans for m in p.migrations}
    assert ran == every  # a consolidated tail also ran (until it moved)
    # No device is shared by more than two sub-stages or over-granted at any instant.
    cuts = sorted({iv.start_s for iv in ex.intervals})
    for t in cuts:
        live = [iv for iv in ex.intervals if iv.device is not None and iv.start_s <= t < iv.end_s]
        for d in {iv.device for iv in live}:
            here = [iv for iv in live if iv.device == d]
            assert len(here) <= 2 and (sum(iv.sm_frac for iv in here) <= 1 + 1e-9 or len(here) == 2)
    assert ex.makespan_s > 0 and (policy == "rollmux" or not migrated)


def test_a_sharing_policy_beats_serial_on_the_same_recorded_work(serial_trace):
    rec = recorded(serial_trace)
    grid = grid_of(rec)
    serial = replay(rec, policies.make("serial"), grid).makespan_s
    assert replay(rec, policies.make("jigsaw"), grid).makespan_s < serial


def test_malformed_traces_are_rejected_with_the_reason():
    bad_id = Trace([TraceEvent(t_s=0.0, event="grant", pipeline="p", substage="p/x/rollout", device=0, sm_frac=1.0)])
    with pytest.raises(ValueError, match="not pipeline/step/rRANK/kind/n"):
        recorded(bad_id)
    with pytest.raises(ValueError, match="no sub-stage"):
        recorded(Trace([]))
    no_meta = Trace([TraceEvent(t_s=0.0, event="host", pipeline="p", substage="p/0/r0/reward/0", data={"end_s": 1.0})])
    with pytest.raises(ValueError, match="pass a profiled grid"):
        grid_of(recorded(no_meta))
