"""Trace → intervals → per-device series → Timeline (no drawing; see the package docstring).

Steps against their SLO (slo_steps): a "step" event's data exclusive_s, step_slowdown,
slo_slowdown and slo_kept (node/slo.py), and a "plan" event's "slo" records (node/effects.py)
─► per pipeline: steps kept of those held to an SLO, mean slowdown against exclusive time,
plans that gave its SLO up.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from jigsaw.graph.ids import SubStageId
from jigsaw.graph.substage import SubStageKind
from jigsaw.timeline.hardware import Hardware, hardware
from jigsaw.trace import Trace, TraceEvent

FORMATS = (".png", ".json", ".html")
KIND_ORDER = tuple(k.value for k in SubStageKind)
"""Sub-stage kinds in pipeline order (rollout_prefill … training, then the host kinds)."""
CROP_MARGIN_FRAC = 0.02
"""Drawn time before the first grant, as a fraction of the time from it to the trace's end."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Interval:
    """One sub-stage holding one device under one budget."""

    device: int
    pipeline: str
    substage: str
    start_s: float
    end_s: float
    sm_frac: float
    slowdown: float
    mem_bytes: int
    holding: int
    """Intervals sharing it held the device without a release in between."""
    release: dict = field(default_factory=dict)
    """Data of the release that closed this interval ({} when a grant or the trace end did)."""
    flops: float = 0.0
    """FLOPs attributed to it (attribute_flops)."""

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def kind(self) -> str:
        return substage_kind(self.substage)


def substage_kind(substage: str) -> str:
    """`rollout_tail` of an id `pipeline/step/rRANK/kind/n`; the id itself otherwise."""
    sid = SubStageId.try_parse(substage)
    return sid.kind.value if sid is not None else (substage or "substage")


def ordered_kinds(kinds) -> tuple[str, ...]:
    """Kinds in KIND_ORDER, then any other name in order of appearance."""
    seen = tuple(dict.fromkeys(kinds))
    return tuple(k for k in KIND_ORDER if k in seen) + tuple(k for k in seen if k not in KIND_ORDER)


# ------------------------------------------------------------------ reconstruction


def span_s(trace: Trace) -> tuple[float, float]:
    """(first, last) event time."""
    times = [e.t_s for e in trace.events]
    return (min(times), max(times)) if times else (0.0, 0.0)


def check_events(trace: Trace) -> None:
    """Field types json.loads cannot promise; a bad one raises ValueError naming the event."""
    for n, e in enumerate(trace.events, 1):
        ok = {"t_s": finite(e.t_s), "sm_frac": finite(e.sm_frac), "slowdown": finite(e.slowdown),
              "pipeline": isinstance(e.pipeline, str), "substage": isinstance(e.substage, str),
              "data": isinstance(e.data, dict), "device": e.device is None or _int(e.device)}
        bad = [name for name, good in ok.items() if not good]
        if bad:
            raise ValueError(f"trace event {n} ({e.event}): bad {bad[0]} {getattr(e, bad[0])!r}")


def finite(v) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def intervals(trace: Trace) -> list[Interval]:
    """Grant/release pairs as intervals (see the module docstring), sorted by start."""
    check_events(trace)
    end_s = span_s(trace)[1]
    open_: dict[tuple[str, int], Interval] = {}
    out: list[Interval] = []
    holdings = 0
    for e in sorted(trace.events, key=lambda e: e.t_s):  # stable: same-time events keep file order
        if e.event not in ("grant", "release"):
            continue
        if e.device is None:
            raise ValueError(f"{e.event} of {e.pipeline!r} at t={e.t_s}s names no device")
        key = (e.pipeline, e.device)
        prev = open_.pop(key, None)
        if prev is not None:
            out.append(replace(prev, end_s=e.t_s, release=_dict(e.data, e) if e.event == "release" else {}))
        if e.event == "grant":
            holding = prev.holding if prev is not None else (holdings := holdings + 1)
            open_[key] = Interval(device=e.device, pipeline=e.pipeline, substage=e.substage, start_s=e.t_s,
                                  end_s=e.t_s, sm_frac=e.sm_frac, slowdown=e.slowdown, mem_bytes=e.mem_bytes,
                                  holding=holding)
    out.extend(replace(iv, end_s=end_s) for iv in open_.values())
    return sorted(out, key=lambda iv: (iv.start_s, iv.device, iv.pipeline))


