"""Which pipelines share which nodes, and how many nodes of which kind each group gets.

    K pipelines, the cluster's (NodeKind, ...), estimate(Group, until_s) ─► seconds (inf: cannot
         run, or passed until_s: the best placement so far already ends by then)
      ─► groupings(K, max_group) (graph/placement.py): every way to cut the pipelines into groups (singles, and
         pairs where max_group is 2: the sub-stages of a pair share its nodes' GPUs)
      ─► per grouping, each group a kind and a node count, no node given twice (every
         assignment tried; an estimate is made once per distinct group)
      ─► Placement: the one whose slowest group ends first (the cluster's makespan for every
         pipeline's steps); among equal ones, the fewest GPU-seconds held

A group is priced with the best makespan found so far as its `until_s`: a trial past it can
stop there, because that group could only be part of a slower placement, and the best only
gets better (so a group cut once is never wanted later).  Groupings are tried pairs first and
node counts largest first, so a good bound comes early.

A pure decision over `estimate`, which the caller owns: the simulator prices a group by
simulating its first steps on its kind's grid with the scheduler that will run it
(cluster/simulate.py), so placement has no cost model of its own.  A group's DP degree per
stage is what its nodes give it: every GPU of the group's nodes, shaped on the node by the
node's own placement (sim/placement.py).  HetRL-style placement is this search with groups of
one (each pipeline on nodes of its own, the count and kind chosen); jigsaw's adds the pairs.
`admit` is RollMux's online admission, the other baseline: greedy, in arrival order, under an
SLO, on as few nodes as it can.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from jigsaw.cluster.spec import NodeKind
from jigsaw.graph.placement import groupings

_TIE = 1e-9  # relative: makespans closer than this are equal, and GPU-seconds decide


@dataclass(frozen=True, kw_only=True, slots=True)
class Group:
    """Pipelines that share some nodes of one kind."""

    pipelines: tuple[int, ...]
    """Indices of the pipelines, in the caller's order."""
    kind: str
    """GPU kind of the group's nodes."""
    gpus_per_node: int
    nodes: int
    """How many nodes of that kind."""

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


@dataclass(frozen=True, kw_only=True, slots=True)
class Placement:
    """Every pipeline in one group, with what the estimate predicted for each group."""

    groups: tuple[Group, ...]
    predicted_s: tuple[float, ...]
    """Each group's estimated makespan, in `groups` order."""
    estimates: int
    """Distinct groups estimated to decide it (each one a trial run, where the simulator prices)."""

    @property
    def makespan_s(self) -> float:
        return max(self.predicted_s)

    @property
    def gpu_s(self) -> float:
        """GPU-seconds the groups hold until each of them ends."""
        return sum(g.gpus * t for g, t in zip(self.groups, self.predicted_s))

    def describe(self, names: list[str]) -> str:
        return "; ".join(f"{' + '.join(names[i] for i in g.pipelines)} on {g.nodes}x{g.kind}:{g.gpus_per_node}"
                         for g in self.groups)


Estimate = Callable[[Group, "float | None"], float]
"""A group's makespan in seconds; inf where it cannot run or where it would pass `until_s`
(None: no bound yet, price it to the end)."""


def place(count: int, cluster: tuple[NodeKind, ...], estimate: Estimate, max_group: int = 2) -> Placement:
    """The placement of `count` pipelines on `cluster` whose slowest group ends first."""
    if count < 1:
        raise ValueError("placement needs at least one pipeline")
    memo: dict[Group, float] = {}
    best: list = [(math.inf, math.inf), None]

    def priced(g: Group) -> float:
        if g not in memo:
            bound = best[0][0]
            memo[g] = estimate(g, bound * (1 + _TIE) if math.isfinite(bound) else None)
        return memo[g]

    for grouping in sorted(groupings(count, max_group), key=len):
        if len(grouping) <= sum(n.count for n in cluster):
            _assign(grouping, cluster, [n.count for n in cluster], [], priced, best)
    if best[1] is None:
        raise ValueError(_unplaceable(count, cluster, max_group, memo))
    groups, times = best[1]
    return Placement(groups=groups, predicted_s=times, estimates=len(memo))


RESIDENCY = 5
"""Most pipelines a RollMux group holds (its evaluation's default: host memory caches 2-5 jobs
a node)."""


def admit(count: int, cluster: tuple[NodeKind, ...], estimate: Estimate, slo: float = 2.0) -> Placement:
    """RollMux §4's admission (Alg. 1) on whole nodes, the baseline to jigsaw's search: the
    pipelines arrive in order, and each is admitted by `admit_one`.  Nodes no pipeline needed
    stay idle: RollMux minimises what is held, not the makespan.  Not modelled: Rollout Scaling
    (a group's rollout pool grown by nodes) and worst-case (max-token) trial lengths."""
    if count < 1:
        raise ValueError("placement needs at least one pipeline")
    memo: dict[Group, float] = {}

    def priced(g: Group) -> float:
        if g not in memo:
            memo[g] = estimate(g, None)
        return memo[g]

    left = {n.kind: n.count for n in cluster}
    groups: list[Group] = []
    for j in range(count):
        k, g = admit_one(j, groups, cluster, left, priced, slo)
        if k is None:
            left[g.kind] -= g.nodes
            groups.append(g)
        else:
            groups[k] = g
    return Placement(groups=tuple(groups), predicted_s=tuple(priced(g) for g in groups), estimates=len(memo))


