"""What a policy sees: live pipelines as scheduler inputs (the runtime builds the same).

    PipelineRun (live) + its prediction ─► remaining graph:
        each worker: [live sub-stage, remaining = predicted − elapsed] ─► predicted rest of its chain
        ─► reward ─► reference ─► training          (this step)
        ─► the predicted next step, renumbered      (so the window can see past the barrier)
    ─► PipelineState(graph, devices, running = granted budgets, urgent = new live sub-stages)

Done work is left out of the graph.  A live sub-stage the prediction does not have (a
regime this step did not show last time) keeps its elapsed time as its estimate and has
no predicted successors on its worker.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Protocol

from jigsaw.graph.graph import SubStageGraph
from jigsaw.graph.merge import DecodeFit
from jigsaw.graph.problem import decode_fit
from jigsaw.graph.plan import Budget, NodeSpec, PipelineState, Plan
from jigsaw.graph.substage import SubStage, SubStageKind
from jigsaw.sim.pipeline import REFERENCE, REWARD, ROLLOUT, TRAINING, PipelineRun

MIN_REMAINING_FRAC = 0.05
"""An overdue sub-stage is still expected to need this share of its prediction."""


@dataclass(frozen=True, slots=True)
class Progress:
    """Per-pipeline facts some baselines use besides the graph."""

    stage: str
    step: int
    rollout_done_frac: float
    """Share of this step's samples finished (RollMux's tail trigger)."""
    ready_since_s: float
    """When the pipeline's current stage became ready or started (HRRS waiting time)."""


@dataclass(frozen=True, slots=True)
class View:
    """Everything a policy decides from."""

    time_s: float
    pipelines: tuple[PipelineState, ...]
    progress: tuple[Progress, ...]
    node: NodeSpec
    model: object
    """The slowdown grid (jigsaw.mux.slowdown.SlowdownGrid)."""


class Policy(Protocol):
    """A scheduling policy: the simulator and the runtime call it at every decision point."""

    name: str

    def plan(self, view: View) -> Plan: ...


def pipeline_state(run: PipelineRun, t: float, granted: Mapping[str, Budget]) -> PipelineState:
    nodes: list[SubStage] = []
    deps: dict[str, tuple[str, ...]] = {}
    running: dict[str, Budget] = {}
    remaining: dict[str, float] = {}
    urgent: set[str] = set()
    pred = run.prediction
    sinks: list[str] = []
    if run.stage == ROLLOUT:
        for r, wk in enumerate(run.workers):
            if not wk.done:
                chain = _rollout_chain(run, r, t, granted, running, remaining, urgent)
                _link(nodes, deps, chain, ())
                sinks.append(chain[-1].id)
    rest = _after_rollout(run, t, granted, running, remaining)
    for layer in rest:
        for s in layer:
            nodes.append(s)
            deps[s.id] = tuple(sinks)
        sinks = [s.id for s in layer]
    if run.step + 1 < run.steps_total and pred is not None:
        _append_next(run, nodes, deps)
    return PipelineState(graph=_graph(run, nodes, deps), devices=run.devices, running=running,
                         remaining_s=remaining, urgent=frozenset(urgent), decode_fit=_decode_fit(run))


def _decode_fit(run: PipelineRun) -> DecodeFit | None:
    """The engine's decode step model, from the prediction (refitted once per step)."""
    cached = getattr(run, "_decode_cache", None)
    if cached is None or cached[0] is not run.prediction:
        fit = decode_fit(run.prediction) if run.prediction is not None else None
        cached = run._decode_cache = (run.prediction, fit)
    return cached[1]


def _graph(run: PipelineRun, nodes: list[SubStage], deps: dict[str, tuple[str, ...]]) -> SubStageGraph:
    """The same graph object as last time if nothing in it changed: the scheduler caches
    its per-pipeline tables by graph identity, and most decisions concern one pipeline."""
    cached = getattr(run, "_graph_cache", None)
    if cached is not None and cached[0] == nodes and cached[1] == deps:
        return cached[2]
    graph = SubStageGraph.from_ordered(nodes, deps)  # built in topological order above
    run._graph_cache = (nodes, deps, graph)
    return graph


