"""A gang that spans nodes, admitted over Ray (issue 35): from the last member's offer to every
member told (not a test: prints a table).

    python bench/cluster_gang.py [--nodes 2 4] [--gangs 200]

    a local Ray cluster (ray.cluster_utils.Cluster: one raylet per node, this machine only)
      ─► one agent per raylet holding a RayLink (cluster/controller.py), as a node daemon does,
         its news read every 0.5 ms (a daemon reads them once per loop turn, ≤ 50 ms)
      ─► per gang: every agent offers it (RayLink.ready: posted, never waited on), the
         controller admits it when the last offer lands, each agent's long poll brings it back
      ─► per node count: median / p99 of (last member told − last offer posted): the offer's
         one crossing, the controller's decision and the answer's one crossing back

The agents stamp times with CLOCK_MONOTONIC, one clock for every process of this machine.
Loopback only: a real network adds its round trip to every figure.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

from rich.console import Console
from rich.table import Table


def _agent_class(ray):
    @ray.remote(num_cpus=0)
    class Agent:
        def __init__(self):
            from jigsaw.cluster.controller import NodeInfo, NodeLink, RayLink

            me = ray.get_runtime_context().get_node_id()
            self.link = RayLink(NodeLink(NodeInfo(node_id=me, kind="h100", gpus=8)), poll_s=1.0, beat_s=0.5)
            self.told: dict[str, float] = {}
            threading.Thread(target=self._read, daemon=True).start()

        def _read(self) -> None:
            while True:
                for gang, _ in self.link.news() or []:
                    self.told[gang] = time.monotonic()
                time.sleep(0.0005)

        def node(self) -> str:
            return self.link.node_id

        def offer(self, gang: str, members: tuple[str, ...]) -> float:
            t = time.monotonic()
            self.link.ready(gang, members)
            return t

        def told_at(self, gang: str) -> float | None:
            return self.told.get(gang)

    return Agent


def measure(count: int, gangs: int) -> list[float]:
    import ray
    from ray.cluster_utils import Cluster
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from jigsaw.cluster.controller import NAMESPACE, get_or_start, stop

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    raylets = [cluster.head_node] + [cluster.add_node(num_cpus=1) for _ in range(count - 1)]
    ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False)
    try:
        cluster.wait_for_nodes()
        get_or_start(node_timeout_s=30.0)
        agent = _agent_class(ray)
        agents = [agent.options(scheduling_strategy=NodeAffinitySchedulingStrategy(r.node_id, soft=False)).remote()
                  for r in raylets]
        members = tuple(ray.get([a.node.remote() for a in agents], timeout=120))
        out = []
        for k in range(gangs + 5):  # the first five warm the actors up
            gang = f"bench/{k}/training/0"
            offered = max(ray.get([a.offer.remote(gang, members) for a in agents], timeout=60))
            deadline = time.monotonic() + 30
            while None in (told := ray.get([a.told_at.remote(gang) for a in agents], timeout=60)):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{gang} not admitted on every node within 30 s")
                time.sleep(0.001)
            if k >= 5:
                out.append(max(told) - offered)
        return out
    finally:
        stop()
        ray.shutdown()
        cluster.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--gangs", type=int, default=200)
    args = ap.parse_args()
    console = Console(width=120)
    t = Table(title=f"a spanning gang admitted over Ray (loopback), {args.gangs} gangs")
    for col in ("nodes", "median ms", "p99 ms", "max ms"):
        t.add_column(col, justify="right")
    for count in args.nodes:
        with console.status(f"{count} raylets ..."):
            ms = [x * 1e3 for x in measure(count, args.gangs)]
        p99 = statistics.quantiles(ms, n=100, method="inclusive")[98]
        t.add_row(str(count), f"{statistics.median(ms):.2f}", f"{p99:.2f}", f"{max(ms):.2f}")
    console.print(t)


if __name__ == "__main__":
    main()
