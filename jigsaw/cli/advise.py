"""`jigsaw advise`: should these jobs share a node, and what will it cost?

    TRACE [TRACE ...] (each job's run alone: `jigsaw run`'s daemon trace, or `jigsaw sim --out`)
        ─► jigsaw.sim.advise: every pipeline a job; each alone, each pair under jigsaw, one after
           the other (serial) and a static split, re-packed by the simulator with the node's grid
        ─► two jobs: a table per policy (makespan, tokens/s, × one after the other, each job's
           slowdown, GPU-hours per step, $ per M tokens) and a verdict
           more: a row per pair (jigsaw against both) and the grouping with the fewest node-hours

No torch is imported: the advice runs on any CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import tyro


@dataclass(frozen=True, kw_only=True, slots=True)
class Args:
    """Predict what co-locating jobs gains and costs, from each job's trace of a run alone: the
    pairing's throughput against one after the other and a static split, each job's slowdown,
    GPU-hours per step and $ per million tokens; for more than two jobs, the best pairing."""

    traces: Annotated[tuple[Path, ...], tyro.conf.Positional, tyro.conf.arg(metavar="TRACE [TRACE ...]")]
    """Traces of the jobs (JSON lines of `jigsaw run`'s daemon or `jigsaw sim --out`); every pipeline
    in them is a job, ideally each recorded alone on the node."""
    profile: Path | None = None
    """Slowdown grid of the node, a file or a name (cpu/tiny-qwen3, h100/qwen3-4b.prior), for every
    job and pair; if unset, jobs whose traces name their model and device (`jigsaw sim`'s) are
    priced as the simulator prices them (each model by its own prior, a pair of two models by its
    pair view), the others by the first trace's grid (its daemon's profile)."""
    usd_per_gpu_hour: float | None = None
    """Price of one device for an hour; prints $ per million tokens beside GPU-hours per step."""
    warmup_steps: int = 1
    """Leading steps of every job left out (start-up and first allocations are not what a shared
    node would repeat); 0 for a simulator's trace."""


def run(args: Args) -> int:
    from rich.console import Console

    from jigsaw.sim.cost import check_price

    check_price(args.usd_per_gpu_hour)
    if args.warmup_steps < 0:
        raise ValueError(f"--warmup-steps must be ≥ 0, got {args.warmup_steps}")
    from jigsaw.sim import advise as adv

    console = Console()
    jobs = adv.jobs_of(args.traces, warmup_steps=args.warmup_steps)
    grid = _grid(args)
    log = Console(stderr=True, highlight=False)
    with console.status("replaying ...") as status:
        pairs, pairing = adv.advise(jobs, grid, usd_per_gpu_hour=args.usd_per_gpu_hour, say=status.update,
                                    views=args.profile is None)
    console.print(_jobs_table(jobs, pairs))
    if len(pairs) == 1:
        console.print(_pair_table(pairs[0]))
        console.print(verdict(pairs[0]), highlight=False)
    else:
        console.print(_pairs_table(pairs))
        console.print(describe(pairing), highlight=False)
    refused = [o for p in pairs for o in p.options.values() if o.refused]
    for o in refused:
        log.print(f"{o.policy} could not run {' + '.join(o.jobs)}: {o.refused}")
    return 0


def _grid(args: Args):
    from jigsaw.mux.model.slowdown import load_grid
    from jigsaw.sim.replay import grid_of, recorded
    from jigsaw.trace import Trace

    if args.profile is not None:
        from jigsaw import profiles

        return load_grid(profiles.resolve(args.profile))
    try:
        return grid_of(recorded(Trace.read(args.traces[0])))
    except (FileNotFoundError, ValueError) as exc:  # a daemon's profile path from another machine, ...
        raise ValueError(f"the grid of {args.traces[0]}: {exc}; pass the node's grid with --profile") from None


def verdict(pair) -> str:
    """One line: pair them or not, by how much, and what each job pays for it."""
    a, b = pair.jobs
    vs_serial, vs_static = pair.gain("jigsaw", "serial"), pair.gain("jigsaw", "static")
    if pair.options["jigsaw"].refused:
        return f"do not pair {a} and {b}: jigsaw cannot run them together ({pair.options['jigsaw'].refused})"
    word = "pair them" if vs_serial > 1.0 else "do not pair them"
    static = f", {vs_static:.2f}× a static split" if vs_static else ""
    return (f"{word}: jigsaw co-located is {vs_serial:.2f}× one after the other{static}; "
            f"a step of {a} takes {pair.slowdown('jigsaw', a):.2f}× its time alone, of {b} "
            f"{pair.slowdown('jigsaw', b):.2f}×")


def describe(pairing) -> str:
    groups = "; ".join(" + ".join(g) if len(g) > 1 else f"{g[0]} alone" for g in pairing.groups)
    saved = 1.0 - pairing.node_s / pairing.alone_node_s if pairing.alone_node_s else 0.0
    return (f"best pairing: {groups}: {pairing.node_s / 3600:.3g} GPU-hours for all their work, "
            f"{saved:.0%} less than every job alone ({pairing.alone_node_s / 3600:.3g})")


def _jobs_table(jobs, pairs):
    from rich.table import Table

    from jigsaw.sim.cost import columns

    alone = {n: o for p in pairs for n, o in p.alone.items()}
    t = Table(title="the jobs, each alone on its recorded devices (re-packed)")
    for col in ("job", "trace", "devices", "steps", "tokens", "makespan s", "step s", *columns("device")):
        t.add_column(col, justify="left" if col in ("job", "trace") else "right")
    for j in jobs:
        o = alone[j.name]
        t.add_row(j.name, Path(j.source).name, str(len(j.state.devices)), str(j.steps), f"{j.tokens:,}",
                  f"{o.makespan_s:,.1f}", f"{o.step_latency_s[j.name]:.2f}", *o.cost.cells())
    return t


def _pair_table(pair):
    from rich.table import Table

    from jigsaw.sim.cost import columns

    a, b = pair.jobs
    t = Table(title=f"{a} beside {b}, predicted")
    for col in ("policy", "makespan s", "tokens/s", "× one after the other", f"slowdown {a}", f"slowdown {b}",
                *columns("device")):
        t.add_column(col, justify="left" if col == "policy" else "right")
    for name, o in pair.options.items():
        if o.refused:
            t.add_row(name, "refused", *[""] * (len(t.columns) - 2))
            continue
        t.add_row(name, f"{o.makespan_s:,.1f}", f"{o.tokens_per_s:,.0f}", f"{pair.gain(name, 'serial'):.2f}",
                  f"{pair.slowdown(name, a):.2f}", f"{pair.slowdown(name, b):.2f}", *o.cost.cells())
    return t


def _pairs_table(pairs):
    from rich.table import Table

    from jigsaw.sim.cost import columns

    t = Table(title="every pair co-located by jigsaw, predicted")
    for col in ("pair", "tokens/s", "× one after the other", "× static split", "slowdowns", *columns("device")):
        t.add_column(col, justify="left" if col == "pair" else "right")
    for p in pairs:
        o = p.options["jigsaw"]
        if o.refused:
            t.add_row(" + ".join(p.jobs), "refused", *[""] * (len(t.columns) - 2))
            continue
        t.add_row(" + ".join(p.jobs), f"{o.tokens_per_s:,.0f}", f"{p.gain('jigsaw', 'serial'):.2f}",
                  f"{p.gain('jigsaw', 'static'):.2f}", " / ".join(f"{p.slowdown('jigsaw', n):.2f}" for n in p.jobs),
                  *o.cost.cells())
    return t