def _append_next(run: PipelineRun, nodes: list[SubStage], deps: dict[str, tuple[str, ...]]) -> None:
    """The predicted next step behind a barrier (built once per step, then reused), each
    worker's rollout summarised in at most two pieces (see _summary)."""
    key = (run.step + 1, id(run.prediction))
    cached = getattr(run, "_next_graph", None)
    if cached is None or cached[0] != key:
        g = _renumber(_summarised(run), run.step + 1)
        cached = run._next_graph = (key, g.substages, g.deps, tuple(s.id for s in g.sources()))
    _, next_nodes, next_deps, sources = cached
    has_succ = {d for ds in deps.values() for d in ds}
    sinks = tuple(s.id for s in nodes if s.id not in has_succ)
    nodes.extend(next_nodes)
    deps.update(next_deps)
    for sid in sources:
        deps[sid] = sinks


def _summarised(run: PipelineRun) -> SubStageGraph:
    """The prediction with each worker's rollout chain replaced by its summary."""
    nodes: list[SubStage] = []
    deps: dict[str, tuple[str, ...]] = {}
    sinks: list[str] = []
    for chain in _chains(run).values():
        short = _summary(chain)
        _link(nodes, deps, short, ())
        sinks.append(short[-1].id)
    for kind in (SubStageKind.REWARD, SubStageKind.REFERENCE, SubStageKind.TRAINING):
        layer = [s for s in run.prediction if s.kind is kind]
        for s in layer:
            nodes.append(s)
            deps[s.id] = tuple(sinks)
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
        time = {}
        for s in on:
            time[s.kind] = time.get(s.kind, 0.0) + s.duration_s
        total = sum(time.values()) or 1.0
        kind, first = max(time, key=time.get), on[0]
        out.append(SubStage(id=f"{first.pipeline}/{first.step}/r{first.dp_rank}/{kind.value}/all",
                            pipeline=first.pipeline, step=first.step, kind=kind, dp_rank=first.dp_rank,
                            duration_s=sum(time.values()), mem_bytes=max(s.mem_bytes for s in on),
                            batch_size=sum(s.batch_size * s.duration_s for s in on) / total,
                            seq_len=sum(s.seq_len * s.duration_s for s in on) / total,
                            num_steps=sum(s.num_steps for s in on), num_tokens=sum(s.num_tokens for s in on),
                            flops=sum(s.flops for s in on)))
    if tools:
        t = tools[0]
        out.append(replace(t, id=f"{t.pipeline}/{t.step}/r{t.dp_rank}/tool/all",
                           duration_s=sum(s.duration_s for s in tools)))
    return out


def _link(nodes, deps, chain, before) -> None:
    prev = before
    for s in chain:
        nodes.append(s)
        deps[s.id] = tuple(prev)
        prev = (s.id,)


def _rollout_chain(run, r, t, granted, running, remaining, urgent) -> list[SubStage]:
    wk = run.workers[r]
    chain = _chains(run).get(r)
    if not chain:  # the prediction has no such worker: one piece of unknown length
        chain = [SubStage(id=f"{run.name}/{run.step}/r{r}/rollout_decode/0", pipeline=run.name, step=run.step,
                          kind=SubStageKind.ROLLOUT_DECODE, dp_rank=r, duration_s=1.0, mem_bytes=run.rollout_mem)]
    if r not in run.started_workers:
        return chain
    live = wk.piece
    if live is None:  # started, no forward step finished yet: it is in its first predicted piece
        cur, j, elapsed = chain[0], 0, t - run.t_stage
    else:
        j = _match(chain, live.kind, live.ordinal)
        elapsed = t - live.start_s
        cur = _live_piece(run, wk, chain[j] if j is not None else None, elapsed)
    left = max(cur.duration_s - elapsed, MIN_REMAINING_FRAC * cur.duration_s, 1e-3)
    if cur.kind is SubStageKind.ROLLOUT_TAIL and wk.decoding and run.lengths.known and cur.num_steps > 0:
        # A tail lasts as long as its longest request: what they generated so far says more
        # than the prediction once the tail has outlived it (jigsaw.graph.residual).
        left = max(1e-3, run.lengths.steps_left(q.generated for q in wk.decoding) * cur.duration_s / cur.num_steps)
    cur = replace(cur, duration_s=max(cur.duration_s, 1e-3))
    if cur.id in granted or not cur.kind.on_device:
        running[cur.id] = granted.get(cur.id, Budget(sm_frac=1.0, mem_frac=1.0))
        remaining[cur.id] = left
    else:  # a new regime (or its first piece): it starts now, only its budget is a choice
        urgent.add(cur.id)
        cur = replace(cur, duration_s=left)
    tail = chain[j + 1:] if j is not None else []
    return [cur, *[s for s in tail if s.id != cur.id]]


