"""Should these jobs share a node, and what would it cost?  (`jigsaw advise`)

    traces (`jigsaw run` alone, or `jigsaw sim`) ─► jobs: every pipeline in them, its recorded
        sub-stages (replay.recorded: exclusive times, warm-up steps left out), tokens, steps
    ─► alone: each job replayed by itself on its recorded devices ─► its makespan, step latency
    ─► a pair on one node (each job keeps its recorded devices), replayed under
           jigsaw   co-located, the look-ahead deciding (what `jigsaw run` would do)
           serial   one after the other (what a user without jigsaw does with one node)
           static   the devices split in equal shares between the two, each pinned
       ─► Outcome per policy: makespan, tokens/s, each job's step latency over alone
          (its slowdown), Cost (sim/cost.py: GPU-hours per step, $ per M tokens)
    ─► more than two jobs: every way to group them in pairs and singles, each group on a
       node of its own; the one that finishes all their work in the fewest node-hours

The prediction is the simulator's re-packing of the jobs' own recorded sub-stages with the
node's slowdown grid (replay.py says what that models and what it does not): the same code
`jigsaw sim --replay` runs, with the same scheduler the daemon runs.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from jigsaw.graph.placement import groupings
from jigsaw.graph.plan import PipelineState, SchedulerConfig
from jigsaw.graph.policies import make
from jigsaw.sim.cost import Cost, cost_of
from jigsaw.sim.replay import Recorded, Refused, recorded, replay, step_latencies
from jigsaw.trace import Trace

PAIR_POLICIES = ("jigsaw", "serial", "static")
"""What a pair is priced under: co-located by jigsaw, one after the other, a static split."""
MAX_JOBS = 10
"""Pairings of more jobs are too many to try every one (945 at ten)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Job:
    """One pipeline of a trace: the work it would bring to a shared node."""

    name: str
    source: str
    """The trace it came from."""
    state: PipelineState
    tokens: int
    """Tokens of its recorded steps (warm-up left out)."""
    steps: int
    deployment: tuple[str, tuple] | None = None
    """(device name, (model, PriorConfig)) a simulator's trace says it ran as; None: unknown (a
    daemon's trace), the node grid prices it."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Outcome:
    """Some jobs run to the end on one node under one policy (or the policy refused them)."""

    policy: str
    jobs: tuple[str, ...]
    num_devices: int
    makespan_s: float
    tokens: int
    step_latency_s: dict[str, float]
    """Mean step latency of each job."""
    cost: Cost
    refused: str | None = None
    """Why the policy could not run them (its numbers are then zero)."""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.makespan_s if self.makespan_s > 0 else 0.0

    @property
    def node_s(self) -> float:
        """Device-seconds the node is held: what the group costs."""
        return self.num_devices * self.makespan_s


@dataclass(frozen=True, kw_only=True, slots=True)
class PairAdvice:
    """Two jobs on one node, under every pair policy, against each alone."""

    jobs: tuple[str, str]
    alone: dict[str, Outcome]
    options: dict[str, Outcome]
    """By policy (PAIR_POLICIES)."""

    def slowdown(self, policy: str, job: str) -> float:
        """Its step latency under `policy` over its latency alone on the same devices."""
        return self.options[policy].step_latency_s[job] / self.alone[job].step_latency_s[job]

    def gain(self, policy: str = "jigsaw", over: str = "serial") -> float:
        """Throughput of `policy` over `over`'s (0 if either refused)."""
        a, b = self.options[policy], self.options[over]
        return a.tokens_per_s / b.tokens_per_s if a.refused is None and b.refused is None and b.tokens_per_s else 0.0


@dataclass(frozen=True, kw_only=True, slots=True)
class Pairing:
    """A way to put the jobs on nodes: pairs co-located by jigsaw, and jobs alone."""

    groups: tuple[tuple[str, ...], ...]
    node_s: float
    """Σ device-seconds of every group's node for its makespan."""
    alone_node_s: float
    """The same with every job alone on a node of its own."""


