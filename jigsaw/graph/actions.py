"""The scheduler's action space and cost: what can be decided, and what it costs.

    State ─► next_decision() ─► (item, options)          one open choice at this time point
                 item   = Group(pipe, kind, tasks)        ready replicas of one kind
                        | Tails(pipe)                     long tails on several workers
                 option = Option(START, σ)    join the running partner with SM share σ
                        | Option(START)       start on idle devices only
                        | Option(SOLO)        start alone and keep the devices to itself
                        | Option(DEFER)       wait for the next completion
                        | Option(MERGE, decision, tails) | Option(KEEP)
    apply(item, option) mutates the State;  settle() applies forced moves (and, if
    asked, advances time) until a real choice is open;  cost() is the critical path (with
    SLO deadlines, their lateness first: deadlines.py).

Actions are per (pipeline, kind), not per device: the replicas of a sub-stage kind on
all DP workers are multiplexed the same way, which keeps the branching factor
independent of the DP degree.  Schedules are non-delay: an idle device is never
kept idle while a ready replica could use it alone.  The options and the per-call slowdown
lookups (`Context`) are in context.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from jigsaw.graph import deadlines as dl
from jigsaw.graph import state as st
from jigsaw.graph.context import Context, Option, Packing, PairPoint, Verb  # noqa: F401 (act.Context, act.Verb for the search)
from jigsaw.graph.merge import DecodeFit, MergeDecision, TailWorker, best_merge, steps_in
from jigsaw.graph.plan import PipelineState
from jigsaw.graph.problem import Problem
from jigsaw.graph.state import Split, State


class Group(NamedTuple):
    """An open choice: how the ready replicas of one kind of one pipeline start."""

    pipe: int
    kind: str
    tasks: tuple[int, ...]


class Tails(NamedTuple):
    """An open choice: whether one pipeline's long tails move onto one worker."""

    pipe: int


Item = Group | Tails


START_IDLE, SOLO, DEFER, KEEP = Option(Verb.START), Option(Verb.SOLO), Option(Verb.DEFER), Option(Verb.KEEP)
NO_ROOM = Option(Verb.NO_ROOM)
"""Logged (never offered) when a start left every replica of its group waiting."""
_START, _SOLO, _DEFER, _MERGE = Verb.START, Verb.SOLO, Verb.DEFER, Verb.MERGE  # bound once: the search is hot
_new = tuple.__new__
"""Builds a NamedTuple without its Python-level __new__: the search makes thousands per decision."""


class Logged(NamedTuple):
    time_s: float
    item: Item
    option: Option


def initial(P: Problem, pipelines: Sequence[PipelineState], time_s: float, ctx: Context) -> State:
    """State at `time_s` with the slowdowns of already running pairs looked up."""
    S = st.initial_state(P, pipelines, time_s, ctx.balanced, ctx.solo, ctx.capped, rates=False)
    if ctx.slo is not None:
        dl.hold(P, S, ctx)
    ctx.elastic = frozenset(i for i in S.urgent if P.kinds[i].startswith("rollout"))
    for d, tasks in enumerate(S.dev):
        if len(tasks) == 2:
            a, b = tasks
            sa, sb = S.split[(a, d)], S.split[(b, d)]
            pair = ctx.grid_pair(P, a, b, sa.sm_frac, sa.mem_frac)
            if pair is None:
                raise ValueError(f"running pair on device {d} is infeasible under the slowdown grid")
            S.split[(a, d)] = Split(sa.sm_frac, sa.mem_frac, pair[0])
            S.split[(b, d)] = Split(sb.sm_frac, sb.mem_frac, pair[1])
        elif len(tasks) == 1:
            S.split[(tasks[0], d)] = st.alone(S, P.kinds[tasks[0]], d)  # the partner is gone
    for i in S.running:
        st.refresh_rate(P, S, i, ctx.balanced)
    if ctx.bound_weight > 0.0:  # only the leaf's bound reads it
        ctx.pack = packing(P, S, ctx)
    return S


