"""`jigsaw daemon`: one per node; owns the node state, the policy, partitions and the trace.

    clients ──Unix socket (wire.py: 0600 in a 0700 dir; length-prefixed, ≤ 64 KiB a message)──►
    serve() loop, one turn:
      read every whole message waiting (the listener already turned away other uids and
        │    lengths past the limit) ─► schema with bounded fields  (anything else: an Error
        ▼    reply, nothing changes); each stamped with its arrival time
      serve heartbeats and status first, then the rest in arrival order ─► sessions; a
        │    pipeline's facts (Admit, Done, Progress, …) through node/inputs.py ─► NodeState,
        ▼    the simulator's path too; a bug in one: `internal`
      tick: one decision for the whole batch (and when a request passes max-wait) ─►
        │   NodeState.decide() (node/state.py, the simulator's too; group by group, all or
        │   nothing) ─► Decision ─► grants.py partitions (pure) ─► Grant replies, budget changes
        │   for the next heartbeat replies; a decision that fails answers every request it held
        ▼
      leases: a session silent for lease_s since its last arrival expires, but never within a
        lease of the daemon coming back from a stall (it was the one not listening)
    SLOs: each plan's forecasts (Plan.slo) kept per pipeline, a given-up one logged once a
      step; StepEnd ─► the "step" event carries the step's exclusive time and whether it kept
      its SLO (node/slo.py) ─► status replies and metrics say attainment and what was given up
    trace (jigsaw/trace.py; stops on a write error, the daemon serves on) · Prometheus metrics
    housekeeping.py: the lock and the socket (removed on exit while still its own), a fresh
      trace under traces/ when none is named, exit after idle_exit_s with no pipeline, Stop
    in a cluster (--cluster): a training or reference Admit of a pipeline spanning nodes is held
      (spanning.py) until the controller admits its gang on every node, then taken urgent; a
      refused gang or a lost controller: taken as it came, decided here alone

A failing policy falls back to admitting requests alone by turn (a pipeline never fails
because the daemon did).  The trace holds every request the node state took
(`node.inputs.record`), operator orders included, so a run's decisions can be replayed
offline (`jigsaw.sim.replay.replay_decisions`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import secrets
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import NamedTuple

import msgspec

from jigsaw import protocol as pr
from jigsaw.graph.plan import NodeSpec, SchedulerConfig
from jigsaw.graph.policies import NAMES, make
from jigsaw.graph.slo import SloForecast
from jigsaw.mux.model.grids import node_grid
from jigsaw.mux.model.learned import LearnConfig, learned_path, load_or_fresh
from jigsaw.node import inputs
from jigsaw.node.effects import Decision
from jigsaw.node.slo import step_fields
from jigsaw.node.state import NodeState
from jigsaw.runtime import grants, housekeeping, owners, plumbing
from jigsaw.runtime.paths import endpoint, runtime_dir
from jigsaw.runtime.session import Session
from jigsaw.runtime.spanning import Held, Link, Spanning
from jigsaw.trace import TraceEvent, TraceWriter

log = logging.getLogger("jigsaw.daemon")
TICK_MS = 50
"""The loop's longest wait for a message before it checks its timers."""
LEARNED_SAVE_S = 60.0
"""How often a daemon that learns its grid writes it (and at exit)."""
STALL_S = 0.5
"""A loop turn longer than this is a stall of the daemon (a long decision, SIGSTOP): leases
then restart from when it came back."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DaemonConfig:
    """The node daemon."""

    profile: Path | None = None
    """Slowdown grid: a file (`jigsaw profile` output) or a name such as cpu/tiny-qwen3 or h100/qwen3-4b.
    None: the analytic H100 prior of Qwen3-4B."""
    devices: int = 1
    """Devices the daemon partitions (GPUs, or CPU partitions)."""
    policy: str = "jigsaw"
    """What decides: jigsaw | greedy | serial (verl) | static (half the device each) | muxserve
    | rollmux | hrrs.
    Any of them runs live, so the same jobs can be compared under each."""
    sched: SchedulerConfig = field(default_factory=SchedulerConfig)
    """The look-ahead scheduler (jigsaw; greedy is it at window 1)."""
    heartbeat_s: float = pr.HEARTBEAT_S
    """How often clients renew their lease."""
    lease_s: float = pr.LEASE_S
    """A client silent this long is dead: its grants are reclaimed."""
    grow_delay_s: float = 0.02
    """A running sub-stage given more of its device learns it this much later, unless a re-plan
    takes it back first: when a partner ends, its pipeline's next sub-stage usually asks within
    a few ms, and growing the survivor only to shrink it again moves its threads twice for
    nothing.  Shrinks are sent at once.  0: every change at once."""
    max_wait_s: float | None = 2.0
    """A request waiting this long is admitted whatever the plan (the policy then only picks its budget).
    None: never (a baseline run live keeps its own order)."""
    trace: Path | None = None
    """Append the trace (JSON lines) here.
    Without it, `jigsaw daemon` writes a new file under the runtime directory's traces/ (the newest 20 kept)."""
    metrics_port: int | None = None
    """Serve Prometheus metrics on 127.0.0.1:PORT."""
    partitioner: str = "advisory"
    """advisory: budgets are told to workers, nothing enforces them.
    green: CUDA green-context SM partitions, which each worker opens and binds itself.
    cpu: core sets and thread counts of this machine's cores."""
    telemetry_s: float | None = None
    """Sample GPU telemetry (NVML: SM utilisation, memory per process) into the trace this often."""
    mps: bool = False
    """Check the MPS control daemon at start-up and start it (thread percentage unset) if it is not running.
    Processes of different pipelines run concurrently on a GPU only under MPS."""
    idle_exit_s: float | None = None
    """Exit after this many seconds with no pipeline registered (`jigsaw run` starts its daemon with 600).
    None: serve until stopped."""
    learn_grid: bool = False
    """Refine the grid from every finished grant with an exclusive-time estimate, and plan with it
    (mux/model/learned.py); kept per node, device and model under the profile directory's learned/,
    saved every minute and at exit.  A pipeline whose grants carry no estimate runs its first few
    trainings and references alone (probes, node/learning.py): its rate alone is what its
    co-located grants are measured against.  Off unless asked: a replay of the trace does not
    learn yet."""
    cluster: str = ""
    """Join this Ray cluster's controller (an address, or auto: the cluster of this node's raylet):
    a pipeline whose ranks span nodes (Register.nodes) starts its training and reference gangs only
    when every node does (runtime/spanning.py).  Needs the [cluster] extra.  "": no cluster."""
    cluster_kind: str = ""
    """The GPU kind this node joins the cluster as, what placement prices its devices by (h100,
    a100); "": its grid's device.  A CPU node named as a GPU kind stands in for one (a test)."""
    watch_grid: bool = False
    """Measure the grid's error on every finished grant as --learn-grid does (probes, the trace's
    `learned`, the file) but never move an entry: the scheduler plans with the profile's grid.
    How far off a profile is, before it is trusted to learn."""

    def __post_init__(self) -> None:
        if self.policy not in NAMES:
            raise ValueError(f"unknown policy {self.policy!r}; choose from {', '.join(NAMES)}")
        if not 0.0 < self.heartbeat_s <= min(pr.MAX_WAIT_S, self.lease_s / 2):
            # clients send heartbeat_s as their Heartbeat.wait_s: above the wire's bound every beat is refused
            raise ValueError(f"heartbeat_s must be in (0, min({pr.MAX_WAIT_S:g}, lease_s / 2)], got {self.heartbeat_s}")
        if not 0.0 <= self.grow_delay_s <= self.lease_s / 2:
            raise ValueError(f"grow_delay_s must be in [0, lease_s / 2], got {self.grow_delay_s}")
        if self.idle_exit_s is not None and not self.idle_exit_s > 0:
            raise ValueError(f"idle_exit_s must be positive (or None: never), got {self.idle_exit_s}")


