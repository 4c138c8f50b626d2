"""The tables of a Timeline: one row per pipeline, one per sub-stage kind.

    Timeline.intervals ─► pipeline_summary(): busy device-s (all kinds, and per kind), share ×
    Timeline.hosts     │      device-s, host seconds per host kind, tokens, steps, FLOPs, MFU
    Timeline.series    └► kind_summary(): per device kind: device-s held, share of the device
                              time (window × devices; the kinds sum to the mean utilisation),
                              time-weighted mean slowdown and share granted; per host kind:
                              seconds run (it holds no device)

Busy time is a union per device: two intervals of one pipeline on one device never overlap
(one holding per pipeline and device), so busy device-s per kind is their total length.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from jigsaw.timeline.model import Interval, Timeline, integral, number_field, substage_kind
from jigsaw.trace import TraceEvent


@dataclass(frozen=True, kw_only=True, slots=True)
class PipelineSummary:
    name: str
    busy_device_s: float
    """Device-seconds it held some device."""
    busy_by_kind_s: dict[str, float]
    """The same per device kind (a kind it never ran is absent)."""
    host_by_kind_s: dict[str, float]
    """Seconds of host sub-stages (reward, tool) per kind."""
    sm_device_s: float
    """Σ SM (or core) share × seconds."""
    tokens: int
    steps: int
    flops: float
    flops_source: str
    """'release', 'step' or 'none'."""
    mfu_frac: float | None


@dataclass(frozen=True, kw_only=True, slots=True)
class KindSummary:
    kind: str
    on_device: bool
    """False for host kinds: they hold no device, so only seconds_s is known."""
    substages: int
    """Distinct sub-stage ids (replicas count once each)."""
    seconds_s: float
    """Device-seconds held (device kinds) or seconds run (host kinds)."""
    share_frac: float | None
    """Its share of the device time: ∫ share over the window / (window × devices)."""
    mean_slowdown: float | None
    """Time-weighted slowdown its grants predicted (1 = as fast as alone)."""
    mean_granted_frac: float | None
    """Time-weighted share its grants gave it."""


def pipeline_summary(tl: Timeline) -> list[PipelineSummary]:
    out = []
    hosts = _host_seconds(tl)
    for p in tl.pipelines:
        mine = [iv for iv in tl.intervals if iv.pipeline == p]
        by_device = _busy_by_device(mine)
        flops = sum(iv.flops for iv in mine)
        peak_s = sum(tl.peak_flops.get(d, math.nan) * s for d, s in by_device.items())
        mfu = flops / peak_s if flops and peak_s > 0 and not math.isnan(peak_s) else None
        by_kind = {k: sum(iv.duration_s for iv in mine if iv.kind == k) for k in tl.kinds}
        out.append(PipelineSummary(name=p, busy_device_s=sum(by_device.values()),
                                   busy_by_kind_s={k: s for k, s in by_kind.items() if s > 0},
                                   host_by_kind_s={k: s for (q, k), s in hosts.items() if q == p},
                                   sm_device_s=sum(iv.sm_frac * iv.duration_s for iv in mine),
                                   tokens=tl.tokens.get(p, 0), steps=tl.steps.get(p, 0), flops=flops,
                                   flops_source=tl.flops_source.get(p, "none"), mfu_frac=mfu))
    return out


def kind_summary(tl: Timeline) -> list[KindSummary]:
    out = []
    device_time_s = tl.window_s * len(tl.devices)
    for k in tl.kinds:
        mine = [iv for iv in tl.intervals if iv.kind == k and iv.duration_s > 0]
        held_s = sum(iv.duration_s for iv in mine)
        share_s = sum(integral(s.times_s, v, tl.first_grant_s, tl.work_end_s)
                      for s in tl.series.values() for (_, kind), v in s.kind_share_frac.items() if kind == k)
        out.append(KindSummary(kind=k, on_device=True, substages=len({iv.substage for iv in mine}), seconds_s=held_s,
                               share_frac=share_s / device_time_s if device_time_s > 0 else None,
                               mean_slowdown=_weighted(mine, "slowdown"), mean_granted_frac=_weighted(mine, "sm_frac")))
    hosts = _host_seconds(tl)
    for k in tl.host_kinds:
        run = [h for h in tl.hosts if substage_kind(h.substage) == k]
        out.append(KindSummary(kind=k, on_device=False, substages=len({h.substage for h in run}),
                               seconds_s=sum(s for (_, kind), s in hosts.items() if kind == k),
                               share_frac=None, mean_slowdown=None, mean_granted_frac=None))
    return out


def host_span(h: TraceEvent) -> tuple[float, float]:
    """(start, end) of a host event; an end before the start (or none) makes it empty."""
    return h.t_s, max(h.t_s, number_field(h.data, "end_s", h))


def _host_seconds(tl: Timeline) -> dict[tuple[str, str], float]:
    """(pipeline, host kind) -> seconds its host sub-stages ran."""
    out: dict[tuple[str, str], float] = defaultdict(float)
    for h in tl.hosts:
        start_s, end_s = host_span(h)
        out[h.pipeline, substage_kind(h.substage)] += end_s - start_s
    return dict(out)


def _weighted(ivs: Sequence[Interval], attr: str) -> float | None:
    total_s = sum(iv.duration_s for iv in ivs)
    return sum(getattr(iv, attr) * iv.duration_s for iv in ivs) / total_s if total_s > 0 else None


def _busy_by_device(ivs: Sequence[Interval]) -> dict[int, float]:
    by: dict[int, list[Interval]] = defaultdict(list)
    for iv in ivs:
        by[iv.device].append(iv)
    return {d: _union_len([(iv.start_s, iv.end_s) for iv in group]) for d, group in by.items()}


def _union_len(spans: list[tuple[float, float]]) -> float:
    total, hi = 0.0, -math.inf
    for a, b in sorted(spans):
        if b > hi:
            total += b - max(a, hi)
            hi = b
    return total
