"""PNG (matplotlib, imported inside the functions) and self-contained HTML of a Timeline."""

from __future__ import annotations

import html
import io
import math
from collections.abc import Sequence

from jigsaw.timeline.model import DeviceSeries, PipelineSummary, Timeline, binned, describe, integral

MAX_ROWS = 16
"""Devices drawn one row each; more are drawn as heatmaps."""
HEATMAP_BINS = 400


def _colors(pipelines: Sequence[str]) -> dict[str, tuple]:
    from matplotlib import colormaps

    cmap = colormaps["tab10" if len(pipelines) <= 10 else "tab20"]
    return {p: cmap(i % cmap.N) for i, p in enumerate(pipelines)}


def _title(tl: Timeline) -> str:
    mfu = tl.mean_mfu_frac
    return (f"{tl.name}: {len(tl.pipelines)} pipelines on {len(tl.devices)} GPUs, {tl.span_s:,.1f} s — "
            f"mean SM utilisation {tl.mean_util_frac:.1%}, mean MFU {'unknown' if mfu is None else f'{mfu:.2%}'}")


def png_bytes(tl: Timeline) -> bytes:
    """The figure (matplotlib, Agg): rows per device, or heatmaps beyond MAX_ROWS devices."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig = _rows_figure(tl) if len(tl.devices) <= MAX_ROWS else _heatmap_figure(tl)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def _mfu_top(tl: Timeline) -> float:
    top = max((max(s.mfu_frac, default=0.0) for s in tl.series.values() if s.mfu_frac), default=0.0)
    return _nice_ceiling(top) if top > 0 else 1.0


def _nice_ceiling(x: float) -> float:
    """Smallest of 1, 2, 2.5, 5 × 10^k at or above x."""
    base = 10 ** math.floor(math.log10(x))
    return next(m * base for m in (1, 2, 2.5, 5, 10) if m * base >= x * 1.0001)


def _percent():
    from matplotlib.ticker import PercentFormatter

    return PercentFormatter(xmax=1.0, decimals=None)


def _rows_figure(tl: Timeline):
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    n = len(tl.devices)
    height_in = 1.15 * n + 1.45
    fig, axes = plt.subplots(n, 1, sharex=True, squeeze=False, figsize=(13, height_in))
    fig.subplots_adjust(left=0.085, right=0.955, top=1 - 0.8 / height_in, bottom=0.55 / height_in, hspace=0.12)
    colors = _colors(tl.pipelines)
    mfu_top = _mfu_top(tl)
    for ax, d in zip(axes[:, 0], tl.devices):
        _draw_device(ax, tl, tl.series[d], colors, mfu_top)
    axes[-1, 0].set_xlabel("seconds since the trace's first event")
    handles = [Patch(color=colors[p], alpha=0.85, label=p) for p in tl.pipelines]
    if tl.flops > 0 and any(s.mfu_frac is not None for s in tl.series.values()):
        handles.append(Line2D([], [], color="black", lw=1.2, label="MFU (right axis)"))
    fig.legend(handles=handles, loc="upper center", ncol=min(len(handles), 4), frameon=False, fontsize=9,
               bbox_to_anchor=(0.5, 1 - 0.36 / height_in))
    fig.suptitle(_title(tl), fontsize=11, y=1 - 0.1 / height_in)
    return fig


def _step_xy(tl: Timeline, s: DeviceSeries, values: Sequence[float]) -> tuple[list[float], list[float]]:
    """Step function as x (relative seconds, from 0 to the span) and y for step='post' drawing."""
    xs = [0.0, *(t - tl.start_s for t in s.times_s), tl.span_s]
    ys = [0.0, *values, 0.0]
    return xs, ys


def _draw_device(ax, tl: Timeline, s: DeviceSeries, colors: dict, mfu_top: float) -> None:
    base = [0.0] * (len(s.times_s) + 2)
    for p in tl.pipelines:
        xs, ys = _step_xy(tl, s, s.share_frac[p])
        top = [b + y for b, y in zip(base, ys)]
        if any(ys):
            ax.fill_between(xs, base, top, step="post", color=colors[p], alpha=0.85, lw=0)
        base = top
    ax.set_ylim(0, 1.02)
    ax.set_xlim(0, max(tl.span_s, 1e-9))
    ax.set_yticks([0, 0.5, 1])
    ax.yaxis.set_major_formatter(_percent())
    ax.tick_params(axis="y", labelsize=7)
    ax.grid(axis="x", alpha=0.3)
    util = integral(s.times_s, s.util_frac, tl.start_s, tl.end_s) / tl.span_s if tl.span_s else 0.0
    label = f"GPU {s.device}\nutil {util:.0%}"
    if s.mfu_frac is not None and tl.flops > 0:
        twin = ax.twinx()
        xs, ys = _step_xy(tl, s, s.mfu_frac)
        twin.step(xs, ys, where="post", color="black", lw=1.0)
        twin.set_ylim(0, mfu_top * 1.05)
        twin.set_yticks([0, mfu_top / 2, mfu_top])
        twin.yaxis.set_major_formatter(_percent())
        twin.tick_params(axis="y", labelsize=7)
        mfu = integral(s.times_s, s.mfu_frac, tl.start_s, tl.end_s) / (tl.span_s or 1.0)
        label += f"\nMFU {mfu:.1%}"
    ax.set_ylabel(label, rotation=0, ha="right", va="center", fontsize=8)


def _heatmap_figure(tl: Timeline):
    import matplotlib.pyplot as plt

    edges = [tl.start_s + tl.span_s * k / HEATMAP_BINS for k in range(HEATMAP_BINS + 1)]
    util = [binned(s.times_s, s.util_frac, edges) for s in tl.series.values()]
    with_mfu = all(s.mfu_frac is not None for s in tl.series.values()) and tl.flops > 0
    mfu = [binned(s.times_s, s.mfu_frac, edges) for s in tl.series.values()] if with_mfu else None
    maps = [(util, "SM utilisation", 1.0)] + ([(mfu, "MFU", _nice_ceiling(max(map(max, mfu)) or 1.0))] if mfu else [])
    heights = [2.2] + [0.06 * len(tl.devices) + 1.0] * len(maps)
    height_in = sum(heights) + 1.45
    fig = plt.figure(figsize=(13, height_in))
    gs = fig.add_gridspec(len(heights), 2, height_ratios=heights, width_ratios=[80, 1], hspace=0.12, wspace=0.015,
                          left=0.085, right=0.935, top=1 - 0.8 / height_in, bottom=0.55 / height_in)
    axes = [fig.add_subplot(gs[0, 0])]
    handles = _draw_node_mean(axes[0], tl, edges, mfu)
    for row, (grid, label, vmax) in enumerate(maps, 1):
        ax = fig.add_subplot(gs[row, 0], sharex=axes[0])
        axes.append(ax)
        im = ax.imshow(grid, aspect="auto", interpolation="nearest", extent=(0, tl.span_s, len(tl.devices) - 0.5, -0.5),
                       vmin=0, vmax=vmax, cmap="viridis")
        ax.set_ylabel(f"{label}\nby GPU", fontsize=9)
        _device_ticks(ax, tl.devices)
        fig.colorbar(im, cax=fig.add_subplot(gs[row, 1]), format=_percent())
    for ax in axes[:-1]:
        ax.tick_params(labelbottom=False)
    axes[-1].set_xlabel("seconds since the trace's first event")
    fig.legend(handles=handles, loc="upper center", ncol=min(len(handles), 4), frameon=False, fontsize=9,
               bbox_to_anchor=(0.5, 1 - 0.36 / height_in))
    fig.suptitle(_title(tl), fontsize=11, y=1 - 0.1 / height_in)
    return fig


def _draw_node_mean(ax, tl: Timeline, edges: Sequence[float], mfu: list[list[float]] | None) -> list:
    """Node-wide stacked mean SM share per pipeline (and mean MFU) over binned time; legend handles."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    colors = _colors(tl.pipelines)
    mids = [(a + b) / 2 - tl.start_s for a, b in zip(edges, edges[1:])]
    base = [0.0] * (len(edges) - 1)
    for p in tl.pipelines:
        rows = [binned(s.times_s, s.share_frac[p], edges) for s in tl.series.values()]
        top = [b + sum(col) / len(rows) for b, col in zip(base, zip(*rows))]
        ax.fill_between(mids, base, top, color=colors[p], alpha=0.85, lw=0)
        base = top
    ax.set_ylim(0, 1.02)
    ax.set_xlim(0, max(tl.span_s, 1e-9))
    ax.set_ylabel("node mean\nSM share", fontsize=9)
    ax.yaxis.set_major_formatter(_percent())
    handles = [Patch(color=colors[p], alpha=0.85, label=p) for p in tl.pipelines]
    if mfu:
        twin = ax.twinx()
        node_mfu = [sum(col) / len(col) for col in zip(*mfu)]
        twin.plot(mids, node_mfu, color="black", lw=1.0)
        twin.set_ylim(0, _nice_ceiling(max(node_mfu)) if max(node_mfu) > 0 else 1.0)
        twin.yaxis.set_major_formatter(_percent())
        twin.tick_params(axis="y", labelsize=7)
        handles.append(Line2D([], [], color="black", lw=1.2, label="node mean MFU (right axis)"))
    return handles


