"""The HTML page of a Timeline: one self-contained file, no script, nothing fetched.

    Timeline ─► html_page():  <h1> name, describe() line
                              <img> png_bytes() inlined as base64
                              table per pipeline: busy device-s per kind, host s, tokens, steps,
                                                  TFLOP, mean MFU        (summary.pipeline_summary)
                                                  GPU-h per step and $ per M tokens of its share
                                                  of the devices, and the node's (sim/cost.py)
                              table per kind: device-s, share of the device time, mean slowdown,
                                              mean share granted        (summary.kind_summary)
                              steps and SLOs: per pipeline whose steps say it (model.slo_steps),
                                  "SLO 1.3×: 5/6 steps kept", mean step slowdown against
                                  exclusive time, plans that gave its SLO up
                              fell open: the trace's `open` events (pipeline, sub-stage, kind,
                                         reason), or a line saying none fell open

Every string that came from the trace (names, sub-stages, kinds, reasons) goes through
html.escape: a trace is untrusted input.
"""

from __future__ import annotations

import base64
import html
import math

from jigsaw.timeline.draw import kind_colors, png_bytes
from jigsaw.timeline.model import SloSteps, Timeline, describe
from jigsaw.timeline.summary import KindSummary, PipelineSummary, kind_summary, pipeline_summary

STYLE = """body{font-family:sans-serif;margin:1.5em;color:#222}table{border-collapse:collapse;margin:.5em 0 1.5em}
td,th{border:1px solid #ccc;padding:.3em .7em;text-align:right}td:first-child,th:first-child{text-align:left}
th{background:#f4f4f4}img{max-width:100%}.sw{display:inline-block;width:.9em;height:.9em;margin-right:.4em;
vertical-align:-.1em;border:1px solid #555}h2{font-size:1.15em;margin-top:1.5em}.note{color:#555}"""


def esc(value) -> str:
    return html.escape(str(value), quote=True)


def html_page(tl: Timeline, usd_per_gpu_hour: float | None = None) -> str:
    """One self-contained page (see the module docstring); `usd_per_gpu_hour` prices the
    cost columns in dollars too."""
    img = base64.b64encode(png_bytes(tl)).decode()
    share = tl.hardware.share
    note = (f"<p class=note>{tl.unattributed_flops:.3g} FLOPs fell outside every grant interval and are not "
            f"drawn.</p>" if tl.unattributed_flops else "")
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>jigsaw timeline: {esc(tl.name)}</title>
<style>{STYLE}</style></head><body>
<h1>jigsaw timeline: {esc(tl.name)}</h1>
<p>{esc(describe(tl))}.</p>
<p class=note>Utilisation is the {esc(share)} granted, not measured activity; MFU is attributed FLOPs over
time × peak. Means and shares run from the first grant to the end of the last sub-stage.</p>
<img alt="per-{esc(tl.hardware.device)} {esc(share)} by sub-stage kind and pipeline, and MFU"
 src="data:image/png;base64,{img}">
<h2>Per pipeline</h2>
{pipeline_table(tl, pipeline_summary(tl), usd_per_gpu_hour)}{note}
<h2>Per sub-stage kind</h2>
{kind_table(tl, kind_summary(tl))}
{slo_list(tl)}<h2>Fell open</h2>
{open_list(tl)}
</body></html>
"""


def _kind_head(tl: Timeline, kind: str) -> str:
    color = kind_colors(tl.kinds + tl.host_kinds)[kind]
    return f"<span class=sw style=\"background:{color}\"></span>{esc(kind)}"


def pipeline_table(tl: Timeline, rows: list[PipelineSummary], usd_per_gpu_hour: float | None = None) -> str:
    """Per pipeline, then the node's whole devices: what each did and what it cost (its cost is
    its share-weighted device time, so the pipelines' costs add up to what the node did)."""
    from jigsaw.sim.cost import columns, cost_of

    kinds = tl.kinds + tl.host_kinds
    head = "".join(f"<th>{_kind_head(tl, k)} s</th>" for k in kinds)
    costs = "".join(f"<th>{esc(c)}</th>" for c in columns(tl.hardware.device))
    body = "".join(_pipeline_row(s, kinds, cost_of(device_s=s.sm_device_s, steps=s.steps, tokens=s.tokens,
                                                   usd_per_gpu_hour=usd_per_gpu_hour)) for s in rows)
    node = cost_of(device_s=tl.window_s * len(tl.devices), steps=sum(s.steps for s in rows),
                   tokens=sum(s.tokens for s in rows), usd_per_gpu_hour=usd_per_gpu_hour)
    gap = "<td></td>" * (len(kinds) + 5)
    body += (f"<tr><td>node: {len(tl.devices)} {esc(tl.hardware.device)}s held</td>"
             f"<td>{seconds(tl.window_s * len(tl.devices))}</td>{gap}{_cost_cells(node)}</tr>\n")
    return (f"<table class=pipelines><thead><tr><th>pipeline</th><th>busy {esc(tl.hardware.device)}-s</th>{head}"
            f"<th>tokens</th><th>steps</th><th>FLOPs</th><th>FLOPs from</th><th>mean MFU</th>{costs}</tr></thead>"
            f"<tbody>\n{body}</tbody></table>")


