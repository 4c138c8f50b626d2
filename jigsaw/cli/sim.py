"""`jigsaw sim`: simulate co-located pipelines on one node and compare policies.

    --workload A,B --gpus 8 --policy all
        ─► lower bound (each pipeline alone; resource bound)
        ─► one simulate() per policy, same samples ─► table: tokens/s, ×serial, gap to bound,
           mean step latency per pipeline, the placement jigsaw / greedy were tried on and run
           on (--placement auto: sim/placement.py) ─► trace of jigsaw (or the one policy) to --out
    --lengths-from LOG: the first workload's lengths from a user's log (sim/lengthlog.py),
        written as a workload TOML and its trace to --lengths-out, then simulated like any other
    --replay TRACE --policy all
        ─► sub-stage graphs rebuilt from the trace ─► each policy re-packs them (graph executor,
           no fallback) ─► its row, or "refused" and why; exit 1 if any policy was refused
        ─► a daemon's trace: its inputs fed to the simulator's node state, every plan re-made
           and compared with the recorded one
    a policy that did not run (infeasible, refused) is one kind of row in either table (_unrun)

No torch is imported: the simulator runs on any CPU.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated

import tyro

from jigsaw.cluster.simulate import ClusterConfig
from jigsaw.sim.run import SimConfig


@dataclass(frozen=True, kw_only=True, slots=True)
class Args:
    """Simulate RL pipelines sharing one node and compare scheduling policies."""

    sim: Annotated[SimConfig, tyro.conf.arg(name="")] = SimConfig()
    """What to simulate."""
    cluster: Annotated[ClusterConfig, tyro.conf.arg(name="")] = ClusterConfig()
    """A cluster of nodes to place the pipelines on (--nodes), else one node."""
    out: Path = Path("jigsaw-sim-trace.jsonl")
    """Trace of the jigsaw run (or of the only policy) for `jigsaw timeline`."""
    bound: bool = True
    """Compute the lower bound (runs each pipeline alone once more)."""
    list: bool = False
    """List the shipped workloads and exit."""
    breakdown: bool = False
    """Also print where the traced run's device time went (occupancy of every device)."""
    replay: Path | None = None
    """Replay this trace (written by `jigsaw sim` or `jigsaw run`) under the policies instead
    of simulating workloads: the recorded sub-stages, re-packed."""
    profile: Path | None = None
    """Slowdown grid for --replay, a file or a name; if unset, the analytic prior of the trace's
    model and device."""
    lengths_from: Path | None = None
    """Logged response lengths (JSONL or parquet with step, prompt and response tokens; verl's
    rollout dump directory with --lengths-tokenizer): the first --workload replays them, with
    the log's prompts and group.  The workload is written to --lengths-out to be used again."""
    lengths_tokenizer: Path | None = None
    """The model's tokenizer (a local directory) to count a verl rollout dump's texts in tokens."""
    lengths_group: int | None = None
    """Responses per prompt of a log that names no prompt; unset: one."""
    lengths_out: Path = Path("lengths-workload.toml")
    """Where --lengths-from writes the workload (TOML) and its length trace (the .jsonl beside it)."""
    usd_per_gpu_hour: float | None = None
    """Price of one GPU for an hour: the table then prices each policy's run, GPU-hours per step
    (the node's GPUs for the makespan over every pipeline's steps) and $ per million tokens."""