def jobs_of(paths: Sequence[Path], warmup_steps: int = 1) -> list[Job]:
    """Every pipeline of every trace as a job; two of one name get the file's stem appended."""
    jobs: list[Job] = []
    for path in paths:
        trace = Trace.read(path)
        names = {e.pipeline for e in trace.events if e.pipeline}
        for name in sorted(names):
            if any(j.name == name for j in jobs):
                trace = renamed(trace, name, _free_name(f"{name}@{Path(path).stem}", jobs))
        rec = recorded(trace, first_step=warmup_steps)
        for ps in rec.pipelines:
            steps = len({s.step for s in ps.graph.substages})
            jobs.append(Job(name=ps.graph.pipeline, source=str(path), state=ps,
                            tokens=rec.tokens.get(ps.graph.pipeline, 0), steps=steps,
                            deployment=_deployment(rec.meta.get(ps.graph.pipeline) or {})))
    if not jobs:
        raise ValueError("no pipeline in the traces given: nothing to advise on")
    return jobs


def renamed(trace: Trace, old: str, new: str) -> Trace:
    """The trace with pipeline `old` called `new` (its events and its sub-stage ids)."""
    if "/" in new or not new:
        raise ValueError(f"a pipeline name must be non-empty without '/', got {new!r}")
    prefix = f"{old}/"
    return Trace([dataclasses.replace(e, pipeline=new, substage=new + e.substage[len(old):]
                                      if e.substage.startswith(prefix) else e.substage)
                  if e.pipeline == old else e for e in trace.events])


def per_pipeline(trace: Trace) -> dict[str, Trace]:
    """A trace cut in one per pipeline (its events and the node's): a run of jobs one after the
    other (`jigsaw demo`'s serial-live) as each job's own trace alone."""
    names = sorted({e.pipeline for e in trace.events if e.pipeline})
    return {name: Trace([e for e in trace.events if e.pipeline in ("", name)]) for name in names}


def _deployment(meta: dict) -> tuple[str, tuple] | None:
    """What a simulator's pipeline event says the job ran as, or None."""
    from jigsaw.mux.model.specs import DEVICES, PriorConfig, model_from_config, register_model

    if not all(k in meta for k in ("model", "device", "prior")) or meta["device"] not in DEVICES:
        return None
    if "model_config" in meta:  # a model the workload described by its shape
        register_model(meta["model"], model_from_config(meta["model_config"], "the trace's model_config"))
    return meta["device"], (meta["model"], PriorConfig(**meta["prior"]))


def views_of(jobs: Sequence[Job]):
    """(node grid, PairGrids or None) for jobs whose models and device are known (one kind of
    device), priced as `jigsaw sim` prices them: one model by its own prior, several by the
    mix prior with each pair by its own view; None where they are not known (the given grid
    prices them)."""
    from jigsaw.mux.model.grids import pair_grids, prior_grid

    known = [j.deployment for j in jobs]
    if any(k is None for k in known) or len({d for d, _ in known}) != 1:
        return None
    device, deps = known[0][0], [dep for _, dep in known]
    return prior_grid(device, deps), pair_grids(device, {j.name: j.deployment[1] for j in jobs})


def _free_name(base: str, jobs: Sequence[Job]) -> str:
    taken = {j.name for j in jobs}
    return next(n for n in itertools.chain([base], (f"{base}-{k}" for k in itertools.count(2))) if n not in taken)


