"""JigsawRL Figs. 15 and 17 in the simulator: asynchronous pipelines, jigsaw against StreamRL and AReaL.

    python bench/paper_async.py [--steps 8] [--seeds 3] [--quick]

    Fig. 15  two pipelines of one workload, both one-step-off (vs streamrl) or both fully-async
             (vs areal): each baseline job on its own half of the node, rollout and training
             workers disaggregated in equal halves of it (JigsawRL §5.3)
    Fig. 17  one synchronous and one one-step-off pipeline of one workload (vs streamrl: the
             sync job as verl, the async one as StreamRL, each on its half)
        ─► jigsaw (its placement trials, crossed included), the system's baseline, serial (the
           jobs back to back, each on the whole node) and static (each job pinned to half of
           every device), the same samples; per row over seeds: jigsaw's tokens/s over each
           (mean and spread), its gap to the lower bound (each job alone on the node, or the
           device-seconds of all work), the placement its trials chose
Paper, 8 GPUs: 1.25× average (up to 1.54×) over StreamRL, 1.21× (up to 1.41×) over AReaL;
sync + async: 1.24× over verl + StreamRL on GSM8K, 1.07× on MATH.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, replace

from rich.console import Console
from rich.table import Table

from jigsaw.sim.run import SimConfig, lower_bound, simulate

GPUS = 8
FIG15 = ("qwen3-0.6b-gsm8k", "qwen3-0.6b-math", "qwen3-4b-gsm8k-multiturn")
FIG17 = ("qwen3-0.6b-gsm8k", "qwen3-0.6b-math")
PAPER = {"one-step-off": 1.25, "fully-async": 1.21, "sync + one-step-off": 1.24}
"""The paper's averages over the system's baseline (the sync + async one: GSM8K's)."""


@dataclass(frozen=True)
class Setting:
    label: str
    modes: tuple[str, str]
    baseline: str


SETTINGS = (Setting("one-step-off", ("one-step-off",) * 2, "streamrl"),
            Setting("fully-async", ("fully-async",) * 2, "areal"),
            Setting("sync + one-step-off", ("sync", "one-step-off"), "streamrl"))


@dataclass
class Row:
    setting: Setting
    workload: str
    ratios: dict[str, list[float]]
    """Baseline -> jigsaw's tokens/s over it, one per seed."""
    gap: list[float]
    """jigsaw's makespan over the lower bound, less one, per seed."""
    placed: list[str]


def run_row(setting: Setting, w: str, steps: int, seeds: int) -> Row:
    others = (setting.baseline, "serial", "static")
    row = Row(setting, w, {p: [] for p in others}, [], [])
    for seed in range(seeds):
        cfg = SimConfig(workload=(w, w), mode=setting.modes, gpus=GPUS, steps=steps, seed=seed, trace=False)
        mine = simulate(replace(cfg, policy="jigsaw"))
        for p in others:
            row.ratios[p].append(mine.tokens_per_s / simulate(replace(cfg, policy=p)).tokens_per_s)
        row.gap.append(mine.makespan_s / lower_bound(replace(cfg, policy="serial")).makespan_s - 1)
        row.placed.append(mine.placement.shape if mine.placement else "colocated")
    return row


def _spread(xs: list[float]) -> str:
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{statistics.fmean(xs):.2f} ± {sd:.2f}"


def table(rows: list[Row], steps: int, seeds: int) -> Table:
    t = Table(title=f"asynchronous pipelines, two per node of {GPUS} GPUs, {steps} steps, {seeds} seeds "
                    "(jigsaw's tokens/s over each; mean ± SD over seeds)")
    for col in ("setting", "workload", "jigsaw / baseline", "jigsaw / serial", "jigsaw / static", "gap to bound",
                "jigsaw placed"):
        t.add_column(col, justify="left" if col in ("setting", "workload", "jigsaw placed") else "right")
    for r in rows:
        t.add_row(r.setting.label, r.workload, f"{_spread(r.ratios[r.setting.baseline])} ({r.setting.baseline})",
                  _spread(r.ratios["serial"]), _spread(r.ratios["static"]),
                  f"{statistics.fmean(r.gap):+.0%} (max {max(r.gap):+.0%})", ", ".join(sorted(set(r.placed))))
    t.add_section()
    for s in SETTINGS:
        mine = [x for r in rows if r.setting == s for x in r.ratios[s.baseline]]
        if mine:
            t.add_row(s.label, "average (max)", f"{statistics.fmean(mine):.2f} ({max(mine):.2f})", "", "", "",
                      f"paper {PAPER[s.label]:.2f}")
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="one workload per setting, one seed")
    args = ap.parse_args()
    seeds = 1 if args.quick else args.seeds
    todo = [(s, w) for s in SETTINGS for w in (FIG17 if s.label.startswith("sync") else FIG15)]
    if args.quick:
        todo = [(s, w) for s, w in todo if w == "qwen3-0.6b-gsm8k"]
    console, t0, rows = Console(width=200), time.time(), []
    for n, (s, w) in enumerate(todo, 1):
        with console.status(f"[{n}/{len(todo)}] {s.label}: {w} ..."):
            rows.append(run_row(s, w, args.steps, seeds))
        r = rows[-1]
        console.print(f"[{n}/{len(todo)}] {s.label}: {w}: jigsaw {_spread(r.ratios[s.baseline])}× {s.baseline}, "
                      f"{_spread(r.ratios['static'])}× static", highlight=False)
    console.print(table(rows, args.steps, seeds))
    console.print(f"simulated in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