def _live_piece(run, wk, base: SubStage | None, elapsed: float) -> SubStage:
    """The worker's current piece as its client reports it: what the engine knows now (the
    active batch and its KV context) over the prediction's length and step count."""
    live = wk.piece
    batch = len(wk.decoding)
    context = sum(q.context for q in wk.decoding) / batch if batch else (base.seq_len if base else 0.0)
    steps = base.num_steps if base else 1
    tokens = max(1, batch * steps)
    return SubStage(id=wk.piece_id(), pipeline=run.name, step=run.step, kind=live.kind, dp_rank=wk.rank,
                    duration_s=base.duration_s if base else max(elapsed, 1e-3),
                    mem_bytes=0 if live.kind is SubStageKind.TOOL else _need(wk, base),
                    batch_size=float(batch), seq_len=context, num_steps=steps, num_tokens=tokens,
                    flops=run.cost.flops_per_token * tokens)


def _need(wk, base: SubStage | None) -> int:
    """Memory of a live piece: its predicted peak, or what the engine holds now if more."""
    now = int(wk.need_bytes(wk.held_kv_tokens()))
    return max(now, base.mem_bytes) if base is not None else now


def _chains(run: PipelineRun) -> dict[int, list[SubStage]]:
    """The prediction's rollout chain of every worker (computed once per step).  Predicted
    ids already carry the current step: the builder predicts the step after its history."""
    cached = getattr(run, "_chains_cache", None)
    if cached is None or cached[0] is not run.prediction:
        out: dict[int, list[SubStage]] = {}
        for s in run.prediction:
            if s.kind.is_rollout or s.kind is SubStageKind.TOOL:
                out.setdefault(s.dp_rank, []).append(s)
        cached = run._chains_cache = (run.prediction, out)
    return cached[1]


def _match(chain: list[SubStage], kind: SubStageKind, ordinal: int) -> int | None:
    suffix = f"/{kind.value}/{ordinal}"
    for j, s in enumerate(chain):
        if s.id.endswith(suffix):
            return j
    same = [j for j, s in enumerate(chain) if s.kind is kind]
    return same[-1] if same else None


def _after_rollout(run, t, granted, running, remaining) -> list[list[SubStage]]:
    pred = run.prediction
    by_kind = {k: [s for s in pred if s.kind is k] for k in (SubStageKind.REWARD, SubStageKind.REFERENCE,
                                                              SubStageKind.TRAINING)}
    layers = []
    stages = [(REWARD, SubStageKind.REWARD), (REFERENCE, SubStageKind.REFERENCE), (TRAINING, SubStageKind.TRAINING)]
    order = [ROLLOUT, REWARD, REFERENCE, TRAINING]
    now = order.index(run.stage) if run.stage in order else len(order)
    for stage, kind in stages:
        if order.index(stage) < now:
            continue
        if order.index(stage) == now and kind is not SubStageKind.REWARD and run.gang is not None:
            layers.append(_live_gang(run, t, granted, running, remaining))
            continue
        layer = list(by_kind[kind])
        if stage == REWARD and run.stage == REWARD:
            layer = [replace(s, duration_s=max(run.reward_end_s - t, 1e-6)) for s in layer] or [
                SubStage(id=f"{run.name}/{run.step}/r0/reward/0", pipeline=run.name, step=run.step,
                         kind=SubStageKind.REWARD, dp_rank=0, duration_s=max(run.reward_end_s - t, 1e-6))]
            for s in layer:
                running[s.id] = Budget(sm_frac=1.0, mem_frac=1.0)
        if layer:
            layers.append(layer)
    return layers


def _live_gang(run, t, granted, running, remaining) -> list[SubStage]:
    g = run.gang
    g.advance(t) if g.started_s is not None else None
    out = []
    for sid, rank in zip(g.ids, g.ranks):
        out.append(SubStage(id=sid, pipeline=run.name, step=run.step, kind=g.kind, dp_rank=rank,
                            duration_s=max(g.excl_s, 1e-6), mem_bytes=g.mem_bytes,
                            batch_size=g.seqs_per_rank, num_steps=1))
        if g.started_s is not None:
            running[sid] = granted.get(sid, Budget(sm_frac=1.0, mem_frac=1.0))
            remaining[sid] = max(g.rem_s, 1e-6)
    return out


def _with_step(sid: str, step: int) -> str:
    name, _, rest = sid.split("/", 2)
    return f"{name}/{step}/{rest}"


def _renumber(g: SubStageGraph, step: int) -> SubStageGraph:
    ren = {s.id: _with_step(s.id, step) for s in g}
    return SubStageGraph([replace(s, id=ren[s.id], step=step) for s in g],
                         {ren[k]: tuple(ren[d] for d in v) for k, v in g.deps.items()})

