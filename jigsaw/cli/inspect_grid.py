"""`jigsaw inspect`: validate a slowdown grid file and show what it predicts.

    FILE ─► SlowdownGrid.load (every rule checked; errors name file, field, problem)
         ─► rich tables: alone slowdown per kind and SM share; best partition per pair;
            with --pair A B the full σ × memory table of that pair.
         ─► with --learned FILE (a daemon's learned grid over this one, GridLearner.load):
            each entry with evidence, its prior, learned value and confidence (count, spread)
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import tyro


@dataclass(frozen=True, kw_only=True, slots=True)
class Args:
    """Validate a slowdown grid file and print its slowdowns."""

    path: tyro.conf.Positional[Path]
    """Grid file, e.g. profiles/h100/qwen3-4b.prior.json."""
    pair: tuple[str, str] | None = None
    """Also print the full σ × memory table of this pair of kinds (A beside B)."""
    learned: Path | None = None
    """A learned grid over this one (`jigsaw daemon --learn-grid` keeps it under the profile
    directory's learned/<node>/<device>/<model>.json): show each entry's prior, learned value and
    confidence."""


def run(args: Args) -> int:
    from rich.console import Console

    from jigsaw.mux.model.slowdown import load_grid

    grid = load_grid(args.path)
    console = Console()
    src = grid.source
    console.print(f"[bold]{args.path}[/]: valid v1 grid, {grid.model} on {grid.device.sku} "
                  f"({grid.device.num_sms} SMs, {grid.device.mem_bytes / 2**30:.0f} GiB)")
    console.print(f"source: {src['kind']} — {src.get('note', '')}")
    console.print(_alone_table(grid))
    console.print(_pairs_table(grid))
    console.print(f"best packing efficiency (1/s_a + 1/s_b): {grid.max_pack_efficiency():.2f}")
    if args.pair:
        console.print(_pair_table(grid, *args.pair))
    if args.learned:
        from jigsaw.mux.model.learned import GridLearner

        console.print(_learned_table(GridLearner.load(args.learned, grid), args.learned))
    return 0


def _learned_table(learner, path):
    from rich.table import Table

    c = learner.config
    t = Table(title=f"learned ({path}): entries with evidence; an entry moves at {c.min_samples} samples, "
                    f"within x[{c.min_factor:g}, {c.max_factor:g}] of its prior")
    for col in ("kind", "beside", "SM", "mem", "prior", "learned", "count", "spread (log)"):
        t.add_column(col, justify="left" if col in ("kind", "beside") else "right")
    for e in learner.report():
        moved = abs(e.learned / e.prior - 1.0) > 1e-9
        sm = "shared" if e.entry[1] and e.sm_frac == 1.0 else f"{e.sm_frac:.0%}"
        value = f"[bold]{e.learned:.2f}[/]" if moved else _fmt(e.learned)
        t.add_row(e.entry[0], e.entry[1] or "alone", sm, f"{e.mem_frac:.0%}", _fmt(e.prior), value, str(e.count),
                  f"{e.spread_log:.3f}")
    return t


def _fmt(v: float | None) -> str:
    return "—" if v is None or v == float("inf") else f"{v:.2f}"


def _alone_table(grid):
    from rich.table import Table

    top = grid.mem_levels[-1]
    t = Table(title=f"alone: slowdown vs SM share (memory {top:.0%})")
    t.add_column("kind")
    for sm in grid.sm_levels:
        t.add_column(f"{sm:.0%}", justify="right")
    for k in grid.kinds:
        t.add_row(k, *(_fmt(grid.alone(k, sm, top)) for sm in grid.sm_levels))
    return t


def _pairs_table(grid):
    from rich.table import Table

    t = Table(title="co-located: best partition (min of the larger slowdown)")
    for col in ("A", "B", "SM A", "mem A", "s_A", "s_B"):
        t.add_column(col, justify="right" if col.startswith(("s", "SM", "mem")) else "left")
    for i, a in enumerate(grid.kinds):
        for b in grid.kinds[i:]:
            opts = grid.pair_options(a, b)
            if not opts:
                t.add_row(a, b, "—", "—", "does not fit", "")
                continue
            sm, mem, sa, sb = min(opts, key=lambda o: max(o[2], o[3]))
            t.add_row(a, b, f"{sm:.0%}", f"{mem:.0%}", _fmt(sa), _fmt(sb))
    return t


def _pair_table(grid, a: str, b: str):
    from rich.table import Table

    t = Table(title=f"{a} beside {b}: s_A / s_B by A's SM share (rows) and memory share (columns)")
    t.add_column("SM A")
    for mem in grid.mem_levels:
        t.add_column(f"mem {mem:.0%}", justify="right")
    for sm in grid.sm_levels:
        cells = []
        for mem in grid.mem_levels:
            p = grid.pair(a, b, sm, mem)
            cells.append("—" if p is None else f"{p[0]:.2f} / {p[1]:.2f}")
        t.add_row("shared" if sm == 1.0 else f"{sm:.0%}", *cells)
    return t
