"""The daemon's own logic under faults, driven message by message on scripted clocks.

The real `Daemon` (node state, policy, grants, leases, timers) with its socket replaced by a
list of what it sent (tests/recorder.py): every test here can say exactly which reply each
request got.
"""

from dataclasses import replace

import pytest
from recorder import Recorder, admit

from jigsaw import protocol as pr
from jigsaw.graph.plan import Assignment, Migration, Plan, SchedulerConfig
from jigsaw.node.state import NodeState
from jigsaw.runtime.daemon import Daemon, Inbound

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def d(tmp_path):
    return Recorder(tmp_path, devices=2)


# ------------------------------------------------------------------ item 2: no grant lost


def test_a_scheduler_that_fails_outright_answers_every_request_and_changes_nothing(d, monkeypatch):
    """A host request and a device request wait while the policy and its fallback both fail:
    both are answered (they run without the daemon), neither is left marked running."""
    s = d.register("A")
    assert d.ask(admit(s, "training", req=1)) and d.sent[-1][1].substage  # A trains: the node is busy
    d.ask(admit(s, "reward", req=2), tick=False)
    d.ask(admit(s, "reference", req=3), tick=False)
    d.sent.clear()

    def broken(*a, **k):
        raise ZeroDivisionError("bug")

    monkeypatch.setattr(d.state.policy, "plan", broken)
    monkeypatch.setattr(NodeState, "_fallback", broken)
    d._tick()
    replies = {r.req: r for _, r in d.sent}
    assert set(replies) == {2, 3}, replies  # the reward's host admission was not thrown away
    assert all(isinstance(r, pr.Error) and r.code == "scheduler" for r in replies.values())
    p = d.state.pipelines["A"]
    assert list(p.running) == ["A/0/r0/training/0"] and not p.waiting


def test_an_applier_that_fails_midway_leaves_the_facts_as_they_were(d, monkeypatch):
    """The policy's plan is refused by the applier after the host work was admitted: the
    fallback decides from the untouched facts and every request gets its Grant."""
    s = d.register("A")
    d.ask(admit(s, "reward", req=1), tick=False)
    d.ask(admit(s, "training", req=2), tick=False)

    planned = []

    def absurd(view):
        planned.append(w := "A/0/r0/training/0")
        return Plan(time_s=view.time_s, started=(w,), assignments=(
            Assignment(substage=w, pipeline="A", device=0, sm_frac=1.0, mem_bytes=1, slowdown=1.0, micro_batch=-5),))

    monkeypatch.setattr(d.state.policy, "plan", absurd)
    d._tick()
    assert planned and not d.state.pipelines["A"].waiting
    grants = {r.req: r for _, r in d.sent if isinstance(r, pr.Grant)}
    assert set(grants) == {1, 2}
    assert grants[2].micro_batch is None and grants[2].sm_frac == 1.0  # the fallback's, not the absurd plan's


# ------------------------------------------------------------------ item 3: absurd reports


def test_absurd_requests_are_refused_and_scheduling_goes_on(d):
    s = d.register("A")
    (r,) = d.ask(admit(s, "training", mem_bytes=1 << 49, req=1))
    assert isinstance(r, pr.Error) and r.code == "bad-request" and "bytes" in r.message
    (g,) = d.ask(admit(s, "training", step=0, req=2))
    assert isinstance(g, pr.Grant)
    (r,) = d.ask(admit(s, "reference", step=10**9, req=3))  # would wedge the step counter
    assert isinstance(r, pr.Error) and r.code == "bad-request" and "jumps" in r.message
    d.ask(pr.Done(session=s, substage=g.substage, batch_size=1e9, seq_len=1e9, req=4))
    (g,) = d.ask(admit(s, "rollout_decode", step=1, req=5))  # the next step still schedules
    assert isinstance(g, pr.Grant) and g.substage == "A/1/r0/rollout_decode/0"
    assert all(not isinstance(r, pr.Error) or r.code != "internal" for _, r in d.sent)
    assert d.state.pipelines["A"].step == 1


# ------------------------------------------------------------------ item 4: owners


