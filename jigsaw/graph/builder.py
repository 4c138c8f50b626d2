"""Forward-step records -> sub-stage graph of one RL step, and the next step's prediction.

    StepRecord* (one pipeline, one step)
        │  rollout steps of each DP worker, in time order
        ▼
    bucket_of(tokens) ─► BucketTracker (hysteresis L_b) ─► per-step regime labels
        │  runs of equal labels, tool waits cut the chain
        ▼
    SubStage per run (+ one per reference / training / reward stage and worker)
        │  chains per worker, barriers between stages
        ▼
    SubStageGraph ──(last k steps, median)──► predict_next() ─► graph of step n+1

The tracker is the same object the pipeline-side client uses to report sub-stage
transitions, so the live runtime and the offline builder agree on boundaries.
"""

from __future__ import annotations

import bisect
import statistics
from collections import defaultdict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

from jigsaw.graph.graph import SubStageGraph
from jigsaw.graph.substage import STAGE_KIND, ROLLOUT_KINDS, Stage, StepRecord, SubStage, SubStageKind


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


def kind_of_bucket(bucket: int, num_buckets: int) -> SubStageKind:
    if bucket == 0:
        return SubStageKind.ROLLOUT_TAIL
    if bucket == num_buckets - 1:
        return SubStageKind.ROLLOUT_PREFILL
    return SubStageKind.ROLLOUT_DECODE


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

    def _transition(self, start: int, bucket: int) -> Transition:
        return Transition(start_index=start, bucket=bucket,
                          kind=kind_of_bucket(bucket, len(self._edges) + 1))


def regime_labels(token_counts: Sequence[int], config: GraphConfig = GraphConfig()) -> list[int]:
    """Bucket label of every step after hysteresis (transitions dated back)."""
    tracker = BucketTracker(config)
    labels: list[int] = []
    for n in token_counts:
        t = tracker.observe(n)
        labels.append(tracker.current)  # type: ignore[arg-type]
        if t is not None:
            labels[t.start_index:] = [t.bucket] * (len(labels) - t.start_index)
    return labels


def build_step_graph(records: Iterable[StepRecord], config: GraphConfig = GraphConfig()) -> SubStageGraph:
    """Sub-stage graph of one RL step of one pipeline from its records."""
    recs = sorted(records, key=lambda r: (r.t_start_s, r.t_end_s))
    if not recs:
        raise ValueError("no records")
    keys = {(r.pipeline, r.step) for r in recs}
    if len(keys) > 1:
        raise ValueError(f"records of several pipelines/steps given: {sorted(keys)[:4]}")
    pipeline, step = keys.pop()
    groups = _stage_groups(recs)
    layers = [_group_substages(pipeline, step, g, config) for g in groups]
    deps: dict[str, tuple[str, ...]] = {}
    prev_sinks: tuple[str, ...] = ()
    for chains in layers:
        for chain in chains:
            deps[chain[0].id] = prev_sinks
            for a, b in zip(chain, chain[1:]):
                deps[b.id] = (a.id,)
        prev_sinks = tuple(chain[-1].id for chain in chains)
    nodes = [s for chains in layers for chain in chains for s in chain]
    return SubStageGraph(nodes, deps)


def _stage_groups(recs: list[StepRecord]) -> list[list[StepRecord]]:
    """Records grouped by stage in order of first appearance; tool waits join rollout."""
    order: list[Stage] = []
    by_stage: dict[Stage, list[StepRecord]] = defaultdict(list)
    for r in recs:
        stage = Stage.ROLLOUT if r.stage is Stage.TOOL else r.stage
        if stage not in by_stage:
            order.append(stage)
        by_stage[stage].append(r)
    return [by_stage[s] for s in order]


