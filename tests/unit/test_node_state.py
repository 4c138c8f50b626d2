"""The node state both the daemon and the simulator decide with: facts, the view, the applier."""


import pytest

from jigsaw.graph.plan import NodeSpec, SchedulerConfig
from jigsaw.graph.policies import make
from jigsaw.graph.substage import SubStageKind as K
from jigsaw.mux.model.slowdown import load_grid
from jigsaw.node.state import NodeState
from jigsaw.node.view import pipeline_state

PRIOR = load_grid("h100/qwen3-4b")
KINDS = (K.ROLLOUT_DECODE, K.ROLLOUT_TAIL, K.TRAINING)


def fresh(devices: int = 1, policy: str = "jigsaw", **kw) -> NodeState:
    return NodeState(NodeSpec(num_devices=devices, mem_bytes=PRIOR.device.mem_bytes), PRIOR,
                     make(policy, SchedulerConfig()), **kw)


def run_step(ns: NodeState, name: str, step: int, t: float, dur_s: float = 1.0) -> float:
    """Ask, get admitted, finish each kind in turn (alone on the node)."""
    p = ns.pipelines[name]
    for kind in KINDS:
        w = ns.request(p.name, kind, 0, step, t)
        d = ns.decide(t)
        assert [a.sid for a in d.admitted] == [w.sid]
        t += dur_s
        ns.finish(name, w.sid, t)
    return t


def test_history_predicts_the_step_and_requested_substages_are_ready():
    ns = fresh()
    p = ns.register("A")
    t = run_step(ns, "A", 0, 0.0)
    w = ns.request(p.name, K.ROLLOUT_TAIL, 0, 1, t)  # skips the predicted decode regime
    state, progress = pipeline_state(p, t, next_step=False)
    assert {s.id for s in state.graph} == {f"A/1/r0/{k}/0" for k in KINDS}
    assert "A/1/r0/rollout_decode/0" in state.done  # went past it: it will not be asked for
    assert state.graph["A/1/r0/training/0"].duration_s == pytest.approx(1.0)  # from the history
    assert [s.id for s in state.graph.frontier(state.done)] == [w.sid]
    assert progress.stage == "rollout" and progress.step == 1 and progress.ready_since_s == t


def test_a_piece_the_prediction_lacks_runs_before_its_workers_predicted_chain():
    ns = fresh()
    p = ns.register("A")
    t = run_step(ns, "A", 0, 0.0)  # step 0 had no prefill on r0
    w = ns.request(p.name, K.ROLLOUT_PREFILL, 0, 1, t)
    state, _ = pipeline_state(p, t, next_step=False)
    assert w.sid in state.graph.deps["A/1/r0/rollout_decode/0"]  # the worker's chain goes on after it
    # only what was asked for is ready: a root decode piece could be started in its place
    assert [s.id for s in state.graph.frontier(state.done)] == [w.sid]
    assert [x.sid for x in ns.decide(t).admitted] == [w.sid]


def test_the_view_looks_past_the_step_barrier():
    ns = fresh()
    p = ns.register("A")
    t = run_step(ns, "A", 0, 0.0)
    ns.request(p.name, K.ROLLOUT_DECODE, 0, 1, t)
    state, _ = pipeline_state(p, t)
    nxt = [s for s in state.graph if s.step == 2]
    assert {s.kind for s in nxt} == {K.ROLLOUT_DECODE, K.TRAINING}  # this worker's rollout, summarised
    first = next(s for s in nxt if s.kind.is_rollout)
    assert set(state.graph.deps[first.id]) == {"A/1/r0/training/0"}  # behind this step's barrier
    alone, _ = pipeline_state(p, t, next_step=False)
    assert not [s for s in alone.graph if s.step == 2]


def test_remaining_time_is_the_prediction_less_the_work_done_at_the_granted_pace():
    ns = fresh()
    a, b = ns.register("A"), ns.register("B")
    for name in "AB":
        run_step(ns, name, 0, 0.0, dur_s=10.0)
    wa = ns.request(a.name, K.TRAINING, 0, 1, 100.0)
    ns.decide(100.0)
    wb = ns.request(b.name, K.ROLLOUT_TAIL, 0, 1, 100.0)
    ns.decide(100.0)
    r = a.running[wa.sid]
    assert r.budget.sm_frac < 1.0 and r.slowdown > 1.0  # the tail joined it: training is slowed
    state, _ = pipeline_state(a, 104.0)
    assert state.remaining_s[wa.sid] == pytest.approx(10.0 - 4.0 / r.slowdown)
    assert b.running[wb.sid].budget.sm_frac == pytest.approx(1.0 - r.budget.sm_frac)


