"""What is known about a live pipeline: the facts the daemon and the simulator both keep.

    worker messages (node/inputs.py) ─► NodeState (state.py) ─► the methods here, the only writers
        request(kind, rank, step)    ─► Waiting           asked to start; the plan admits it
        admit / regrant              ─► Running           budget, predicted slowdown, work done
        finish(numbers)              ─► finished SubStage exclusive time = work integrated
        a request of a later step    ─► history           the step's graph, assembled from its
                                                           finished pieces
        report / count / observe     ─► what an engine knows now (live numbers, samples done,
                                        turn lengths); forecast ─► a guess of a step before any
                                        history
    LivePipeline (read-only views) ─► view.pipeline_state() ─► the scheduler's PipelineState

Work is measured in exclusive seconds: a sub-stage running under a predicted slowdown s
advances at 1/s, the replicas of a lockstep gang at the gang's rate (`state.gang_rate`, the
scheduler's own model).  `integrate(now)` brings it up to date before a budget changes and
when a sub-stage ends, so the same facts give the same remaining times live and simulated.

Invariants the methods keep: a sub-stage id is in at most one of waiting, running and this
step's finished; `step` only grows and a request of a later step closes the step first;
`ended` holds only DP ranks of this pipeline; a merged-away id is finished.  Readers get
read-only views: every change goes through a method named for what happened.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Iterable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Generic, TypeVar

from jigsaw.graph.buffer import MODES
from jigsaw.graph.builder import assemble_step_graph
from jigsaw.graph.graph import SubStageGraph
from jigsaw.graph.ids import SubStageId, check_name
from jigsaw.graph.plan import Assignment, Budget
from jigsaw.graph.problem import gang_keys
from jigsaw.graph.residual import ResidualLength
from jigsaw.graph.slo import StepOutcome
from jigsaw.graph.state import gang_rate
from jigsaw.graph.substage import Stage, SubStage, SubStageKind
from jigsaw.node.slo import StepClock

HISTORY_STEPS = 5
"""Step graphs kept per pipeline (the prediction reads the last GraphConfig.history_steps)."""
HOST = Budget(sm_frac=0.0, mem_frac=0.0)
"""What a host sub-stage (reward, tool wait) holds of its device: nothing."""
STAGE_OF = {SubStageKind.TOOL: Stage.ROLLOUT, SubStageKind.REWARD: Stage.REWARD,
            SubStageKind.REFERENCE: Stage.REFERENCE, SubStageKind.TRAINING: Stage.TRAINING}
STAGE_ORDER = (Stage.ROLLOUT, Stage.REWARD, Stage.REFERENCE, Stage.TRAINING)

Owner = TypeVar("Owner")
"""Who to answer when a request is admitted: the daemon's (session, connection, request id);
None in the simulator and the graph executor, which act on the Decision themselves."""


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
class Waiting(Generic[Owner]):
    """A sub-stage that asked to start and waits for the plan (changed only by its LivePipeline)."""

    sid: str
    kind: SubStageKind
    rank: int
    since_s: float
    urgent: bool = False
    """It starts whatever the plan (a running rollout entering its next regime cannot
    pause; or it waited too long); the plan only chooses its budget."""
    aged: bool = False
    """It waited the node's max-wait: urgent under every policy, whatever its own order."""
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
    owner: Owner | None = None
    live: LiveNumbers | None = None
    """What its engine knows now (a rollout regime that began before it asked)."""
    computes: bool = False
    """Host work that computes on this node's CPU (protocol.Admit.computes)."""