def admit_one(j: int, groups: list[Group], cluster: tuple[NodeKind, ...], left: dict[str, int],
              priced: Callable[[Group], float], slo: float = 2.0,
              residency: int = RESIDENCY) -> tuple[int | None, Group]:
    """Where pipeline j goes as it arrives beside `groups` (with `left` nodes free per kind):
    (k, groups[k] with j in it), or (None, a new group of free nodes).  RollMux's rule: j is
      packed into the group that ends soonest with it (Direct Packing: no new node) where that
        group, with it, ends within `slo` × each member's time alone on the group's nodes
        (conservative: the group's end stands for every member's), at most `residency` a group;
      else given nodes of its own (Isolated Provisioning): per kind the fewest it runs on, of
        the kind where it costs the fewest GPU-seconds alone;
      else, with no node free, packed where the group ends soonest with it (RollMux queues it).
    ValueError where it fits nowhere."""
    packed = [(priced(g2), k, g2) for k, g in enumerate(groups) if len(g.pipelines) < residency
              for g2 in [Group(pipelines=(*g.pipelines, j), kind=g.kind, gpus_per_node=g.gpus_per_node,
                               nodes=g.nodes)]]
    fits = [(t, k, g2) for t, k, g2 in packed if math.isfinite(t)
            and all(t <= slo * priced(_alone(g2, i)) for i in g2.pipelines)]
    alone = [(t * g.gpus, g) for g in _isolated(j, cluster, left, priced) if math.isfinite(t := priced(g))]
    if fits:
        _, k, g = min(fits)
        return k, g
    if alone:
        return None, min(alone, key=lambda tg: (tg[0], tg[1].nodes))[1]
    if finite := [x for x in packed if math.isfinite(x[0])]:
        _, k, g = min(finite)
        return k, g
    raise ValueError(f"pipeline {j} fits no node of {', '.join(str(n) for n in cluster)}, alone or packed")


def _isolated(j: int, cluster: tuple[NodeKind, ...], left: dict[str, int], priced) -> list[Group]:
    """Pipeline j on nodes of its own: per kind, the fewest free nodes it runs on at all."""
    out = []
    for node in cluster:
        for n in range(1, left[node.kind] + 1):
            g = Group(pipelines=(j,), kind=node.kind, gpus_per_node=node.gpus, nodes=n)
            if math.isfinite(priced(g)):
                out.append(g)
                break
    return out


def _alone(g: Group, i: int) -> Group:
    return Group(pipelines=(i,), kind=g.kind, gpus_per_node=g.gpus_per_node, nodes=g.nodes)


def _assign(grouping, cluster, left: list[int], chosen: list[tuple[Group, float]], priced, best) -> None:
    """Each way to give the groups still to place nodes from `left`, the best kept in `best`."""
    if len(chosen) == len(grouping):
        key = (max(t for _, t in chosen), sum(g.gpus * t for g, t in chosen))
        if _better(key, best[0]):
            best[0], best[1] = key, (tuple(g for g, _ in chosen), tuple(t for _, t in chosen))
        return
    pipes, still = grouping[len(chosen)], len(grouping) - len(chosen) - 1
    for k, node in enumerate(cluster):
        # leave at least one node for each group after this one
        for n in range(min(left[k], sum(left) - still), 0, -1):
            g = Group(pipelines=pipes, kind=node.kind, gpus_per_node=node.gpus, nodes=n)
            t = priced(g)
            if math.isinf(t) or t > best[0][0] * (1 + _TIE):
                continue
            left[k] -= n
            chosen.append((g, t))
            _assign(grouping, cluster, left, chosen, priced, best)
            chosen.pop()
            left[k] += n


def _better(a: tuple[float, float], b: tuple[float, float]) -> bool:
    tol = _TIE * max(1.0, b[0]) if math.isfinite(b[0]) else 0.0
    return a[0] < b[0] - tol or (abs(a[0] - b[0]) <= tol and a[1] < b[1])


def _unplaceable(count: int, cluster, max_group: int, memo: dict[Group, float]) -> str:
    where, nodes = ", ".join(str(n) for n in cluster), sum(n.count for n in cluster)
    if -(-count // max_group) > nodes:
        alone = "each on nodes of its own" if max_group == 1 else f"in groups of at most {max_group}"
        return f"{count} pipelines {alone} need more nodes than the {nodes} of {where}"
    alone = {g.pipelines[0] for g, t in memo.items() if math.isfinite(t) and len(g.pipelines) == 1}
    missing = [i for i in range(count) if i not in alone]
    if missing:
        return f"pipeline(s) {missing} fit no node count of any kind on {where}"
    return f"no placement of {count} pipelines in groups of at most {max_group} fits {where}"