def test_two_pipelines_share_a_device_and_budgets_sum_to_one():
    ns = fresh()
    for name in "AB":
        ns.register(name)
        run_step(ns, name, 0, 0.0)
    ns.request("A", K.ROLLOUT_TAIL, 0, 1, 10.0)
    ns.request("B", K.TRAINING, 0, 1, 10.0)
    d = ns.decide(10.0)
    admitted = {x.sid: x.assignment for x in d.admitted}
    assert set(admitted) == {"A/1/r0/rollout_tail/0", "B/1/r0/training/0"}
    assert sum(a.sm_frac for a in admitted.values()) <= 1.0 + 1e-9
    assert sum(a.mem_bytes for a in admitted.values()) <= PRIOR.device.mem_bytes
    assert all(a.sm_frac < 1.0 for a in admitted.values())
    assert not ns.overcommitted() and not d.notes


def test_host_work_is_admitted_at_once_and_a_running_tool_wait_holds_its_device():
    ns = fresh()
    p = ns.register("A")
    w = ns.request(p.name, K.REWARD, 0, 0, 0.0)
    assert w.sid in {x.sid for x in ns.decide(0.0).admitted}
    tool = ns.request(p.name, K.TOOL, 0, 0, 0.0)
    ns.decide(0.0)
    state, _ = pipeline_state(p, 0.5)
    assert tool.sid in state.running and tool.sid not in state.done  # it keeps its place


class OnlyUrgent:
    """A policy that starts only what must start (urgent) and defers the rest."""

    name = "only-urgent"
    separable = False

    def plan(self, view):
        from jigsaw.graph.plan import Assignment, Plan

        out = [Assignment(substage=sid, pipeline=ps.graph.pipeline, device=ps.devices[ps.graph[sid].dp_rank],
                          sm_frac=1.0, mem_bytes=view.node.mem_bytes, slowdown=1.0)
               for ps in view.pipelines for sid in sorted(ps.urgent)]
        return Plan(time_s=view.time_s, started=tuple(a.substage for a in out), assignments=tuple(out))


def test_liveness_admits_the_oldest_request_when_nothing_runs():
    def node(liveness: bool) -> tuple[NodeState, str]:
        ns = NodeState(NodeSpec(num_devices=1, mem_bytes=PRIOR.device.mem_bytes), PRIOR, OnlyUrgent(),
                       liveness=liveness)
        ns.register("A")
        ns.register("B")
        first = ns.request("A", K.TRAINING, 0, 0, 0.0)
        ns.request("B", K.TRAINING, 0, 0, 0.5)
        return ns, first.sid

    ns, first = node(liveness=True)
    assert [x.sid for x in ns.decide(1.0).admitted] == [first]  # nothing ran: the oldest starts
    ns, _ = node(liveness=False)
    assert not ns.decide(1.0).admitted  # without the guard the node would wait forever
    assert fresh().decide(0.0) is None  # an empty node decides nothing


class StartsWhatNobodyAsked:
    """A policy whose plan starts a sub-stage no pipeline requested."""

    name = "starts-what-nobody-asked"
    separable = False

    def plan(self, view):
        from jigsaw.graph.plan import Assignment, Plan

        a = Assignment(substage="A/0/r0/rollout_decode/9", pipeline="A", device=0, sm_frac=1.0,
                       mem_bytes=view.node.mem_bytes, slowdown=1.0)
        return Plan(time_s=view.time_s, started=(a.substage,), assignments=(a,))


def test_liveness_does_not_trust_a_plan_that_starts_nothing_asked_for():
    ns = NodeState(NodeSpec(num_devices=1, mem_bytes=PRIOR.device.mem_bytes), PRIOR, StartsWhatNobodyAsked(),
                   liveness=True)
    ns.register("A")
    w = ns.request("A", K.TRAINING, 0, 0, 0.0)
    d = ns.decide(1.0)
    assert [x.sid for x in d.admitted] == [w.sid] and "started nothing" in d.fallback


def test_a_request_waiting_too_long_turns_urgent():
    ns = NodeState(NodeSpec(num_devices=1, mem_bytes=PRIOR.device.mem_bytes), PRIOR, OnlyUrgent(), max_wait_s=2.0)
    ns.register("A")
    w = ns.request("A", K.TRAINING, 0, 0, 0.0)
    assert not ns.decide(1.9).admitted
    assert [x.sid for x in ns.decide(2.0).admitted] == [w.sid]


