"""Two real node daemons (ThreadNodes, real sockets and clients) that form a cluster through
the controller's real body (tests/nodes.InProcessLink; over Ray in test_cluster_ray.py), and
two pipelines whose training gang spans both nodes, one rank on each.

Each rank's training waits in a barrier for its other rank, as an FSDP collective does.  The
daemons keep each pipeline's order (policy serial, no max-wait), so a node that started its
first asker's training beside the other node starting the other's deadlocks both pipelines:
checked to happen without the cluster (a rank gives up in its collective), and never with it,
in the crossed arrival order.
A node lost mid-wait: its partner's gang is refused and run there alone, nothing lost; so is
a gang whose other node is alive but never asks for its part (its rank runs without its daemon)."""

from __future__ import annotations

import threading
import time

import pytest
from nodes import Clock, InProcessLink, ThreadNode
from waiting import HANG_S, wait_until

from jigsaw.cluster.controller import Controller

pytestmark = pytest.mark.timeout(180)
CROSSED = [("X", "A"), ("Y", "B"), ("Y", "A"), ("X", "B")]
"""X asks first on A, Y first on B: each node would start a different pipeline's training."""
COLLECTIVE_S = 4.0
"""How long a rank waits in its collective for the other: past it, the pair is deadlocked."""


class Cluster:
    def __init__(self, tmp, spanning: bool, node_timeout_s: float = 60.0, **controller):
        self.body, lock = Controller(node_timeout_s=node_timeout_s, **controller), threading.Lock()
        self.links = {n: InProcessLink(self.body, n, lock) for n in "AB"}
        self.nodes = {n: ThreadNode(tmp / n, link=self.links[n], devices=1, policy="serial", max_wait_s=None)
                      for n in "AB"}
        self.clients = {(p, n): self.nodes[n].client(p, nodes=("A", "B") if spanning else ())
                        for p in "XY" for n in "AB"}
        self.barriers = {p: threading.Barrier(2, timeout=COLLECTIVE_S) for p in "XY"}
        self.log: list[tuple[str, str, str, str]] = []
        self.threads: list[threading.Thread] = []

    def train(self, p: str, n: str) -> None:
        with self.clients[(p, n)].substage("training", dp_rank=0, step=0) as h:
            self.log.append((p, n, "start", h.substage))
            try:
                self.barriers[p].wait()
                self.log.append((p, n, "collective", h.substage))
            except threading.BrokenBarrierError:
                self.log.append((p, n, "deadlocked", h.substage))

    def ask(self, p: str, n: str, seen) -> None:
        """`p`'s rank on `n` asks; returns once node `n` has its request (held or waiting)."""
        t = threading.Thread(target=self.train, args=(p, n), daemon=True)
        t.start()
        self.threads.append(t)
        wait_until(lambda: seen(p, n), HANG_S, f"{p}'s request on {n}")

    def join(self) -> None:
        for t in self.threads:
            t.join(HANG_S)
            assert not t.is_alive(), "a rank never got its answer"

    def close(self) -> None:
        for node in self.nodes.values():
            node.close()


def _asked(cluster: Cluster):
    def seen(p: str, n: str) -> bool:
        d = cluster.nodes[n].daemon
        held = any(g.startswith(f"{p}/") for g in d.spanning.held) or any(
            g.startswith(f"{p}/") for g in d.spanning.running)
        return held or d.requested.get(p, 0) > 0
    return seen


@pytest.mark.parametrize("spanning", [False, True], ids=["nodes-alone", "cluster"])
def test_a_crossed_arrival_deadlocks_two_spanning_gangs_only_without_the_cluster(tmp_path, spanning):
    c = Cluster(tmp_path, spanning)
    try:
        for p, n in CROSSED:
            c.ask(p, n, _asked(c))
        c.join()
        outcome = {(p, n): what for p, n, what, _ in c.log if what != "start"}
        if not spanning:  # the hazard is real: a node started a training whose other rank waited behind another
            assert "deadlocked" in outcome.values(), c.log
            return
        assert set(outcome.values()) == {"collective"} and len(outcome) == 4, c.log
        for n in "AB":  # the node took each request once, urgent (admitted with its gang), and granted it once
            d = c.nodes[n].daemon
            assert d.requested == {"X": 1, "Y": 1} and d.granted == {"X": 1, "Y": 1}
            assert d.spanning.admitted == 2 and d.spanning.refused == 0
            urgent = [e for e in c.nodes[n].events() if e["event"] == "request"]
            assert len(urgent) == 2 and all(e["data"]["urgent"] for e in urgent)
    finally:
        c.close()


