"""Forward steps in bulk: columns, vectorised hysteresis, per-piece summaries.

    StepRecord* ─── StepColumns.from_records ──┐
    simulator / engine arrays ──────────────────┴─► StepColumns (one worker, time order)
        └─► bucket_labels: buckets, then hysteresis over runs of equal buckets
            └─► rollout_pieces: index ranges of one regime, cut by tool waits
                └─► summaries with np.add.reduceat ─► SubStage fields

Hysteresis over runs is the same rule as the online `BucketTracker`: a maximal run of
at least L_b steps in a new bucket switches the regime from the run's first step;
shorter runs stay in the current regime (a property test checks they agree).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from jigsaw.graph.substage import StepRecord, SubStageKind

_FIELDS = ("t_start_s", "t_end_s", "num_prefill_tokens", "num_decode_reqs", "kv_tokens_used", "mem_bytes", "flops",
           "slowdown")


_FLOAT = ("t_start_s", "t_end_s", "flops", "slowdown")


@dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class StepColumns:
    """Rollout forward steps of one worker in one RL step, one array per StepRecord field."""

    pipeline: str
    step: int
    dp_rank: int
    t_start_s: np.ndarray
    t_end_s: np.ndarray
    num_prefill_tokens: np.ndarray
    num_decode_reqs: np.ndarray
    kv_tokens_used: np.ndarray
    mem_bytes: np.ndarray
    flops: np.ndarray
    slowdown: np.ndarray

    def __post_init__(self) -> None:
        n = len(self.t_start_s)
        if any(len(getattr(self, f)) != n for f in _FIELDS):
            raise ValueError(f"StepColumns {self.pipeline}/{self.step}/r{self.dp_rank}: columns differ in length")
        if n and (np.any(self.t_end_s < self.t_start_s) or np.any(np.diff(self.t_start_s) < 0)):
            raise ValueError(f"StepColumns {self.pipeline}/{self.step}/r{self.dp_rank}: steps must be in time "
                             "order and end after they start")

    def __len__(self) -> int:
        return len(self.t_start_s)

    @property
    def num_tokens(self) -> np.ndarray:
        return self.num_prefill_tokens + self.num_decode_reqs

    @classmethod
    def from_records(cls, records: Sequence[StepRecord]) -> StepColumns:
        """Columns of rollout records of one worker (sorted by start time)."""
        recs = sorted(records, key=lambda r: (r.t_start_s, r.t_end_s))
        first = recs[0]
        cols = {f: np.array([getattr(r, f) for r in recs], dtype=float if f in _FLOAT else np.int64)
                for f in _FIELDS}
        return cls(pipeline=first.pipeline, step=first.step, dp_rank=first.dp_rank, **cols)

    @classmethod
    def concat(cls, parts: Sequence[StepColumns]) -> StepColumns:
        parts = [p for p in parts if len(p)]
        first = parts[0]
        return cls(pipeline=first.pipeline, step=first.step, dp_rank=first.dp_rank,
                   **{f: np.concatenate([getattr(p, f) for p in parts]) for f in _FIELDS})


def bucket_labels(token_counts: np.ndarray, edges: Sequence[int], hysteresis_steps: int) -> np.ndarray:
    """Bucket of every step after hysteresis (transitions dated back to the run start)."""
    buckets = np.searchsorted(np.asarray(edges), np.asarray(token_counts), side="right")
    if len(buckets) == 0:
        return buckets
    starts = np.flatnonzero(np.diff(buckets)) + 1
    starts = np.concatenate(([0], starts))
    ends = np.concatenate((starts[1:], [len(buckets)]))
    labels = np.empty_like(buckets)
    current = buckets[0]
    for s, e in zip(starts.tolist(), ends.tolist()):
        value = buckets[s]
        if value != current and e - s >= hysteresis_steps:
            current = value
        labels[s:e] = current
    return labels


def kind_of_bucket(bucket: int, num_buckets: int) -> SubStageKind:
    if bucket == 0:
        return SubStageKind.ROLLOUT_TAIL
    if bucket == num_buckets - 1:
        return SubStageKind.ROLLOUT_PREFILL
    return SubStageKind.ROLLOUT_DECODE


def rollout_pieces(cols: StepColumns | None, tools: Sequence[StepRecord], edges: Sequence[int],
                   hysteresis_steps: int) -> list[tuple[SubStageKind, dict]]:
    """(kind, SubStage fields) of each piece of one worker's rollout, in time order."""
    tools = sorted(tools, key=lambda r: r.t_start_s)
    if cols is None or not len(cols):
        return [(SubStageKind.TOOL, _tool_fields(t)) for t in tools]
    labels = bucket_labels(cols.num_tokens, edges, hysteresis_steps)
    cut = np.searchsorted(cols.t_start_s, [t.t_start_s for t in tools], side="left")
    _check_tools(cols, tools, cut)
    bounds = np.flatnonzero(np.diff(labels)) + 1
    bounds = np.unique(np.concatenate(([0], bounds, cut, [len(cols)])))
    starts, stops = bounds[:-1], bounds[1:]
    fields = _summaries(cols, starts)
    num_buckets = len(edges) + 1
    pieces, next_tool = [], 0
    for k, (s, e) in enumerate(zip(starts.tolist(), stops.tolist())):
        while next_tool < len(tools) and cut[next_tool] <= s:
            pieces.append((SubStageKind.TOOL, _tool_fields(tools[next_tool])))
            next_tool += 1
        if e > s:
            pieces.append((kind_of_bucket(int(labels[s]), num_buckets), {f: v[k] for f, v in fields.items()}))
    pieces += [(SubStageKind.TOOL, _tool_fields(t)) for t in tools[next_tool:]]
    return pieces