def run_group(jobs: Sequence[Job], policy: str, grid, sched: SchedulerConfig = SchedulerConfig(),
              usd_per_gpu_hour: float | None = None, views: bool = True) -> Outcome:
    """`jobs` on one node (each on its recorded devices) to the end under `policy`; `views`:
    jobs of different known models are priced by their pair views (`views_of`), not `grid`."""
    pairs = None
    if views and (got := views_of(jobs)) is not None:
        grid, pairs = got
    num_devices = max(max(j.state.devices) + 1 for j in jobs)
    rec = Recorded(pipelines=tuple(j.state for j in jobs), tokens={j.name: j.tokens for j in jobs}, meta={},
                   num_devices=num_devices)
    ex = replay(rec, make(policy, sched), grid, sched, pairs=pairs)
    names = tuple(j.name for j in jobs)
    tokens, steps = sum(j.tokens for j in jobs), sum(j.steps for j in jobs)
    if isinstance(ex, Refused):
        return Outcome(policy=policy, jobs=names, num_devices=num_devices, makespan_s=0.0, tokens=0,
                       step_latency_s={}, cost=cost_of(device_s=0.0, steps=0, tokens=0), refused=str(ex))
    return Outcome(policy=policy, jobs=names, num_devices=num_devices, makespan_s=ex.makespan_s, tokens=tokens,
                   step_latency_s={n: statistics.fmean(v) for n, v in step_latencies(ex).items()},
                   cost=cost_of(device_s=num_devices * ex.makespan_s, steps=steps, tokens=tokens,
                                usd_per_gpu_hour=usd_per_gpu_hour))


def advise_pair(a: Job, b: Job, grid, sched: SchedulerConfig = SchedulerConfig(),
                usd_per_gpu_hour: float | None = None, alone: dict[str, Outcome] | None = None,
                views: bool = True) -> PairAdvice:
    """Jobs a and b on one node under every pair policy, and each alone (`alone`, if known)."""
    alone = alone or {}
    solo = {j.name: alone.get(j.name) or run_group([j], "serial", grid, sched, usd_per_gpu_hour, views)
            for j in (a, b)}
    options = {p: run_group([a, b], p, grid, sched, usd_per_gpu_hour, views) for p in PAIR_POLICIES}
    return PairAdvice(jobs=(a.name, b.name), alone=solo, options=options)


def best_pairing(names: Sequence[str], alone_node_s: dict[str, float],
                 pair_node_s: dict[frozenset, float]) -> Pairing:
    """The grouping into pairs and singles with the fewest node-seconds (every one tried)."""
    if len(names) > MAX_JOBS:
        raise ValueError(f"{len(names)} jobs: advise pairs at most {MAX_JOBS} (every pairing is tried)")

    def node_s_of(group: tuple[int, ...]) -> float:
        if len(group) == 1:
            return alone_node_s[names[group[0]]]
        return pair_node_s.get(frozenset(names[i] for i in group), math.inf)

    node_s, best = min(((sum(node_s_of(g) for g in grouping), grouping) for grouping in groupings(len(names), 2)),
                       key=lambda found: found[0])
    groups = tuple(tuple(names[i] for i in g) for g in best)
    return Pairing(groups=groups, node_s=node_s, alone_node_s=sum(alone_node_s[n] for n in names))


def advise(jobs: Sequence[Job], grid, sched: SchedulerConfig = SchedulerConfig(),
           usd_per_gpu_hour: float | None = None, say: Callable[[str], None] = lambda line: None,
           views: bool = True) -> tuple[list[PairAdvice], Pairing]:
    """Every pair of `jobs` advised on, and the best way to group them all."""
    if len(jobs) < 2:
        raise ValueError(f"advise needs at least two jobs, the traces hold {len(jobs)}")
    if len(jobs) > MAX_JOBS:
        raise ValueError(f"{len(jobs)} jobs: advise pairs at most {MAX_JOBS} (every pairing is tried)")
    alone = {}
    for j in jobs:
        say(f"{j.name} alone ...")
        alone[j.name] = run_group([j], "serial", grid, sched, usd_per_gpu_hour, views)
    pairs = []
    for a, b in itertools.combinations(jobs, 2):
        say(f"{a.name} beside {b.name} ...")
        pairs.append(advise_pair(a, b, grid, sched, usd_per_gpu_hour, alone, views))
    pair_node_s = {frozenset(p.jobs): p.options["jigsaw"].node_s for p in pairs if p.options["jigsaw"].refused is None}
    pairing = best_pairing([j.name for j in jobs], {n: o.node_s for n, o in alone.items()}, pair_node_s)
    return pairs, pairing


__all__ = ["MAX_JOBS", "PAIR_POLICIES", "Job", "Outcome", "PairAdvice", "Pairing", "advise", "advise_pair",
           "best_pairing", "jobs_of", "per_pipeline", "renamed", "run_group"]
