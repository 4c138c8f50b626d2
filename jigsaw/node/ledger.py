"""What is known about a live pipeline: the facts the daemon and the simulator both keep.

    the pipeline's workers (client messages, or the simulator's engines)
        request(kind, rank, step) ─► Waiting            asked to start; the plan admits it
        admit / regrant            ─► Running            budget, predicted slowdown, work done
        finish(numbers)            ─► finished SubStage  exclusive time = work integrated
        close_step                 ─► history (the builder's graph of the step, or assembled)
    LivePipeline ─► view.pipeline_state() ─► the scheduler's PipelineState  (view.py)

Work is measured in exclusive seconds: a sub-stage running under a predicted slowdown s
advances at 1/s, the replicas of a lockstep gang at the gang's rate (`state.gang_rate`, the
scheduler's own model).  `integrate(now)` brings it up to date before a budget changes and
when a sub-stage ends, so the same facts give the same remaining times live and simulated.

Some facts only one source has: an engine model knows its requests' generated tokens (tail
residuals) and a stage's exact size once its batch is known (`expected_s`); a client may not
say them.  The view uses what is there and falls back to the prediction otherwise.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from jigsaw.graph.builder import assemble_step_graph
from jigsaw.graph.graph import SubStageGraph
from jigsaw.graph.ids import SubStageId, check_name
from jigsaw.graph.plan import Assignment, Budget
from jigsaw.graph.problem import gang_keys
from jigsaw.graph.residual import ResidualLength
from jigsaw.graph.state import gang_rate
from jigsaw.graph.substage import Stage, SubStage, SubStageKind

HISTORY_STEPS = 5
"""Step graphs kept per pipeline (the prediction reads the last GraphConfig.history_steps)."""
HOST = Budget(sm_frac=0.0, mem_frac=0.0)
"""What a host sub-stage (reward, tool wait) holds of its device: nothing."""
STAGE_OF = {SubStageKind.TOOL: Stage.ROLLOUT, SubStageKind.REWARD: Stage.REWARD,
            SubStageKind.REFERENCE: Stage.REFERENCE, SubStageKind.TRAINING: Stage.TRAINING}
STAGE_ORDER = (Stage.ROLLOUT, Stage.REWARD, Stage.REFERENCE, Stage.TRAINING)


def stage_of(kind: SubStageKind) -> Stage:
    return STAGE_OF.get(kind, Stage.ROLLOUT)


@dataclass(frozen=True, kw_only=True, slots=True)
class LiveNumbers:
    """What a rollout engine knows about a running piece now (all optional)."""

    batch_size: float = 0.0
    """Requests decoding now."""
    context_tokens: float = 0.0
    """Mean KV tokens per decoding request."""
    generated: tuple[int, ...] = ()
    """Tokens each decoding request generated in its current turn (tail residual life)."""


@dataclass(slots=True)
class Waiting:
    """A sub-stage that asked to start and waits for the plan."""

    sid: str
    kind: SubStageKind
    rank: int
    since_s: float
    urgent: bool = False
    """It starts whatever the plan (a running rollout entering its next regime cannot
    pause; or it waited too long); the plan only chooses its budget."""
    need_bytes: int = 0
    """Memory the requester says it needs (0: unknown)."""
    expected_s: float | None = None
    """The requester's own estimate of its exclusive time (None: predicted)."""
    batch_size: float = 0.0
    """Sequences it processes, when the requester knows (a stage whose batch is done)."""
    work_s: float = 0.0
    """Exclusive work it did before it asked (a regime is recognised a few steps into it)."""
    pids: tuple[int, ...] = ()
    """Processes that run it (bound to its partition by the client)."""
    owner: Any = None
    """Who to answer on admission (the daemon's session and request; the simulator: None)."""
    live: LiveNumbers | None = None
    """What its engine knows now (a rollout regime that began before it asked)."""


@dataclass(slots=True)
class Running:
    """A sub-stage holding (host work: not holding) a budget."""

    sid: str
    kind: SubStageKind
    rank: int
    device: int
    budget: Budget
    slowdown: float
    """Predicted slowdown of its current budget (1.0 alone, on the whole device)."""
    start_s: float
    need_bytes: int = 0
    expected_s: float | None = None
    """Exclusive time it is expected to take in all (None: predicted); a merge sets it."""
    batch_size: float = 0.0
    micro_batch: int | None = None
    pids: tuple[int, ...] = ()
    owner: Any = None
    work_s: float = 0.0
    """Exclusive seconds of work done by `since_s`."""
    since_s: float = 0.0
    rate: float = 1.0
    """Exclusive seconds of work per second now (1/slowdown, or its gang's rate)."""
    live: LiveNumbers | None = None

    @property
    def on_device(self) -> bool:
        return self.kind.on_device


