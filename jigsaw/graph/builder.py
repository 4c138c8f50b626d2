"""Forward-step records -> sub-stage graph of one RL step, and the next step's prediction.

    StepRecord* and/or StepColumns (one pipeline, one step)
        │  rollout steps of each DP worker, in time order (steps.py)
        ▼
    buckets of tokens per forward ─► hysteresis (L_b) ─► per-step regime labels
        │  runs of equal labels, tool waits cut the chain
        ▼
    SubStage per run (+ one per reference / training / reward stage and worker)
        │  chains per worker, barriers between stages
        ▼
    SubStageGraph ──(last k steps, median)──► predict_next() ─► graph of step n+1

`BucketTracker` is the online form of the same rule, for the pipeline-side client that
reports sub-stage transitions as they happen; a property test keeps the two in step.
"""

from __future__ import annotations

import bisect
import statistics
from collections import defaultdict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import numpy as np

from jigsaw.graph.graph import SubStageGraph
from jigsaw.graph.ids import SubStageId, position_of, with_step
from jigsaw.graph.steps import StepColumns, bucket_labels, kind_of_bucket, rollout_pieces, summarise_stage
from jigsaw.graph.substage import STAGE_KIND, Stage, StepRecord, SubStage, SubStageKind


@dataclass(frozen=True, kw_only=True, slots=True)
class GraphConfig:
    """How records become sub-stages (paper §4.1)."""

    bucket_edges: tuple[int, ...] = (128, 1024)
    """Tokens-per-forward boundaries between rollout regimes; the lowest bucket is the
    long tail, the highest prefill-heavy, the ones between large-batch decode."""
    hysteresis_steps: int = 10
    """L_b: consecutive forward steps a new bucket must hold before the sub-stage changes."""
    history_steps: int = 3
    """Recent RL steps whose median predicts the next step's graph."""

    def __post_init__(self) -> None:
        edges = self.bucket_edges
        if not edges or any(e <= 0 for e in edges) or any(b <= a for a, b in zip(edges, edges[1:])):
            raise ValueError(f"bucket_edges must be positive and strictly increasing, got {edges}")
        if self.hysteresis_steps < 1:
            raise ValueError(f"hysteresis_steps must be >= 1, got {self.hysteresis_steps}")
        if self.history_steps < 1:
            raise ValueError(f"history_steps must be >= 1, got {self.history_steps}")


def bucket_of(num_tokens: int, edges: Sequence[int]) -> int:
    """Index of the bucket `[edges[i-1], edges[i])` holding `num_tokens`."""
    return bisect.bisect_right(edges, num_tokens)


@dataclass(frozen=True, kw_only=True, slots=True)
class Transition:
    """The regime changed: from forward step `start_index` on, tokens are in `bucket`."""

    start_index: int
    bucket: int
    kind: SubStageKind


class BucketTracker:
    """Online hysteresis over forward steps of one worker.

    The first step sets the regime.  A different bucket becomes the regime only after
    it held for `hysteresis_steps` consecutive steps; the transition is then dated back
    to the first of those steps, so short fluctuations never split a sub-stage.
    """

    __slots__ = ("_edges", "_need", "current", "_cand", "_run", "_run_start", "_index")

    def __init__(self, config: GraphConfig = GraphConfig()):
        self._edges = config.bucket_edges
        self._need = config.hysteresis_steps
        self.current: int | None = None
        self._cand: int | None = None
        self._run = 0
        self._run_start = 0
        self._index = 0

    def observe(self, num_tokens: int) -> Transition | None:
        b = bucket_of(num_tokens, self._edges)
        i, self._index = self._index, self._index + 1
        if self.current is None:
            self.current = b
            return self._transition(i, b)
        if b == self.current:
            self._cand, self._run = None, 0
            return None
        if b != self._cand:
            self._cand, self._run, self._run_start = b, 0, i
        self._run += 1
        if self._run < self._need:
            return None
        self.current, self._cand, self._run = b, None, 0
        return self._transition(self._run_start, b)

    def steps_to_switch(self, num_tokens: int) -> int | None:
        """How many more steps of `num_tokens` make the regime switch (None: they never do)."""
        b = bucket_of(num_tokens, self._edges)
        if self.current is None:
            return 1
        if b == self.current:
            return None
        return self._need - (self._run if b == self._cand else 0)

    def observe_many(self, num_tokens: int, count: int) -> Transition | None:
        """`count` identical steps at once.  A switch among them is dated back to the run's
        first step as usual; `steps_to_switch` tells when it is detected."""
        if count < 1:
            return None
        switch = self.observe(num_tokens)
        rest = count - 1
        self._index += rest
        if rest == 0 or switch is not None or bucket_of(num_tokens, self._edges) == self.current:
            return switch
        self._run += rest
        if self._run < self._need:
            return None
        self.current, self._cand, self._run = self._cand, None, 0
        return self._transition(self._run_start, self.current)

    def _transition(self, start: int, bucket: int) -> Transition:
        return Transition(start_index=start, bucket=bucket,
                          kind=kind_of_bucket(bucket, len(self._edges) + 1))


