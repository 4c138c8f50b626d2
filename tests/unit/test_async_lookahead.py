"""The look-ahead sees an asynchronous job's sample buffer: its edges, the Problem's links, the
node's view and the graph executor's world."""

from __future__ import annotations

import pytest
from factories import GIB, NODE, rollout, synthetic_grid, training

from jigsaw.graph import state as st
from jigsaw.graph.buffer import buffer_edges
from jigsaw.graph.plan import NodeSpec, PipelineState, SchedulerConfig
from jigsaw.graph.policies import make
from jigsaw.graph.problem import SchedulerCache
from jigsaw.graph.substage import SubStageKind as K
from jigsaw.node.state import NodeState
from jigsaw.sim.execute import execute

pytestmark = pytest.mark.timeout(60)
GRID = synthetic_grid()
TWO = NodeSpec(num_devices=2, mem_bytes=80 * GIB)


@pytest.mark.parametrize("k", [0, 1, 2])
def test_each_training_step_waits_for_its_batch_and_each_round_for_its_weights(k):
    R, T = rollout("J", 4, 2.0, 1.0, ranks=2), training("J.train", 4, 3.0, ranks=2)
    want = {(f"J/{n}/r{a}/rollout_tail/0", f"J.train/{n}/r{b}/reference/0")
            for n in range(4) for a in (0, 1) for b in (0, 1)}
    want |= {(f"J.train/{n - k - 1}/r{a}/training/0", f"J/{n}/r{b}/rollout_decode/0")
             for n in range(k + 1, 4) for a in (0, 1) for b in (0, 1)}
    assert set(buffer_edges(R, T, k)) == want
    # a step one graph no longer holds (finished) waits on nothing and is waited on by nothing
    late = training("J.train", 2, 3.0, ranks=2, first=2)
    assert {b.split("/")[1] for _, b in buffer_edges(R, late, k) if b.startswith("J.train/")} == {"2", "3"}
    assert all(int(a.split("/")[1]) >= 2 for a, b in buffer_edges(R, late, k) if b.startswith("J/"))


def _one_round():
    """One round (decode 2 s, tail 3 s) and the training step of its batch (reference 1 s,
    training 5 s), on one device each."""
    return (PipelineState(graph=rollout("J", 1, 2.0, 3.0), devices=(0,)),
            PipelineState(graph=training("J.train", 1, 5.0), devices=(1,)))


def test_a_link_carries_the_critical_path_across_the_buffer_and_leaves_shared_tasks_alone():
    cache = SchedulerCache()
    r, t = _one_round()
    graphs = ((r.graph, (0,)), (t.graph, (0,)))
    links = buffer_edges(r.graph, t.graph, 1)
    P = cache.problem(graphs, NODE, links)
    decode, tail, ref, _ = P.tasks
    assert decode.tail_s == pytest.approx(3.0 + 1.0 + 5.0)  # the batch's tail, then its training
    assert tail.succs == (ref.idx,) and ref.preds == (tail.idx,)
    assert tail.step_tail_s == 0.0  # the round's own step ends with its tail (its SLO deadline)
    alone = cache.problem(graphs, NODE)  # the same graphs' tasks, never linked
    assert alone.tasks[0].tail_s == pytest.approx(3.0) and alone.tasks[1].succs == ()


def test_links_that_make_a_cycle_are_refused():
    r, t = _one_round()
    links = (("J/0/r0/rollout_tail/0", "J.train/0/r0/reference/0"),
             ("J.train/0/r0/training/0", "J/0/r0/rollout_decode/0"))  # a batch waiting on its own training
    with pytest.raises(ValueError, match="cycle"):
        SchedulerCache().problem(((r.graph, (0,)), (t.graph, (1,))), TWO, links)


def test_a_training_step_is_not_ready_before_its_batch_is_generated():
    r, t = _one_round()
    graphs = ((r.graph, (0,)), (t.graph, (1,)))
    for links, ready in (((), {0, 2}), (buffer_edges(r.graph, t.graph, 1), {0})):
        P = SchedulerCache().problem(graphs, TWO, links)
        assert st.initial_state(P, [r, t], 0.0, True).ready == ready


def _node(*sides: tuple[str, str, str], devices=((0,), (1,))) -> NodeState:
    ns = NodeState(TWO, GRID, make("jigsaw", SchedulerConfig()), next_step=False)
    graphs = {"J": rollout("J", 3, 2.0, 3.0), "J.train": training("J.train", 3, 5.0)}
    for (name, job, mode), devs in zip(sides, devices):
        ns.register(name, devs, static=graphs[name], steps=1, job=job, mode=mode, staleness=1 if mode else 0)
    return ns


