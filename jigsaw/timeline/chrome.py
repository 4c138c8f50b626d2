"""Chrome trace / Perfetto JSON of a Timeline, and a validator of the Trace Event Format."""

from __future__ import annotations

import json

from jigsaw.timeline.model import Timeline, finite, number_field, substage_kind

HOST_TID = 1000
"""Thread ids of host sub-stages: HOST_TID + pipeline index, on the device of their DP rank."""


def chrome_trace(tl: Timeline) -> dict:
    """Trace Event Format: X per interval, M names ("GPU 0" / "CPU 0"), C share ("SM share" /
    "core share") and MFU per device, i per migration."""
    us = lambda t: round((t - tl.start_s) * 1e6, 3)  # noqa: E731
    tid = {p: i for i, p in enumerate(tl.pipelines)}
    ev: list[dict] = []
    for d in tl.devices:
        name = f"{tl.hardware.device} {d}"
        ev.append({"ph": "M", "name": "process_name", "pid": d, "tid": 0, "args": {"name": name}})
        ev.append({"ph": "M", "name": "process_sort_index", "pid": d, "tid": 0, "args": {"sort_index": d}})
        for p in tl.pipelines:
            ev.append({"ph": "M", "name": "thread_name", "pid": d, "tid": tid[p], "args": {"name": p}})
    for iv in tl.intervals:
        ev.append({"ph": "X", "cat": "device", "name": iv.kind, "pid": iv.device, "tid": tid[iv.pipeline],
                   "ts": us(iv.start_s), "dur": round(iv.duration_s * 1e6, 3),
                   "args": {"substage": iv.substage, "pipeline": iv.pipeline, "sm_frac": iv.sm_frac,
                            "slowdown": iv.slowdown, "mem_bytes": iv.mem_bytes, "flops": iv.flops}})
    ev.extend(_host_events(tl, tid, us))
    for s in tl.series.values():
        for i, t in enumerate(s.times_s):
            ev.append({"ph": "C", "name": tl.hardware.share, "pid": s.device, "ts": us(t),
                       "args": {p: round(v[i], 6) for p, v in s.share_frac.items()}})
            if s.mfu_frac is not None:
                ev.append({"ph": "C", "name": "MFU", "pid": s.device, "ts": us(t),
                           "args": {"mfu": round(s.mfu_frac[i], 6)}})
    for m in tl.migrations:
        d = tl.device_of(m.substage, m.t_s)
        if d in tl.series and m.pipeline in tid:
            target = m.data.get("target", "")
            ev.append({"ph": "i", "s": "t", "name": "migration", "pid": d, "tid": tid[m.pipeline], "ts": us(m.t_s),
                       "args": {"source": m.substage, "target": target,
                                "target_device": tl.device_of(str(target), m.t_s),
                                **{k: v for k, v in m.data.items() if k != "target"}}})
    return {"traceEvents": ev, "displayTimeUnit": "ms",
            "otherData": {"trace": tl.name, "mean_util_frac": tl.mean_util_frac, "mean_mfu_frac": tl.mean_mfu_frac}}


def _host_events(tl: Timeline, tid: dict[str, int], us) -> list[dict]:
    out = []
    named = set()
    for h in tl.hosts:
        d = tl.device_of(h.substage, h.t_s)
        if d not in tl.series or h.pipeline not in tid:
            continue
        if (d, h.pipeline) not in named:
            named.add((d, h.pipeline))
            out.append({"ph": "M", "name": "thread_name", "pid": d, "tid": HOST_TID + tid[h.pipeline],
                        "args": {"name": f"{h.pipeline} (host)"}})
        end = number_field(h.data, "end_s", h)
        out.append({"ph": "X", "cat": "host", "name": substage_kind(h.substage), "pid": d,
                    "tid": HOST_TID + tid[h.pipeline], "ts": us(h.t_s), "dur": round(max(0.0, end - h.t_s) * 1e6, 3),
                    "args": {"substage": h.substage, "pipeline": h.pipeline}})
    return out


_META_NAMES = {"process_name": "name", "thread_name": "name", "process_sort_index": "sort_index",
               "thread_sort_index": "sort_index", "process_labels": "labels"}


def validate_chrome_trace(doc) -> None:
    """Check the Trace Event Format subset chrome_trace() writes; raise ValueError naming the bad event."""
    if not isinstance(doc, dict) or not isinstance(doc.get("traceEvents"), list):
        raise ValueError("a Chrome trace is an object with a 'traceEvents' list")
    if doc.get("displayTimeUnit", "ms") not in ("ms", "ns"):
        raise ValueError(f"displayTimeUnit must be 'ms' or 'ns', got {doc['displayTimeUnit']!r}")
    for n, e in enumerate(doc["traceEvents"]):
        problem = _event_problem(e)
        if problem:
            raise ValueError(f"traceEvents[{n}]: {problem}: {e!r}")
    json.dumps(doc, allow_nan=False)


def _event_problem(e) -> str | None:
    if not isinstance(e, dict):
        return "not an object"
    ph = e.get("ph")
    if ph not in ("X", "M", "C", "i"):
        return f"ph must be one of X, M, C, i, got {ph!r}"
    if not isinstance(e.get("name"), str) or not e["name"]:
        return "name must be a non-empty string"
    if not isinstance(e.get("pid"), int) or isinstance(e.get("pid"), bool):
        return "pid must be an integer"
    if ph != "M" and not (finite(e.get("ts")) and e["ts"] >= 0):
        return "ts must be a finite number >= 0 (microseconds)"
    if "args" in e and not isinstance(e["args"], dict):
        return "args must be an object"
    return {"X": _x_problem, "M": _m_problem, "C": _c_problem, "i": _i_problem}[ph](e)


def _x_problem(e: dict) -> str | None:
    if not (finite(e.get("dur")) and e["dur"] >= 0):
        return "dur must be a finite number >= 0 (microseconds)"
    if not isinstance(e.get("tid"), int) or isinstance(e.get("tid"), bool):
        return "tid must be an integer"
    return None


def _m_problem(e: dict) -> str | None:
    key = _META_NAMES.get(e["name"])
    if key is None:
        return f"metadata name must be one of {sorted(_META_NAMES)}"
    if not isinstance(e.get("args"), dict) or key not in e["args"]:
        return f"metadata {e['name']} needs args.{key}"
    if e["name"].startswith("thread") and not isinstance(e.get("tid"), int):
        return "thread metadata needs an integer tid"
    return None


def _c_problem(e: dict) -> str | None:
    args = e.get("args")
    if not isinstance(args, dict) or not args or not all(finite(v) for v in args.values()):
        return "counter args must be a non-empty object of finite numbers"
    return None


def _i_problem(e: dict) -> str | None:
    scope = e.get("s", "t")
    if scope not in ("g", "p", "t"):
        return f"instant scope s must be g, p or t, got {scope!r}"
    if scope == "t" and (not isinstance(e.get("tid"), int) or isinstance(e.get("tid"), bool)):
        return "thread-scoped instant needs an integer tid"
    return None