def test_a_name_held_by_another_job_is_refused_and_its_grants_stay(d):
    mine = d.register("A", owner="t" * 32)
    (g,) = d.ask(admit(mine, "training", req=1))
    assert isinstance(g, pr.Grant)
    for stranger in ("u" * 32, ""):
        (r,) = d.ask(pr.Register(pipeline="A", pid=1, owner=stranger, req=2))
        assert isinstance(r, pr.Error) and r.code == "name-taken" and "jigsaw run --name" in r.message
    assert list(d.state.pipelines["A"].running) == [g.substage]
    worker = d.register("A", owner="t" * 32)  # a process of the same job joins
    assert d.ask(pr.Unregister(session=worker, req=3)) == [pr.Ok(req=3)]
    assert list(d.state.pipelines["A"].running) == [g.substage]
    d.ask(pr.Unregister(session=mine, pipeline_done=True, req=4))
    assert d.register("A", owner="v" * 32)  # the name is free once its job left


# ------------------------------------------------------------------ item 5: leases and timers


def test_a_stall_of_the_daemon_does_not_expire_clients_that_kept_sending(d):
    alive, dead = d.register("A"), d.register("B")
    d.time.t += 0.9
    d.beat(alive)
    d.beat(dead)
    d._tick()
    d.time.t += 5.0  # SIGSTOP, or a decision that took 5 s: nothing was read meanwhile
    d._tick()
    assert set(s.pipeline for s in d.sessions.values()) == {"A", "B"}
    d.beat(alive)  # its heartbeats queued during the stall arrive now
    d.run_for(d.config.lease_s + 0.2, beating=[alive])
    assert [s.pipeline for s in d.sessions.values()] == ["A"]  # B really went silent: it expires


def test_a_long_decision_does_not_expire_clients_whose_heartbeats_it_held_up(d, monkeypatch):
    s = d.register("A")
    decide = d.state.decide

    def slow(now_s):
        d.time.t += 3.0  # the decision takes 3 s of the daemon's time
        return decide(now_s)

    monkeypatch.setattr(d.state, "decide", slow)
    d.ask(admit(s, "training", req=1))
    assert [x.pipeline for x in d.sessions.values()] == ["A"]


def test_a_silent_holder_loses_its_grants_one_lease_after_its_last_message(tmp_path):
    """What a killed worker costs the node (test_runtime.py kills a real one): its grant is
    reclaimed by the first loop turn past one lease since its last message, not before, and
    a request waiting for the device gets it then."""
    # With the pair filter on, two trainings (which pack badly) are never co-located by choice.
    d = Recorder(tmp_path, devices=1, max_wait_s=None, sched=SchedulerConfig(min_pack_efficiency=1.25))
    a, b = d.register("A"), d.register("B")
    d.run_for(0.5, beating=[a, b])  # its last message comes later than the daemon's start
    (held,) = d.ask(admit(a, "training", req=1))
    assert isinstance(held, pr.Grant)
    assert d.ask(admit(b, "training", req=2)) == []  # B waits for A's device
    d.run_for(d.config.lease_s - 0.05, beating=[b])  # A says nothing more from here on
    assert sorted(s.pipeline for s in d.sessions.values()) == ["A", "B"]
    assert not [x for _, x in d.sent if getattr(x, "req", None) == 2]
    d.run_for(0.1, beating=[b])
    assert [s.pipeline for s in d.sessions.values()] == ["B"] and "A" not in d.state.pipelines
    (g,) = [x for _, x in d.sent if getattr(x, "req", None) == 2]
    assert isinstance(g, pr.Grant) and g.substage == "B/0/r0/training/0" and g.sm_frac == 1.0


