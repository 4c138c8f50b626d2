"""One ledger: the live node is fed what the simulator is fed, and decides the same.

    simulated node (NodeSim, record=[...]) ─► every request its clients sent, and its plans
    the same requests, read by the real daemon in the same batches (tests/recorder.py)
        ─► the daemon's plan events == the simulator's plans, every one
    a daemon trace with an operator's migration ─► replay_decisions ─► every plan, that one too
"""

from dataclasses import replace

import msgspec
import pytest
from factories import colocated
from recorder import Recorder

from jigsaw import protocol as pr
from jigsaw.graph.plan import SchedulerConfig
from jigsaw.node.effects import Decision
from jigsaw.sim.node import NodeSim
from jigsaw.sim.replay import replay_decisions
from jigsaw.sim.report import Decided, Sent
from jigsaw.sim.run import build
from jigsaw.trace import Trace

pytestmark = pytest.mark.timeout(300)


def simulated(workloads: tuple[str, ...], gpus: int, steps: int) -> tuple[list, object, object]:
    """(what the simulator's clients sent and its decisions, the node grid, the node spec)."""
    runs, node, grid, policy = build(colocated(workload=workloads, gpus=gpus, steps=steps, trace=False))
    record: list = []
    NodeSim(runs, node, grid, policy, trace=False, record=record).run()
    return record, grid, node


def test_every_request_the_simulator_sends_is_a_valid_wire_message():
    """The simulator speaks the protocol as a worker does: each request survives the wire's
    schema and bounds (encoded, then decoded as the daemon decodes it) unchanged."""
    record, _, _ = simulated(("qwen3-4b-gsm8k-multiturn", "qwen3-0.6b-math"), 4, 2)
    sent = [e.request for e in record if isinstance(e, Sent)]
    kinds = {type(m).__name__ for m in sent}
    assert {"Register", "Forecast", "Admit", "Done", "Progress", "Samples", "Lengths"} <= kinds, kinds
    for msg in sent:
        assert pr.decode_request(pr.encode(msg)) == msg


def test_the_daemon_given_the_simulators_requests_makes_the_simulators_plans(tmp_path):
    """The real daemon (sessions, inbox, node state, policy, grants, trace) reads the requests
    a simulated node's clients sent, batch by batch as the simulator decided between them, on
    the simulator's clock: its plans are the simulator's, each one."""
    record, grid, node = simulated(("qwen3-0.6b-gsm8k", "qwen3-0.6b-gsm8k"), 2, 2)
    grid.save(tmp_path / "grid.json")
    d = Recorder(tmp_path / "rt", profile=tmp_path / "grid.json", devices=node.num_devices, max_wait_s=None,
                 lease_s=1e6, trace=tmp_path / "trace.jsonl")
    sessions, batch, expected = {}, [], []
    for e in record:
        if isinstance(e, Sent) and isinstance(e.request, pr.Register):
            sessions[e.pipeline] = d.register(e.pipeline, devices=e.request.devices, steps=e.request.steps,
                                              max_tokens=e.request.max_tokens)
        elif isinstance(e, Sent):
            batch.append(msgspec.structs.replace(e.request, session=sessions[e.pipeline]))
        else:
            d.time.t = 100.0 + e.t_s  # the daemon's clock starts at 100 (its t0): its now() is the simulator's
            d.deliver(batch)
            batch = []
            if e.plan is not None:
                expected.append((e.t_s, e.plan))
    d.trace_writer.close()
    plans = [(ev.t_s, {k: v for k, v in ev.data.items() if k != "decide_ms"})
             for ev in Trace.read(tmp_path / "trace.jsonl").events if ev.event == "plan"]
    assert len(expected) > 20
    assert len(plans) == len(expected)
    for (t, mine), (t_sim, theirs) in zip(plans, expected):
        assert t == pytest.approx(t_sim, abs=1e-9)
        assert mine == theirs, f"t={t_sim}: the daemon planned {mine}, the simulator {theirs}"
    assert not [r for _, r in d.sent if isinstance(r, pr.Error)]


