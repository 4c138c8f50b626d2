"""The cluster controller on a real multi-node Ray cluster: several raylets on this machine
(`ray.cluster_utils.Cluster`, this machine only), each with a node agent pinned to it that speaks to
the controller through NodeLink, as a node's daemon would.

Checked: nodes join with their kinds; a gang across two nodes starts on both at once, only
once both asked; the controller places submitted pipelines on concrete nodes of the right kind;
a raylet removed mid-wait leaves, and the gang waiting for it is refused to its partner; the
controller killed, a node's calls end within their deadline as lost and the node goes on."""

from __future__ import annotations

import time

import pytest

ray = pytest.importorskip("ray", reason="the [cluster] extra (Ray) is part of [dev]")

from ray.cluster_utils import Cluster  # noqa: E402

from jigsaw.cluster.controller import NAME, NAMESPACE, get_or_start  # noqa: E402

pytestmark = pytest.mark.timeout(300)


def _start(kinds: list[str]):
    """A cluster of one raylet per kind (the first is the head), and an agent pinned to each."""
    cluster = Cluster(initialize_head=True, head_node_args={
        "num_cpus": 1, "resources": {f"kind:{kinds[0]}": 1}, "include_dashboard": False})
    raylets = [cluster.head_node] + [cluster.add_node(num_cpus=1, resources={f"kind:{k}": 1}) for k in kinds[1:]]
    ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False)
    cluster.wait_for_nodes()

    @ray.remote(num_cpus=0)
    class Agent:
        """What a node's daemon does with the controller, on its own node."""

        def __init__(self, kind: str):
            from jigsaw.cluster.controller import NodeInfo, NodeLink

            me = ray.get_runtime_context().get_node_id()
            self.link = NodeLink(NodeInfo(node_id=me, kind=kind, gpus=1), deadline_s=3.0)

        def join(self) -> bool:
            joined = self.link.join()
            self.link.beat(0.3)  # as a daemon does, from its own thread
            return joined

        def node(self) -> str:
            return self.link.info.node_id

        def call(self, method: str, *args):
            return getattr(self.link, method)(*args)

    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    ids = [r.node_id for r in raylets]
    agents = [Agent.options(scheduling_strategy=NodeAffinitySchedulingStrategy(i, soft=False)).remote(k)
              for i, k in zip(ids, kinds)]
    assert ray.get([a.node.remote() for a in agents], timeout=60) == ids  # each agent on its own raylet
    return cluster, raylets, agents, ids


def _stop(cluster) -> None:
    try:
        ray.kill(ray.get_actor(NAME, namespace=NAMESPACE))
    except ValueError:
        pass
    ray.shutdown()
    cluster.shutdown()


def test_nodes_join_a_cross_node_gang_starts_whole_and_pipelines_are_placed_on_nodes():
    cluster, _, agents, ids = _start(["h100", "h100", "a100"])
    try:
        ctrl = get_or_start(node_timeout_s=30.0)
        assert all(ray.get([a.join.remote() for a in agents], timeout=60))
        assert sorted((n.node_id, n.kind) for n in ray.get(ctrl.nodes.remote(), timeout=30)) == \
            sorted(zip(ids, ["h100", "h100", "a100"]))
        a, b = agents[0], agents[1]
        members = (ids[0], ids[1])
        assert ray.get(a.call.remote("ready", "train-7", members), timeout=30)
        assert ray.get(a.call.remote("take"), timeout=30) == []  # half a gang: nothing starts
        assert ray.get(b.call.remote("ready", "train-7", members), timeout=30)
        told = ray.get([a.call.remote("take"), b.call.remote("take")], timeout=30)
        assert [[tuple(t) for t in node] for node in told] == [[("train-7", "")]] * 2  # both at once
        with pytest.raises(ray.exceptions.RayTaskError, match="not a member"):  # refused, not "lost"
            ray.get(a.call.remote("ready", "train-8", (ids[1], ids[2])), timeout=30)
        ray.get(ctrl.submit.remote("math", "qwen3-0.6b-math"), timeout=30)
        ray.get(ctrl.submit.remote("gsm8k", "qwen3-0.6b-gsm8k"), timeout=30)
        got = ray.get(ctrl.place.remote(steps=2, trial_steps=1, policy="hetrl"), timeout=240)
        kind = dict(zip(ids, ["h100", "h100", "a100"]))
        placed = [n for nodes in got.nodes.values() for n in nodes]
        assert sorted(got.nodes) == ["gsm8k", "math"] and len(placed) == len(set(placed))
        for g in got.groups:
            for i in g.pipelines:
                assert [kind[n] for n in got.nodes[["gsm8k", "math"][i]]] == [g.kind] * g.nodes
    finally:
        _stop(cluster)


def test_a_lost_raylet_refuses_its_gang_and_a_lost_controller_leaves_nodes_deciding_alone():
    cluster, raylets, agents, ids = _start(["h100", "a100"])
    try:
        ctrl = get_or_start(node_timeout_s=2.0)
        assert all(ray.get([a.join.remote() for a in agents], timeout=60))
        head = agents[0]
        assert ray.get(head.call.remote("ready", "ref-3", (ids[0], ids[1])), timeout=30)
        cluster.remove_node(raylets[1])  # the other node's raylet, and its agent with it, gone mid-wait
        deadline, told = time.monotonic() + 60, []
        while not told and time.monotonic() < deadline:
            told = ray.get(head.call.remote("take"), timeout=30)
            time.sleep(0.5)
        assert [tuple(t) for t in told] == [("ref-3", f"node {ids[1]!r} left the cluster")]
        assert [n.node_id for n in ray.get(ctrl.nodes.remote(), timeout=30)] == [ids[0]]
        ray.kill(ctrl)
        t0 = time.monotonic()
        assert ray.get(head.call.remote("take"), timeout=60) is None  # lost: the node decides alone
        assert ray.get(head.call.remote("ready", "ref-4", (ids[0],)), timeout=60) is False
        assert time.monotonic() - t0 < 30
        assert ray.get(head.node.remote(), timeout=30) == ids[0]  # the node itself goes on
    finally:
        _stop(cluster)