# ---------------------------------------------------------------- decisions

def next_decision(P: Problem, S: State, ctx: Context) -> tuple[Item, list[Option]] | None:
    found: dict[tuple[int, str], list[int]] = {}
    claimed: set[tuple[int, int]] = set()
    deferred, closed, held, dev, tasks, kinds = S.deferred, S.closed, S.held, S.dev, P.tasks, P.kinds
    lone = _lone_devices(P, S) if S.alone else None
    for i in sorted(S.ready if len(S.ready) <= _FEW_READY else _placeable(P, S)):
        if i in deferred or (lone is not None and _held_back(P, S, i, lone)):
            continue
        task = tasks[i]
        devs = task.devices
        if not devs:
            continue
        pipe = task.pipe
        for d in devs:  # written out: this runs for every ready task at every search node
            if d in closed or (st.places_taken(P, S, i, d) if held[d] else len(dev[d])) >= 2 or (pipe, d) in claimed:
                break
        else:
            key = (pipe, kinds[i])
            group = found.get(key)
            if group is None:
                found[key] = [i]
            else:
                group.append(i)
            # A worker runs one piece at a time: a later piece of its own that live reports
            # made ready too (a next step's, before this one started) waits for the next decision.
            claimed.update((pipe, d) for d in devs)
    groups = _Groups(P, S, ctx, found)
    # Urgent groups first: they are already on their devices, nothing may take them.
    urgent = S.urgent
    order = sorted(found, key=lambda k: (not any(i in urgent for i in found[k]), k)) if urgent else sorted(found)
    for key in order:
        if groups[key]:
            opts = _group_options(P, S, ctx, key, groups)
            if opts:
                return _new(Group, (key[0], key[1], tuple(groups[key]))), opts
    if ctx.config.merge:
        return _merge_decision(P, S, ctx)
    return None


_FEW_READY = 16
"""Above this many ready tasks, those on full devices are set aside in C first (`_placeable`):
at a step barrier of 64 DP workers a hundred wait, and the search looks at them after every
completion."""


def _placeable(P: Problem, S: State) -> set[int]:
    """The ready tasks next_decision's device test can pass: gangs (tested device by device),
    and single-device tasks whose device runs fewer than two (a full one fails the test)."""
    ready = S.ready
    out = ready.intersection(P.gangs)
    for d, occ in enumerate(S.dev):
        if len(occ) < 2:
            out.update(ready.intersection(P.singles_on[d]))
    return out


class _Groups:
    """Ready tasks by (pipeline, kind) that have places on their devices, less those that
    would leave a continuing rollout no room (`leaves_room`), checked only for the groups a
    decision looks at: most searches stop at the first group with options."""

    __slots__ = ("P", "S", "ctx", "found", "done")

    def __init__(self, P: Problem, S: State, ctx: Context, found: dict[tuple[int, str], list[int]]):
        self.P, self.S, self.ctx, self.found, self.done = P, S, ctx, found, {}

    def __getitem__(self, key: tuple[int, str]) -> list[int]:
        got = self.done.get(key)
        if got is None:
            P, S, ctx = self.P, self.S, self.ctx
            got = self.done[key] = [i for i in self.found[key] if i in S.urgent or i in S.alone or all(
                leaves_room(P, S, ctx, i, d) for d in P.tasks[i].devices)]
        return got



def _lone_devices(P: Problem, S: State) -> set[int]:
    """Devices of the probes that wait or run (PipelineState.alone)."""
    status = S.status
    return {d for i in S.alone if status[i] == st.READY or status[i] == st.RUNNING for d in P.tasks[i].devices}