def run(args: Args) -> int:
    from rich.console import Console

    from jigsaw.sim import workload as wl

    console = Console()
    if args.list:
        for name in sorted(wl.shipped()):
            console.print(f"{name:36s} {wl.get(name).description}")
        return 0
    if args.cluster.nodes:
        return _cluster(args, console)
    policies = _policies(args.sim.policy, asynchronous=_asynchronous(args.sim))
    from jigsaw.sim.cost import check_price

    check_price(args.usd_per_gpu_hour)
    if args.lengths_from is not None:
        args = replace(args, sim=_from_log(args, console))
    if args.replay is not None:
        table, refused = _replay(args.replay, args.profile, policies, args.sim)
        console.print(table)
        return 1 if refused else 0
    from jigsaw.sim.node import Infeasible

    results, infeasible = {}, {}
    log = Console(stderr=True, highlight=False)
    for n, name in enumerate(policies, 1):
        t0 = time.perf_counter()
        try:
            with console.status(f"simulating {name} ..."):
                results[name] = _simulate(replace(args.sim, policy=name))
            outcome = _outcome(results[name])
        except Infeasible as exc:  # one policy that cannot run this deployment is a row, not the end
            infeasible[name] = str(exc)
            outcome = f"infeasible: {exc}"
        log.print(f"[{n}/{len(policies)}] {name}: {outcome} ({time.perf_counter() - t0:.1f} s)", style="dim")
    if not results:
        why = "\n".join(f"  {p}: {w}" for p, w in infeasible.items())
        raise ValueError(f"no policy can run this deployment:\n{why}")
    bound = None
    if args.bound:
        with console.status("lower bound: each pipeline alone ..."):
            from jigsaw.sim.run import lower_bound

            bound = lower_bound(replace(args.sim, policy="serial"))
    console.print(_table(results, bound, args.sim, infeasible, args.usd_per_gpu_hour))
    violated = _violations(results, log)
    keep = results.get("jigsaw") or next(reversed(results.values()))
    if keep.trace is not None:
        keep.trace.write(args.out)
        console.print(f"trace of {keep.config.policy}: {args.out}")
        if args.breakdown:
            from jigsaw.sim.breakdown import breakdown, table
            from jigsaw.sim.run import build

            _, node, _, _ = build(replace(keep.config, trace=False))
            title = f"where {keep.config.policy}'s device time went"
            console.print(table(breakdown(keep.trace, node.num_devices), title))
    return 1 if violated else 0


def _cluster(args: Args, console) -> int:
    """Each placement policy's placement of the pipelines on the cluster, every group run."""
    from rich.console import Console
    from rich.table import Table

    from jigsaw.cluster.simulate import simulate_cluster
    from jigsaw.sim.run import expand

    log = Console(stderr=True, highlight=False)
    results, refused = [], {}
    for name in args.cluster.cluster_policy:
        try:
            with console.status(f"placing and simulating under {name} ..."):
                results.append(simulate_cluster(args.sim, args.cluster, name,
                                                say=lambda line: log.print(line, style="dim")))
        except ValueError as exc:  # one placement that cannot hold the pipelines is a line, not the end
            refused[name] = str(exc)
            log.print(f"{name}: cannot place: {exc}", style="dim")
    if not results:
        raise ValueError("no placement policy can place these pipelines:\n" +
                         "\n".join(f"  {p}: {why}" for p, why in refused.items()))
    names = expand(args.sim.workload)
    ref = next((r for r in results if r.policy == "jigsaw"), results[0])
    t = Table(title=f"{len(names)} pipelines on {args.cluster.nodes}, {args.sim.steps} steps")
    for col in ("placement", "trial s", "makespan s", "tokens/s", f"{ref.policy} / it", "GPU-hours",
                "GPU-hours held", "trials", "decide s"):
        t.add_column(col, justify="left" if col == "placement" else "right")
    for r in results:
        t.add_row(r.policy, f"{r.placement.makespan_s:,.1f}", f"{r.makespan_s:,.1f}", f"{r.tokens_per_s:,.0f}",
                  f"{ref.tokens_per_s / r.tokens_per_s:.2f}", f"{r.gpu_hours:,.2f}", f"{r.held_gpu_hours:,.2f}",
                  str(r.placement.estimates), f"{r.decide_s:.1f}")
    t.caption = "\n".join([f"{r.policy}: {r.placement.describe(names)}" for r in results] + [
        f"{p}: cannot place: {why}" for p, why in refused.items()] + [
        f"trial s: the slowest group's trial ({args.cluster.cluster_trial_steps} steps on other samples); "
        "makespan: the slowest group's run; GPU-hours: every GPU of the cluster for the makespan; held: each "
        "group's GPUs until it ends (nodes no group uses are free for other jobs); the network between nodes is "
        "priced only where a pipeline's FSDP group is larger than a node"])
    console.print(t)
    return 1 if _violations({f"{r.policy} group {k}": run for r in results for k, run in enumerate(r.runs)},
                            log) else 0