def _device_ticks(ax, devices: Sequence[int]) -> None:
    step = max(1, len(devices) // 16)
    ticks = list(range(0, len(devices), step))
    ax.set_yticks(ticks)
    ax.set_yticklabels([str(devices[i]) for i in ticks], fontsize=7)


# --- HTML


def html_page(tl: Timeline) -> str:
    """One self-contained page: the PNG inlined as base64 and a table per pipeline."""
    import base64

    img = base64.b64encode(png_bytes(tl)).decode()
    rows = "".join(_html_row(s) for s in tl.pipeline_summary())
    esc = html.escape
    note = (f"<p>{tl.unattributed_flops:.3g} FLOPs fell outside every grant interval and are not drawn.</p>"
            if tl.unattributed_flops else "")
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>jigsaw timeline: {esc(tl.name)}</title>
<style>body{{font-family:sans-serif;margin:1.5em;color:#222}}table{{border-collapse:collapse;margin-top:1em}}
td,th{{border:1px solid #ccc;padding:.3em .7em;text-align:right}}td:first-child,th:first-child{{text-align:left}}
img{{max-width:100%}}</style></head><body>
<h1>jigsaw timeline: {esc(tl.name)}</h1>
<p>{esc(describe(tl))}. Utilisation is the SM share granted; MFU is attributed FLOPs over time × peak.</p>
<img alt="per-device SM share and MFU" src="data:image/png;base64,{img}">
<table><thead><tr><th>pipeline</th><th>busy device-s</th><th>SM-share device-s</th><th>tokens</th>
<th>TFLOP</th><th>FLOPs from</th><th>mean MFU</th></tr></thead><tbody>
{rows}</tbody></table>{note}
</body></html>
"""


def _html_row(s: PipelineSummary) -> str:
    mfu = "—" if s.mfu_frac is None else f"{s.mfu_frac:.2%}"
    return (f"<tr><td>{html.escape(s.name)}</td><td>{s.busy_device_s:,.1f}</td><td>{s.sm_device_s:,.1f}</td>"
            f"<td>{s.tokens:,}</td><td>{s.flops / 1e12:,.1f}</td><td>{s.flops_source}</td><td>{mfu}</td></tr>\n")
