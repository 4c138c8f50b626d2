"""JigsawRL Fig. 13 in the simulator: two co-located pipelines on 8 to 64 A100.

    python bench/paper_scale.py [--steps 10] [--gpus 8 16 32 64] [--quick] [--flat]

Larger models (DeepSeek-R1-Distill-Qwen-14B and Qwen3-32B on MATH, Qwen3-4B on GSM8K) at
growing DP degree.  Paper: up to 1.75× (1.47× on average) over verl, 1.31× over RollMux.

Every baseline is placed the way its paper places it: verl (serial) runs each job on every
GPU in turn, split gives each its half, static and MuxServe share every GPU, RollMux its
rollout and training pools (sim/policies).  The GPUs are nodes of 4, the paper's A100 nodes
(§5.1; GPUS/4 x the workload's kind, cluster/spec.node_gpus): jigsaw places the pair on them
as `jigsaw sim --nodes` does (cluster/placement.py: both on every node, or each on nodes of
its own, priced by jigsaw's own trials), and so do
HetRL-style placement (each on nodes of its own, run alone) and RollMux's admission ("rollmux
placed": packed within its SLO, else on nodes of its own; it may leave nodes idle, as it
minimises the GPUs held).  "jigsaw flat" is jigsaw with both pipelines on every GPU, as
before placement (--flat: only that).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _compare import run_mix, table  # noqa: E402
from rich.console import Console  # noqa: E402

from jigsaw.cluster.spec import node_gpus  # noqa: E402
from jigsaw.sim import workload  # noqa: E402

GPUS_PER_NODE = node_gpus("a100")

FIG13 = ("qwen3-4b-gsm8k-a100", "deepseek-r1-distill-qwen-14b-math", "qwen3-32b-math")
POLICIES = ("serial", "split", "static", "rollmux", "muxserve", "jigsaw")
PLACED = ("jigsaw flat", "hetrl", "rollmux placed")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--gpus", type=int, nargs="+", default=[8, 16, 32, 64])
    ap.add_argument("--quick", action="store_true", help="8 and 16 GPUs, 4 steps")
    ap.add_argument("--flat", action="store_true", help="jigsaw on every GPU, no placement on nodes")
    args = ap.parse_args()
    if any(g % GPUS_PER_NODE for g in args.gpus):
        ap.error(f"--gpus: whole nodes of {GPUS_PER_NODE}")
    gpus, steps = ([8, 16], 4) if args.quick else (args.gpus, args.steps)
    console = Console(width=240)
    t0 = time.time()
    rows, skipped = [], []
    for w in FIG13:
        for g in gpus:
            with console.status(f"{w} on {g} A100 ..."):
                try:
                    nodes = "" if args.flat else f"{g // GPUS_PER_NODE}x{workload.get(w).device}"
                    rows.append(run_mix(f"{w} @{g}", (w, w), g, steps, args.seed, POLICIES, nodes=nodes))
                except ValueError as exc:  # the deployment itself does not fit (even serial)
                    skipped.append(f"{w} @{g}: {exc}")
    shown = POLICIES[:-1] + ("jigsaw",) if args.flat else POLICIES[:-1] + PLACED + ("jigsaw",)
    how = "flat" if args.flat else f"placed on nodes of {GPUS_PER_NODE}"
    console.print(table(f"Fig. 13: 2 pipelines on 8-64 A100, {steps} steps, jigsaw {how} (ratios of tokens/s)",
                        rows, shown))
    for line in skipped:
        console.print(f"skipped {line}")
    console.print(f"simulated in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
