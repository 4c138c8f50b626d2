"""`jigsaw daemon`: one per node; owns the node state, the policy, partitions and the trace.

    clients ──ipc (ZeroMQ ROUTER, 0600 socket in a 0700 dir)──► Daemon.serve()
        │ every frame: peer uid (SO_PEERCRED, via ZeroMQ's Peer-Address) ─► size ─► schema
        ▼
    sessions ─► NodeState (graph/node.py: the simulator's too): register / request / finish
        │ after every change; leases judged after the socket is drained
        ▼
    NodeState.decide() ─► Decision ─► grants.py: partitions (pure) ─► Grant replies (deferred
        │                 Admit answers) and budget changes in heartbeat replies
        ▼
    trace (jigsaw/trace.py, the node's inputs and plans too) · Prometheus metrics (optional)

A bad message gets an `Error` reply and changes nothing; the loop keeps serving the
others.  A failing policy falls back to admitting requests alone by turn (a pipeline never
fails because the daemon did).  The trace holds every input the node state saw, so a run's
decisions can be replayed offline (`jigsaw.sim.replay.replay_decisions`).
"""

from __future__ import annotations

import fcntl
import logging
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NamedTuple

import zmq

from jigsaw.graph.node import Decision, NodeState
from jigsaw.graph.plan import NodeSpec, SchedulerConfig
from jigsaw.graph.policy import NAMES, make
from jigsaw.graph.substage import SubStageKind
from jigsaw.mux.prior import node_grid
from jigsaw.runtime import grants
from jigsaw.runtime import protocol as pr
from jigsaw.runtime.paths import endpoint, runtime_dir, socket_path
from jigsaw.trace import TraceEvent, TraceWriter

log = logging.getLogger("jigsaw.daemon")


@dataclass(frozen=True, kw_only=True, slots=True)
class DaemonConfig:
    """The node daemon."""

    profile: Path | None = None
    """Slowdown grid (`jigsaw profile` output or a shipped prior); default: the analytic
    H100 prior of Qwen3-4B."""
    devices: int = 1
    """Devices the daemon partitions (GPUs, or CPU partitions)."""
    policy: str = "jigsaw"
    """What decides: jigsaw | greedy | serial (verl) | muxserve | rollmux | hrrs.  Any of them
    runs live, so the same jobs can be compared under each."""
    sched: SchedulerConfig = field(default_factory=SchedulerConfig)
    """The look-ahead scheduler (jigsaw; greedy is it at window 1)."""
    heartbeat_s: float = pr.HEARTBEAT_S
    """How often clients renew their lease."""
    lease_s: float = pr.LEASE_S
    """A client silent this long is dead: its grants are reclaimed."""
    max_wait_s: float | None = 2.0
    """A request waiting this long is admitted whatever the plan (the policy then only picks
    its budget); none: never (a baseline run live keeps its own order)."""
    trace: Path | None = None
    """Append the trace (JSON lines) here."""
    metrics_port: int | None = None
    """Serve Prometheus metrics on 127.0.0.1:PORT."""
    partitioner: str = "advisory"
    """advisory (budgets are told to workers, nothing enforces them) | green (CUDA green-context
    SM partitions, which each worker opens and binds itself) | cpu (core sets and thread
    counts of this machine's cores)."""
    telemetry_s: float | None = None
    """Sample GPU telemetry (NVML: SM utilisation, memory per process) into the trace every
    this many seconds."""
    mps: bool = False
    """Check the MPS control daemon at start-up and start it (thread percentage unset) if it
    is not running: processes of different pipelines run concurrently on a GPU only under MPS."""

    def __post_init__(self) -> None:
        if self.policy not in NAMES:
            raise ValueError(f"unknown policy {self.policy!r}; choose from {', '.join(NAMES)}")


class Owner(NamedTuple):
    """Who asked for a sub-stage: the session, and where its Grant goes."""

    session: str
    ident: bytes
    req: int


