"""A pipeline's client across the nodes of a cluster it was placed on: one Client per node.

    JIGSAW_NODES = [[node id, its daemon's endpoint, devices], ...] (cluster/launch.py) ─► connect()
      ─► Across: a Client per node, each registered with `nodes` = every node id (the node's
         daemon then holds the pipeline's collective gangs until the cluster admits them on all)
    global rank r ─► node of the r-th device (the nodes' devices in order), local rank there
      rollout(dp_rank=r)  ─► that node's Client.rollout(local rank); migrations it is told of
                              name local ranks, so the Rollout carries its node's rank offset
      gang(members)       ─► each node's part asked of its own daemon, all at once (threads):
                              a node's part is held until every node asked for its own, so
                              asking them one after the other would wait forever
      substage(...)       ─► the first node's (host work: the reward)
      step_end, samples, lengths ─► every node (each schedules the pipeline's pieces it holds)

The processes all run where the pipeline's driver does (the CPU engines start them there); the
grants of rank r come from the daemon of rank r's node, which is what a cluster decides.  So
every node's daemon must be reachable from the driver at an endpoint of its own (one host
with a raylet per device group); where one is not (nodes on other hosts, whose ipc paths
name nothing here or this host's own daemon), `reach` says why, and connect() falls back to
the driver's node alone (nothing held for a gang its other nodes would never ask for).
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from collections.abc import Iterator, Sequence

log = logging.getLogger("jigsaw.client")


class Across:
    """The Client of a pipeline whose ranks span nodes (the subset of Client the recipes use)."""

    def __init__(self, pipeline: str, nodes: Sequence[tuple[str, str, int]], client: type, **kw):
        """`nodes`: (node id, its daemon's endpoint, devices) of each node, in rank order;
        `client`: client.py's Client (passed in: client.py's connect() makes an Across)."""
        if len(nodes) < 2:
            raise ValueError(f"a pipeline across nodes needs two or more, got {len(nodes)}")
        ids = tuple(n for n, _, _ in nodes)
        self.pipeline = pipeline
        self.clients = [client(pipeline, ep, tuple(range(devices)), nodes=ids, **kw) for _, ep, devices in nodes]
        self.offsets = [sum(d for _, _, d in nodes[:k]) for k in range(len(nodes))]
        self.devices = sum(d for _, _, d in nodes)
        # the workers run beside the driver: they follow postings on the driver's node
        self.board = self.clients[0].board
        for c in self.clients[1:]:
            c.board = self.board

    @property
    def connected(self) -> bool:
        return all(c.connected for c in self.clients)

    @property
    def fallen_open(self) -> list[dict]:
        return [rec for c in self.clients for rec in c.fallen_open]

    def where(self, rank: int) -> tuple:
        """(the node's client, the local rank, the node's rank offset) of global rank `rank`."""
        k = max(i for i, off in enumerate(self.offsets) if off <= rank % self.devices)
        return self.clients[k], rank % self.devices - self.offsets[k], self.offsets[k]

    def rollout(self, *, dp_rank: int = 0, step: int = 0, pids: Sequence[int] = (), label: str = ""):
        client, local, offset = self.where(dp_rank)
        ro = client.rollout(dp_rank=local, step=step, pids=pids, label=label)
        ro.rank_offset = offset
        return ro

    def substage(self, kind: str, **kw):
        from jigsaw.graph.ids import SubStageKind

        if SubStageKind(kind).collective:  # every node's daemon holds it for the others: a gang of all
            raise ValueError(f"{self.pipeline}: a {kind} stage across nodes is a gang of ranks on every node "
                             f"({self.devices} ranks), not one sub-stage")
        return self.clients[0].substage(kind, **kw)

    @contextlib.contextmanager
    def gang(self, kind: str, *, members: Sequence[tuple[int, Sequence[int]]], step: int = 0,
             **kw) -> Iterator[list]:
        """Each node's members asked of its daemon at once; the grants in `members` order."""
        parts: dict[int, list[tuple[int, int, Sequence[int]]]] = {}
        for i, (rank, pids) in enumerate(members):
            client, local, _ = self.where(rank)
            parts.setdefault(self.clients.index(client), []).append((i, local, pids))
        cms = {k: self.clients[k].gang(kind, members=[(local, pids) for _, local, pids in part], step=step, **kw)
               for k, part in parts.items()}
        got: dict[int, list] = {}
        failed: list[BaseException] = []

        def enter(k: int) -> None:
            try:
                got[k] = cms[k].__enter__()
            except BaseException as exc:  # noqa: BLE001 - raised again below, in the caller's thread
                failed.append(exc)

        threads = [threading.Thread(target=enter, args=(k,), name=f"jigsaw-across-{k}", daemon=True) for k in cms]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        try:
            if failed:
                raise failed[0]
            grants: list = [None] * len(members)
            for k, part in parts.items():
                for (i, _, _), g in zip(part, got[k]):
                    grants[i] = g
            yield grants
        finally:
            for k in got:
                cms[k].__exit__(None, None, None)

    def step_end(self, step: int, **kw) -> None:
        for c in self.clients:
            c.step_end(step, **kw)

    def samples(self, step: int, done: int, total: int) -> None:
        for c in self.clients:
            c.samples(step, done, total)

    def lengths(self, turns: Sequence[int]) -> None:
        turns = list(turns)
        for c in self.clients:
            c.lengths(turns)

    def close(self, pipeline_done: bool = False) -> None:
        for c in self.clients:
            c.close(pipeline_done=pipeline_done)


def reach(pipeline: str, nodes: Sequence[tuple[str, str, int]], client: type, **kw) -> Across | str:
    """The pipeline's Across over `nodes`, or why not (the caller runs on its own node alone):
    two nodes at one endpoint, or a node whose daemon this process cannot reach."""
    endpoints = [ep for _, ep, _ in nodes]
    if len(set(endpoints)) < len(endpoints):
        return f"nodes {[n for n, _, _ in nodes]} share daemon endpoints {endpoints} (separate hosts?)"
    across = Across(pipeline, nodes, client, **kw)
    if missing := [n for (n, _, _), c in zip(nodes, across.clients) if c.session is None]:
        across.close()
        return f"the daemon of node(s) {missing} cannot be reached from this process"
    return across


def parse_nodes(text: str) -> list[tuple[str, str, int]]:
    """JIGSAW_NODES' value as (node id, endpoint, devices) per node; a clear error otherwise."""
    try:
        nodes = [(str(n), str(ep), int(d)) for n, ep, d in json.loads(text)]
    except (ValueError, TypeError) as exc:
        raise ValueError(f"JIGSAW_NODES must be JSON [[node id, endpoint, devices], ...], got {text!r}") from exc
    if any(d < 1 for _, _, d in nodes):
        raise ValueError(f"JIGSAW_NODES: every node needs at least one device, got {text!r}")
    return nodes