def test_a_failing_policy_falls_back_to_one_request_per_idle_device_alone():
    class Broken:
        name = "broken"
        separable = False

        def plan(self, view):
            raise ZeroDivisionError("bug")

    ns = NodeState(NodeSpec(num_devices=2, mem_bytes=PRIOR.device.mem_bytes), PRIOR, Broken())
    p = ns.register("A", (0, 1))
    a = ns.request(p.name, K.TRAINING, 0, 0, 0.0)
    b = ns.request(p.name, K.TRAINING, 1, 0, 0.1)
    q = ns.register("B", (0,))
    c = ns.request(q.name, K.ROLLOUT_TAIL, 0, 0, 0.2)
    host = ns.request(q.name, K.REWARD, 0, 0, 0.3)
    d = ns.decide(1.0)
    assert "ZeroDivisionError" in d.fallback
    assert {x.sid for x in d.admitted} == {a.sid, b.sid, host.sid}  # c waits: device 0 is taken
    assert c.sid in q.waiting and all(x.assignment.sm_frac in (0.0, 1.0) for x in d.admitted)


def test_the_fallback_starts_a_lockstep_gang_only_whole_and_the_policy_goes_on_after_it():
    ns = fresh(devices=2)
    ns.register("A", (0, 1)), ns.register("B", (1,))
    theirs = ns.request("B", K.TRAINING, 0, 0, 0.0, need_bytes=50 << 30)
    ns.decide(0.0)
    ranks = [ns.request("A", K.TRAINING, r, 0, 0.1, need_bytes=50 << 30) for r in (0, 1)]  # two do not fit a device
    real, ns.policy.plan = ns.policy.plan, lambda view: 1 / 0
    d = ns.decide(0.2)
    assert d.fallback and not d.admitted  # device 1 is B's: rank 0 alone would be half a gang
    ns.policy.plan = real
    assert ns.decide(0.3).fallback == "" and ns.failures == 1  # the policy plans on from a sound state
    ns.finish("B", theirs.sid, 1.0)
    ns.policy.plan = lambda view: 1 / 0
    d = ns.decide(1.0)
    assert {x.sid for x in d.admitted} == {w.sid for w in ranks}  # both devices idle: the whole gang


def test_bad_requests_say_why():
    ns = fresh(devices=2)
    p = ns.register("A", (0, 1))
    with pytest.raises(ValueError, match="dp_rank 2"):
        ns.request(p.name, K.TRAINING, 2, 0, 0.0)
    with pytest.raises(ValueError, match="on this node"):
        ns.register("B", (3,))
    with pytest.raises(ValueError, match="already registered"):
        ns.register("A", (0,))
    with pytest.raises(ValueError, match="may only hold"):
        ns.register("a/b")
    ns.request(p.name, K.TRAINING, 0, 1, 0.0)
    with pytest.raises(ValueError, match="already finished"):
        ns.request(p.name, K.TRAINING, 0, 0, 0.0)
    with pytest.raises(ValueError, match="not running"):
        ns.finish("A", "A/1/r0/training/9", 1.0)


def test_collective_replicas_ask_and_finish_one_by_one():
    ns = fresh(devices=2)
    p = ns.register("A", (0, 1))
    t = 0.0
    for step in range(2):
        first = ns.request(p.name, K.TRAINING, 0, step, t)
        assert [x.sid for x in ns.decide(t).admitted] == [first.sid]
        t += 1.0
        ns.finish("A", first.sid, t)  # rank 0 is done before rank 1 even asks
        state, _ = pipeline_state(p, t)
        assert f"A/{step}/r1/training/0" in state.running or step == 0  # the gang runs on, as predicted
        second = ns.request(p.name, K.TRAINING, 1, step, t)
        assert [x.sid for x in ns.decide(t).admitted] == [second.sid]
        t += 1.0
        ns.finish("A", second.sid, t)
    assert len(p.history) == 1


def test_groups_of_pipelines_sharing_no_device_are_planned_apart_and_fail_apart():
    ns = fresh(devices=4)
    for name, devices in (("A", (0, 1)), ("B", (1,)), ("C", (3,))):
        ns.register(name, devices)
    assert sorted(sorted(p.name for p in g) for g in ns.groups()) == [["A", "B"], ["C"]]
    seen = []
    real = ns.policy.plan

    def plan(view):
        names = {ps.graph.pipeline for ps in view.pipelines}
        seen.append(names)
        if "C" in names:
            raise ZeroDivisionError("C's facts broke it")
        return real(view)

    ns.policy.plan = plan
    wa, wc = ns.request("A", K.ROLLOUT_DECODE, 0, 0, 0.0, urgent=True), ns.request("C", K.TRAINING, 0, 0, 0.0)
    d = ns.decide(0.0)
    assert sorted(map(sorted, seen)) == [["A"], ["C"]]  # B asked for nothing: only live pipelines are in a view
    assert "ZeroDivisionError" in d.fallback and ns.failures == 1
    assert {x.sid for x in d.admitted} == {wa.sid, wc.sid}
    assert d.fallback.count("ZeroDivisionError") == 1  # A's group was planned by the policy, C's fell back
    serial = fresh(devices=4, policy="serial")
    serial.register("A", (0,))
    serial.register("C", (3,))
    assert not serial.policy.separable  # node-wide turns: planned as one


