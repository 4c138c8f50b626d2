"""Run a simulation: workloads × policy on one node, and its lower bound.

    SimConfig ─► pipelines(): workloads (sim/workload.py) + per-pipeline TP / FSDP / offload
              flags, in a canonical order (the listing order never changes a result)
              ─► placement (policy) ─► Parallelism ─► PipelineRun × K (sim/deploy.py costs)
              ─► (model, PriorConfig) per pipeline ─► mux.model.grids: step costs, and the
                 node grid (the pipelines' own analytic prior, or the mix prior of several)
              ─► needs(): what each pipeline's sub-stage kinds need of a device (cost model)
                 ─► policy.refusal(needs): a policy that cannot run them is Infeasible with
                    its reason before any simulated time passes
              ─► NodeSim(runs, node, grid, policy).run() ─► SimResult (physics: each side
                 of a pair priced by its own model, sim/physics.py; or a true grid the
                 config names, while the policy plans with the prior or the grid it learns)
    lower_bound(config): max( each pipeline alone (its own critical path, step after step),
                              device-seconds of all work / (GPUs × best packing efficiency) )

Pipelines draw their samples from their own seeded generator, so every policy sees the
same rollouts.  A device type is shared by the node: workloads must agree on it.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, replace

from jigsaw.graph.placement import Placement, shape
from jigsaw.graph.plan import NodeSpec, SchedulerConfig
from jigsaw.graph.policies import make
from jigsaw.graph.policy import Needs, PipelineNeeds, refusal
from jigsaw.graph.slo import check_slo, within
from jigsaw.graph.substage import DEVICE_KINDS, SubStageKind
from jigsaw.mux.model import grids
from jigsaw.mux.model.learned import GridLearner, parse_scale, scaled
from jigsaw.mux.model.slowdown import SlowdownGrid
from jigsaw.mux.model.specs import DEVICES, PriorConfig
from jigsaw.node.learning import Learned
from jigsaw.sim import workload
from jigsaw.sim.asynchronous import Coupling, RolloutSide, TrainSide
from jigsaw.sim.deploy import Parallelism, Replicas
from jigsaw.sim.node import Infeasible, NodeSim
from jigsaw.sim.physics import Physics
from jigsaw.sim.pipeline import PipelineRun
from jigsaw.sim.placement import Choice, choose
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
    """GPUs of the node; if unset, the largest of the workloads'."""
    device: str = ""
    """GPU kind of the node (h100 | a100); empty: the workloads' own, which must agree.  A
    workload on another kind is priced by that kind's analytic prior for its model."""
    node_gpus: int = 0
    """GPUs of one physical node where --gpus spans several: a training shard group larger than
    it pays the inter-node bandwidth.  0: the kind's usual node (8 H100, the paper's 4 A100);
    `--nodes` sets each group's."""
    rollout_tp: tuple[int, ...] = ()
    """Rollout TP of each pipeline, in --workload order; empty: each workload's.  TPs must
    divide each other (a scheduling device is one group of the largest)."""
    fsdp_degree: tuple[int, ...] = ()
    """FSDP shard degree of each pipeline's training; empty: the workload's, else every GPU its
    training runs on."""
    offload: tuple[str, ...] = ()
    """Training state offloaded to host memory per pipeline: none | optimizer | full (verl's
    FSDP optimizer_offload / param_offload); empty: each workload's."""
    mode: tuple[str, ...] = ()
    """How each pipeline's rollout and training meet, in --workload order: sync | one-step-off |
    fully-async (the workload's `mode`); empty: each workload's.  An asynchronous pipeline runs
    as its rollout and training sides on devices of their own (sim/asynchronous.py)."""
    steps: int = 20
    """RL steps per pipeline."""
    seed: int = 0
    """Seed of every pipeline's sample generator (pipeline i uses seed*1000 + i)."""
    sample_streams: tuple[int, ...] = ()
    """Sample stream of each pipeline, in --workload order: its generator's seed is
    seed*1000 + stream; empty: its place in the canonical order.  A pipeline placed beside other
    partners (jigsaw/cluster) keeps its stream, so it trains the same samples."""
    tailbatch: bool = False
    """RollPacker tail batching inside every pipeline (combines with any policy)."""
    sched: SchedulerConfig = field(default_factory=SchedulerConfig)
    """The look-ahead scheduler (jigsaw; greedy is it at window 1), as the daemon's."""
    placement: str = "auto"
    """Where jigsaw and greedy put the pipelines: colocated | paired | split | disaggregated |
    shared-pool (graph/placement.py), or auto: each of them simulated for
    `placement_trial_steps` steps on samples of their own, the fastest kept (sim/placement.py).
    The baselines keep their own placement."""
    placement_trial_steps: int = 8
    """RL steps of each placement trial (auto; at most the run's).  Shorter trials mislead:
    the ratio of two shapes' 4-step trials spreads by 2-3% (SD) over trial seeds, and where
    pipelines fall into step with each other only after a few steps (Qwen3-0.6B GSM8K:
    sharing 7% ahead over 20 steps, 1% in a 4-step trial) they miss the gain."""
    placement_min_gain_frac: float = 0.02
    """A shape that shares devices is kept over split (each pipeline on devices of its own)
    only if its trial is at least this much faster: what sharing gains is the slowdown
    model's prediction, within its error for a gain this small; split shares nothing to
    mispredict."""
    placement_confirm_frac: float = 0.05
    """A shape that shares devices and whose trial beats split by less than this (but by the
    least gain) is tried again, split beside it, on samples of a second trial seed, and kept
    only if it beats split by the least gain over both trials: one trial's ratio of two shapes
    spreads by about 2% (SD) over trial seeds, so a gain near the least one is as likely
    noise.  0: one trial decides."""
    trial_windows: tuple[int, ...] = (1,)
    """Look-ahead windows jigsaw also tries (auto placement) on the shape kept, on the same
    trial samples; one is run instead of the scheduler's window if its trial is faster by
    `trial_window_min_gain_frac` (W = 1: what greedy would do there).  Empty: the scheduler's
    window only."""
    trial_window_min_gain_frac: float = 0.01
    """The least gain a window's trial must show over the scheduler's own window to be kept:
    the default window is the one measured best across families (bench/scheduler_quality.py);
    another is kept only where a workload's own trial says so (the 32B SWE-agent pair: W = 1
    ends 2-5% before W = 2 on each of three sample seeds)."""
    trace: bool = True
    """Record grants, releases, migrations and steps."""
    true_grid: str = ""
    """The grid the physics runs by (a file or a name, see `jigsaw inspect`), while the policy
    plans with the prior (or the grid it learns, --learn-grid); empty: the prior is the truth.
    A node with one grid for all its pipelines then (no per-pair views)."""
    true_grid_scale: tuple[str, ...] = ()
    """Entries of the true grid as the prior's times a factor, KIND/PARTNER=FACTOR each (PARTNER
    `alone`: the kind alone), e.g. training/rollout_decode=1.5; over --true-grid if given."""
    learn_grid: bool = False
    """The policy plans with a grid learned online from every finished sub-stage, starting from
    the prior (mux/model/learned.py, the daemon's --learn-grid)."""
    slo: tuple[float, ...] = ()
    """Slowdown SLO per pipeline, in --workload order (one value: every pipeline; 0: none):
    a step may take at most this × its exclusive time (graph/slo.py).  jigsaw and greedy plan
    to keep it; every policy's steps are measured against it."""

    def __post_init__(self) -> None:
        if self.slo and len(self.slo) not in (1, len(expand(self.workload))):
            raise ValueError(f"--slo takes one value or one per workload ({len(expand(self.workload))}), "
                             f"got {len(self.slo)}")
        for x in self.slo:
            if x:
                check_slo(x)
        if self.placement_trial_steps < 1:
            raise ValueError(f"--placement-trial-steps must be at least 1, got {self.placement_trial_steps}")
        if self.node_gpus < 0:
            raise ValueError(f"--node-gpus must be at least 1 (0: the kind's usual node), got {self.node_gpus}")
        if any(w < 1 for w in self.trial_windows):
            raise ValueError(f"--trial-windows must be at least 1 each, got {self.trial_windows}")
        for name in ("placement_min_gain_frac", "placement_confirm_frac", "trial_window_min_gain_frac"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"--{name.replace('_', '-')} must be in [0, 1), got {getattr(self, name)}")

    def slo_of(self, i: int) -> float | None:
        """Pipeline i's SLO (None: none)."""
        if not self.slo:
            return None
        got = self.slo[0] if len(self.slo) == 1 else self.slo[i]
        return got or None


