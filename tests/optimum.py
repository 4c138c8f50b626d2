"""Exhaustive optimum over the scheduler's own action space, for tests only.

Depth-first search over every option of every choice until all work is done, with
branch-and-bound on `actions.lower_bound`.  Exponential: small instances only.
"""

from __future__ import annotations

from jigsaw.graph import actions as act
from jigsaw.graph.plan import SchedulerConfig
from jigsaw.graph.problem import SchedulerCache


def optimal_makespan(pipelines, node, model, config: SchedulerConfig = SchedulerConfig(),
                     node_limit: int = 2_000_000) -> float:
    cache = SchedulerCache()
    P = cache.problem(tuple((ps.graph, tuple(ps.devices)) for ps in pipelines), node)
    ctx = act.Context(model, config, node, cache, pipelines)
    S = act.initial(P, pipelines, 0.0, ctx)
    min_s = min(1.0, min(v for k in model.kinds for kb in model.kinds
                         for _, _, a, b in model.pair_options(k, kb) for v in (a, b)))
    best = [float("inf")]
    budget = [node_limit]

    def dfs(state):
        budget[0] -= 1
        if budget[0] < 0:
            raise RuntimeError("exhaustive search exceeded its node limit")
        dec = act.settle(P, state, ctx, advance_time=True)
        if dec is None:
            best[0] = min(best[0], max(state.end_s))
            return
        if act.lower_bound(P, state, min_s, max(1.0, model.max_pack_efficiency())) >= best[0] - 1e-12:
            return
        for opt in dec[1]:
            branch = state.copy()
            act.apply(P, branch, ctx, dec[0], opt)
            dfs(branch)

    dfs(S)
    return best[0]