def _dict(data, e: TraceEvent) -> dict:
    if not isinstance(data, dict):
        raise ValueError(f"{e.event} of {e.pipeline!r} at t={e.t_s}s: data must be an object, got {data!r}")
    return data


def number_field(data: dict, key: str, e: TraceEvent) -> float:
    v = _dict(data, e).get(key, 0.0)
    if not finite(v) or v < 0:
        raise ValueError(f"{e.event} of {e.pipeline!r} at t={e.t_s}s: data.{key} must be a number >= 0, got {v!r}")
    return float(v)


def release_reporting(trace: Trace) -> set[str]:
    """Pipelines whose releases carry their replica's FLOPs."""
    return {e.pipeline for e in trace.events if e.event == "release" and "flops" in _dict(e.data, e)}


def attribute_flops(trace: Trace, ivs: Sequence[Interval]) -> tuple[list[Interval], float]:
    """Intervals with their FLOPs, and the FLOPs no interval could take (see the module docstring)."""
    flops = [0.0] * len(ivs)
    lost = 0.0
    by_release = release_reporting(trace)
    holdings: dict[int, list[int]] = defaultdict(list)
    for i, iv in enumerate(ivs):
        holdings[iv.holding].append(i)
    for idx in holdings.values():
        last = max(idx, key=lambda i: ivs[i].end_s)
        if ivs[last].pipeline in by_release and "flops" in ivs[last].release:
            f = number_field(ivs[last].release, "flops", _release_event(ivs[last]))
            lost += _spread(f, [(i, ivs[i].duration_s) for i in idx], flops)
    for name, steps in _steps(trace).items():
        if name in by_release:
            continue
        mine = sorted((i for i, iv in enumerate(ivs) if iv.pipeline == name), key=lambda i: ivs[i].start_s)
        starts = [ivs[i].start_s for i in mine]
        longest = max((ivs[i].duration_s for i in mine), default=0.0)
        for e in steps:
            end = e.t_s
            start = end - number_field(e.data, "latency_s", e)
            near = mine[bisect.bisect_left(starts, start - longest):bisect.bisect_right(starts, end)]
            parts = [(i, min(end, ivs[i].end_s) - max(start, ivs[i].start_s)) for i in near]
            lost += _spread(number_field(e.data, "flops", e), [(i, w) for i, w in parts if w > 0], flops)
    return [replace(iv, flops=f) for iv, f in zip(ivs, flops)], lost


def _release_event(iv: Interval) -> TraceEvent:
    return TraceEvent(t_s=iv.end_s, event="release", pipeline=iv.pipeline, device=iv.device)


def _spread(total: float, weights: list[tuple[int, float]], into: list[float]) -> float:
    """Add `total` to `into` in proportion to the weights; return what could not be placed."""
    norm = sum(w for _, w in weights)
    if norm <= 0:
        return total
    for i, w in weights:
        into[i] += total * w / norm
    return 0.0


def _steps(trace: Trace) -> dict[str, list[TraceEvent]]:
    out: dict[str, list[TraceEvent]] = defaultdict(list)
    for e in trace.events:
        if e.event == "step":
            out[e.pipeline].append(e)
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class SloSteps:
    """One pipeline's steps against their exclusive time and its SLO (its "step" events)."""

    slo_slowdown: float
    """Its SLO (its last step event's; 0: none)."""
    kept: int
    """Steps within the SLO."""
    held: int
    """Steps held to the SLO."""
    mean_slowdown: float | None
    """Mean step latency over exclusive time, over its steps that say it (None: none does)."""
    given_up_plans: int = 0
    """Plan events whose "slo" records give its SLO up."""


def slo_steps(trace: Trace) -> dict[str, SloSteps]:
    """Per pipeline whose step events carry SLO fields or whose SLO a plan gave up (see the
    module docstring)."""
    given_up = _given_up_plans(trace)
    out = {}
    for name, steps in _steps(trace).items():
        mine = [e for e in steps if "slo_slowdown" in _dict(e.data, e) or "exclusive_s" in e.data]
        if mine:
            out[name] = _slo_steps(mine, given_up.get(name, 0))
    for name, n in given_up.items():
        out.setdefault(name, SloSteps(slo_slowdown=0.0, kept=0, held=0, mean_slowdown=None, given_up_plans=n))
    return out


