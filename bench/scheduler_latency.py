"""Decision time of the look-ahead scheduler at node scale (not a test: prints a table).

    GRPO-shaped graphs (bench/_graphs.py) × K pipelines on N GPUs
        └─► execute(..., policy=jigsaw, timed) ─► one schedule() call per completion event
             (after one untimed run: the interpreter's warm-up; a collected heap before each)
             ├─► steady state (every call but a run's first): median / p99 wall time per call,
             │   all calls and calls that decided something
             └─► cold: a run's first call (the policy's tables empty), the slowest of the runs
    (the time is the policy's decision alone: the node's view building is not in it), with the
    load average while measuring

Usage:  python bench/scheduler_latency.py [--seeds 3] [--steps 2] [--windows 1 3] [--repeat 3] [--group]
The group setups time one scheduler deciding a group of 4 nodes × 8 GPUs × 4 pipelines whose
ranks span nodes (issue 35; --group: only those).
Goal (issues 14, 32): steady p99 ≤ 2 ms at 2 pipelines × 8 DP and ≤ 20 ms at 4 × 64 DP with the
default settings, a cold first decision ≤ 20 ms (bench/scheduler_quality.py puts these times
next to the decisions' quality).  The p99 of 19–20 ms issue 32 saw at 2 × 8 DP were cold
lookups: the first decisions meeting a kind pair interpolated hundreds of grid nodes with
scipy (~0.1 ms a call); grid nodes are now read from the table.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _graphs import grpo_graph  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

import jigsaw.graph.schedule  # noqa: E402,F401  (imported before timing: a cold call is cold tables, not imports)
from jigsaw.graph.plan import NodeSpec, PipelineState, SchedulerConfig  # noqa: E402
from jigsaw.graph.policy import Jigsaw  # noqa: E402
from jigsaw.mux.model.slowdown import load_grid  # noqa: E402
from jigsaw.profiles import SHIPPED_DIR
from jigsaw.sim.execute import execute  # noqa: E402

PRIOR = SHIPPED_DIR / "h100" / "qwen3-4b.prior.json"


@dataclass(frozen=True)
class Setup:
    label: str
    num_gpus: int
    placements: tuple[tuple[int, ...], ...]
    """GPUs of each pipeline, DP rank order."""


def setups() -> list[Setup]:
    eight = tuple(range(8))
    # 64 GPUs, 32 DP each, staggered so every GPU hosts exactly two pipelines and the groups couple.
    stagger = tuple(tuple((start + i) % 64 for i in range(32)) for start in (0, 16, 32, 48))
    return [
        Setup("2×8 DP, 8 GPUs", 8, (eight, eight)),
        Setup("4×8 DP, 8 GPUs", 8, (eight,) * 4),
        Setup("4×32 DP, 64 GPUs, 2/GPU", 64, stagger),
        Setup("4×64 DP, 64 GPUs, 4/GPU", 64, (tuple(range(64)),) * 4),
    ] + group_setups()


def group_setups() -> list[Setup]:
    """A group of 4 nodes × 8 GPUs decided by one scheduler (issue 35: the node's policy over
    the group's devices): pipelines that span nodes, two a node, and every pipeline on every
    node."""
    span = tuple(tuple((8 * start + i) % 32 for i in range(16)) for start in range(4))
    return [
        Setup("group: 4 nodes × 8, 4×16 DP over 2 nodes", 32, span),
        Setup("group: 4 nodes × 8, 4×32 DP over 4 nodes", 32, (tuple(range(32)),) * 4),
    ]


def measure(setup: Setup, config: SchedulerConfig, seeds: int, steps: int, grid, repeat: int = 1) -> dict:
    """Wall time of every schedule() call while `execute` runs `seeds` random graph sets, the
    first call of each run (cold: the policy's tables are empty) apart from the rest.  With
    `repeat` > 1 each run is made that many times and each call keeps its least time: the
    plans, so the calls, are the same every time, and the least is the least disturbed."""
    cold, every, deciding, wall = [], [], [], 0.0
    node = NodeSpec(num_devices=setup.num_gpus, mem_bytes=grid.device.mem_bytes)
    load_before = os.getloadavg()[0]

    class Timed(Jigsaw):
        def __init__(self, **kw):
            super().__init__(**kw)
            self.calls: list[tuple[float, bool]] = []
            """(seconds, decided something) of each call, the run's first (cold) first."""

        def plan(self, view):
            t0 = time.perf_counter()
            plan = super().plan(view)
            self.calls.append((time.perf_counter() - t0, bool(plan.decisions)))
            return plan

    def pipes(seed: int) -> list[PipelineState]:
        rng = random.Random(seed)
        return [PipelineState(graph=grpo_graph(f"P{k}", len(devs), rng, steps=steps, multi_turn=k % 2 == 1),
                              devices=devs) for k, devs in enumerate(setup.placements)]

    # Untimed first: Python's own warm-up (3.11 specialises code as it runs it) is not the
    # scheduler's cost; a new policy per timed run still starts with empty tables (cold).
    execute(pipes(seeds), node, grid, policy=Jigsaw(config=config))
    for seed in range(seeds):
        runs = []
        for _ in range(repeat):
            run, policy = pipes(seed), Timed(config=config)
            gc.collect()  # the runs before leave garbage a collection in this one's first calls would pay for
            t0 = time.perf_counter()
            execute(run, node, grid, policy=policy)
            wall += time.perf_counter() - t0
            runs.append(policy.calls)
        if len({len(r) for r in runs}) != 1:
            raise RuntimeError(f"seed {seed}: the repeated runs made different numbers of calls")
        least = [min(c[0] for c in same) for same in zip(*runs)]
        cold.append(least[0])
        every.extend(least[1:])
        deciding.extend(dt for dt, (_, decided) in zip(least[1:], runs[0][1:]) if decided)
    return {"calls": len(every), "median": _ms(statistics.median(every)), "p99": _ms(_p99(every)),
            "max": _ms(max(every)),
            "d_median": _ms(statistics.median(deciding)), "d_p99": _ms(_p99(deciding)),
            "cold_max": _ms(max(cold)), "wall": wall, "load": max(load_before, os.getloadavg()[0])}


def _p99(xs: list[float]) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[98] if len(xs) > 1 else xs[0]


def _ms(x: float) -> float:
    return x * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=3, help="random graph sets per setup")
    ap.add_argument("--steps", type=int, default=2, help="RL steps chained per pipeline")
    ap.add_argument("--windows", type=int, nargs="+", default=[1, 3], help="look-ahead depths to time")
    ap.add_argument("--quick", action="store_true", help="skip the 4 x 64 DP and the group setups")
    ap.add_argument("--group", action="store_true", help="only the group of 4 nodes x 8 GPUs")
    ap.add_argument("--repeat", type=int, default=1,
                    help="make each run this many times and keep each call's least time (same plans, so the "
                         "same calls: a side-by-side comparison on a noisy machine)")
    args = ap.parse_args()
    if args.repeat < 1 or args.seeds < 1:
        ap.error("--repeat and --seeds must be at least 1")
    grid = load_grid(PRIOR)
    least = f", each call's least of {args.repeat} runs" if args.repeat > 1 else ""
    table = Table(title=f"schedule() wall time per call (ms), {args.seeds} seeds × {args.steps} steps{least}")
    for col in ("pipelines × DP", "W", "steady calls", "median", "p99", "max", "median*", "p99*", "cold max",
                "run s", "load"):
        table.add_column(col, justify="left" if col == "setup" else "right")
    console = Console(width=120)
    for setup in group_setups() if args.group else setups()[:3] if args.quick else setups():
        for w in args.windows:
            with console.status(f"{setup.label}, W={w}"):
                r = measure(setup, SchedulerConfig(window=w), args.seeds, args.steps, grid, args.repeat)
            table.add_row(setup.label, str(w), str(r["calls"]), f"{r['median']:.2f}", f"{r['p99']:.2f}",
                          f"{r['max']:.1f}",
                          f"{r['d_median']:.2f}", f"{r['d_p99']:.2f}", f"{r['cold_max']:.2f}",
                          f"{r['wall']:.1f}", f"{r['load']:.2f}")
    console.print(table)
    console.print("steady: every call but each run's first; max: the slowest steady call (a run's end game, solved "
                  "once: SchedulerConfig.end_game_windows); *: steady calls that decided something (the others "
                  "only re-grant budgets after a completion); cold max: the slowest first decision of a run (empty "
                  "tables); load: the 1-minute load average while measuring (the bench itself is ~1.0)")


if __name__ == "__main__":
    main()
