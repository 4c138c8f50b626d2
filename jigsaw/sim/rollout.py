"""Continuous-batching rollout engine of one DP worker, simulated a batch segment at a time.

    Request (request.py: prompt, tokens per turn, appended context, tool latency)
        │ queue ──► prefill step: up to `prefill_chunk` prompt tokens in one forward
        │ decoding ─► decode segment: k steps with the same batch b;
        │             step j takes s·(c0(b) + c1·(KV0 + j·b))  (StepCost, exact for decode)
        │             it ends where a turn ends, a tool returns, the regime switches, or
        │             interrupt(t) changes the slowdown s
        │ turn done ─► next turn (its context is prefilled), a tool wait, or finished
        ▼
    every forward step as columns (for the graph builder) + TOOL records for waits in
    which the worker has nothing to run; the live sub-stage (kind, ordinal, start) as the
    pipeline-side client would report it, from the same BucketTracker.

A migration takes requests out (`take`) and puts them into another worker (`add`),
which prefills their whole context again: the KV recompute the paper charges.

Its KV pool (kvpool.py) is bounded by its memory grant, like an engine's.
"""

from __future__ import annotations

import heapq
from collections import defaultdict, deque
from dataclasses import dataclass, field

import numpy as np

from jigsaw.graph.builder import BucketTracker, GraphConfig
from jigsaw.graph.ids import SubStageId
from jigsaw.graph.steps import StepColumns, kind_of_bucket
from jigsaw.graph.substage import Stage, StepRecord, SubStageKind
from jigsaw.mux.model.costmodel import StepCost
from jigsaw.sim.kvpool import DoesNotFit, KVPool
from jigsaw.sim.request import Request


@dataclass(frozen=True, slots=True)
class LivePiece:
    """The sub-stage a worker is in, as its client would report it."""

    kind: SubStageKind
    ordinal: int
    start_s: float


@dataclass(slots=True)
class _Segment:
    kind: str  # "prefill" | "decode" | "idle"
    t0: float
    ends: np.ndarray
    """End time of each step (idle: one entry, the wake-up time)."""
    batch: int = 0
    prefill: list[tuple[Request, int]] = field(default_factory=list)
    switch_at_end: bool = False


@dataclass(slots=True)
class Outcome:
    """What committing a segment changed (the node re-plans on any of these)."""

    switched: bool = False
    idle_ended: bool = False
    finished: bool = False
    completed: list[Request] = field(default_factory=list)