def test_a_node_lost_mid_wait_has_its_partners_gang_refused_and_run_there_alone(tmp_path):
    c = Cluster(tmp_path, spanning=True, node_timeout_s=0.5)
    try:
        c.ask("X", "A", _asked(c))
        wait_until(lambda: c.body.gates.waiting.get("X/0/training/0"), HANG_S, "A's offer at the controller")
        c.links["B"].lost = True  # B's daemon gone: it polls no more, and the controller stops hearing it
        c.barriers["X"] = threading.Barrier(1)  # X's other rank is gone with its node: no collective to wait for
        c.join()
        d = c.nodes["A"].daemon
        assert [what for p, n, what, _ in c.log] == ["start", "collective"]
        assert d.spanning.refused == 1 and d.granted == {"X": 1}
        (req,) = [e for e in c.nodes["A"].events() if e["event"] == "request"]
        assert not req["data"]["urgent"]  # decided by A alone: no gang, no controller
    finally:
        c.close()


def test_a_gang_a_live_node_never_asks_for_runs_alone_on_the_other_after_the_wait_and_late_there(tmp_path):
    clock = Clock()  # the controller's: the wait is over when the test says so, whatever the machine's load
    c = Cluster(tmp_path, spanning=True, clock=clock, gang_wait_s=30.0)
    try:
        c.barriers["X"] = threading.Barrier(1)  # the collective does not wait here: what matters is who decides
        c.ask("X", "A", _asked(c))
        wait_until(lambda: c.body.gates.waiting.get("X/0/training/0"), HANG_S, "A's offer at the controller")
        clock.t = 30.0  # B heartbeats all along (alive), never asks for its part
        c.join()
        a, b = c.nodes["A"].daemon, c.nodes["B"].daemon
        assert a.spanning.refused == 1 and a.granted == {"X": 1} and "B" in c.body.members
        wait_until(lambda: "X/0/training/0" in b.spanning.alone, HANG_S, "B told of the refusal")
        c.ask("X", "B", _asked(c))  # late: the controller's clock stands still, so holding it would hang
        c.join()
        assert b.granted == {"X": 1} and not b.spanning.held and not a.spanning.held
        assert [(p, n, what) for p, n, what, _ in c.log] == [("X", "A", "start"), ("X", "A", "collective"),
                                                            ("X", "B", "start"), ("X", "B", "collective")]
    finally:
        c.close()


def test_a_lost_controller_lets_each_node_decide_its_own_pipelines(tmp_path):
    c = Cluster(tmp_path, spanning=True)
    try:
        for link in c.links.values():
            link.lost = True
        t0 = time.monotonic()
        c.barriers = {p: threading.Barrier(1) for p in "XY"}  # every rank alone: no deadlock to fear here
        for p, n in CROSSED:
            c.ask(p, n, _asked(c))
        c.join()
        assert time.monotonic() - t0 < HANG_S
        for n in "AB":
            d = c.nodes[n].daemon
            assert d.granted == {"X": 1, "Y": 1} and d.spanning.lost and not d.spanning.held
    finally:
        c.close()


def test_a_pipeline_naming_nodes_without_this_one_is_refused_and_registers_nothing(tmp_path):
    from jigsaw.runtime.client import Client
    from jigsaw.runtime.paths import endpoint

    body, lock = Controller(), threading.Lock()
    node = ThreadNode(tmp_path, link=InProcessLink(body, "A", lock), devices=1)
    try:
        node.client("ok", nodes=("A", "B"))  # registered (waits for the daemon's thread)
        c = Client("Z", endpoint(node.dir), devices=(0,), nodes=("B", "C"))
        assert c.refusal is not None and c.refusal.code == "bad-request" and "not this one (A)" in c.refusal.message
        c.close()
        assert "Z" not in node.daemon.state.pipelines and "Z" not in node.daemon.spanning.spans
        assert node.daemon.spanning.spans == {"ok": ("A", "B")}
    finally:
        node.close()
