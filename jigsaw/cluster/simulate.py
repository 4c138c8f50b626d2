"""A cluster simulated: pipelines placed on nodes of kinds, each group of nodes simulated.

    ClusterConfig (nodes, placement policies, trial steps) + SimConfig (workloads, steps, seed)
      ─► per placement policy (PLACERS), decide():
           jigsaw  groups of one or two, a group priced by jigsaw running its first steps
           hetrl   groups of one: each pipeline on nodes of its own, their kind and count
                   searched (HetRL's setting: one RL job per GPU set, time-shared inside)
           rollmux RollMux's admission: in arrival order, each packed into a group within its
                   SLO, else on a node of its own; groups run RollMux's phase round robin
         place() (cluster/placement.py), each estimate a trial: the group's first
         `cluster_trial_steps` steps on trial samples, on its kind's grid and GPUs
      ─► each group simulated for every step (sim/run.simulate, the same call as the trial:
         the group's kind, GPUs, node policy, each pipeline on its own sample stream)
      ─► ClusterResult: makespan (the slowest group), tokens, the cluster's GPU-hours, each
         group's predicted and simulated makespan

Groups do not interact: a pipeline spans the nodes of its group only.  The network between
nodes is priced only where a pipeline's FSDP group is larger than its kind's node in the cost
model (mux/model/roofline.py: its collectives then run at the inter-node bandwidth); DP
replicas and rollout workers across nodes cost as within one node.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from jigsaw.cluster.placement import RESIDENCY, Estimate, Group, Placement, admit, place
from jigsaw.cluster.spec import NodeKind, parse_nodes
from jigsaw.sim.node import Cut, Infeasible
from jigsaw.sim.placement import TRIAL_SEED
from jigsaw.sim.run import SimConfig, SimResult, expand, simulate


@dataclass(frozen=True, kw_only=True, slots=True)
class ClusterConfig:
    """A cluster of nodes for `jigsaw sim`, and how its pipelines are placed."""

    nodes: str = ""
    """The cluster as COUNTxKIND[:GPUS], comma-separated (4xh100,4xa100; unless :GPUS, the
    kind's usual node: 8 H100, the paper's 4 A100): the pipelines are placed on its nodes by
    each --cluster-policy and every group of nodes is simulated.  Empty: one node, as without it."""
    cluster_policy: tuple[str, ...] = ("jigsaw", "hetrl", "rollmux")
    """Placement policies to compare: jigsaw (singles and pairs, priced by jigsaw's own runs),
    hetrl (each pipeline on nodes of its own, priced alone) and rollmux (RollMux's admission: each
    pipeline in turn packed into a group within a 2x SLO, else on one node of its own)."""
    cluster_trial_steps: int = 3
    """RL steps of the trial that prices one group for placement (on samples no run uses)."""

    def __post_init__(self) -> None:
        if self.nodes:
            parse_nodes(self.nodes)  # a malformed cluster is a usage error, before any trial
        unknown = [p for p in self.cluster_policy if p not in PLACERS]
        if unknown or not self.cluster_policy:
            raise ValueError(f"--cluster-policy {unknown or '(none)'} unknown; choose from {', '.join(PLACERS)}")
        if self.cluster_trial_steps < 1:
            raise ValueError(f"--cluster-trial-steps must be at least 1, got {self.cluster_trial_steps}")


@dataclass(frozen=True, kw_only=True, slots=True)
class Placer:
    max_group: int
    """1: every pipeline alone on its nodes; 2: pairs share theirs (the search's groups)."""
    node_policy: str
    """The policy that runs a group's node(s)."""
    admission: bool = False
    """RollMux's online admission (placement.admit) instead of the search."""


PLACERS = {"jigsaw": Placer(max_group=2, node_policy="jigsaw"), "hetrl": Placer(max_group=1, node_policy="serial"),
           "rollmux": Placer(max_group=RESIDENCY, node_policy="rollmux", admission=True)}


@dataclass(frozen=True, kw_only=True, slots=True)
class ClusterResult:
    policy: str
    placement: Placement
    runs: tuple[SimResult, ...]
    """Each group's simulated run, in `placement.groups` order."""
    cluster_gpus: int
    decide_s: float
    """Wall time of the placement decision (its trials included)."""

    @property
    def makespan_s(self) -> float:
        return max(r.makespan_s for r in self.runs)

    @property
    def tokens(self) -> int:
        return sum(r.tokens for r in self.runs)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.makespan_s if self.makespan_s > 0 else 0.0

    @property
    def gpu_hours(self) -> float:
        """The whole cluster's GPUs for the makespan."""
        return self.cluster_gpus * self.makespan_s / 3600.0

    @property
    def held_gpu_hours(self) -> float:
        """Each group's GPUs until the group ends: what the placement holds (RollMux's cost)."""
        return sum(g.gpus * r.makespan_s for g, r in zip(self.placement.groups, self.runs)) / 3600.0


def group_config(sim: SimConfig, group: Group, policy: str) -> SimConfig:
    """The one-node (or one group of nodes) run of `group`: its pipelines with their own flags
    and sample streams, on its kind and GPUs, under `policy`."""
    pick = group.pipelines

    def sub(values: tuple) -> tuple:
        return tuple(values[i] for i in pick) if len(values) > 1 else values

    names = expand(sim.workload)
    return replace(sim, workload=tuple(names[i] for i in pick), device=group.kind, gpus=group.gpus,
                   node_gpus=group.gpus_per_node, policy=policy,
                   sample_streams=pick, rollout_tp=sub(sim.rollout_tp), fsdp_degree=sub(sim.fsdp_degree),
                   offload=sub(sim.offload), mode=sub(sim.mode), slo=sub(sim.slo))


def estimator(sim: SimConfig, config: ClusterConfig, policy: str) -> Estimate:
    """A group's makespan for its first steps on trial samples (inf where it cannot run, or
    once the trial passes `until_s`: it is stopped there).  Trial samples belong to what a
    pipeline runs, not to its index (trial_streams): two pipelines of one workload are priced
    alike, so a placement never favours one for the luck of its trial draw."""
    steps = min(sim.steps, config.cluster_trial_steps)
    keys = _alike(sim)

    def estimate(group: Group, until_s: float | None = None) -> float:
        trial = replace(group_config(sim, group, policy), steps=steps, seed=TRIAL_SEED + sim.seed, trace=False,
                        placement_trial_steps=min(steps, sim.placement_trial_steps),
                        sample_streams=trial_streams(keys, group.pipelines))
        try:
            return simulate(trial, until_s=until_s, measure_slo=False).makespan_s
        except Cut:
            return math.inf
        except (Infeasible, ValueError):  # too few GPUs for its training, TP not dividing, ...
            return math.inf

    return estimate


def decide(sim: SimConfig, config: ClusterConfig, policy: str, cluster: tuple[NodeKind, ...]) -> Placement:
    """Where `policy` (PLACERS) places `sim`'s pipelines on `cluster`: the simulator's and the
    live controller's one decision."""
    placer = PLACERS[policy]
    estimate = estimator(sim, config, placer.node_policy)
    count = len(expand(sim.workload))
    if placer.admission:
        return admit(count, cluster, estimate)
    return place(count, cluster, estimate, placer.max_group)


def trial_streams(keys: list[tuple], pick: tuple[int, ...]) -> tuple[int, ...]:
    """Trial sample streams of the pipelines `pick`: the first pipeline with the same key
    (workload and flags), and for each earlier one in `pick` with that key one more stride of
    len(keys) (so a pair of one workload still draws two streams, the same whichever two
    pipelines they are, and no two members of a group share one)."""
    first = {k: keys.index(k) for k in keys}
    return tuple(first[keys[i]] + len(keys) * sum(keys[j] == keys[i] for j in pick[:n]) for n, i in enumerate(pick))


def _alike(sim: SimConfig) -> list[tuple]:
    """Per pipeline, what makes two pipelines run alike: the workload and its own flags."""
    names = expand(sim.workload)

    def at(values: tuple, i: int):
        return values[i] if len(values) > 1 else (values[0] if values else None)

    return [(names[i], at(sim.rollout_tp, i), at(sim.fsdp_degree, i), at(sim.offload, i), at(sim.mode, i),
             at(sim.slo, i)) for i in range(len(names))]


def simulate_cluster(sim: SimConfig, config: ClusterConfig, policy: str,
                     say: Callable[[str], None] = lambda line: None) -> ClusterResult:
    """`sim`'s pipelines placed on `config`'s cluster by `policy` (PLACERS), every group run."""
    cluster = parse_nodes(config.nodes)
    placer = PLACERS[policy]
    names = expand(sim.workload)
    t0 = time.perf_counter()
    placed = decide(sim, config, policy, cluster)
    decide_s = time.perf_counter() - t0
    say(f"{policy}: {placed.describe(names)} ({placed.estimates} trials, {decide_s:.1f} s)")
    runs = tuple(simulate(group_config(sim, g, placer.node_policy)) for g in placed.groups)
    return ClusterResult(policy=policy, placement=placed, runs=runs, cluster_gpus=_gpus(cluster), decide_s=decide_s)


def _gpus(cluster: tuple[NodeKind, ...]) -> int:
    return sum(n.count * n.gpus for n in cluster)
