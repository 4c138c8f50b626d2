"""SLO deadlines in the look-ahead's cost (graph/slo.py says what an SLO is).

    actions.initial ─► hold(): a deadline its step misses even alone is given up (Context.given_up);
                       the rest are watched (State.watch: the tasks of each held step)
    actions._best_split ─► keeping(): the memory splits that hold the watched tasks' deadlines
    actions.cost ─► lateness(): Σ how late each held step ends on the critical path, and how
                    late the next step ends past its own SLO after it
        _chain_end / _tail_end: the rest of a step runs beside its partner while the partner
        holds the device (a rollout: with the regimes that continue it, at its pace now), or
        waits for it where it fits beside it at no share

Written for the search's leaf: plain loops over the State, no allocation it can avoid.
"""

from __future__ import annotations

from jigsaw.graph import state as st
from jigsaw.graph.context import Context, PairPoint
from jigsaw.graph.problem import Problem
from jigsaw.graph.slo import TOLERANCE_S
from jigsaw.graph.state import State


def hold(P: Problem, S: State, ctx: Context) -> None:
    """The deadlines the search holds: one its step misses even alone from now on is given up
    at once (Context.given_up), so it buys no priority it cannot use; the rest are watched."""
    for p, (step, deadline, _, _) in list(ctx.slo.items()):
        alone = alone_left_s(P, S, p, step)
        if S.now_s + alone > deadline + TOLERANCE_S:
            ctx.given_up[p] = (f"infeasible: even alone from now its step {step} needs {alone:.3g} s at "
                               f"exclusive speed, {max(deadline - S.now_s, 0.0):.3g} s are left to its deadline")
            del ctx.slo[p]
    if not ctx.slo:
        ctx.slo = None
        return
    watch(P, S, ctx.slo)


def watch(P: Problem, S: State, slo: dict) -> None:
    """S watches the tasks of each step held to a deadline in `slo` (none ended yet)."""
    S.watch = frozenset(i for p, (step, *_) in slo.items() for i in P.pipe_tasks[p] if P.tasks[i].step == step)
    S.slo_end = [-float("inf")] * len(P.names)


def alone_left_s(P: Problem, S: State, p: int, step: int) -> float:
    """What pipeline p's `step` still needs alone, at exclusive speed, from S on."""
    return max((S.rem_s[i] + P.tasks[i].step_tail_s for i in P.pipe_tasks[p]
                if S.status[i] in (st.READY, st.RUNNING) and P.tasks[i].step == step), default=0.0)


def keeping(P: Problem, S: State, ctx: Context, x: int, y: int, points: list[PairPoint],
             sm_x: float) -> list[PairPoint]:
    """The memory splits that keep the deadlines of x's and y's steps (each at its pace here,
    the rest of its step alone after it), else those that end the later of them least late:
    a split is an SLO's constraint as much as the choice of a partner is."""
    d = next(dd for dd in P.tasks[x].devices if S.dev[dd] and S.dev[dd][0] == y)

    def late(pt: PairPoint) -> float:
        out, end_x, end_y = 0.0, S.now_s + pt[1] * S.rem_s[x], S.now_s + pt[2] * S.rem_s[y]
        for i, j, end_i, end_j, share in ((x, y, end_x, end_y, (sm_x, pt[0], pt[1], pt[2])),
                                          (y, x, end_y, end_x, (1.0 - sm_x, 1.0 - pt[0], pt[2], pt[1]))):
            if i in S.watch:
                t = P.tasks[i]
                v = _tail_end(P, ctx, i, j, d, end_i, end_j, share, t.step_tail_s)
                out += max(0.0, v - ctx.slo[t.pipe][1])
        return out
    scored = [(late(pt), pt) for pt in points]
    least = min((v for v, _ in scored), default=0.0)
    return [pt for v, pt in scored if v <= least + TOLERANCE_S]