def _held_back(P: Problem, S: State, i: int, lone: set[int]) -> bool:
    """Ready task i may not start now: a probe whose devices are not its own yet (something
    runs there, another pipeline holds a place, or an urgent piece of one is ready), or a task
    on a probe's devices.  Urgent pieces start whatever (a running rollout cannot pause; an
    aged one waited enough)."""
    if i in S.urgent:
        return False
    devs = P.tasks[i].devices
    if i not in S.alone:
        return any(d in lone for d in devs)
    if any(st.places_taken(P, S, i, d) for d in devs):
        return True
    pipe, tasks = P.tasks[i].pipe, P.tasks
    return any(tasks[j].pipe != pipe and S.status[j] == st.READY and not set(devs).isdisjoint(tasks[j].devices)
               for j in S.urgent)


def _group_options(P: Problem, S: State, ctx: Context, key: tuple[int, str], groups) -> list[Option]:
    members = groups[key]
    busy = [i for i in members if any(S.dev[d] for d in P.tasks[i].devices)]
    if S.alone and not busy and not S.alone.isdisjoint(members):
        return [START_IDLE]  # a probe on its emptied devices: nothing to decide
    idle_devs = {d for i in members if i not in busy for d in P.tasks[i].devices}
    joinable = [i for i in busy if _joinable(P, S, ctx, i)]
    opts = [ctx.start_beside[b] for b in ctx.sm_budgets_frac if any(_fits(P, S, ctx, i, b) for i in joinable)]
    stuck = [i for i in busy if i in S.urgent]
    if stuck:  # continuing rollouts beside a partner: they join it, only the share is a choice
        return [o for o in opts if all(_fits(P, S, ctx, i, o.sm_frac) for i in stuck)] or opts or [START_IDLE]
    if any(i in S.urgent for i in members):  # continuing on idle devices: nothing to choose
        return opts + [START_IDLE] if idle_devs or not opts else opts
    # Keeping the devices to itself, or yielding them, only differs from starting if
    # another group could use them now (a schedule never leaves a device idle).
    rivals = bool(idle_devs) and _rivals(P, groups, key, idle_devs)
    if idle_devs:
        opts.append(START_IDLE)
        if rivals:
            opts.append(SOLO)
    if rivals or (busy and not idle_devs):
        opts.append(DEFER)
    return opts


def _rivals(P: Problem, groups: _Groups, key: tuple[int, str], idle_devs: set[int]) -> bool:
    """Could another group start on one of these idle devices now?  Only the groups whose
    ready tasks are there are filtered for room (the filter is the costly part)."""
    tasks = P.tasks
    for k, ready in groups.found.items():
        if k != key and any(idle_devs.intersection(tasks[j].devices) for j in ready):
            if any(idle_devs.intersection(tasks[j].devices) for j in groups[k]):
                return True
    return False


def leaves_room(P: Problem, S: State, ctx: Context, i: int, d: int) -> bool:
    """May task i take a place on device d, given the rollouts of other pipelines there
    that continue?  A worker waiting on a tool, or running a rollout piece with more to
    come, keeps its engine and its requests' KV cache on d and goes on the moment it can:
    i must leave room for its next rollout piece to run beside i (a grid split fits both)."""
    held, on = S.held[d], S.dev[d]
    if not held and not on:
        return True
    return ctx.leaves_room(P, i, d, held + on)


def _joinable(P: Problem, S: State, ctx: Context, i: int) -> bool:
    """May ready task i start beside what runs on its devices? (complementary, or urgent)"""
    if i in S.urgent or ctx.min_pack_efficiency <= 1.0:  # the filter off (the default): any pair may form
        return True
    for d in P.tasks[i].devices:
        if S.dev[d]:
            j = S.dev[d][0]
            if not ctx.complementary(P.dominant[i], P.dominant[j], P.tasks[i].pipe, P.tasks[j].pipe):
                return False
    return True


def _fits(P: Problem, S: State, ctx: Context, i: int, sm: float) -> bool:
    return all(ctx.feasible(P, i, S.dev[d][0], sm) for d in P.tasks[i].devices if S.dev[d])


