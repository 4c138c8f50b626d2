"""The scheduler's input from a live pipeline: one builder for the daemon, the simulator and
the graph executor.

    LivePipeline (live.py)
      │ base graph: the static graph, or the predicted step (history ─► predict_next,
      │             renumbered to this step), or the pipeline's prior guess
      ├─ a live sub-stage the base lacks takes the place of the base's last piece of its kind
      │  on its worker (inheriting its successors), or stands alone
      ├─ base pieces before a finished or live one are skipped (the pipeline went past them);
      │  finished ones leave the graph
      ├─ waiting: ready now (they asked), urgent ones must start; running: remaining =
      │  expected − work done, an overdue prediction still needs a share of itself, a tail
      │  the residual life of its requests (when the engine says what they generated)
      ├─ lockstep gangs: once a replica started, all of them run until the last one is done
      └─ the predicted next step behind the barrier, each worker's rollout summarised
    ─► PipelineState(graph, devices, running budgets, remaining, urgent, decode fit)
       + Progress (stage, step, rollout share done, since when) for whole-stage baselines
    every registered pipeline ─► host_frac: per device, the share working on the host

Pure: it reads the facts and `now_s`; derived data is kept in the caller's `ViewMemo` (the
prediction, the summarised next step, the last graph, so an unchanged graph is the same
object and the scheduler's per-graph tables stay valid).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, replace

from jigsaw.graph.builder import predict_next
from jigsaw.graph.graph import SubStageGraph
from jigsaw.graph.ids import SUMMARY, SubStageId, with_step
from jigsaw.graph.plan import Budget, PipelineState, Progress
from jigsaw.graph.problem import decode_fit, prefill_stats
from jigsaw.graph.substage import SubStage, SubStageKind
from jigsaw.node.ledger import HOST, STAGE_ORDER, LivePipeline, Running, Waiting, stage_of

MIN_REMAINING_FRAC = 0.05
"""An overdue predicted sub-stage is still expected to need this share of its prediction
(a known, static graph is exact: no floor)."""
MIN_REMAINING_S = 1e-3
DEFAULT_DURATION_S = 1.0
"""Exclusive time assumed for a kind never seen before."""
_SUMMED = (SubStageKind.REWARD, SubStageKind.REFERENCE, SubStageKind.TRAINING)
_STAGE_INDEX = {k: STAGE_ORDER.index(stage_of(k)) for k in SubStageKind}


@dataclass(slots=True)
class ViewMemo:
    """What the view derived from one pipeline's facts, kept between calls (each entry is
    keyed by what it was derived from, so a stale one is never used)."""

    prediction: tuple | None = None
    """((step, history length, last graph's id), predicted step graph)."""
    measured: tuple | None = None
    """(base graph, (decode fit, prefill stats, multi-turn))."""
    base_gangs: tuple | None = None
    """(base graph, {gang key: member ids})."""
    finished_ancestors: tuple | None = None
    """(base graph, finished count, ancestors of the finished in the base)."""
    next: tuple | None = None
    """((step, prediction's id), next step's nodes, deps, sources)."""
    graph: tuple | None = None
    """(nodes, deps, the graph built from them)."""


def pipeline_state(p: LivePipeline, now_s: float, *, next_step: bool = True,
                   memo: ViewMemo | None = None) -> tuple[PipelineState, Progress]:
    """Scheduler input and progress of one pipeline at `now_s` (see the module docstring);
    `memo`: what earlier calls for this pipeline derived (a fresh one when None)."""
    memo = ViewMemo() if memo is None else memo
    base = _base(p, memo)
    live: dict[str, Waiting | Running] = {**p.waiting, **p.running}
    anchors = _anchors(p, base, live)
    started = _started_gangs(p, base, live, memo)
    nodes, deps, kept, done, at_of = _current(p, base, live, anchors, started, memo)
    running, remaining, urgent = _times(p, nodes, at_of, kept, started, now_s)
    aged = frozenset(sid for sid in urgent if p.waiting[sid].aged)
    if next_step and p.more_steps and p.static is None and (pred := _prediction(p, memo) or p.forecast) is not None:
        _append_next(p, pred, nodes, deps, memo)
    graph = _graph(p, nodes, deps, memo)
    fit, prefill, turns = _measured(base, memo)
    state = PipelineState(graph=graph, devices=p.devices, done=frozenset(done), running=running,
                          remaining_s=remaining, urgent=frozenset(urgent), aged=aged, decode_fit=fit,
                          prefill_work=prefill, multi_turn=turns, deadline=_deadline(p, base, graph, remaining, now_s))
    return state, _progress(p, nodes, done, remaining, now_s)


def _deadline(p: LivePipeline, base: SubStageGraph | None, graph: SubStageGraph, remaining: dict[str, float],
              now_s: float):
    """The step's SLO deadline (node/slo.py), its exclusive time as known now: finished pieces
    at their work, running ones at work done + left, the rest as predicted."""
    if p.clock.slo_slowdown is None:
        return None
    known = {sid: s.duration_s for sid, s in p.finished.items()}
    for sid, r in p.running.items():
        if sid in remaining:
            known[sid] = r.work_s + max(0.0, now_s - r.since_s) * r.rate + remaining[sid]
    return p.clock.deadline(p.step, base, known, graph)


def host_frac(pipelines: Iterable[LivePipeline]) -> dict[int, float]:
    """Per device, the share of the pipelines placed on it that work on the host: nothing of
    theirs holds or waits for a device (their Python between sub-stages, a host reward,
    start-up, exit).  Those are not in the view; on a CPU they still use its cores
    (SchedulerConfig.host_on_device).  A pipeline in a tool sub-stage waits (a tool call run
    elsewhere, a framework polling for its rollout): it computes nothing, and keeps no share;
    unless the tool computes here (protocol.Admit.computes: a code tool run on this CPU)."""
    placed: Counter[int] = Counter()
    busy: Counter[int] = Counter()
    for p in pipelines:
        on_host = not p.waiting and not any(r.on_device or (r.kind is SubStageKind.TOOL and not r.computes)
                                            for r in p.running.values())
        for d in set(p.devices):
            placed[d] += 1
            busy[d] += on_host
    return {d: busy[d] / placed[d] for d in placed if busy[d]}


# ---------------------------------------------------------------- base graph

def _base(p: LivePipeline, memo: ViewMemo) -> SubStageGraph | None:
    if p.static is not None:
        return p.static
    return _prediction(p, memo) or p.forecast


def _prediction(p: LivePipeline, memo: ViewMemo) -> SubStageGraph | None:
    """predict_next of the history, renumbered to the current step (memoised per step)."""
    last = p.last_graph
    if last is None:
        return None
    history = p.history
    key = (p.step, len(history), id(last))
    if memo.prediction is None or memo.prediction[0] != key:
        pred = predict_next(list(history))
        if pred.steps != (p.step,):
            ren = {s.id: with_step(s.id, p.step) for s in pred}
            pred = SubStageGraph([replace(s, id=ren[s.id], step=p.step) for s in pred],
                                 {ren[k]: tuple(ren[d] for d in v) for k, v in pred.deps.items()})
        memo.prediction = (key, pred)
    return memo.prediction[1]


def _measured(base: SubStageGraph | None, memo: ViewMemo):
    """The engine's decode step model, its prefill work and whether it is multi-turn, read
    once per base graph (the remaining graph may have none of it left to read)."""
    if memo.measured is None or memo.measured[0] is not base:
        got = (decode_fit(base), prefill_stats(base), any(s.kind is SubStageKind.TOOL for s in base)) \
            if base is not None else (None, None, False)
        memo.measured = (base, got)
    return memo.measured[1]


def _anchors(p: LivePipeline, base: SubStageGraph | None, live: dict) -> dict[str, str | None]:
    """For each live sub-stage the base does not know: the base piece whose place it takes
    (the last one of its kind on its worker that is not itself live), or None."""
    out: dict[str, str | None] = {}
    for sid, f in live.items():
        if base is not None and sid in base:
            continue
        anchor = None
        if base is not None:
            for s in base:
                if s.dp_rank == f.rank and s.kind is f.kind and s.id not in live:
                    anchor = s.id
        out[sid] = anchor
    return out


def _started_gangs(p: LivePipeline, base: SubStageGraph | None, live: dict, memo: ViewMemo) -> dict[tuple, list[str]]:
    """Lockstep gangs with a replica running or finished and one not finished: key → members."""
    members = {k: list(v) for k, v in _base_gangs(p, base, memo).items()}
    extra = [sid for sid, f in live.items() if f.kind.collective and (base is None or sid not in base)]
    extra += [sid for sid, s in p.finished.items() if s.kind.collective and (base is None or sid not in base)]
    for sid in extra:
        members.setdefault(p.gang_key(sid), []).append(sid)
    out = {}
    for key, sids in members.items():
        begun = any(sid in p.running or sid in p.finished for sid in sids)
        if begun and not all(sid in p.finished for sid in sids):
            out[key] = sids
    return out


def _base_gangs(p: LivePipeline, base: SubStageGraph | None, memo: ViewMemo) -> dict[tuple, tuple[str, ...]]:
    """The base graph's lockstep gangs (memoised per base graph: a static one lives all run)."""
    if memo.base_gangs is None or memo.base_gangs[0] is not base:
        members: dict[tuple, list[str]] = {}
        for s in base or ():
            if s.kind.collective:
                members.setdefault(p.gang_key(s.id), []).append(s.id)
        memo.base_gangs = (base, {k: tuple(v) for k, v in members.items()})
    return memo.base_gangs[1]


# ---------------------------------------------------------------- this step

def _current(p, base, live, anchors, started, memo: ViewMemo):
    """Nodes (topological) and deps of this step, and which are done: finished, skipped
    (the pipeline went past them), replaced by a live piece, or never to run (their worker
    ended).  Done nodes stay in the graph, so a graph keeps its shape while facts come in
    (the scheduler patches the tasks of a same-shaped graph instead of rebuilding them).
    `kept`: finished replicas of a running gang, which run on until the gang ends; `at_of`:
    the base piece each live one stands in for (None for a loose one)."""
    finished = p.finished
    kept = {sid for sids in started.values() for sid in sids if sid in finished}
    done = set(finished) - kept
    if base is not None:
        places = {a for a in anchors.values() if a}
        placed = {sid for sid in (*finished, *live) if sid in base} | places
        done |= (_finished_ancestors(p, base, memo) | _ancestors(base, placed - set(finished))) - set(live) - kept
        done |= places
        # A worker runs the rest of its predicted chain after the piece it is in now: back in
        # an earlier regime, or in a piece whose id the base has at another place (a tail
        # re-entered before its first tool wait finishes tail/1 before tool/0; the base's
        # tail/1 comes after tool/0 and is still to run, and so is the tool wait after it).
        now = places | {sid for sid in live if sid in base}
        done -= {s for a in now for s in _chain_after(base, a)}
        if (ended := p.ended):  # a worker out of requests will run nothing more of its predicted rollout
            done |= {s.id for s in base if s.dp_rank in ended and s.id not in live
                     and (s.kind.is_rollout or s.kind is SubStageKind.TOOL)}
    by_anchor: dict[str, list[str]] = {}
    at_of: dict[str, SubStage | None] = {}
    nodes: list[SubStage] = []
    deps: dict[str, tuple[str, ...]] = {}
    loose: list[tuple[int, int, int, str]] = []  # (stage order, step, rank, id) of live ones without a place
    for sid, a in anchors.items():
        if a is None:
            node = _live_node(p, live[sid], None)
            at_of[sid] = None
            _emit(nodes, deps, node, ())
            loose.append((_STAGE_INDEX[node.kind], node.step, node.dp_rank, sid))
        else:
            by_anchor.setdefault(a, []).append(sid)
    rename = {a: sids[-1] for a, sids in by_anchor.items()}
    for s in base or ():
        ds = tuple(rename.get(d, d) for d in base.deps[s.id]) if rename else tuple(base.deps[s.id])
        if s.id in live:  # it asked: it is ready, whatever the prediction said before it
            at_of[s.id] = s
            _emit(nodes, deps, _live_node(p, live[s.id], s), tuple(d for d in ds if d in done))
        elif s.id in kept:
            _emit(nodes, deps, replace(s, duration_s=max(s.duration_s, finished[s.id].duration_s)), ds)
        else:
            if loose:  # a piece the base did not know still sits between its neighbours in the step
                ds += _after_loose(loose, s)
            _emit(nodes, deps, s, ds)
        for sid in by_anchor.get(s.id, ()):  # a live piece in the place of a predicted one
            at_of[sid] = s
            _emit(nodes, deps, _live_node(p, live[sid], s), ())
    emitted = set(deps)
    for sid in kept - emitted:  # a finished replica the base does not know
        _emit(nodes, deps, finished[sid], ())
    return nodes, deps, kept, done, at_of


def _after_loose(loose: list[tuple[int, int, int, str]], s: SubStage) -> tuple[str, ...]:
    """The loose live pieces a base piece waits for: those of an earlier stage of its step,
    and those of its own stage on its own worker (a worker that began a stage with a piece
    the prediction did not have, a prefill say, runs its predicted pieces after it; as
    roots they could be started in its place, and they were never asked for)."""
    stage = _STAGE_INDEX[s.kind]
    return tuple(sid for st, step, rank, sid in loose
                 if step == s.step and (st < stage or (st == stage and rank == s.dp_rank)))


def _chain_after(base: SubStageGraph, sid: str) -> list[str]:
    """The rollout pieces (and tool waits) after `sid` on its worker, in the base."""
    rank, out, cur = base[sid].dp_rank, [], sid
    while True:
        nxt = [n for n in base.successors(cur) if base[n].dp_rank == rank
               and (base[n].kind.is_rollout or base[n].kind is SubStageKind.TOOL)]
        if not nxt:
            return out
        cur = nxt[0]
        out.append(cur)


def _emit(nodes: list, deps: dict, s: SubStage, ds: tuple[str, ...]) -> None:
    nodes.append(s)
    deps[s.id] = ds


def _finished_ancestors(p: LivePipeline, base: SubStageGraph, memo: ViewMemo) -> set[str]:
    """Ancestors in `base` of the finished sub-stages, grown as they finish (finished only
    grows while the base stands: memoised on the base and how many have finished)."""
    finished = p.finished
    got = memo.finished_ancestors
    n = len(finished)
    if got is None or got[0] is not base or got[1] > n:
        got = (base, 0, set())
    new = [sid for sid in list(finished)[got[1]:] if sid in base]
    seen = _ancestors(base, new, got[2]) if new else got[2]
    memo.finished_ancestors = (base, n, seen)
    return seen


def _ancestors(base: SubStageGraph, ids, seen: set[str] | None = None) -> set[str]:
    """Every ancestor of `ids` in `base`, added to `seen` (whose ancestors it already holds)."""
    seen = set() if seen is None else seen
    stack = [d for s in ids for d in base.deps[s] if d not in seen]
    while stack:
        s = stack.pop()
        if s not in seen:
            seen.add(s)
            stack.extend(base.deps[s])
    return seen


def _live_node(p: LivePipeline, f: Waiting | Running, at: SubStage | None) -> SubStage:
    """A live sub-stage as a node: the base piece at its place, corrected by what is known
    now (its own expected size, the memory it asked for, the engine's batch; a tail that has
    not started yet, the residual life of its requests)."""
    expected = f.expected_s or (at.duration_s if at is not None else None) or p.estimate_s(f.kind) \
        or DEFAULT_DURATION_S
    step = at.step if at is not None else (p.static[f.sid].step if p.static is not None else p.step)
    if at is None:
        node = SubStage(id=f.sid, pipeline=p.name, step=step, kind=f.kind, dp_rank=f.rank, duration_s=expected,
                        mem_bytes=f.need_bytes)
    else:
        node = at if at.id == f.sid and at.duration_s == expected else \
            replace(at, id=f.sid, kind=f.kind, duration_s=expected)
        running_engine = f.kind.is_rollout and f.need_bytes > 0 and (isinstance(f, Running) or f.urgent)
        if f.need_bytes > node.mem_bytes or running_engine:
            # A running engine (or one whose regime changed) holds what it reports, not its
            # history's peak: its pool follows the budget it is given.
            node = replace(node, mem_bytes=f.need_bytes)
    if f.batch_size > 0 and node.batch_size != f.batch_size:
        node = replace(node, batch_size=f.batch_size)
    live = f.live
    if live is not None and live.batch_size > 0 and f.kind.is_rollout:
        per_token = node.flops / node.num_tokens if node.num_tokens else 0.0
        tokens = max(1, int(live.batch_size * node.num_steps))
        node = replace(node, batch_size=live.batch_size, seq_len=live.context_tokens, num_tokens=tokens,
                       flops=per_token * tokens)
    if isinstance(f, Waiting):  # what is left of it (it may have begun before it asked)
        left = _residual(p, f, node, at)
        if left is None and f.work_s > 0:
            left = max(node.duration_s - f.work_s, MIN_REMAINING_FRAC * node.duration_s, MIN_REMAINING_S)
        if left is not None:
            node = replace(node, duration_s=left)
    return node


def _residual(p: LivePipeline, f: Waiting | Running, node: SubStage, at: SubStage | None) -> float | None:
    """Exclusive seconds a tail has left by the residual life of its requests (what they
    generated so far, against the lengths finished requests had), when the engine says.
    A step costs what the prediction's did (`at`, the base piece): an expected size set
    since (a merge's, which adds requests, not steps) does not stretch the steps."""
    lengths, live = p.lengths, f.live
    step = at if at is not None and at.num_steps > 0 else node
    if (f.kind is not SubStageKind.ROLLOUT_TAIL or live is None or not live.generated or lengths is None
            or not lengths.known or step.num_steps <= 0):
        return None
    # A tail lasts as long as its longest request: what they generated so far says more
    # than the prediction once the tail has outlived it (jigsaw.graph.residual).
    return max(MIN_REMAINING_S, lengths.steps_left(live.generated) * step.duration_s / step.num_steps)


def _times(p, nodes, at_of, kept, started, now_s):
    """Budgets of running sub-stages, their exclusive time left, and the urgent ones."""
    index = {s.id: s for s in nodes}
    floor = 0.0 if p.static is not None else MIN_REMAINING_FRAC
    running: dict[str, Budget] = {}
    remaining: dict[str, float] = {}
    for sid, r in p.running.items():
        running[sid] = r.budget
        remaining[sid] = _left(p, r, index[sid], at_of.get(sid), now_s, floor)
    urgent = {sid for sid, w in p.waiting.items() if w.urgent}
    for sids in started.values():  # the whole gang runs once one replica does
        budget = next((p.running[s].budget for s in sids if s in p.running), Budget(sm_frac=1.0, mem_frac=1.0))
        for sid in sids:
            if sid not in running and sid in index:
                running[sid] = budget
                remaining[sid] = MIN_REMAINING_S if sid in kept else max(index[sid].duration_s * floor,
                                                                           MIN_REMAINING_S)
                urgent.discard(sid)
    return running, remaining, urgent


def _left(p: LivePipeline, r: Running, node: SubStage, at: SubStage | None, now_s: float, floor: float) -> float:
    work = r.work_s + max(0.0, now_s - r.since_s) * r.rate
    expected = r.expected_s if r.expected_s is not None else node.duration_s
    if r.budget is HOST:
        work = now_s - r.start_s  # host work runs at wall-clock pace
    if (left := _residual(p, r, node, at)) is not None:
        return left
    if floor == 0.0:
        return max(expected - work, 0.0)
    return max(expected - work, floor * expected, MIN_REMAINING_S)


# ---------------------------------------------------------------- the next step

def _append_next(p: LivePipeline, pred: SubStageGraph, nodes: list, deps: dict, memo: ViewMemo) -> None:
    """The predicted next step behind the barrier (built once per step)."""
    key = (p.step, id(pred))
    if memo.next is None or memo.next[0] != key:
        g = _renumber(summarised(pred), p.step + 1)
        memo.next = (key, g.substages, g.deps, tuple(s.id for s in g.sources()))
    _, next_nodes, next_deps, sources = memo.next
    has_succ = {d for ds in deps.values() for d in ds}
    sinks = tuple(s.id for s in nodes if s.id not in has_succ)
    nodes.extend(next_nodes)
    deps.update(next_deps)
    for sid in sources:
        deps[sid] = sinks


def summarised(pred: SubStageGraph) -> SubStageGraph:
    """A step's graph with each worker's rollout chain replaced by its summary."""
    nodes: list[SubStage] = []
    deps: dict[str, tuple[str, ...]] = {}
    sinks: list[str] = []
    chains: dict[int, list[SubStage]] = {}
    for s in pred:
        if s.kind.is_rollout or s.kind is SubStageKind.TOOL:
            chains.setdefault(s.dp_rank, []).append(s)
    for chain in chains.values():
        prev: tuple[str, ...] = ()
        for s in _summary(chain):
            _emit(nodes, deps, s, prev)
            prev = (s.id,)
        sinks.append(prev[0])
    for kind in _SUMMED:
        layer = [s for s in pred if s.kind is kind]
        for s in layer:
            _emit(nodes, deps, s, tuple(sinks))
        sinks = [s.id for s in layer] or sinks
    return SubStageGraph.from_ordered(nodes, deps)


def _summary(chain: list[SubStage]) -> list[SubStage]:
    """A worker's rollout as one device piece (its dominant kind; all its device time,
    tokens and FLOPs) then one tool wait (all of them).  The look-ahead reads a step it
    will not start within its window only through chain lengths and device loads, which
    this keeps; and it is a fraction of the sub-stages to build at every decision."""
    on = [s for s in chain if s.kind.on_device]
    tools = [s for s in chain if not s.kind.on_device]
    out = []
    if on:
        time: dict[SubStageKind, float] = {}
        for s in on:
            time[s.kind] = time.get(s.kind, 0.0) + s.duration_s
        total = sum(time.values()) or 1.0
        kind, first = max(time, key=time.get), on[0]
        sid = SubStageId(first.pipeline, first.step, first.dp_rank, kind, SUMMARY)
        out.append(SubStage(id=str(sid), pipeline=first.pipeline, step=first.step, kind=kind, dp_rank=first.dp_rank,
                            duration_s=sum(time.values()), mem_bytes=max(s.mem_bytes for s in on),
                            batch_size=sum(s.batch_size * s.duration_s for s in on) / total,
                            seq_len=sum(s.seq_len * s.duration_s for s in on) / total,
                            num_steps=sum(s.num_steps for s in on), num_tokens=sum(s.num_tokens for s in on),
                            flops=sum(s.flops for s in on)))
    if tools:
        t = tools[0]
        sid = SubStageId(t.pipeline, t.step, t.dp_rank, SubStageKind.TOOL, SUMMARY)
        out.append(replace(t, id=str(sid), duration_s=sum(s.duration_s for s in tools)))
    return out


def _renumber(g: SubStageGraph, step: int) -> SubStageGraph:
    ren = {s.id: with_step(s.id, step) for s in g}
    return SubStageGraph([replace(s, id=ren[s.id], step=step) for s in g],
                         {ren[k]: tuple(ren[d] for d in v) for k, v in g.deps.items()})


def _graph(p: LivePipeline, nodes: list[SubStage], deps: dict[str, tuple[str, ...]], memo: ViewMemo) -> SubStageGraph:
    """The same graph object as last time if nothing in it changed: the scheduler caches
    its per-pipeline tables by graph identity, and most decisions concern one pipeline."""
    got = memo.graph
    if got is not None and got[0] == nodes and got[1] == deps:
        return got[2]
    base = p.static
    if base is not None and len(base) == len(nodes) and all(a is b for a, b in zip(base.substages, nodes)) \
            and all(base.deps[k] == v for k, v in deps.items()):
        graph = base  # the known graph itself: nothing about it changed
    else:
        graph = SubStageGraph.from_ordered(nodes, deps)  # built in topological order above
    memo.graph = (nodes, deps, graph)
    return graph


# ---------------------------------------------------------------- progress

def _progress(p: LivePipeline, nodes: list[SubStage], skip: set[str], remaining: dict, now_s: float) -> Progress:
    if p.samples is not None and p.samples[1] > 0:
        done_frac = p.samples[0] / p.samples[1]
    else:  # exclusive rollout work done over done + left, this step
        done = sum(s.duration_s for s in p.finished.values() if s.kind.is_rollout and s.step == p.step)
        done += sum(r.work_s for r in p.running.values() if r.kind.is_rollout)
        left = sum(remaining.get(s.id, s.duration_s) for s in nodes
                   if s.kind.is_rollout and s.step == p.step and s.id not in skip)
        done_frac = done / (done + left) if done + left > 0 else 1.0
    since = p.stage_since_s if p.stage_since_s is not None else now_s
    return Progress(stage=p.stage.value, step=p.step, rollout_done_frac=done_frac, ready_since_s=since,
                    job="" if p.job == p.name else p.job)