def _violations(results: dict, log) -> bool:
    """Print every policy's invariant violations (a few each); whether there were any."""
    for name, r in results.items():
        if r.violations:
            log.print(f"[bold red]{name}: {len(r.violations)} violation(s)[/], first: "
                      + "; ".join(r.violations[:3]), highlight=False)
    return any(r.violations for r in results.values())


def _asynchronous(config: SimConfig) -> bool:
    """Whether a pipeline of the run is asynchronous (False where the workloads do not load:
    the run itself then says why)."""
    from jigsaw.sim.run import pipelines

    try:
        return any(spec.is_async for spec, *_ in pipelines(config))
    except (KeyError, ValueError):
        return False


def _policies(spec: str, asynchronous: bool = True) -> list[str]:
    """The policies `spec` names; 'all' leaves out the asynchronous systems' baselines
    (streamrl, areal: split by another name) when every pipeline is synchronous."""
    from jigsaw.graph.policies import ASYNC_ONLY, NAMES

    names = [p for p in NAMES if asynchronous or p not in ASYNC_ONLY] if spec == "all" else \
        [p for p in spec.split(",") if p]
    unknown = [p for p in names if p not in NAMES]
    if unknown or not names:
        raise ValueError(f"unknown policy {unknown or spec!r}; choose from {', '.join(NAMES)} or 'all'")
    return names


def _simulate(config: SimConfig):
    from jigsaw.sim.run import simulate

    return simulate(config)


def _outcome(result) -> str:
    return f"{result.tokens_per_s:,.0f} tokens/s, makespan {result.makespan_s:,.1f} s"


def _table(results: dict, bound, config: SimConfig, infeasible: dict[str, str], usd_per_gpu_hour: float | None = None):
    from rich.table import Table

    from jigsaw.sim.cost import columns
    from jigsaw.sim.run import num_gpus

    first = next(iter(results.values()))
    names = [p.name for p in first.pipelines]
    t = Table(title=f"{', '.join(names)} on {config.gpus or 'default'} GPUs, {config.steps} steps"
                    + (", tail batching" if config.tailbatch else ""))
    priced = usd_per_gpu_hour is not None  # an 80-column terminal has no room for them otherwise
    held = [p.name for p in first.pipelines if p.slo_slowdown is not None]
    for col in ("policy", "tokens/s", "x serial", "makespan s", "gap to bound", *[f"step s {n}" for n in names],
                *[f"SLO {n}" for n in held], *(columns() if priced else ())):
        t.add_column(col, justify="left" if col == "policy" else "right", min_width=10 if col == "tokens/s" else None)
    serial = results.get("serial")
    for name, r in results.items():
        ratio = f"{r.tokens_per_s / serial.tokens_per_s:.2f}" if serial else "—"
        gap = f"{r.makespan_s / bound.makespan_s - 1:+.1%}" if bound else "—"
        t.add_row(name, f"{r.tokens_per_s:,.0f}", ratio, f"{r.makespan_s:,.1f}", gap,
                  *[f"{p.mean_step_latency_s:.1f}" for p in r.pipelines],
                  *[_slo_cell(p) for p in r.pipelines if p.name in held],
                  *(_cost(r, num_gpus(config), usd_per_gpu_hour) if priced else ()))
    notes = [_same_work(results)] + [_unrun(t, name, "infeasible", why) for name, why in infeasible.items()]
    notes += [f"{name}: {r.placement.summary()}" for name, r in results.items() if r.placement is not None]
    if held:
        notes.append("SLO: steps within the SLO of all, and the mean step against the same step of the "
                     "pipeline alone on the node")
    if bound:
        notes.append(f"lower bound {bound.makespan_s:,.1f} s = max(pipeline alone {bound.critical_path_s:,.1f} s, "
                     f"resource {bound.resource_s:,.1f} s)")
    t.caption = "\n".join(notes) or None
    return t


def _slo_cell(p) -> str:
    kept, steps = p.slo_kept
    return f"{kept}/{steps} at {p.slowdown:.2f}×"


