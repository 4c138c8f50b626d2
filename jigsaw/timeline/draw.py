"""The PNG of a Timeline (matplotlib, imported inside the functions, never at module import).

    Timeline ─► figure(): up to MAX_ROWS devices a row each, else a node-mean row + heatmaps
        row of a device: DeviceSeries.kind_share_frac stacked per (pipeline, kind):
            fill colour  = the kind   (KIND_COLORS, a fixed palette; other kinds FALLBACK_COLORS)
            hatch        = the pipeline (HATCHES by pipeline order; a white line tops each pipeline)
            strip below 0: host sub-stages (reward, tool), a lane per pipeline, same channels
            black line   = MFU (right axis), when the peak and FLOPs are known
        x: seconds since the trace's first event, from Timeline.view_start_s (start-up cropped;
           the title states how much) to the trace's end
        labels: Timeline.hardware ("GPU 0", "SM share" | "CPU 0 (2 cores)", "core share")
    ─► png_bytes(): Agg, 110 dpi

Every artist drawing a (pipeline, kind) carries gid "pipeline|kind" (tests read the colours).
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence

from jigsaw.timeline.model import DeviceSeries, Timeline, binned, substage_kind
from jigsaw.timeline.summary import host_span

MAX_ROWS = 16
"""Devices drawn one row each; more are drawn as heatmaps."""
HEATMAP_BINS = 400
KIND_COLORS = {
    "rollout_prefill": "#56B4E9",  # sky blue
    "rollout_decode": "#0072B2",  # blue
    "rollout_tail": "#009E73",  # bluish green
    "reference": "#E69F00",  # orange
    "training": "#D55E00",  # vermillion
    "reward": "#CC79A7",  # reddish purple
    "tool": "#F0E442",  # yellow
}
"""Colour of each sub-stage kind (Okabe–Ito: apart for colour-blind readers too)."""
FALLBACK_COLORS = ("#999999", "#8C564B", "#BCBD22", "#17BECF", "#7F7F7F", "#AEC7E8")
"""Kinds outside KIND_COLORS, by order of appearance."""
HATCHES = ("", "////", "....", "xxxx", "\\\\\\\\", "oo", "++", "||||", "----", "**")
"""Pipeline i is hatched HATCHES[i % len]; past len, pipelines share a pattern (the legend says)."""
HATCH_COLOR = "#1A1A1A"
TITLE_LINE_IN = 0.21
LEGEND_ROW_IN = 0.3
HOST_STRIP_FRAC = 0.16
"""Height of the host strip under a row, in units of the share axis."""
MIN_HOST_WIDTH_FRAC = 0.004
"""A host sub-stage shorter than this share of the drawn time is widened to it, to stay visible."""


def kind_colors(kinds: Sequence[str]) -> dict[str, str]:
    extra = [k for k in kinds if k not in KIND_COLORS]
    return {**{k: FALLBACK_COLORS[i % len(FALLBACK_COLORS)] for i, k in enumerate(extra)},
            **{k: c for k, c in KIND_COLORS.items() if k in kinds}}


def pipeline_hatches(pipelines: Sequence[str]) -> dict[str, str]:
    return {p: HATCHES[i % len(HATCHES)] for i, p in enumerate(pipelines)}


def plain(text: str) -> str:
    """Text from the trace as matplotlib shows it literally (a `$` would start mathtext)."""
    return str(text).replace("$", r"\$")


def png_bytes(tl: Timeline) -> bytes:
    """The figure (matplotlib, Agg): rows per device, or heatmaps beyond MAX_ROWS devices."""
    import matplotlib.pyplot as plt

    fig = figure(tl)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def figure(tl: Timeline):
    """The matplotlib Figure (the caller closes it)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    return _rows_figure(tl) if len(tl.devices) <= MAX_ROWS else _heatmap_figure(tl)


# --- labels


