"""`jigsaw timeline`: draw what every device did in a trace of `jigsaw sim` or `jigsaw run`.

    TRACE, or the newest <runtime dir>/traces/daemon-*.jsonl (printed)
          ─► jigsaw.timeline.load (grant/release intervals, FLOPs, peaks, GPU or CPU, series)
          ─► --out by suffix: .png (a row per device: share by sub-stage kind (colour) and
                                    pipeline (hatch), MFU; start-up before the first grant cropped)
                              .json (Chrome trace / Perfetto: ui.perfetto.dev, chrome://tracing)
                              .html (the PNG inlined + tables per pipeline and per kind + fell open)
          ─► one line: what was written, mean utilisation and MFU

matplotlib is imported only to draw (never by `jigsaw --help`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import tyro


@dataclass(frozen=True, kw_only=True, slots=True)
class Args:
    """Draw per-device utilisation and MFU of a trace as PNG, Perfetto JSON or HTML."""

    trace: Annotated[Path | None, tyro.conf.Positional, tyro.conf.arg(metavar="[TRACE]")] = None
    """Trace file (JSON lines) of `jigsaw sim --out` or a daemon; without one, the newest daemon
    trace in the runtime directory."""
    out: Path = Path("jigsaw-timeline.png")
    """Output; the suffix picks the format: .png, .json (Chrome trace for Perfetto), .html (PNG + tables)."""
    peak_tflops: float | None = None
    """Peak dense TFLOP/s per device for MFU; if unset, the trace's, e.g. 989 for an h100 pipeline."""
    devices: tuple[int, ...] | None = None
    """Only these devices; if unset, every device of the trace."""
    usd_per_gpu_hour: float | None = None
    """Price of one device for an hour: the HTML page's $ per million tokens (GPU-hours per step
    is always on it)."""


def run(args: Args) -> int:
    from jigsaw import timeline
    from jigsaw.sim.cost import check_price

    timeline.check_format(args.out)  # before the (possibly long) read
    check_price(args.usd_per_gpu_hour)
    if args.peak_tflops is not None and not args.peak_tflops > 0:
        raise ValueError(f"--peak-tflops must be > 0, got {args.peak_tflops}")
    trace = args.trace
    if trace is None:
        trace = latest_daemon_trace()
        print(f"using the latest daemon trace: {trace}")
    tl = timeline.load(trace, peak_flops=args.peak_tflops * 1e12 if args.peak_tflops else None,
                       devices=args.devices)
    fmt = timeline.write(tl, args.out, args.usd_per_gpu_hour)
    print(f"wrote {args.out} ({fmt}): {timeline.describe(tl)}")
    return 0


def latest_daemon_trace() -> Path:
    """The newest daemon trace of the runtime directory; ValueError saying where it looked if none."""
    from jigsaw.runtime import paths

    try:
        where = paths.traces_dir(paths.runtime_dir(create=False))
    except FileNotFoundError as exc:
        where = Path(exc.filename) / "traces"
    except ValueError as exc:
        raise ValueError(f"no TRACE given, and the runtime directory cannot be read: {exc}") from None
    found = paths.latest_trace()
    if found is None:
        raise ValueError(f"no TRACE given and no daemon trace (daemon-*.jsonl) in {where}; pass a trace file, "
                         f"or make one: `jigsaw sim --out trace.jsonl`, `jigsaw daemon --trace trace.jsonl`, or "
                         f"run pipelines under `jigsaw run` (its daemon writes its trace there)")
    return found
