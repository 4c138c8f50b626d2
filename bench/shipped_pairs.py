"""jigsaw against every baseline on every shipped workload pair and mix (not a test: prints a table).

    python bench/shipped_pairs.py [--steps 8] [--seed 0] [--only NAME ...] [--no-mixes]

    shipped workloads ─► pairs (w, w) and (w, the next of w's device kind)   workload.shipped_pairs()
                      + the 3- and 4-pipeline mixes of bench/paper_sync.py
        ─► every policy on each, the same samples (bench/_compare.py) ─► per row: jigsaw over
           each baseline, over the best baseline that ran, the placement jigsaw's trials chose,
           its gap to the lower bound
Goal (issue 32): jigsaw ≥ 1.00× every baseline that ran, on every row.  Each row runs on its
workloads' own node (the larger GPU count of the pair).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _compare import BASELINES, run_mix, table  # noqa: E402
from paper_sync import MIXES  # noqa: E402
from rich.console import Console  # noqa: E402

from jigsaw.sim import workload as wl  # noqa: E402

POLICIES = BASELINES + ("jigsaw",)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--only", nargs="+", default=None, help="rows whose label contains one of these")
    ap.add_argument("--no-mixes", action="store_true", help="the pairs only")
    args = ap.parse_args()
    rows_in = [(a if a == b else f"{a} + {b}", (a, b)) for a, b in wl.shipped_pairs()]
    if not args.no_mixes:
        rows_in += list(MIXES.items())
    if args.only:
        rows_in = [(label, ws) for label, ws in rows_in if any(o in label for o in args.only)]
    console = Console(width=260)
    t0, rows = time.time(), []
    for n, (label, ws) in enumerate(rows_in, 1):
        gpus = max(wl.get(w).gpus for w in ws)
        with console.status(f"[{n}/{len(rows_in)}] {label} on {gpus} GPUs ..."):
            rows.append(run_mix(f"{label} @{gpus}", ws, gpus, args.steps, args.seed, POLICIES))
        r = rows[-1]
        ran = [p for p in BASELINES if p in r.tokens_per_s]
        best = max(ran, key=lambda p: r.tokens_per_s[p])
        broke = f", VIOLATIONS: {sorted(r.violations)}" if r.violations else ""
        console.print(f"[{n}/{len(rows_in)}] {label}: jigsaw {r.tokens_per_s['jigsaw'] / r.tokens_per_s[best]:.3f}× "
                      f"{best} (placed {r.placed}){broke}", highlight=False)
    console.print(table(f"every shipped pair and mix, {args.steps} steps (ratios of tokens/s)", rows, POLICIES))
    console.print(f"simulated in {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()
