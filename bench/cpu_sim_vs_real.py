"""Simulated against measured: the CPU demo's serial, static and jigsaw, side by side.

    python bench/cpu_sim_vs_real.py [--steps 7] [--repeats 3] [--out-dir /tmp/jigsaw-sim-vs-real]

The demo's serial, static, static-live and jigsaw modes run interleaved and repeated
(jigsaw.recipes.demo).  Every daemon run (static-live, jigsaw) leaves a trace holding each
sub-stage of both pipelines as granted, released and host intervals; its exclusive time is
its granted time over the grid's slowdown for what ran beside it (jigsaw.sim.replay).  Those
sub-stages, warm-up steps left out, are re-packed by the simulator under serial, static and
jigsaw with the CPU grid the daemon used, and the predictions are set against the runs:

    measured  tokens/s over the measured steps (median, min-max), mean step latency
    simulated the same from each trace's replay (median, min-max over the traces)

The simulator's work is the recipe's own (its lengths, batches and regimes, bucketed into
sub-stages by the builder); its timing of a sub-stage beside another is the grid's.  What it
does not see is printed too: the time each pipeline spends outside every sub-stage.
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict
from pathlib import Path

from rich.console import Console
from rich.table import Table

from jigsaw.graph.ids import SubStageId
from jigsaw.graph.policy import make
from jigsaw.mux.slowdown import load_grid
from jigsaw.profiles import CPU_DEFAULT
from jigsaw.recipes.demo import DemoConfig, run_demo
from jigsaw.recipes.demo_report import print_report
from jigsaw.sim.replay import recorded, replay
from jigsaw.trace import Trace

MODES = ("serial", "static", "static-live", "jigsaw")
PREDICTED = ("serial", "static", "jigsaw")
"""Policies the simulator replays; `static` is set against the measured static mode (a fixed
core split with no daemon), static-live is its runtime twin."""


def predict(trace: Trace, first_step: int, grid) -> dict[str, tuple[float, float]]:
    """{policy: (tokens/s, mean step latency s)} of the trace's measured steps, re-packed."""
    rec = recorded(trace, first_step=first_step)
    tokens = sum(rec.tokens.values())
    out = {}
    for name in PREDICTED:
        ex = replay(rec, make(name), grid)
        spans: dict[tuple[str, int], list[float]] = defaultdict(lambda: [float("inf"), 0.0])
        for iv in ex.intervals:
            span = spans[(iv.pipeline, SubStageId.parse(iv.substage).step)]
            span[0], span[1] = min(span[0], iv.start_s), max(span[1], iv.end_s)
        out[name] = (tokens / ex.makespan_s, statistics.fmean(end - start for start, end in spans.values()))
    return out


def outside_share(trace: Trace, first_step: int) -> float:
    """Share of the measured steps' latency each pipeline spent in no sub-stage at all (its own
    Python between sub-stages, waiting for the daemon's answer included)."""
    start: dict[str, float] = {}
    busy: dict[tuple[str, int], float] = defaultdict(float)
    for e in trace.events:
        if not e.substage or SubStageId.parse(e.substage).step < first_step:
            continue
        key = (e.pipeline, SubStageId.parse(e.substage).step)
        if e.event == "grant":
            start.setdefault(e.substage, e.t_s)
        elif e.event == "release" and e.substage in start:
            busy[key] += e.t_s - start.pop(e.substage)
        elif e.event == "host":
            busy[key] += float(e.data["end_s"]) - e.t_s
    lat = {(e.pipeline, int(e.data["step"])): float(e.data["latency_s"]) for e in trace.events
           if e.event == "step" and int(e.data["step"]) >= first_step}
    return 1.0 - sum(busy[k] for k in lat) / sum(lat.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out-dir", type=Path, default=Path("/tmp/jigsaw-sim-vs-real"))
    args = ap.parse_args()
    console = Console(width=120)
    cfg = DemoConfig(steps=args.steps, repeats=args.repeats, modes=MODES, out_dir=args.out_dir)
    runs = run_demo(cfg, say=console.print)
    print_report(runs, console)
    grid = load_grid(cfg.profile or CPU_DEFAULT)
    traces = [Trace.read(p) for mode in ("static-live", "jigsaw")
              for p in sorted(args.out_dir.glob(f"{mode}-trace-r*.jsonl"))]
    predicted = [predict(t, cfg.warmup_steps, grid) for t in traces]
    measured = {m: [(r.tokens_per_s, statistics.fmean(r.step_latency_s.values())) for r in runs if r.mode == m]
                for m in PREDICTED}
    console.print(table(measured, predicted))
    gaps = [outside_share(t, cfg.warmup_steps) for t in traces]
    console.print(f"outside every sub-stage (not simulated): {statistics.median(gaps):.1%} of a measured step "
                  f"(median of {len(gaps)} traces, {min(gaps):.1%}-{max(gaps):.1%})")


def table(measured: dict[str, list[tuple[float, float]]], predicted: list[dict[str, tuple[float, float]]]) -> Table:
    t = Table(title="the CPU demo, simulated against measured (median, min-max)")
    for col in ("mode", "measured tokens/s", "simulated tokens/s", "error", "measured step s", "simulated step s",
                "error"):
        t.add_column(col, justify="left" if col == "mode" else "right")
    for mode in PREDICTED:
        cells = []
        for i in (0, 1):
            got, sim = [m[i] for m in measured[mode]], [p[mode][i] for p in predicted]
            cells += [_spread(got), _spread(sim), f"{statistics.median(sim) / statistics.median(got) - 1:+.0%}"]
        t.add_row(mode, *cells)
    return t


def _spread(xs: list[float]) -> str:
    fmt = "{:,.0f}" if max(xs) > 100 else "{:.2f}"
    return f"{fmt.format(statistics.median(xs))} ({fmt.format(min(xs))}-{fmt.format(max(xs))})"


if __name__ == "__main__":
    main()
