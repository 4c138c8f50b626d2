"""One trace format for the simulator and the runtime: JSON lines of small events.

    TraceEvent(t_s, event, pipeline, substage, device, sm_frac, mem_bytes, slowdown, data)
        event ∈ pipeline   a pipeline joined (data: workload, model, device, devices, prior)
                grant      a sub-stage replica runs on a device under a budget from t_s on
                           (data: need_bytes, the memory it needs)
                release    it stops holding the device (done, migrated away, or waiting on a tool)
                host       a host sub-stage (tool wait, reward) ran from t_s (data: end_s)
                migration  requests moved between DP workers (data: target, delta_s)
                step       an RL step finished (data: latency_s, tokens, samples, flops)
                telemetry  an NVML sample of `device`, pipeline "" (jigsaw.mux.telemetry; data:
                           sm_util_frac = fraction of the sample period some kernel ran,
                           mem_used_bytes, mem_total_bytes, processes = {"pid": bytes or null})
    Trace.write(path) / Trace.read(path)    one JSON object per line, keys as above

`jigsaw timeline` draws per-device utilisation from grant/release pairs and MFU from step
FLOPs over the device's peak; `jigsaw sim --replay` rebuilds the step graphs from grants
(exclusive time = interval / slowdown), host events and the pipeline metadata.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

EVENTS = ("pipeline", "grant", "release", "host", "migration", "step", "telemetry")


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


class Trace:
    """An append-only list of events with JSONL I/O."""

    def __init__(self, events: list[TraceEvent] | None = None):
        self.events: list[TraceEvent] = list(events or [])

    def add(self, event: TraceEvent) -> None:
        self.events.append(event)

    def write(self, path: str | Path) -> None:
        with open(path, "w") as f:
            for e in self.events:
                f.write(json.dumps(asdict(e), separators=(",", ":")) + "\n")

    @classmethod
    def read(cls, path: str | Path) -> Trace:
        events = []
        with open(path) as f:
            for n, line in enumerate(f, 1):
                if line.strip():
                    try:
                        events.append(TraceEvent(**json.loads(line)))
                    except (TypeError, ValueError) as exc:
                        raise ValueError(f"{path}:{n}: not a trace event: {exc}") from None
        return cls(events)
