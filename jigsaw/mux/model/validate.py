"""Sanity checks of a slowdown grid: does it describe the device, or the load on it?

    SlowdownGrid (tables + source["noise"] from measure_grid) ─► check_grid() ─► [Finding]
        monotone     k alone on a smaller SM share faster than on a larger one,
                     by more than MONOTONE_TOL                                       warning
        noise        repeats of a point disagree: median spread > NOISE_MEDIAN_MAX,
                     or one point's spread > NOISE_POINT_MAX (per kind if recorded)  warning
        flat         every kind alone at the lowest partitioned share within
                     FLAT_TOL of 1.0: the partition was not seen                     degenerate
        pair_excess  a partitioned pair above PAIR_EXCESS_MAX x alone on the same
                     budget: the partner cannot explain it, other load does           degenerate
        free_pack    every pair of kinds packs at >= FREE_PACK (the theoretical max
                     is 2.0): pairs cost nothing                                      degenerate
    kind_spreads() / packing() ─► the numbers `jigsaw profile` prints beside the findings

Pure functions of the grid: nothing here measures, so tests feed hand-made grids.  What a real
measurement of a small model on 2 CPU cores legitimately holds (profiles/cpu/tiny-qwen3):
a tiny decode alone on one core faster than on two (0.84: two threads that synchronise), so the
best packing of the whole grid may exceed 2.0 and monotonicity is only a warning; shared
(σ = 1.0) points hundreds of times slower than alone (two processes' threads oversubscribing
the cores), so the shared row has no upper bound.  What it never holds: no kind slowed by
half the cores, or every pair packed for free.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

from jigsaw.mux.model.slowdown import SlowdownGrid

MONOTONE_TOL = 0.10
"""A kind alone may be this much faster on less SM share before it is flagged (measurement noise;
a CPU's tiny decode is legitimately a little faster on one core than on two synchronising ones)."""
NOISE_MEDIAN_MAX = 0.10
"""Typical repeat spread above which differences of MONOTONE_TOL are indistinguishable from noise."""
NOISE_POINT_MAX = 0.5
"""One repeated point varying by more than this of its median: the machine was busy meanwhile."""
FLAT_TOL = 0.03
"""Alone at the lowest partitioned share this close to 1.0, for every kind, is a flat grid."""
PAIR_EXCESS_MAX = 3.0
"""Partitioned pair over alone on the same budget: a partner on disjoint SMs (cores) shares only
memory bandwidth and caches, worth at most ~2x for two bandwidth-bound kinds (the shipped grids
stay under 2.1); above this the time was other load's."""
FREE_PACK = 1.98
"""Best packing (1/s_a + 1/s_b) within 1% of the theoretical 2.0 for every pair of kinds."""

Severity = Literal["warning", "degenerate"]


@dataclass(frozen=True, slots=True)
class Finding:
    """One problem of a grid, with the kind, level and values in its message."""

    severity: Severity
    rule: str
    message: str


@dataclass(frozen=True, slots=True)
class KindSpread:
    """How noisy and how share-sensitive one kind's measurement was."""

    kind: str
    repeat_spread_frac: float | None
    """Largest (max − min) / median of its repeated values; None where not recorded."""
    low_share_min: float
    """Smallest slowdown alone at the lowest partitioned share, over the memory levels."""
    low_share_max: float


def check_grid(grid: SlowdownGrid) -> list[Finding]:
    """Every finding, warnings first."""
    found = [*_monotone(grid), *_noise(grid.source.get("noise")), *_flat(grid), *_pair_excess(grid),
             *_free_pack(grid)]
    return sorted(found, key=lambda f: f.severity != "warning")


def is_degenerate(findings: list[Finding]) -> bool:
    return any(f.severity == "degenerate" for f in findings)


def kind_spreads(grid: SlowdownGrid) -> list[KindSpread]:
    by_kind = (grid.source.get("noise") or {}).get("max_spread_frac_by_kind", {})
    alone = _alone(grid)
    out = []
    for k in grid.kinds:
        row = alone[k][0][np.isfinite(alone[k][0])]
        out.append(KindSpread(k, by_kind.get(k), float(row.min(initial=math.inf)), float(row.max(initial=-math.inf))))
    return out


def packing(grid: SlowdownGrid) -> dict[tuple[str, str], float]:
    """Best 1/s_a + 1/s_b over the partitioned points of each unordered pair that has one."""
    best = {}
    for a, b in itertools.combinations_with_replacement(grid.kinds, 2):
        options = grid.pair_options(a, b)
        if options:
            best[(a, b)] = max(1 / s_a + 1 / s_b for _, _, s_a, s_b in options)
    return best


# ---------------------------------------------------------------------------------------- rules


def _alone(grid: SlowdownGrid) -> dict[str, np.ndarray]:
    return {k: np.array(t, dtype=float) for k, t in grid.to_dict()["alone"].items()}  # null -> NaN


def _monotone(grid: SlowdownGrid) -> list[Finding]:
    found = []
    for k, table in _alone(grid).items():
        bad = []  # (gap, lower σ index, higher σ index, mem index)
        for lo, hi in itertools.combinations(range(len(grid.sm_levels)), 2):
            for j in range(len(grid.mem_levels)):
                if table[lo, j] < table[hi, j] * (1 - MONOTONE_TOL):  # NaN compares False
                    bad.append((1 - table[lo, j] / table[hi, j], lo, hi, j))
        if bad:
            gap, lo, hi, j = max(bad)
            found.append(Finding("warning", "monotone", (
                f"{k} alone at σ={grid.sm_levels[lo]:g} mem={grid.mem_levels[j]:g} is {table[lo, j]:.2f}, "
                f"{gap:.0%} faster than at σ={grid.sm_levels[hi]:g} ({table[hi, j]:.2f}): more than the "
                f"{MONOTONE_TOL:.0%} noise tolerance ({_points(len(bad))} of {k})")))
    return found


def _noise(noise: dict | None) -> list[Finding]:
    if not noise or not noise.get("repeated_values"):
        return []
    found = []
    if noise["median_spread_frac"] > NOISE_MEDIAN_MAX:
        found.append(Finding("warning", "noise", (
            f"repeats disagree by {noise['median_spread_frac']:.0%} (median over {noise['repeated_values']} "
            f"repeated values, {noise['repeats']} runs each), more than {NOISE_MEDIAN_MAX:.0%}: smaller "
            "differences in this grid are noise; profile again on an idle machine")))
    by_kind = noise.get("max_spread_frac_by_kind")
    if by_kind is None and noise["max_spread_frac"] > NOISE_POINT_MAX:  # measured before it was kept per kind
        found.append(Finding("warning", "noise", (
            f"one repeated value varied by {noise['max_spread_frac']:.0%} of its median over {noise['repeats']} "
            f"runs (> {NOISE_POINT_MAX:.0%}; the median was kept; the grid does not say of which kind): the "
            "machine was busy during the profile")))
    for k, spread in (by_kind or {}).items():
        if spread > NOISE_POINT_MAX:
            found.append(Finding("warning", "noise", (
                f"{k}: repeats of one value varied by {spread:.0%} of their median over {noise['repeats']} runs "
                f"(> {NOISE_POINT_MAX:.0%}; the median was kept): the machine was busy while {k} was measured, or a "
                f"point is erratic by nature (on a CPU, two processes time-sharing every core swing by orders "
                f"of magnitude from run to run)")))
    return found


def _flat(grid: SlowdownGrid) -> list[Finding]:
    if len(grid.sm_levels) < 2:
        return []
    low, top = grid.sm_levels[0], grid.mem_levels[-1]
    values = [v for v in (grid.alone(k, low, top) for k in grid.kinds) if math.isfinite(v)]
    if not values or max(abs(v - 1.0) for v in values) > FLAT_TOL:
        return []
    return [Finding("degenerate", "flat", (
        f"every kind alone at σ={low:g} (memory {top:g}) is within {FLAT_TOL:.0%} of its time on the whole "
        f"device ({min(values):.2f}-{max(values):.2f}): the measurement did not see the partition (cores or SMs "
        "not bound, or the whole device was as slow as a part because other jobs held it)"))]


def _pair_excess(grid: SlowdownGrid) -> list[Finding]:
    alone, pairs = _alone(grid), grid.to_dict()["pairs"]
    bad = []  # (ratio, a, b, σ index, mem index)
    for a, b in itertools.product(grid.kinds, repeat=2):
        ratio = np.array(pairs[a][b], dtype=float)[:-1] / alone[a][:-1]  # partitioned rows only
        bad += [(ratio[i, j], a, b, i, j) for i, j in zip(*np.nonzero(ratio > PAIR_EXCESS_MAX))]
    if not bad:
        return []
    ratio, a, b, i, j = max(bad)
    return [Finding("degenerate", "pair_excess", (
        f"{a} beside {b} at σ={grid.sm_levels[i]:g} mem={grid.mem_levels[j]:g} is {pairs[a][b][i][j]:.2f}, "
        f"{ratio:.1f}x its {alone[a][i, j]:.2f} alone on the same share: a partner on the other SMs (cores) "
        f"shares only memory bandwidth and caches, so more than {PAIR_EXCESS_MAX:g}x is other load "
        f"({_points(len(bad))})"))]


def _free_pack(grid: SlowdownGrid) -> list[Finding]:
    best = packing(grid)
    if not best or min(best.values()) < FREE_PACK:
        return []
    (a, b), worst = min(best.items(), key=lambda item: item[1])
    return [Finding("degenerate", "free_pack", (
        f"every pair of kinds packs at the theoretical 2.00, even the least packable, {a} + {b} ({worst:.2f}): "
        "two kinds on disjoint halves of the device cost each other nothing, so the grid does not see the "
        "partition"))]


def _points(n: int) -> str:
    return f"{n} point{'s' if n != 1 else ''}"
