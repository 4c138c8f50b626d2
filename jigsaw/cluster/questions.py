"""The placement questions the cluster controller asks, each a frozen snapshot of its book: pure
data in, the decision out (trials: the actor runs each off its event loop).

    Asking   every submitted pipeline over the live nodes ─► search() (simulate.decide: the
             `jigsaw sim --nodes` decision) ─► assign(): Assigned, concrete node ids per pipeline
    Arrival  one pipeline arriving beside the running groups ─► decide() (placement.admit_one,
             each group priced by the policy's node scheduler) ─► packed into a group, or a
             group of free nodes of its own
"""

from __future__ import annotations

from dataclasses import dataclass

from jigsaw.cluster.placement import Group, Placement
from jigsaw.cluster.simulate import ClusterConfig, decide
from jigsaw.cluster.spec import NodeKind


@dataclass(frozen=True, kw_only=True, slots=True)
class Assigned:
    """A placement on concrete nodes."""

    nodes: dict[str, tuple[str, ...]]
    """Per pipeline name: the node ids its group runs on."""
    groups: tuple[Group, ...]
    predicted_s: tuple[float, ...]


@dataclass(frozen=True, kw_only=True, slots=True)
class Asking:
    """A placement question: the pipelines, and the live nodes by (kind, GPUs)."""

    names: tuple[str, ...]
    workloads: tuple[str, ...]
    by_kind: dict[tuple[str, int], tuple[str, ...]]
    steps: int
    trial_steps: int
    seed: int
    policy: str

    def search(self) -> Placement:
        """The placement (placement.place, each group priced by a simulator trial): seconds to
        minutes of trials, so the actor runs it off its event loop."""
        from jigsaw.sim.run import SimConfig

        cluster = tuple(NodeKind(kind=k, count=len(ids), gpus=g) for (k, g), ids in self.by_kind.items())
        sim = SimConfig(workload=self.workloads, steps=self.steps, seed=self.seed, trace=False)
        return decide(sim, ClusterConfig(cluster_trial_steps=self.trial_steps), self.policy, cluster)

    def assign(self, placed: Placement) -> Assigned:
        """Concrete nodes for each group, in the order the nodes joined."""
        free = {key: list(ids) for key, ids in self.by_kind.items()}
        nodes = {}
        for g in placed.groups:
            pool = free[(g.kind, g.gpus_per_node)]
            taken, free[(g.kind, g.gpus_per_node)] = tuple(pool[:g.nodes]), pool[g.nodes:]
            nodes.update({self.names[i]: taken for i in g.pipelines})
        return Assigned(nodes=nodes, groups=placed.groups, predicted_s=placed.predicted_s)


@dataclass(frozen=True, kw_only=True, slots=True)
class Arrival:
    """A pipeline arriving while others run: where it goes, by RollMux's admission rule
    (placement.admit_one) with each group priced by the policy's node scheduler."""

    names: tuple[str, ...]
    """The running pipelines, then the one arriving (last)."""
    workloads: tuple[str, ...]
    groups: tuple[Group, ...]
    """The running groups, over indices into `names`."""
    cluster: tuple[NodeKind, ...]
    free: dict[str, int]
    """Nodes no group holds, per kind."""
    steps: int
    trial_steps: int
    seed: int
    policy: str

    def decide(self) -> tuple[int | None, Group]:
        """(k: packed into groups[k], or None: nodes of its own) and its group: trials, so the
        actor runs it off its event loop."""
        from jigsaw.cluster.placement import RESIDENCY, admit_one
        from jigsaw.cluster.simulate import PLACERS, estimator
        from jigsaw.sim.run import SimConfig

        placer = PLACERS[self.policy]
        sim = SimConfig(workload=self.workloads, steps=self.steps, seed=self.seed, trace=False)
        estimate = estimator(sim, ClusterConfig(cluster_trial_steps=self.trial_steps), placer.node_policy)
        memo: dict[Group, float] = {}

        def priced(g: Group) -> float:
            if g not in memo:
                memo[g] = estimate(g, None)
            return memo[g]

        return admit_one(len(self.names) - 1, list(self.groups), self.cluster, dict(self.free), priced,
                         residency=RESIDENCY if placer.admission else placer.max_group)


__all__ = ["Arrival", "Asking", "Assigned"]