def test_a_request_past_max_wait_is_admitted_by_the_loops_timer_alone(tmp_path):
    # With the pair filter on, two trainings (which pack badly) are never co-located by choice.
    d = Recorder(tmp_path, devices=1, max_wait_s=2.0, sched=SchedulerConfig(min_pack_efficiency=1.25))
    a, b = d.register("A"), d.register("B")
    d.ask(admit(a, "training", req=1))
    assert d.ask(admit(b, "training", req=2)) == []  # B waits for A
    d.run_for(1.9, beating=[a, b])
    assert not [x for _, x in d.sent if getattr(x, "req", None) == 2]
    d.run_for(0.2, beating=[a, b])  # heartbeats only: the loop's own timer admits it
    (g,) = [x for _, x in d.sent if getattr(x, "req", None) == 2]
    assert isinstance(g, pr.Grant) and g.substage == "B/0/r0/training/0"


def test_decisions_are_coalesced_and_heartbeats_served_first(d, monkeypatch):
    sessions = [d.register(f"P{i}") for i in range(6)]
    calls = []
    decide = d.state.decide
    monkeypatch.setattr(d.state, "decide", lambda now: calls.append(now) or decide(now))
    d.sent.clear()
    batch = [Inbound(1, admit(s, "training", req=i), d.time()) for i, s in enumerate(sessions)]
    batch.insert(1, Inbound(1, pr.StepEnd(session=sessions[0], step=0, req=50), d.time()))
    batch.insert(3, Inbound(2, pr.Heartbeat(session=sessions[0], req=99), d.time()))
    d._serve(batch)
    assert [r.req for _, r in d.sent] == [99, 50]  # the heartbeat first, though it came later
    d._tick()
    assert len(calls) == 1  # six requests, one decision


# ------------------------------------------------------------------ item 6: memory


def test_nothing_is_kept_for_pipelines_that_left(d):
    for i in range(300):
        s = d.register(f"P{i}", owner=str(i))
        d.ask(admit(s, "training", req=1))
        d.ask(pr.Unregister(session=s, pipeline_done=True, req=2))
    assert not d.sessions and not d.state.pipelines and not d.owners and not d.step_start


# ------------------------------------------------------------------ the daemon never dies


def test_a_bug_in_one_request_is_answered_and_the_daemon_serves_on(d, monkeypatch):
    s = d.register("A")
    monkeypatch.setattr(Daemon, "_step_end", lambda self, msg, session: 1 / 0)
    (r,) = d.ask(pr.StepEnd(session=s, step=0, req=5))
    assert isinstance(r, pr.Error) and r.code == "internal" and r.req == 5
    assert isinstance(d.ask(pr.Status(req=6))[0], pr.StatusReply)


# ------------------------------------------------------------------ migrations reach their source


def test_a_migration_order_reaches_the_sources_owner_and_its_late_end_is_a_no_op(d, monkeypatch):
    """Replica 1's tail is merged into replica 0's: replica 1's own session (not only the
    target's) is told, with no budget and the order; the trace says the source let its device
    go; its later Done is answered Ok and ends nothing else."""
    s0, s1 = d.register("A"), d.register("A")
    d.ask(admit(s0, "rollout_tail", rank=0, req=1))
    d.ask(admit(s1, "rollout_tail", rank=1, req=2))
    src, tgt = "A/0/r1/rollout_tail/0", "A/0/r0/rollout_tail/0"
    assert set(d.state.pipelines["A"].running) == {src, tgt}
    d.sent.clear()
    real = d.state.policy.plan

    def merging(view):
        plan = real(view)
        return replace(plan, migrations=(Migration(pipeline="A", source=src, target=tgt, source_rank=1,
                                                   target_rank=0, delta_s=0.5, target_remaining_s=1.0),))

    ev = []
    monkeypatch.setattr(d, "_event", lambda event, pipeline, substage="", **kw: ev.append(
        {"event": event, "substage": substage, "data": kw.get("data", {})}))
    monkeypatch.setattr(d.state.policy, "plan", merging)
    d.ask(admit(s0, "reward", req=3))  # any request makes the daemon decide again
    monkeypatch.setattr(d.state.policy, "plan", real)
    beats = [r for r in d.ask(pr.Heartbeat(session=s1), tick=False) if isinstance(r, pr.Beat)]
    told = [g for b in beats for g in b.grants if g.substage == src]
    assert told and told[0].sm_frac == 0.0 and told[0].migrations == (
        pr.MigrationOrder(source=src, target=tgt, source_rank=1, target_rank=0),)
    assert src not in d.state.pipelines["A"].running and tgt in d.state.pipelines["A"].running
    assert [e["substage"] for e in ev if e["event"] == "migration"] == [src]
    # the event names the ranks too (an operator's order may name no target sub-stage)
    assert [(e["data"]["source_rank"], e["data"]["target_rank"]) for e in ev if e["event"] == "migration"] == [(1, 0)]
    assert any(e["event"] == "release" and e["substage"] == src and e["data"].get("migrated") for e in ev)
    assert isinstance(d.ask(pr.Done(session=s1, substage=src, final=True, req=4))[-1], pr.Ok)
    assert tgt in d.state.pipelines["A"].running