def test_a_replay_applies_an_operators_migration_as_the_daemon_did(tmp_path):
    """A's rollout regimes run on both its DP ranks, B's training waits for device 1, where A's
    rank-1 tail runs.  An operator moves rank 1's requests to rank 0: device 1 is free, and the
    next plan gives B's training all of it.  The replay applies the order too (it re-decides
    nothing for it, and the plan after it finds device 1 free, as the daemon did)."""
    d = Recorder(tmp_path / "rt", devices=2, max_wait_s=None, lease_s=1e6, trace=tmp_path / "trace.jsonl",
                 sched=SchedulerConfig())
    a, b = d.register("A", owner="job-a", devices=(0, 1)), d.register("B", devices=(1,))
    tails = d.deliver([pr.Admit(session=a, kind="rollout_tail", dp_rank=r, step=0, req=10 + r) for r in (0, 1)])
    assert sorted(g.substage for g in tails if isinstance(g, pr.Grant)) == ["A/0/r0/rollout_tail/0",
                                                                           "A/0/r1/rollout_tail/0"]
    d.time.t += 1.0
    d.ask(pr.Admit(session=b, kind="training", dp_rank=0, step=0, req=20))
    d.time.t += 1.0
    (moved,) = d.ask(pr.Migrate(pipeline="A", source_rank=1, target_rank=0, owner="job-a", req=30), tick=False)
    assert isinstance(moved, pr.Migrated) and moved.source == "A/0/r1/rollout_tail/0"
    d._tick()  # the source's device is free: the daemon decides again
    d.time.t += 1.0
    d.ask(pr.Done(session=a, substage="A/0/r1/rollout_tail/0", final=True, req=31))  # its owner's late report
    d.trace_writer.close()
    trace = Trace.read(tmp_path / "trace.jsonl")
    b_grants = [e for e in trace.events if e.event == "grant" and e.pipeline == "B"]
    assert b_grants and b_grants[-1].sm_frac == 1.0, [(e.t_s, e.sm_frac) for e in b_grants]
    assert [e.event for e in trace.events].count("migrate") == 1
    got = replay_decisions(trace)
    assert got.plans == sum(e.event == "plan" for e in trace.events) and got.plans >= 3
    assert got.differ == 0, got.mismatches


def test_a_decision_is_frozen_and_says_everything_its_effects_need():
    """Acting on a decision never reads the node state again: it is frozen data (holders,
    budgets in bytes, owners, orders), and a later decision does not change an earlier one."""
    record, grid, node = simulated(("qwen3-0.6b-gsm8k",), 2, 1)
    from jigsaw.graph.policies import make
    from jigsaw.node.inputs import Inbox
    from jigsaw.node.state import NodeState

    state = NodeState(node, grid, make("jigsaw"))
    inbox = Inbox(state)
    decisions: list[Decision] = []
    for e in record:
        if isinstance(e, Sent) and isinstance(e.request, pr.Register):
            inbox.register(e.request)
        elif isinstance(e, Sent):
            inbox.take(e.pipeline, e.request, e.t_s)
        elif isinstance(e, Decided) and (dd := state.decide(e.t_s)) is not None:
            decisions.append(dd)
    first = decisions[0]
    snapshot = [(h.sid, h.budget, h.mem_bytes) for h in first.holders]
    assert snapshot and all(h.mem_bytes == round(h.budget.mem_frac * node.mem_bytes) for h in first.holders
                            if h.on_device)
    with pytest.raises((AttributeError, TypeError)):
        first.holders[0].budget = None
    assert [(h.sid, h.budget, h.mem_bytes) for h in first.holders] == snapshot  # later decisions left it alone
    assert all(set(x.held.sid for x in d.admitted) <= {h.sid for h in d.holders} for d in decisions)
    assert replace(first, notes=()).holders is first.holders


def test_what_the_node_learns_of_a_step_is_what_its_engines_did():
    """The node's history of a step is assembled from its workers' reports alone (as live), yet
    it is the step its engines ran (the builder's graph of their forward steps, the ground
    truth only the simulator has): the same pieces, the same counts, the same exclusive time
    within 1% for nearly every piece.  A regime's first steps, run before its worker told it
    apart, count for it and not for the one before; a migrated piece keeps its owner's counts."""
    runs, node, grid, policy = build(colocated(workload=("llama-3.1-8b-instruct-gsm8k",) * 2, gpus=8, steps=6,
                                               trace=False))
    sim = NodeSim(runs, node, grid, policy, trace=False)
    sim.run()
    pieces = close = 0
    for run in runs:
        truth = {g.steps[0]: g for g in run.builder.history(run.name)}
        for g in sim.state.pipelines[run.name].history:
            if g.steps[0] not in truth:  # the builder keeps fewer steps
                continue
            real = truth[g.steps[0]]
            assert {s.id for s in g} == {s.id for s in real}
            for s in g:
                r = real[s.id]
                if s.kind.is_rollout:  # the regime's forward steps, counted as its engine ran them
                    assert (s.num_steps, s.num_tokens) == (r.num_steps, r.num_tokens), s.id
                elif s.kind.on_device:  # a stage's tokens (the builder rounds them per interval)
                    assert s.num_tokens == pytest.approx(r.num_tokens, rel=0.01), s.id
                pieces += 1
                close += abs(s.duration_s - r.duration_s) <= 0.01 * r.duration_s + 1e-9
    assert pieces > 100 and close >= 0.95 * pieces, (close, pieces)
    assert sim.decisions and any(sim.state.pipelines[r.name].history for r in runs)
