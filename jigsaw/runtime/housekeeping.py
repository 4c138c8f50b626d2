"""The daemon's housekeeping in its runtime directory: lock, socket, traces, idle exit.

    start  Home(dir): flock dir/daemon.lock (plumbing.lock, this pid in it; taken again if the
             file was replaced meanwhile, so the lock held is always the file at that path)
           Home.listen() ─► dir/daemon.sock, its identity (device, inode) kept
           fresh_trace(dir) ─► traces/daemon-<time>-<pid>.jsonl (when no --trace was given);
             the oldest daemon-*.jsonl beyond KEEP_TRACES go, nothing else is touched
    serve  Idle.due(busy, now): no pipeline registered for idle_exit_s ─► the daemon stops
    exit   (SIGTERM, SIGINT, a Stop request, idle) ─► Home.close(): the socket, then the lock,
             each removed only while the file at its path is still the one this daemon made
             (a daemon that starts next never loses its files to one that is leaving)
    say    hello(daemon): its start line in the log · status_reply(daemon): `jigsaw daemon status`
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from jigsaw import protocol as pr
from jigsaw.runtime import plumbing
from jigsaw.runtime.paths import endpoint, new_trace_path, socket_path, traces_dir

log = logging.getLogger("jigsaw.daemon")
KEEP_TRACES = 20
"""Daemon traces kept in the runtime directory's traces/ (the newest, the new one included)."""
GIVEN_UP_CHARS = 240
"""A status reply's reason for a given-up SLO is cut to this (the log has it whole)."""
TRACE_GLOB = "daemon-*.jsonl"
"""The only files trace rotation ever deletes."""
LOCK_ATTEMPTS = 3


def file_id(path: Path) -> tuple[int, int] | None:
    """(device, inode) of the file at `path` itself (a link is not followed); None if none."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


class Home:
    """This daemon's lock and socket in `directory`; `close()` removes what is still its own."""

    def __init__(self, directory: Path):
        self.lock_path = directory / "daemon.lock"
        self.sock_path: Path | None = None
        self.sock_id: tuple[int, int] | None = None
        self.lock = self._take_lock()

    def _take_lock(self):
        """plumbing.lock, checked against the path: a lock taken on a file that a leaving
        daemon unlinked meanwhile would lock nothing anyone else opens."""
        for _ in range(LOCK_ATTEMPTS):
            f = plumbing.lock(self.lock_path)  # RuntimeError: another daemon holds it
            st = os.fstat(f.fileno())
            if file_id(self.lock_path) == (st.st_dev, st.st_ino):
                return f
            f.close()
        raise RuntimeError(f"{self.lock_path} keeps being replaced: is another daemon starting and stopping?")

    def listen(self, directory: Path, refuse: Callable, too_large: Callable, clock: Callable[[], float]):
        self.sock_path = socket_path(endpoint(directory))
        listener = plumbing.listen(self.sock_path, refuse, too_large, clock)
        self.sock_id = file_id(self.sock_path)
        return listener

    def close(self, listener) -> None:
        if listener is not None:
            if self.sock_id is not None and file_id(self.sock_path) == self.sock_id:
                listener.close()  # unlinks the socket
            else:
                log.warning("%s is no longer this daemon's socket: left in place", self.sock_path)
                listener.sel.close()
                listener.sock.close()
        st = os.fstat(self.lock.fileno())
        if file_id(self.lock_path) == (st.st_dev, st.st_ino):
            with contextlib.suppress(OSError):
                self.lock_path.unlink()  # still holding the lock: nobody else can own this file
        self.lock.close()


# ------------------------------------------------------------------ traces

def fresh_trace(directory: Path, keep: int = KEEP_TRACES) -> Path:
    """A new trace path under `directory`/traces, the oldest traces beyond `keep` deleted."""
    path = new_trace_path(directory)
    prune_traces(directory, keep - 1, spare=path)
    return path


def prune_traces(directory: Path, keep: int, spare: Path | None = None) -> list[Path]:
    """Delete the oldest daemon-*.jsonl (by modification time) beyond the newest `keep`;
    `spare` is neither counted nor deleted.  Returns what was deleted."""
    traces = [p for p in traces_dir(directory).glob(TRACE_GLOB) if p != spare and p.is_file()]
    traces.sort(key=lambda p: (_mtime(p), p.name), reverse=True)
    gone = []
    for old in traces[max(keep, 0):]:
        with contextlib.suppress(OSError):
            old.unlink()
            gone.append(old)
    if gone:
        log.info("deleted %d old trace(s) from %s (keeping the newest %d)", len(gone), traces_dir(directory), keep)
    return gone


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


