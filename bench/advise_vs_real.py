"""`jigsaw advise` against the measured pairing: two real GRPO pipelines on this CPU.

    python bench/advise_vs_real.py [--steps 5] [--repeats 2] [--out-dir /tmp/jigsaw-advise-vs-real]

The demo's serial-live, static and jigsaw modes run interleaved and repeated
(jigsaw.recipes.demo).  serial-live runs each pipeline alone under a daemon, one after the
other: its trace, cut in two (one file per pipeline), is what a user has of each job alone.

    repeat r:  serial-live trace ─► A.jsonl, B.jsonl ─► jigsaw.sim.advise (what `jigsaw advise
               A.jsonl B.jsonl` prints) ─► predicted tokens/s of the pair under jigsaw,
               one after the other (serial) and a static split
               set against the same repeat's measured jigsaw, serial-live and static runs

Not a test: the times are this machine's.  Goal (issue 36): the pairing's throughput under
jigsaw within 10% of the measured one.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from rich.console import Console
from rich.table import Table

from jigsaw.mux.model.slowdown import load_grid
from jigsaw.profiles import CPU_DEFAULT, resolve
from jigsaw.recipes.demo import DemoConfig, run_demo
from jigsaw.recipes.demo_report import print_report
from jigsaw.sim.advise import advise_pair, jobs_of, per_pipeline
from jigsaw.trace import Trace

MODES = ("serial-live", "static", "jigsaw")
MEASURED = {"jigsaw": "jigsaw", "serial": "serial-live", "static": "static"}
"""Predicted policy -> the measured mode it is set against."""


def solo_files(trace: Trace, out_dir: Path, tag: str) -> list[Path]:
    """One trace file per pipeline, as each job's run alone."""
    paths = []
    for name, solo in per_pipeline(trace).items():
        path = out_dir / f"{tag}-{name}.jsonl"
        solo.write(path)
        paths.append(path)
    return paths


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=DemoConfig().steps)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out-dir", type=Path, default=Path("/tmp/jigsaw-advise-vs-real"))
    args = ap.parse_args()
    console = Console(width=120)
    cfg = DemoConfig(steps=args.steps, repeats=args.repeats, modes=MODES, out_dir=args.out_dir)
    runs = run_demo(cfg, say=console.print)
    print_report(runs, console)
    grid = load_grid(resolve(cfg.profile or CPU_DEFAULT))
    measured = {(r.mode, r.repeat): r.tokens_per_s for r in runs}
    rows: dict[str, list[tuple[float, float]]] = {p: [] for p in MEASURED}
    for rep in range(1, args.repeats + 1):
        trace = Trace.read(args.out_dir / f"serial-live-trace-r{rep}.jsonl")
        a, b = jobs_of(solo_files(trace, args.out_dir, f"r{rep}"), warmup_steps=cfg.warmup_steps)
        pair = advise_pair(a, b, grid)
        for policy, mode in MEASURED.items():
            rows[policy].append((measured[(mode, rep - 1)], pair.options[policy].tokens_per_s))
    console.print(table(rows, args.repeats))


def table(rows: dict[str, list[tuple[float, float]]], repeats: int) -> Table:
    t = Table(title=f"jigsaw advise on each repeat's solo traces against the same repeat's runs ({repeats} repeats)")
    for col in ("policy", "measured tokens/s", "advised tokens/s", "error per repeat", "median error"):
        t.add_column(col, justify="left" if col == "policy" else "right")
    for policy, pairs in rows.items():
        errors = [p / m - 1 for m, p in pairs]
        t.add_row(policy, " ".join(f"{m:,.0f}" for m, _ in pairs), " ".join(f"{p:,.0f}" for _, p in pairs),
                  " ".join(f"{e:+.1%}" for e in errors), f"{statistics.median(errors):+.1%}")
    return t


if __name__ == "__main__":
    main()
