"""What the demo's runs say, and whether to believe it.

    [Run] (mode × repeat) ─► summarise ─► ModeSummary per mode: median tokens/s, min..max,
                                          × serial paired by repeat (median, min..max)
                          ─► doubts    ─► reasons the comparison is unreliable: a comparison
                                          the repeats do not settle (a paired ratio on both
                                          sides of 1), a machine busy with other work between
                                          runs, modes that did different work, one repeat
                          ─► noise     ─► modes whose repeats spread wide (the median holds)
                          ─► table (rich) and the verdict lines
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from dataclasses import dataclass

from jigsaw.recipes.demo import DAEMON_POLICY, Run

MAX_SPREAD_FRAC = 0.2
"""A mode whose runs differ by more than this (max - min over the median) is called noisy."""
MAX_BUSY_FRAC = 0.15
"""Share of the machine other processes may use between runs before the timings are suspect."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ModeSummary:
    mode: str
    runs: int
    tokens_per_s: float
    """Median over the repeats."""
    min_tokens_per_s: float
    max_tokens_per_s: float
    vs_serial: tuple[float, float, float] | None
    """(median, min, max) of this mode's tokens/s over serial's in the same repeat."""
    step_latency_s: dict[str, float]
    """Median over repeats of the mean measured step latency, per pipeline."""
    wall_s: float
    """Median whole-run time, start-up included."""
    fell_open: int
    """Sub-stages that fell open, summed over the repeats."""

    @property
    def spread_frac(self) -> float:
        return (self.max_tokens_per_s - self.min_tokens_per_s) / self.tokens_per_s if self.tokens_per_s else 0.0


def summarise(runs: list[Run]) -> list[ModeSummary]:
    by_mode: dict[str, list[Run]] = defaultdict(list)
    for r in runs:
        by_mode[r.mode].append(r)
    serial = {r.repeat: r.tokens_per_s for r in by_mode.get("serial", ())}
    return [_mode_summary(mode, rs, serial) for mode, rs in by_mode.items()]


def _mode_summary(mode: str, rs: list[Run], serial: dict[int, float]) -> ModeSummary:
    tps = [r.tokens_per_s for r in rs]
    ratios = [r.tokens_per_s / serial[r.repeat] for r in rs if serial.get(r.repeat)]
    names = rs[0].step_latency_s.keys()
    return ModeSummary(mode=mode, runs=len(rs), tokens_per_s=statistics.median(tps), min_tokens_per_s=min(tps),
                       max_tokens_per_s=max(tps),
                       vs_serial=(statistics.median(ratios), min(ratios), max(ratios)) if ratios else None,
                       step_latency_s={n: statistics.median(r.step_latency_s[n] for r in rs) for n in names},
                       wall_s=statistics.median(r.wall_s for r in rs), fell_open=sum(r.fell_open for r in rs))


def doubts(runs: list[Run], summaries: list[ModeSummary]) -> list[str]:
    """Why the comparison should not be trusted; empty when nothing is suspect."""
    out = []
    if max((s.runs for s in summaries), default=0) < 2:
        out.append("one run per mode: no spread to judge the timings by (use --repeats 3)")
    out += [f"the repeats do not tell whether {a} is faster than {b}: {a}/{b} ranges {lo:.2f}-{hi:.2f} "
            "over the repeats" for a, b, (lo, hi) in _comparisons(runs) if lo < 1.0 < hi]
    if (busy := max((r.idle_busy_frac for r in runs), default=0.0)) > MAX_BUSY_FRAC:
        out.append(f"the machine was busy with other work: up to {busy:.0%} of its CPU between runs "
                   f"(over {MAX_BUSY_FRAC:.0%})")
    if len({r.step_tokens for r in runs}) > 1:
        out.append("the runs did different work (their token counts per step differ)")
    return out


def noise(summaries: list[ModeSummary]) -> list[str]:
    """Modes whose repeats spread wider than MAX_SPREAD_FRAC: their medians are still the
    numbers to quote, but not to a few percent."""
    return [f"{s.mode}: its runs differ by {s.spread_frac:.0%} of the median "
            f"({s.min_tokens_per_s:,.0f}..{s.max_tokens_per_s:,.0f} tokens/s)"
            for s in summaries if s.spread_frac > MAX_SPREAD_FRAC]


def _comparisons(runs: list[Run]) -> list[tuple[str, str, tuple[float, float]]]:
    """(a, b, (min, max) of a's tokens/s over b's in the same repeat) for every mode against
    serial and jigsaw against every other mode: the questions the demo answers."""
    tps = {(r.mode, r.repeat): r.tokens_per_s for r in runs}
    modes = list(dict.fromkeys(r.mode for r in runs))
    pairs = [(m, "serial") for m in modes if m != "serial" and "serial" in modes]
    pairs += [("jigsaw", m) for m in modes if m not in ("jigsaw", "serial") and "jigsaw" in modes]
    out = []
    for a, b in pairs:
        ratios = [v / tps[(b, rep)] for (m, rep), v in tps.items() if m == a and tps.get((b, rep))]
        if ratios:
            out.append((a, b, (min(ratios), max(ratios))))
    return out


def table(summaries: list[ModeSummary]):
    from rich.table import Table

    t = Table(title="GRPO pipelines side by side on this CPU: median of the repeats (min-max)")
    for col in ("mode", "runs", "tokens/s", "× serial", "step s", "run s", "fell open"):
        t.add_column(col, justify="right", no_wrap=True)
    for s in summaries:
        ratio = f"{s.vs_serial[0]:.2f} ({s.vs_serial[1]:.2f}-{s.vs_serial[2]:.2f})" if s.vs_serial else "-"
        lat = " ".join(f"{v:.2f}" for v in s.step_latency_s.values())
        t.add_row(s.mode, str(s.runs), f"{s.tokens_per_s:,.0f} ({s.min_tokens_per_s:,.0f}-{s.max_tokens_per_s:,.0f})",
                  ratio, lat, f"{s.wall_s:.0f}", str(s.fell_open) if s.mode in DAEMON_POLICY else "-")
    t.caption = ("tokens/s: response tokens over the measured steps' time; × serial: against serial in the same "
                 "repeat; step s: mean step latency per pipeline; run s: whole run, start-up included")
    return t


def print_report(runs: list[Run], console) -> None:
    """The table and the verdict, as `jigsaw demo` and bench/cpu_demo.py print them."""
    summaries = summarise(runs)
    console.print(table(summaries))
    for line in verdict(runs, summaries):
        console.print(line, style="bold red" if line.startswith("UNRELIABLE") else None, highlight=False)


def verdict(runs: list[Run], summaries: list[ModeSummary]) -> list[str]:
    """The lines under the table: what the work was, and whether to trust the comparison."""
    tokens = sorted({r.tokens for r in runs})
    lines = [f"every run: the same {len(runs[0].step_tokens)} pipelines, {tokens[0]:,} measured response tokens"
             if len(tokens) == 1 else f"measured response tokens per run: {', '.join(f'{t:,}' for t in tokens)}"]
    if problems := doubts(runs, summaries):
        lines.append("UNRELIABLE comparison:")
        lines += [f"  - {p}" for p in problems]
    else:
        lines.append("reliable: every repeat ranks the modes the same way, the machine was quiet between runs")
    if noisy := noise(summaries):
        lines.append(f"noisy (repeats over {MAX_SPREAD_FRAC:.0%} apart; the medians hold, their digits do not):")
        lines += [f"  - {n}" for n in noisy]
    return lines
