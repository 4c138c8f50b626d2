"""`jigsaw demo`: two GRPO pipelines on this machine: serial, side by side, under jigsaw.

    DemoConfig ─► jigsaw.recipes.demo.run_demo() (every mode, repeated, interleaved; a progress
                  line per run) ─► demo_report: table (median, spread, × serial) + verdict
               ─► timeline PNG and HTML of the last jigsaw run

Exit code 0 when the demo ran, whether or not its comparison is reliable (the verdict says).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Annotated

import tyro

from jigsaw.recipes.demo import DemoConfig


@dataclass(frozen=True, kw_only=True, slots=True)
class Args:
    """Run two real GRPO pipelines (different seeds) several ways on this CPU, each way several
    times, interleaved: one after the other (serial); both at once with cores / pipelines
    threads each (naive-fair); scheduled by the jigsaw daemon with CPU partitions (jigsaw); and,
    with --modes, both at once with no control, every worker on every core (naive).  Prints
    tokens/s (median and spread over the repeats, warm-up steps left out), ratios to serial,
    sub-stages that fell open, and whether the comparison can be trusted; writes the jigsaw
    run's trace and timeline."""

    demo: Annotated[DemoConfig, tyro.conf.OmitArgPrefixes] = DemoConfig()
    async_pair: Annotated[bool, tyro.conf.arg(name="async")] = False
    """Shorthand for --workload async: a one-step off-policy pipeline beside a synchronous one."""


def run(args: Args) -> int:
    from rich.console import Console

    from jigsaw.extras import require
    from jigsaw.recipes.demo import run_demo
    from jigsaw.recipes.demo_report import print_report

    require("cpu", "jigsaw demo")

    console = Console(width=None if Console().is_terminal else 110)  # logs get the whole table
    cfg = dataclasses.replace(args.demo, workload="async") if args.async_pair else args.demo
    console.print(f"jigsaw demo: {len(cfg.modes)} modes × {cfg.repeats} repeats, {cfg.steps} steps each "
                  f"({cfg.warmup_steps} warm-up not measured); logs in {cfg.out_dir / 'logs'}")
    runs = run_demo(cfg, say=console.print)
    print_report(runs, console)
    trace = cfg.out_dir / "jigsaw-trace.jsonl"
    if "jigsaw" in cfg.modes and trace.exists():
        from jigsaw import timeline

        tl = timeline.load(trace)
        for suffix in ("png", "html"):
            timeline.write(tl, cfg.out_dir / f"jigsaw-timeline.{suffix}")
        console.print(f"last jigsaw run: trace {trace}, timeline {cfg.out_dir / 'jigsaw-timeline.png'} and .html")
    return 0
