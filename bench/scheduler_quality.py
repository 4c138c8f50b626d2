"""The scheduler's decisions against the exact optimum, next to their decision time (not a test).

    tests/exact.py FAMILIES × --count instances ─► exact optimum (branch-and-bound over the
        system's decision space; each optimal schedule replayed through `execute` to check it)
    setting (a policy, or the look-ahead with a SchedulerConfig) ─► execute ─► makespan
        ─► gap to the optimum: mean / median / p90 / max, and the mean per family
        ─► schedule() wall time per call at 2 × 8 DP (8 GPUs) and 4 × 64 DP (64 GPUs),
           bench/scheduler_latency.py's graphs: median / p99
    ─► one table; pick the default from it

Usage:  python bench/scheduler_quality.py [--count 32] [--seeds 2] [--quick]
Goal (issue 14): default within 3% on average and 8% at p90 of the optimum; p99 decision
time ≤ 2 ms at 2 × 8 DP and ≤ 20 ms at 4 × 64 DP on a quiet 2-core machine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from exact import FAMILIES, Replay, SearchLimit, instances, solve  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402
from scheduler_latency import PRIOR, measure, setups  # noqa: E402

from jigsaw.graph.plan import SchedulerConfig  # noqa: E402
from jigsaw.graph.policies import make  # noqa: E402
from jigsaw.mux.model.slowdown import load_grid  # noqa: E402
from jigsaw.sim.execute import execute  # noqa: E402


@dataclass(frozen=True)
class Setting:
    label: str
    config: SchedulerConfig | None = None
    """The look-ahead's settings; None: the baseline `policy`."""
    policy: str = "jigsaw"


DEFAULT = SchedulerConfig()
SETTINGS = (
    Setting(f"default (W={DEFAULT.window}, filter {DEFAULT.min_pack_efficiency}, bound {DEFAULT.bound_weight})",
            DEFAULT),
    Setting("W=1 (greedy)", SchedulerConfig(window=1)),
    Setting("W=3", SchedulerConfig(window=3)),
    Setting("W=4", SchedulerConfig(window=4)),
    Setting("W=2, critical path only", SchedulerConfig(bound_weight=0.0)),
    Setting("W=2, pair filter 1.25", SchedulerConfig(min_pack_efficiency=1.25)),
    Setting("paper (W=3, filter 1.25, critical path)",
            SchedulerConfig(window=3, min_pack_efficiency=1.25, bound_weight=0.0)),
    Setting("serial", policy="serial"),
)


def optima(count: int, seed: int, grid, console: Console, limit_s: float) -> dict[str, tuple]:
    """Per instance key: (pipelines, node, optimal makespan); unsolved instances left out."""
    out = {}
    for fam in FAMILIES:
        with console.status(f"exact optima: {fam}") as status:
            for k, (pipes, node) in enumerate(instances(fam, count, seed)):
                status.update(f"exact optima: {fam} {k + 1}/{count}")
                upper = min(execute(pipes, node, grid, s.config).makespan_s for s in SETTINGS[:3])
                try:
                    opt = solve(pipes, node, grid, upper_s=upper, time_limit_s=limit_s)
                except SearchLimit:
                    console.print(f"[yellow]{fam}/{k}: not solved within {limit_s} s; left out")
                    continue
                replayed = execute(pipes, node, grid, policy=Replay(opt)).makespan_s
                if abs(replayed - opt.makespan_s) > 1e-6 * opt.makespan_s:
                    raise SystemExit(f"{fam}/{k}: the optimum replays at {replayed}, not {opt.makespan_s}")
                out[f"{fam}/{k}"] = (pipes, node, opt.makespan_s)
    return out


def gaps(setting: Setting, solved: dict[str, tuple], grid) -> dict[str, float]:
    out = {}
    for key, (pipes, node, best) in solved.items():
        policy = make(setting.policy) if setting.config is None else None
        got = execute(pipes, node, grid, setting.config or SchedulerConfig(), policy=policy).makespan_s
        if got < best * (1 - 1e-9):
            raise SystemExit(f"{setting.label} beats the exact optimum on {key}: {got} < {best}")
        out[key] = got / best - 1.0
    return out


def row(setting: Setting, g: dict[str, float], timing: dict[str, dict]) -> list[str]:
    xs = sorted(g.values())
    p90 = statistics.quantiles(xs, n=10, method="inclusive")[8]
    fams = " ".join(f"{statistics.mean(v for k, v in g.items() if k.startswith(f + '/')) * 100:.1f}"
                    for f in FAMILIES)
    times = [f"{timing[lab]['median']:.2f} / {timing[lab]['p99']:.2f}" if lab in timing else "–"
             for lab in ("2×8", "4×64")]
    return [setting.label, f"{statistics.mean(xs) * 100:.1f}", f"{statistics.median(xs) * 100:.1f}",
            f"{p90 * 100:.1f}", f"{max(xs) * 100:.1f}", fams, *times]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--count", type=int, default=32, help="instances per family")
    ap.add_argument("--seed", type=int, default=0, help="instance set")
    ap.add_argument("--seeds", type=int, default=2, help="graph sets per decision-time setup")
    ap.add_argument("--limit-s", type=float, default=120.0, help="exact search time limit per instance")
    ap.add_argument("--quick", action="store_true", help="time 2 × 8 DP only (skip 4 × 64 DP)")
    args = ap.parse_args()
    grid = load_grid(PRIOR)
    console = Console(width=160)
    t0 = time.perf_counter()
    solved = optima(args.count, args.seed, grid, console, args.limit_s)
    console.print(f"{len(solved)} instances solved exactly in {time.perf_counter() - t0:.0f} s")
    timed = {"2×8": setups()[0], "4×64": setups()[3]}
    if args.quick:
        del timed["4×64"]
    table = Table(title=f"gap to the exact optimum (%) on {len(solved)} instances; schedule() ms per call")
    for col in ("setting", "mean", "median", "p90", "max", "per family: " + " ".join(FAMILIES),
                "2×8 DP med / p99", "4×64 DP med / p99"):
        table.add_column(col, justify="left" if col == "setting" else "right")
    for setting in SETTINGS:
        with console.status(f"{setting.label}: gaps"):
            g = gaps(setting, solved, grid)
        timing = {}
        if setting.config is not None:
            for lab, setup in timed.items():
                with console.status(f"{setting.label}: decision time at {setup.label}"):
                    timing[lab] = measure(setup, setting.config, args.seeds, 2, grid)
        table.add_row(*row(setting, g, timing))
    console.print(table)


if __name__ == "__main__":
    main()
