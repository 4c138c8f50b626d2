"""Placement on a cluster of mixed GPU kinds (issue 35): jigsaw against HetRL-style placement
(not a test: prints a table).

    python bench/cluster_mixed.py [--nodes 2xh100,2xa100] [--steps 6] [--seeds 0 1] [--workload ...]
                                  [--search-only | --pruning]

    1. the search alone: place() over random estimate tables (K pipelines on 4xh100,4xa100),
       wall time per decision, median and p99: the controller's own cost once trials are known
    2. workloads × cluster ─► per seed, per placement policy (jigsaw/cluster/simulate.py):
        jigsaw  groups of one or two pipelines, each group priced by jigsaw's own trial run
        hetrl   each pipeline on nodes of its own, kind and count searched, priced alone
    ─► every group simulated for all steps on its kind's grid ─► per seed: makespan, tokens/s,
       jigsaw / hetrl (the same samples: a pipeline keeps its sample stream wherever placed),
       the placements, and each policy's decision time (its trials)
    3. (--pruning) jigsaw's placement decided with trials stopped at the best makespan found so
       far and with every trial run to its end, side by side: wall time, and the same placement
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time

from rich.console import Console
from rich.table import Table

from jigsaw.cluster.placement import Group, place
from jigsaw.cluster.simulate import PLACERS, ClusterConfig, estimator, simulate_cluster
from jigsaw.cluster.spec import parse_nodes
from jigsaw.sim.run import SimConfig

MIX = ("qwen3-4b-gsm8k", "qwen3-0.6b-gsm8k", "qwen3-4b-aime", "qwen3-0.6b-math")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--nodes", default="2xh100,2xa100")
    ap.add_argument("--workload", nargs="+", default=list(MIX))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--trial-steps", type=int, default=3)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--search-only", action="store_true", help="only part 1 (no simulation)")
    ap.add_argument("--pruning", action="store_true", help="only part 3: jigsaw's placement with and without "
                                                           "stopping trials at the best makespan so far")
    args = ap.parse_args()
    console = Console(width=200)
    if args.pruning:
        console.print(pruning_table(args))
        return
    console.print(search_table())
    if args.search_only:
        return
    cfg = ClusterConfig(nodes=args.nodes, cluster_trial_steps=args.trial_steps)
    t = Table(title=f"{len(args.workload)} pipelines on {args.nodes}, {args.steps} steps")
    for col in ("seed", "policy", "placement", "makespan s", "tokens/s", "jigsaw / hetrl", "trials", "decide s"):
        t.add_column(col, justify="left" if col in ("policy", "placement") else "right")
    ratios, t0 = [], time.time()
    for seed in args.seeds:
        sim = SimConfig(workload=tuple(args.workload), steps=args.steps, seed=seed, trace=False)
        got = {}
        for policy in ("jigsaw", "hetrl"):
            with console.status(f"seed {seed}: {policy} ..."):
                got[policy] = simulate_cluster(sim, cfg, policy)
        ratio = got["jigsaw"].tokens_per_s / got["hetrl"].tokens_per_s
        ratios.append(ratio)
        for policy, r in got.items():
            t.add_row(str(seed), policy, r.placement.describe(list(args.workload)), f"{r.makespan_s:,.1f}",
                      f"{r.tokens_per_s:,.0f}", f"{ratio:.3f}" if policy == "jigsaw" else "",
                      str(r.placement.estimates), f"{r.decide_s:.1f}")
    console.print(t)
    spread = f"{min(ratios):.3f}-{max(ratios):.3f}" if len(ratios) > 1 else f"{ratios[0]:.3f}"
    console.print(f"jigsaw / hetrl: mean {statistics.fmean(ratios):.3f}, range {spread} over {len(ratios)} seed(s); "
                  f"{time.time() - t0:.0f} s")


def _random_estimate(rng: random.Random):
    table: dict[Group, float] = {}

    def estimate(g: Group, until_s: float | None = None) -> float:
        if g not in table:
            table[g] = rng.uniform(10, 100) / g.nodes ** rng.uniform(0.3, 1.0)
        return table[g]

    return estimate


def search_table(instances: int = 50) -> Table:
    """Wall time of place() with estimates already known (a table lookup each)."""
    cluster = parse_nodes("4xh100,4xa100")
    t = Table(title=f"placement search alone, {instances} random instances each, {cluster[0]} + {cluster[1]}")
    for col in ("pipelines", "groups", "estimates", "median ms", "p99 ms"):
        t.add_column(col, justify="right")
    for count in (2, 4, 6):
        times, estimates = [], 0
        for seed in range(instances):
            estimate = _random_estimate(random.Random(seed))
            place(count, cluster, estimate)  # fills the table: what trials would have priced
            t0 = time.perf_counter()
            got = place(count, cluster, estimate)
            times.append(time.perf_counter() - t0)
            estimates = max(estimates, got.estimates)
        p99 = statistics.quantiles(times, n=100, method="inclusive")[98]
        t.add_row(str(count), str(math.ceil(count / 2)) + f"-{count}", str(estimates),
                  f"{statistics.median(times) * 1e3:.1f}", f"{p99 * 1e3:.1f}")
    return t


def pruning_table(args) -> Table:
    """Part 3: jigsaw's placement decided twice per seed, side by side: trials stopped once they
    pass the best makespan found so far (place()'s bound), and every trial run to its end."""
    cluster = parse_nodes(args.nodes)
    cfg = ClusterConfig(nodes=args.nodes, cluster_trial_steps=args.trial_steps)
    t = Table(title=f"trial pruning: jigsaw's placement of {len(args.workload)} pipelines on {args.nodes}")
    for col in ("seed", "trials", "bounded s", "unbounded s", "bounded / unbounded", "same placement"):
        t.add_column(col, justify="right")
    for seed in args.seeds:
        sim = SimConfig(workload=tuple(args.workload), steps=args.steps, seed=seed, trace=False)
        estimate = estimator(sim, cfg, PLACERS["jigsaw"].node_policy)
        runs = {}
        for bounded in (True, False):
            how = estimate if bounded else (lambda g, until_s=None, full=estimate: full(g, None))
            t0 = time.perf_counter()
            runs[bounded] = (place(len(args.workload), cluster, how), time.perf_counter() - t0)
        (a, a_s), (b, b_s) = runs[True], runs[False]
        t.add_row(str(seed), str(a.estimates), f"{a_s:.1f}", f"{b_s:.1f}", f"{a_s / b_s:.2f}",
                  "yes" if a.groups == b.groups else f"no: {a.describe(list(args.workload))}")
    return t


if __name__ == "__main__":
    main()
