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

`--live` runs the CPU demo's jigsaw mode (two real GRPO pipelines on this CPU) with a wrong
prior: the calibrated CPU grid with the same four pair tables ×1.5.  Per repeat, interleaved:
        learned   the daemon learns (`--learn-grid`; the first trainings and references of each
                  pipeline run alone as probes: its rate alone is what co-located grants are
                  measured against, node/learning.py)
        prior     the same wrong prior, measured and never moved (`--watch-grid`: the same probes)
        measured  the calibrated grid, measured and never moved
        plain     the calibrated grid, no learner (no probes: what they cost)
    ─► per arm, the prediction error by step window, over the grants that were evidence about an
       entry and over all grants with a reference; tokens/s of every arm, paired by repeat

    python bench/learned_grid.py --live [--steps 24] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

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


def _errors(path) -> list[tuple[int, bool, float]]:
    """(step, evidence about an entry?, |error|) of every grant with a reference in a trace."""
    return [(SubStageId.parse(e.substage).step, e.data["learned"]["entry"] is not None,
             abs(e.data["learned"]["error_log"]))
            for e in Trace.read(path).events if e.event == "release" and "learned" in e.data]


def live_runs(steps: int, repeats: int, out_dir: Path) -> None:
    """The CPU demo with a wrong prior, learning and not (module docstring)."""
    from jigsaw import profiles
    from jigsaw.mux.model.learned import parse_scale, scaled
    from jigsaw.mux.model.slowdown import SlowdownGrid
    from jigsaw.recipes.demo import DemoConfig, run_demo

    out_dir.mkdir(parents=True, exist_ok=True)
    measured = profiles.resolve(profiles.CPU_DEFAULT)
    wrong = out_dir / "prior-x1.5.json"
    wrong.write_text(json.dumps(scaled(SlowdownGrid.load(measured), parse_scale(SCALE), note="x1.5").to_dict()))
    arms = {"learned": (wrong, "learn"), "prior": (wrong, "watch"), "measured": (measured, "watch"),
            "plain": (measured, "")}
    tps: dict[str, list[float]] = {a: [] for a in arms}
    errors: dict[str, list[tuple[int, bool, float]]] = {a: [] for a in arms if arms[a][1]}
    probes: dict[str, int] = {}
    for rep in range(repeats):
        for arm, (grid, how) in arms.items():
            d = out_dir / f"{arm}-r{rep + 1}"
            print(f"[repeat {rep + 1}/{repeats}] {arm}: 2 pipelines x {steps} steps ...", flush=True)
            (run,) = run_demo(DemoConfig(steps=steps, repeats=1, modes=("jigsaw",), out_dir=d, profile=str(grid),
                                         learn_grid=how == "learn", watch_grid=how == "watch"), say=lambda *_: None)
            tps[arm].append(run.tokens / run.steps_s)
            if how:
                errors[arm] += _errors(d / "jigsaw-trace.jsonl")
            for e in Trace.read(d / "jigsaw-trace.jsonl").events if how == "learn" else ():
                if e.event == "release" and "probe" in e.data:
                    probes[e.data["probe"]] = probes.get(e.data["probe"], 0) + 1
    _print_live(steps, repeats, tps, errors, probes)


def _print_live(steps: int, repeats: int, tps, errors, probes) -> None:
    print(f"\nCPU demo, jigsaw mode, {steps} steps x 2 pipelines, {repeats} repeat(s); wrong prior: the calibrated "
          f"grid x1.5 on {', '.join(x.split('=')[0] for x in SCALE)}")
    print(f"probes of the learned runs: {probes}")
    print("\nprediction error, mean |log(predicted / reference)| (grants): evidence about an entry / all")
    print(f"{'steps':>7}  " + "  ".join(f"{arm:>23}" for arm in errors))
    width = max(1, steps // 4)
    cell = lambda xs: f"{statistics.fmean(xs):.3f} ({len(xs):>3})" if xs else f"{'-':>9}"  # noqa: E731
    for lo in range(0, steps, width):
        cells = []
        for errs in errors.values():
            ev = [x for st, e, x in errs if lo <= st < lo + width and e]
            al = [x for st, _, x in errs if lo <= st < lo + width]
            cells.append(f"{cell(ev)} / {cell(al)}")
        print(f"{lo:>3}-{min(steps, lo + width) - 1:<3}  " + "  ".join(f"{c:>23}" for c in cells))
    print("\ntokens/s per repeat (x: learned over the other, same repeat)")
    for arm, xs in tps.items():
        ratio = "" if arm == "learned" else "  x " + " ".join(f"{a / b:.3f}" for a, b in zip(tps["learned"], xs))
        print(f"{arm:>9}: {' '.join(f'{x:,.0f}' for x in xs)}{ratio}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=None, help="steps per pipeline (default: 30 simulated, 24 --live)")
    ap.add_argument("--workload", default="qwen3-0.6b-gsm8k,qwen3-0.6b-gsm8k")
    ap.add_argument("--traces", nargs="+", default=None, help="daemon traces of runs that learned: print their error")
    ap.add_argument("--live", action="store_true", help="the CPU demo with a wrong prior, learning and not")
    ap.add_argument("--repeats", type=int, default=2, help="--live: runs of each arm, interleaved")
    ap.add_argument("--out-dir", type=Path, default=Path("/tmp/jigsaw-learned-grid"), help="--live: runs go here")
    args = ap.parse_args()
    if args.traces:
        live(args.traces)
        return
    if args.live:
        live_runs(args.steps or 24, args.repeats, args.out_dir)
        return
    args.steps = args.steps or 30
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
