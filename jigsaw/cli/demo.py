"""`jigsaw demo`: two GRPO pipelines on this machine: serial, naive concurrent, under jigsaw.

    DemoConfig ─► jigsaw.recipes.demo.run_demo() ─► table ─► timeline PNG of the jigsaw run
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import tyro

from jigsaw.recipes.demo import DemoConfig


@dataclass(frozen=True, kw_only=True, slots=True)
class Args:
    """Run two real GRPO pipelines (different seeds) four ways on this CPU: one after the other
    (serial); both at once with no control, every worker on every core (naive); both at once
    with cores / pipelines threads each (naive-fair); and scheduled by the jigsaw daemon with
    CPU partitions.  Prints aggregated tokens/s, step latency, ratios and sub-stages that fell
    open; writes the jigsaw run's trace and timeline PNG."""

    demo: Annotated[DemoConfig, tyro.conf.OmitArgPrefixes] = DemoConfig()


def run(args: Args) -> int:
    from rich.console import Console

    from jigsaw.recipes.demo import run_demo, table

    console = Console()
    results = run_demo(args.demo, say=console.print)
    console.print(table(results))
    trace = args.demo.out_dir / "jigsaw-trace.jsonl"
    if any(r.mode == "jigsaw" for r in results) and trace.exists():
        from jigsaw import timeline

        png = args.demo.out_dir / "jigsaw-timeline.png"
        timeline.write(timeline.load(trace), png)
        console.print(f"trace {trace}, timeline {png}")
    return 0
