"""The daemon's plumbing: its listener, its lock, its Prometheus metrics.

    listen(path) ─► wire.Listener (0600 Unix socket; peers' uids checked as they connect)
    lock(dir/daemon.lock) ─► one daemon per runtime directory
    Metrics(port) ─► counters of trace events, gauges of the node state; per pipeline: SLO
                     attainment, the last finished step's slowdown, whether the latest plan
                     gives its SLO up (label sets of pipelines that left are removed)
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from collections.abc import Mapping
from pathlib import Path

from jigsaw import protocol as pr
from jigsaw.graph.slo import SloForecast
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
    """The daemon's Prometheus registry (served on 127.0.0.1:`port`; None: not served, read
    `registry` directly)."""

    def __init__(self, port: int | None):
        from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server
        self.registry = r = CollectorRegistry()
        self.events = Counter("jigsaw_trace_events", "Trace events by kind", ["event"], registry=r)
        self.pipelines = Gauge("jigsaw_pipelines", "Registered pipelines", registry=r)
        self.running = Gauge("jigsaw_running_substages", "Granted sub-stages", registry=r)
        self.pending = Gauge("jigsaw_pending_substages", "Sub-stages waiting for admission", registry=r)
        self.attainment = Gauge("jigsaw_slo_attainment", "Finished steps within the SLO over steps held to it",
                                ["pipeline"], registry=r)
        self.slowdown = Gauge("jigsaw_step_slowdown", "Last finished step's latency over its exclusive time",
                              ["pipeline"], registry=r)
        self.given_up = Gauge("jigsaw_slo_given_up", "1 when the latest plan gives the pipeline's SLO up",
                              ["pipeline"], registry=r)
        self._labelled: dict[str, set[str]] = {}
        """Per labelled gauge, the pipelines it has a value for (removed when they leave)."""
        if port is not None:
            start_http_server(port, addr="127.0.0.1", registry=r)

    def count(self, event: str) -> None:
        self.events.labels(event=event).inc()

    def set(self, state, slo: Mapping[str, SloForecast] | None = None) -> None:
        """Gauges of the node state; `slo`: the latest plan's forecast per pipeline."""
        pipelines = state.summary()
        self.pipelines.set(len(pipelines))
        self.running.set(sum(len(p.running) for p in pipelines))
        self.pending.set(sum(len(p.waiting) for p in pipelines))
        slo = slo or {}
        with_slo = [p for p in pipelines if p.slo_slowdown is not None]
        self._labels("attainment", {p.name: p.slo_kept / p.slo_steps for p in with_slo if p.slo_steps})
        self._labels("slowdown", {p.name: p.last_slowdown for p in pipelines if p.last_slowdown is not None})
        self._labels("given_up", {p.name: float(p.name in slo and not slo[p.name].kept) for p in with_slo})

    def _labels(self, gauge: str, values: Mapping[str, float]) -> None:
        """Set `gauge`'s value per pipeline; pipelines no longer in `values` lose their label set."""
        g = getattr(self, gauge)
        for name in self._labelled.get(gauge, set()) - set(values):
            g.remove(name)
        for name, v in values.items():
            g.labels(pipeline=name).set(v)
        self._labelled[gauge] = set(values)
