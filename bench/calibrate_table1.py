"""Stage shares of the `serial` policy against JigsawRL Table 1, and a fit of one workload.

    python bench/calibrate_table1.py                 # shares of every Table 1 configuration
    python bench/calibrate_table1.py --fit NAME      # grid-search NAME's length parameters

Only workload parameters are fitted (length distribution, turns, tool latency); device
constants come from datasheets and the prior.  Shares are means over `--steps` steps of
one pipeline alone on the configuration's GPUs, as verl runs it.
"""

from __future__ import annotations

import argparse
import itertools
from dataclasses import replace

from jigsaw.sim import workload as wl
from jigsaw.sim.run import stage_shares

TABLE1 = {  # (workload, GPUs): (rollout, reference, training, tool) in %
    ("qwen3-0.6b-gsm8k", 4): (66.1, 14.2, 19.7, 0.0),
    ("qwen3-4b-gsm8k", 4): (52.2, 18.7, 29.1, 0.0),
    ("qwen3-4b-aime", 4): (80.9, 6.9, 12.2, 0.0),
    ("qwen3-4b-gsm8k", 64): (67.4, 15.8, 16.8, 0.0),
    ("qwen3-4b-search-r1", 4): (39.1, 16.6, 24.6, 19.7),
}


def shares(spec: wl.WorkloadSpec, gpus: int, steps: int, seed: int = 0) -> tuple[float, ...]:
    return stage_shares(spec, gpus, steps, seed)


def report(steps: int) -> float:
    worst = 0.0
    print(f"{'workload':22s} {'GPUs':>4s}   {'rollout':>15s} {'reference':>15s} {'training':>15s} {'tool':>15s}")
    for (name, gpus), target in TABLE1.items():
        got = shares(wl.get(name), gpus, steps)
        worst = max(worst, max(abs(g - t) for g, t in zip(got, target)))
        cells = "  ".join(f"{g:5.1f} ({t:5.1f})" for g, t in zip(got, target))
        print(f"{name:22s} {gpus:4d}   {cells}")
    print(f"largest deviation: {worst:.1f} points (simulated (Table 1))")
    return worst


def fit(name: str, steps: int) -> None:
    base = wl.get(name)
    targets = [(g, t) for (n, g), t in TABLE1.items() if n == name]
    best = None
    for med, ps, rs in itertools.product([150, 250, 400, 600, 900, 1300, 1800, 2500, 3500],
                                         [0.2, 0.4, 0.6, 0.8], [0.2, 0.4, 0.6, 0.8]):
        spec = replace(base, lengths=replace(base.lengths, median_tokens=float(med), prompt_sigma=ps,
                                             response_sigma=rs))
        err = max(max(abs(a - b) for a, b in zip(shares(spec, g, steps), t)) for g, t in targets)
        if best is None or err < best[0]:
            best = (err, med, ps, rs)
            print(f"  median {med} prompt_sigma {ps} response_sigma {rs}: max error {err:.1f}", flush=True)
    print("best:", best)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--fit", help="workload to fit")
    args = ap.parse_args()
    if args.fit:
        fit(args.fit, args.steps)
    else:
        report(args.steps)


if __name__ == "__main__":
    main()
