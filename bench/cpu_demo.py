"""Every demo mode, serial to jigsaw: two real GRPO pipelines on this CPU, repeated.

    python bench/cpu_demo.py [--steps 5] [--max-new-tokens 256] [--repeats 3] [--workload agentic] [--modes ...]
                             [--pipelines 3]

The same runs as `jigsaw demo` (jigsaw.recipes.demo): each mode runs both pipelines with the
same seeds, the modes interleaved and repeated; tokens/s is over the measured steps (start-up
and the warm-up step left out; the whole-run wall time is printed next to it), as the median
and the spread over the repeats, with the ratio to serial paired by repeat.  The verdict line
says whether the machine was quiet and the repeats agree.  static pins each pipeline to its own
half of the cores (the free baseline); static-live is the same split made by the daemon's
`static` policy, so static against it is what jigsaw's runtime costs, and static-live against
jigsaw what its decisions are worth; serial-live is serial through the daemon (its traces
calibrate a grid: `jigsaw profile --calibrate`).  Goals: jigsaw ≥ 1.3× serial, ≥ 1.15× static.  Uses the CPU
grid cpu/tiny-qwen3 (yours if `jigsaw profile --device cpu` measured one).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from jigsaw.recipes.demo import MODES, DemoConfig, run_demo
from jigsaw.recipes.demo_report import print_report


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=DemoConfig().steps)
    ap.add_argument("--max-new-tokens", type=int, default=DemoConfig().max_new_tokens)
    ap.add_argument("--repeats", type=int, default=DemoConfig().repeats)
    ap.add_argument("--out-dir", type=Path, default=Path("/tmp/jigsaw-cpu-demo"))
    ap.add_argument("--workload", choices=("math", "agentic", "async"), default="math",
                    help="agentic: the first pipeline calls a sandboxed Python tool between its 3 turns; "
                         "async: the first pipeline is one-step off-policy")
    ap.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES), help="which modes to run")
    ap.add_argument("--pipelines", type=int, default=len(DemoConfig().seeds),
                    help="pipelines side by side (seeds 1..N); more than the cores: static caps each at an equal "
                         "share of CPU time (cgroups, needs root)")
    args = ap.parse_args()
    console = Console(width=110)
    runs = run_demo(DemoConfig(steps=args.steps, max_new_tokens=args.max_new_tokens, repeats=args.repeats,
                               modes=tuple(args.modes), out_dir=args.out_dir, workload=args.workload,
                               seeds=tuple(range(1, args.pipelines + 1))),
                    say=console.print)
    print_report(runs, console)


if __name__ == "__main__":
    main()
