"""Two unmodified verl 0.9.1 GRPO jobs on this CPU: serial, naive, static, static-live, jigsaw.

    python bench/verl_pair.py [--steps 6] [--max-new-tokens 64] [--repeats 3]   (the [verl] venv)

The demo's machinery (jigsaw.recipes.demo, --framework verl): each mode runs the same two jobs
(seeds 1 and 2, 2 rollout replicas and 2 trainer ranks each, jigsaw's rollout backend), modes
interleaved and repeated.  serial: one job, then the other; naive: both at once, nothing else
(what a user does for free); static: each job pinned to its own half of the cores; static-live:
the daemon's `static` policy, a baseline run live through jigsaw's runtime; jigsaw: both under
`jigsaw run` with the CPU-partitioning daemon.  Steps are timed from verl's own console lines
(jigsaw.integrations.verl.watch); the first step of each job (start-up) is not measured.

Prints aggregated tokens/s (median, spread, × serial paired by repeat), per-job step latency,
and each verl stage's mean time per mode.  Goal: jigsaw ≥ 1.3× serial and above naive.  verl's
sync trainer polls its replay buffer every 2 s (`ReplayBuffer(poll_interval=2.0)`), so `gen`
lasts 2 s, 4 s, ... whatever the rollout takes: a 2.01 s rollout costs 4 s, a quantum that
swamps any schedule.  The bench shortens the poll to --verl-poll-s (0.05 s) in every mode alike
(serial and naive included; jigsaw.integrations.verl.poll); --verl-poll-s 0 keeps verl's.
"""

from __future__ import annotations

import argparse
import statistics
from collections import defaultdict
from pathlib import Path

from rich.console import Console
from rich.table import Table

from jigsaw.recipes.demo import VERL_MODES, DemoConfig, run_demo
from jigsaw.recipes.demo_report import print_report


def stage_table(runs) -> Table:
    by_mode = defaultdict(list)
    for r in runs:
        by_mode[r.mode].append(r.stages_s)
    stages = sorted({k for rs in by_mode.values() for st in rs for k in st})
    table = Table(title="verl stage time per measured step, s (median over repeats, both jobs)")
    table.add_column("mode")
    for st in stages:
        table.add_column(st, justify="right")
    for mode, rs in by_mode.items():
        table.add_row(mode, *(f"{statistics.median(r.get(st, 0.0) for r in rs):.2f}" for st in stages))
    return table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--modes", nargs="+", default=list(VERL_MODES))
    ap.add_argument("--verl-poll-s", type=float, default=0.05,
                    help="verl's replay-buffer poll in every mode (0: verl's own 2 s)")
    ap.add_argument("--out-dir", type=Path, default=Path("/tmp/jigsaw-verl-pair"))
    args = ap.parse_args()
    console = Console(width=120)
    runs = run_demo(DemoConfig(framework="verl", steps=args.steps, prompts=args.prompts, group=args.group,
                               max_new_tokens=args.max_new_tokens, repeats=args.repeats, modes=tuple(args.modes),
                               verl_poll_s=args.verl_poll_s or None, out_dir=args.out_dir), say=console.print)
    print_report(runs, console)
    console.print(stage_table(runs))


if __name__ == "__main__":
    main()
