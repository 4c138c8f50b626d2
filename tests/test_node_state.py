"""The daemon's decisions without I/O: live graphs from history, admissions, leases."""

from pathlib import Path

import pytest

from jigsaw.graph.plan import Assignment, NodeSpec
from jigsaw.mux.slowdown import load_grid
from jigsaw.runtime.node import NodeState, live_state

PRIOR = load_grid(Path(__file__).resolve().parents[1] / "profiles" / "h100" / "qwen3-4b.prior.json")
KINDS = ("rollout_decode", "rollout_tail", "training")


def fresh(devices: int = 1) -> NodeState:
    return NodeState(NodeSpec(num_devices=devices, mem_bytes=PRIOR.device.mem_bytes), PRIOR)


def run_step(ns: NodeState, session: str, step: int, t: float, dur_s: float = 1.0) -> float:
    """Ask, get admitted, finish each kind in turn (alone on the node)."""
    for kind in KINDS:
        sid = ns.request(session, kind, 0, step, b"id", 1, t)
        d = ns.decide(t)
        assert [a.pending.sid for a in d.admitted] == [sid]
        t += dur_s
        ns.finish(session, sid, t)
    return t


def test_history_predicts_the_step_and_requested_substages_are_ready():
    ns = fresh()
    ns.register("A", "s", ())
    t = run_step(ns, "s", 0, 0.0)
    p = ns.pipelines["A"]
    ns.request("s", "rollout_tail", 0, 1, b"id", 2, t)  # skips the predicted decode regime
    state = live_state(p, t)
    assert {s.id for s in state.graph} == {f"A/1/r0/{k}/0" for k in KINDS}
    assert state.graph["A/1/r0/training/0"].duration_s == pytest.approx(1.0)
    assert "A/1/r0/rollout_decode/0" in state.done  # went past it: it will not be asked for
    assert [s.id for s in state.graph.frontier(state.done)] == ["A/1/r0/rollout_tail/0"]


def test_two_pipelines_share_a_device_and_budgets_sum_to_one():
    ns = fresh()
    for name in "AB":
        ns.register(name, name.lower(), ())
        run_step(ns, name.lower(), 0, 0.0)
    ns.request("a", "rollout_tail", 0, 1, b"a", 1, 10.0)
    ns.request("b", "training", 0, 1, b"b", 1, 10.0)
    d = ns.decide(10.0)
    admitted = {a.pending.sid: a.assignment for a in d.admitted}
    assert set(admitted) == {"A/1/r0/rollout_tail/0", "B/1/r0/training/0"}
    assert sum(a.sm_frac for a in admitted.values()) <= 1.0 + 1e-9
    assert sum(a.mem_bytes for a in admitted.values()) <= PRIOR.device.mem_bytes
    assert all(a.sm_frac < 1.0 for a in admitted.values())


def test_a_request_is_never_left_waiting_on_an_idle_device():
    ns = fresh()
    ns.register("A", "s", ())
    sid = ns.request("s", "reward", 0, 0, b"x", 1, 0.0)  # a host kind the scheduler may defer
    d = ns.decide(0.0)
    assert sid in {a.pending.sid for a in d.admitted}


def test_a_dropped_client_gives_its_grants_back_and_bad_requests_say_why():
    ns = fresh(devices=2)
    ns.register("A", "s", (0, 1))
    with pytest.raises(ValueError, match="dp_rank 2"):
        ns.request("s", "training", 2, 0, b"x", 1, 0.0)
    with pytest.raises(ValueError, match="outside this node"):
        ns.register("B", "t", (3,))
    with pytest.raises(KeyError):
        ns.request("nobody", "training", 0, 0, b"x", 1, 0.0)
    sid = ns.request("s", "training", 0, 0, b"x", 1, 0.0)
    ns.decide(0.0)
    with pytest.raises(ValueError, match="not running for this session"):
        ns.finish("s", "A/0/r0/training/9", 1.0)
    runs, _, gone = ns.drop("s")
    assert [r.sid for r in runs] == [sid] and gone and not ns.pipelines


def test_collective_replicas_ask_and_finish_one_by_one():
    ns = fresh(devices=2)
    ns.register("A", "s", (0, 1))
    t = 0.0
    for step in range(2):
        first = ns.request("s", "training", 0, step, b"x", 1, t)
        assert [a.pending.sid for a in ns.decide(t).admitted] == [first]
        t += 1.0
        ns.finish("s", first, t)  # rank 0 is done before rank 1 even asks
        second = ns.request("s", "training", 1, step, b"y", 2, t)
        assert [a.pending.sid for a in ns.decide(t).admitted] == [second]
        t += 1.0
        ns.finish("s", second, t)
        host = ns.request("s", "reward", 0, step, b"z", 3, t)
        assert [a.assignment.sm_frac for a in ns.decide(t).admitted if a.pending.sid == host] == [0.0]
        ns.finish("s", host, t + 0.5)
    assert len(ns.pipelines["A"].history) == 1


def test_a_failing_partitioner_leaves_budgets_advisory(tmp_path):
    from jigsaw.runtime.daemon import Daemon, DaemonConfig

    class BrokenPartitioner:
        def apply(self, device, budgets):
            raise ValueError("no such partition")

    d = Daemon(DaemonConfig(), directory=tmp_path, partitioner=BrokenPartitioner())
    parts = d._partitions([Assignment(substage="A/0/r0/training/0", pipeline="A", device=0, sm_frac=0.5,
                                      mem_bytes=1, slowdown=1.0)])
    assert parts == {"A/0/r0/training/0": {"kind": "advisory", "sm_frac": "0.5"}}
