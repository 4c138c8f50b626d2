"""Run a simulation: workloads × policy on one node, and its lower bound.

    SimConfig ─► workloads (sim/workload.py) ─► placement (policy) ─► PipelineRun × K
              ─► slowdown grid: the analytic prior of the first workload's deployment
              ─► NodeSim(runs, node, grid, policy).run() ─► SimResult
    lower_bound(config): max( each pipeline alone (its own critical path, step after step),
                              device-seconds of all work / (GPUs × best packing efficiency) )

Pipelines draw their samples from their own seeded generator, so every policy sees the
same rollouts.  A device type is shared by the node: workloads must agree on it.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace

from jigsaw.graph.plan import NodeSpec, SchedulerConfig
from jigsaw.graph.policy import make
from jigsaw.mux.costmodel import StepCost
from jigsaw.mux.prior import DEVICES, PriorConfig, analytic_prior
from jigsaw.sim import workload
from jigsaw.sim.node import NodeSim
from jigsaw.sim.pipeline import PipelineRun
from jigsaw.trace import Trace


@dataclass(frozen=True, kw_only=True, slots=True)
class SimConfig:
    """One simulated run."""

    workload: tuple[str, ...] = ("qwen3-4b-gsm8k", "qwen3-4b-gsm8k")
    """Workloads, one per co-located pipeline: shipped names or TOML paths (`jigsaw sim
    --list` shows them); comma-separated also works."""
    policy: str = "jigsaw"
    """serial | static | muxserve | rollmux | hrrs | greedy | jigsaw (the CLI also takes a comma list
    or 'all'), the same policies `jigsaw daemon --policy` runs live."""
    gpus: int | None = None
    """GPUs of the node; if unset, the first workload's."""
    steps: int = 20
    """RL steps per pipeline."""
    seed: int = 0
    """Seed of every pipeline's sample generator (pipeline i uses seed*1000 + i)."""
    tailbatch: bool = False
    """RollPacker tail batching inside every pipeline (combines with any policy)."""
    sched: SchedulerConfig = field(default_factory=SchedulerConfig)
    """The look-ahead scheduler (jigsaw; greedy is it at window 1), as the daemon's."""
    trace: bool = True
    """Record grants, releases, migrations and steps."""


@dataclass(frozen=True, kw_only=True, slots=True)
class PipelineResult:
    name: str
    workload: str
    steps: int
    tokens: int
    step_latency_s: tuple[float, ...]
    finish_s: float

    @property
    def mean_step_latency_s(self) -> float:
        return statistics.fmean(self.step_latency_s) if self.step_latency_s else 0.0


@dataclass(frozen=True, kw_only=True, slots=True)
class SimResult:
    config: SimConfig
    makespan_s: float
    pipelines: tuple[PipelineResult, ...]
    decisions: int
    violations: tuple[str, ...]
    trace: Trace | None = field(default=None, compare=False)

    @property
    def tokens(self) -> int:
        return sum(p.tokens for p in self.pipelines)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.makespan_s if self.makespan_s > 0 else 0.0


def expand(names: tuple[str, ...]) -> list[str]:
    """Workload names, with comma-separated lists split."""
    return [n for item in names for n in item.split(",") if n]