def test_a_pipeline_with_nothing_asked_is_working_on_the_host_and_keeps_its_cpu_share():
    """A registered pipeline that asks for nothing is in its own Python (between sub-stages,
    exiting): not in the view, yet on a CPU it uses its cores, so the other's training alone
    is kept to its half there.  Once it is gone, the training may take the whole device."""
    cpu = load_grid("cpu/tiny-qwen3")
    ns = NodeState(NodeSpec(num_devices=1, mem_bytes=cpu.device.mem_bytes), cpu,
                   make("jigsaw", SchedulerConfig(host_on_device=True)))
    a, _ = ns.register("A"), ns.register("B")
    w = ns.request(a.name, K.TRAINING, 0, 0, 0.0)
    d = ns.decide(0.0)
    assert [x.sid for x in d.admitted] == [w.sid] and d.admitted[0].assignment.sm_frac == 0.5
    ns.remove("B")
    d = ns.decide(0.1)
    assert [h.budget.sm_frac for h in d.changed] == [1.0]


def test_a_pipeline_waiting_in_a_tool_sub_stage_keeps_no_cpu_share():
    """A tool sub-stage is a wait on the host (a tool call; verl's trainer polling for its
    rollout): the other pipeline's training alone may take the whole CPU meanwhile, and is kept
    to its half again once the waiter is back in its own Python."""
    cpu = load_grid("cpu/tiny-qwen3")
    ns = NodeState(NodeSpec(num_devices=1, mem_bytes=cpu.device.mem_bytes), cpu,
                   make("jigsaw", SchedulerConfig(host_on_device=True)))
    a, b = ns.register("A"), ns.register("B")
    wait = ns.request(b.name, K.TOOL, 0, 0, 0.0)
    assert [x.sid for x in ns.decide(0.0).admitted] == [wait.sid]
    w = ns.request(a.name, K.TRAINING, 0, 0, 0.01)
    d = ns.decide(0.01)
    assert [x.sid for x in d.admitted] == [w.sid] and d.admitted[0].assignment.sm_frac == 1.0
    ns.finish("B", wait.sid, 0.02)
    d = ns.decide(0.02)
    assert [h.budget.sm_frac for h in d.changed] == [0.5]


def test_a_tool_that_computes_on_this_cpu_keeps_its_share_and_gets_the_free_cores():
    """A code tool run here (Admit.computes) is CPU work, not a wait: the other pipeline's
    training alone is kept to its half while it runs, and the grants engine puts the tool's
    processes on the half the training leaves free; alone, the tool gets every core."""
    from jigsaw.mux.partition.partitioners import CpuPartitioner
    from jigsaw.runtime import grants

    cpu = load_grid("cpu/tiny-qwen3")
    ns = NodeState(NodeSpec(num_devices=1, mem_bytes=cpu.device.mem_bytes), cpu,
                   make("jigsaw", SchedulerConfig(host_on_device=True)))
    parts = CpuPartitioner(1, cores=(0, 1))
    a, b = ns.register("A"), ns.register("B")
    tool = ns.request(b.name, K.TOOL, 0, 0, 0.0, computes=True)
    d = ns.decide(0.0)
    assert [x.sid for x in d.admitted] == [tool.sid]
    assert grants.make(d, parts).admitted[0].partition.cores == (0, 1)  # nothing else holds the CPU
    w = ns.request(a.name, K.TRAINING, 0, 0, 0.01)
    d = ns.decide(0.01)
    assert [x.sid for x in d.admitted] == [w.sid] and d.admitted[0].assignment.sm_frac == 0.5
    made = grants.make(d, parts)
    training = made.admitted[0].partition.cores
    [(held, moved)] = made.hosts
    assert held.sid == tool.sid and len(training) == 1 and moved.partition.cores == tuple({0, 1} - set(training))
    ns.finish("B", tool.sid, 0.02)
    assert grants.make(ns.decide(0.02), parts).hosts == ()  # it ended: nothing of it to move
