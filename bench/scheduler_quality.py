"""The scheduler's decisions against the exact optimum, next to their decision time (not a test).

    tests/exact.py FAMILIES × --count instances ─► exact optimum (branch-and-bound over the
        system's decision space; each optimal schedule replayed through `execute` to check it)
    setting (a policy, or the look-ahead with a SchedulerConfig) ─► execute ─► makespan
        ─► gap to the optimum: mean / median / p90 / max, and the mean per family
        ─► schedule() wall time per call at 2 × 8 DP (8 GPUs) and 4 × 64 DP (64 GPUs),
           bench/scheduler_latency.py's graphs: median / p99
    ─► one table; pick the default from it

Usage:  python bench/scheduler_quality.py [--count 32] [--seeds 2] [--quick] [--families one-gpu three]
The optima are kept in ~/.cache/jigsaw/exact-optima.json (--cache, --no-cache) by instance digest.
Goal (issue 32): default within 2% on average and 5% at p90 of the optimum on every family,
the unlike ones included (train-heavy beside tail-heavy, very different step times, three
pipelines); steady p99 decision time ≤ 2 ms at 2 × 8 DP and ≤ 20 ms at 4 × 64 DP on a quiet
2-core machine (bench/scheduler_latency.py prints cold first decisions apart).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from exact import FAMILIES, SPACE, Replay, SearchLimit, instances, solve  # noqa: E402
from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402
from scheduler_latency import PRIOR, measure, setups  # noqa: E402

from jigsaw.graph.plan import SchedulerConfig  # noqa: E402
from jigsaw.graph.policies import make  # noqa: E402
from jigsaw.mux.model.slowdown import load_grid  # noqa: E402
from jigsaw.sim.execute import PolicyFailed, execute  # noqa: E402


@dataclass(frozen=True)
class Setting:
    label: str
    config: SchedulerConfig | None = None
    """The look-ahead's settings; None: the baseline `policy`."""
    policy: str = "jigsaw"


DEFAULT = SchedulerConfig()
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "jigsaw" / "exact-optima.json"
"""Optima solved before, by instance (an optimum takes up to --limit-s to prove)."""
SETTINGS = (
    Setting(f"default (W={DEFAULT.window}, filter {DEFAULT.min_pack_efficiency}, bound {DEFAULT.bound_weight}, "
            f"end game {DEFAULT.end_game_tasks} at W in {DEFAULT.end_game_depths})", DEFAULT),
    Setting("end game at the window's own depth (the stop-41 default)",
            SchedulerConfig(end_game_windows=(DEFAULT.window,))),
    Setting("window only (no end game: the issue-14 default)", SchedulerConfig(end_game_tasks=0)),
    Setting("W=1 (greedy), no end game", SchedulerConfig(window=1, end_game_tasks=0)),
    Setting("W=1, end game", SchedulerConfig(window=1)),
    Setting("W=3, end game at W=3", SchedulerConfig(window=3, end_game_windows=(3,))),
    Setting("paper (W=3, filter 1.25, critical path)",
            SchedulerConfig(window=3, min_pack_efficiency=1.25, bound_weight=0.0, end_game_tasks=0)),
    Setting("serial", policy="serial"),
    Setting("static", policy="static"),
    Setting("muxserve", policy="muxserve"),
)
BASELINES = ("static", "muxserve", "serial")
"""Policies a setting is compared with per instance ("behind"): what a user has for free."""


def optima(families: list[str], count: int, seed: int, grid, console: Console, limit_s: float,
           cache: Path | None) -> dict[str, tuple]:
    """Per instance key: (pipelines, node, optimal makespan); unsolved instances left out.
    Optima already in `cache` (by family, seed, index and a digest of the instance) are read,
    not solved again."""
    known = json.loads(cache.read_text()) if cache is not None and cache.exists() else {}
    out = {}
    for fam in families:
        with console.status(f"exact optima: {fam}") as status:
            for k, (pipes, node) in enumerate(instances(fam, count, seed)):
                status.update(f"exact optima: {fam} {k + 1}/{count}")
                tag, digest = f"{fam}/{seed}/{k}", _digest(pipes, node, grid)
                if known.get(tag, {}).get("digest") == digest:
                    out[f"{fam}/{k}"] = (pipes, node, known[tag]["makespan_s"])
                    continue
                upper = min(execute(pipes, node, grid, s.config).makespan_s for s in SETTINGS[:3])
                try:
                    opt = solve(pipes, node, grid, upper_s=upper, time_limit_s=limit_s)
                except SearchLimit:
                    console.print(f"[yellow]{fam}/{k}: not solved within {limit_s} s; left out")
                    continue
                replayed = execute(pipes, node, grid, policy=Replay(opt)).makespan_s
                if abs(replayed - opt.makespan_s) > 1e-6 * opt.makespan_s:
                    raise SystemExit(f"{fam}/{k}: the optimum replays at {replayed}, not {opt.makespan_s}")
                out[f"{fam}/{k}"] = (pipes, node, opt.makespan_s)
                known[tag] = {"digest": digest, "makespan_s": opt.makespan_s}
                if cache is not None:
                    cache.parent.mkdir(parents=True, exist_ok=True)
                    cache.write_text(json.dumps(known, indent=0, sort_keys=True))
    return out