@dataclass(slots=True)
class Running(Generic[Owner]):
    """A sub-stage holding (host work: not holding) a budget (changed only by its LivePipeline)."""

    sid: str
    kind: SubStageKind
    rank: int
    device: int
    budget: Budget
    slowdown: float
    """Predicted slowdown of its current budget (1.0 alone, on the whole device)."""
    start_s: float
    mem_bytes: int = 0
    """Memory granted (its budget's share of the device, in bytes as the plan gave it)."""
    need_bytes: int = 0
    expected_s: float | None = None
    """Exclusive time it is expected to take in all (None: predicted); a merge sets it."""
    batch_size: float = 0.0
    micro_batch: int | None = None
    pids: tuple[int, ...] = ()
    owner: Owner | None = None
    work_s: float = 0.0
    """Exclusive seconds of work done by `since_s`."""
    since_s: float = 0.0
    rate: float = 1.0
    """Exclusive seconds of work per second now (1/slowdown, or its gang's rate)."""
    live: LiveNumbers | None = None
    peak_bytes: int = 0
    """The most memory its engine said it needed while it ran (its piece's footprint)."""
    computes: bool = False
    """Host work that computes on this node's CPU (protocol.Admit.computes)."""
    paces: list[tuple[float, float, float]] = field(default_factory=list)
    """(time, work done by then, rate from then) at each change of its rate: the work it did
    in any part of its life (`work_at`)."""

    def work_at(self, t_s: float) -> float:
        """Exclusive work it had done by `t_s` (up to its last integration)."""
        if not self.paces:
            return self.work_s
        t0, w0, rate = self.paces[0]
        for t, w, r in self.paces:
            if t > t_s:
                break
            t0, w0, rate = t, w, r
        return min(w0 + max(0.0, t_s - t0) * rate, self.work_s)

    @property
    def on_device(self) -> bool:
        return self.kind.on_device


@dataclass(frozen=True, slots=True)
class Saved:
    """A pipeline's changeable facts at one moment (`LivePipeline.save`), to put back when a
    decision fails half-way."""

    waiting: dict
    running: dict
    merged_away: frozenset[str]
    ended: frozenset[int]
    finished: dict
    first_start_s: dict