def _slo_steps(steps: list[TraceEvent], given_up: int) -> SloSteps:
    kept = [_kept(e) for e in steps]
    slowdowns = [x for e in steps if (x := _step_slowdown(e)) is not None]
    return SloSteps(slo_slowdown=number_field(steps[-1].data, "slo_slowdown", steps[-1]),
                    kept=sum(1 for k in kept if k), held=sum(1 for k in kept if k is not None),
                    mean_slowdown=sum(slowdowns) / len(slowdowns) if slowdowns else None, given_up_plans=given_up)


def _kept(e: TraceEvent) -> bool | None:
    got = e.data.get("slo_kept")
    if got is not None and not isinstance(got, bool):
        raise ValueError(f"step of {e.pipeline!r} at t={e.t_s}s: data.slo_kept must be true, false or null, "
                         f"got {got!r}")
    return got


def _step_slowdown(e: TraceEvent) -> float | None:
    """The step's latency over its exclusive time: its own step_slowdown, else latency_s / exclusive_s."""
    if "step_slowdown" in e.data:
        return number_field(e.data, "step_slowdown", e)
    exclusive_s = number_field(e.data, "exclusive_s", e)
    return number_field(e.data, "latency_s", e) / exclusive_s if exclusive_s > 0 else None


def _given_up_plans(trace: Trace) -> dict[str, int]:
    """Per pipeline, the plan events whose "slo" records say its SLO is not kept."""
    out: Counter[str] = Counter()
    for e in trace.events:
        if e.event == "plan":
            out.update({r[0] for r in _slo_records(e) if r[4] is False})
    return dict(out)


def _slo_records(e: TraceEvent) -> list[list]:
    records = _dict(e.data, e).get("slo", [])
    ok = isinstance(records, list) and all(
        isinstance(r, list) and len(r) >= 5 and isinstance(r[0], str) and isinstance(r[4], bool) for r in records)
    if not ok:
        raise ValueError(f"plan at t={e.t_s}s: data.slo must be a list of [pipeline, step, deadline_s, "
                         f"predicted_end_s, kept, reason], got {records!r}")
    return records


def pipeline_meta(trace: Trace) -> dict[str, dict]:
    return {e.pipeline: _dict(e.data, e) for e in trace.events if e.event == "pipeline"}


def pipeline_peak_flops(meta: dict) -> float | None:
    """Peak FLOP/s per device of a pipeline's `pipeline` event data, if it says."""
    from jigsaw.mux.model.specs import DEVICES

    if meta.get("peak_flops") is not None:
        peak = meta["peak_flops"]
        if not finite(peak) or peak <= 0:
            raise ValueError(f"pipeline data.peak_flops must be a number > 0, got {peak!r}")
        return float(peak)
    device = meta.get("device")
    info = DEVICES.get(device) if isinstance(device, str) else None
    info = info or next((d for d in DEVICES.values() if d.sku == device), None)
    return info.peak_flops if info else None


def placed_devices(meta: dict) -> list[int]:
    """A pipeline's devices by DP rank (its `pipeline` event data "devices"; [] if absent)."""
    devices = meta.get("devices") or []
    if not isinstance(devices, list) or not all(_int(d) for d in devices):
        raise ValueError(f"pipeline data.devices must be a list of device ids, got {devices!r}")
    return devices


def device_peaks(trace: Trace, devices: Sequence[int], override_flops: float | None = None) -> dict[int, float]:
    """Peak FLOP/s of every device whose peak is known: the override, else that of a pipeline
    placed on it, else the one peak all pipelines agree on."""
    if override_flops is not None:
        return {d: override_flops for d in devices}
    placed: dict[int, float] = {}
    peaks = set()
    for meta in pipeline_meta(trace).values():
        peak = pipeline_peak_flops(meta)
        if peak is None:
            continue
        peaks.add(peak)
        for d in placed_devices(meta):
            placed.setdefault(d, peak)
    common = peaks.pop() if len(peaks) == 1 else None
    return {d: p for d in devices if (p := placed.get(d, common)) is not None}