def title(tl: Timeline) -> str:
    """Two or three lines: what ran where and the means; then what is not drawn."""
    hw, mfu = tl.hardware, tl.mean_mfu_frac
    lines = [f"{plain(tl.name)}: {len(tl.pipelines)} pipelines on {hw.count(len(tl.devices))}, "
             f"{tl.window_s:,.1f} s from the first grant — mean {hw.share} granted {tl.mean_util_frac:.1%}, "
             f"mean MFU {'unknown' if mfu is None else f'{mfu:.2%}'}"]
    notes = []
    if tl.cropped_s > 0:
        notes.append(f"start-up {tl.cropped_s:,.1f} s not shown (the first grant came "
                     f"{tl.startup_s:,.1f} s after the trace's first event)")
    if tl.opens:
        notes.append(f"{len(tl.opens)} sub-stage{'s' if len(tl.opens) != 1 else ''} fell open "
                     f"(ran without the daemon, not drawn)")
    return "\n".join(lines + ["; ".join(notes)] if notes else lines)


def x_label(tl: Timeline) -> str:
    crop = f" (the first {tl.cropped_s:,.1f} s, start-up, not shown)" if tl.cropped_s > 0 else ""
    return f"seconds since the trace's first event{crop}"


def _x_range(tl: Timeline) -> tuple[float, float]:
    """Drawn x limits, in seconds since the trace's first event."""
    return tl.view_start_s - tl.start_s, max(tl.view_end_s - tl.start_s, tl.view_start_s - tl.start_s + 1e-9)


def _header_in(tl: Timeline) -> float:
    """Inches above the axes: the title's lines, then the two legend rows."""
    return 0.1 + TITLE_LINE_IN * title(tl).count("\n") + TITLE_LINE_IN + 2 * LEGEND_ROW_IN + 0.1


def _header(fig, tl: Timeline, height_in: float, *, mfu: bool, hosts: bool) -> None:
    """The title, then legend row 1: a swatch per kind (colour; host kinds when drawn); row 2: a
    hatch per pipeline (and the MFU line)."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    drawn = tl.kinds + (tl.host_kinds if hosts else ())
    colors = kind_colors(tl.kinds + tl.host_kinds)
    hatches = pipeline_hatches(tl.pipelines)
    blank = Patch(visible=False)
    kinds = [blank] + [Patch(facecolor=colors[k], label=plain(k)) for k in drawn]
    pipes = [blank] + [Patch(facecolor="white", edgecolor=HATCH_COLOR, hatch=hatches[p], lw=0.6, label=plain(p))
                       for p in tl.pipelines]
    if mfu:
        pipes.append(Line2D([], [], color="black", lw=1.2, label="MFU (right axis)"))
    fig.suptitle(title(tl), fontsize=10.5, y=1 - 0.08 / height_in, va="top")
    legend_in = 0.08 + TITLE_LINE_IN * (title(tl).count("\n") + 1) + 0.05
    for row, (handles, head) in enumerate([(kinds, "sub-stage kind:"), (pipes, "pipeline:")]):
        handles[0].set_label(head)
        fig.legend(handles=handles, loc="upper center", ncol=len(handles), frameon=False, fontsize=9,
                   handlelength=2.2, columnspacing=1.4,
                   bbox_to_anchor=(0.5, 1 - (legend_in + LEGEND_ROW_IN * row) / height_in))


# --- one row per device


def _rows_figure(tl: Timeline):
    import matplotlib.pyplot as plt

    n = len(tl.devices)
    row_in = 2.2 if n <= 2 else 1.6 if n <= 4 else 1.25
    header_in = _header_in(tl)
    height_in = row_in * n + header_in + 0.6
    fig, axes = plt.subplots(n, 1, sharex=True, squeeze=False, figsize=(13, height_in))
    fig.subplots_adjust(left=0.11, right=0.955, top=1 - header_in / height_in, bottom=0.6 / height_in, hspace=0.16)
    mfu_top = _mfu_top(tl)
    hosted = [_draw_device(ax, tl, tl.series[d], mfu_top) for ax, d in zip(axes[:, 0], tl.devices)]
    axes[-1, 0].set_xlim(*_x_range(tl))
    axes[-1, 0].set_xlabel(x_label(tl))
    _header(fig, tl, height_in, mfu=_has_mfu(tl), hosts=any(hosted))
    return fig


def _has_mfu(tl: Timeline) -> bool:
    return tl.flops > 0 and any(s.mfu_frac is not None for s in tl.series.values())


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


def _step_xy(tl: Timeline, times_s: Sequence[float], values: Sequence[float]) -> tuple[list[float], list[float]]:
    """Step function as x (seconds since the trace start, to its end) and y for step='post'."""
    return [0.0, *(t - tl.start_s for t in times_s), tl.span_s], [0.0, *values, 0.0]


def _draw_bands(ax, tl: Timeline, xs: Sequence[float], shares: dict[tuple[str, str], Sequence[float]]) -> None:
    """Stack the (pipeline, kind) shares: colour by kind, hatch by pipeline, a white line on
    top of each pipeline's part of the stack."""
    colors = kind_colors(tl.kinds)
    hatches = pipeline_hatches(tl.pipelines)
    base = [0.0] * len(xs)
    for p in tl.pipelines:
        for k in (k for q, k in shares if q == p):
            top = [b + y for b, y in zip(base, shares[p, k])]
            band = ax.fill_between(xs, base, top, step="post", facecolor=colors[k], hatch=hatches[p],
                                   edgecolor=HATCH_COLOR, lw=0)
            band.set_hatchcolor(HATCH_COLOR)
            band.set_hatch_linewidth(0.6)
            band.set_gid(f"{p}|{k}")
            base = top
        if any((q == p) for q, _ in shares):
            ax.step(xs, base, where="post", color="white", lw=0.7)


