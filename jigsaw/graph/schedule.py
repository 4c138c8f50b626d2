"""Windowed critical-path look-ahead scheduler (paper §4.4): a pure function to a `Plan`.

    schedule(pipelines, node, model, config, time_s)
      │ Problem (tasks, deps, tails)  +  State at time_s
      ▼
      loop while a choice is open at time_s:
        best = search(state, W)       try every option of the open choice; after each,
        │                             run forward to the next choice (forced moves and
        │                             completions included) and recurse, W choices deep;
        │                             score the leaf by the critical path  C = max_p Σ T
        │  or, with ≤ end_game_tasks device tasks left:
        best = play_out(state, Ws)    each option played to the end by `search` at every
        │                             later choice, at each depth of Ws (W and W + 1 by
        │                             default: solved once per run, so it may look deeper);
        │                             the earliest makespan reached decides
        apply(best first option)      commit only what happens now (receding horizon)
      ▼
    Plan: assignments per device (SM share, memory, slowdown, micro-batch), migrations,
          routing weights, predicted cost

W = 1 is the greedy variant: each choice minimises the critical path right after it,
blind to a co-location it forecloses a few moves later (paper Fig. 11).  The window is as
blind to the end game: which pipeline's training can still hide under the other's rollout,
and which must run last, alone (issue 32); playing the few last tasks out sees it.  No I/O, no
clock: the same inputs always give the same Plan, so the runtime and the simulator
share it.
"""

from __future__ import annotations

import gc
from collections.abc import Mapping, Sequence
from contextlib import contextmanager

from jigsaw.graph import actions as act
from jigsaw.graph import deadlines as dl
from jigsaw.graph import state as st
from jigsaw.graph.merge import balance
from jigsaw.graph.model import PairModels, SlowdownModel
from jigsaw.graph.plan import Assignment, Migration, NodeSpec, PipelineState, Plan, Routing, SchedulerConfig
from jigsaw.graph.problem import Problem, SchedulerCache
from jigsaw.graph.slo import TOLERANCE_S, SloForecast
from jigsaw.graph.state import State

_TIE = 1e-9  # relative: options whose costs differ less are equal; the earlier one wins


def schedule(pipelines: Sequence[PipelineState], node: NodeSpec, model: SlowdownModel,
             config: SchedulerConfig = SchedulerConfig(), time_s: float = 0.0,
             cache: SchedulerCache | None = None, pairs: PairModels | None = None,
             host_frac: Mapping[int, float] | None = None, end_game: EndGame | None = None) -> Plan:
    """Decide what runs on every device from `time_s` on.

    `model`: the node's slowdown grid (graph/model.py says what it answers; a
    `jigsaw.mux.model.slowdown.SlowdownGrid` does).  `cache` keeps lookup tables and task tables
    between calls on one node (the same Plan with or without it).  `pairs`
    (jigsaw.mux.model.pairing.PairGrids): the exact grid of two pipelines running different
    models, by name; co-locations are planned with it, the rest with `model`.
    `host_frac`: per device, the share of its pipelines working on the host (View.host_frac).
    `end_game`: the line the last play-out chose (EndGame), followed where this call's
    choices lie on it, and replaced by this call's play-outs; None: every end-game choice is
    played out."""
    with _collector_paused():
        return _schedule(pipelines, node, model, config, time_s, cache, pairs, host_frac, end_game)


