"""A grid learned online, in the simulator: a run whose true grid differs from the prior.

    true grid = the prior with four pair tables of reference / training ×1.5 (SCALE)
    three runs of one mix, the physics always by the true grid:
        prior    the policy plans with the prior (learning off)
        learned  it plans with the grid learned online from every finished sub-stage
        true     it plans with the true grid (what learning could reach at best)
    ─► per step: mean |log(predicted / true)| of the sub-stage times that have a reference
       (the plan's prediction error), and the entries learned so far; throughput of each run

    python bench/learned_grid.py [--steps 30] [--workload qwen3-0.6b-gsm8k,qwen3-0.6b-gsm8k]

Live: `--traces T.jsonl ...` reads daemon traces of runs that learned (`jigsaw demo --learn-grid`,
`jigsaw daemon --learn-grid`): per step, the mean |log(predicted / reference)| of the grants the
learner took (a release event's `learned`), and how many there were.
"""

from __future__ import annotations

import argparse
import statistics
import time

from jigsaw.graph.ids import SubStageId
from jigsaw.mux.model.learned import GridLearner, LearnConfig
from jigsaw.sim.node import NodeSim
from jigsaw.sim.run import SimConfig, build, true_grid
from jigsaw.trace import Trace

SCALE = ("reference/rollout_tail=1.5", "reference/training=1.5", "training/rollout_tail=1.5",
         "training/reference=1.5")


def run(config: SimConfig, mode: str):
    """(tokens/s, per-step errors, learner) of one run: mode prior | learned | true."""
    runs, node, grid, pol = build(config)
    truth = true_grid(config, grid)
    plan_with = truth if mode == "true" else grid
    # The same bookkeeping in every mode; off, a rule that never moves an entry only watches.
    never = LearnConfig(min_samples=1 << 30, window=1 << 30)
    learner = GridLearner(plan_with) if mode == "learned" else GridLearner(plan_with, never)
    sim = NodeSim(runs, node, plan_with, pol, trace=False, truth=truth, learner=learner)
    sim.run()
    tokens = sum(m.tokens for r in runs for m in r.metrics)
    makespan = max(r.metrics[-1].end_s for r in runs)
    per_step: dict[int, list[float]] = {}
    for got in sim.state.grants.history:
        per_step.setdefault(SubStageId.parse(got.sid).step, []).append(abs(got.error_log))
    return tokens / makespan, per_step, learner


def live(paths) -> None:
    """The plan's error per step over daemon traces that learned (module docstring)."""
    print(f"{'trace':<40} {'step':>4} {'grants':>6} {'mean |error|':>12}")
    for path in paths:
        per_step: dict[int, list[float]] = {}
        for e in Trace.read(path).events:
            if e.event == "release" and "learned" in e.data:
                per_step.setdefault(SubStageId.parse(e.substage).step, []).append(abs(e.data["learned"]["error_log"]))
        for step, errs in sorted(per_step.items()):
            print(f"{str(path)[-40:]:<40} {step:>4} {len(errs):>6} {statistics.fmean(errs):12.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--workload", default="qwen3-0.6b-gsm8k,qwen3-0.6b-gsm8k")
    ap.add_argument("--traces", nargs="+", default=None, help="daemon traces of runs that learned: print their error")
    args = ap.parse_args()
    if args.traces:
        live(args.traces)
        return
    config = SimConfig(workload=(args.workload,), steps=args.steps, placement="colocated", trace=False,
                       true_grid_scale=SCALE)
    t0 = time.perf_counter()
    got = {mode: run(config, mode) for mode in ("prior", "learned", "true")}
    print(f"true grid: prior x 1.5 on {len(SCALE)} pair tables ({', '.join(x.split('=')[0] for x in SCALE)}); "
          f"{args.workload}, {args.steps} steps, colocated")
    print("\nprediction error of sub-stage times, mean |log(predicted/true)| by step")
    print(f"{'step':>4}  {'prior':>6}  {'learned':>7}  {'true':>6}")
    for step in range(0, args.steps, max(1, args.steps // 10)):
        cells = [statistics.fmean(got[m][1][step]) if got[m][1].get(step) else float("nan")
                 for m in ("prior", "learned", "true")]
        print(f"{step:>4}  {cells[0]:6.3f}  {cells[1]:7.3f}  {cells[2]:6.3f}")
    for mode in ("prior", "learned", "true"):
        errs = [e for s in got[mode][1].values() for e in s]
        half = [e for st, s in got[mode][1].items() if st >= args.steps // 2 for e in s]
        print(f"{mode:>8}: {got[mode][0]:9.0f} tokens/s  error all {statistics.fmean(errs):.3f}, "
              f"second half {statistics.fmean(half):.3f}")
    learner = got["learned"][2]
    moved = [e for e in learner.report() if abs(e.learned / e.prior - 1) > 1e-6]
    print(f"\nlearned: {learner.observed} grants were evidence, {len(moved)} entries moved; skipped "
          f"{dict(learner.skipped)}")
    for e in moved:
        print(f"  {e.entry[0]:>15} beside {e.entry[1] or 'alone':<15} sm {e.sm_frac:.2f} mem {e.mem_frac:.1f}: "
              f"prior {e.prior:.3f} learned {e.learned:.3f} (n={e.count}, spread {e.spread_log:.3f})")
    print(f"\n({time.perf_counter() - t0:.1f} s)")


if __name__ == "__main__":
    main()
