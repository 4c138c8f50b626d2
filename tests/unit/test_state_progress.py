"""The search's State steps its running tasks from event to event (graph/state.py), keeping
each device's unfinished work on the side (the cost's and the bound's load term).  Driven
through whole runs with random options, every event must end exactly the tasks that end
first, at the time they end, and every device's load must stay the sum of its tasks' work
left: what a faster bookkeeping of progress (a heap of ends, lazy loads) has to keep."""

from __future__ import annotations

import random

import pytest
from exact import grpo, instances

from jigsaw.graph import actions as act
from jigsaw.graph import state as st
from jigsaw.graph.plan import NodeSpec, PipelineState, SchedulerConfig
from jigsaw.graph.problem import SchedulerCache
from jigsaw.mux.model.slowdown import load_grid

PRIOR = load_grid("h100/qwen3-4b")
TOL = 1e-7


def next_end(P, S) -> tuple[float, set[int]]:
    """The oracle: when the first running task ends at its rate, and which end with it."""
    dt = min(S.rem_s[i] / S.rate[i] for i in S.running)
    ends = {i for i in S.running if S.rem_s[i] - dt * S.rate[i] <= st.EPS_S * max(1.0, P.tasks[i].excl_s)}
    return S.now_s + dt, ends


def check_loads(P, S) -> None:
    want = [0.0] * P.num_devices
    for i, status in enumerate(S.status):
        if status != st.DONE:
            for d in P.tasks[i].devices:
                want[d] += S.rem_s[i] * (1.0 if S.pace is None else S.pace[i])
    assert S.load_s == pytest.approx(want, abs=TOL)


def run_through(pipes, node, rng: random.Random) -> int:
    """A whole run with random options, the state checked at every event; events seen."""
    cache = SchedulerCache()
    P = cache.problem(tuple((ps.graph, tuple(ps.devices)) for ps in pipes), node)
    ctx = act.Context(PRIOR, SchedulerConfig(), node, cache, pipes)
    S = act.initial(P, pipes, 0.0, ctx)
    events = 0
    while True:
        dec = act.settle(P, S, ctx, advance_time=False)
        if dec is not None:
            act.apply(P, S, ctx, dec[0], rng.choice(dec[1]))
            continue
        if not S.running:
            break
        check_loads(P, S)
        if events == 3:  # a merge grows a target's work left mid-run (set_remaining)
            i = min(S.running)
            st.set_remaining(P, S, i, S.rem_s[i] * 1.5)
            check_loads(P, S)
        at, ends = next_end(P, S)
        before = set(S.running)
        st.advance(P, S, ctx.balanced)
        assert S.now_s == pytest.approx(at, rel=1e-12, abs=1e-12)
        assert before - S.running == ends, "advance ended other tasks than the first to end"
        assert all(S.rem_s[i] > 0.0 for i in S.running)
        events += 1
    assert all(s == st.DONE for s in S.status)
    check_loads(P, S)
    return events


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", ["gangs", "mixed-dp", "multi-turn", "two-steps", "three"])
def test_every_event_ends_the_first_to_end_and_loads_stay_summed(family):
    rng = random.Random(family)
    events = sum(run_through(pipes, node, rng) for pipes, node in instances(family, 4, seed=3))
    assert events > 20


@pytest.mark.timeout(60)
def test_tasks_that_end_together_end_in_one_event():
    """Twin pipelines on their own devices: every piece ends beside its twin, in one event."""
    twins = [PipelineState(graph=grpo(random.Random(7), name, 2, 3), devices=devs)
             for name, devs in (("A", (0, 1)), ("B", (2, 3)))]
    node = NodeSpec(num_devices=4, mem_bytes=80 * 2**30)
    assert run_through(twins, node, random.Random(0)) > 3


@pytest.mark.timeout(120)
def test_ready_tasks_set_aside_on_full_devices_change_no_plan(monkeypatch):
    """Above _FEW_READY ready tasks, next_decision first drops those on full devices (in C):
    the same plans as testing every one of them."""
    from jigsaw.sim.execute import execute

    rng = random.Random(4)  # seed 4: gangs are ready beside more than _FEW_READY others, 6 times
    pipes = [PipelineState(graph=grpo(rng, name, 12, 3).then(grpo(rng, name, 12, 2, step=1)),
                           devices=tuple(range(12))) for name in "ABC"]
    node = NodeSpec(num_devices=12, mem_bytes=80 * 2**30)
    fast = execute(pipes, node, PRIOR, SchedulerConfig()).plans
    monkeypatch.setattr(act, "_FEW_READY", 10**9)
    assert execute(pipes, node, PRIOR, SchedulerConfig()).plans == fast
    monkeypatch.setattr(act, "_FEW_READY", 16)
    seen = []
    real = act._placeable
    monkeypatch.setattr(act, "_placeable", lambda P, S: seen.append(bool(S.ready & P.gangs)) or real(P, S))
    execute(pipes, node, PRIOR, SchedulerConfig())
    assert any(seen), "no gang was ready beside more than _FEW_READY others: the case is not exercised"