@dataclass(frozen=True, kw_only=True, slots=True)
class PipelineResult:
    name: str
    workload: str
    steps: int
    tokens: int
    samples: int
    step_latency_s: tuple[float, ...]
    finish_s: float
    exclusive_step_s: tuple[float, ...] = ()
    """With an SLO: each step of the pipeline alone on the node, the same samples
    (`exclusive_steps`; a daemon, with no such truth, measures its pieces' exclusive work:
    node/slo.py); else empty."""
    slo_slowdown: float | None = None

    @property
    def slowdown(self) -> float:
        """Mean step latency over mean exclusive step (1.0: as fast as alone)."""
        excl = statistics.fmean(self.exclusive_step_s) if self.exclusive_step_s else 0.0
        return self.mean_step_latency_s / excl if excl > 0 else 1.0

    @property
    def slo_kept(self) -> tuple[int, int] | None:
        """(steps within the SLO, steps), None without one."""
        if self.slo_slowdown is None:
            return None
        pairs = list(zip(self.step_latency_s, self.exclusive_step_s))
        return sum(1 for lat, ex in pairs if within(lat, ex, self.slo_slowdown)), len(pairs)

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
    placement: Choice | None = None
    """How the placement was chosen (auto), else None: the configured shape, or the policy's own."""
    learner: GridLearner | None = field(default=None, compare=False)
    """What the run learned (learn_grid), else None."""
    learned: tuple[Learned, ...] = field(default=(), compare=False)
    """Each finished sub-stage the learner took, in order, with the plan's error for it."""

    @property
    def tokens(self) -> int:
        return sum(p.tokens for p in self.pipelines)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.makespan_s if self.makespan_s > 0 else 0.0


