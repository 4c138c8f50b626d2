"""Serial vs naive concurrent vs jigsaw: two real GRPO pipelines on this CPU, in one run.

    python bench/cpu_demo.py [--steps 5] [--max-new-tokens 256]

The same runs as `jigsaw demo` (jigsaw.recipes.demo): each mode runs both pipelines with the
same seeds; tokens/s is over the time the pipelines spend in their steps (start-up, the same
in every mode, is left out; the whole-run wall time is printed next to it).  Goal: jigsaw
≥ 1.3× serial and above naive.  Needs profiles/cpu/tiny-qwen3.json (`jigsaw profile --device cpu`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from jigsaw.recipes.demo import DemoConfig, run_demo, table


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=DemoConfig().steps)
    ap.add_argument("--max-new-tokens", type=int, default=DemoConfig().max_new_tokens)
    ap.add_argument("--out-dir", type=Path, default=Path("/tmp/jigsaw-cpu-demo"))
    args = ap.parse_args()
    console = Console()
    results = run_demo(DemoConfig(steps=args.steps, max_new_tokens=args.max_new_tokens, out_dir=args.out_dir),
                       say=console.print)
    console.print(table(results))


if __name__ == "__main__":
    main()