def test_the_node_view_links_a_jobs_sides_once_one_side_said_its_mode():
    ns = _node(("J", "", ""), ("J.train", "J", "one-step-off"))  # `jigsaw run` registered the rollout side
    ns.request("J", K.ROLLOUT_DECODE, 0, 0, 0.0, sid="J/0/r0/rollout_decode/0")
    view, _ = ns.view(0.0)
    (r,), (t,) = view.pipelines, view.waiting  # the training side asks for nothing: it waits for batch 0
    assert set(t.waits_for) == {(f"J/{n}/r0/rollout_tail/0", f"J.train/{n}/r0/reference/0") for n in range(3)}
    # one step off: round 2 generates under the weights of step 0
    assert r.waits_for == (("J.train/0/r0/training/0", "J/2/r0/rollout_decode/0"),)
    assert sorted(p.name for p in ns.groups()[0]) == ["J", "J.train"]  # planned together, devices apart
    assert [a.substage for a in ns.decide(0.0).plan.assignments] == ["J/0/r0/rollout_decode/0"]
    blind = _node(("J", "", ""), ("J.train", "J", ""))
    blind.request("J", K.ROLLOUT_DECODE, 0, 0, 0.0, sid="J/0/r0/rollout_decode/0")
    view, _ = blind.view(0.0)
    assert not view.waiting and not view.pipelines[0].waits_for  # no mode said: no bound known
    blind.couple("J", "one-step-off", 1)  # the rollout side's own client says it later
    view, _ = blind.view(0.0)
    assert view.waiting[0].waits_for == t.waits_for
    with pytest.raises(ValueError, match="not a coupling"):
        blind.couple("J", "two-step", 1)


def test_an_idle_side_whose_next_piece_waits_on_nothing_is_left_out_of_the_view():
    ns = _node(("J", "J", "one-step-off"), ("J.train", "J", "one-step-off"))
    for sid in ("J/0/r0/rollout_decode/0", "J/0/r0/rollout_tail/0"):
        ns.request("J", K.ROLLOUT_DECODE if "decode" in sid else K.ROLLOUT_TAIL, 0, 0, 0.0, sid=sid)
        ns.decide(0.0)
        ns.finish("J", sid, 1.0)
    ns.request("J", K.ROLLOUT_DECODE, 0, 1, 1.0, sid="J/1/r0/rollout_decode/0")
    # batch 0 is in the buffer: the training side may begin at once, yet asked for nothing; a
    # plan must not start what nobody asked for, so the look-ahead does not see it
    view, _ = ns.view(1.0)
    assert [ps.graph.pipeline for ps in view.pipelines] == ["J"] and view.waiting == ()


def _pair(told: bool):
    """Device 0: job J's rollout side beside a synchronous pipeline B; device 1: J's training
    side (8 s a step), which waits for J's batch of each round (one-step off-policy)."""
    ps = [PipelineState(graph=rollout("J", 2, 4.0, 6.0), devices=(0,)),
          PipelineState(graph=training("J.train", 2, 8.0), devices=(1,)),
          PipelineState(graph=rollout("B", 2, 4.0, 6.0, train_s=6.0), devices=(0,))]
    return execute(ps, TWO, GRID, jobs={"J": ("one-step-off" if told else "", 1)})


def test_a_scheduler_that_sees_the_buffer_hides_the_training_behind_the_other_pipeline():
    told, blind = _pair(True), _pair(False)
    for ex in (told, blind):  # the world holds the buffer either way
        start = {iv.substage: iv.start_s for iv in reversed(ex.intervals)}
        end = {iv.substage: iv.end_s for iv in ex.intervals}
        for n in (0, 1):
            assert start[f"J.train/{n}/r0/reference/0"] >= end[f"J/{n}/r0/rollout_tail/0"] - 1e-9
        assert start["J/1/r0/rollout_decode/0"] < end["J.train/0/r0/training/0"]  # one step off: it overlaps
    # Seeing that J's batch unlocks 8 s of training on the other device, the scheduler finishes
    # it first; blind to the buffer, it thinks the training could start at once.
    assert told.makespan_s < 0.95 * blind.makespan_s, (told.makespan_s, blind.makespan_s)


def test_the_world_lets_a_round_start_only_under_weights_within_its_bound():
    ps = [PipelineState(graph=rollout("J", 3, 1.0, 1.0), devices=(0,)),
          PipelineState(graph=training("J.train", 3, 6.0), devices=(1,))]
    ex = execute(ps, TWO, GRID, jobs={"J": ("one-step-off", 0)})  # bound 0: round n after step n - 1
    start = {iv.substage: iv.start_s for iv in reversed(ex.intervals)}
    end = {iv.substage: iv.end_s for iv in ex.intervals}
    for n in (1, 2):
        assert start[f"J/{n}/r0/rollout_decode/0"] >= end[f"J.train/{n - 1}/r0/training/0"] - 1e-9


def test_a_piece_that_asked_waits_on_nothing_though_the_other_sides_report_is_late():
    ns = _node(("J", "J", "one-step-off"), ("J.train", "J", "one-step-off"))
    ns.request("J", K.ROLLOUT_DECODE, 0, 0, 0.0, sid="J/0/r0/rollout_decode/0")
    ns.decide(0.0)
    ns.finish("J", "J/0/r0/rollout_decode/0", 1.0)
    ns.request("J", K.ROLLOUT_TAIL, 0, 0, 1.0, sid="J/0/r0/rollout_tail/0")
    ns.decide(1.0)
    # the training side's client saw batch 0 in the buffer before the rollout side's Done came
    ns.request("J.train", K.REFERENCE, 0, 0, 2.0, sid="J.train/0/r0/reference/0")
    view, _ = ns.view(2.0)
    t = next(ps for ps in view.pipelines if ps.graph.pipeline == "J.train")
    assert {b for _, b in t.waits_for} == {"J.train/1/r0/reference/0", "J.train/2/r0/reference/0"}
    assert "J.train/0/r0/reference/0" in {a.sid for a in ns.decide(2.0).admitted}