def _group_substages(pipeline: str, step: int, recs: list[StepRecord],
                     config: GraphConfig) -> list[list[SubStage]]:
    """One chain of sub-stages per DP worker for a stage group."""
    by_rank: dict[int, list[StepRecord]] = defaultdict(list)
    for r in recs:
        by_rank[r.dp_rank].append(r)
    chains = []
    for rank in sorted(by_rank):
        rank_recs = by_rank[rank]
        if rank_recs[0].stage in (Stage.ROLLOUT, Stage.TOOL):
            runs = _rollout_runs(rank_recs, config)
        else:
            runs = [(STAGE_KIND[rank_recs[0].stage], rank_recs)]
        chains.append(_number(pipeline, step, rank, runs))
    return chains


def _rollout_runs(recs: list[StepRecord], config: GraphConfig) -> list[tuple[SubStageKind, list[StepRecord]]]:
    labels = iter(regime_labels([r.num_tokens for r in recs if r.stage is Stage.ROLLOUT], config))
    num_buckets = len(config.bucket_edges) + 1
    runs: list[tuple[SubStageKind, list[StepRecord]]] = []
    last_end = float("-inf")
    for r in recs:
        if r.stage is Stage.TOOL:
            if r.t_start_s < last_end:
                raise ValueError(f"{r.pipeline}/{r.step}/rank{r.dp_rank}: tool record at {r.t_start_s} "
                                 "overlaps a forward step; tool records mark waits with no forward step")
            runs.append((SubStageKind.TOOL, [r]))
            last_end = r.t_end_s
            continue
        kind = kind_of_bucket(next(labels), num_buckets)
        if runs and runs[-1][0] is kind:
            runs[-1][1].append(r)
        else:
            runs.append((kind, [r]))
        last_end = max(last_end, r.t_end_s)
    return runs


def _number(pipeline: str, step: int, rank: int,
            runs: list[tuple[SubStageKind, list[StepRecord]]]) -> list[SubStage]:
    seen: dict[SubStageKind, int] = defaultdict(int)
    out = []
    for kind, recs in runs:
        ordinal = seen[kind]
        seen[kind] += 1
        out.append(_summarise(f"{pipeline}/{step}/r{rank}/{kind.value}/{ordinal}", kind, recs))
    return out


def _summarise(sid: str, kind: SubStageKind, recs: list[StepRecord]) -> SubStage:
    first = recs[0]
    reqs = sum(r.num_decode_reqs for r in recs)
    tokens = sum(r.num_tokens for r in recs)
    if kind in ROLLOUT_KINDS:
        batch = reqs / len(recs)
        seq = sum(r.kv_tokens_used for r in recs) / reqs if reqs else 0.0
    else:
        batch = float(reqs)
        seq = sum(r.num_prefill_tokens for r in recs) / reqs if reqs else 0.0
    return SubStage(
        id=sid, pipeline=first.pipeline, step=first.step, kind=kind, dp_rank=first.dp_rank,
        duration_s=max(r.t_end_s for r in recs) - first.t_start_s,
        mem_bytes=max(r.mem_bytes for r in recs), batch_size=batch, seq_len=seq,
        num_steps=len(recs), num_tokens=tokens, flops=sum(r.flops for r in recs),
    )


def _position(s: SubStage) -> str:
    """Id without pipeline and step: the same position in another step's graph."""
    return s.id.split("/", 2)[2]


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
    rename = {s.id: f"{s.pipeline}/{nxt}/{_position(s)}" for s in latest}
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

    def add_step(self, records: Iterable[StepRecord]) -> SubStageGraph:
        graph = build_step_graph(records, self.config)
        self._history[graph.pipeline].append(graph)
        return graph

    def history(self, pipeline: str) -> tuple[SubStageGraph, ...]:
        return tuple(self._history.get(pipeline, ()))

    def predict(self, pipeline: str) -> SubStageGraph:
        if pipeline not in self._history:
            raise KeyError(f"no steps recorded for pipeline {pipeline!r}")
        return predict_next(self._history[pipeline], self.config)