# ------------------------------------------------------------------ idle exit

class Idle:
    """How long the daemon has had no pipeline registered."""

    def __init__(self, limit_s: float | None, now_s: float):
        self.limit_s = limit_s
        self.since_s: float | None = now_s
        """When it last became idle (None: busy)."""

    def due(self, busy: bool, now_s: float) -> bool:
        """Whether the daemon has been idle for `limit_s` by `now_s` (never without a limit)."""
        if busy:
            self.since_s = None
            return False
        if self.since_s is None:
            self.since_s = now_s
        return self.limit_s is not None and now_s - self.since_s >= self.limit_s


# ------------------------------------------------------------------ GPU side-services

def start_telemetry(interval_s: float | None, trace, clock: Callable[[], float]):
    """NVML telemetry into `trace` every `interval_s`; None when off or without NVML."""
    if interval_s is None or trace is None:
        return None
    from jigsaw.mux.telemetry import Telemetry, TelemetryError

    try:
        return Telemetry(trace.write, interval_s=interval_s, clock=clock).start()
    except TelemetryError as exc:  # no NVML: the node still schedules
        log.warning("telemetry off: %s", exc)
        return None


def check_mps() -> None:
    from jigsaw.mux.partition.mps import ensure_mps

    st = ensure_mps(start=True)
    log.info("MPS: %s (%s)%s", st.state, st.reason, " - started" if st.started else "")
    for w in st.warnings:  # e.g. a default active thread percentage that caps every partition
        log.warning("MPS: %s", w)


# ------------------------------------------------------------------ what the daemon says about itself

def hello(d) -> str:
    """The daemon's start line in its log: what it runs with."""
    c = d.config
    return (f"jigsaw daemon {os.getpid()}: {c.devices} device(s), grid {grid_file(d.grid)}, partitioner "
            f"{d.partitioner.kind}, policy {c.policy}, trace {trace_state(d.trace_writer)}, idle exit "
            f"{'never' if c.idle_exit_s is None else f'after {c.idle_exit_s:g} s'}")


def status_reply(d, req: int) -> pr.StatusReply:
    """What `jigsaw daemon status` shows: the set-up, the counters, each pipeline."""
    clients = Counter(s.pipeline for s in d.sessions.values())
    info = tuple(pr.PipelineInfo(name=p.name, clients=clients[p.name], step=p.step, running=p.running,
                                 pending=p.waiting, requested=d.requested[p.name], granted=d.granted[p.name],
                                 **_slo_info(p, d.slo.get(p.name)))
                 for p in d.state.summary())
    c = d.config
    return pr.StatusReply(pid=os.getpid(), pipelines=info, refused=d.refused, errors=d.errors,
                          scheduler_failures=d.state.failures + d.give_ups, trace=trace_state(d.trace_writer),
                          uptime_s=d.wall() - d.started_s, policy=c.policy, profile=str(c.profile or ""),
                          grid=grid_file(d.grid), devices=c.devices, partitioner=d.partitioner.kind,
                          idle_exit_s=c.idle_exit_s, req=req)


def _slo_info(p, forecast) -> dict:
    """A pipeline's SLO fields of its PipelineInfo (p: its NodeState Summary; forecast: the
    latest plan's SloForecast for it, or None)."""
    given_up = "" if forecast is None or forecast.kept else forecast.reason or "given up"
    if len(given_up) > GIVEN_UP_CHARS:  # it names the pipelines kept instead: a reply stays small
        given_up = given_up[:GIVEN_UP_CHARS - 1] + "…"
    return {"slo_slowdown": p.slo_slowdown or 0.0, "slo_kept": p.slo_kept, "slo_steps": p.slo_steps,
            "last_slowdown": p.last_slowdown or 0.0, "slo_given_up": given_up}


def grid_file(grid) -> str:
    return grid.path or f"analytic prior ({grid.device.sku}, {grid.model})"


def trace_state(trace) -> str:
    """off | writing PATH | stopped: why."""
    if trace is None:
        return "off"
    return f"stopped: {trace.failed}" if trace.failed else f"writing {trace.path}"
