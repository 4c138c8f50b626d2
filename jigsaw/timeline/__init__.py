"""What every device did, read from a trace (simulator or runtime, one format).

    model.py     trace ─► intervals ─► per-device series ─► Timeline (no drawing)
    hardware.py  what the devices are, for labels (GPUs: SM share; CPU cores: core share)
    summary.py   its tables: a row per pipeline and per sub-stage kind
    draw.py      the PNG (matplotlib)   page.py  the HTML page   chrome.py  Perfetto JSON

    Trace ─► intervals(): per (pipeline, device) a grant opens an interval; the next grant
    │        there (a new sub-stage or budget) or a release closes it; the trace's last event
    │        closes what is still open ─► Interval(device, pipeline, sub-stage (and its kind),
    │        start_s, end_s, sm_frac, slowdown); the intervals up to a release form one holding
    ├─► attribute_flops(): a pipeline whose releases carry data {"flops"} gets each one spread
    │        over the holding it closes; any other pipeline gets each step's data {"flops"}
    │        spread over its intervals inside the step window [t_s − latency_s, t_s];
    │        both in proportion to interval length ─► Interval.flops
    ├─► device_peaks(): pipeline data "peak_flops", else DEVICES[data "device"].peak_flops, for
    │        the devices it lists in data "devices" (or one override for all)
    ├─► hardware(): GPU (SM share) or CPU (core share, cores) — hardware.py
    ▼
    device_series(): per device a step function: share per (pipeline, kind) and per pipeline,
        utilisation, MFU ─► Timeline (+ host, open, migration events; the first grant; per
        pipeline its steps against exclusive time and its SLO: model.slo_steps)
        ─► summary.py: a row per pipeline and per kind
        ─► write(out) by suffix: .png png_bytes (draw.py; matplotlib, imported only there)
                                 | .json chrome_trace (Perfetto; validate_chrome_trace checks it)
                                 | .html html_page (page.py: the PNG inlined + the tables + SLOs + fell open)

Definitions.  Utilisation is the share granted (SM share on a GPU, core share on a CPU), not
measured activity: min(1, Σ sm_frac of the intervals holding the device).  An unpartitioned
pair (both granted σ = 1, time-shared) is drawn as shares 1/n each.  MFU of a device =
Σ (interval FLOPs / interval length) / peak.  Means run over the window from the first grant to
the end of the last sub-stage × the devices shown, an idle device counting zero: the start-up
before the first grant (a daemon waiting for its pipelines to load) and the tail after the work
(pipelines unregistering) are not counted, and the drawn axis runs from CROP_MARGIN_FRAC of the
window before the first grant (the title says how much it left off; a simulator trace starts
with a grant and is not cropped) to as much after the work.  A pipeline's mean MFU is its
FLOPs over its busy device-seconds × peak.

What a trace must honour (the simulator does): one holding per (pipeline, device) at a time;
a release names its pipeline and device (its sub-stage may be empty); events at equal t_s
apply in file order, so a release of a pipeline's old holding on a device comes before the
grant of its next one there; release data "flops" is the work done on that device since the
holding's first grant, and a pipeline reports it on all its releases or on none.

The PNG colours each band by its sub-stage kind and hatches it by pipeline, one row per device
up to MAX_ROWS devices; beyond that, one node-wide row (mean share per pipeline and kind, mean
MFU) above a device × time heatmap of utilisation (and one of MFU when known), so 64 devices
stay readable.
"""

from __future__ import annotations

import json
from pathlib import Path

from jigsaw.timeline.chrome import chrome_trace, validate_chrome_trace
from jigsaw.timeline.draw import figure, kind_colors, png_bytes
from jigsaw.timeline.hardware import Hardware, hardware
from jigsaw.timeline.model import (
    FORMATS,
    DeviceSeries,
    Interval,
    Timeline,
    attribute_flops,
    binned,
    build,
    describe,
    device_peaks,
    device_series,
    integral,
    intervals,
    load,
)
from jigsaw.timeline.page import html_page
from jigsaw.timeline.summary import KindSummary, PipelineSummary, kind_summary, pipeline_summary

__all__ = ["DeviceSeries", "FORMATS", "Hardware", "Interval", "KindSummary", "PipelineSummary", "Timeline",
           "attribute_flops", "binned", "build", "check_format", "chrome_trace", "describe", "device_peaks",
           "device_series", "figure", "hardware", "html_page", "integral", "intervals", "kind_colors",
           "kind_summary", "load", "pipeline_summary", "png_bytes", "validate_chrome_trace", "write"]


def check_format(out: str | Path) -> str:
    """The suffix of `out`; ValueError for an unknown one, MissingExtra for a drawing without matplotlib."""
    from jigsaw.extras import require

    suffix = Path(out).suffix.lower()
    if suffix not in FORMATS:
        raise ValueError(f"cannot write {out}: unknown suffix {suffix or '(none)'!r}; use one of {', '.join(FORMATS)}")
    if suffix in (".png", ".html"):
        require("timeline", f"drawing a {suffix[1:].upper()} timeline", "a .json one (Perfetto) needs nothing more")
    return suffix


def write(tl: Timeline, out: str | Path, usd_per_gpu_hour: float | None = None) -> str:
    """Write `out` in the format its suffix names; return the format.  `usd_per_gpu_hour`
    prices the HTML page's cost columns in dollars too."""
    suffix = check_format(out)
    if suffix == ".png":
        Path(out).write_bytes(png_bytes(tl))
    elif suffix == ".json":
        doc = chrome_trace(tl)
        validate_chrome_trace(doc)
        Path(out).write_text(json.dumps(doc, separators=(",", ":"), allow_nan=False))
    else:
        Path(out).write_text(html_page(tl, usd_per_gpu_hour))
    return suffix[1:]
