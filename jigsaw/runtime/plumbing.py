"""The daemon's plumbing: its socket, its lock, its peers' uids, its Prometheus metrics.

    listen(ctx, endpoint) ─► ROUTER socket (0600, frames > HARD_LIMIT_BYTES cut by ZeroMQ)
    same_uid(Peer-Address) ─► whether a message may be served
    lock(dir/daemon.lock) ─► one daemon per runtime directory
    Metrics(port) ─► counters of trace events, gauges of the node state
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from pathlib import Path

import zmq

from jigsaw.runtime import protocol as pr
from jigsaw.runtime.paths import socket_path

log = logging.getLogger("jigsaw.daemon")


def listen(ctx, ep: str):
    """The ROUTER socket, bound, its file 0600; OSErrors (a path too long, no space, no
    permission) become one clear error."""
    path = socket_path(ep)
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.MAXMSGSIZE, pr.HARD_LIMIT_BYTES)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.bind(ep)
        os.chmod(path, 0o600)
    except (zmq.ZMQError, OSError) as exc:
        sock.close(0)
        raise ValueError(f"the daemon cannot listen on {path}: {exc}") from None
    log.info("jigsaw daemon %d listening on %s", os.getpid(), ep)
    return sock


def same_uid(peer: str) -> bool:
    """ZeroMQ reports an ipc peer as `host:uid:gid:pid` from SO_PEERCRED."""
    parts = peer.rsplit(":", 3)
    return len(parts) == 4 and parts[1].isdigit() and int(parts[1]) == os.getuid()


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
        self.pipelines.set(len(state.pipelines))
        self.running.set(sum(len(p.running) for p in state.pipelines.values()))
        self.pending.set(sum(len(p.waiting) for p in state.pipelines.values()))