# ------------------------------------------------------------------ series


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceSeries:
    """Step functions of one device: value i holds on [times_s[i], times_s[i + 1])."""

    device: int
    times_s: tuple[float, ...]
    share_frac: dict[str, tuple[float, ...]]
    """SM share per pipeline, scaled so that the stack never exceeds 1."""
    kind_share_frac: dict[tuple[str, str], tuple[float, ...]]
    """The same per (pipeline, kind), pipelines in order, each one's kinds in KIND_ORDER; only
    the pairs that held this device.  A pipeline holds one kind at a time, so per pipeline
    these sum to share_frac."""
    util_frac: tuple[float, ...]
    mfu_frac: tuple[float, ...] | None
    """None when the device's peak is unknown."""


def device_series(device: int, ivs: Sequence[Interval], pipelines: Sequence[str],
                  peak_flops: float | None) -> DeviceSeries:
    """Sweep one device's intervals (see the module docstring for the definitions)."""
    opens: dict[float, list[Interval]] = defaultdict(list)
    closes: dict[float, list[Interval]] = defaultdict(list)
    for iv in ivs:
        if iv.duration_s > 0:
            opens[iv.start_s].append(iv)
            closes[iv.end_s].append(iv)
    times = sorted(set(opens) | set(closes))
    kinds = ordered_kinds(iv.kind for iv in ivs if iv.duration_s > 0)
    pairs = [(p, k) for p in pipelines for k in kinds
             if any(iv.pipeline == p and iv.kind == k and iv.duration_s > 0 for iv in ivs)]
    live: dict[int, Interval] = {}
    share: dict[tuple[str, str], list[float]] = {pk: [] for pk in pairs}
    util, mfu = [], []
    for t in times:
        for iv in closes[t]:
            live.pop(id(iv), None)
        for iv in opens[t]:
            live[id(iv)] = iv
        total = sum(iv.sm_frac for iv in live.values())
        scale = 1.0 / max(1.0, total)
        for p, k in pairs:
            share[p, k].append(scale * sum(iv.sm_frac for iv in live.values() if iv.pipeline == p and iv.kind == k))
        util.append(min(1.0, total))
        rate = sum(iv.flops / iv.duration_s for iv in live.values())
        mfu.append(rate / peak_flops if peak_flops else 0.0)
    by_pipeline = {p: tuple(map(sum, zip(*(v for (q, _), v in share.items() if q == p)))) or (0.0,) * len(times)
                   for p in pipelines}
    return DeviceSeries(device=device, times_s=tuple(times), share_frac=by_pipeline,
                        kind_share_frac={pk: tuple(v) for pk, v in share.items()},
                        util_frac=tuple(util), mfu_frac=tuple(mfu) if peak_flops else None)


def integral(times_s: Sequence[float], values: Sequence[float], start_s: float, end_s: float) -> float:
    """∫ of a step function (value i on [times_s[i], times_s[i + 1]); 0 outside) over [start_s, end_s]."""
    total = 0.0
    for i, v in enumerate(values):
        hi = times_s[i + 1] if i + 1 < len(times_s) else times_s[i]
        total += v * max(0.0, min(hi, end_s) - max(times_s[i], start_s))
    return total


def binned(times_s: Sequence[float], values: Sequence[float], edges_s: Sequence[float]) -> list[float]:
    """Mean of a step function over each bin [edges_s[k], edges_s[k + 1])."""
    return [integral(times_s, values, a, b) / (b - a) if b > a else 0.0 for a, b in zip(edges_s, edges_s[1:])]


# ------------------------------------------------------------------ timeline