def _best_split(P: Problem, S: State, ctx: Context, x: int, y: int, sm_x: float) -> PairPoint | None:
    """Memory split for X (share sm_x) beside Y minimising the later of their ends; on a
    tie, the earlier other end (a point no other point beats on both slowdowns)."""
    rx, ry = S.rem_s[x], S.rem_s[y]
    best, best_key = None, None
    points = ctx.feasible(P, x, y, sm_x)
    if S.watch and (x in S.watch or y in S.watch):
        points = dl.keeping(P, S, ctx, x, y, points, sm_x)
    alone = _single_device(P, x, y)
    for pt in points:
        ex, ey = _pair_ends(pt, rx, ry, alone)
        key = (ex, ey) if ex >= ey else (ey, ex)
        if best_key is None or _earlier(key, best_key):
            best, best_key = pt, key
    return best


def _single_device(P: Problem, x: int, y: int) -> bool:
    """Do tasks x and y both run on one device only (so the one left runs alone there)?"""
    return len(P.tasks[x].devices) == 1 and len(P.tasks[y].devices) == 1


def _pair_ends(pt: PairPoint, rx: float, ry: float, alone: bool) -> tuple[float, float]:
    """When X and Y (rx, ry exclusive seconds left) end beside each other at point pt; with
    `alone` (both on this device only), the one left runs alone once the other ends, as
    `cost` counts it.  Without that, a split that starves the shorter side (a decode on a
    sliver of KV memory, slowdown 3) looks better for the longer than an even one, though
    the two then clear less work than either alone."""
    ex, ey = pt[1] * rx, pt[2] * ry  # pt.slowdown, pt.partner_slowdown (indexed: hot)
    if alone:
        if ex < ey:
            ey = ex + ry - ex / pt[2]
        else:
            ex = ey + rx - ey / pt[1]
    return ex, ey


def _earlier(a: tuple[float, float], b: tuple[float, float]) -> bool:
    """(later end, other end) pairs: is `a` strictly better, ties within 1e-9 relative?"""
    tol = 1e-9 * max(1.0, b[0])
    return a[0] < b[0] - tol or (a[0] <= b[0] + tol and a[1] < b[1] - tol)


def local_split(P: Problem, S: State, ctx: Context, item: Item, options: list[Option]) -> list[Option]:
    """Keep one SM share among the Option(START, σ) options: the one whose new pairs end
    soonest (the memory-split rule applied to σ).  Used inside the window, below the
    choice being decided, where trying every share triples the search for little gain."""
    shares = [o for o in options if o.verb is _START and o.sm_frac is not None]
    if len(shares) < 2:
        return options
    best, best_key = None, None
    for opt in shares:
        late, total = 0.0, 0.0
        for i in item.tasks:
            for d in P.tasks[i].devices:
                if S.dev[d]:
                    y = S.dev[d][0]
                    pt = _best_split(P, S, ctx, i, y, opt[1])
                    if pt is not None:
                        ex, ey = _pair_ends(pt, S.rem_s[i], S.rem_s[y], _single_device(P, i, y))
                        late, total = max(late, ex, ey), total + ex + ey
        if best_key is None or _earlier((late, total), best_key):
            best, best_key = opt, (late, total)
    return [o for o in options if o is best or not (o.verb is _START and o.sm_frac is not None)]


def _merge_decision(P: Problem, S: State, ctx: Context) -> tuple[Item, list[Option]] | None:
    for p in range(len(P.names)):
        if ctx.multi_turn[p]:
            continue
        key = _new(Tails, (p,))
        if key in S.deferred:
            continue
        tails = sorted(S.running.intersection(P.mergeable[p]))  # in C: this runs after every event
        if len(tails) < 2 or S.touched.isdisjoint(map(P.first_device.__getitem__, tails)):
            continue
        decision = _best_merge(P, S, ctx, tails)
        if decision is not None:
            return key, [_new(Option, (Verb.MERGE, None, decision, tuple(tails))), KEEP]
    return None