def _pipeline_row(s: PipelineSummary, kinds: tuple[str, ...], cost) -> str:
    by_kind = {**s.busy_by_kind_s, **s.host_by_kind_s}
    cells = "".join(f"<td>{seconds(by_kind[k])}</td>" if k in by_kind else "<td>—</td>" for k in kinds)
    mfu = "—" if s.mfu_frac is None else f"{s.mfu_frac:.2%}"
    return (f"<tr><td>{esc(s.name)}</td><td>{seconds(s.busy_device_s)}</td>{cells}<td>{s.tokens:,}</td>"
            f"<td>{s.steps}</td><td>{flops(s.flops)}</td><td>{esc(s.flops_source)}</td><td>{mfu}</td>"
            f"{_cost_cells(cost)}</tr>\n")


def _cost_cells(cost) -> str:
    return "".join(f"<td>{esc(c)}</td>" for c in cost.cells())


def seconds(x_s: float) -> str:
    """2 decimals, or 3 significant digits below 0.1 s (a reward of 1.5 ms is not 0.00)."""
    return f"{x_s:,.2f}" if x_s >= 0.1 or x_s == 0 else f"{x_s:.3g}"


def flops(x: float) -> str:
    """'52.1 GFLOP', '51.1 PFLOP'; '—' for none."""
    if not x:
        return "—"
    exp = min(max(int(math.log10(x) // 3), 0), 6)
    return f"{x / 10 ** (3 * exp):,.1f} {' kMGTPE'[exp].strip()}FLOP"


def kind_table(tl: Timeline, rows: list[KindSummary]) -> str:
    device = esc(tl.hardware.device)
    body = "".join(_kind_row(tl, k) for k in rows)
    return (f"<table class=kinds><thead><tr><th>kind</th><th>sub-stages</th><th>{device}-s held (host: s run)</th>"
            f"<th>share of {device} time</th><th>mean slowdown</th><th>mean {esc(tl.hardware.share)} granted</th>"
            f"</tr></thead><tbody>\n{body}</tbody></table>")


def _kind_row(tl: Timeline, k: KindSummary) -> str:
    def pct(v: float | None) -> str:
        return "—" if v is None else f"{v:.1%}"

    slow = "—" if k.mean_slowdown is None else f"{k.mean_slowdown:.2f}×"
    where = "" if k.on_device else " (host)"
    return (f"<tr><td>{_kind_head(tl, k.kind)}{where}</td><td>{k.substages}</td><td>{seconds(k.seconds_s)}</td>"
            f"<td>{pct(k.share_frac)}</td><td>{slow}</td><td>{pct(k.mean_granted_frac)}</td></tr>\n")


def slo_list(tl: Timeline) -> str:
    """Per pipeline whose steps were measured against their exclusive time: its SLO attainment,
    mean slowdown and given-up plans ("" when no step says any of it)."""
    if not tl.slo:
        return ""
    names = [*(p for p in tl.pipelines if p in tl.slo), *(p for p in tl.slo if p not in tl.pipelines)]
    items = "".join(f"<li>{esc(name)}: {esc(slo_line(tl.slo[name]))}</li>\n" for name in names)
    return f"<h2>Steps against exclusive time</h2>\n<ul class=slo>\n{items}</ul>\n"


def slo_line(s: SloSteps) -> str:
    """'SLO 1.3×: 5/6 steps kept, mean step 1.21× exclusive, 2 plans gave it up'."""
    parts = [f"SLO {s.slo_slowdown:g}×: {s.kept}/{s.held} steps kept" if s.slo_slowdown else "no SLO"]
    if s.mean_slowdown is not None:
        parts.append(f"mean step {s.mean_slowdown:.2f}× exclusive")
    if s.given_up_plans:
        parts.append(f"{s.given_up_plans} plan{'s' if s.given_up_plans != 1 else ''} gave its SLO up")
    return ", ".join(parts)


def open_list(tl: Timeline) -> str:
    """The fell-open sub-stages as a table, or a line saying there were none."""
    if not tl.opens:
        return "<p class=fell-open>No sub-stage fell open (the trace has no open event).</p>"
    rows = []
    for e in tl.opens:
        data = e.data if isinstance(e.data, dict) else {}
        cells = [f"{e.t_s - tl.start_s:,.2f}", e.pipeline, e.substage or "—", data.get("kind", "—"),
                 data.get("reason", "—")]
        rows.append("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in cells) + "</tr>\n")
    return (f"<p class=fell-open>{len(tl.opens)} sub-stage{'s' if len(tl.opens) != 1 else ''} ran without the "
            f"daemon (fell open), so they are not drawn:</p>\n<table class=fell-open><thead><tr><th>s since the "
            f"trace's first event</th><th>pipeline</th><th>sub-stage</th><th>kind</th><th>why</th></tr></thead>"
            f"<tbody>\n{''.join(rows)}</tbody></table>")
