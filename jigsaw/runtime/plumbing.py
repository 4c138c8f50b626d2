"""The daemon's plumbing: its listener, its lock, its Prometheus metrics.

    listen(path) ─► wire.Listener (0600 Unix socket; peers' uids checked as they connect)
    lock(dir/daemon.lock) ─► one daemon per runtime directory
    Metrics(port) ─► counters of trace events, gauges of the node state
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from pathlib import Path

from jigsaw import protocol as pr
from jigsaw.runtime.wire import Listener

log = logging.getLogger("jigsaw.daemon")


def listen(path: Path, refuse, too_large, clock) -> Listener:
    """The daemon's listener on `path` (0600); OSErrors (no space, no permission, a path in
    the way) become one clear error."""
    try:
        listener = Listener(path, pr.MAX_MESSAGE_BYTES, refuse=refuse, too_large=too_large, clock=clock)
    except OSError as exc:
        raise ValueError(f"the daemon cannot listen on {path}: {exc.strerror or exc}") from None
    log.info("jigsaw daemon %d listening on %s", os.getpid(), path)
    return listener


def lock(path: Path):
    """The runtime directory's lock, holding this daemon's pid; a clear error when another
    daemon holds it or the file cannot be written (no space, no permission)."""
    try:
        f = open(path, "a+")
    except OSError as exc:
        raise ValueError(f"the daemon cannot create its lock file {path}: {exc.strerror}") from None
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        raise RuntimeError(f"another jigsaw daemon holds {path} (pid {f.read().strip() or '?'})") from None
    try:
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
    except OSError as exc:
        with contextlib.suppress(OSError):  # closing flushes the same write again
            f.close()
        raise ValueError(f"the daemon cannot write its lock file {path}: {exc.strerror}") from None
    return f


class Metrics:
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

    def set(self, state) -> None:
        pipelines = state.summary()
        self.pipelines.set(len(pipelines))
        self.running.set(sum(len(p.running) for p in pipelines))
        self.pending.set(sum(len(p.waiting) for p in pipelines))
