"""Replaying recorded traces: the sub-stage graphs a trace implies, re-packed by each policy."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import replace

import pytest
from factories import colocated

from jigsaw.graph.policies import make
from jigsaw.sim.execute import Execution
from jigsaw.sim.replay import Recorded, grid_of, recorded, recorded_makespan_s
from jigsaw.sim.replay import replay as replay_or_refuse
from jigsaw.sim.run import simulate
from jigsaw.trace import Trace, TraceEvent

CFG = colocated(workload=("qwen3-4b-gsm8k-multiturn", "qwen3-0.6b-gsm8k"), gpus=4, steps=2, seed=3)
GIB = 1 << 30


def replay(rec: Recorded, policy, grid) -> Execution:
    """The policy's own run of the recorded work (these policies are not refused)."""
    got = replay_or_refuse(rec, policy, grid)
    assert isinstance(got, Execution), str(got)
    return got


@pytest.fixture(scope="module")
def serial_trace() -> Trace:
    return simulate(replace(CFG, policy="serial")).trace


def test_replaying_a_serial_trace_under_serial_gives_the_simulated_makespan(serial_trace):
    rec = recorded(serial_trace)
    ex = replay(rec, make("serial"), grid_of(rec))
    assert ex.makespan_s == pytest.approx(recorded_makespan_s(serial_trace), rel=1e-6)


def test_a_replay_from_a_later_step_leaves_the_earlier_steps_work_and_tokens_out(serial_trace):
    rec = recorded(serial_trace, first_step=1)
    assert {s.step for ps in rec.pipelines for s in ps.graph} == {1}
    steps = [e for e in serial_trace.events if e.event == "step"]
    assert sum(rec.tokens.values()) == sum(e.data["tokens"] for e in steps if e.data["step"] == 1)
    # serial runs whole steps by turns: without step 0, the run is what came after both step 0s
    first_done_s = max(e.t_s for e in steps if e.data["step"] == 0)
    ex = replay(rec, make("serial"), grid_of(rec))
    assert ex.makespan_s == pytest.approx(recorded_makespan_s(serial_trace) - first_done_s, rel=1e-6)


@pytest.mark.parametrize("policy", ["static", "muxserve", "rollmux", "hrrs", "greedy", "jigsaw"])
def test_every_policy_runs_every_recorded_substage_within_device_budgets(serial_trace, policy):
    rec = recorded(serial_trace)
    ex = replay(rec, make(policy), grid_of(rec))
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
    serial = replay(rec, make("serial"), grid).makespan_s
    assert replay(rec, make("jigsaw"), grid).makespan_s < serial


def test_malformed_traces_are_rejected_with_the_reason():
    bad_id = Trace([TraceEvent(t_s=0.0, event="grant", pipeline="p", substage="p/x/rollout", device=0, sm_frac=1.0)])
    with pytest.raises(ValueError, match="not pipeline/step/rRANK/kind/n"):
        recorded(bad_id)
    with pytest.raises(ValueError, match="no sub-stage"):
        recorded(Trace([]))
    no_meta = Trace([TraceEvent(t_s=0.0, event="host", pipeline="p", substage="p/0/r0/reward/0", data={"end_s": 1.0})])
    with pytest.raises(ValueError, match="pass a profiled grid"):
        grid_of(recorded(no_meta))