def lateness(P: Problem, S: State, slo: dict, held: dict[int, float], run_end: dict[int, float],
              step_end: dict[int, float] | None, ctx: Context) -> float:
    """Σ of how late each deadline's step ends: its latest task (ended in the search, or at
    `held`'s end plus the chain left in its step, `_chain_end`); and how late the next step
    ends past its own SLO after that, where a partner outlasting this step slows it (the
    next step's deadline is not set before it begins, but what runs beside this step's end
    is decided now)."""
    ends = {p: S.slo_end[p] for p in slo}
    nexts = dict.fromkeys(slo, -float("inf"))
    tasks = P.tasks
    for i, end in held.items():
        task = tasks[i]
        p = task.pipe
        v = _chain_end(P, S, ctx, i, end, run_end, task.step_tail_s) if task.step_tail_s > 0.0 else end
        if v > ends[p]:
            ends[p] = v
        more = slo[p][2]
        if more > 0.0 and (w := _chain_end(P, S, ctx, i, end, run_end, task.step_tail_s + more)) > nexts[p]:
            nexts[p] = w
    if step_end is not None:
        step_end.update(ends)
    late = 0.0
    for p, (_, deadline, more, slo_slowdown) in slo.items():
        late += max(0.0, ends[p] - deadline) + max(0.0, nexts[p] - ends[p] - slo_slowdown * more)
    return late


def _chain_end(P: Problem, S: State, ctx: Context, i: int, end: float, run_end: dict[int, float],
               tail: float) -> float:
    """When `tail` exclusive seconds of its pipeline's work after task i end if they follow i
    at once: at exclusive speed, but beside the other pipeline's running partner of i for as
    long as that partner outlasts i, at the slowdown i's next piece has beside it on i's
    share (that work cannot have the device to itself before the partner is done, nor more
    of its memory; the critical path alone would call a deadline kept that the partner's
    long piece breaks)."""
    worst = end + tail
    for d in P.tasks[i].devices:
        occ = S.dev[d]
        if len(occ) < 2:
            continue
        j = occ[1] if occ[0] == i else occ[0]
        v = _tail_end(P, ctx, i, j, d, end, run_end.get(j, end), (*S.split[(i, d)], S.split[(j, d)].slowdown), tail)
        if v > worst:
            worst = v
    return worst


def _tail_end(P: Problem, ctx: Context, i: int, j: int, d: int, end_i: float, end_j: float,
              share: tuple[float, float, float, float], tail: float) -> float:
    """`_chain_end` on device d: i (at `share` = SM, memory, slowdown, j's slowdown) ends at
    end_i beside j ending at end_j (a rollout: once the regimes that continue it end, at its
    pace now); i's next piece there runs on i's share beside j until then, or waits for j
    where it fits beside j at no share."""
    end_j += _rollout_left_s(P, j, d) * share[3]
    overlap_s = end_j - end_i
    if overlap_s <= 0.0:
        return end_i + tail
    s = share[2]
    nxt = next((k for k in P.tasks[i].succs if d in P.tasks[k].devices), None)
    if nxt is not None and not any(ctx.feasible(P, nxt, j, b) for b in ctx.sm_budgets_frac):
        return end_j + tail  # it cannot join j at any share (memory): it waits for j
    if nxt is not None and (got := ctx.grid_pair(P, nxt, j, share[0], share[1])) is not None:
        s = max(s, got[0])
    if s <= 1.0:
        return end_i + tail
    return end_i + tail * s if tail * s <= overlap_s else end_i + overlap_s + tail - overlap_s / s


def _rollout_left_s(P: Problem, j: int, d: int) -> float:
    """Exclusive time of the rollout pieces that continue rollout piece j on device d (a
    rollout worker's next regime starts the moment j ends: it keeps the device's place)."""
    left, tasks = 0.0, P.tasks
    while P.kinds[j].startswith("rollout"):
        j = next((k for k in tasks[j].succs if P.kinds[k].startswith("rollout") and d in tasks[k].devices), -1)
        if j < 0:
            break
        left += tasks[j].excl_s
    return left