def _digest(pipes, node, grid) -> str:
    """What an optimum depends on: the decision space's version, every sub-stage, its
    dependencies, the placement, the node and the grid file."""
    parts = [SPACE, repr(node), str(PRIOR), str(grid.device)]
    for ps in pipes:
        parts.append(repr(ps.devices))
        parts += [f"{s.id} {s.kind.value} {s.duration_s!r} {s.mem_bytes} {ps.graph.deps[s.id]}" for s in ps.graph]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def gaps(setting: Setting, solved: dict[str, tuple], grid) -> dict[str, float]:
    """Per instance, the makespan's gap to the optimum; a policy that cannot run one (static:
    a training over its half of the device) has none there."""
    out = {}
    for key, (pipes, node, best) in solved.items():
        policy = make(setting.policy) if setting.config is None else None
        try:
            got = execute(pipes, node, grid, setting.config or SchedulerConfig(), policy=policy,
                          fallback=False).makespan_s
        except PolicyFailed:
            continue
        if got < best * (1 - 1e-9):
            raise SystemExit(f"{setting.label} beats the exact optimum on {key}: {got} < {best}")
        out[key] = got / best - 1.0
    return out


def behind(g: dict[str, float], baselines: dict[str, dict[str, float]]) -> tuple[int, float]:
    """Instances where the setting ends later than the best baseline that ran, and its worst
    ratio to that baseline's makespan."""
    count, worst = 0, 1.0
    for key, gap in g.items():
        best = min((b[key] for b in baselines.values() if key in b), default=None)
        if best is not None and gap > best + 1e-9:
            count += 1
            worst = max(worst, (1 + gap) / (1 + best))
    return count, worst


def row(setting: Setting, g: dict[str, float], timing: dict[str, dict], families: list[str]) -> list[str]:
    xs = sorted(g.values())
    p90 = statistics.quantiles(xs, n=10, method="inclusive")[8]
    fams = " ".join(f"{statistics.mean(v for k, v in g.items() if k.startswith(f + '/')) * 100:.1f}"
                    for f in families if any(k.startswith(f + "/") for k in g))
    times = [f"{timing[lab]['median']:.2f} / {timing[lab]['p99']:.2f}" if lab in timing else "–"
             for lab in ("2×8", "4×64")]
    return [setting.label, str(len(xs)), f"{statistics.mean(xs) * 100:.1f}", f"{statistics.median(xs) * 100:.1f}",
            f"{p90 * 100:.1f}", f"{max(xs) * 100:.1f}", fams, *times]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--count", type=int, default=32, help="instances per family")
    ap.add_argument("--seed", type=int, default=0, help="instance set")
    ap.add_argument("--seeds", type=int, default=2, help="graph sets per decision-time setup")
    ap.add_argument("--limit-s", type=float, default=120.0, help="exact search time limit per instance")
    ap.add_argument("--quick", action="store_true", help="time 2 × 8 DP only (skip 4 × 64 DP)")
    ap.add_argument("--families", nargs="+", choices=list(FAMILIES), default=list(FAMILIES),
                    help="instance families (tests/exact.py); default: all")
    ap.add_argument("--cache", type=Path, default=CACHE, help="optima solved before (JSON); read and extended")
    ap.add_argument("--no-cache", action="store_true", help="solve every instance again, write nothing")
    args = ap.parse_args()
    grid = load_grid(PRIOR)
    console = Console(width=160)
    t0 = time.perf_counter()
    solved = optima(args.families, args.count, args.seed, grid, console, args.limit_s,
                    None if args.no_cache else args.cache)
    console.print(f"{len(solved)} instances solved exactly in {time.perf_counter() - t0:.0f} s")
    timed = {"2×8": setups()[0], "4×64": setups()[3]}
    if args.quick:
        del timed["4×64"]
    table = Table(title=f"gap to the exact optimum (%) on {len(solved)} instances; schedule() ms per call "
                        "(steady state)")
    for col in ("setting", "n", "mean", "median", "p90", "max", "per family: " + " ".join(args.families),
                "2×8 DP med / p99", "4×64 DP med / p99", "behind a baseline (worst ×)"):
        table.add_column(col, justify="left" if col == "setting" else "right")
    results = {}
    for setting in SETTINGS:
        with console.status(f"{setting.label}: gaps"):
            results[setting.label] = gaps(setting, solved, grid)
    base = {s.label: results[s.label] for s in SETTINGS if s.policy in BASELINES}
    for setting in SETTINGS:
        timing = {}
        if setting.config is not None:
            for lab, setup in timed.items():
                with console.status(f"{setting.label}: decision time at {setup.label}"):
                    timing[lab] = measure(setup, setting.config, args.seeds, 2, grid)
        n, worst = behind(results[setting.label], base)
        table.add_row(*row(setting, results[setting.label], timing, args.families),
                      f"{n} ({worst:.3f})" if setting.config is not None else "–")
    console.print(table)
    console.print(family_table(results, args.families))


def family_table(results: dict[str, dict[str, float]], families: list[str]) -> Table:
    """Per family: the default's and the window-only setting's gap, mean / p90 / max (%)."""
    labels = [SETTINGS[0].label, SETTINGS[1].label]
    table = Table(title="per family: gap to the optimum (%), mean / p90 / max")
    table.add_column("family")
    for lab in labels:
        table.add_column(lab.split(" (")[0], justify="right")
    for fam in families:
        cells = []
        for lab in labels:
            xs = sorted(v for k, v in results[lab].items() if k.startswith(fam + "/"))
            cells.append("–" if not xs else f"{statistics.mean(xs) * 100:.1f} / "
                         f"{statistics.quantiles(xs, n=10, method='inclusive')[8] * 100:.1f} / {xs[-1] * 100:.1f}"
                         if len(xs) > 1 else f"{xs[0] * 100:.1f}")
        table.add_row(fam, *cells)
    return table


if __name__ == "__main__":
    main()
