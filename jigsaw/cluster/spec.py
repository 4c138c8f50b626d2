"""A cluster as nodes of GPU kinds: `--nodes 4xh100,2xa100:4`.

    "COUNTxKIND[:GPUS]", comma-separated ─► parse_nodes ─► (NodeKind, ...): COUNT nodes of
    KIND (a device the simulator prices: mux/model/specs.DEVICES) with GPUS GPUs each (unless
    given, the kind's usual node: node_gpus); the same kind and size listed twice is one entry.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from jigsaw.mux.model.specs import DEVICES, GPUS_PER_NODE

OTHER_NODE_GPUS = 8
"""GPUs of a node of a kind without a usual node in specs.GPUS_PER_NODE (an HGX board)."""


def node_gpus(kind: str) -> int:
    """GPUs of a node of `kind` where `--nodes` does not say: the node the cost model prices its
    FSDP collectives by (specs.GPUS_PER_NODE: DGX H100 8, the paper's A100 nodes 4), so a
    pipeline placed on one node never pays the inter-node bandwidth."""
    return GPUS_PER_NODE.get(DEVICES[kind].sku, OTHER_NODE_GPUS) if kind in DEVICES else OTHER_NODE_GPUS

_TOKEN = re.compile(r"^(\d+)x([a-z0-9_-]+)(?::(\d+))?$")


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeKind:
    """Some nodes alike: the same GPU kind, the same number of GPUs."""

    kind: str
    """GPU kind (h100 | a100): the slowdown grid and step costs of every pipeline placed there."""
    count: int
    """How many such nodes the cluster has."""
    gpus: int = 0
    """GPUs of each node (0: the kind's usual node, node_gpus)."""

    def __post_init__(self) -> None:
        if self.gpus == 0:
            object.__setattr__(self, "gpus", node_gpus(self.kind))

    def __str__(self) -> str:
        return f"{self.count}x{self.kind}" + ("" if self.gpus == node_gpus(self.kind) else f":{self.gpus}")


def parse_nodes(text: str) -> tuple[NodeKind, ...]:
    """The cluster `text` describes, kinds in the order first listed; a clear error otherwise."""
    counts: dict[tuple[str, int], int] = {}
    for token in (t.strip().lower() for t in text.split(",")):
        if not token:
            continue
        m = _TOKEN.match(token)
        if m is None:
            raise ValueError(f"--nodes: {token!r} is not COUNTxKIND[:GPUS] (e.g. 4xh100 or 2xa100:4)")
        count, kind = int(m[1]), m[2]
        if kind not in DEVICES:
            raise ValueError(f"--nodes: GPU kind {kind!r} unknown; known: {', '.join(sorted(DEVICES))}")
        gpus = int(m[3]) if m[3] else node_gpus(kind)
        if count < 1 or gpus < 1:
            raise ValueError(f"--nodes: {token!r} needs at least one node of at least one GPU")
        counts[(kind, gpus)] = counts.get((kind, gpus), 0) + count
    if not counts:
        raise ValueError("--nodes names no node (e.g. 4xh100,4xa100)")
    return tuple(NodeKind(kind=k, count=c, gpus=g) for (k, g), c in counts.items())