class LivePipeline:
    """One pipeline's facts (module docstring).  Attributes are read-only views; the methods
    are called by NodeState, which every message reaches first."""

    def __init__(self, name: str, devices: tuple[int, ...], *, steps: int | None = None, max_tokens: int = 0,
                 static: SubStageGraph | None = None, slo_slowdown: float | None = None, job: str = "",
                 mode: str = "", staleness: int = 0):
        self.name = check_name(name)
        self.job = check_name(job) if job else name
        """The job it belongs to: itself, or the asynchronous job it is one side of."""
        self.mode, self.staleness = "", 0
        """How its job's sides are coupled and the job's staleness bound, as its client said
        them ("": not said; graph/buffer.py MODES)."""
        self.couple(mode, staleness)
        self.clock = StepClock(slo_slowdown)
        """Its steps' timing against its slowdown SLO (node/slo.py)."""
        self.devices = tuple(devices)
        self.steps = steps
        """Steps the pipeline runs in all (None: not said; another step always follows)."""
        self.static = static
        """The whole graph, when it is known in advance (the graph executor, a replay): used
        as it is instead of a prediction, and never renumbered."""
        self._gang_keys = dict(zip((s.id for s in static), gang_keys(static))) if static is not None else None
        self._lengths = ResidualLength(max_tokens=max_tokens) if max_tokens > 0 else None
        self._forecast: SubStageGraph | None = None
        self._history: deque[SubStageGraph] = deque(maxlen=HISTORY_STEPS)
        self._finished: dict[str, SubStage] = {}
        self._first_start_s: dict[str, float] = {}
        self._waiting: dict[str, Waiting] = {}
        self._running: dict[str, Running] = {}
        self._merged_away: set[str] = set()
        self._ended: set[int] = set()
        self._ordinals: dict[tuple[int, SubStageKind], int] = {}
        self._last_done: dict[int, tuple[str, float, Running]] = {}
        """Per DP rank, the device piece it finished last: (id, when, how it ran)."""
        self._samples: tuple[int, int] | None = None
        self.step = 0
        self.stage = Stage.ROLLOUT
        """The step's latest stage that asked to run (what whole-stage baselines order by)."""
        self.stage_since_s: float | None = None
        """When that stage first asked (None: nothing asked in this step yet)."""

    # ------------------------------------------------------------ read-only views

    @property
    def waiting(self) -> Mapping[str, Waiting]:
        return MappingProxyType(self._waiting)

    @property
    def running(self) -> Mapping[str, Running]:
        return MappingProxyType(self._running)

    @property
    def finished(self) -> Mapping[str, SubStage]:
        """This step's finished sub-stages (all of them with a static graph)."""
        return MappingProxyType(self._finished)

    @property
    def history(self) -> tuple[SubStageGraph, ...]:
        """Graphs of the last steps, oldest first."""
        return tuple(self._history)

    @property
    def last_graph(self) -> SubStageGraph | None:
        return self._history[-1] if self._history else None

    @property
    def forecast(self) -> SubStageGraph | None:
        """The pipeline's own guess of a step before any history exists (e.g. from its caps)."""
        return self._forecast

    @property
    def merged_away(self) -> AbstractSet[str]:
        """Sub-stages a migration ended (their owner may still report the end)."""
        return self._merged_away

    @property
    def ended(self) -> AbstractSet[int]:
        """DP ranks whose rollout is over this step (their worker said its last regime ended)."""
        return self._ended

    @property
    def lengths(self) -> ResidualLength | None:
        """Turn lengths of finished requests, for tail residuals (None: the pipeline said no cap)."""
        return self._lengths

    @property
    def samples(self) -> tuple[int, int] | None:
        """(finished, total) samples of this step's rollout, when the pipeline says."""
        return self._samples

    @property
    def more_steps(self) -> bool:
        """Another step follows this one (the view then appends its prediction)."""
        return self.steps is None or self.step + 1 < self.steps

    @property
    def started(self) -> bool:
        """The pipeline has asked for something (a step may only follow one that began)."""
        return bool(self._history or self._finished or self._ordinals)

    @property
    def live(self) -> bool:
        """Something waits or runs (a pipeline between steps has nothing to schedule)."""
        return bool(self._waiting or self._running)

    # ------------------------------------------------------------ requests

    def request(self, kind: SubStageKind, rank: int, step: int, now_s: float, *, urgent: bool = False,
                need_bytes: int = 0, expected_s: float | None = None, batch_size: float = 0.0,
                elapsed_s: float = 0.0, pids: tuple[int, ...] = (), owner=None, ordinal: int | None = None,
                sid: str | None = None, computes: bool = False) -> Waiting:
        """A sub-stage asks to start.  Its id is `ordinal` (the worker's own count), else the
        next ordinal of its kind on its worker in its step, or `sid` (a node of the static
        graph).  A later step closes this one.  `elapsed_s`: wall seconds it ran before it
        asked, at the pace of what its worker ran last.  `computes`: host work that computes on
        this node's CPU (protocol.Admit.computes)."""
        self._at(rank, step)
        sid = sid or self._new_id(kind, rank, step, ordinal)
        if sid in self._waiting or sid in self._running or sid in self._finished:
            raise ValueError(f"{sid} was already requested")
        self.clock.begin(now_s)
        stage = stage_of(kind)
        if self.stage_since_s is None or STAGE_ORDER.index(stage) > STAGE_ORDER.index(self.stage):
            self.stage, self.stage_since_s = stage, now_s
        w = self._waiting[sid] = Waiting(sid=sid, kind=kind, rank=rank, since_s=now_s, urgent=urgent,
                                         need_bytes=need_bytes, expected_s=expected_s, batch_size=batch_size,
                                         work_s=self._head_start(rank, elapsed_s, now_s), pids=pids, owner=owner,
                                         computes=computes)
        return w

    def _head_start(self, rank: int, elapsed_s: float, now_s: float) -> float:
        """Exclusive work a piece did in the `elapsed_s` before it asked, at the paces its
        worker ran at then.  The piece that worker ran before did not do that work (its
        worker ran this one's first steps before telling them apart): it is taken off it."""
        last = self._last_done.get(rank)
        if last is None:
            return elapsed_s
        sid, end_s, r = last
        began = now_s - elapsed_s
        if elapsed_s <= 0.0 or end_s <= began:  # it began after that one ended
            return elapsed_s * r.rate
        moved = r.work_s - r.work_at(max(began, r.start_s))
        piece = self._finished.get(sid)
        if piece is not None:
            self._finished[sid] = replace(piece, duration_s=max(0.0, piece.duration_s - moved))
        return moved + max(0.0, now_s - end_s) * r.rate

    def _new_id(self, kind: SubStageKind, rank: int, step: int, ordinal: int | None) -> str:
        n = self._ordinals.get((rank, kind), 0)
        if ordinal is None:
            ordinal = n
        self._ordinals[(rank, kind)] = max(n, ordinal + 1)
        return str(SubStageId(self.name, step, rank, kind, ordinal))

    def urge(self, sid: str, aged: bool = False) -> None:
        """A waiting request must start now (it waited too long: `aged`, or nothing else can run)."""
        w = self._waiting[sid]
        w.urgent, w.aged = True, w.aged or aged

    def admit(self, sid: str, a: Assignment, budget: Budget, now_s: float) -> Running:
        """A waiting sub-stage starts under the assignment (host work: holding nothing)."""
        w = self._waiting.pop(sid)
        on = w.kind.on_device
        r = self._running[sid] = Running(
            sid=sid, kind=w.kind, rank=w.rank, device=a.device if on else self.devices[w.rank],
            budget=budget if on else HOST, slowdown=a.slowdown if on else 1.0, start_s=now_s,
            mem_bytes=a.mem_bytes if on else 0, need_bytes=w.need_bytes, expected_s=w.expected_s,
            batch_size=w.batch_size, micro_batch=a.micro_batch if on else None,
            pids=w.pids, owner=w.owner, work_s=w.work_s, since_s=now_s, rate=1.0 / (a.slowdown if on else 1.0),
            live=w.live, peak_bytes=w.need_bytes, computes=w.computes and not on)
        r.paces.append((now_s, r.work_s, r.rate))
        return r

    def regrant(self, sid: str, a: Assignment, budget: Budget) -> bool:
        """A new budget for a running sub-stage (integrate first); whether it changed."""
        r = self._running[sid]
        if (budget, a.slowdown, a.micro_batch) == (r.budget, r.slowdown, r.micro_batch):
            return False
        r.budget, r.slowdown, r.micro_batch, r.mem_bytes = budget, a.slowdown, a.micro_batch, a.mem_bytes
        return True

    def integrate(self, now_s: float) -> None:
        """Work done since the last call, at each running sub-stage's current rate."""
        for r in self._running.values():
            if now_s > r.since_s:
                r.work_s += (now_s - r.since_s) * r.rate
                r.since_s = now_s

    def refresh_rates(self, balanced: bool) -> None:
        """Rates after budgets changed: 1/s, or a gang's common rate (call after integrate)."""
        gangs: dict[tuple, list[Running]] = {}
        for r in self._running.values():
            r.rate = 1.0 / max(r.slowdown, 1e-9) if r.on_device else 1.0
            if r.kind.collective:
                gangs.setdefault(self.gang_key(r.sid), []).append(r)
        for members in gangs.values():
            if len(members) > 1:
                rate = gang_rate([m.slowdown for m in members],
                                 balanced and any(m.micro_batch is not None for m in members))
                for m in members:
                    m.rate = rate
        for r in self._running.values():
            if r.paces and r.paces[-1][2] != r.rate:
                r.paces.append((r.since_s, r.work_s, r.rate))

    def finish(self, sid: str, now_s: float, *, final: bool = False, **numbers) -> tuple[Running, SubStage] | None:
        """A running sub-stage ended: its exclusive time is the work it did.  `final`: its
        worker has no more rollout in this step (what was predicted after it will not run).
        None for one a migration already ended (its owner reports the end late), and for one
        still waiting (its worker moved on before it was admitted: it never ran)."""
        if sid in self._merged_away or sid in self._waiting:
            if sid in self._waiting:
                del self._waiting[sid]
            elif numbers and (piece := self._finished.get(sid)) is not None:
                self._finished[sid] = replace(piece, **numbers)  # its owner counted what it did before the move
            if final:
                self._ended.add(SubStageId.parse(sid).rank)
            return None
        r = self._running.pop(sid, None)
        if r is None:
            raise ValueError(f"{sid} is not running")
        if final and (r.kind.is_rollout or r.kind is SubStageKind.TOOL):
            self._ended.add(r.rank)
        r.work_s += max(0.0, now_s - r.since_s) * r.rate
        r.since_s = now_s
        if r.on_device:
            self._last_done[r.rank] = (sid, now_s, r)
        piece = SubStage(id=sid, pipeline=self.name, step=self._step_of(sid), kind=r.kind, dp_rank=r.rank,
                         duration_s=max(r.work_s, 0.0), mem_bytes=max(r.need_bytes, r.peak_bytes), **numbers)
        if self.static is not None or piece.step == self.step:
            self._finished[sid] = piece
            self._first_start_s[sid] = r.start_s
        if piece.step == self.step:
            self.clock.end(now_s)
        return r, piece

    def hand_over(self, source: str, target: str, target_remaining_s: float, now_s: float) -> Running:
        """A migration: the source ends now (its owner's report of the end comes later and
        is a no-op) and the target, if running and priced, takes on what it took over."""
        r = self._running[source]
        self.finish(source, now_s)
        self._merged_away.add(source)
        t = self._running.get(target)
        if t is not None and target_remaining_s > 0:
            t.expected_s = t.work_s + target_remaining_s
        return r

    def skip(self, sid: str) -> None:
        """A node of the static graph that will not run: its work left with a migration."""
        s = self.static[sid]
        self._finished[sid] = replace(s, duration_s=0.0)
        self._merged_away.add(sid)

    def withdraw(self, sid: str) -> Waiting | Running | None:
        """Forget a waiting or running sub-stage (its requester left)."""
        return self._waiting.pop(sid, None) or self._running.pop(sid, None)

    def rollout_over(self, rank: int, step: int) -> None:
        """DP rank `rank` has no (more) rollout in `step` (its routing sent it nothing); a
        later step closes this one, as its requests would."""
        self._at(rank, step)
        self._ended.add(rank)

    def _at(self, rank: int, step: int) -> None:
        """A worker speaks of `step`: a rank of this pipeline, a step not over (a later one
        closes this one)."""
        if not 0 <= rank < len(self.devices):
            raise ValueError(f"dp_rank {rank} outside pipeline {self.name}'s 0..{len(self.devices) - 1}")
        if step < self.step:
            raise ValueError(f"step {step} of {self.name} already finished (now at step {self.step})")
        if step > self.step:
            self._close_step(step)

    # ------------------------------------------------------------ what engines know

    def report(self, sid: str, live: LiveNumbers | None, need_bytes: int | None) -> None:
        """An engine's numbers of its waiting or running piece now (what its requests are;
        `need_bytes` None: its memory is not known, what it asked with stands)."""
        fact = self._running.get(sid) or self._waiting.get(sid)
        if fact is None:
            raise ValueError(f"{sid} neither waits nor runs")
        fact.live = live
        if need_bytes is not None:
            fact.need_bytes = need_bytes
            if isinstance(fact, Running):
                fact.peak_bytes = max(fact.peak_bytes, need_bytes)

    def ran_open(self, rank: int, step: int, kind: SubStageKind | None = None) -> list[Waiting | Running]:
        """A worker ran a `kind` piece of `step` without the daemon (it was unreachable,
        stalled or restarting): the pipeline has reached that step, whatever it was told
        meanwhile, and the request it gave up waiting for is withdrawn (read late, it would
        be granted to nobody and hold its device for ever).  What was withdrawn."""
        self._at(rank, max(step, self.step))  # an older step moves nothing back
        stale = [f.sid for f in (*self._waiting.values(), *self._running.values())
                 if f.rank == rank and f.kind is kind and self._step_of(f.sid) == step]
        return [self.withdraw(sid) for sid in stale]

    def count(self, step: int, done: int, total: int) -> None:
        """Samples of `step`'s rollout finished so far, of all (total 0: not known)."""
        if step == self.step:
            self._samples = (done, total) if total else None

    def observe(self, turn_lengths: Iterable[int]) -> None:
        """Lengths of finished turns (generated tokens each), one observation."""
        if self._lengths is None:
            raise ValueError(f"{self.name} said no response cap at registration: turn lengths cannot be used")
        self._lengths.observe(turn_lengths)

    def couple(self, mode: str, staleness: int) -> None:
        """Its job's coupling, as a client says it (`mode` "": nothing said, kept as it was)."""
        if mode:
            if mode not in MODES or staleness < 0:
                raise ValueError(f"pipeline {self.name!r}: mode {mode!r} with staleness {staleness} is not a "
                                 f"coupling (modes {MODES}, staleness >= 0)")
            self.mode, self.staleness = mode, staleness

    def set_forecast(self, graph: SubStageGraph) -> None:
        self._forecast = graph

    # ------------------------------------------------------------ steps

    def _close_step(self, new_step: int) -> None:
        """The step is over: its graph, assembled from the finished pieces, joins the history
        (and its outcome the step clock's)."""
        self.clock.close(self.step, self._finished.values(), self._first_start_s)
        if self._finished and self.static is None:
            self._history.append(assemble_step_graph(self._finished.values(), self._first_start_s))
        if self.static is None:
            self._finished, self._first_start_s = {}, {}
        self._ordinals, self._merged_away, self._ended = {}, set(), set()
        self.step, self._samples = new_step, None
        self.stage, self.stage_since_s = Stage.ROLLOUT, None

    # ------------------------------------------------------------ failures

    def save(self) -> Saved:
        return Saved(waiting=dict(self._waiting), running={sid: replace(r) for sid, r in self._running.items()},
                     merged_away=frozenset(self._merged_away), ended=frozenset(self._ended),
                     finished=dict(self._finished), first_start_s=dict(self._first_start_s))

    def restore(self, saved: Saved) -> None:
        self._waiting = dict(saved.waiting)
        self._running = {sid: replace(r) for sid, r in saved.running.items()}
        self._merged_away, self._ended = set(saved.merged_away), set(saved.ended)
        self._finished, self._first_start_s = dict(saved.finished), dict(saved.first_start_s)

    # ------------------------------------------------------------ reading

    def estimate_s(self, kind: SubStageKind) -> float | None:
        """Median exclusive time of this kind in the history and this step, if any."""
        seen = [s.duration_s for g in self._history for s in g if s.kind is kind]
        seen += [s.duration_s for s in self._finished.values() if s.kind is kind]
        return statistics.median(seen) if seen else None

    def gang_key(self, sid: str) -> tuple:
        """Replicas of one lockstep stage share this: the k-th sub-stage of a collective kind
        in a step on every worker (`problem.gang_keys` on a static graph)."""
        if self._gang_keys is not None:
            return self._gang_keys[sid]
        i = SubStageId.parse(sid)
        return i.step, i.kind.value, i.ordinal

    def step_outcomes(self, current: bool = True) -> tuple[StepOutcome, ...]:
        """Its finished steps measured (the last KEPT_OUTCOMES), and with `current` the step
        in progress as it stands (a pipeline's last step never closes)."""
        now = self.clock.outcome(self.step, self._finished.values(), self._first_start_s) if current else None
        return (*self.clock.outcomes, *(() if now is None else (now,)))

    def first_start_s(self, sid: str) -> float | None:
        return self._first_start_s.get(sid)

    def _step_of(self, sid: str) -> int:
        if self.static is not None and sid in self.static:
            return self.static[sid].step
        return SubStageId.parse(sid).step


def by_rank(pieces: Iterable[Running]) -> dict[int, list[Running]]:
    out: dict[int, list[Running]] = {}
    for r in pieces:
        out.setdefault(r.rank, []).append(r)
    return out
