"""`jigsaw cluster [--address auto]`: what the cluster's controller knows.

    ray.init(address) ─► the controller actor (none: said, exit 1) ─► nodes (id, kind, GPUs,
    daemon endpoint), and the pipelines `jigsaw run --cluster` booked nodes for ─► two tables

Needs the [cluster] extra (Ray).  It never starts a controller: a node's `jigsaw daemon
--cluster` does.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

ASK_TIMEOUT_S = 30.0
"""How long to wait for the controller's answers."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Args:
    """Show the nodes of a Ray cluster's jigsaw controller (each a `jigsaw daemon --cluster`) and
    the pipelines `jigsaw run --cluster` placed on them."""

    address: str = "auto"
    """The Ray cluster: an address (host:port, ray://...), or auto (this node's)."""


def run(args: Args) -> int:
    from jigsaw.extras import require

    require("cluster", "jigsaw cluster")
    import ray
    from rich.console import Console
    from rich.table import Table

    from jigsaw.cluster.controller import NAME, NAMESPACE, join

    join(args.address, "--address")
    try:
        ctrl = ray.get_actor(NAME, namespace=NAMESPACE)
    except ValueError:
        print(f"jigsaw cluster: no controller in the cluster at {args.address} (a node's "
              "`jigsaw daemon --cluster` starts it)", file=sys.stderr)
        return 1
    nodes = ray.get(ctrl.nodes.remote(), timeout=ASK_TIMEOUT_S)
    booked = ray.get(ctrl.arrivals.remote(), timeout=ASK_TIMEOUT_S)
    on = {n: sorted(p for p, ids in booked.items() if n in ids) for n in {i.node_id for i in nodes}}
    t = Table(title=f"{len(nodes)} node(s) in the jigsaw cluster")
    for col in ("node", "kind", "GPUs", "daemon", "pipelines"):
        t.add_column(col)
    for n in sorted(nodes, key=lambda i: (i.kind, i.node_id)):
        t.add_row(n.node_id, n.kind, str(n.gpus), n.endpoint or "-", ", ".join(on[n.node_id]) or "-")
    Console().print(t)
    lost = {p: ids for p, ids in booked.items() if not set(ids) <= set(on)}
    for p, ids in sorted(lost.items()):
        print(f"{p}: booked on node(s) that left: {', '.join(i for i in ids if i not in on)}")
    return 0