def test_breakdown_accounts_every_device_second_and_the_work_done():
    from jigsaw.sim.breakdown import breakdown

    ev = [TraceEvent(t_s=0.0, event="pipeline", pipeline="a", data={"devices": [0, 1]}),
          TraceEvent(t_s=0.0, event="grant", pipeline="a", substage="a/0/r0/rollout_tail/0", device=0, slowdown=1.0),
          TraceEvent(t_s=2.0, event="grant", pipeline="b", substage="b/0/r0/training/0", device=0, slowdown=1.25),
          TraceEvent(t_s=2.0, event="grant", pipeline="a", substage="a/0/r0/rollout_tail/0", device=0, slowdown=2.0),
          TraceEvent(t_s=4.0, event="release", pipeline="a", device=0),
          TraceEvent(t_s=4.0, event="grant", pipeline="b", substage="b/0/r0/training/0", device=0, slowdown=1.0),
          TraceEvent(t_s=4.0, event="host", pipeline="a", substage="a/0/r1/tool/0", data={"end_s": 5.0}),
          TraceEvent(t_s=6.0, event="release", pipeline="b", device=0)]
    bd = breakdown(Trace(ev), num_devices=2)
    assert bd.device_s == pytest.approx(12.0)
    occ = bd.by_occupancy_s
    assert occ["rollout_tail"] == pytest.approx(2.0) and occ["rollout_tail + training"] == pytest.approx(2.0)
    assert occ["training"] == pytest.approx(2.0)
    assert occ["idle, tool wait"] == pytest.approx(1.0)  # device 1 while worker r1 waited
    assert occ["idle"] == pytest.approx(5.0)
    assert sum(occ.values()) == pytest.approx(bd.device_s)
    # 2 s alone + 2 s at (1/2 + 1/1.25) + 2 s of training alone
    assert sum(bd.work_s.values()) == pytest.approx(2.0 + 2.0 * (0.5 + 0.8) + 2.0)


def test_a_worker_whose_requests_moved_runs_no_more_of_that_rollout():
    """RollMux consolidates tails while search-R1 workers are mid-chain (decode, tool, decode):
    the rest of a moved worker's chain left with its requests, so it never asks for the device
    RollMux gave to the other pipeline (it used to overcommit that device)."""
    cfg = colocated(workload=("qwen3-4b-search-r1", "qwen3-0.6b-math"), gpus=4, steps=3, seed=0, policy="jigsaw")
    rec = recorded(simulate(cfg).trace)
    ex = replay(rec, make("rollmux"), grid_of(rec))
    graphs = {ps.graph.pipeline: ps.graph for ps in rec.pipelines}
    moved = [(m.pipeline, m.source) for p in ex.plans for m in p.migrations]
    assert moved
    chained = set()
    for pipe, source in moved:
        g, todo = graphs[pipe], list(graphs[pipe].successors(source))
        while todo:
            s = g[todo.pop()]
            if s.dp_rank == g[source].dp_rank and (s.kind.is_rollout or s.kind.name == "TOOL"):
                chained.add(s.id)
                todo.extend(g.successors(s.id))
    ran = [iv.substage for iv in ex.intervals]
    assert chained and not chained & set(ran)
    every = {s.id for g in graphs.values() for s in g}
    assert set(ran) | chained == every


def test_a_rollout_piece_needs_its_smallest_reported_footprint_a_stage_its_largest():
    """A rollout engine's pool follows its grant: what it reported under a whole device is
    that device again, not a need (a long-CoT tail reported 76 GiB there and ran on at 32)."""
    roll, train = "a/0/r0/rollout_tail/0", "a/0/r0/training/0"

    def grant(t: float, sid: str, need_gib: float) -> TraceEvent:
        return TraceEvent(t_s=t, event="grant", pipeline="a", substage=sid, device=0, sm_frac=1.0,
                          mem_bytes=80 * GIB, slowdown=1.0, data={"need_bytes": int(need_gib * GIB)})

    rec = recorded(Trace([grant(0.0, roll, 76), grant(1.0, roll, 32), grant(2.0, roll, 40),
                          grant(3.0, train, 30), grant(4.0, train, 38),
                          TraceEvent(t_s=5.0, event="release", pipeline="a", device=0)]))
    mem = {s.id: s.mem_bytes for s in rec.pipelines[0].graph}
    assert mem == {roll: 32 * GIB, train: 38 * GIB}


def test_muxserve_replays_the_long_cot_pair_whose_tails_continue_beside_each_other():
    """Replayed with its tails' peak footprints, a tail that continued its worker's rollout
    (76 GiB, recorded alone on a whole device) could not join the other pipeline's tail on
    its device, and muxserve raised; with the footprints the engines ran with, it fits."""
    cfg = colocated(workload=("qwen3-4b-longcot-empirical",) * 2, steps=2, policy="jigsaw")
    rec = recorded(simulate(cfg).trace)
    assert replay(rec, make("muxserve"), grid_of(rec)).makespan_s > 0


