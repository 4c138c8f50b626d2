"""One trace format for the simulator and the runtime: JSON lines of small events.

    TraceEvent(t_s, event, pipeline, substage, device, sm_frac, mem_bytes, slowdown, data)
        event ∈ node       a daemon started (data: policy, sched, max_wait_s, grid, devices)
                pipeline   a pipeline joined (data: workload, model, device, devices, prior)
                request    a sub-stage asked to start (data: its Admit's fields, dp_rank as
                           rank and mem_bytes as need_bytes; queued_ms)
                grant      a sub-stage replica runs on a device under a budget from t_s on
                           (data: need_bytes, the memory it needs; partition, when enforced)
                delivered  a budget change (a later grant of a running sub-stage) went to its
                           worker in a heartbeat reply; the worker binds it on receipt
                release    it stops holding the device (done, migrated away, or waiting on a tool)
                host       a host sub-stage (tool wait, reward) ran from t_s (data: end_s)
                done       a sub-stage reported its end (data: its numbers)
                progress   an engine said what its piece holds now (data: requests,
                           context_tokens, generated, mem_bytes)
                samples    how far a step's rollout is (data: step, done, total)
                lengths    finished turns' lengths (data: turns, more)
                no_rollout a DP rank has no rollout in a step (data: dp_rank, step)
                forecast   a pipeline's guess of a step before any history (data: step, pieces)
                migrate    an operator's migration order (data: pipeline, source_rank,
                           target_rank); its plan event says `operator`
                drop       a client left or lost its lease (data: withdrawn sub-stages, removed)
                plan       the daemon decided (data: started, assignments, decisions, fallback)
                open       a sub-stage ran without the daemon (fail-open; data: reason, kind, rank, step)
                migration  requests moved between DP workers (data: target, delta_s)
                step       an RL step finished (data: latency_s, tokens, samples, flops; an
                           asynchronous side's: job, weights_version, and staleness or carried)
                job        a side of an asynchronous job said its coupling (data: job, mode,
                           staleness: the bound its framework keeps)
                weights    new weights reached a running fully-async rollout: its requests
                           interrupted, resumed with their partial output (data: step, resumed)
                telemetry  an NVML sample of `device`, pipeline "" (jigsaw.mux.telemetry; data:
                           sm_util_frac = fraction of the sample period some kernel ran,
                           mem_used_bytes, mem_total_bytes, processes = {"pid": bytes or null})
    Trace: events in memory (the simulator) ─► write(path)  ┐ one line per event, written by
    TraceWriter: events appended as they happen (the daemon) ┘ `line()`;  Trace.read(path)

`jigsaw timeline` draws per-device utilisation from grant/release pairs and MFU from step
FLOPs over the device's peak; `jigsaw sim --replay` rebuilds the step graphs from grants
(exclusive time = interval / slowdown), host events and the pipeline metadata, and replays a
daemon's inputs (node, pipeline, the requests above, drop, migrate) to reproduce its plan
events (jigsaw.node.inputs writes and reads the requests' data).
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import asdict, dataclass, field
from pathlib import Path

EVENTS = ("node", "pipeline", "request", "grant", "delivered", "release", "host", "done", "drop", "plan", "open",
          "migration", "step", "telemetry", "progress", "samples", "lengths", "no_rollout", "forecast", "migrate",
          "weights", "job")
log = logging.getLogger("jigsaw.trace")


@dataclass(frozen=True, kw_only=True, slots=True)
class TraceEvent:
    t_s: float
    event: str
    pipeline: str
    substage: str = ""
    device: int | None = None
    sm_frac: float = 0.0
    mem_bytes: int = 0
    slowdown: float = 1.0
    data: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.event not in EVENTS:
            raise ValueError(f"trace event must be one of {EVENTS}, got {self.event!r}")


def line(event: TraceEvent) -> str:
    """The event as one JSON line (floats as repr, so times read back exactly)."""
    return json.dumps(asdict(event), separators=(",", ":")) + "\n"


class Trace:
    """An append-only list of events with JSONL I/O."""

    def __init__(self, events: list[TraceEvent] | None = None):
        self.events: list[TraceEvent] = list(events or [])

    def add(self, event: TraceEvent) -> None:
        self.events.append(event)

    def write(self, path: str | Path) -> None:
        with open(path, "w") as f:
            for e in self.events:
                f.write(line(e))

    @classmethod
    def read(cls, path: str | Path) -> Trace:
        events = []
        with open(path) as f:
            for n, text in enumerate(f, 1):
                if text.strip():
                    try:
                        events.append(TraceEvent(**json.loads(text)))
                    except (TypeError, ValueError) as exc:
                        raise ValueError(f"{path}:{n}: not a trace event: {exc}") from None
        return cls(events)


class TraceWriter:
    """Appends events to a file as they happen; thread-safe.  A failed write (disk full, the
    file gone) stops the trace, once and loudly, and never the caller."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.failed: str | None = None
        """Why the trace stopped (None while it writes)."""
        self._lock = threading.Lock()
        self._file = None
        try:
            self._file = open(self.path, "a", buffering=1)
        except OSError as exc:
            self.failed = f"{self.path}: {exc}"
            log.error("trace off: %s", self.failed)

    def write(self, event: TraceEvent) -> None:
        with self._lock:
            if self._file is None:
                return
            try:
                self._file.write(line(event))
            except OSError as exc:
                self.failed = f"{self.path}: {exc}"
                log.error("trace stopped: %s", self.failed)
                self._close()

    def close(self) -> None:
        with self._lock:
            self._close()

    def _close(self) -> None:
        if self._file is not None:
            try:
                self._file.close()
            except OSError:
                pass
            self._file = None