class RolloutWorker(KVPool):
    """One DP worker's engine for one RL step."""

    def __init__(self, *, pipeline: str, step: int, rank: int, cost: StepCost, mem_bytes: int,
                 graph_config: GraphConfig = GraphConfig(), prefill_chunk: int = 8192,
                 blocking_tools: bool = False, max_new_tokens: int = 8192, deadline_s: float | None = None,
                 tool_cores: int = 0):
        self.pipeline, self.step, self.rank = pipeline, step, rank
        self.tool_free_s: list[float] = [0.0] * tool_cores
        """When each of the worker's tool cores is next free (a heap; empty: calls never wait)."""
        self.cost, self.mem_bytes, self.chunk = cost, mem_bytes, prefill_chunk
        self.blocking, self.max_new_tokens = blocking_tools, max_new_tokens
        self.deadline_s = deadline_s
        self.unreported: list[Request] = []
        """Requests finished since the pipeline last asked (`drain`): a segment cut short by an
        interrupt or a migration finishes requests too."""
        """Trajectories still running then are cut where they are (a wall-clock limit)."""
        self.device_tokens = self.tokens_in(cost.device.mem_bytes)
        """KV tokens the whole device holds beside the weights and the reserve."""
        self.cap_tokens = self.device_tokens
        """KV tokens it may hold under its current memory grant (an engine sizes its pool from
        the memory it is given; `mem_bytes` is only what it expects to need, for packing)."""
        self.retracted = 0
        """Requests retracted (or evicted from a tool wait) and recomputed, this step."""
        self.undersized = False
        """A grant left less than one whole response needs (the engine ran at that minimum)."""
        self.queue: deque[Request] = deque()
        self.decoding: list[Request] = []
        self.in_tool: list[Request] = []
        self.barrier: list[Request] = []
        self.finished: list[Request] = []
        self.t, self.s = 0.0, 1.0
        self.tracker = BucketTracker(graph_config)
        self._graph_config = graph_config
        self.piece: LivePiece | None = None
        self._ordinal: dict[SubStageKind, int] = defaultdict(int)
        self._asked_first: SubStageKind | None = None
        """The kind `first_piece_id` predicted (the client asked admission for it), until the
        first piece opens."""
        self._recent_starts: deque[float] = deque(maxlen=graph_config.hysteresis_steps + 1)
        self._steps = 0
        self._counted = (0, 0, 0, 0)
        self._cols: list[dict[str, np.ndarray]] = []
        self.tools: list[StepRecord] = []
        self.segment: _Segment | None = None

    # ------------------------------------------------------------ requests

    def add(self, requests: list[Request], t: float) -> None:
        """New (or migrated) requests: their whole context is prefilled here."""
        for r in requests:
            if r.final_context > self.device_tokens:
                raise DoesNotFit(f"{self.pipeline}: a response of {r.final_context:,} tokens (prompt, turns, tool "
                                 f"output) does not fit a rollout KV pool of {self.device_tokens:,} tokens (a whole "
                                 "device); the model needs more memory per device (rollout_tp) or a lower max_tokens")
            r.pending = r.context
            self.queue.append(r)
        self.t = max(self.t, t)

    def take(self, rids: set[int]) -> list[Request]:
        """Abort these requests here and hand them over with what they generated so far."""
        out = [r for r in self._active() if r.rid in rids]
        gone = {id(r) for r in out}
        self.queue = deque(r for r in self.queue if id(r) not in gone)
        self.decoding = [r for r in self.decoding if id(r) not in gone]
        self.in_tool = [r for r in self.in_tool if id(r) not in gone]
        self.barrier = [r for r in self.barrier if id(r) not in gone]
        return out

    def _active(self) -> list[Request]:
        return [*self.queue, *self.decoding, *self.in_tool, *self.barrier]

    @property
    def num_active(self) -> int:
        return len(self.queue) + len(self.decoding) + len(self.in_tool) + len(self.barrier)

    @property
    def done(self) -> bool:
        return self.num_active == 0

    @property
    def on_device(self) -> bool:
        """Whether the worker has forward steps to run (not just waiting on tools)."""
        return bool(self.queue or self.decoding)

    # ------------------------------------------------------------ segments

    def plan(self) -> float | None:
        """Plan the next segment from the worker's clock; its end time, or None when done."""
        self._wake_tools(self.t)
        batch = self._admit() if self.queue else []
        if batch:
            self.segment = self._plan_prefill(batch)
        elif self.decoding:
            self.segment = self._plan_decode()
        elif self.in_tool:
            self.segment = self._plan_idle()
        else:
            self.segment = None
            return None
        return float(self.segment.ends[-1])

    def _plan_idle(self) -> _Segment:
        """Nothing to run until a tool returns: the device is free, the worker is in TOOL."""
        wake = max(self.t, min(min(r.ready_at for r in self.in_tool), self._deadline()))
        if self.piece is None or self.piece.kind is not SubStageKind.TOOL:
            self.tools.append(StepRecord(pipeline=self.pipeline, step=self.step, stage=Stage.TOOL,
                                         dp_rank=self.rank, t_start_s=self.t, t_end_s=wake,
                                         num_decode_reqs=len(self.in_tool)))
            self._new_piece(SubStageKind.TOOL, self.t)
        return _Segment("idle", self.t, np.array([wake]))

    def _plan_prefill(self, batch: list[tuple[Request, int]]) -> _Segment:
        tokens = sum(n for _, n in batch)
        ctx = sum(r.context - r.pending for r, _ in batch) / len(batch)
        dur = self.s * self.cost.prefill_s(tokens, int(ctx), len(batch))
        seg = _Segment("prefill", self.t, np.array([self.t + dur]), prefill=batch)
        seg.switch_at_end = self.tracker.steps_to_switch(tokens) == 1
        return seg

    def _plan_decode(self) -> _Segment:
        room = self._room_for(len(self.decoding))
        b = len(self.decoding)
        k = min(min(r.left for r in self.decoding), max(1, room // b))
        switch = self.tracker.steps_to_switch(b)
        if switch is not None:
            k = min(k, switch)
        kv0 = sum(r.context for r in self.decoding)
        co = self.cost.decode(b)
        step_s = self.s * (co.c0_s + co.c1_s_per_token * (kv0 + b * np.arange(k)))
        ends = self.t + np.cumsum(step_s)
        # Steps that start after a tool returns wait for its prefill; none starts past the deadline.
        wake = min(min((r.ready_at for r in self.in_tool), default=np.inf), self._deadline())
        if wake < ends[-1]:
            starts = np.concatenate(([self.t], ends[:-1]))
            ends = ends[: max(1, int(np.searchsorted(starts, wake, side="left")))]
        seg = _Segment("decode", self.t, ends, batch=b)
        seg.switch_at_end = switch is not None and len(ends) == switch
        return seg

    def commit(self, upto_s: float | None = None) -> Outcome:
        """Run the planned segment to its end, or only its steps that start before `upto_s`."""
        seg, out = self.segment, Outcome()
        if seg is None:
            return out
        if seg.kind == "idle":
            end = float(seg.ends[0]) if upto_s is None else min(float(seg.ends[0]), upto_s)
            self._idle_until(end, out)
        else:
            n = len(seg.ends) if upto_s is None else int(np.searchsorted(
                np.concatenate(([seg.t0], seg.ends[:-1])), upto_s, side="left"))
            if n:
                (self._commit_prefill if seg.kind == "prefill" else self._commit_decode)(seg, n, out)
        self.segment = None
        if self.deadline_s is not None and self.t >= self.deadline_s and self.num_active:
            self._cut(out)
        out.finished = self.done
        return out

    def drain(self) -> list[Request]:
        """Requests finished since the last call, for the pipeline's accounting."""
        out, self.unreported = self.unreported, []
        return out

    def _deadline(self) -> float:
        return np.inf if self.deadline_s is None else self.deadline_s

    def _cut(self, out: Outcome) -> None:
        """The wall-clock limit: every unfinished trajectory ends with what it generated."""
        for r in self._active():
            r.cut()
            self.finished.append(r)
            out.completed.append(r)
            self.unreported.append(r)
        self.queue.clear()
        self.decoding, self.in_tool, self.barrier = [], [], []

    def settle(self, t: float) -> None:
        """Finish the steps started before `t` and plan nothing: requests are about to move."""
        if self.segment is not None:
            self.commit(upto_s=t)
        self.t = max(self.t, t)

    def interrupt(self, t: float, slowdown: float) -> float | None:
        """A new slowdown from `t`: finish the steps already started, re-plan from there."""
        if self.segment is not None and self.segment.kind == "idle":
            self.s = slowdown
            return float(self.segment.ends[0])
        if self.segment is not None:
            self.commit(upto_s=t)
        self.s = slowdown
        self.t = max(self.t, t)
        return self.plan()

    # ------------------------------------------------------------ committing

    def _commit_prefill(self, seg: _Segment, n: int, out: Outcome) -> None:
        tokens = 0
        for r, k in seg.prefill:
            r.pending -= k
            tokens += k
        joined = [r for r, _ in seg.prefill if r.pending == 0]
        for r in joined:
            self.queue.remove(r)
        self.decoding.extend(joined)
        kv = sum(r.context - r.pending for r in [*self.decoding, *self.queue])
        self._record(seg.ends[:1], np.array([seg.t0]), tokens, 0, np.array([kv]))
        out.switched = self._observe(tokens, 1, np.array([seg.t0]))
        self.t = float(seg.ends[0])

    def _commit_decode(self, seg: _Segment, n: int, out: Outcome) -> None:
        b, ends = seg.batch, seg.ends[:n]
        starts = np.concatenate(([seg.t0], ends[:-1]))
        kv0 = sum(r.context for r in self.decoding)
        self._record(ends, starts, 0, b, kv0 + b * np.arange(1, n + 1))
        out.switched = self._observe(b, n, starts)
        self.t = float(ends[-1])
        for r in self.decoding:
            r.generated += n
            r.context += n
        for r in [r for r in self.decoding if r.left == 0]:
            self.decoding.remove(r)
            self._end_turn(r, out)
        self._release_barrier()

    def _end_turn(self, r: Request, out: Outcome) -> None:
        if r.turn + 1 == len(r.turns):
            self.finished.append(r)
            out.completed.append(r)
            self.unreported.append(r)
            return
        added = r.next_turn()
        wait = float(r.tool_s[r.turn - 1])
        if wait > 0 and self.blocking:
            self.barrier.append(r)
        elif wait > 0:
            r.ready_at = self._call(wait)
            self.in_tool.append(r)
        elif added:
            self.queue.append(r)
        else:
            self.decoding.append(r)

    def _release_barrier(self) -> None:
        """Blocked tool calls go out together once every unfinished request reached one."""
        if self.barrier and not self.decoding and not self.queue and not self.in_tool:
            back = max(self._call(float(r.tool_s[r.turn - 1])) for r in self.barrier)
            for r in self.barrier:
                r.ready_at = back
            self.in_tool.extend(self.barrier)
            self.barrier.clear()

    def _call(self, wait_s: float) -> float:
        """A tool call made now: when it returns, once a tool core is free for it (calls are
        made in time order, so the earliest-free core is the one a FIFO queue would give)."""
        if not self.tool_free_s:
            return self.t + wait_s
        end = max(self.t, heapq.heappop(self.tool_free_s)) + wait_s
        heapq.heappush(self.tool_free_s, end)
        return end

    def _wake_tools(self, t: float) -> None:
        back = [r for r in self.in_tool if r.ready_at <= t]
        for r in back:
            self.in_tool.remove(r)
            (self.queue if r.pending else self.decoding).append(r)

    def _idle_until(self, end: float, out: Outcome) -> None:
        self.t = max(self.t, end)
        self._wake_tools(self.t)
        if self.on_device and self.tracker.current is not None:
            self._new_piece(kind_of_bucket(self.tracker.current, len(self.tracker._edges) + 1), self.t)
            out.idle_ended = True

    # ------------------------------------------------------------ live sub-stage

    def _observe(self, tokens: int, count: int, starts: np.ndarray) -> bool:
        """Feed the live tracker; on a switch open the new piece where its run began."""
        recent = self._recent_starts
        recent.extend(starts[-recent.maxlen:].tolist())
        self._steps += count
        switch = self.tracker.observe_many(tokens, count)
        if switch is None:
            return False
        # A switch is detected L_b steps into its run (or at the very first step), so the
        # run's first step is among the last L_b + 1 starts.
        offset = switch.start_index - (self._steps - len(recent))
        self._new_piece(switch.kind, recent[max(0, offset)])
        return True

    def _new_piece(self, kind: SubStageKind, start: float) -> None:
        first, self._asked_first = self._asked_first, None
        if first is not None and first is not kind:
            # The tracker opened another kind than the first chunk predicted: the predicted
            # piece's id was asked for (and ends here), so that kind's next piece is its second.
            self._ordinal[first] = 1
        ordinal = self._ordinal[kind]
        self._ordinal[kind] += 1
        self.piece = LivePiece(kind=kind, ordinal=ordinal, start_s=start)

    def piece_id(self) -> str | None:
        p = self.piece
        return None if p is None else str(SubStageId(self.pipeline, self.step, self.rank, p.kind, p.ordinal))

    def first_piece_id(self) -> str:
        """The id its first forward step will open (what its client asks admission for); kept,
        so that a first piece the tracker opens as another kind does not reuse it."""
        budget, tokens = self.chunk, 0
        for r in self.queue:
            if budget <= 0:
                break
            n = min(r.pending, budget)
            tokens, budget = tokens + n, budget - n
        kind = BucketTracker(self._graph_config).observe(tokens).kind
        self._asked_first = kind
        return str(SubStageId(self.pipeline, self.step, self.rank, kind, 0))

    # ------------------------------------------------------------ records

    def counters(self, before_s: float | None = None) -> tuple[int, int, int, int]:
        """Forward steps, tokens, decoding requests (summed over steps) and KV tokens read, so
        far this step (of the steps that began before `before_s`): what a live client counts
        for the regime it reports."""
        steps, tokens, reqs, kv = self._counted
        if before_s is None:
            return self._counted
        for c in reversed(self._cols):
            starts = c["t_start_s"]
            k = 0 if starts[0] >= before_s else int(np.searchsorted(starts, before_s, side="left"))
            steps -= len(starts) - k
            tokens -= int(np.sum(c["num_prefill_tokens"][k:] + c["num_decode_reqs"][k:]))
            reqs -= int(np.sum(c["num_decode_reqs"][k:]))
            kv -= int(np.sum(c["kv_tokens_used"][k:]))
            if k > 0:
                break
        return steps, tokens, reqs, kv

    def _record(self, ends: np.ndarray, starts: np.ndarray, prefill: int, decode: int, kv: np.ndarray) -> None:
        n = len(ends)
        steps, tokens, reqs, kv_sum = self._counted
        self._counted = (steps + n, tokens + n * (prefill + decode), reqs + n * decode, kv_sum + int(np.sum(kv)))
        self._cols.append({
            "t_start_s": starts, "t_end_s": ends, "num_prefill_tokens": np.full(n, prefill),
            "num_decode_reqs": np.full(n, decode), "kv_tokens_used": np.asarray(kv, dtype=np.int64),
            "mem_bytes": self.need_bytes(np.asarray(kv)),
            "flops": np.full(n, self.cost.flops_per_token * (prefill + decode)),
            "slowdown": np.full(n, self.s),
        })

    def columns(self) -> StepColumns | None:
        if not self._cols:
            return None
        return StepColumns(pipeline=self.pipeline, step=self.step, dp_rank=self.rank,
                           **{k: np.concatenate([c[k] for c in self._cols]) for k in self._cols[0]})

    def num_steps(self) -> int:
        return self._steps
