"""Throughput against step-latency SLOs (JigsawRL Fig. 14's latency cost, against serial's 2×).

    python bench/slo.py [--steps 6] [--seed 0] [--slos 2.0 1.6 1.4 1.2] [--pairs A+B ...]

    per pair of shipped workloads, the same samples in every row (sim.run.simulate):
        serial, static          the baselines a user has for free (no SLO: they cannot hold one)
        jigsaw                  no SLO
        jigsaw slo s,0          the first pipeline held to s, the second free (`--slo s 0`)
        jigsaw slo s            both held to s
    ─► tokens/s, × static, and per pipeline its mean step against the same step alone on the
       node (sim.run.exclusive_steps: the truth an SLO is measured by) and the steps within s

Not a test: the node simulator predicts each step's graph as a live daemon does, so a step
whose prediction was off can miss an SLO the plan kept (tests/integration/test_slo_pairs.py
holds the look-ahead to SLOs it could keep, on graphs it knows).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace

from rich.console import Console
from rich.table import Table

from jigsaw.graph.slo import within
from jigsaw.sim.node import Infeasible
from jigsaw.sim.run import SimConfig, exclusive_steps, simulate

PAIRS = ("qwen3-4b-gsm8k+qwen3-4b-gsm8k", "qwen3-0.6b-gsm8k+qwen3-0.6b-math",
         "qwen3-4b-gsm8k+qwen3-4b-gsm8k-multiturn", "qwen3-4b-instruct-gsm8k+qwen3-4b-longcot-empirical")


def _rows(slos: list[float]) -> list[tuple[str, str, tuple[float, ...]]]:
    out = [("serial", "serial", ()), ("static", "static", ()), ("jigsaw", "jigsaw", ())]
    for s in slos:
        out += [(f"jigsaw slo {s:g},0", "jigsaw", (s, 0.0)), (f"jigsaw slo {s:g}", "jigsaw", (s,))]
    return out


def _cells(result, alone: dict[int, tuple[float, ...]], slo: tuple[float, ...]) -> list[str]:
    """Per pipeline: its mean (worst) step over the step alone, and its steps within its SLO."""
    cells = []
    for i, p in enumerate(result.pipelines):
        ratios = [lat / ex for lat, ex in zip(p.step_latency_s, alone[i])]
        held = slo[0] if len(slo) == 1 else slo[i] if slo else 0.0
        kept = sum(1 for lat, ex in zip(p.step_latency_s, alone[i]) if within(lat, ex, held))
        cells += [f"{statistics.fmean(ratios):.2f} ({max(ratios):.2f})", f"{kept}/{len(ratios)}" if held else ""]
    return cells


def pair_table(pair: str, steps: int, seed: int, slos: list[float], log: Console) -> Table:
    workloads = tuple(pair.split("+"))
    base = SimConfig(workload=workloads, steps=steps, seed=seed, trace=False)
    alone = exclusive_steps(replace(base, slo=(1.0,)))  # each pipeline alone: the same samples
    t = Table(title=f"{pair}, {steps} steps, seed {seed}")
    for col in ("run", "tokens/s", "×static", "p0 ×alone", "kept", "p1 ×alone", "kept"):
        t.add_column(col, justify="left" if col == "run" else "right", no_wrap=True)
    static_tps = None
    for label, policy, slo in _rows(slos):
        t0 = time.perf_counter()
        try:
            r = simulate(replace(base, policy=policy, slo=slo))
        except Infeasible as exc:
            t.add_row(label, "infeasible", "", str(exc)[:40], "", "", "")
            continue
        static_tps = r.tokens_per_s if policy == "static" else static_tps
        ratio = f"{r.tokens_per_s / static_tps:.3f}" if static_tps else "—"
        t.add_row(label, f"{r.tokens_per_s:,.0f}", ratio, *_cells(r, alone, slo))
        log.print(f"  {pair}: {label} {r.tokens_per_s:,.0f} tok/s ({time.perf_counter() - t0:.1f} s)", style="dim")
    return t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--slos", type=float, nargs="+", default=[2.0, 1.6, 1.4, 1.2])
    ap.add_argument("--pairs", nargs="+", default=list(PAIRS), help="A+B workload pairs (jigsaw sim --list)")
    args = ap.parse_args()
    out, log = Console(width=max(Console().width, 96)), Console(stderr=True, highlight=False)
    for pair in args.pairs:
        out.print(pair_table(pair, args.steps, args.seed, args.slos, log))
    out.print("×alone: each step's latency over the same step of the pipeline alone on the node (mean over "
              "steps, worst in brackets); kept: steps within the SLO")
    return 0


if __name__ == "__main__":
    sys.exit(main())