def expand(names: tuple[str, ...]) -> list[str]:
    """Workload names, with comma-separated lists split."""
    return [n for item in names for n in item.split(",") if n]


def pipelines(config: SimConfig) -> list[tuple[workload.WorkloadSpec, int, int | None, str | None]]:
    """(spec, rollout_tp, fsdp_degree or None, offload or None) of every pipeline, flags over
    workload fields, in a canonical order: the result never depends on the listing order."""
    listed = _listed(config)
    return [listed[j] for j in _canonical(listed)]


def sample_seeds(config: SimConfig) -> list[int]:
    """Sample seed of each pipeline, in `pipelines` order."""
    if not config.sample_streams:
        return [config.seed * 1000 + i for i in range(len(expand(config.workload)))]
    streams = [config.sample_streams[j] for j in _canonical(_listed(config))]
    if not all(0 <= s < 1000 for s in streams):
        raise ValueError(f"--sample-streams must be in [0, 1000), got {config.sample_streams}")
    return [config.seed * 1000 + s for s in streams]


def _canonical(listed: list) -> list[int]:
    return sorted(range(len(listed)), key=lambda j: (listed[j][0].name, listed[j][1], listed[j][2] or 0, listed[j][3]))


def _listed(config: SimConfig) -> list[tuple[workload.WorkloadSpec, int, int | None, str | None]]:
    specs = [workload.get(w) for w in expand(config.workload)]
    for name, values in (("rollout_tp", config.rollout_tp), ("fsdp_degree", config.fsdp_degree),
                         ("offload", config.offload), ("mode", config.mode), ("sample_streams", config.sample_streams)):
        if values and len(values) != len(specs):
            raise ValueError(f"--{name.replace('_', '-')} gives {len(values)} values for {len(specs)} pipelines")
    if config.mode:
        specs = [s if m == s.mode else replace(s, mode=m, provenance={**s.provenance, "mode": "the run's --mode"})
                 for s, m in zip(specs, config.mode)]
    if config.device:
        if config.device not in DEVICES:
            raise ValueError(f"--device {config.device!r} unknown; known: {', '.join(sorted(DEVICES))}")
        specs = [s if s.device == config.device else
                 replace(s, device=config.device, provenance={**s.provenance, "device": "the run's --device"})
                 for s in specs]
    out = []
    for i, s in enumerate(specs):
        tp = config.rollout_tp[i] if config.rollout_tp else s.rollout_tp
        fsdp = config.fsdp_degree[i] if config.fsdp_degree else (s.fsdp_degree or None)
        off = config.offload[i] if config.offload else s.offload
        out.append((s, tp, fsdp, off))
    return out


