"""A cluster as nodes of GPU kinds: `--nodes 4xh100,2xa100:4`.

    "COUNTxKIND[:GPUS]", comma-separated ─► parse_nodes ─► (NodeKind, ...): COUNT nodes of
    KIND (a device the simulator prices: mux/model/specs.DEVICES) with GPUS GPUs each (8 unless
    given); the same kind and size listed twice is one entry.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from jigsaw.mux.model.specs import DEVICES

GPUS_PER_NODE = 8
"""GPUs of a node where `--nodes` does not say (an HGX board)."""

_TOKEN = re.compile(r"^(\d+)x([a-z0-9_-]+)(?::(\d+))?$")


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeKind:
    """Some nodes alike: the same GPU kind, the same number of GPUs."""

    kind: str
    """GPU kind (h100 | a100): the slowdown grid and step costs of every pipeline placed there."""
    count: int
    """How many such nodes the cluster has."""
    gpus: int = GPUS_PER_NODE
    """GPUs of each node."""

    def __str__(self) -> str:
        return f"{self.count}x{self.kind}" + ("" if self.gpus == GPUS_PER_NODE else f":{self.gpus}")


def parse_nodes(text: str) -> tuple[NodeKind, ...]:
    """The cluster `text` describes, kinds in the order first listed; a clear error otherwise."""
    counts: dict[tuple[str, int], int] = {}
    for token in (t.strip().lower() for t in text.split(",")):
        if not token:
            continue
        m = _TOKEN.match(token)
        if m is None:
            raise ValueError(f"--nodes: {token!r} is not COUNTxKIND[:GPUS] (e.g. 4xh100 or 2xa100:4)")
        count, kind, gpus = int(m[1]), m[2], int(m[3] or GPUS_PER_NODE)
        if kind not in DEVICES:
            raise ValueError(f"--nodes: GPU kind {kind!r} unknown; known: {', '.join(sorted(DEVICES))}")
        if count < 1 or gpus < 1:
            raise ValueError(f"--nodes: {token!r} needs at least one node of at least one GPU")
        counts[(kind, gpus)] = counts.get((kind, gpus), 0) + count
    if not counts:
        raise ValueError("--nodes names no node (e.g. 4xh100,4xa100)")
    return tuple(NodeKind(kind=k, count=c, gpus=g) for (k, g), c in counts.items())
