"""The cluster controller on a real multi-node Ray cluster: several raylets on this machine
(`ray.cluster_utils.Cluster`, this machine only), each with a node agent pinned to it that speaks to
the controller through NodeLink, as a node's daemon would.

Checked: nodes join with their kinds; a gang across two nodes starts on both at once, only
once both asked, also through a daemon's RayLink (offers posted, the admission back by long
poll); the controller places submitted pipelines on concrete nodes of the right kind;
a raylet removed mid-wait leaves, and the gang waiting for it is refused to its partner; the
controller killed, a node's calls end within their deadline as lost and the node goes on."""

from __future__ import annotations

import time

import pytest

ray = pytest.importorskip("ray", reason="the [cluster] extra (Ray) is part of [dev]")

from ray.cluster_utils import Cluster  # noqa: E402

from jigsaw.cluster.controller import NAMESPACE, get_or_start, stop  # noqa: E402

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

        def linked(self, method: str, *args):
            """A call of this node's RayLink, the line a daemon in a cluster holds (spanning.py)."""
            from jigsaw.cluster.controller import RayLink

            if getattr(self, "ray_link", None) is None:
                self.ray_link = RayLink(self.link, poll_s=0.5, beat_s=0.3)
            return getattr(self.ray_link, method)(*args)

    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    ids = [r.node_id for r in raylets]
    agents = [Agent.options(scheduling_strategy=NodeAffinitySchedulingStrategy(i, soft=False)).remote(k)
              for i, k in zip(ids, kinds)]
    assert ray.get([a.node.remote() for a in agents], timeout=60) == ids  # each agent on its own raylet
    return cluster, raylets, agents, ids


def _controller(node_timeout_s: float):
    """The controller actor, once it answers: its start (a worker process) can take seconds on a
    loaded machine, longer than a node's call deadline, and a join it missed would be "lost"."""
    ctrl = get_or_start(node_timeout_s=node_timeout_s)
    ray.get(ctrl.nodes.remote(), timeout=120)
    return ctrl


def _stop(cluster) -> None:
    stop()
    ray.shutdown()
    cluster.shutdown()


def test_nodes_join_a_cross_node_gang_starts_whole_and_pipelines_are_placed_on_nodes():
    cluster, _, agents, ids = _start(["h100", "h100", "a100"])
    try:
        ctrl = _controller(node_timeout_s=30.0)
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
        # A daemon's RayLink: offers sent without waiting, the admission back by its long poll.
        assert ray.get([x.linked.remote("news") for x in (a, b)], timeout=60) == [[], []]
        for x in (a, b):
            ray.get(x.linked.remote("ready", "train-9", members), timeout=30)
        news: dict[int, list] = {0: [], 1: []}
        deadline = time.monotonic() + 60
        while not all(news.values()) and time.monotonic() < deadline:
            for k, x in enumerate((a, b)):
                news[k] += [tuple(t) for t in ray.get(x.linked.remote("news"), timeout=30)]
        assert news == {0: [("train-9", "")], 1: [("train-9", "")]}
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
        ctrl = _controller(node_timeout_s=2.0)
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


def _daemons(ids: list[str], tmp_path):
    """A real node daemon on each raylet (`DaemonConfig.cluster`: it joins the controller from its
    own node through a RayLink), serving a socket under tmp_path that this process's clients use."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    @ray.remote(num_cpus=0, max_concurrency=4)
    class NodeDaemon:
        def __init__(self, directory: str):
            import threading
            from pathlib import Path

            from jigsaw.runtime.daemon import Daemon, DaemonConfig

            config = DaemonConfig(devices=1, policy="serial", max_wait_s=None, cluster="auto",
                                  trace=Path(directory) / "trace.jsonl")
            self.d = Daemon(config, Path(directory))
            threading.Thread(target=self.d.serve, daemon=True).start()

        def book(self) -> dict:
            s = self.d.spanning
            return {"node": getattr(s.link, "node_id", None), "admitted": s.admitted, "refused": s.refused,
                    "granted": dict(self.d.granted), "held": sorted(s.held)}

    daemons, dirs = [], []
    for k, node in enumerate(ids):
        d = tmp_path / f"node{k}"
        d.mkdir(mode=0o700)
        dirs.append(d)
        daemons.append(NodeDaemon.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False))
                       .remote(str(d)))
    return daemons, dirs


def _reached(book: dict, pipeline: str) -> bool:
    """Whether `pipeline`'s step-0 training request reached that node: held there, or already
    granted (its gang's other part was offered first, so the admission can come back before a
    poll sees it held: a busy machine's poll is slower than the controller's round trip)."""
    return f"{pipeline}/0/training/0" in book["held"] or pipeline in book["granted"]


def test_real_daemons_in_a_ray_cluster_start_crossed_spanning_gangs_whole_and_survive_a_lost_node(tmp_path):
    import threading

    from jigsaw.runtime.client import Client
    from jigsaw.runtime.paths import endpoint

    cluster, _, _, ids = _start(["h100", "h100"])
    try:
        _controller(node_timeout_s=2.0)
        daemons, dirs = _daemons(ids, tmp_path)
        deadline = time.monotonic() + 120
        while [b["node"] for b in ray.get([d.book.remote() for d in daemons], timeout=60)] != ids:
            assert time.monotonic() < deadline, "the daemons never joined the cluster"
            time.sleep(0.2)
        clients = {(p, k): Client(p, endpoint(dirs[k]), devices=(0,), nodes=tuple(ids), connect_timeout_s=10.0)
                   for p in "XY" for k in (0, 1)}
        barriers = {p: threading.Barrier(2, timeout=10.0) for p in "XY"}
        log: list[tuple[str, int, str]] = []

        def train(p: str, k: int) -> None:
            with clients[(p, k)].substage("training", dp_rank=0, step=0) as h:
                assert h.substage, "ran without the daemon"
                try:
                    barriers[p].wait()  # the FSDP collective across the two nodes
                    log.append((p, k, "collective"))
                except threading.BrokenBarrierError:
                    log.append((p, k, "deadlocked"))

        threads = []
        for p, k in [("X", 0), ("Y", 1), ("Y", 0), ("X", 1)]:  # crossed: each node's first asker differs
            threads.append(threading.Thread(target=train, args=(p, k), daemon=True))
            threads[-1].start()
            if (p, k) != ("X", 1):  # the last asker completes both gangs: nothing is held after it
                until = time.monotonic() + 60
                while not _reached(ray.get(daemons[k].book.remote(), timeout=60), p):
                    assert time.monotonic() < until, f"{p}'s request never reached node {k}"
                    time.sleep(0.01)
        for t in threads:
            t.join(60)
        assert sorted(log) == [(p, k, "collective") for p in "XY" for k in (0, 1)]
        books = ray.get([d.book.remote() for d in daemons], timeout=60)
        assert [(b["admitted"], b["refused"], b["granted"]) for b in books] == [(2, 0, {"X": 1, "Y": 1})] * 2

        # Node 1's daemon lost while node 0 waits for a gang with it: refused there, run there alone.
        ray.kill(daemons[1])
        with clients[("X", 0)].substage("training", dp_rank=0, step=1) as h:
            assert h.substage  # the daemon granted it (it did not fall open)
        book = ray.get(daemons[0].book.remote(), timeout=60)
        assert book["refused"] == 1 and book["granted"] == {"X": 2, "Y": 1} and not book["held"]
        for c in clients.values():
            c.close()
    finally:
        _stop(cluster)