@dataclass(slots=True)
class Session:
    pipeline: str
    last_seen: float
    updates: dict[str, pr.Grant] = field(default_factory=dict)
    """Budget changes to hand out with the next heartbeat reply."""


class Daemon:
    def __init__(self, config: DaemonConfig, directory: Path | None = None, partitioner=None,
                 clock: Callable[[], float] = time.monotonic):
        """`clock` times the scheduler's facts (leases always run on the wall clock): a test
        that scripts it gets decisions that do not depend on machine load."""
        self.config, self.clock = config, clock
        self.dir = directory or runtime_dir()
        self.grid = node_grid(config.profile)
        node = NodeSpec(num_devices=config.devices, mem_bytes=self.grid.device.mem_bytes)
        self.state = NodeState(node, self.grid, make(config.policy, config.sched), next_step=config.sched.next_step,
                               max_wait_s=config.max_wait_s, liveness=True)
        self.partitioner = partitioner or grants.partitioner(config.partitioner, config.devices,
                                                             config.sched.budgets(self.grid))
        self.t0 = clock()
        self.sessions: dict[str, Session] = {}
        self.step_start: dict[str, float] = {}
        self.refused = self.errors = 0
        self._trace = TraceWriter(config.trace) if config.trace else None
        self._metrics = _Metrics(config.metrics_port) if config.metrics_port else None
        self.stopping = False
        self._event("node", "", data={"policy": config.policy, "sched": asdict(config.sched),
                                      "max_wait_s": config.max_wait_s, "devices": config.devices,
                                      "profile": str(config.profile) if config.profile else None,
                                      "partitioner": self.partitioner.kind, "pid": os.getpid(),
                                      "clock_t0_s": self.t0})  # event times are clock − t0

    def now(self) -> float:
        return self.clock() - self.t0

    # ------------------------------------------------------------ loop

    def serve(self) -> None:
        lock = _lock(self.dir / "daemon.lock")
        if self.config.mps:
            self._check_mps()
        telemetry = self._start_telemetry()
        ep = endpoint(self.dir)
        ctx = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.MAXMSGSIZE, pr.HARD_LIMIT_BYTES)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(ep)
        os.chmod(socket_path(ep), 0o600)
        self.sock = sock
        log.info("jigsaw daemon %d listening on %s (policy %s)", os.getpid(), ep, self.config.policy)
        try:
            while not self.stopping:
                if sock.poll(timeout=50):
                    self._drain(sock)
                self._expire()
        finally:
            if telemetry is not None:
                telemetry.stop()
            if self._trace is not None:
                self._trace.close()
            sock.close(0)
            ctx.term()
            lock.close()

    def _drain(self, sock, most: int = 256) -> None:
        """Every message that is waiting (up to `most`): leases are judged only after the
        heartbeats that queued while the daemon was busy have been read."""
        for _ in range(most):
            try:
                frames = sock.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._receive(frames)

    def _start_telemetry(self):
        if self.config.telemetry_s is None or self._trace is None:
            return None
        from jigsaw.mux.telemetry import Telemetry, TelemetryError

        try:
            return Telemetry(self._trace.write, interval_s=self.config.telemetry_s, clock=self.now).start()
        except TelemetryError as exc:  # no NVML: the node still schedules
            log.warning("telemetry off: %s", exc)
            return None

    def _check_mps(self) -> None:
        from jigsaw.mux.mps import ensure_mps

        st = ensure_mps(start=True)
        log.info("MPS: %s (%s)%s", st.state, st.reason, " - started" if st.started else "")
        for w in st.warnings:  # e.g. a default active thread percentage that caps every partition
            log.warning("MPS: %s", w)

    def _receive(self, frames) -> None:
        ident = frames[0].bytes
        peer = frames[-1].get("Peer-Address") or ""
        if not _same_uid(peer):
            self.refused += 1
            log.warning("refused a message from peer %r (uid is not %d)", peer, os.getuid())
            return self._send(ident, pr.Error(code="refused", message=f"peer uid is not {os.getuid()}"))
        if len(frames) != 2:
            self.errors += 1
            return self._send(ident, pr.Error(code="bad-message", message=f"expected 1 frame, got {len(frames) - 1}"))
        try:
            msg = pr.decode_request(frames[1].bytes)
        except pr.ProtocolError as exc:
            self.errors += 1
            return self._send(ident, pr.Error(code=exc.code, message=str(exc)))
        try:
            reply = self._handle(msg, ident)
        except (KeyError, ValueError) as exc:
            self.errors += 1
            code = "unknown-session" if isinstance(exc, KeyError) else "out-of-order"
            reply = pr.Error(code=code, message=str(exc).strip("'\""), req=msg.req)
        if reply is not None:
            self._send(ident, reply)
        if isinstance(msg, (pr.Admit, pr.Done, pr.Unregister)):
            self._decide()

    def _send(self, ident: bytes, reply) -> None:
        try:
            self.sock.send_multipart([ident, pr.encode(reply)], flags=zmq.NOBLOCK)
        except zmq.ZMQError:  # the peer is gone; it will re-ask
            pass

    # ------------------------------------------------------------ requests

    def _handle(self, msg, ident: bytes):
        if isinstance(msg, pr.Status):
            return self._status(msg.req)
        if isinstance(msg, pr.Register):
            return self._register(msg)
        session = self._session(msg.session)
        session.last_seen = time.monotonic()
        if isinstance(msg, pr.Heartbeat):
            grants_now, session.updates = tuple(session.updates.values()), {}
            for g in grants_now:
                self._event("delivered", session.pipeline, g.substage, device=g.device, sm_frac=g.sm_frac)
            return pr.Beat(grants=grants_now, req=msg.req)
        if isinstance(msg, pr.Admit):
            return self._admit(msg, session, ident)
        if isinstance(msg, pr.Done):
            return self._done(msg, session)
        if isinstance(msg, pr.Opened):
            return self._opened(msg, session)
        if isinstance(msg, pr.StepEnd):
            return self._step_end(msg, session)
        if isinstance(msg, pr.Unregister):
            self._drop(msg.session, reason="unregistered", whole=msg.pipeline_done)
            return pr.Ok(req=msg.req)
        raise ValueError(f"unhandled request {type(msg).__name__}")

    def _session(self, token: str) -> Session:
        s = self.sessions.get(token)
        if s is None:
            raise KeyError(f"unknown session {token[:16]!r} (the daemon restarted?): register again")
        return s

    def _register(self, msg: pr.Register) -> pr.Registered:
        token = secrets.token_hex(8)
        if msg.pipeline not in self.state.pipelines:
            p = self.state.register(msg.pipeline, tuple(msg.devices))
            self.step_start[p.name] = self.now()
            self._event("pipeline", p.name, data={"devices": list(p.devices), "pid": msg.pid,
                                                  "device": self.grid.device.sku,
                                                  "peak_flops": self.grid.device.peak_flops})
        self.sessions[token] = Session(pipeline=msg.pipeline, last_seen=time.monotonic())
        self._gauge()
        return pr.Registered(session=token, heartbeat_s=self.config.heartbeat_s, lease_s=self.config.lease_s,
                             req=msg.req)

    def _admit(self, msg: pr.Admit, session: Session, ident: bytes) -> None:
        p = self.state.pipelines[session.pipeline]
        kind = SubStageKind(msg.kind)
        w = p.request(kind, msg.dp_rank, msg.step, self.now(), urgent=msg.urgent, need_bytes=msg.mem_bytes,
                      pids=tuple(msg.pids), owner=Owner(msg.session, ident, msg.req))
        self._event("request", p.name, w.sid, data={"kind": kind.value, "rank": msg.dp_rank, "step": msg.step,
                                                    "urgent": msg.urgent, "need_bytes": msg.mem_bytes,
                                                    "pids": list(msg.pids)})
        return None  # answered by a Grant when admitted

    def _done(self, msg: pr.Done, session: Session) -> pr.Ok:
        p = self.state.pipelines[session.pipeline]
        r = p.running.get(msg.substage)
        if msg.substage not in p.merged_away and (r is None or r.owner is None or r.owner.session != msg.session):
            raise ValueError(f"{msg.substage} is not running for this session")
        numbers = {"batch_size": msg.batch_size, "seq_len": msg.seq_len, "num_steps": msg.num_steps,
                   "num_tokens": msg.num_tokens, "flops": msg.flops}
        self._event("done", p.name, msg.substage, data={**numbers, "final": msg.final})
        session.updates.pop(msg.substage, None)  # a budget change it no longer needs
        ended = self.state.finish(p.name, msg.substage, self.now(), final=msg.final, **numbers)
        if ended is None:  # a migration already ended it
            return pr.Ok(req=msg.req)
        r, piece = ended
        if not r.on_device:  # host work (reward, tool): it never held the device
            self._event("host", p.name, piece.id, t_s=r.start_s, data={"end_s": self.now()})
        else:
            self._event("release", p.name, piece.id, device=r.device,
                        data={"flops": msg.flops, "tokens": msg.num_tokens, "exclusive_s": piece.duration_s})
        return pr.Ok(req=msg.req)

    def _opened(self, msg: pr.Opened, session: Session) -> pr.Ok:
        self._event("open", session.pipeline, msg.substage, data={"reason": msg.reason, "kind": msg.kind,
                                                                   "rank": msg.dp_rank, "step": msg.step,
                                                                   "duration_s": msg.duration_s})
        return pr.Ok(req=msg.req)

    def _step_end(self, msg: pr.StepEnd, session: Session) -> pr.Ok:
        name = session.pipeline
        start = self.step_start.get(name, 0.0)
        self.step_start[name] = self.now()
        self._event("step", name, data={"step": msg.step, "latency_s": self.now() - start, "tokens": msg.tokens,
                                        "samples": msg.samples, "flops": msg.flops})
        return pr.Ok(req=msg.req)

    def _status(self, req: int) -> pr.StatusReply:
        clients: dict[str, int] = {}
        for s in self.sessions.values():
            clients[s.pipeline] = clients.get(s.pipeline, 0) + 1
        info = tuple(pr.PipelineInfo(name=p.name, clients=clients.get(p.name, 0), step=p.step,
                                     running=tuple(p.running), pending=tuple(p.waiting))
                     for p in self.state.pipelines.values())
        return pr.StatusReply(pid=os.getpid(), pipelines=info, refused=self.refused, errors=self.errors, req=req)

    # ------------------------------------------------------------ leases

    def _expire(self) -> None:
        deadline = time.monotonic() - self.config.lease_s
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
        name = session.pipeline
        tokens = {token}
        if whole:
            tokens |= {t for t, s in self.sessions.items() if s.pipeline == name}
            for t in tokens:
                self.sessions.pop(t, None)
        p = self.state.pipelines.get(name)
        if p is None:
            return
        gone = [f for f in (*p.waiting.values(), *p.running.values())
                if f.owner is not None and f.owner.session in tokens]
        for f in gone:
            p.withdraw(f.sid)
        removed = whole or not any(s.pipeline == name for s in self.sessions.values())
        if removed:
            self.state.remove(name)
        self._event("drop", name, data={"reason": reason, "withdrawn": [f.sid for f in gone], "removed": removed})
        for f in gone:
            if hasattr(f, "device") and f.on_device:
                self._event("release", name, f.sid, device=f.device, data={"reclaimed": reason})
        if gone or removed:
            log.info("%s: %s (%d requests and grants withdrawn)", name, reason, len(gone))
        self._gauge()

    # ------------------------------------------------------------ decisions

    def _decide(self) -> None:
        now = self.now()
        try:
            d = self.state.decide(now)
        except Exception:  # noqa: BLE001 - the node state must never take the daemon down
            log.exception("deciding failed; nothing changes until the next event")
            return
        if d is not None:
            self._effect(d, now)

    def _effect(self, d: Decision, now: float) -> None:
        if d.fallback:
            log.warning("policy %s failed (%s): requests admitted alone by turn", self.config.policy, d.fallback)
        for note in d.notes:
            log.warning("plan at %.3f s: %s", now, note)
        self._event("plan", "", t_s=now, data=d.record())
        for m in d.plan.migrations:
            self._event("migration", m.pipeline, m.source, data={"target": m.target, "delta_s": m.delta_s})
        made = grants.make(d, self.state, self.partitioner)
        for adm, g in zip(d.admitted, made.admitted):
            self._send(adm.waiting.owner.ident, g)
            self._traced_grant(adm.assignment.pipeline, adm.running, g)
        for (r, a), g in zip(d.changed, made.changed):
            if r.owner is not None and r.owner.session in self.sessions:
                self.sessions[r.owner.session].updates[r.sid] = g
            self._traced_grant(a.pipeline, r, g)
        self._gauge()

    def _traced_grant(self, pipeline: str, r, g: pr.Grant) -> None:
        if r.on_device:
            part = {"partition": grants.describe(g.partition)} if g.partition is not None else {}
            self._event("grant", pipeline, g.substage, device=g.device, sm_frac=g.sm_frac, mem_bytes=g.mem_bytes,
                        slowdown=r.slowdown, data={"need_bytes": r.need_bytes, "pids": list(r.pids), **part})

    # ------------------------------------------------------------ trace, metrics

    def _event(self, event: str, pipeline: str, substage: str = "", t_s: float | None = None, **kw) -> None:
        if self._metrics is not None:
            self._metrics.count(event)
        if self._trace is not None:
            self._trace.write(TraceEvent(t_s=self.now() if t_s is None else t_s, event=event, pipeline=pipeline,
                                         substage=substage, **kw))

    def _gauge(self) -> None:
        if self._metrics is not None:
            self._metrics.set(self.state)


