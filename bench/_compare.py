"""Shared by the paper benches: run every policy on one workload mix and tabulate ratios."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, replace

from rich.table import Table

from jigsaw.sim import workload
from jigsaw.sim.breakdown import Breakdown, breakdown, combined
from jigsaw.sim.run import LowerBound, SimConfig, lower_bound, pipelines, simulate

BASELINES = ("serial", "split", "static", "rollmux", "muxserve", "hrrs", "greedy")


@dataclass
class Row:
    label: str
    tokens_per_s: dict[str, float]
    latency_x: dict[str, float]
    """Mean over pipelines of (mean step latency / mean step time alone)."""
    bound: LowerBound
    makespan_s: dict[str, float]
    where: Breakdown | None = None
    """Where jigsaw's device time went (from its trace)."""
    infeasible: dict[str, str] | None = None
    """Policies that cannot run this mix, and why (e.g. training does not fit their pool)."""
    placed: str = ""
    """The placement jigsaw's trials chose (sim/placement.py)."""
    violations: dict[str, str] | None = None
    """Policies whose run broke an invariant (a sub-stage ungranted, a pair the grid cannot
    hold): how many, and the first; such a row's figure is not the policy's."""


def run_mix(label: str, workloads: tuple[str, ...], gpus: int, steps: int, seed: int,
            policies: tuple[str, ...] = BASELINES + ("jigsaw",), nodes: str = "") -> Row:
    """Every policy on the mix, on one node of `gpus` GPUs; with `nodes` (COUNTxKIND, as many
    GPUs), jigsaw and HetRL-style placement also place the pipelines on those nodes (see
    _place): the row's "jigsaw" is then the placed run, its flat run "jigsaw flat"."""
    cfg = SimConfig(workload=workloads, gpus=gpus, steps=steps, seed=seed, trace=False)
    res, infeasible = {}, {}
    for p in policies:
        try:
            res[p] = simulate(replace(cfg, policy=p, trace=p == "jigsaw"))
        except ValueError as exc:  # the policy's placement cannot host this deployment
            infeasible[p] = str(exc)
    bound = lower_bound(replace(cfg, policy="serial"))
    first = workload.get(workloads[0])
    where = breakdown(res["jigsaw"].trace, gpus // first.rollout_tp) if "jigsaw" in res else None
    row = Row(label=label, tokens_per_s={p: r.tokens_per_s for p, r in res.items()},
               latency_x={p: statistics.fmean(x.mean_step_latency_s / (a / steps)
                                              for x, a in zip(r.pipelines, bound.alone_s))
                          for p, r in res.items()},
               bound=bound, makespan_s={p: r.makespan_s for p, r in res.items()}, where=where,
               infeasible=infeasible or None,
               placed=_placed(res["jigsaw"].placement) if "jigsaw" in res and res["jigsaw"].placement else "",
               violations={p: f"{len(r.violations)}, first: {r.violations[0]}" for p, r in res.items()
                           if r.violations} or None)
    if nodes and "jigsaw" in policies:
        _place(row, cfg, nodes)
    return row


PLACED = {"jigsaw": "jigsaw", "hetrl": "hetrl", "rollmux": "rollmux placed"}
"""Placement policies of cluster/simulate.py a placed row adds, and their column (hetrl: HetRL's
placement; rollmux: RollMux's admission, beside its pools on every GPU, "rollmux")."""


def _place(row: Row, cfg: SimConfig, nodes: str) -> None:
    """jigsaw's, HetRL's and RollMux's placement of the row's pipelines on `nodes` (the same code
    as `jigsaw sim --nodes`): the row's jigsaw becomes the placed run, its flat one "jigsaw flat"."""
    from jigsaw.cluster.simulate import ClusterConfig, simulate_cluster

    for key in ("tokens_per_s", "latency_x", "makespan_s"):
        values = getattr(row, key)
        if "jigsaw" in values:
            values["jigsaw flat"] = values.pop("jigsaw")
    names = [spec.name for spec, *_ in pipelines(cfg)]  # the bound's order
    alone = {n: a for n, a in zip(names, row.bound.alone_s)}
    for policy, column in PLACED.items():
        try:
            got = simulate_cluster(replace(cfg, trace=policy == "jigsaw"), ClusterConfig(nodes=nodes), policy)
        except ValueError as exc:  # e.g. more pipelines than nodes for groups of one
            row.infeasible = {**(row.infeasible or {}), column: str(exc)}
            continue
        row.tokens_per_s[column] = got.tokens_per_s
        row.makespan_s[column] = got.makespan_s
        row.latency_x[column] = statistics.fmean(x.mean_step_latency_s / (alone[x.workload] / cfg.steps)
                                                 for r in got.runs for x in r.pipelines)
        if policy == "jigsaw":
            row.placed = "; ".join(f"{'+'.join(f'P{i}' for i in g.pipelines)} on {g.nodes}x{g.kind}"
                                   for g in got.placement.groups)
            row.where = combined([breakdown(r.trace, r.config.gpus // workload.get(r.config.workload[0]).rollout_tp)
                                  for r in got.runs])


def _placed(choice) -> str:
    """The shape jigsaw's trials kept, and the window where a trial chose another."""
    return choice.shape + (f", W = {choice.window}" if choice.window else "")


def table(title: str, rows: list[Row], policies: tuple[str, ...]) -> Table:
    t = Table(title=title)
    t.add_column("workload", no_wrap=True)
    others = [p for p in policies if p != "jigsaw"]
    baselines = [p for p in others if p != "jigsaw flat"]  # jigsaw unplaced is not a baseline
    for p in others:
        t.add_column(f"jigsaw / {p}", justify="right")
    t.add_column("× best baseline", justify="right")
    t.add_column("jigsaw placed", justify="left")
    t.add_column("jigsaw tok/s", justify="right")
    t.add_column("gap to bound", justify="right")
    t.add_column("latency × alone", justify="right")
    for col in ("idle", "one alone", "work / device-s"):
        t.add_column(col, justify="right")
    notes = []
    for r in rows:
        t.add_row(r.label, *[_ratio(r, p) for p in others], _best(r, baselines), r.placed,
                  f"{r.tokens_per_s['jigsaw']:,.0f}", f"{r.makespan_s['jigsaw'] / r.bound.makespan_s - 1:+.0%}",
                  f"{r.latency_x['jigsaw']:.2f}", *_where(r.where))
        notes += [f"n/a: {p} on {r.label}: {why}" for p, why in (r.infeasible or {}).items()]
        notes += [f"VIOLATIONS: {p} on {r.label}: {what}" for p, what in (r.violations or {}).items()]
    ratios = {p: [r.tokens_per_s["jigsaw"] / r.tokens_per_s[p] for r in rows if p in r.tokens_per_s] for p in others}
    t.caption = "\n".join(notes) or None
    t.add_section()
    best = [b[1] for r in rows if (b := _best_baseline(r, baselines)) is not None]
    t.add_row("average", *[f"{statistics.fmean(v):.2f}" for v in ratios.values()], f"{statistics.fmean(best):.2f}", "",
              "", f"{statistics.fmean(r.makespan_s['jigsaw'] / r.bound.makespan_s - 1 for r in rows):+.0%}",
              f"{statistics.fmean(r.latency_x['jigsaw'] for r in rows):.2f}")
    t.add_row("max", *[f"{max(v):.2f}" for v in ratios.values()], f"{max(best):.2f}", "", "", "", "")
    t.add_row("min", *[f"{min(v):.2f}" for v in ratios.values()], f"{min(best):.2f}", "", "", "", "")
    return t


def _best_baseline(r: Row, others: list[str]) -> tuple[str, float] | None:
    """The fastest baseline that ran this mix, and jigsaw's tokens/s over its."""
    ran = [p for p in others if p in r.tokens_per_s]
    if not ran:
        return None
    p = max(ran, key=lambda q: r.tokens_per_s[q])
    return p, r.tokens_per_s["jigsaw"] / r.tokens_per_s[p]


def _best(r: Row, others: list[str]) -> str:
    b = _best_baseline(r, others)
    return "n/a" if b is None else f"{b[1]:.2f} ({b[0]})"


def _ratio(r: Row, p: str) -> str:
    return f"{r.tokens_per_s['jigsaw'] / r.tokens_per_s[p]:.2f}" if p in r.tokens_per_s else "n/a"


def _where(bd: Breakdown | None) -> list[str]:
    """jigsaw's idle device time, time with one sub-stage alone, and work per device-second."""
    if bd is None:
        return ["", "", ""]
    idle = sum(v for k, v in bd.by_occupancy_s.items() if k.startswith("idle"))
    alone = sum(v for k, v in bd.by_occupancy_s.items() if not k.startswith("idle") and " + " not in k)
    return [f"{idle / bd.device_s:.0%}", f"{alone / bd.device_s:.0%}", f"{bd.work_per_device_s:.2f}"]
