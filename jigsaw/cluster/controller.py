"""The cluster controller on Ray: a detached named actor that knows every node and pipeline.

    a node (its daemon, through NodeLink) ── join / heartbeat ──► Controller ◄── submit ── a user
    Controller.place() ─► placement.place over the live nodes, priced by the simulator's trials
                          (simulate.estimator: the `jigsaw sim --nodes` code) ─► Assigned: each
                          pipeline's concrete node ids, and what the trials predicted
    gangs across nodes: ready / withdraw / done / take ─► Gates (gangs.py): whole or not at all
    a node silent for `node_timeout_s` (daemon or raylet lost) leaves: its waiting gangs are
    refused to their other members, who run those pieces alone; placement forgets the node
    the controller lost: every NodeLink call ends within its deadline as "lost", and each node
    keeps deciding its own pipelines (nothing waits on the controller)

Ray runs the actor (`get_or_start`: detached, named, in the "jigsaw" namespace, on no CPU of its
own); everything it decides is the pure code of placement.py and gangs.py.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

from jigsaw.cluster.gangs import Gates
from jigsaw.cluster.placement import Group, place
from jigsaw.cluster.simulate import PLACERS, ClusterConfig, estimator
from jigsaw.cluster.spec import NodeKind
from jigsaw.extras import require

NAME = "jigsaw-cluster"
NAMESPACE = "jigsaw"
_LOST = object()  # NodeLink: the controller did not answer


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeInfo:
    """What a node tells the controller when it joins."""

    node_id: str
    """Ray's node id (where the node's daemon runs)."""
    kind: str
    gpus: int
    free_mem_bytes: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class Assigned:
    """A placement on concrete nodes."""

    nodes: dict[str, tuple[str, ...]]
    """Per pipeline name: the node ids its group runs on."""
    groups: tuple[Group, ...]
    predicted_s: tuple[float, ...]


class Controller:
    """The actor's body (plain Python: a test can drive it without Ray)."""

    def __init__(self, node_timeout_s: float = 10.0, clock=time.monotonic):
        self.node_timeout_s, self.clock = node_timeout_s, clock
        self.members: dict[str, NodeInfo] = {}
        self.seen: dict[str, float] = {}
        self.workloads: dict[str, str] = {}
        self.gates = Gates()

    # ------------------------------------------------------------ nodes
    def join(self, info: NodeInfo) -> None:
        self.members[info.node_id], self.seen[info.node_id] = info, self.clock()
        self.gates.rejoin(info.node_id)

    def heartbeat(self, node_id: str) -> bool:
        """False: the controller does not know this node (it left, or the controller restarted):
        join again."""
        self._expire()
        if node_id not in self.members:
            return False
        self.seen[node_id] = self.clock()
        return True

    def leave(self, node_id: str) -> list[str]:
        self.members.pop(node_id, None)
        self.seen.pop(node_id, None)
        return self.gates.leave(node_id)

    def nodes(self) -> list[NodeInfo]:
        self._expire()
        return list(self.members.values())

    def _expire(self) -> None:
        now = self.clock()
        for node_id in [n for n, t in self.seen.items() if now - t > self.node_timeout_s]:
            self.leave(node_id)

    # ------------------------------------------------------------ pipelines and placement
    def submit(self, name: str, workload: str) -> None:
        if name in self.workloads:
            raise ValueError(f"pipeline {name!r} was already submitted")
        self.workloads[name] = workload

    def place(self, steps: int = 8, trial_steps: int = 3, seed: int = 0, policy: str = "jigsaw") -> Assigned:
        """Every submitted pipeline placed on the live nodes (the simulator prices each group)."""
        from jigsaw.sim.run import SimConfig

        names = sorted(self.workloads)
        if not names:
            raise ValueError("no pipeline submitted")
        by_kind: dict[tuple[str, int], list[str]] = {}
        for info in self.nodes():
            by_kind.setdefault((info.kind, info.gpus), []).append(info.node_id)
        if not by_kind:
            raise ValueError("no node has joined the cluster")
        cluster = tuple(NodeKind(kind=k, count=len(ids), gpus=g) for (k, g), ids in by_kind.items())
        sim = SimConfig(workload=tuple(self.workloads[n] for n in names), steps=steps, seed=seed, trace=False)
        cfg = ClusterConfig(cluster_trial_steps=trial_steps)
        placed = place(len(names), cluster, estimator(sim, cfg, PLACERS[policy].node_policy),
                       PLACERS[policy].max_group)
        free = {key: list(ids) for key, ids in by_kind.items()}
        nodes = {}
        for g in placed.groups:
            pool = free[(g.kind, g.gpus_per_node)]
            taken, free[(g.kind, g.gpus_per_node)] = tuple(pool[:g.nodes]), pool[g.nodes:]
            nodes.update({names[i]: taken for i in g.pipelines})
        return Assigned(nodes=nodes, groups=placed.groups, predicted_s=placed.predicted_s)

    # ------------------------------------------------------------ gangs across nodes
    def ready(self, gang: str, node_id: str, members: tuple[str, ...]) -> None:
        self._expire()
        self.gates.ready(gang, node_id, frozenset(members))
        self.gates.admit()

    def withdraw(self, gang: str, node_id: str) -> None:
        self.gates.withdraw(gang, node_id)

    def done(self, gang: str) -> None:
        self.gates.done(gang)

    def take(self, node_id: str) -> list[tuple[str, str]]:
        """What `node_id` has yet to be told: (gang, "") admitted, (gang, why) refused."""
        self._expire()
        self.gates.admit()
        return self.gates.take(node_id)