def _best_merge(P: Problem, S: State, ctx: Context, tails: list[int]):
    # Only tails whose engine reports requests and a step count can be priced (a cold
    # prediction, or a worker between requests, says neither).
    tails = [i for i in tails if P.tasks[i].batch_size > 0 and P.tasks[i].num_steps > 1]
    if len(tails) < 2:
        return None
    fpt = max(P.tasks[i].flops_per_token for i in tails)
    if fpt <= 0.0:
        return None  # FLOPs of the migrated context unknown: the recompute cannot be costed
    pipe = P.tasks[tails[0]].pipe
    known = ctx.prefill_work[pipe] if pipe < len(ctx.prefill_work) else None
    cfg = ctx.merge_config(*(known if known is not None else P.prefill_work[pipe]))
    merged = S.merged
    if sum(merged[i][0] if i in merged else P.tasks[i].batch_size for i in tails) > cfg.max_merged_batch:
        return None  # best_merge's own first test, before the workers are priced (hot in the window)
    decode = _decode(P, ctx, pipe)
    workers = [_tail_worker(P, S, i, decode) for i in tails]
    return best_merge(workers, flops_per_token=fpt, peak_flops=ctx.peak_flops, config=cfg, decode=decode)


def _decode(P: Problem, ctx: Context, pipe: int) -> DecodeFit | None:
    return ctx.decode[pipe] if pipe < len(ctx.decode) and ctx.decode[pipe] is not None else P.decode[pipe]


def _tail_worker(P: Problem, S: State, i: int, decode: DecodeFit | None) -> TailWorker:
    """Task i's tail as the merge test sees it; a target of an earlier merge in this search
    holds the requests it received (S.merged), so moving it on is priced as what it is."""
    task, d = P.tasks[i], P.tasks[i].devices[0]
    partners = [j for j in S.dev[d] if j != i]
    batch, context, steps, excl_s = S.merged.get(i) or (task.batch_size, task.context_tokens, task.num_steps,
                                                          task.excl_s)
    left = steps_in(S.rem_s[i], batch, context, decode) if decode is not None else \
        steps * (S.rem_s[i] / excl_s if excl_s > 0 else 0.0)
    return TailWorker(
        dp_rank=task.ranks[0], remaining_s=S.rem_s[i], num_steps=max(1, round(left)),
        batch_size=batch, context_tokens=context, slowdown=S.split[(i, d)].slowdown,
        partner_remaining_s=S.rem_s[partners[0]] if partners else 0.0,
        partner_slowdown=S.split[(partners[0], d)].slowdown if partners else 1.0,
    )


# ---------------------------------------------------------------- effects

def apply(P: Problem, S: State, ctx: Context, item: Item, opt: Option) -> None:
    if type(item) is Tails:
        S.log.append(_new(Logged, (S.now_s, item, opt)))
        if opt.verb is _MERGE:
            _apply_merge(P, S, ctx, opt.merge, opt.tails)
        else:
            S.deferred.add(item)
        return
    verb, sm = opt[0], opt[1]  # opt.verb, opt.sm_frac (indexed: hot)
    started, stale, dev = False, set(), S.dev
    for i in item.tasks:
        devs = P.tasks[i].devices
        if (dev[devs[0]] if len(devs) == 1 else any(dev[d] for d in devs)):  # a running partner there
            if sm is not None and _joinable(P, S, ctx, i) and _fits(P, S, ctx, i, sm):
                stale.update(_start_beside(P, S, ctx, i, sm))
                started = True
            else:
                S.deferred.add(i)
        elif verb is _DEFER:
            S.deferred.add(i)
        else:
            st.start(P, S, i)
            st.refresh_rate(P, S, i, ctx.balanced)
            started = True
            if verb is _SOLO:
                S.closed.update(devs)
    for j in stale:  # once, after all joined: a gang beside many joiners is one rate to recompute
        st.refresh_rate(P, S, j, ctx.balanced)
    # The log is what the plan says it did: a start none of whose replicas could start is not one.
    S.log.append(_new(Logged, (S.now_s, item, opt if started or verb is _DEFER else NO_ROOM)))