def _check_tools(cols: StepColumns, tools: Sequence[StepRecord], cut: np.ndarray) -> None:
    for t, i in zip(tools, cut.tolist()):
        if (i > 0 and cols.t_end_s[i - 1] > t.t_start_s) or (i < len(cols) and cols.t_start_s[i] < t.t_end_s):
            raise ValueError(f"{t.pipeline}/{t.step}/rank{t.dp_rank}: tool record at {t.t_start_s} overlaps a "
                             "forward step; tool records mark waits with no forward step")


def _summaries(cols: StepColumns, starts: np.ndarray) -> dict[str, list]:
    """SubStage fields of the pieces beginning at `starts` (reduceat over the step columns)."""
    reqs = np.add.reduceat(cols.num_decode_reqs, starts)
    steps = np.diff(np.concatenate((starts, [len(cols)])))
    kv = np.add.reduceat(cols.kv_tokens_used, starts)
    span = np.maximum.reduceat(cols.t_end_s, starts) - cols.t_start_s[starts]
    # Exclusive time: each step counts for its duration over the slowdown it ran under.
    lost = np.add.reduceat((cols.t_end_s - cols.t_start_s) * (1.0 - 1.0 / cols.slowdown), starts)
    return {
        "duration_s": (span - lost).tolist(),
        "mem_bytes": np.maximum.reduceat(cols.mem_bytes, starts).astype(int).tolist(),
        "batch_size": (reqs / steps).tolist(),
        "seq_len": np.divide(kv, reqs, out=np.zeros(len(starts)), where=reqs > 0).tolist(),
        "num_steps": steps.astype(int).tolist(),
        "num_tokens": np.add.reduceat(cols.num_tokens, starts).astype(int).tolist(),
        "flops": np.add.reduceat(cols.flops, starts).tolist(),
    }


def _tool_fields(t: StepRecord) -> dict:
    return {"duration_s": t.duration_s, "mem_bytes": t.mem_bytes, "batch_size": float(t.num_decode_reqs),
            "seq_len": 0.0, "num_steps": 1, "num_tokens": 0, "flops": 0.0}


def summarise_stage(records: Sequence[StepRecord]) -> dict:
    """SubStage fields of a reference / training / reward stage on one worker."""
    reqs = sum(r.num_decode_reqs for r in records)
    span = max(r.t_end_s for r in records) - min(r.t_start_s for r in records)
    lost = sum(r.duration_s * (1.0 - 1.0 / r.slowdown) for r in records)
    return {"duration_s": span - lost,
            "mem_bytes": max(r.mem_bytes for r in records), "batch_size": float(reqs),
            "seq_len": sum(r.num_prefill_tokens for r in records) / reqs if reqs else 0.0,
            "num_steps": len(records), "num_tokens": sum(r.num_tokens for r in records),
            "flops": sum(r.flops for r in records)}