def _draw_device(ax, tl: Timeline, s: DeviceSeries, mfu_top: float) -> bool:
    """One device's row; whether it drew host sub-stages."""
    xs = _step_xy(tl, s.times_s, [])[0]
    shares = {pk: _step_xy(tl, s.times_s, v)[1] for pk, v in s.kind_share_frac.items()}
    _draw_bands(ax, tl, xs, shares)
    hosted = _draw_hosts(ax, tl, s.device)
    ax.set_ylim(-HOST_STRIP_FRAC if hosted else 0, 1.02)
    ticks = ([-HOST_STRIP_FRAC / 2] if hosted else []) + [0, 0.5, 1]
    ax.set_yticks(ticks, labels=(["host"] if hosted else []) + ["0%", "50%", "100%"])
    ax.tick_params(axis="y", labelsize=7)
    ax.grid(axis="x", alpha=0.3)
    hw = tl.hardware
    label = f"{hw.device} {s.device}{f' ({hw.cores} cores)' if hw.cores else ''}\n{hw.share} {tl.mean_util(s):.0%}"
    if s.mfu_frac is not None and tl.flops > 0:
        _draw_mfu(ax, tl, s, mfu_top)
        mfu = sum(iv.flops for iv in tl.intervals if iv.device == s.device) / (tl.peak_flops[s.device] * tl.window_s)
        label += f"\nMFU {mfu:.1%}"
    ax.set_ylabel(label, rotation=0, ha="right", va="center", fontsize=8)
    return hosted


def _draw_mfu(ax, tl: Timeline, s: DeviceSeries, mfu_top: float) -> None:
    twin = ax.twinx()
    twin.step(*_step_xy(tl, s.times_s, s.mfu_frac), where="post", color="black", lw=1.0)
    bottom = ax.get_ylim()[0] / 1.02 * mfu_top * 1.05
    twin.set_ylim(bottom, mfu_top * 1.05)
    twin.set_yticks([0, mfu_top / 2, mfu_top])
    twin.yaxis.set_major_formatter(_percent())
    twin.tick_params(axis="y", labelsize=7)


def _draw_hosts(ax, tl: Timeline, device: int) -> bool:
    """Host sub-stages of the pipelines placed here, in a lane per pipeline below 0; whether any."""
    colors = kind_colors(tl.kinds + tl.host_kinds)
    hatches = pipeline_hatches(tl.pipelines)
    lo, hi = _x_range(tl)
    min_w = MIN_HOST_WIDTH_FRAC * (hi - lo)
    lane = HOST_STRIP_FRAC * 0.8 / max(1, len(tl.pipelines))
    spans: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for h in tl.hosts:
        if h.pipeline in hatches and tl.device_of(h.substage, h.t_s) == device:
            a, b = host_span(h)
            spans.setdefault((h.pipeline, substage_kind(h.substage)), []).append((a - tl.start_s, max(b - a, min_w)))
    for (p, k), xr in spans.items():
        y = -HOST_STRIP_FRAC * 0.9 + lane * tl.pipelines.index(p)
        bars = ax.broken_barh(xr, (y, lane), facecolors=colors[k], hatch=hatches[p], edgecolor=HATCH_COLOR, lw=0)
        bars.set_hatchcolor(HATCH_COLOR)
        bars.set_hatch_linewidth(0.6)
        bars.set_gid(f"{p}|{k}")
    if spans:
        ax.axhline(0, color="#888888", lw=0.5)
    return bool(spans)