@dataclass(slots=True)
class LivePipeline:
    """One pipeline's facts (see the module docstring); mutated only through its methods."""

    name: str
    devices: tuple[int, ...]
    step: int = 0
    more_steps: bool = True
    """Another step follows this one (the view then appends its prediction)."""
    static: SubStageGraph | None = None
    """The whole graph, when it is known in advance (the graph executor, a replay): used
    as it is instead of a prediction, and never renumbered."""
    prior: SubStageGraph | None = None
    """A guess of a step before any history exists (e.g. a workload's cap-based graph)."""
    history: deque = field(default_factory=lambda: deque(maxlen=HISTORY_STEPS))
    finished: dict[str, SubStage] = field(default_factory=dict)
    """This step's finished sub-stages (all of them with a static graph)."""
    first_start_s: dict[str, float] = field(default_factory=dict)
    waiting: dict[str, Waiting] = field(default_factory=dict)
    running: dict[str, Running] = field(default_factory=dict)
    merged_away: set[str] = field(default_factory=set)
    """Sub-stages a migration ended (their owner may still report the end)."""
    ended: set[int] = field(default_factory=set)
    """DP ranks whose rollout is over this step (their client said its last regime ended)."""
    ordinals: dict[tuple[int, SubStageKind], int] = field(default_factory=dict)
    stage: Stage = Stage.ROLLOUT
    """The step's latest stage that asked to run (what whole-stage baselines order by)."""
    stage_since_s: float | None = None
    """When that stage first asked (None: nothing asked in this step yet)."""
    lengths: ResidualLength | None = None
    """Turn lengths of finished requests (the engine model's), for tail residuals."""
    samples: tuple[int, int] | None = None
    """(finished, total) samples of this step's rollout, when the pipeline says."""
    version: int = 0
    """Bumped at every change of facts (views cache on it)."""
    cache: dict = field(default_factory=dict)
    """The view's per-pipeline memo (prediction, summary, decode fit); see view.py."""

    def __post_init__(self) -> None:
        check_name(self.name)

    # ------------------------------------------------------------ requests

    def request(self, kind: SubStageKind, rank: int, step: int, now_s: float, *, urgent: bool = False,
                need_bytes: int = 0, expected_s: float | None = None, batch_size: float = 0.0,
                work_s: float = 0.0, pids: tuple[int, ...] = (), owner: Any = None, sid: str | None = None) -> Waiting:
        """A sub-stage asks to start.  Its id is the next ordinal of its kind on its worker in
        its step (or `sid`, a node of the static graph).  A later step closes this one."""
        if not 0 <= rank < len(self.devices):
            raise ValueError(f"dp_rank {rank} outside pipeline {self.name}'s 0..{len(self.devices) - 1}")
        if step < self.step:
            raise ValueError(f"step {step} of {self.name} already finished (now at step {self.step})")
        if step > self.step:
            self.close_step(step, now_s)
        if sid is None:
            n = self.ordinals.get((rank, kind), 0)
            self.ordinals[(rank, kind)] = n + 1
            sid = str(SubStageId(self.name, step, rank, kind, n))
        elif sid in self.waiting or sid in self.running or sid in self.finished:
            raise ValueError(f"{sid} was already requested")
        stage = stage_of(kind)
        if self.stage_since_s is None or STAGE_ORDER.index(stage) > STAGE_ORDER.index(self.stage):
            self.stage, self.stage_since_s = stage, now_s
        w = self.waiting[sid] = Waiting(sid=sid, kind=kind, rank=rank, since_s=now_s, urgent=urgent,
                                        need_bytes=need_bytes, expected_s=expected_s, batch_size=batch_size,
                                        work_s=work_s, pids=pids, owner=owner)
        self.version += 1
        return w

    def admit(self, sid: str, a: Assignment, budget: Budget, now_s: float) -> Running:
        """A waiting sub-stage starts under the assignment (host work: holding nothing)."""
        w = self.waiting.pop(sid)
        on = w.kind.on_device
        r = self.running[sid] = Running(
            sid=sid, kind=w.kind, rank=w.rank, device=a.device if on else self.devices[w.rank],
            budget=budget if on else HOST, slowdown=a.slowdown if on else 1.0, start_s=now_s,
            need_bytes=w.need_bytes, expected_s=w.expected_s, batch_size=w.batch_size,
            micro_batch=a.micro_batch if on else None,
            pids=w.pids, owner=w.owner, work_s=w.work_s, since_s=now_s, rate=1.0 / (a.slowdown if on else 1.0),
            live=w.live)
        self.version += 1
        return r

    def regrant(self, r: Running, a: Assignment, budget: Budget) -> bool:
        """A new budget for a running sub-stage (integrate first); whether it changed."""
        if (budget, a.slowdown, a.micro_batch) == (r.budget, r.slowdown, r.micro_batch):
            return False
        r.budget, r.slowdown, r.micro_batch = budget, a.slowdown, a.micro_batch
        self.version += 1
        return True

    def integrate(self, now_s: float) -> None:
        """Work done since the last call, at each running sub-stage's current rate."""
        for r in self.running.values():
            if now_s > r.since_s:
                r.work_s += (now_s - r.since_s) * r.rate
                r.since_s = now_s

    def refresh_rates(self, balanced: bool) -> None:
        """Rates after budgets changed: 1/s, or a gang's common rate (call after integrate)."""
        gangs: dict[tuple, list[Running]] = {}
        for r in self.running.values():
            r.rate = 1.0 / max(r.slowdown, 1e-9) if r.on_device else 1.0
            if r.kind.collective:
                gangs.setdefault(self.gang_key(r.sid), []).append(r)
        for members in gangs.values():
            if len(members) > 1:
                rate = gang_rate([m.slowdown for m in members],
                                 balanced and any(m.micro_batch is not None for m in members))
                for m in members:
                    m.rate = rate

    def finish(self, sid: str, now_s: float, *, final: bool = False, **numbers) -> tuple[Running, SubStage] | None:
        """A running sub-stage ended: its exclusive time is the work it did.  `final`: its
        worker has no more rollout in this step (what was predicted after it will not run).
        None for one a migration already ended (its owner reports the end late)."""
        if sid in self.merged_away:
            if final:
                self.ended.add(SubStageId.parse(sid).rank)
                self.version += 1
            return None
        r = self.running.pop(sid, None)
        if r is None:
            raise ValueError(f"{sid} is not running")
        if final and (r.kind.is_rollout or r.kind is SubStageKind.TOOL):
            self.ended.add(r.rank)
        r.work_s += max(0.0, now_s - r.since_s) * r.rate
        r.since_s = now_s
        piece = SubStage(id=sid, pipeline=self.name, step=self._step_of(sid), kind=r.kind, dp_rank=r.rank,
                         duration_s=max(r.work_s, 0.0), mem_bytes=r.need_bytes, **numbers)
        if self.static is not None or piece.step == self.step:
            self.finished[sid] = piece
            self.first_start_s[sid] = r.start_s
        self.version += 1
        return r, piece

    def withdraw(self, sid: str) -> Waiting | Running | None:
        """Forget a waiting or running sub-stage (its requester left)."""
        self.version += 1
        return self.waiting.pop(sid, None) or self.running.pop(sid, None)

    def close_step(self, new_step: int, now_s: float, graph: SubStageGraph | None = None) -> None:
        """The step is over: its graph (the caller's builder graph, or assembled from the
        finished pieces) joins the history."""
        if graph is None and self.finished and self.static is None:
            graph = assemble_step_graph(self.finished.values(), self.first_start_s)
        if graph is not None:
            self.history.append(graph)
        if self.static is None:
            self.finished, self.first_start_s = {}, {}
        self.ordinals, self.merged_away, self.ended = {}, set(), set()
        self.step, self.samples = new_step, None
        self.stage, self.stage_since_s = Stage.ROLLOUT, None
        self.version += 1

    # ------------------------------------------------------------ reading

    @property
    def live(self) -> bool:
        """Something waits or runs (a pipeline between steps has nothing to schedule)."""
        return bool(self.waiting or self.running)

    def estimate_s(self, kind: SubStageKind) -> float | None:
        """Median exclusive time of this kind in the history and this step, if any."""
        seen = [s.duration_s for g in self.history for s in g if s.kind is kind]
        seen += [s.duration_s for s in self.finished.values() if s.kind is kind]
        return statistics.median(seen) if seen else None

    def gang_key(self, sid: str) -> tuple:
        """Replicas of one lockstep stage share this: the k-th sub-stage of a collective kind
        in a step on every worker (`problem.gang_keys` on a static graph)."""
        if self.static is not None:
            keys = self.cache.get("gang_keys")
            if keys is None:
                keys = self.cache["gang_keys"] = dict(zip((s.id for s in self.static), gang_keys(self.static)))
            return keys[sid]
        i = SubStageId.parse(sid)
        return i.step, i.kind.value, i.ordinal

    def _step_of(self, sid: str) -> int:
        if self.static is not None and sid in self.static:
            return self.static[sid].step
        return SubStageId.parse(sid).step