def regime_labels(token_counts: Sequence[int], config: GraphConfig = GraphConfig()) -> list[int]:
    """Bucket label of every step after hysteresis (transitions dated back)."""
    return bucket_labels(np.asarray(token_counts), config.bucket_edges, config.hysteresis_steps).tolist()


def build_step_graph(records: Iterable[StepRecord] = (), config: GraphConfig = GraphConfig(), *,
                     columns: Iterable[StepColumns] = ()) -> SubStageGraph:
    """Sub-stage graph of one RL step of one pipeline.

    `records` may hold every stage; `columns` carry rollout forward steps in bulk (a
    simulator or an engine adapter that batches its reports).  Both go through the
    same bucketing and hysteresis."""
    recs = sorted(records, key=lambda r: (r.t_start_s, r.t_end_s))
    cols = [c for c in columns if len(c)]
    keys = {(r.pipeline, r.step) for r in recs} | {(c.pipeline, c.step) for c in cols}
    if not keys:
        raise ValueError("no records")
    if len(keys) > 1:
        raise ValueError(f"records of several pipelines/steps given: {sorted(keys)[:4]}")
    pipeline, step = keys.pop()
    return _layered([_chains(pipeline, step, stage, rs, cs, config) for stage, rs, cs in _stage_groups(recs, cols)])


def _layered(layers: list[list[list[SubStage]]]) -> SubStageGraph:
    """Stage layers, each a chain per worker: chains in order, a barrier between layers."""
    deps: dict[str, tuple[str, ...]] = {}
    prev_sinks: tuple[str, ...] = ()
    for chains in layers:
        for chain in chains:
            deps[chain[0].id] = prev_sinks
            for a, b in zip(chain, chain[1:]):
                deps[b.id] = (a.id,)
        prev_sinks = tuple(chain[-1].id for chain in chains)
    return SubStageGraph([s for chains in layers for chain in chains for s in chain], deps)


STAGE_ORDER = (Stage.ROLLOUT, Stage.REWARD, Stage.REFERENCE, Stage.TRAINING)
_STAGE_OF = {SubStageKind.TOOL: Stage.ROLLOUT, SubStageKind.REWARD: Stage.REWARD,
             SubStageKind.REFERENCE: Stage.REFERENCE, SubStageKind.TRAINING: Stage.TRAINING}


def assemble_step_graph(pieces: Iterable[SubStage], first_start_s: dict[str, float]) -> SubStageGraph:
    """One step's graph from finished sub-stages (e.g. rebuilt from a trace): per stage, one
    chain per worker in order of `first_start_s`, stages in RL order, barriers between."""
    by_stage: dict[Stage, dict[int, list[SubStage]]] = {}
    for s in sorted(pieces, key=lambda s: first_start_s[s.id]):
        stage = _STAGE_OF.get(s.kind, Stage.ROLLOUT)
        by_stage.setdefault(stage, {}).setdefault(s.dp_rank, []).append(s)
    return _layered([[chains[r] for r in sorted(chains)] for st in STAGE_ORDER if (chains := by_stage.get(st))])


def _stage_groups(recs: list[StepRecord], cols: list[StepColumns]):
    """(stage, records, columns) in order of first appearance; tool waits join rollout."""
    first: dict[Stage, float] = {}
    by_stage: dict[Stage, list[StepRecord]] = defaultdict(list)
    for r in recs:
        stage = Stage.ROLLOUT if r.stage is Stage.TOOL else r.stage
        first.setdefault(stage, r.t_start_s)
        by_stage[stage].append(r)
    if cols:
        first[Stage.ROLLOUT] = min([first.get(Stage.ROLLOUT, float("inf"))] + [float(c.t_start_s[0]) for c in cols])
    order = sorted(first, key=first.__getitem__)
    return [(s, by_stage[s], cols if s is Stage.ROLLOUT else []) for s in order]


