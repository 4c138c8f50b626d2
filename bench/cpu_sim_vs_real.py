"""Simulated against measured: the CPU demo's serial, static and jigsaw, side by side.

    python bench/cpu_sim_vs_real.py [--steps 7] [--repeats 3] [--out-dir /tmp/jigsaw-sim-vs-real]
                                    [--workload agentic] [--pipelines 3] [--no-calibrate | --calibrate-on DIR]

The demo's serial, static, serial-live, static-live and jigsaw modes run interleaved and
repeated (jigsaw.recipes.demo).  Every daemon run leaves a trace holding each sub-stage of both
pipelines as granted, released and host intervals (a code tool's, which computes on this CPU,
marked so: the replay asks for it as the live client did, and the daemon's recorded scheduler
configuration, which keeps cores free for host work, plans it).

    repeat 1:  serial-live trace (every sub-stage alone)  ┐ jigsaw.sim.calibrate: per kind, the
               static-live trace (every sub-stage on half)┘ factor the CPU grid misjudges a
                                                            half by ─► calibrated grid
    repeats 2+ (held out): each daemon trace, warm-up steps left out, re-packed by the simulator
               under serial, static and jigsaw (jigsaw.sim.replay), once with the grid the
               daemon used and once calibrated ─► tokens/s and mean step latency, set against
               the same repeats' measured serial, static and jigsaw runs
    --no-calibrate: no static-live mode (three pipelines have no static split of two cores),
               every repeat held out, simulated with the grid the daemon used (the shipped
               cpu/tiny-qwen3 is itself calibrated this way)
    --calibrate-on DIR: no static-live mode either; the grid is calibrated on DIR's repeat-1
               serial-live and static-live traces (an earlier run's, of two pipelines) and every
               repeat of this run is held out

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
from jigsaw.graph.policies import make
from jigsaw.mux.model.slowdown import load_grid
from jigsaw.profiles import CPU_DEFAULT
from jigsaw.recipes.demo import DemoConfig, run_demo
from jigsaw.recipes.demo_report import print_report
from jigsaw.sim.calibrate import Calibration, calibrate
from jigsaw.sim.execute import Refused
from jigsaw.sim.replay import recorded, replay, step_latencies
from jigsaw.trace import Trace

MODES = ("serial", "static", "serial-live", "static-live", "jigsaw")
LIVE = ("serial-live", "static-live", "jigsaw")
PREDICTED = ("serial", "static", "jigsaw")
"""Policies the simulator replays; `static` is set against the measured static mode (a fixed
core split with no daemon), static-live is its runtime twin."""


_SAID: set[str] = set()


def predict(trace: Trace, first_step: int, grid, factors=None,
            label: str = "a trace") -> dict[str, tuple[float, float]]:
    """{policy: (tokens/s, mean step latency s)} of the trace's measured steps, re-packed under
    the scheduler configuration the daemon recorded; a policy the simulator refuses (static with
    more pipelines than a device has halves) is said once and left out."""
    rec = recorded(trace, first_step=first_step, factors=factors)
    tokens = sum(rec.tokens.values())
    out = {}
    for name in PREDICTED:
        ex = replay(rec, make(name, rec.config), grid, rec.config)
        if isinstance(ex, Refused):
            if name not in _SAID:
                _SAID.add(name)
                print(f"not simulated: {name} ({label}: {ex.reason})")
            continue
        steps = [s for per in step_latencies(ex).values() for s in per]
        out[name] = (tokens / ex.makespan_s, statistics.fmean(steps))
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


def _args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=7)
    ap.add_argument("--repeats", type=int, default=3, help="at least 2 with calibration: the first calibrates, "
                                                          "the rest are predicted")
    ap.add_argument("--out-dir", type=Path, default=Path("/tmp/jigsaw-sim-vs-real"))
    ap.add_argument("--workload", choices=("math", "agentic"), default="math",
                    help="agentic: the first pipeline calls a sandboxed Python tool between its 3 turns")
    ap.add_argument("--pipelines", type=int, default=2, help="pipelines side by side (seeds 1..N)")
    ap.add_argument("--no-calibrate", dest="calibrate", action="store_false",
                    help="simulate every repeat with the grid the daemon used; no static-live runs")
    ap.add_argument("--calibrate-on", type=Path, default=None,
                    help="calibrate on this earlier run's serial-live-trace-r1.jsonl and static-live-trace-r1.jsonl "
                         "(e.g. of two pipelines); no static-live runs, every repeat held out")
    args = ap.parse_args()
    if args.calibrate_on is not None:
        args.calibrate = False
        missing = [f for f in ("serial-live-trace-r1.jsonl", "static-live-trace-r1.jsonl")
                   if not (args.calibrate_on / f).is_file()]
        if missing:
            ap.error(f"--calibrate-on {args.calibrate_on}: no {', '.join(missing)} there")
    if args.calibrate and args.repeats < 2:
        ap.error("--repeats must be at least 2: repeat 1 calibrates the grid, the others are predicted")
    return args


def main() -> None:
    args = _args()
    console = Console(width=130)
    modes = MODES if args.calibrate else tuple(m for m in MODES if m != "static-live")
    cfg = DemoConfig(steps=args.steps, repeats=args.repeats, modes=modes, out_dir=args.out_dir,
                     workload=args.workload, seeds=tuple(range(1, args.pipelines + 1)))
    runs = run_demo(cfg, say=console.print)
    print_report(runs, console)
    compare(args, cfg, runs, console)


def compare(args: argparse.Namespace, cfg: DemoConfig, runs, console: Console) -> None:
    """The held-out daemon traces re-packed, with the daemon's grid and calibrated, set
    against the measured runs."""
    grid = load_grid(cfg.profile or CPU_DEFAULT)
    live = [m for m in LIVE if m in cfg.modes]
    read = {m: {r: Trace.read(args.out_dir / f"{m}-trace-r{r}.jsonl") for r in range(1, args.repeats + 1)}
            for m in live}
    first = 2 if args.calibrate else 1
    held_out = [(f"{m} r{r}", t) for m in live for r, t in read[m].items() if r >= first]
    measured = {m: [(r.tokens_per_s, statistics.fmean(r.step_latency_s.values())) for r in runs
                    if r.mode == m and r.repeat >= first - 1] for m in PREDICTED}
    arms = [("the grid the daemon used", grid, None)]
    if args.calibrate or args.calibrate_on:
        home = args.calibrate_on or args.out_dir
        pair = [Trace.read(home / f"{m}-trace-r1.jsonl") for m in ("serial-live", "static-live")]
        cal = calibrate(grid, pair[:1], pair[1:], first_step=cfg.warmup_steps,
                        sources=(f"{home}/serial-live r1", f"{home}/static-live r1"))
        console.print(fits(cal, "repeat 1" if args.calibrate else f"{home}, repeat 1"))
        arms.append((f"calibrated on {'repeat 1' if args.calibrate else home}", cal.grid, cal.factors))
    span = f"repeats {first}-{args.repeats}"
    for title, g, factors in arms:
        predicted = [predict(t, cfg.warmup_steps, g, factors, label) for label, t in held_out]
        console.print(table(measured, predicted, f"{span}, simulated with {title}"))
    gaps = [outside_share(t, cfg.warmup_steps) for _, t in held_out]
    console.print(f"outside every sub-stage (not simulated): {statistics.median(gaps):.1%} of a measured step "
                  f"(median of {len(gaps)} traces, {min(gaps):.1%}-{max(gaps):.1%})")


def fits(cal: Calibration, source: str) -> Table:
    t = Table(title=f"calibration ({source}): a sub-stage on half the cores over alone on all of them")
    for col in ("kind", "matched", "alone s", "on half s", "measured ×", "grid said ×", "factor"):
        t.add_column(col, justify="left" if col == "kind" else "right")
    for f in cal.fits:
        t.add_row(f.kind, str(f.matched), f"{f.alone_s:.2f}", f"{f.shared_s:.2f}", f"{f.measured_x:.2f}",
                  f"{f.grid_x:.2f}", f"{f.factor:.2f}" if f.applied else "(too little)")
    return t


def table(measured: dict[str, list[tuple[float, float]]], predicted: list[dict[str, tuple[float, float]]],
          title: str) -> Table:
    t = Table(title=f"the CPU demo, simulated against measured (median, min-max): {title}")
    for col in ("mode", "measured tokens/s", "simulated tokens/s", "error", "measured step s", "simulated step s",
                "error"):
        t.add_column(col, justify="left" if col == "mode" else "right")
    for mode in PREDICTED:
        cells = []
        for i in (0, 1):
            got, sim = [m[i] for m in measured[mode]], [p[mode][i] for p in predicted if mode in p]
            if not got or not sim:
                cells += [_spread(got) if got else "-", "not simulated" if got else "-", ""]
                continue
            cells += [_spread(got), _spread(sim), f"{statistics.median(sim) / statistics.median(got) - 1:+.0%}"]
        t.add_row(mode, *cells)
    return t


def _spread(xs: list[float]) -> str:
    fmt = "{:,.0f}" if max(xs) > 100 else "{:.2f}"
    return f"{fmt.format(statistics.median(xs))} ({fmt.format(min(xs))}-{fmt.format(max(xs))})"


if __name__ == "__main__":
    main()