@dataclass(frozen=True, kw_only=True, slots=True)
class Timeline:
    name: str
    start_s: float
    """The trace's first event (the origin of the drawn seconds)."""
    first_grant_s: float
    """Before it: start-up (daemon up, pipelines loading), drawn only as a small margin."""
    end_s: float
    pipelines: tuple[str, ...]
    devices: tuple[int, ...]
    hardware: Hardware
    intervals: tuple[Interval, ...]
    series: dict[int, DeviceSeries]
    peak_flops: dict[int, float]
    """Devices whose peak is known."""
    tokens: dict[str, int]
    steps: dict[str, int]
    """Step events per pipeline."""
    slo: dict[str, SloSteps]
    """Per pipeline whose steps say their exclusive time or SLO: how they fared (slo_steps)."""
    flops_source: dict[str, str]
    unattributed_flops: float
    migrations: tuple[TraceEvent, ...]
    hosts: tuple[TraceEvent, ...]
    opens: tuple[TraceEvent, ...]
    """Sub-stages that ran without the daemon (fell open; data: reason, kind, rank, step)."""
    placement: dict[str, list[int]]
    """Pipeline -> its devices by DP rank (pipeline data "devices")."""
    where: dict[str, tuple[tuple[float, int], ...]]
    """Sub-stage id -> (grant time, device) of its intervals, by time."""

    @property
    def span_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def work_end_s(self) -> float:
        """When the last sub-stage ended (a daemon trace goes on while pipelines unregister); the
        trace's end if no sub-stage took any time."""
        ends = [iv.end_s for iv in self.intervals]
        ends += [number_field(h.data, "end_s", h) for h in self.hosts if "end_s" in (h.data or {})]
        last = min(self.end_s, max(ends))
        return last if last > self.first_grant_s else self.end_s

    @property
    def window_s(self) -> float:
        """From the first grant to the last sub-stage's end: what the means run over."""
        return self.work_end_s - self.first_grant_s

    @property
    def view_end_s(self) -> float:
        """Where the drawn time axis ends: CROP_MARGIN_FRAC of the window after the work."""
        return min(self.end_s, self.work_end_s + CROP_MARGIN_FRAC * self.window_s)

    @property
    def startup_s(self) -> float:
        return self.first_grant_s - self.start_s

    @property
    def view_start_s(self) -> float:
        """Where the drawn time axis starts: CROP_MARGIN_FRAC of the window before the first grant,
        or the trace's start when the start-up is no longer than twice that."""
        margin_s = CROP_MARGIN_FRAC * self.window_s
        return self.first_grant_s - margin_s if self.startup_s > 2 * margin_s else self.start_s

    @property
    def cropped_s(self) -> float:
        """Start-up time left off the drawn axis (0 for a trace whose first grant is at its start)."""
        return self.view_start_s - self.start_s

    @property
    def kinds(self) -> tuple[str, ...]:
        """Kinds that held a device, in KIND_ORDER."""
        return ordered_kinds(iv.kind for iv in self.intervals)

    @property
    def host_kinds(self) -> tuple[str, ...]:
        return ordered_kinds(substage_kind(h.substage) for h in self.hosts)

    @property
    def flops(self) -> float:
        return sum(iv.flops for iv in self.intervals)

    def mean_util(self, s: DeviceSeries) -> float:
        """A device's mean utilisation over the window."""
        return integral(s.times_s, s.util_frac, self.first_grant_s, self.work_end_s) / self.window_s

    @property
    def mean_util_frac(self) -> float:
        return sum(map(self.mean_util, self.series.values())) / len(self.devices) if self.devices else 0.0

    @property
    def mean_mfu_frac(self) -> float | None:
        """None without a peak for every device, or without any FLOPs."""
        if not self.devices or len(self.peak_flops) < len(self.devices) or not self.flops:
            return None
        return sum(iv.flops / self.peak_flops[iv.device] for iv in self.intervals) / (len(self.devices) * self.window_s)

    def device_of(self, substage: str, t_s: float) -> int | None:
        """Where `substage` was (last granted at or before t_s), else its DP rank's placed device."""
        held = self.where.get(substage, ())
        k = bisect.bisect_right(held, (t_s, math.inf))
        if k:
            return held[k - 1][1]
        sid = SubStageId.try_parse(substage)
        if sid is not None:
            placed = self.placement.get(sid.pipeline, [])
            return placed[sid.rank] if sid.rank < len(placed) else None
        return None