def _cost(result, gpus: int, usd_per_gpu_hour: float | None) -> tuple[str, str]:
    from jigsaw.sim.cost import cost_of

    steps = sum(p.steps for p in result.pipelines)
    return cost_of(device_s=gpus * result.makespan_s, steps=steps, tokens=result.tokens,
                   usd_per_gpu_hour=usd_per_gpu_hour).cells()


def _from_log(args: Args, console) -> SimConfig:
    """The simulation with its first workload's lengths, prompts and group from a log."""
    from jigsaw.sim import lengthlog
    from jigsaw.sim.run import expand

    log = lengthlog.read(args.lengths_from, tokenizer=args.lengths_tokenizer, group=args.lengths_group)
    base, *rest = expand(args.sim.workload)
    path = lengthlog.workload_from_log(base, log, args.lengths_out)
    for line in lengthlog.summary(log):
        console.print(line, highlight=False)
    console.print(f"wrote {path} ({base} with these lengths) and {path.with_suffix('.jsonl')}", highlight=False)
    return replace(args.sim, workload=(str(path), *rest))


def _unrun(t, name: str, word: str, why: str) -> str:
    """A policy that did not run, as every table shows one: a row saying `word` where its
    numbers would be; the caption line (returned) says why."""
    t.add_row(name, word, *[""] * (len(t.columns) - 2))
    return f"{word}: {why}"


def _same_work(results: dict) -> str:
    """Whether every policy trained the same samples and tokens (what makes × serial fair)."""
    work = {name: (sum(p.samples for p in r.pipelines), r.tokens) for name, r in results.items()}
    if len(set(work.values())) == 1:
        samples, tokens = next(iter(work.values()))
        return f"every policy trained the same {samples:,} samples, {tokens:,} tokens"
    return "policies trained different work: " + ", ".join(f"{n} {s:,} samples / {t:,} tokens"
                                                           for n, (s, t) in work.items())


def _replay(path: Path, profile: Path | None, policies: list[str], config: SimConfig):
    """The replay table, and whether any policy was refused."""
    from rich.table import Table

    from jigsaw.graph.policies import make
    from jigsaw.mux.model.slowdown import load_grid
    from jigsaw.sim.replay import Refused, grid_of, recorded, recorded_makespan_s, replay, replay_decisions
    from jigsaw.trace import Trace

    trace = Trace.read(path)
    rec = recorded(trace)
    grid = load_grid(profile) if profile else grid_of(rec)
    tokens = sum(rec.tokens.values())
    caption = f"recorded makespan {recorded_makespan_s(trace):,.1f} s; recorded placement kept"
    if rec.node is not None:  # a daemon's trace: do its decisions come out the same offline?
        same = replay_decisions(trace)  # with the daemon's own grid, whatever re-packs with
        caption += (f"\n{rec.node['policy']}'s {same.plans} live plans re-made by the simulator's node state: "
                    + (f"{same.differ} differ, first: {same.mismatches[0]}" if same.differ else "all identical"))
        if same.linked:
            caption += f"\n{same.linked} of them saw an asynchronous job's sides linked through its buffer"
        if same.fallbacks:  # a policy that raises would otherwise show only as plans that differ
            caption += f"\nthe policy failed in {len(same.fallbacks)} of them, first: {same.fallbacks[0]}"
    t = Table(title=f"replay of {path}: {len(rec.pipelines)} pipelines on {rec.num_devices} devices",
              caption=caption)
    for col in ("policy", "makespan s", "tokens/s", *[f"done s {ps.graph.pipeline}" for ps in rec.pipelines]):
        t.add_column(col, justify="left" if col == "policy" else "right")
    refused = []
    for name in policies:
        ex = replay(rec, make(name, config.sched), grid, config.sched)
        if isinstance(ex, Refused):  # its row says so; no other scheduler's makespan stands in
            refused.append(_unrun(t, name, "refused", str(ex)))
            continue
        finish = dict(ex.finish_s)
        t.add_row(name, f"{ex.makespan_s:,.1f}", f"{tokens / ex.makespan_s:,.0f}" if ex.makespan_s else "—",
                  *[f"{finish[ps.graph.pipeline]:,.1f}" for ps in rec.pipelines])
    t.caption = "\n".join([caption, *refused])
    return t, bool(refused)
