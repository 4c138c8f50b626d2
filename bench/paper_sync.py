"""JigsawRL Fig. 12 in the simulator: two co-located pipelines on 8 H100, every policy.

    python bench/paper_sync.py [--steps 20] [--seed 0] [--quick]

For each workload two pipelines run side by side (same model and dataset, different
samples, as in the paper's §5.2).  Printed: jigsaw's aggregated tokens/s over each
baseline, its gap to the lower bound, and its per-pipeline step latency relative to the
pipeline alone (the paper: 1.48× on average, serial is 2×).  Then 3 and 4 co-located
pipelines (mixes of the grid's workloads), which the paper does not run.
Paper, 8 H100: 1.56× average (up to 1.95×) over verl, 1.27× over RollMux, 1.23× over MuxServe.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _compare import BASELINES, run_mix, table  # noqa: E402
from rich.console import Console  # noqa: E402

FIG12 = ("qwen3-0.6b-gsm8k", "qwen3-0.6b-math", "qwen3-4b-gsm8k-multiturn", "qwen3-4b-aime-multiturn",
         "qwen3-4b-instruct-gsm8k", "llama-3.1-8b-instruct-gsm8k", "qwen3-4b-search-r1")
MIXES = {
    "3: 0.6b-gsm8k + 4b-gsm8k-mt + 4b-instruct": ("qwen3-0.6b-gsm8k", "qwen3-4b-gsm8k-multiturn",
                                                  "qwen3-4b-instruct-gsm8k"),
    "3: 4b-aime-mt + 4b-search-r1 + 0.6b-math": ("qwen3-4b-aime-multiturn", "qwen3-4b-search-r1", "qwen3-0.6b-math"),
    "4: 0.6b-gsm8k ×2 + 4b-gsm8k-mt ×2": ("qwen3-0.6b-gsm8k",) * 2 + ("qwen3-4b-gsm8k-multiturn",) * 2,
    "4: 4b-instruct + 4b-search-r1 + 0.6b-math + 4b-aime-mt": ("qwen3-4b-instruct-gsm8k", "qwen3-4b-search-r1",
                                                               "qwen3-0.6b-math", "qwen3-4b-aime-multiturn"),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="three workloads, 8 steps, no mixes")
    args = ap.parse_args()
    console = Console(width=240)
    workloads, steps = (FIG12[:3], 8) if args.quick else (FIG12, args.steps)
    policies = BASELINES + ("jigsaw",)
    t0 = time.time()
    rows = []
    for w in workloads:
        with console.status(f"{w} ..."):
            rows.append(run_mix(w, (w, w), 8, steps, args.seed, policies))
    console.print(table(f"Fig. 12 grid: 2 pipelines on 8 H100, {steps} steps (ratios of tokens/s)", rows, policies))
    if not args.quick:
        mixes = []
        for label, ws in MIXES.items():
            with console.status(f"{label} ..."):
                mixes.append(run_mix(label, ws, 8, steps, args.seed, policies))
        console.print(table(f"3 and 4 co-located pipelines on 8 H100, {steps} steps", mixes, policies))
    console.print(f"simulated in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