def build(trace: Trace, *, name: str = "trace", peak_flops: float | None = None,
          devices: Sequence[int] | None = None) -> Timeline:
    """Everything the outputs draw (see the module docstring)."""
    ivs, lost = attribute_flops(trace, intervals(trace))
    meta = pipeline_meta(trace)
    placement = {p: placed_devices(m) for p, m in meta.items()}
    known = sorted({iv.device for iv in ivs} | {d for ds in placement.values() for d in ds})
    if not ivs:
        raise ValueError(f"{name}: no grant events, nothing to draw")
    start, end = span_s(trace)
    first_grant = min(iv.start_s for iv in ivs)
    if end <= first_grant:
        raise ValueError(f"{name}: every grant is at the trace's end (t={end}s), the trace spans no time")
    if devices:
        missing = sorted(set(devices) - set(known))
        if missing:
            raise ValueError(f"{name}: no device {missing} in the trace (it has {known})")
        known = sorted(set(devices))
        ivs = [iv for iv in ivs if iv.device in known]
    pipelines = tuple(dict.fromkeys([*meta, *(iv.pipeline for iv in ivs)]))
    peaks = device_peaks(trace, known, peak_flops)
    series = {d: device_series(d, [iv for iv in ivs if iv.device == d], pipelines, peaks.get(d)) for d in known}
    events = defaultdict(list)
    for e in trace.events:
        events[e.event].append(e)
    return Timeline(name=name, start_s=start, first_grant_s=first_grant, end_s=end, pipelines=pipelines,
                    devices=tuple(known), hardware=hardware(trace), intervals=tuple(ivs), series=series,
                    peak_flops=peaks, tokens=_tokens(trace), steps=dict(Counter(e.pipeline for e in events["step"])),
                    slo=slo_steps(trace),
                    flops_source=_flops_sources(trace, pipelines), unattributed_flops=lost,
                    migrations=tuple(events["migration"]), hosts=tuple(events["host"]), opens=tuple(events["open"]),
                    placement=placement, where=_where(ivs))


def _where(ivs: Sequence[Interval]) -> dict[str, tuple[tuple[float, int], ...]]:
    out: dict[str, list[tuple[float, int]]] = defaultdict(list)
    for iv in ivs:
        out[iv.substage].append((iv.start_s, iv.device))
    return {k: tuple(sorted(v)) for k, v in out.items()}


def _tokens(trace: Trace) -> dict[str, int]:
    """Step tokens per pipeline; release tokens where a pipeline has no step event."""
    steps: dict[str, int] = defaultdict(int)
    releases: dict[str, int] = defaultdict(int)
    for e in trace.events:
        if e.event == "step":
            steps[e.pipeline] += int(number_field(e.data, "tokens", e))
        elif e.event == "release" and "tokens" in _dict(e.data, e):
            releases[e.pipeline] += int(number_field(e.data, "tokens", e))
    return {**releases, **steps}


def _flops_sources(trace: Trace, pipelines: Sequence[str]) -> dict[str, str]:
    by_release = release_reporting(trace)
    by_step = {e.pipeline for e in trace.events if e.event == "step" and "flops" in _dict(e.data, e)}
    return {p: "release" if p in by_release else "step" if p in by_step else "none" for p in pipelines}


def load(path: str | Path, *, peak_flops: float | None = None, devices: Sequence[int] | None = None) -> Timeline:
    """Read a trace file; an unreadable or malformed one raises ValueError naming it."""
    try:
        trace = Trace.read(path)
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a text trace file") from None
    except OSError as exc:
        raise ValueError(f"cannot read trace {path}: {exc.strerror or exc}") from None
    return build(trace, name=Path(path).name, peak_flops=peak_flops, devices=devices)


def describe(tl: Timeline) -> str:
    """One line: devices, pipelines, the window (and the start-up left out), mean share and MFU."""
    mfu = tl.mean_mfu_frac
    if mfu is not None:
        mfu_s = f"mean MFU {mfu:.2%}"
    elif not tl.flops:
        mfu_s = "MFU unknown (no FLOPs in the trace)"
    else:
        mfu_s = "MFU unknown (no peak FLOP/s for every device: pass --peak-tflops)"
    startup = f" after a {tl.startup_s:,.1f} s start-up (not counted)" if tl.startup_s >= 0.05 else ""
    return (f"{tl.hardware.count(len(tl.devices))}, {len(tl.pipelines)} pipelines, {tl.window_s:,.1f} s{startup}; "
            f"mean utilisation {tl.mean_util_frac:.1%} ({tl.hardware.share} granted), {mfu_s}")