@contextmanager
def _collector_paused():
    """The search allocates tens of thousands of short-lived tuples and states, none in a
    reference cycle (reference counting frees them): the cyclic collector's passes, which
    they would trigger, wait until the plan is out (10% of a decision's time at 2 × 8 DP)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _schedule(pipelines, node, model, config, time_s, cache, pairs, host_frac, end_game) -> Plan:
    cache = cache or SchedulerCache()
    if len(pipelines) < 1:
        raise ValueError("schedule needs at least one pipeline")
    names = [ps.graph.pipeline for ps in pipelines]
    if len(set(names)) != len(names):
        raise ValueError(f"pipeline names must be unique, got {names}")
    links = tuple(edge for ps in pipelines for edge in ps.waits_for)
    P = cache.problem(tuple((ps.graph, tuple(ps.devices)) for ps in pipelines), node, links)
    ctx = act.Context(model, config, node, cache, pipelines, pairs, host_frac)
    S = act.initial(P, pipelines, time_s, ctx)
    before = set(S.running)
    late = 0 < _device_tasks_left(P, S, config.end_game_tasks + 1) <= config.end_game_tasks
    while (dec := act.settle(P, S, ctx, advance_time=False)) is not None:
        if not late:
            option = search(P, S, ctx, config.window, dec)[1]
        elif end_game is None:
            option = play_out(P, S, ctx, config.end_game_depths, dec)[1]
        elif (option := end_game.follow(P, S, dec, ctx.deadlines)) is None:
            end_game.solve(P, S, ctx, config.end_game_depths, dec)
            option = end_game.follow(P, S, dec, ctx.deadlines)
        act.apply(P, S, ctx, dec[0], option)
    return _plan(P, S, ctx, before)


class EndGame:
    """The end game solved once, as the line of every choice left (owned by whoever calls the
    scheduler on one node: a policy), and followed while the run stays on it.

    Without it each end-game choice is played out when it comes (`play_out`: every option
    played to the end by the window).  With it, the first end-game choice of a run plays out
    that choice and every later one along the winner's way, each as a call at that point
    would (the state then has the call's fresh marks and packing), and keeps the line; a
    later call whose choice is on the line (the same Problem, time and item, the option still
    offered) takes the line's option.  The end game's ten or so play-outs then cost one call,
    not ten; where the run leaves the line (a sub-stage ending at another time than
    predicted, another choice open) the rest is solved again from there.  A plan then depends
    on an earlier call's line, as a baseline's turn does."""

    __slots__ = ("problem", "line", "deadlines")

    def __init__(self) -> None:
        self.problem: Problem | None = None
        self.line: list[act.Logged] = []
        self.deadlines: dict = {}
        """The SLO deadlines the line was solved under (a new step's deadline is another game)."""

    def follow(self, P: Problem, S: State, dec, deadlines: dict | None = None) -> act.Option | None:
        """The line's option for `dec` at S, or None where S is off the line (or the deadlines
        it was solved under have changed)."""
        if P is not self.problem or (deadlines or {}) != self.deadlines:
            return None
        item, options = dec
        tol = _TIE * max(1.0, S.now_s)
        for logged in self.line:
            if logged.item == item and abs(logged.time_s - S.now_s) <= tol:
                return logged.option if logged.option in options else None
        return None

    def solve(self, P: Problem, S: State, ctx: act.Context, depths: tuple[int, ...], dec) -> None:
        """The line from S: each choice played out, applied, and the run advanced to the next."""
        line, T, pack = [], S.copy(history=False), ctx.pack
        try:
            while dec is not None:
                option = play_out(P, T, ctx, depths, dec)[1]
                line.append(act.Logged(T.now_s, dec[0], option))
                act.apply(P, T, ctx, dec[0], option)
                dec = act.settle(P, T, ctx, advance_time=False)
                while dec is None and T.running:
                    st.advance(P, T, ctx.balanced)
                    T.touched.update(range(P.num_devices))  # what a call at this point starts from
                    if ctx.bound_weight > 0.0:
                        ctx.pack = act.packing(P, T, ctx)
                    dec = act.settle(P, T, ctx, advance_time=False)
        finally:
            ctx.pack = pack
        self.problem, self.line, self.deadlines = P, line, dict(ctx.deadlines)


def search(P: Problem, S: State, ctx: act.Context, depth: int, dec,
           root: bool = True) -> tuple[tuple[float, ...], tuple]:
    """Best option of the open choice `dec` with `depth` choices of look-ahead.

    Every option of the root choice is tried; inside the window the SM share of a
    co-location is fixed by `local_split` and only the kind of move branches."""
    item, options = dec
    if not root:
        options = act.local_split(P, S, ctx, item, options)
    best_cost, best_opt = None, options[0]
    for opt in options:
        c = _window_value(P, S, ctx, depth, item, opt)
        if best_cost is None or _better(c, best_cost):
            best_cost, best_opt = c, opt
    return best_cost, best_opt


def play_out(P: Problem, S: State, ctx: act.Context, depths: tuple[int, ...], dec) -> tuple[tuple[float, ...], tuple]:
    """Best option of `dec` by the makespan reached when the rest of the run is decided by
    `search` (the window's choice at every later decision), at each of `depths`: an option is
    worth the earliest end any of them reaches; the window's own value (at `depths[0]`)
    breaks ties.

    Options are played in the window's order, and a play is dropped once the lower bound of
    where it stands cannot beat the best makespan found: that prunes, never changes, the answer
    (a dropped play could at best tie)."""
    item, options = dec
    ranked = sorted(((_window_value(P, S, ctx, depths[0], item, o), k) for k, o in enumerate(options)))
    best_cost, best_opt = None, options[0]
    for depth in depths:  # the shallow plays first: the makespan they find cuts the deeper ones
        for first, k in ranked:
            c = _played(P, _after(P, S, ctx, item, options[k]), ctx, depth, first, best_cost)
            if c is not None and (best_cost is None or _better(c, best_cost)):
                best_cost, best_opt = c, options[k]
    return best_cost, best_opt


def _played(P: Problem, branch: State, ctx: act.Context, depth: int, first: tuple[float, ...],
            best: tuple[float, ...] | None) -> tuple[float, ...] | None:
    """The value of playing `branch` to the end with the window at `depth` (its makespan, then
    `first`), or None once its lower bound says it cannot beat `best`."""
    # A makespan bound cannot cut a play valued by its SLO lateness first.
    cut = best[0] if best is not None and ctx.slo is None else None
    while (nxt := act.settle(P, branch, ctx, advance_time=True)) is not None:
        # the call's packing (the bound's input) exists only where the leaf blends the bound
        if cut is not None and ctx.bound_weight > 0.0 and \
                act.lower_bound(P, branch, ctx.min_slowdown, ctx.pack) > cut * (1 + _TIE):
            return None
        act.apply(P, branch, ctx, nxt[0], search(P, branch, ctx, depth, nxt)[1])
    c = (max(branch.end_s), *first)
    return c if ctx.slo is None else (act.cost(P, branch, ctx.slo, ctx=ctx)[0], *c)


def _after(P: Problem, S: State, ctx: act.Context, item, option) -> State:
    branch = S.copy(history=False)
    act.apply(P, branch, ctx, item, option)
    return branch


def _window_value(P: Problem, S: State, ctx: act.Context, depth: int, item, option) -> tuple[float, ...]:
    """What `search` values `option` at: its window below, or its leaf."""
    branch = _after(P, S, ctx, item, option)
    nxt = act.settle(P, branch, ctx, advance_time=True) if depth > 1 else None
    return search(P, branch, ctx, depth - 1, nxt, False)[0] if nxt is not None else act.score(P, branch, ctx)


def _device_tasks_left(P: Problem, S: State, enough: int) -> int:
    """Device tasks not done, counted up to `enough` (from the end: a pipeline's done tasks are
    its first ones)."""
    left, status, tasks = 0, S.status, P.tasks
    for i in range(len(status) - 1, -1, -1):
        if status[i] != st.DONE and tasks[i].devices:
            left += 1
            if left >= enough:
                break
    return left


def _better(a: tuple[float, ...], b: tuple[float, ...]) -> bool:
    """Lexicographic comparison where differences below a relative tolerance are ties."""
    tol = _TIE * max(1.0, abs(b[0]))
    for x, y in zip(a, b):
        if x < y - tol:
            return True
        if x > y + tol:
            return False
    return False


# ---------------------------------------------------------------- plan

def _plan(P: Problem, S: State, ctx: act.Context, before: set[int]) -> Plan:
    # A tail merged away in the same plan never runs: its requests go to the target.
    started = tuple(sid for i in S.started if i not in before and S.status[i] == st.RUNNING
                    for sid in P.tasks[i].ids)
    return Plan(
        time_s=S.now_s, started=started, assignments=assignments(P, S, ctx),
        migrations=_migrations(P, S), routing=_routing(P, S, ctx),
        cost_s=act.cost(P, S)[0], decisions=tuple(_describe(P, item, opt) for _, item, opt in S.log),
        slo=_slo(P, S, ctx),
    )


def _slo(P: Problem, S: State, ctx: act.Context) -> tuple[SloForecast, ...]:
    """Each deadline's predicted step end after this plan, and why one given up is."""
    if not ctx.deadlines:
        return ()
    ends: dict[int, float] = {}
    all_held = dict(ctx.deadlines)
    T = S.copy(history=False)  # the given-up ones' ends too, on the same path (no time passed in the call)
    dl.watch(P, T, all_held)
    act.cost(P, T, all_held, ends, ctx)
    kept = {p for p, (_, deadline, *_) in all_held.items()
            if p not in ctx.given_up and ends[p] <= deadline + TOLERANCE_S}
    out = []
    for p, (step, deadline, *_) in sorted(all_held.items()):
        why = "" if p in kept else ctx.given_up.get(p) or _given_up([P.names[q] for q in sorted(kept)])
        out.append(SloForecast(pipeline=P.names[p], step=step, deadline_s=deadline,
                               predicted_end_s=max(ends[p], S.now_s), kept=p in kept, reason=why))
    return tuple(out)


def _given_up(kept: list[str]) -> str:
    if kept:
        return f"given up for the SLO of {', '.join(kept)}: no option in the look-ahead keeps all of them"
    return ("given up: the devices are held by work already running; every option in the look-ahead ends "
            "its step late")


def assignments(P: Problem, S: State, ctx: act.Context) -> tuple[Assignment, ...]:
    """Every replica on a device in S as the Plan grants it (also replays exact schedules)."""
    micro: dict[int, tuple[int, ...] | None] = {}  # per gang, balanced once: not once per replica
    out = []
    for d in range(P.num_devices):
        for i in S.dev[d]:
            task = P.tasks[i]
            if i not in micro:
                micro[i] = _balanced(P, S, ctx, i)
            k = task.devices.index(d) if len(task.devices) > 1 else 0
            sm, mem, s = S.split[(i, d)]
            out.append(Assignment(substage=task.ids[k], pipeline=P.names[task.pipe], device=d, sm_frac=sm,
                                  mem_bytes=int(mem * P.mem_bytes), slowdown=s,
                                  micro_batch=None if micro[i] is None else micro[i][k]))
    return tuple(out)


def _balanced(P: Problem, S: State, ctx: act.Context, i: int) -> tuple[int, ...] | None:
    """Per replica of a lockstep gang, its micro-batch skewed towards the faster replicas
    (None: a single replica, or uniform slowdowns, which keep the pipeline's own split)."""
    task = P.tasks[i]
    if len(task.devices) < 2 or not ctx.balanced or task.batch_size <= 0:
        return None
    slow = [S.split[(i, dd)].slowdown for dd in task.devices]
    if max(slow) <= min(slow):
        return None
    sizes = balance(round(task.batch_size), slow).batch_sizes
    # Every FSDP rank must run a micro-batch: too few samples to skew keep the even split.
    return None if min(sizes) < 1 else tuple(sizes)


def _migrations(P: Problem, S: State) -> tuple[Migration, ...]:
    out = []
    for _, item, opt in S.log:
        if type(item) is not act.Tails or opt.verb is not act.Verb.MERGE:
            continue
        decision, tails = opt.merge, opt.tails
        by_rank = {P.tasks[i].ranks[0]: P.tasks[i] for i in tails}
        tgt = by_rank[decision.target_rank]
        for r in decision.source_ranks:
            out.append(Migration(pipeline=P.names[tgt.pipe], source=by_rank[r].ids[0], target=tgt.ids[0],
                                 source_rank=r, target_rank=decision.target_rank, delta_s=decision.delta_s,
                                 target_remaining_s=decision.aggregated_s))
    return tuple(out)


def _routing(P: Problem, S: State, ctx: act.Context) -> tuple[Routing, ...]:
    """Rollout routing weights ∝ 1/s of each worker's rollout replica (§2.7)."""
    if not ctx.balanced:
        return ()
    by_pipe: list[dict[int, float]] = [{} for _ in P.names]  # per pipeline: rank -> its rollout's slowdown
    for i in sorted(S.running):
        task = P.tasks[i]
        if task.kind.startswith("rollout") and task.devices:
            by_pipe[task.pipe][task.ranks[0]] = S.split[(i, task.devices[0])].slowdown
    out = []
    for name, slow in zip(P.names, by_pipe):
        if len(slow) > 1 and any(v != 1.0 for v in slow.values()):
            # Exclusive time is linear in requests routed, so equal finish times need w ∝ 1/s.
            norm = sum(1.0 / v for v in slow.values())
            full = [0.0] * (max(slow) + 1)
            for r, v in slow.items():
                full[r] = 1.0 / v / norm
            out.append(Routing(pipeline=name, weights=tuple(full)))
    return tuple(out)


def _describe(P: Problem, item: act.Item, opt: act.Option) -> str:
    if type(item) is act.Tails:
        if opt.verb is not act.Verb.MERGE:
            return f"{P.names[item.pipe]}: keep tails in place"
        d = opt.merge
        return f"{P.names[item.pipe]}: merge tails of ranks {list(d.source_ranks)} into rank {d.target_rank} " \
               f"(ΔT={d.delta_s:.3g}s)"
    head = f"{P.names[item.pipe]}:{item.kind}×{len(item.tasks)}"
    if opt.verb is act.Verb.START:
        return f"{head} start" + ("" if opt.sm_frac is None else f" beside partner at {opt.sm_frac:.0%} SMs")
    return f"{head} {opt.verb.value}"