# --- heatmaps beyond MAX_ROWS devices


def _heatmap_figure(tl: Timeline):
    import matplotlib.pyplot as plt

    hw = tl.hardware
    edges = [tl.view_start_s + (tl.view_end_s - tl.view_start_s) * k / HEATMAP_BINS for k in range(HEATMAP_BINS + 1)]
    util = [binned(s.times_s, s.util_frac, edges) for s in tl.series.values()]
    mfu = [binned(s.times_s, s.mfu_frac, edges) for s in tl.series.values()] if _all_mfu(tl) else None
    maps = [(util, f"{hw.share} granted", 1.0)]
    if mfu:
        maps.append((mfu, "MFU", _nice_ceiling(max(map(max, mfu)) or 1.0)))
    heights = [2.2] + [0.06 * len(tl.devices) + 1.0] * len(maps)
    header_in = _header_in(tl)
    height_in = sum(heights) + header_in + 0.6
    fig = plt.figure(figsize=(13, height_in))
    gs = fig.add_gridspec(len(heights), 2, height_ratios=heights, width_ratios=[80, 1], hspace=0.12, wspace=0.015,
                          left=0.085, right=0.935, top=1 - header_in / height_in, bottom=0.6 / height_in)
    axes = [fig.add_subplot(gs[0, 0])]
    _draw_node_mean(axes[0], tl, edges, mfu)
    x0, x1 = _x_range(tl)
    for row, (grid, label, vmax) in enumerate(maps, 1):
        ax = fig.add_subplot(gs[row, 0], sharex=axes[0])
        axes.append(ax)
        im = ax.imshow(grid, aspect="auto", interpolation="nearest", extent=(x0, x1, len(tl.devices) - 0.5, -0.5),
                       vmin=0, vmax=vmax, cmap="viridis")
        ax.set_ylabel(f"{label}\nby {hw.device}", fontsize=9)
        _device_ticks(ax, tl.devices)
        fig.colorbar(im, cax=fig.add_subplot(gs[row, 1]), format=_percent())
    for ax in axes[:-1]:
        ax.tick_params(labelbottom=False)
    axes[-1].set_xlim(x0, x1)
    axes[-1].set_xlabel(x_label(tl))
    _header(fig, tl, height_in, mfu=mfu is not None, hosts=False)
    return fig


def _all_mfu(tl: Timeline) -> bool:
    return all(s.mfu_frac is not None for s in tl.series.values()) and tl.flops > 0


def _draw_node_mean(ax, tl: Timeline, edges: Sequence[float], mfu: list[list[float]] | None) -> None:
    """Node-wide mean share per (pipeline, kind), stacked as in a row, over binned time (and mean MFU)."""
    xs = [e - tl.start_s for e in edges]
    pairs = dict.fromkeys(pk for s in tl.series.values() for pk in s.kind_share_frac)
    shares = {}
    for pk in sorted(pairs, key=lambda pk: tl.pipelines.index(pk[0])):
        rows = [binned(s.times_s, s.kind_share_frac[pk], edges) for s in tl.series.values() if pk in s.kind_share_frac]
        shares[pk] = [sum(col) / len(tl.devices) for col in zip(*rows)] + [0.0]
    _draw_bands(ax, tl, xs, shares)
    ax.set_ylim(0, 1.02)
    ax.set_ylabel(f"node mean\n{tl.hardware.share}", fontsize=9)
    ax.yaxis.set_major_formatter(_percent())
    if mfu:
        twin = ax.twinx()
        node_mfu = [sum(col) / len(col) for col in zip(*mfu)]
        twin.step(xs, node_mfu + [0.0], where="post", color="black", lw=1.0)
        twin.set_ylim(0, _nice_ceiling(max(node_mfu)) if max(node_mfu) > 0 else 1.0)
        twin.yaxis.set_major_formatter(_percent())
        twin.tick_params(axis="y", labelsize=7)


def _device_ticks(ax, devices: Sequence[int]) -> None:
    step = max(1, len(devices) // 16)
    ticks = list(range(0, len(devices), step))
    ax.set_yticks(ticks)
    ax.set_yticklabels([str(devices[i]) for i in ticks], fontsize=7)