def build(config: SimConfig, only: int | None = None, placed_as: str | None = None,
          placed: list[Placement] | None = None):
    """(runs, node, grid, policy) for a configuration; `only` keeps one pipeline (with its
    own seed and placement as if alone, for the lower bound), placed as policy `placed_as`
    would place it alone (default: the configured policy), or where `placed` says."""
    items = pipelines(config)
    devices = {s.device for s, *_ in items}
    if len(devices) > 1:
        raise ValueError(f"workloads on one node must share a device type, got {sorted(devices)}")
    # A scheduling device is one group of the largest TP: its GPUs always run the same
    # sub-stages in lockstep; a smaller TP runs several engines on it (sim/deploy.py).
    per_device = max(tp for _, tp, _, _ in items)
    gpus = config.gpus or max(s.gpus for s, *_ in items)
    if gpus % per_device:
        raise ValueError(f"{gpus} GPUs do not split into scheduling devices of {per_device} (the largest rollout_tp)")
    pol = make(config.policy, config.sched)
    chosen = list(range(len(items))) if only is None else [only]
    try:
        places = placed or _placement(config, placed_as, len(chosen), gpus // per_device)
    except ValueError as exc:
        raise Infeasible(str(exc)) from exc
    device_name = items[0][0].device
    device = DEVICES[device_name]
    runs, deployments, seeds = [], [], sample_seeds(config)
    for i, (roll, train) in zip(chosen, places):
        spec, tp, fsdp, offload = items[i]
        roll, train = sides(spec, roll, train)
        if not roll or not train:
            raise Infeasible(f"{pol.name}: its placement leaves {spec.name} no devices for rollout or training "
                             f"on {gpus // per_device} scheduling devices of {per_device} GPUs")
        dep = Parallelism(rollout_tp=tp, fsdp_degree=fsdp or len(train) * per_device, gpus_per_device=per_device,
                         offload=offload)
        deployment = (spec.model, prior_config(spec, dep, config.node_gpus))
        deployments.append(deployment)
        try:
            cost = Replicas(grids.step_cost(device_name, deployment), dep.replicas, per_device)
        except ValueError as exc:  # this policy's placement gives its training too few GPUs
            raise Infeasible(f"{pol.name}: {spec.name} on {len(train)} of {gpus // per_device} devices: {exc}; "
                             "more GPUs per pipeline, a larger fsdp_degree or offload would fit") from exc
        kw = dict(steps=config.steps, seed=seeds[i], cost=cost, tailbatch=config.tailbatch,
                  slo_slowdown=config.slo_of(i))
        runs += _runs(len(runs), spec, f"p{i}-{spec.name}", roll, train, kw)
    node = NodeSpec(num_devices=gpus // per_device, mem_bytes=device.mem_bytes)
    try:
        grid = grids.prior_grid(device_name, deployments)
    except ValueError as exc:  # a model whose weights or state do not fit a device at all
        raise Infeasible(f"{pol.name}: {exc}") from exc
    return runs, node, grid, pol


def sides(spec: workload.WorkloadSpec, roll: tuple[int, ...], train: tuple[int, ...]) -> Placement:
    """Where an asynchronous pipeline's rollout and training go: a placement that shares its
    devices between them is split by rollout_frac (disaggregated, as StreamRL and AReaL run;
    a single device is shared); a sync pipeline stays where it was placed."""
    if spec.is_async and roll == train and len(roll) > 1:
        cut = min(len(roll) - 1, max(1, round(spec.rollout_frac * len(roll))))
        return roll[:cut], roll[cut:]
    return roll, train


def _runs(index: int, spec: workload.WorkloadSpec, name: str, roll: tuple[int, ...], train: tuple[int, ...],
          kw: dict) -> list[PipelineRun]:
    """One pipeline, or an asynchronous one's two sides (placed by `sides`)."""
    if not spec.is_async:
        return [PipelineRun(index, spec, name=name, rollout_devices=roll, train_devices=train, **kw)]
    if kw["tailbatch"] or kw["slo_slowdown"]:
        raise ValueError(f"{name}: tail batching and SLOs are not simulated for asynchronous pipelines")
    coupling = Coupling(name, spec.staleness_bound)
    rollout = RolloutSide(index, spec, coupling=coupling, rollout_devices=roll, train_devices=roll, **kw)
    return [rollout, TrainSide(index + 1, spec, coupling=coupling, rollout=rollout, rollout_devices=train,
                               train_devices=train, **kw)]


def _placement(config: SimConfig, placed_as: str | None, k: int, devices: int) -> list[Placement]:
    """The configured shape for a policy that runs on several (auto before its trial: the
    policy's own), else the policy's own placement."""
    pol = make(placed_as or config.policy)
    shapes = getattr(pol, "shapes", ())
    if placed_as is None and shapes and config.placement != "auto":
        if config.placement not in shapes:
            raise ValueError(f"{pol.name} runs on {', '.join(shapes)}, not on placement {config.placement!r}")
        return shape(config.placement)(k, devices)
    return pol.placement(k, devices)


def prior_config(spec: workload.WorkloadSpec, dep: Parallelism, node_gpus: int = 0) -> PriorConfig:
    return PriorConfig(rollout_tp=dep.rollout_tp, fsdp_degree=dep.fsdp_degree, node_gpus=node_gpus,
                       train_forward_passes=4.0 if spec.gradient_checkpointing else 3.0, offload=dep.offload)


def needs(runs: list[PipelineRun], node: NodeSpec) -> Needs:
    """What each pipeline's sub-stage kinds need of one device, from its deployment's cost model:
    reference and training their FSDP footprint, a rollout engine its weights, reserve and
    one response at the cap (SGLang fails a request its pool cannot finish)."""
    def need_bytes(r: PipelineRun, kind: SubStageKind) -> int:
        if kind.is_rollout:
            return r.cost.rollout_mem_bytes(r.spec.lengths.max_tokens)
        return r.cost.fsdp_mem_bytes(train=kind is SubStageKind.TRAINING)

    return Needs(device_mem_bytes=node.mem_bytes, pipelines=tuple(
        PipelineNeeds(name=r.name, rollout_devices=r.rollout_devices, train_devices=r.train_devices,
                      mem_bytes={k.value: need_bytes(r, k) for k in DEVICE_KINDS}, mode=r.spec.mode) for r in runs))


def simulate(config: SimConfig, until_s: float | None = None, measure_slo: bool = True) -> SimResult:
    """The run `config` describes; with `until_s`, node.Cut once it passes that much simulated
    time (a placement trial that can no longer win).  With SLOs (and `measure_slo`), each
    pipeline is also run alone for its exclusive steps, the truth its SLO is measured by."""
    choice = None
    if config.placement == "auto" and getattr(make(config.policy), "shapes", ()):
        choice = choose(config, pipelines=len(expand(config.workload)), devices=_devices(config), simulate=simulate,
                        asynchronous=any(spec.is_async for spec, *_ in pipelines(config)))
        config = replace(config, placement=choice.shape,
                         sched=replace(config.sched, window=choice.window) if choice.window else config.sched)
    runs, node, grid, pol = build(config)
    why = refusal(pol, needs(runs, node))
    if why is not None:  # before the run: the row says why, no simulated time is spent
        raise Infeasible(why)
    truth = true_grid(config, grid)
    learner = GridLearner(grid) if config.learn_grid else None
    sim = NodeSim(runs, node, grid, pol, trace=config.trace, next_step=config.sched.next_step, truth=truth,
                  learner=learner)
    sim.run(until_s)
    alone = exclusive_steps(config) if config.slo and measure_slo else {}
    results = tuple(PipelineResult(name=r.name, workload=r.spec.name, steps=len(r.metrics),
                                   tokens=sum(m.tokens for m in r.metrics),
                                   samples=sum(m.samples for m in r.metrics),
                                   step_latency_s=tuple(m.end_s - m.start_s for m in r.metrics),
                                   finish_s=r.metrics[-1].end_s if r.metrics else 0.0,
                                   exclusive_step_s=alone.get(i, ()), slo_slowdown=r.slo_slowdown)
                    for i, r in enumerate(runs))
    return SimResult(config=config, makespan_s=max(p.finish_s for p in results), pipelines=results,
                     decisions=sim.decisions, violations=tuple(sim.violations), trace=sim.trace, placement=choice,
                     learner=learner, learned=tuple(sim.state.grants.history) if learner else ())


def exclusive_steps(config: SimConfig) -> dict[int, tuple[float, ...]]:
    """Per pipeline with an SLO, each of its steps alone on every device of the node (the same
    samples, one step after another): the exclusive step its SLO is measured against."""
    serial = replace(config, policy="serial", trace=False, slo=())
    every = tuple(range(_devices(config)))
    out = {}
    for i in range(len(expand(config.workload))):
        if config.slo_of(i) is None:
            continue
        runs, node, grid, _ = build(serial, only=i, placed=[(every, every)])
        NodeSim(runs, node, grid, make("serial"), trace=False).run()
        out[i] = tuple(m.end_s - m.start_s for m in runs[0].metrics)
    return out


def true_grid(config: SimConfig, prior: SlowdownGrid) -> SlowdownGrid | None:
    """The grid the physics runs by (SimConfig.true_grid, true_grid_scale); None: the prior's."""
    if not config.true_grid and not config.true_grid_scale:
        return None
    base = SlowdownGrid.load(config.true_grid) if config.true_grid else prior
    return scaled(base, parse_scale(config.true_grid_scale)) if config.true_grid_scale else base


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
    """No policy can finish before this (the same samples, see the module docstring).  A
    pipeline alone is run on every placement a policy could give it (fewer GPUs can be faster:
    FSDP within a node), and the fastest counts, and its least device-seconds."""
    alone, work = [], 0.0
    serial = replace(config, policy="serial", trace=False)
    for i in range(len(expand(config.workload))):
        best_s = best_work = math.inf
        for placed in _alone_placements(serial, i):
            try:
                runs, node, grid_i, _ = build(serial, only=i, placed=[placed])
            except Infeasible:
                continue
            NodeSim(runs, node, grid_i, make("serial"), trace=False).run()
            # an asynchronous pipeline is its two sides: it ends with the later, works in both
            end_s, device_s = max(r.metrics[-1].end_s for r in runs), sum(r.device_s for r in runs)
            best_s, best_work = min(best_s, end_s), min(best_work, device_s)
        if math.isinf(best_s):
            raise Infeasible(f"{expand(config.workload)[i]} cannot run alone on this node under any placement")
        alone.append(best_s)
        work += best_work
    runs, node, grid, _ = build(serial)
    physics = Physics.of(grid, runs)
    resource = work / (node.num_devices * max(1.0, physics.max_pack_efficiency()))
    cp = max(alone)
    return LowerBound(makespan_s=max(cp, resource), critical_path_s=cp, resource_s=resource, alone_s=tuple(alone))


def _devices(config: SimConfig) -> int:
    """Scheduling devices of the node (`build`'s count, without building it)."""
    return num_gpus(config) // max(tp for _, tp, _, _ in pipelines(config))


def num_gpus(config: SimConfig) -> int:
    """GPUs of the node (a TP group is several): what a run holds and is priced by (sim/cost.py)."""
    return config.gpus or max(s.gpus for s, *_ in pipelines(config))


def _alone_placements(config: SimConfig, i: int) -> list[Placement]:
    """Every distinct place a policy could give the i-th pipeline (in canonical order): each
    policy's placement of it alone and among all the node's pipelines, under every shape it
    runs on; alone, a pipeline cares only how many devices its stages get and which they
    share, so devices are renumbered in order of use."""
    from jigsaw.graph.placement import SHAPES
    from jigsaw.graph.policies import NAMES

    k, devices = len(pipelines(config)), _devices(config)
    seen: list[Placement] = []
    for name in NAMES:
        pol = make(name)
        ways = [(1, 0, pol.placement), (k, i, pol.placement)] + [(k, i, SHAPES[s]) for s in getattr(pol, "shapes", ())]
        for n, at, place in ways:
            try:
                got = _renumbered(place(n, devices)[at])
            except ValueError:
                continue
            if got not in seen:
                seen.append(got)
    return seen


def _renumbered(placed: Placement) -> Placement:
    order = {d: n for n, d in enumerate(dict.fromkeys(placed[0] + placed[1]))}
    return tuple(order[d] for d in placed[0]), tuple(order[d] for d in placed[1])


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