def test_an_operators_migration_reaches_the_source_and_one_that_cannot_move_changes_nothing(d):
    token = "t" * 32
    s0, s1 = d.register("A", owner=token), d.register("A", owner=token)
    d.ask(admit(s0, "rollout_tail", rank=0, req=1))
    d.ask(admit(s1, "reference", rank=1, req=2))
    before = set(d.state.pipelines["A"].running)
    for bad, why in [(pr.Migrate(pipeline="B", source_rank=1, target_rank=0, owner=token, req=3), "no pipeline"),
                     (pr.Migrate(pipeline="A", source_rank=1, target_rank=0, owner=token, req=4),
                      "no rollout running on DP rank 1"),
                     (pr.Migrate(pipeline="A", source_rank=0, target_rank=0, owner=token, req=5),
                      "from one to another"),
                     (pr.Migrate(pipeline="A", source_rank=0, target_rank=7, owner=token, req=6), "DP ranks 0..1")]:
        (reply,) = d.ask(bad)
        assert isinstance(reply, pr.Error) and reply.code == "bad-request" and why in reply.message, reply
    (reply,) = d.ask(pr.Migrate(pipeline="A", source_rank=0, target_rank=1, req=9))  # no owner token
    assert isinstance(reply, pr.Error) and reply.code == "name-taken"
    assert set(d.state.pipelines["A"].running) == before  # refused: nothing moved, nothing ended
    (reply,) = [r for r in d.ask(pr.Migrate(pipeline="A", source_rank=0, target_rank=1, owner=token, req=7))
                if isinstance(r, pr.Migrated)]
    assert reply.source == "A/0/r0/rollout_tail/0" and reply.target == ""  # rank 1 runs no rollout: it asks anew
    (beat,) = [r for r in d.ask(pr.Heartbeat(session=s0), tick=False) if isinstance(r, pr.Beat)]
    (told,) = [g for g in beat.grants if g.substage == reply.source]
    assert told.sm_frac == 0.0 and [(m.source_rank, m.target_rank) for m in told.migrations] == [(0, 1)]
    assert reply.source not in d.state.pipelines["A"].running
    assert isinstance(d.ask(pr.Done(session=s0, substage=reply.source, final=True, req=8))[-1], pr.Ok)


def test_a_migration_the_applier_ignores_is_neither_traced_nor_told(d, monkeypatch):
    """A plan may merge into a tail that has not asked yet (its prediction): the applier
    ignores it, and nothing says it happened."""
    s1 = d.register("A")
    d.ask(admit(s1, "rollout_tail", rank=1, req=1))
    src, absent = "A/0/r1/rollout_tail/0", "A/0/r0/rollout_tail/0"
    real = d.state.policy.plan
    monkeypatch.setattr(d.state.policy, "plan", lambda view: replace(real(view), migrations=(
        Migration(pipeline="A", source=src, target=absent, source_rank=1, target_rank=0, delta_s=0.5,
                  target_remaining_s=1.0),)))
    ev = []
    monkeypatch.setattr(d, "_event", lambda event, pipeline, substage="", **kw: ev.append(event))
    d.ask(admit(s1, "reward", req=2))
    beats = [r for r in d.ask(pr.Heartbeat(session=s1), tick=False) if isinstance(r, pr.Beat)]
    assert "migration" not in ev and not any(g.migrations for b in beats for g in b.grants)
    assert src in d.state.pipelines["A"].running
