"""Where a run's device time goes, read from its trace.

    Trace ─► per device, the sub-stages holding it between consecutive events
          ─► device-seconds by occupancy: idle (a tool wait on it, or not), one kind alone,
             a pair of kinds ─► and exclusive seconds of work done per device-second

A sub-stage under slowdown s does 1/s exclusive seconds of work per second, so a device
shared by a pair clears 1/s_a + 1/s_b (its packing efficiency), one alone at full SM
clears 1, an idle one 0.  The mean over all device-seconds is what a policy gets out of
the node; the lower bound assumes the grid's best packing everywhere.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from dataclasses import dataclass

from jigsaw.graph.ids import SubStageId
from jigsaw.trace import Trace


@dataclass(frozen=True, kw_only=True, slots=True)
class Breakdown:
    device_s: float
    """Devices × the trace's span."""
    by_occupancy_s: dict[str, float]
    """Device-seconds per occupancy label: 'idle', 'idle, tool wait', 'KIND', 'KIND + KIND'."""
    work_s: dict[str, float]
    """Exclusive seconds of work done per occupancy label."""

    @property
    def work_per_device_s(self) -> float:
        return sum(self.work_s.values()) / self.device_s if self.device_s else 0.0


def _kind(substage: str) -> str:
    sid = SubStageId.try_parse(substage)
    return sid.kind.value if sid is not None else substage


def breakdown(trace: Trace, num_devices: int) -> Breakdown:
    """Occupancy of every device over the trace (see the module docstring)."""
    events = sorted(trace.events, key=lambda e: e.t_s)
    devices = {e.pipeline: e.data.get("devices", []) for e in events if e.event == "pipeline"}
    waits = _tool_waits(events, devices)
    held: dict[int, dict[str, tuple[str, float]]] = defaultdict(dict)
    occ: dict[str, float] = defaultdict(float)
    work: dict[str, float] = defaultdict(float)
    t0 = events[0].t_s if events else 0.0
    last = t0
    cuts = sorted({x for starts, ends in waits.values() for x in (*starts, *ends)})
    for e in events:
        if e.t_s > last:
            inner = cuts[bisect.bisect_right(cuts, last):bisect.bisect_left(cuts, e.t_s)]
            for a, b in zip([last, *inner], [*inner, e.t_s]):  # a tool wait starts or ends inside
                _account(held, waits, num_devices, a, b, occ, work)
            last = e.t_s
        if e.event == "grant":
            held[e.device][e.pipeline] = (_kind(e.substage), e.slowdown)
        elif e.event == "release" and e.device is not None:
            held[e.device].pop(e.pipeline, None)
    return Breakdown(device_s=num_devices * (last - t0), by_occupancy_s=dict(occ), work_s=dict(work))


def combined(parts: list[Breakdown]) -> Breakdown:
    """Several runs' device time as one: groups of nodes placed apart (cluster/simulate.py)."""
    occ: dict[str, float] = defaultdict(float)
    work: dict[str, float] = defaultdict(float)
    for bd in parts:
        for label, sec in bd.by_occupancy_s.items():
            occ[label] += sec
        for label, sec in bd.work_s.items():
            work[label] += sec
    return Breakdown(device_s=sum(bd.device_s for bd in parts), by_occupancy_s=dict(occ), work_s=dict(work))


def _tool_waits(events, devices: dict[str, list[int]]) -> dict[int, tuple[list[float], list[float]]]:
    """Per device, the union of the intervals in which a worker placed there waited on a
    tool, as sorted (starts, ends) of disjoint intervals."""
    spans: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for e in events:
        if e.event == "host" and _kind(e.substage) == "tool":
            rank, placed = SubStageId.parse(e.substage).rank, devices.get(e.pipeline, [])
            if rank < len(placed):
                spans[placed[rank]].append((e.t_s, float(e.data["end_s"])))
    out = {}
    for d, iv in spans.items():
        starts, ends = [], []
        for s, e in sorted(iv):
            if ends and s <= ends[-1]:
                ends[-1] = max(ends[-1], e)
            else:
                starts.append(s)
                ends.append(e)
        out[d] = (starts, ends)
    return out


def _waiting(waits, d: int, a: float, b: float) -> bool:
    if d not in waits:
        return False
    starts, ends = waits[d]
    i = bisect.bisect_left(starts, b) - 1  # the last interval starting before b
    return i >= 0 and ends[i] > a


def _account(held, waits, num_devices: int, a: float, b: float, occ, work) -> None:
    for d in range(num_devices):
        units = held.get(d, {})
        if not units:
            label = "idle, tool wait" if _waiting(waits, d, a, b) else "idle"
        else:
            label = " + ".join(sorted(k for k, _ in units.values()))
            work[label] += (b - a) * sum(1.0 / s for _, s in units.values())
        occ[label] += b - a


def table(bd: Breakdown, title: str, top: int = 12):
    """A rich table: the largest occupancy labels with their share of device time and work."""
    from rich.table import Table

    t = Table(title=title, caption=f"exclusive work per device-second: {bd.work_per_device_s:.2f}")
    for col in ("occupancy", "device time", "work / device-s"):
        t.add_column(col, justify="left" if col == "occupancy" else "right")
    for label, sec in sorted(bd.by_occupancy_s.items(), key=lambda kv: -kv[1])[:top]:
        t.add_row(label, f"{sec / bd.device_s:.1%}", f"{bd.work_s.get(label, 0.0) / sec:.2f}" if sec else "—")
    return t