def build(config: SimConfig, only: int | None = None):
    """(runs, node, grid, policy) for a configuration; `only` keeps one pipeline (with its
    own seed and placement as if alone, for the lower bound)."""
    specs = [workload.get(w) for w in expand(config.workload)]
    devices = {s.device for s in specs}
    if len(devices) > 1:
        raise ValueError(f"workloads on one node must share a device type, got {sorted(devices)}")
    tp = {s.rollout_tp for s in specs}
    if len(tp) > 1:
        raise ValueError(f"workloads on one node must share rollout_tp (a device is a TP group), got {sorted(tp)}")
    tp = tp.pop()
    gpus = config.gpus or specs[0].gpus
    if gpus % tp:
        raise ValueError(f"{gpus} GPUs do not split into TP groups of {tp}")
    pol = make(config.policy, config.sched)
    chosen = list(range(len(specs))) if only is None else [only]
    # A scheduling device is one TP group: its GPUs always run the same sub-stages in lockstep.
    places = pol.placement(len(chosen), gpus // tp)
    device = DEVICES[specs[0].device]
    runs, grid = [], None
    for k, (i, (roll, train)) in enumerate(zip(chosen, places)):
        spec = specs[i]
        prior_cfg = PriorConfig(rollout_tp=tp, fsdp_degree=len(train) * tp,
                                train_forward_passes=4.0 if spec.gradient_checkpointing else 3.0)
        if grid is None:
            grid = analytic_prior(device, spec.model, prior_cfg)
        runs.append(PipelineRun(k, spec, name=f"p{i}-{spec.name}", steps=config.steps, seed=config.seed * 1000 + i,
                                cost=StepCost(device, spec.model, prior_cfg), rollout_devices=roll,
                                train_devices=train, tailbatch=config.tailbatch))
    node = NodeSpec(num_devices=gpus // tp, mem_bytes=device.mem_bytes)
    return runs, node, grid, pol


def simulate(config: SimConfig) -> SimResult:
    runs, node, grid, pol = build(config)
    sim = NodeSim(runs, node, grid, pol, trace=config.trace, next_step=config.sched.next_step)
    sim.run()
    results = tuple(PipelineResult(name=r.name, workload=r.spec.name, steps=len(r.metrics),
                                   tokens=sum(m.tokens for m in r.metrics),
                                   step_latency_s=tuple(m.end_s - m.start_s for m in r.metrics),
                                   finish_s=r.metrics[-1].end_s if r.metrics else 0.0) for r in runs)
    return SimResult(config=config, makespan_s=max(p.finish_s for p in results), pipelines=results,
                     decisions=sim.decisions, violations=tuple(sim.violations), trace=sim.trace)


@dataclass(frozen=True, kw_only=True, slots=True)
class LowerBound:
    makespan_s: float
    critical_path_s: float
    """The slowest pipeline run alone on the whole node."""
    resource_s: float
    """Device-seconds of all exclusive work / (GPUs × best packing efficiency of the grid)."""
    alone_s: tuple[float, ...] = ()
    """Each pipeline alone on the node: its whole run, all steps."""


def lower_bound(config: SimConfig) -> LowerBound:
    """No policy can finish before this (the same samples, see the module docstring)."""
    alone, work = [], 0.0
    grid = None
    for i in range(len(expand(config.workload))):
        runs, node, grid_i, _ = build(replace(config, policy="serial", trace=False), only=i)
        grid = grid or grid_i
        NodeSim(runs, node, grid_i, make("serial"), trace=False).run()
        alone.append(runs[0].metrics[-1].end_s)
        work += runs[0].device_s
    first = workload.get(expand(config.workload)[0])
    devices = (config.gpus or first.gpus) // first.rollout_tp
    resource = work / (devices * max(1.0, grid.max_pack_efficiency()))
    cp = max(alone)
    return LowerBound(makespan_s=max(cp, resource), critical_path_s=cp, resource_s=resource, alone_s=tuple(alone))


def stage_shares(spec: workload.WorkloadSpec, gpus: int, steps: int, seed: int = 0) -> tuple[float, ...]:
    """(rollout, reference, training, tool) % of step time of one pipeline alone under
    `serial`, as JigsawRL Table 1 reports verl's (tool waits on the rollout's critical path
    count as tool, not rollout)."""
    runs, node, grid, pol = build(SimConfig(workload=(spec.name,), policy="serial", gpus=gpus, steps=steps,
                                            seed=seed, trace=False))
    runs[0].spec = spec
    NodeSim(runs, node, grid, pol, trace=False).run()
    stages = ("rollout", "reference", "training", "tool")
    sums = {k: sum(m.stage_s.get(k, 0.0) for m in runs[0].metrics) for k in stages}
    sums["rollout"] -= sums["tool"]
    total = sum(sums.values()) + sum(m.stage_s.get("reward", 0.0) for m in runs[0].metrics)
    return tuple(100 * sums[k] / total for k in ("rollout", "reference", "training", "tool"))