def _chains(pipeline: str, step: int, stage: Stage, recs: list[StepRecord], cols: list[StepColumns],
            config: GraphConfig) -> list[list[SubStage]]:
    """One chain of sub-stages per DP worker for a stage group."""
    ranks = sorted({r.dp_rank for r in recs} | {c.dp_rank for c in cols})
    chains = []
    for rank in ranks:
        mine = [r for r in recs if r.dp_rank == rank]
        if stage is Stage.ROLLOUT:
            fwd = [c for c in cols if c.dp_rank == rank]
            steps = [r for r in mine if r.stage is Stage.ROLLOUT]
            if steps:
                fwd.append(StepColumns.from_records(steps))
            merged = StepColumns.concat(sorted(fwd, key=lambda c: float(c.t_start_s[0]))) if fwd else None
            tools = [r for r in mine if r.stage is Stage.TOOL]
            pieces = rollout_pieces(merged, tools, config.bucket_edges, config.hysteresis_steps)
        else:
            pieces = [(STAGE_KIND[stage], summarise_stage(mine))]
        chains.append(_number(pipeline, step, rank, pieces))
    return chains


def _number(pipeline: str, step: int, rank: int, pieces: list[tuple[SubStageKind, dict]]) -> list[SubStage]:
    seen: dict[SubStageKind, int] = defaultdict(int)
    out = []
    for kind, fields in pieces:
        ordinal = seen[kind]
        seen[kind] += 1
        out.append(SubStage(id=str(SubStageId(pipeline, step, rank, kind, ordinal)), pipeline=pipeline,
                            step=step, kind=kind, dp_rank=rank, **fields))
    return out


def _position(s: SubStage) -> str:
    """Id without pipeline and step: the same position in another step's graph."""
    return position_of(s.id)


def predict_next(history: Sequence[SubStageGraph], config: GraphConfig = GraphConfig()) -> SubStageGraph:
    """Graph of the step after `history[-1]` (inter-step consistency, paper §4.1).

    The structure is the latest step's; each sub-stage's numbers are the median over
    the last `history_steps` graphs of the sub-stage at the same position (worker,
    kind, ordinal), where that position exists.
    """
    if not history:
        raise ValueError("predict_next needs at least one step graph")
    recent = list(history)[-config.history_steps:]
    latest = recent[-1]
    if len(latest.steps) != 1:
        raise ValueError(f"history graphs must hold one step each, got steps {latest.steps}")
    by_pos = [{_position(s): s for s in g} for g in recent]
    nxt = latest.steps[0] + 1
    rename = {s.id: with_step(s.id, nxt) for s in latest}
    nodes = [_median_substage(s, [m[_position(s)] for m in by_pos if _position(s) in m], rename[s.id], nxt)
             for s in latest]
    deps = {rename[sid]: tuple(rename[d] for d in ds) for sid, ds in latest.deps.items()}
    return SubStageGraph(nodes, deps)


def _median_substage(base: SubStage, seen: list[SubStage], sid: str, step: int) -> SubStage:
    def med(field: str) -> float:
        return statistics.median(getattr(s, field) for s in seen)

    return replace(
        base, id=sid, step=step, duration_s=med("duration_s"), mem_bytes=int(med("mem_bytes")),
        batch_size=med("batch_size"), seq_len=med("seq_len"), num_steps=max(1, round(med("num_steps"))),
        num_tokens=int(med("num_tokens")), flops=med("flops"),
    )


class GraphBuilder:
    """Keeps the last few step graphs of each pipeline and predicts the next one."""

    def __init__(self, config: GraphConfig = GraphConfig()):
        self.config = config
        self._history: dict[str, deque[SubStageGraph]] = defaultdict(
            lambda: deque(maxlen=config.history_steps))

    def add_step(self, records: Iterable[StepRecord] = (), *, columns: Iterable[StepColumns] = ()) -> SubStageGraph:
        graph = build_step_graph(records, self.config, columns=columns)
        self._history[graph.pipeline].append(graph)
        return graph

    def history(self, pipeline: str) -> tuple[SubStageGraph, ...]:
        return tuple(self._history.get(pipeline, ()))

    def predict(self, pipeline: str) -> SubStageGraph:
        if pipeline not in self._history:
            raise KeyError(f"no steps recorded for pipeline {pipeline!r}")
        return predict_next(self._history[pipeline], self.config)