def _start_beside(P: Problem, S: State, ctx: Context, i: int, sm: float) -> set[int] | tuple[int, int]:
    """Start i beside its partners; the tasks whose rates must be refreshed."""
    devs = P.tasks[i].devices
    if len(devs) == 1:  # most tasks: one replica beside one partner
        d = devs[0]
        y = S.dev[d][0]
        pt = _best_split(P, S, ctx, i, y, sm)
        st.start(P, S, i)
        st.place_pair(S, i, y, d, (sm, *pt))
        return y, i
    partners = {d: S.dev[d][0] for d in devs if S.dev[d]}
    splits = {d: _best_split(P, S, ctx, i, y, sm) for d, y in partners.items()}
    st.start(P, S, i)
    for d, y in partners.items():
        st.place_pair(S, i, y, d, (sm, *splits[d]))
    return set(partners.values()) | {i}


def _apply_merge(P: Problem, S: State, ctx: Context, decision: MergeDecision, tails: tuple[int, ...]) -> None:
    by_rank = {P.tasks[i].ranks[0]: i for i in tails}
    target = by_rank[decision.target_rank]
    decode = _decode(P, ctx, P.tasks[target].pipe)
    moved = [_tail_worker(P, S, by_rank[r], decode) for r in (decision.target_rank, *decision.source_ranks)]
    S.merged = {**S.merged, target: (sum(w.batch_size for w in moved), sum(w.context_tokens for w in moved),
                                     max(w.num_steps for w in moved), decision.aggregated_s)}
    st.set_remaining(P, S, target, decision.aggregated_s)
    for r in decision.source_ranks:
        st.finish(P, S, by_rank[r], ctx.balanced)


def settle(P: Problem, S: State, ctx: Context, advance_time: bool) -> tuple[Item, list[Option]] | None:
    """Apply forced moves (host tasks start at once; single-option choices) and, if
    `advance_time`, run to later time points until a real choice is open.  None when
    nothing is left to decide (at this time point, or at all)."""
    while True:
        for i in sorted(S.ready):
            if not P.tasks[i].devices:
                st.start(P, S, i)
                st.refresh_rate(P, S, i, ctx.balanced)
        dec = next_decision(P, S, ctx)
        if dec is not None and len(dec[1]) > 1:
            return dec
        if dec is not None:
            apply(P, S, ctx, dec[0], dec[1][0])
            continue
        if not advance_time or not S.running:
            return None
        st.advance(P, S, ctx.balanced)


# ---------------------------------------------------------------- cost