class Owner(NamedTuple):
    """Who asked for a sub-stage: the session, and where its Grant goes."""

    session: str
    conn: int
    req: int


class Release(NamedTuple):
    """A Done refused for its report (a NaN, a count out of bounds): its grant still ends."""

    session: str
    substage: str
    error: pr.Error
    """The refusal, the sender's reply whether or not the release succeeds."""

    @property
    def req(self) -> int:
        return self.error.req


class Inbound(NamedTuple):
    """A valid request as it was read, stamped with when it arrived (leases go by that)."""

    conn: int
    msg: pr.Request
    arrived_s: float


FIRST = (pr.Heartbeat, pr.Status, pr.Stop)
"""Served before anything else read in the same batch: they are cheap, and a lease never
waits behind a decision."""
DECIDE_AFTER = (*pr.FACTS, pr.Unregister, Release)


class Daemon:
    def __init__(self, config: DaemonConfig, directory: Path | None = None, partitioner=None,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.monotonic,
                 auto_trace: bool = False, link: Link | None = None):
        """`clock` times the scheduler's facts, `wall` arrivals, leases and the loop's stalls:
        a test that scripts them gets decisions that do not depend on machine load.
        `auto_trace`: without `config.trace`, `serve` writes a fresh trace under traces/.
        `link`: the line to the cluster controller (else `serve` opens one with `config.cluster`)."""
        self.clock, self.wall, self.auto_trace = clock, wall, auto_trace
        self.dir = directory or runtime_dir()
        self.grid = node_grid(config.profile)
        self.partitioner = partitioner or grants.partitioner(config.partitioner, config.devices,
                                                             config.sched.budgets(self.grid))
        if config.sched.host_on_device is None:  # resolved here, so the trace records what was decided with
            config = replace(config, sched=replace(config.sched, host_on_device=self.partitioner.kind == "cpu"))
        self.config = config
        node = NodeSpec(num_devices=config.devices, mem_bytes=self.grid.device.mem_bytes)
        self.learner, self._learned_s = self._learner(), wall()
        self.state = NodeState(node, self.grid, make(config.policy, config.sched), next_step=config.sched.next_step,
                               max_wait_s=config.max_wait_s, liveness=True, learner=self.learner)
        self.inbox = inputs.Inbox(self.state)
        self.spanning = Spanning(link)
        self.t0 = clock()
        self.sessions: dict[str, Session] = {}
        self.owners: dict[str, str] = {}
        """Pipeline name -> the owner token it was registered with."""
        self.step_start: dict[str, float] = {}
        self.requested: Counter[str] = Counter()
        self.granted: Counter[str] = Counter()
        """Sub-stages asked for and admitted, per pipeline (in status replies)."""
        self.slo: dict[str, SloForecast] = {}
        """Per pipeline with a deadline: the latest policy plan's forecast for it."""
        self._warned_slo: dict[str, int] = {}
        """Per pipeline, the last step whose given-up SLO was logged (once a step)."""
        self.errors = self.give_ups = 0
        self.listener = None
        self._dirty = False
        """Facts changed since the last decision (decisions are coalesced: one per batch read)."""
        self._tick_s = self._awake_s = self.started_s = wall()
        """The loop's last turn, when it last came back from a stall (leases restart then), and
        when it started (uptime; the idle clock starts then too)."""
        self._idle = housekeeping.Idle(config.idle_exit_s, self.started_s)
        self.trace_writer: TraceWriter | None = None
        self._metrics = plumbing.Metrics(config.metrics_port) if config.metrics_port else None
        self.stopping = False
        if config.trace:
            self._open_trace(config.trace)

    def _learner(self):
        """The node's learned grid (DaemonConfig.learn_grid), from its file if it has one; a file
        that cannot be used is said and set aside, and learning starts from the profile's grid."""
        if not (self.config.learn_grid or self.config.watch_grid):
            return None
        path = learned_path(self.grid)
        learner, said = load_or_fresh(path, self.grid, LearnConfig(frozen=not self.config.learn_grid))
        if said:
            log.warning("%s", said)
        return learner

    def save_learned(self) -> None:
        """Write what the node learned (never fatal: the daemon serves on without the file)."""
        if self.learner is None or not self.learner.observed:
            return
        try:
            self.learner.save(path := learned_path(self.grid))
            log.info("learned grid: %d grants were evidence, skipped %s; saved to %s", self.learner.observed,
                     dict(self.learner.skipped), path)
        except OSError as exc:
            log.warning("could not save the learned grid: %s", exc)
        self._learned_s = self.wall()

    def _open_trace(self, path: Path) -> None:
        """Start the trace with the `node` event (what a replay needs to rebuild this node)."""
        c = self.config
        self.trace_writer = TraceWriter(path)
        self._event("node", "", data={"policy": c.policy, "sched": asdict(c.sched), "max_wait_s": c.max_wait_s,
                                      "devices": c.devices, "profile": str(c.profile) if c.profile else None,
                                      "learn_grid": c.learn_grid, "watch_grid": c.watch_grid,
                                      "partitioner": self.partitioner.kind, "pid": os.getpid(),
                                      "clock_t0_s": self.t0})  # event times are clock − t0

    def now(self) -> float:
        return self.clock() - self.t0

    @property
    def refused(self) -> int:
        """Connections refused for their peer's uid."""
        return self.listener.refused if self.listener is not None else 0

    # ------------------------------------------------------------ loop

    def serve(self) -> None:
        """Until `stopping` (a signal, a Stop request, idle exit); its socket and lock go then."""
        home, telemetry = housekeeping.Home(self.dir), None  # RuntimeError: another daemon holds the directory
        try:
            if self.config.mps:
                housekeeping.check_mps()
            self.listener = home.listen(self.dir, self._refusal, self._too_large, self.wall)
            if self.trace_writer is None and self.auto_trace:
                self._open_trace(housekeeping.fresh_trace(self.dir))
            if self.config.cluster and self.spanning.link is None:
                from jigsaw.cluster.controller import RayLink

                kind = self.config.cluster_kind or self.grid.device.sku
                self.spanning.link = RayLink.connect(self.config.cluster, kind, self.config.devices,
                                                     endpoint=endpoint(self.dir))
            telemetry = housekeeping.start_telemetry(self.config.telemetry_s, self.trace_writer, self.now)
            log.info("%s", housekeeping.hello(self))
            while not self.stopping:
                if self.listener.poll(self._poll_ms()):
                    self._serve(self._read())
                self._tick()
        finally:
            if telemetry is not None:
                telemetry.stop()
            if self.spanning.link is not None and hasattr(self.spanning.link, "close"):
                self.spanning.link.close()
            if self.trace_writer is not None:
                self.trace_writer.close()
            self.save_learned()
            home.close(self.listener)
            log.info("jigsaw daemon %d stopped", os.getpid())

    def _read(self, most: int = 512) -> list[Inbound]:
        """Whole messages waiting (up to `most`), each stamped with when the listener read it
        (on the daemon's wall clock); the listener answered on its own a stranger's connection
        and an oversized header."""
        batch = []
        for conn, data, arrived_s in self.listener.read(most):
            msg = self._check(conn, data)
            if msg is not None:
                batch.append(Inbound(conn, msg, arrived_s))
        return batch

    def _check(self, conn: int, data: bytes):
        """The request in `data`; a refused Done that names its grant as a `Release` (the
        grant is given back in arrival order, its report dropped); else None once the sender
        has its Error, with the frame's own request id where it could be read."""
        try:
            return pr.decode_request(data)
        except pr.ProtocolError as exc:
            self.errors += 1
            error = pr.Error(code=exc.code, message=str(exc), req=exc.req)
            if exc.release is not None:
                return Release(session=exc.release[0], substage=exc.release[1], error=error)
            return self._send(conn, error)

    def _refusal(self) -> bytes:
        log.warning("refused a connection from another uid (not %d)", os.getuid())
        return pr.encode(pr.Error(code="refused", message=f"peer uid is not {os.getuid()}"))

    def _too_large(self, n: int) -> bytes:
        self.errors += 1
        return pr.encode(pr.Error(code="too-large", message=f"message of {n} bytes exceeds {pr.MAX_MESSAGE_BYTES}; "
                                                            "the connection is closed"))

    def _serve(self, batch: list[Inbound]) -> None:
        for item in sorted(batch, key=lambda i: not isinstance(i.msg, FIRST)):  # stable: arrival order kept
            reply = self._answer(item)
            if reply is not None:
                self._send(item.conn, reply)
            self._dirty |= isinstance(item.msg, DECIDE_AFTER)

    def _answer(self, item: Inbound):
        msg = item.msg
        try:
            return self._handle(msg, item.conn, item.arrived_s)
        except ValueError as exc:  # a refusal (ProtocolError with its code), or facts out of order
            self.errors += 1
            return pr.Error(code=getattr(exc, "code", "out-of-order"), message=str(exc), req=msg.req)
        except Exception as exc:  # noqa: BLE001 - a bug in one request must not take the node down
            self.errors += 1
            log.exception("request %s failed", type(msg).__name__)
            return pr.Error(code="internal", message=f"{type(exc).__name__}: {exc}", req=msg.req)

    def _tick(self) -> None:
        """Timers, on the daemon's own clock: coalesced and overdue decisions, then leases."""
        mono = self.wall()
        if mono - self._tick_s > STALL_S:  # the loop itself stood still: silence proved nothing
            self._awake_s = mono
        self._spanned()
        if self._dirty or self.state.due(self.now()):
            self._dirty = False
            self._decide()
        self._tick_s = self.wall()
        for session in self.sessions.values():
            self._wake(session)
        if self._tick_s - mono > STALL_S:  # a long decision: the heartbeats it held up are not read yet
            self._awake_s = self._tick_s
        self._expire()
        if self.learner is not None and self.wall() - self._learned_s >= LEARNED_SAVE_S:
            self.save_learned()
        if self._idle.due(bool(self.state.pipelines), self.wall()) and not self.stopping:
            log.info("no pipeline registered for %g s (idle_exit_s): exiting", self.config.idle_exit_s)
            self.stopping = True

    def _poll_ms(self) -> int:
        """Until the next tick, or sooner when a parked heartbeat or a pending change is due."""
        times = [t for s in self.sessions.values() for t in (s.next_due_s(), s.parked and s.parked[2])
                 if t is not None]
        soonest_ms = 1e3 * (min(times) - self.wall()) if times else TICK_MS
        return int(max(0.0, min(TICK_MS, math.ceil(soonest_ms))))

    def _delivered(self, session: Session, beat: pr.Beat) -> pr.Beat:
        for g in beat.grants:
            self._event("delivered", session.pipeline, g.substage, device=g.device, sm_frac=g.sm_frac)
        return beat

    def _wake(self, session: Session, force: bool = False) -> None:
        """Answer a parked heartbeat when a change is due or its time is up (`force`: now)."""
        got = session.reply(self.wall(), force=force)
        if got is not None:
            self._send(got[0], self._delivered(session, got[1]))

    def _send(self, conn: int, reply) -> None:
        self.listener.send(conn, pr.encode(reply))  # a peer that is gone will ask again

    # ------------------------------------------------------------ requests

    def _handle(self, msg, conn: int, arrived_s: float):
        if isinstance(msg, pr.Status):
            return housekeeping.status_reply(self, msg.req)
        if isinstance(msg, pr.Stop):
            log.info("stop requested (jigsaw daemon stop): exiting")
            self.stopping = True
            return pr.Ok(req=msg.req)
        if isinstance(msg, pr.Register):
            return self._register(msg, conn, arrived_s)
        if isinstance(msg, pr.Migrate):
            return self._migrate(msg)
        if isinstance(msg, Release):
            return self._release(msg)
        session = self._session(msg.session)
        session.last_seen = max(session.last_seen, arrived_s)
        if isinstance(msg, pr.Heartbeat):
            now = self.wall()
            if msg.wait_s > 0 and not session.due(now):  # answered when a change is due (_wake)
                session.park(conn, msg.req, arrived_s + min(msg.wait_s, self.config.lease_s / 2))
                return None
            return self._delivered(session, pr.Beat(grants=session.take(now), req=msg.req))
        if isinstance(msg, pr.FACTS):
            return self._fact(msg, session, conn, arrived_s)
        if isinstance(msg, pr.StepEnd):
            return self._step_end(msg, session)
        if isinstance(msg, pr.Unregister):
            self._drop(msg.session, reason="unregistered", whole=msg.pipeline_done)
            return pr.Ok(req=msg.req)
        raise ValueError(f"unhandled request {type(msg).__name__}")

    def _session(self, token: str) -> Session:
        s = self.sessions.get(token)
        if s is None:
            raise pr.ProtocolError("unknown-session",
                                   f"unknown session {token[:16]!r} (the daemon restarted?): register again")
        return s

    def _register(self, msg: pr.Register, conn: int, arrived_s: float) -> pr.Registered:
        name = msg.pipeline
        pid = self.listener.peer_pid(conn) if self.listener is not None else None  # the kernel's word
        owner = owners.owner_of(msg.owner, msg.pid if pid is None else pid)
        p = self.state.pipelines.get(name)
        said = None if p is None else (p.mode, p.staleness)
        if p is not None:
            owners.check(self.owners, name, owner)
        else:
            self.spanning.span(name, msg.nodes, len(msg.devices) or 1)  # refused before anything changed
            try:
                self.inbox.register(msg)
            except ValueError:
                self.spanning.forget(set(), name)
                raise
            self.owners[name], self.step_start[name] = owner, self.now()
            self._event("pipeline", name, data={"devices": list(self.state.pipeline(name).devices), "pid": msg.pid,
                                                "steps": msg.steps, "max_tokens": msg.max_tokens,
                                                "slo_slowdown": msg.slo_slowdown,
                                                **({"job": msg.job} if msg.job else {}),
                                                "device": self.grid.device.sku,
                                                "peak_flops": self.grid.device.peak_flops})
        if msg.mode and said != (msg.mode, msg.staleness):  # whichever client says it: `jigsaw run` does not
            self.state.couple(name, msg.mode, msg.staleness)
            self._event("job", name, data={"job": msg.job or name, "mode": msg.mode, "staleness": msg.staleness})
        token = secrets.token_hex(8)
        self.sessions[token] = Session(pipeline=name, last_seen=arrived_s)
        self._gauge()
        return pr.Registered(session=token, heartbeat_s=self.config.heartbeat_s, lease_s=self.config.lease_s,
                             req=msg.req)

    def _fact(self, msg, session: Session, conn: int, arrived_s: float) -> pr.Ok | None:
        """A request carrying facts of the session's pipeline (node/inputs.py maps it); an
        Admit is answered by its Grant, when admitted."""
        name, now = session.pipeline, self.now()
        if isinstance(msg, pr.Admit):
            if not self.spanning.hold(name, Held(msg, msg.session, conn, arrived_s)):
                self._request(name, msg, conn, arrived_s)
            return None
        if isinstance(msg, pr.Done):
            return self._done(msg, session, now)
        got = self.inbox.take(name, msg, now)
        self._event(inputs.EVENTS[type(msg)], name, getattr(msg, "substage", ""), data=inputs.record(msg))
        if isinstance(msg, pr.Opened):
            self.spanning.ran_open(name, msg.dp_rank, msg.step, msg.kind)
            if got:
                self._withdrawn(name, got, "ran-open")
        return pr.Ok(req=msg.req)

    def _request(self, name: str, msg: pr.Admit, conn: int, arrived_s: float):
        """An Admit taken by the node state (the Waiting it became)."""
        w = self.inbox.take(name, msg, self.now(), owner=Owner(msg.session, conn, msg.req))
        self.requested[name] += 1
        self._event("request", name, w.sid, data={**inputs.record(msg), "queued_ms": 1e3 * (self.wall() - arrived_s)})
        return w

    def _spanned(self) -> None:
        """Admits held for gangs that span nodes, taken now that the cluster said (or is lost):
        an admitted gang's urgent, so this node starts it at once as every other member does."""
        for gang, held, admitted in self.spanning.released():
            session = self.sessions.get(held.session)
            if session is None:  # its client went meanwhile
                continue
            msg = msgspec.structs.replace(held.msg, urgent=True) if admitted else held.msg
            try:
                w = self._request(session.pipeline, msg, held.conn, held.arrived_s)
            except ValueError as exc:  # its step is over meanwhile, ...: the worker runs it alone
                self.errors += 1
                self._send(held.conn, pr.Error(code=getattr(exc, "code", "out-of-order"), message=str(exc),
                                               req=msg.req))
                continue
            self.spanning.started(gang, session.pipeline, w.sid)
            self._dirty = True

    def _withdrawn(self, name: str, facts: list, reason: str, removed: bool = False) -> None:
        """Requests and grants gone without their requester's Done (`removed`: the pipeline
        with them): traced, their devices free, their sessions no longer holding them."""
        self._event("drop", name, data={"reason": reason, "withdrawn": [f.sid for f in facts], "removed": removed})
        for f in facts:
            self.spanning.finished(name, f.sid)
            if getattr(f, "on_device", False):
                self._event("release", name, f.sid, device=f.device, data={"reclaimed": reason})
            if f.owner is not None and (s := self.sessions.get(f.owner.session)) is not None:
                s.ended(f.sid)

    def _done(self, msg: pr.Done, session: Session, now: float, report: bool = True) -> pr.Ok:
        name = session.pipeline
        try:
            who = self.state.owner(name, msg.substage)
        except KeyError:
            raise ValueError(f"{msg.substage} is not running for this session") from None
        if who is not None and who.session != msg.session:  # None: a migration ended it
            raise ValueError(f"{msg.substage} is not running for this session")
        data = inputs.record(msg) if report else {"substage": msg.substage, "report": False}
        self._event("done", name, msg.substage, data=data)
        handed = session.holds.get(msg.substage)
        session.ended(msg.substage)
        ended = self.inbox.take(name, msg, now) if report else self.inbox.release(name, msg.substage, now)
        self.spanning.finished(name, msg.substage)
        if ended is None:  # a migration already ended it, or it never started
            return pr.Ok(req=msg.req)
        r, piece = ended
        if not r.on_device:  # host work (reward, tool): it never held the device
            cores = getattr(handed.partition, "cores", None) if handed is not None else None
            self._event("host", name, piece.id, t_s=r.start_s, data={
                "end_s": now, **({"computes": True} if r.computes else {}),
                **({"cores": list(cores)} if cores is not None else {})})
        else:
            data = {"flops": msg.flops, "tokens": msg.num_tokens, "exclusive_s": piece.duration_s}
            if (got := self._learned(piece.id)) is not None:  # the plan's error for it, as the learner saw it
                data["learned"] = {"entry": list(got.entry) if got.entry else None, "error_log": got.error_log}
            if (probe := self._probe(name, piece.id)) is not None:
                data["probe"] = "alone" if probe else "joined"
            self._event("release", name, piece.id, device=r.device, data=data)
        return pr.Ok(req=msg.req)

    def _learned(self, sid: str):
        """What the learner took of the grant of `sid` that just ended, or None."""
        grants = self.state.grants
        if grants is None or not grants.history or grants.history[-1].sid != sid:
            return None
        return grants.history[-1]

    def _probe(self, name: str, sid: str) -> bool | None:
        """Was the grant of `sid` that just ended a learning probe: True if it ran wholly alone,
        False if something joined it; None: not a probe."""
        last = None if self.state.grants is None else self.state.grants.last_probe
        return last[2] if last is not None and last[:2] == (name, sid) else None

    def _release(self, msg: Release) -> pr.Error:
        """A Done refused for its report still ends its grant; the sender gets the refusal."""
        done = pr.Done(session=msg.session, substage=msg.substage, req=msg.req)
        with contextlib.suppress(ValueError):  # no such session, or not its grant: nothing to give back
            self._done(done, self._session(msg.session), self.now(), report=False)
        return msg.error

    def _migrate(self, msg: pr.Migrate) -> pr.Migrated:
        """An operator's migration order, applied as the scheduler's are (the source's owner
        is told; the trace records the order, so a replay applies it too).  Only the
        pipeline's owner may give it."""
        if msg.pipeline in self.state.pipelines:
            owners.check(self.owners, msg.pipeline, msg.owner)
        now = self.now()
        try:
            d = self.state.migrate(msg.pipeline, msg.source_rank, msg.target_rank, now)
        except ValueError as exc:
            raise pr.ProtocolError("bad-request", str(exc)) from None
        self._event("migrate", msg.pipeline, data=inputs.record(msg))
        self._effect(d, grants.make(d, self.partitioner), now, decide_ms=0.0, operator=True)
        self._dirty = True  # the source's device is free: decide again
        m = d.plan.migrations[0]
        return pr.Migrated(source=m.source, target=m.target, req=msg.req)

    def _step_end(self, msg: pr.StepEnd, session: Session) -> pr.Ok:
        name = session.pipeline
        start = self.step_start.get(name, 0.0)
        self.step_start[name] = self.now()
        self._event("step", name, data={"step": msg.step, "latency_s": self.now() - start, "tokens": msg.tokens,
                                        "samples": msg.samples, "flops": msg.flops,
                                        **step_fields(self.state.pipeline(name), msg.step)})
        return pr.Ok(req=msg.req)

    # ------------------------------------------------------------ leases

    def _expire(self) -> None:
        """Sessions silent for a lease; after a stall of the daemon every session has a whole
        lease from when it came back (its heartbeats may still be queued)."""
        deadline = self.wall() - self.config.lease_s
        if self._awake_s > deadline:
            return
        dead = [token for token, s in self.sessions.items() if s.last_seen < deadline]
        for token in dead:
            self._drop(token, reason="lease expired")
        if dead:
            self._decide()

    def _drop(self, token: str, reason: str, whole: bool = False) -> None:
        """A client left: its requests and grants go; the pipeline goes with its last client
        (or with `whole`, when `jigsaw run` says the pipeline is done)."""
        session = self.sessions.pop(token, None)
        if session is None:
            return
        self._wake(session, force=True)  # a parked heartbeat is answered, not left to time out
        name = session.pipeline
        tokens = {token}
        if whole:
            tokens |= {t for t, s in self.sessions.items() if s.pipeline == name}
            for t in tokens:
                self.sessions.pop(t, None)
        removed = whole or not any(s.pipeline == name for s in self.sessions.values())
        self.spanning.forget(tokens, name if removed else None)
        if name not in self.state.pipelines:
            return
        gone = self.state.drop(name, lambda owner: owner.session in tokens)
        if removed:
            self.state.remove(name)
            self.inbox.forget(name)
            for per_pipeline in (self.owners, self.step_start, self.requested, self.granted, self.slo,
                                 self._warned_slo):
                per_pipeline.pop(name, None)
        self._withdrawn(name, gone, reason, removed)
        if gone or removed:
            log.info("%s: %s (%d requests and grants withdrawn)", name, reason, len(gone))
        self._gauge()

    # ------------------------------------------------------------ decisions

    def _decide(self) -> None:
        now, began = self.now(), self.wall()
        try:
            d = self.state.decide(now)
        except Exception as exc:  # noqa: BLE001 - the node state must never take the daemon down
            log.exception("deciding failed: every waiting request runs without the daemon")
            return self._give_up(self.state.waiting_requests(), f"{type(exc).__name__}: {exc}")
        if d is None:
            return
        try:
            made = grants.make(d, self.partitioner)
        except Exception as exc:  # noqa: BLE001 - admitted requests are answered all the same
            log.exception("making the partitions failed: the admitted requests run without the daemon")
            admitted = [(a.held.pipeline, a.sid, a.held.owner) for a in d.admitted]
            return self._give_up(admitted, f"{type(exc).__name__}: {exc}")
        self._effect(d, made, now, decide_ms=1e3 * (self.wall() - began))

    def _give_up(self, requests, why: str) -> None:
        """The scheduler failed: each of these requests (pipeline, id, owner) is withdrawn and
        answered (it runs without the daemon and reports so); none is left waiting for a reply."""
        for name, sid, owner in requests:
            self.state.withdraw(name, [sid])
            if owner is not None:
                self._send(owner.conn, pr.Error(code="scheduler", message=f"scheduler failed ({why}); "
                                                 "run it without the daemon", req=owner.req))

    def _effect(self, d: Decision, made: grants.Made, now: float, decide_ms: float, operator: bool = False) -> None:
        """Act on a decision (`operator`: an operator's migration order, not the policy's plan)."""
        if d.fallback:
            log.warning("policy %s failed (%s): requests admitted alone by turn", self.config.policy, d.fallback)
        for note in d.notes:
            log.warning("plan at %.3f s: %s", now, note)
        if not operator:
            self._forecasts(d.plan.slo, now)
        self._event("plan", "", t_s=now, data={**d.record(), "decide_ms": decide_ms,
                                               **({"operator": True} if operator else {})})
        self._gauge()  # before any grant goes out: a worker acting on its grant sees it counted
        for ms in d.orders.values():  # a migration the applier ignored is in the plan's notes, not here
            for m in ms:
                # The ranks too: an operator's order to a rank whose rollout has ended names no target.
                self._event("migration", m.pipeline, m.source, data={"target": m.target, "delta_s": m.delta_s,
                                                                      "source_rank": m.source_rank,
                                                                      "target_rank": m.target_rank})
        for h, g in zip(d.moved, made.moved):  # its owner hands its requests over: told like a budget change
            if h.owner is not None and h.owner.session in self.sessions:
                self.sessions[h.owner.session].queue(g, self.wall(), 0.0)
            self._event("release", h.pipeline, h.sid, device=h.device, data={"migrated": True})
        for adm, g in zip(d.admitted, made.admitted):
            owner = adm.held.owner
            if (s := self.sessions.get(owner.session)) is not None:
                s.admitted(g)
            self._traced_grant(adm.held, g)  # before the worker can act on it
            self._send(owner.conn, g)
            self.granted[adm.held.pipeline] += 1
        for h, g in zip(d.changed, made.changed):
            if h.owner is not None and h.owner.session in self.sessions:
                self.sessions[h.owner.session].queue(g, self.wall(), self.config.grow_delay_s)
            self._traced_grant(h, g)
        for h, g in made.hosts:  # computing host work follows the cores its device leaves free
            if h.owner is not None and h.owner.session in self.sessions:
                self.sessions[h.owner.session].queue(g, self.wall(), self.config.grow_delay_s)
        for session in self.sessions.values():
            self._wake(session)

    def _forecasts(self, slo: tuple[SloForecast, ...], now: float) -> None:
        """The plan's SLO forecasts replace the last plan's; a given-up SLO is logged once a step."""
        self.slo = {f.pipeline: f for f in slo}
        for f in slo:
            if not f.kept and self._warned_slo.get(f.pipeline) != f.step:
                self._warned_slo[f.pipeline] = f.step
                log.warning("plan at %.3f s gives up the SLO of %s for step %d (%.3g s late): %s", now,
                            f.pipeline, f.step, f.late_s, f.reason)

    def _traced_grant(self, h, g: pr.Grant) -> None:
        if h.on_device:
            part = {"partition": grants.describe(g.partition)} if g.partition is not None else {}
            self._event("grant", h.pipeline, g.substage, device=g.device, sm_frac=g.sm_frac, mem_bytes=g.mem_bytes,
                        slowdown=h.slowdown, data={"need_bytes": h.need_bytes, "pids": list(h.pids), **part})

    # ------------------------------------------------------------ trace, metrics

    def _event(self, event: str, pipeline: str, substage: str = "", t_s: float | None = None, **kw) -> None:
        if self._metrics is not None:
            self._metrics.count(event)
        if self.trace_writer is not None:
            self.trace_writer.write(TraceEvent(t_s=self.now() if t_s is None else t_s, event=event,
                                               pipeline=pipeline, substage=substage, **kw))

    def _gauge(self) -> None:
        if self._metrics is not None:
            self._metrics.set(self.state, self.slo)
