"""`jigsaw timeline`: draw what every device did in a trace of `jigsaw sim` or `jigsaw run`.

    TRACE ─► jigsaw.timeline.load (grant/release intervals, FLOPs, peaks, per-device series)
          ─► --out by suffix: .png (a row per device: SM share per pipeline, MFU)
                              .json (Chrome trace / Perfetto: ui.perfetto.dev, chrome://tracing)
                              .html (the PNG inlined + a summary table per pipeline)
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

    trace: Annotated[Path, tyro.conf.Positional, tyro.conf.arg(metavar="TRACE")]
    """Trace file (JSON lines) written by `jigsaw sim --out` or `jigsaw run`."""
    out: Path = Path("jigsaw-timeline.png")
    """Output; the suffix picks the format: .png, .json (Chrome trace for Perfetto), .html (PNG + summary)."""
    peak_tflops: float | None = None
    """Peak dense TFLOP/s per device for MFU (default: the trace's, e.g. 989 for an h100 pipeline)."""
    devices: tuple[int, ...] | None = None
    """Only these devices (default: every device of the trace)."""


def run(args: Args) -> int:
    from jigsaw import timeline

    timeline.check_format(args.out)  # before the (possibly long) read
    if args.peak_tflops is not None and not args.peak_tflops > 0:
        raise ValueError(f"--peak-tflops must be > 0, got {args.peak_tflops}")
    tl = timeline.load(args.trace, peak_flops=args.peak_tflops * 1e12 if args.peak_tflops else None,
                       devices=args.devices)
    fmt = timeline.write(tl, args.out)
    print(f"wrote {args.out} ({fmt}): {timeline.describe(tl)}")
    return 0