def cost(P: Problem, S: State, slo: dict | None = None, step_end: dict[int, float] | None = None,
         ctx: Context | None = None) -> tuple[float, ...]:
    """Critical path after the window: (longest chain, longest dependency chain, sum); with
    `slo` (Context.slo) and `ctx`, first the SLO lateness on the same path: Σ over pipelines of
    how far the end of the step held to a deadline lies past it (`step_end`, if given, gets
    each end).

    Chains follow dependency edges and device edges.  Along dependencies: running
    tasks end at their current pace until their partner ends, then alone; ready tasks
    not yet placed queue for their devices after the running work there, longest path
    first (deciding co-location is what the window is for); later tasks follow their
    longest chain of exclusive durations (`tail_s`).  Along a device: the remaining
    exclusive work on it runs one piece after another unless co-located, so
    `t + load_d` is a chain too; it is what makes wasted capacity (idle devices,
    co-locations that gain nothing) cost something.  (The leaf of every search: written
    out, no helper calls.)"""
    t, tasks, rem, rate, dev, watch = S.now_s, P.tasks, S.rem_s, S.rate, S.dev, S.watch
    ends = S.end_s[:]
    held = {}  # task -> its end, for the tasks of a step held to a deadline
    run_end = {}
    for i in S.running:
        task = tasks[i]
        mine = rem[i] / rate[i]
        end = t + mine
        devs = task.devices
        if len(devs) == 1:
            occ = dev[devs[0]]
            if len(occ) == 2:  # alone at rate 1 once a single-device partner ends first
                j = occ[1] if occ[0] == i else occ[0]
                theirs = rem[j] / rate[j]
                if theirs < mine and len(tasks[j].devices) == 1:
                    end = t + theirs + (rem[i] - rate[i] * theirs)
        run_end[i] = end
        if i in watch:
            held[i] = end
        v = end + task.tail_s
        if v > ends[task.pipe]:
            ends[task.pipe] = v
    free = []
    for occ in dev:
        if not occ:
            free.append(t)
        elif len(occ) == 1:
            free.append(run_end[occ[0]])
        else:
            a, b = run_end[occ[0]], run_end[occ[1]]
            free.append(a if a < b else b)
    for _, i in sorted((-(rem[i] + tasks[i].tail_s), i) for i in S.ready):  # longest path first
        task = tasks[i]
        devs = task.devices
        start = t
        for d in devs:
            if free[d] > start:
                start = free[d]
        end = start + rem[i]
        for d in devs:
            free[d] = end
        if i in watch:
            held[i] = end
        if end + task.tail_s > ends[task.pipe]:
            ends[task.pipe] = end + task.tail_s
    deps_chain = max(ends)
    c = max(deps_chain, t + max(S.load_s)), deps_chain, sum(ends)
    return c if slo is None else (dl.lateness(P, S, slo, held, run_end, step_end, ctx), *c)


def packing(P: Problem, S: State, ctx: Context) -> Packing:
    """The best pairs among the kinds each device has left (once per call: work only ends,
    so it bounds every later state of the search too)."""
    left: list[set[tuple[str, bool]]] = [set() for _ in range(P.num_devices)]
    gangs = set()  # a kind's gangs on the same devices (every step's) added once, not once per device each
    for i, status in enumerate(S.status):
        if status != st.DONE:
            devs = P.tasks[i].devices
            if len(devs) == 1:
                left[devs[0]].add((P.kinds[i], False))
            elif devs:
                gangs.add((P.kinds[i], devs))
    for kind, devs in gangs:
        for d in devs:
            left[d].add((kind, True))
    rates = [ctx.clearing_of(frozenset(kinds)) for kinds in left]
    return Packing(device=tuple(r[0] for r in rates), node=sum(r[1] for r in rates))


def lower_bound(P: Problem, S: State, min_slowdown: float, pack: Packing) -> float:
    """Makespan no schedule from S can beat: no task runs faster than `1/min_slowdown`,
    no device (and not the node) clears work faster than `pack` says."""
    t, best = S.now_s, max(S.end_s)
    rem, tasks = S.rem_s, P.tasks
    for i in S.running | S.ready:
        v = t + (rem[i] + tasks[i].tail_s) * min_slowdown
        if v > best:
            best = v
    for d, load in enumerate(S.load_s):
        v = t + load / pack.device[d]
        if v > best:
            best = v
    return max(best, t + sum(S.load_s) / pack.node)


def score(P: Problem, S: State, ctx: Context) -> tuple[float, ...]:
    """A leaf's value in the look-ahead: the critical path (`cost`) blended with the lower
    bound (SchedulerConfig.bound_weight), then the critical path's own tie-breakers."""
    if ctx.slo is not None:  # SLO lateness first: a constraint, not a term traded against time
        late, *c = cost(P, S, ctx.slo, ctx=ctx)
        w = ctx.bound_weight
        lead = c[0] if w <= 0.0 else w * lower_bound(P, S, ctx.min_slowdown, ctx.pack) + (1.0 - w) * c[0]
        return (late, lead, *c)
    c = cost(P, S)
    w = ctx.bound_weight
    if w <= 0.0:
        return c
    return (w * lower_bound(P, S, ctx.min_slowdown, ctx.pack) + (1.0 - w) * c[0], *c)
