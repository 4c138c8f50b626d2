"""`jigsaw daemon`: one per node; owns partitions, slowdown model, graphs and scheduler.

    clients ──ipc (ZeroMQ ROUTER, 0600 socket in a 0700 dir)──► Daemon.serve()
        │ every frame: peer uid (SO_PEERCRED, via ZeroMQ's Peer-Address) ─► size ─► schema
        ▼
    NodeState (node.py): register / request / finish / drop      leases: expire clients
        │ after every change                                       silent for lease_s
        ▼
    NodeState.decide() ─► Plan ─► Grant replies (deferred Admit answers), budget changes
        │                         in heartbeat replies, Partitioner.apply per device
        ▼
    trace (JSONL, jigsaw/trace.py events) · Prometheus metrics (optional)

A bad message gets an `Error` reply and changes nothing; the loop keeps serving the
others.  An exception in the scheduler is logged and the waiting requests are admitted
exclusively-by-turn (a pipeline never fails because the daemon did).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import secrets
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import zmq

from jigsaw.graph.plan import Assignment, NodeSpec, Plan, SchedulerConfig
from jigsaw.mux.partition import NullPartitioner, Partitioner
from jigsaw.runtime import protocol as pr
from jigsaw.runtime.node import Decision, NodeState, Pending
from jigsaw.runtime.paths import endpoint, runtime_dir, socket_path
from jigsaw.trace import TraceEvent

log = logging.getLogger("jigsaw.daemon")


@dataclass(frozen=True, kw_only=True, slots=True)
class DaemonConfig:
    """The node daemon."""

    profile: Path | None = None
    """Slowdown grid (`jigsaw profile` output or a shipped prior); default: the analytic
    H100 prior of Qwen3-4B."""
    devices: int = 1
    """Devices the daemon partitions (GPUs, or CPU partitions)."""
    heartbeat_s: float = 0.25
    """How often clients renew their lease."""
    lease_s: float = 1.0
    """A client silent this long is dead: its grants are reclaimed."""
    max_wait_s: float = 2.0
    """A request waiting this long is admitted whatever the plan (the scheduler then only
    picks its budget)."""
    window: int = 3
    """Look-ahead depth W of the scheduler."""
    trace: Path | None = None
    """Append the trace (JSON lines) here."""
    metrics_port: int | None = None
    """Serve Prometheus metrics on 127.0.0.1:PORT."""
    partitioner: str = "advisory"
    """advisory (budgets are told to workers, nothing enforces them) | green (CUDA green-context
    SM partitions: each worker binds `GreenPartitions(...).pair(budget)[side]`) | cpu (core sets
    and thread counts, jigsaw/mux/cpu.py)."""
    telemetry_s: float | None = None
    """Sample GPU telemetry (NVML: SM utilisation, memory per process) into the trace every
    this many seconds."""
    mps: bool = False
    """Check the MPS control daemon at start-up and start it (thread percentage unset) if it
    is not running: processes of different pipelines run concurrently on a GPU only under MPS."""


class Daemon:
    def __init__(self, config: DaemonConfig, directory: Path | None = None,
                 partitioner: Partitioner | None = None):
        self.config = config
        self.dir = directory or runtime_dir()
        grid = _load_grid(config.profile)
        node = NodeSpec(num_devices=config.devices, mem_bytes=grid.device.mem_bytes)
        budgets = tuple(s for s in grid.sm_levels if s < 1.0)  # only splits the grid measured (and the device can make)
        self.state = NodeState(node, grid, SchedulerConfig(window=config.window, sm_budgets_frac=budgets))
        self.partitioner = partitioner or _partitioner(config.partitioner, config.devices)
        self.t0 = time.monotonic()
        self.last_seen: dict[str, float] = {}
        self.updates: dict[str, dict[str, pr.Grant]] = {}
        self.step_start: dict[str, float] = {}
        self.refused = self.errors = 0
        self._trace = open(config.trace, "a", buffering=1) if config.trace else None
        self._trace_lock = threading.Lock()
        self._metrics = _Metrics(config.metrics_port) if config.metrics_port else None
        self.stopping = False

    def now(self) -> float:
        return time.monotonic() - self.t0

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
        log.info("jigsaw daemon %d listening on %s", os.getpid(), ep)
        try:
            while not self.stopping:
                if sock.poll(timeout=50):
                    self._receive(sock.recv_multipart(copy=False))
                self._expire()
        finally:
            if telemetry is not None:
                telemetry.stop()
            sock.close(0)
            ctx.term()
            lock.close()

    def _start_telemetry(self):
        if self.config.telemetry_s is None or self._trace is None:
            return None
        from jigsaw.mux.telemetry import Telemetry, TelemetryError

        try:
            return Telemetry(self._write, interval_s=self.config.telemetry_s, clock=self.now).start()
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
            reply = pr.Error(code=code, message=str(exc), req=msg.req)
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
        session = msg.session
        self.state.pipeline_of(session)  # KeyError: unknown session (e.g. a restarted daemon)
        self.last_seen[session] = time.monotonic()
        if isinstance(msg, pr.Heartbeat):
            return pr.Beat(grants=tuple(self.updates.pop(session, {}).values()), req=msg.req)
        if isinstance(msg, pr.Admit):
            sid = self.state.request(session, msg.kind, msg.dp_rank, msg.step, ident, msg.req, self.now(), msg.urgent,
                                     msg.mem_bytes)
            log.debug("request %s", sid)
            return None  # answered by a Grant when admitted
        if isinstance(msg, pr.Done):
            return self._done(msg)
        if isinstance(msg, pr.StepEnd):
            return self._step_end(msg)
        if isinstance(msg, pr.Unregister):
            self._drop(session, reason="unregistered", whole=msg.pipeline_done)
            return pr.Ok(req=msg.req)
        raise ValueError(f"unhandled request {type(msg).__name__}")

    def _register(self, msg: pr.Register) -> pr.Registered:
        session = secrets.token_hex(8)
        new = msg.pipeline not in self.state.pipelines
        p = self.state.register(msg.pipeline, session, tuple(msg.devices))
        self.last_seen[session] = time.monotonic()
        if new:
            self.step_start[p.name] = self.now()
            self._event("pipeline", p.name, data={"devices": list(p.devices), "pid": msg.pid,
                                                  "device": self.state.grid.device.sku,
                                                  "peak_flops": self.state.grid.device.peak_flops})
        self._gauge()
        return pr.Registered(session=session, heartbeat_s=self.config.heartbeat_s, lease_s=self.config.lease_s,
                             req=msg.req)

    def _done(self, msg: pr.Done) -> pr.Ok:
        r, piece = self.state.finish(msg.session, msg.substage, self.now(), batch_size=msg.batch_size,
                                     seq_len=msg.seq_len, num_steps=msg.num_steps, num_tokens=msg.num_tokens,
                                     flops=msg.flops)
        if r.budget.sm_frac == 0.0:  # host work (reward, tool): it never held the device
            self._event("host", piece.pipeline, piece.id, t_s=r.start_s, data={"end_s": self.now()})
        else:
            self._event("release", piece.pipeline, piece.id, device=r.device,
                        data={"flops": msg.flops, "tokens": msg.num_tokens, "exclusive_s": piece.duration_s})
        return pr.Ok(req=msg.req)

    def _step_end(self, msg: pr.StepEnd) -> pr.Ok:
        p = self.state.pipeline_of(msg.session)
        start = self.step_start.get(p.name, 0.0)
        self.step_start[p.name] = self.now()
        self._event("step", p.name, data={"step": msg.step, "latency_s": self.now() - start, "tokens": msg.tokens,
                                          "samples": msg.samples, "flops": msg.flops})
        return pr.Ok(req=msg.req)

    def _status(self, req: int) -> pr.StatusReply:
        info = tuple(pr.PipelineInfo(name=p.name, clients=len(p.clients), step=p.step, running=tuple(p.running),
                                     pending=tuple(p.pending)) for p in self.state.pipelines.values())
        return pr.StatusReply(pid=os.getpid(), pipelines=info, refused=self.refused, errors=self.errors, req=req)

    # ------------------------------------------------------------ leases

    def _expire(self) -> None:
        deadline = time.monotonic() - self.config.lease_s
        dead = [s for s, t in self.last_seen.items() if t < deadline]
        for s in dead:
            self._drop(s, reason="lease expired")
        if dead:
            self._decide()

    def _drop(self, session: str, reason: str, whole: bool = False) -> None:
        self.last_seen.pop(session, None)
        self.updates.pop(session, None)
        name = self.state.session_pipeline.get(session)
        sessions = [session]
        if whole and name is not None:
            sessions = [s for s, n in self.state.session_pipeline.items() if n == name]
        runs = []
        for s in sessions:
            self.last_seen.pop(s, None)
            runs += self.state.drop(s)[0]
        for r in runs:
            self._event("release", name or "", r.sid, device=r.device, data={"reclaimed": reason})
        if runs or whole:
            log.info("%s: %s (%d grants reclaimed)", name, reason, len(runs))
        self._gauge()

    # ------------------------------------------------------------ decisions

    def _decide(self) -> None:
        try:
            decision = self.state.decide(self.now(), self.config.max_wait_s)
        except Exception:  # noqa: BLE001 - the scheduler must never take the node down
            log.exception("scheduler failed; admitting the oldest request exclusively")
            decision = None
            self._admit_fallback()
        if decision is not None:
            self._effect(decision)

    def _effect(self, d: Decision) -> None:
        routing = {r.pipeline: r.weights for r in d.plan.routing}
        orders = {}
        for m in d.plan.migrations:
            orders.setdefault(m.pipeline, []).append(pr.MigrationOrder(source=m.source, target=m.target,
                                                                       source_rank=m.source_rank,
                                                                       target_rank=m.target_rank))
            self._event("migration", m.pipeline, m.source, data={"target": m.target, "delta_s": m.delta_s})
        parts = self._partitions(d.plan.assignments)
        for adm in d.admitted:
            a = adm.assignment
            g = self._grant(a, routing, orders, parts, req=adm.pending.req)
            self._send(adm.pending.ident, g)
            if a.sm_frac > 0.0:
                self._event("grant", a.pipeline, a.substage, device=a.device, sm_frac=a.sm_frac,
                            mem_bytes=a.mem_bytes, slowdown=a.slowdown)
        for r, a in d.changed:
            self.updates.setdefault(r.session, {})[r.sid] = self._grant(a, routing, orders, parts)
            self._event("grant", a.pipeline, a.substage, device=a.device, sm_frac=a.sm_frac, mem_bytes=a.mem_bytes,
                        slowdown=a.slowdown)
        self._gauge()

    def _grant(self, a: Assignment, routing, orders, parts, req: int = 0) -> pr.Grant:
        return pr.Grant(substage=a.substage, device=a.device, sm_frac=a.sm_frac, mem_bytes=a.mem_bytes,
                        micro_batch=a.micro_batch, routing=routing.get(a.pipeline),
                        migrations=tuple(orders.get(a.pipeline, ())), partition=parts.get(a.substage, {}), req=req)

    def _partitions(self, assignments) -> dict[str, dict[str, str]]:
        out: dict[str, dict[str, str]] = {}
        for dev in {a.device for a in assignments}:
            budgets = {a.substage: a.sm_frac for a in assignments if a.device == dev}
            try:
                out.update(self.partitioner.apply(dev, budgets))
            except Exception as exc:  # noqa: BLE001 - budgets stay advisory rather than the node stopping
                log.warning("partitioner failed on device %d (%s); budgets there are advisory", dev, exc)
                out.update(NullPartitioner().apply(dev, budgets))
        return out

    def _admit_fallback(self) -> None:
        """Scheduler failure: admit, per free device, the oldest request alone."""
        busy = {r.device for p in self.state.pipelines.values() for r in p.running.values()}
        waiting: list[tuple[float, Pending, object]] = sorted(
            ((q.since_s, q, p) for p in self.state.pipelines.values() for q in p.pending.values()),
            key=lambda w: w[0])
        for _, q, p in waiting:
            dev = p.devices[int(q.sid.split("/")[2][1:])]
            if dev in busy:
                continue
            busy.add(dev)
            a = Assignment(substage=q.sid, pipeline=p.name, device=dev, sm_frac=1.0,
                           mem_bytes=self.state.node.mem_bytes, slowdown=1.0)
            plan = Plan(time_s=self.now(), started=(a.substage,), assignments=(a,))
            self._effect(self.state.effects(plan, [p], self.now()))

    # ------------------------------------------------------------ trace, metrics

    def _event(self, event: str, pipeline: str, substage: str = "", t_s: float | None = None, **kw) -> None:
        if self._metrics is not None:
            self._metrics.count(event)
        if self._trace is not None:
            self._write(TraceEvent(t_s=self.now() if t_s is None else t_s, event=event, pipeline=pipeline,
                                   substage=substage, **kw))

    def _write(self, ev: TraceEvent) -> None:
        with self._trace_lock:  # the telemetry thread writes too
            self._trace.write(json.dumps(asdict(ev), separators=(",", ":")) + "\n")

    def _gauge(self) -> None:
        if self._metrics is not None:
            self._metrics.set(self.state)


def _partitioner(name: str, num_devices: int) -> Partitioner:
    if name == "advisory":
        return NullPartitioner()
    if name == "green":
        from jigsaw.mux.green import GreenPartitioner

        return GreenPartitioner()
    if name == "cpu":
        from jigsaw.mux.cpu import CpuPartitioner

        return CpuPartitioner(num_devices)
    raise ValueError(f"unknown partitioner {name!r}; use advisory, green or cpu")


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


def _load_grid(profile: Path | None):
    if profile is not None:
        from jigsaw.mux.slowdown import load_grid
        return load_grid(profile)
    from jigsaw.mux.prior import DEVICES, analytic_prior
    return analytic_prior(DEVICES["h100"], "qwen3-4b")


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
        self.pending.set(sum(len(p.pending) for p in state.pipelines.values()))