def _training_needs_half():
    """The synthetic grid, with training unable to hold 20% or 40% of a device (null there,
    alone and beside anything, and so its partners at 80% and 60% beside it)."""
    from factories import synthetic_grid

    from jigsaw.mux.model.slowdown import SlowdownGrid

    d = synthetic_grid().to_dict()
    for row in d["alone"]["training"]:
        row[0] = row[1] = None
    for other in d["kinds"]:
        for row in d["pairs"]["training"][other]:
            row[0] = row[1] = None
        for row in d["pairs"][other]["training"]:
            row[2] = row[3] = None
    return SlowdownGrid.from_dict(d)


class HalfEach:
    """Every sub-stage half a device's SMs and memory (what a static split grants)."""

    name, separable = "half-each", False

    def plan(self, view):
        from jigsaw.graph.plan import Assignment, Plan

        out = []
        for ps in view.pipelines:
            for s in [ps.graph[sid] for sid in ps.running] + list(ps.graph.frontier(ps.done, ps.running)):
                out.append(Assignment(substage=s.id, pipeline=ps.graph.pipeline, device=ps.devices[s.dp_rank],
                                      sm_frac=0.5, mem_bytes=view.node.mem_bytes // 2, slowdown=1.0))
        return Plan(time_s=view.time_s, started=tuple(a.substage for a in out), assignments=tuple(out))


def test_a_stage_runs_in_a_budget_its_need_fits_though_the_grids_lower_level_cannot_hold_it():
    """The executor prices what runs by need, as the node simulator's physics does: a 38 GiB
    training in half an 80 GiB device runs (at the 60% level's pace), though the grid's
    40% level is null and, without its need, half the device would be infeasible."""
    from factories import NODE, chain, states

    from jigsaw.graph.substage import SubStageKind as K
    from jigsaw.sim.execute import execute

    grid = _training_needs_half()
    assert grid.actual(("training", 0.5, 0.5)) == (math.inf,)
    ex = execute(states(chain("A", [("train", K.TRAINING, 5.0, 38)])), NODE, grid, policy=HalfEach(),
                 fallback=False)
    assert ex.makespan_s == pytest.approx(5.0 * grid.alone("training", 0.5, 0.6))


@pytest.mark.parametrize("computes", [True, False])
def test_a_tool_that_computed_on_the_cpu_replays_as_host_work_that_keeps_its_share(computes):
    """A code tool ran on the node's CPU (its host event says `computes`): the replay asks for
    it as the live client did, so the daemon's recorded configuration (a CPU node keeps cores
    free for host work) holds back the partner's training beside it; a tool that only waited
    (a remote call) leaves the partner the whole device."""
    from jigsaw.graph.plan import SchedulerConfig
    from jigsaw.mux.model.slowdown import load_grid
    from jigsaw.profiles import CPU_DEFAULT

    sched = dataclasses.asdict(SchedulerConfig(host_on_device=True))
    node = TraceEvent(t_s=0.0, event="node", pipeline="", data={"policy": "jigsaw", "sched": sched, "devices": 1})
    tool, train, other = "a/0/r0/tool/0", "a/0/r0/training/0", "b/0/r0/training/0"
    rec = recorded(Trace([
        node,
        TraceEvent(t_s=0.0, event="host", pipeline="a", substage=tool,
                   data={"end_s": 2.0, **({"computes": True} if computes else {})}),
        TraceEvent(t_s=0.0, event="grant", pipeline="b", substage=other, device=0, sm_frac=1.0, slowdown=1.0),
        TraceEvent(t_s=3.0, event="release", pipeline="b", device=0),
        TraceEvent(t_s=3.0, event="grant", pipeline="a", substage=train, device=0, sm_frac=1.0, slowdown=1.0),
        TraceEvent(t_s=4.0, event="release", pipeline="a", device=0)]))
    assert rec.config.host_on_device and (("a", tool) in rec.computes) == computes
    ex = replay_or_refuse(rec, make("jigsaw", rec.config), load_grid(CPU_DEFAULT), rec.config)
    assert isinstance(ex, Execution), str(ex)
    beside_tool = [iv.sm_frac for iv in ex.intervals if iv.substage == other and iv.start_s < 2.0]
    assert beside_tool
    assert (max(beside_tool) < 1.0) == computes