def _same_uid(peer: str) -> bool:
    """ZeroMQ reports an ipc peer as `host:uid:gid:pid` from SO_PEERCRED."""
    parts = peer.rsplit(":", 3)
    return len(parts) == 4 and parts[1].isdigit() and int(parts[1]) == os.getuid()


def _lock(path: Path):
    f = open(path, "a+")
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        raise RuntimeError(f"another jigsaw daemon holds {path} (pid {f.read().strip() or '?'})") from None
    f.seek(0)
    f.truncate()
    f.write(str(os.getpid()))
    f.flush()
    return f


class _Metrics:
    def __init__(self, port: int):
        from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server
        self.registry = CollectorRegistry()
        self.events = Counter("jigsaw_trace_events", "Trace events by kind", ["event"], registry=self.registry)
        self.pipelines = Gauge("jigsaw_pipelines", "Registered pipelines", registry=self.registry)
        self.running = Gauge("jigsaw_running_substages", "Granted sub-stages", registry=self.registry)
        self.pending = Gauge("jigsaw_pending_substages", "Sub-stages waiting for admission", registry=self.registry)
        start_http_server(port, addr="127.0.0.1", registry=self.registry)

    def count(self, event: str) -> None:
        self.events.labels(event=event).inc()

    def set(self, state: NodeState) -> None:
        self.pipelines.set(len(state.pipelines))
        self.running.set(sum(len(p.running) for p in state.pipelines.values()))
        self.pending.set(sum(len(p.waiting) for p in state.pipelines.values()))