def get_or_start(node_timeout_s: float = 10.0):
    """The cluster's controller actor: the running one, or a new detached one."""
    require("cluster", "the cluster controller")
    import ray

    actor = ray.remote(num_cpus=0, max_concurrency=1)(Controller)
    # on the head node: it lives as long as the cluster does, where a worker node may go
    return actor.options(name=NAME, namespace=NAMESPACE, lifetime="detached", get_if_exists=True,
                         resources={"node:__internal_head__": 0.001}).remote(node_timeout_s=node_timeout_s)


class NodeLink:
    """A node's calls to the controller, each within `deadline_s`: a controller that does not
    answer is "lost" (None), and the node goes on deciding alone."""

    def __init__(self, info: NodeInfo, deadline_s: float = 5.0, handle=None):
        require("cluster", "a node's link to the cluster controller")
        import ray

        self.ray = ray
        self.info, self.deadline_s = info, deadline_s
        self.handle = handle

    def _answer(self, method: str, *args):
        """The controller's answer, or _LOST where it is gone or silent past the deadline."""
        try:
            handle = self.handle or self.ray.get_actor(NAME, namespace=NAMESPACE)
        except ValueError:  # no such actor: the controller is gone
            return _LOST
        try:  # a request the controller refuses (RayTaskError) is the node's bug: it propagates
            return self.ray.get(getattr(handle, method).remote(*args), timeout=self.deadline_s)
        except (self.ray.exceptions.RayActorError, self.ray.exceptions.GetTimeoutError):
            return _LOST

    def call(self, method: str, *args):
        """The controller's answer, or None where it is lost (the node falls open)."""
        got = self._answer(method, *args)
        return None if got is _LOST else got

    def join(self) -> bool:
        """Whether the controller heard (False: lost)."""
        return self._answer("join", self.info) is not _LOST

    def heartbeat(self) -> bool:
        """Whether the controller knows this node now (it joins again if it was forgotten)."""
        got = self.call("heartbeat", self.info.node_id)
        return self.join() if got is False else bool(got)

    def beat(self, interval_s: float) -> threading.Event:
        """Heartbeats every `interval_s` from a thread until the returned event is set."""
        stop = threading.Event()

        def loop() -> None:
            while not stop.wait(interval_s):
                self.heartbeat()

        threading.Thread(target=loop, name="jigsaw-cluster-heartbeat", daemon=True).start()
        return stop

    def ready(self, gang: str, members: tuple[str, ...]) -> bool:
        """Whether the controller took the request (False: lost; the node decides alone)."""
        return self._answer("ready", gang, self.info.node_id, members) is not _LOST

    def take(self) -> list[tuple[str, str]] | None:
        """(gang, "") admitted, (gang, why) refused; None: the controller is lost."""
        return self.call("take", self.info.node_id)


__all__ = ["NAME", "NAMESPACE", "Assigned", "Controller", "NodeInfo", "NodeLink", "get_or_start"]
