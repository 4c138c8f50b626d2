"""SM counts of green-context partitions: the pure half of the GPU side (no driver, no torch).

    SmResource (SMs, partition granularity) ─► split_sms(σ) ─► (SMs for σ, SMs for 1-σ)
    budget_levels(fracs) ─► the levels a device holds, closed under σ → 1-σ
    assign_sides({substage: σ}) ─► {substage: (level, side)}: which side of which pair

The daemon computes partition descriptors with these (partitioners.py), and a worker opens the
same split in its own process (green.py), so both sides of a pair agree on the SM counts.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from jigsaw.mux.model.slowdown import DEFAULT_SM_LEVELS

FRAC_TOL = 1e-9
"""Budgets within this of a level are that level (1 - 0.8 is 0.19999999999999996)."""
PARTITION_LEVELS = tuple(x for x in DEFAULT_SM_LEVELS if x < 1.0)
"""The grid format's default SM levels below the whole device."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SmResource:
    """The SMs of one device and the partition sizes its driver accepts."""

    num_sms: int
    """Streaming multiprocessors on the device."""
    min_partition_sms: int
    """Smallest green-context partition, in SMs."""
    alignment_sms: int
    """A partition's SM count must be a multiple of this."""

    def __post_init__(self) -> None:
        for name in ("num_sms", "min_partition_sms", "alignment_sms"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"SmResource.{name} must be a positive int, got {value!r}")

    @property
    def smallest_sms(self) -> int:
        """The smallest valid partition: min_partition_sms rounded up to the alignment."""
        return -(-self.min_partition_sms // self.alignment_sms) * self.alignment_sms


def granularity(compute_capability: tuple[int, int]) -> tuple[int, int]:
    """(min_partition_sms, alignment_sms) of cuDevSmResourceSplitByCount by compute capability.

        CC 6.x   (1, 1)      CC 8.x   (4, 2)
        CC 7.x   (2, 2)      CC 9.0+  (8, 8)   Hopper, Blackwell

    Driver docs 12.4 / 13.0; flashinfer `get_sm_count_constraint` and sglang pdmux hard-code
    the same table.  Drivers >= 13.0 also report both numbers, and `probe` prefers those.
    """
    major, minor = compute_capability
    if major < 6:
        raise ValueError(f"green contexts need compute capability >= 6.0, got {major}.{minor}")
    if major >= 9:
        return (8, 8)
    return {6: (1, 1), 7: (2, 2), 8: (4, 2)}[major]


def split_sms(resource: SmResource, frac: float) -> tuple[int, int]:
    """SMs for share `frac` and for its complement: two valid, disjoint partitions.

    Rounding rule (mirror-symmetric: split_sms(r, 1-σ) is split_sms(r, σ) swapped):
      1. the smaller share s = min(σ, 1-σ) gets the valid count nearest to s * num_sms that
         still leaves room for a valid complement; an exact tie takes the larger count (the
         smaller side loses a bigger fraction of its throughput per missing SM);
      2. the other share gets the largest valid count that fits in what is left;
      3. the leftover (num_sms minus both, always < alignment_sms) goes to neither side.
    At σ = 0.5 the requested side plays the smaller one.

        Hopper 132 SMs (8, 8):  0.25 -> (32, 96)  0.5 -> (64, 64)  0.75 -> (96, 32)  4 unused
        A100   108 SMs (4, 2):  0.25 -> (28, 80)  0.5 -> (54, 54)  0.75 -> (80, 28)
    """
    if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0.0 < frac < 1.0:
        raise ValueError(f"frac must be a number strictly between 0 and 1, got {frac!r}")
    n, step, lo = resource.num_sms, resource.alignment_sms, resource.smallest_sms
    if n - lo < lo:
        raise ValueError(
            f"a device with {n} SMs cannot hold two green-context partitions: each needs at "
            f"least {resource.min_partition_sms} SMs in multiples of {step} ({2 * lo} in all)")
    target = min(frac, 1.0 - frac) * n
    # NOTE: round() absorbs float noise (0.3 * 10 = 3.0000000000000004) so ties stay ties.
    small = min(range(lo, n - lo + 1, step), key=lambda c: (round(abs(c - target), 9), -c))
    other = (n - small) // step * step
    return (small, other) if frac <= 0.5 else (other, small)


def budget_grid(resource: SmResource, fracs: Sequence[float] = PARTITION_LEVELS) -> dict[float, tuple[int, int]]:
    """split_sms for each budget level: {σ: (SMs for σ, SMs for 1-σ)}."""
    return {frac: split_sms(resource, frac) for frac in fracs}


def budget_levels(fracs: Sequence[float]) -> tuple[float, ...]:
    """The budget levels `fracs` allow, closed under complement (σ held means 1-σ is too)."""
    out: list[float] = []
    for frac in fracs:
        if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not 0.0 < frac < 1.0:
            raise ValueError(f"partition budgets must lie strictly between 0 and 1, got {frac!r}")
        for level in (float(frac), round(1.0 - frac, 12)):
            if match_level(level, out) is None:
                out.append(level)
    return tuple(sorted(out))


def match_level(frac: float, levels: Sequence[float]) -> float | None:
    return next((level for level in levels if abs(level - frac) <= FRAC_TOL), None)


def pair_key(level: float) -> float:
    """The split that serves `level`: σ and 1-σ share one, keyed by the smaller share."""
    return min(level, round(1.0 - level, 12))


def assign_sides(budgets: Mapping[str, float], levels: Sequence[float]) -> dict[str, tuple[float, int]]:
    """{substage: (budget level, side)} for one device's budgets; ValueError if not a layout.

    A layout is a pair (σ, 1-σ) of levels, one budget alone (1.0, or a level σ < 1: a task
    keeps its side when its partner ends first), or nothing; 0.0 is host work (level 0.0).
    `side` indexes pair(level): 0, except the second of two 0.5 budgets (by substage id).
    """
    on_device: list[tuple[float, str]] = []
    out: dict[str, tuple[float, int]] = {}
    for sid, frac in budgets.items():
        if isinstance(frac, bool) or not isinstance(frac, (int, float)) or not -FRAC_TOL <= frac <= 1 + FRAC_TOL:
            raise ValueError(f"{sid}: SM budget must lie in [0, 1], got {frac!r}")
        if frac <= FRAC_TOL:
            out[sid] = (0.0, 0)
        else:
            on_device.append((float(frac), sid))
    on_device.sort()
    layout = ", ".join(f"{sid}={frac:g}" for frac, sid in on_device)
    if len(on_device) > 2 or (len(on_device) == 2 and abs(on_device[0][0] + on_device[1][0] - 1.0) > FRAC_TOL):
        raise ValueError(f"budgets {{{layout}}} are not a pair (σ, 1-σ) of the levels {tuple(levels)} or one "
                         "budget alone")
    sides = {}
    for frac, sid in on_device:
        level = 1.0 if frac >= 1.0 - FRAC_TOL and len(on_device) == 1 else match_level(frac, levels)
        if level is None:
            raise ValueError(f"{sid}: budget {frac:g} (in {{{layout}}}) is not a level {tuple(levels)} "
                             "or 1.0 alone")
        sides[level] = sides.get(level, -1) + 1
        out[sid] = (level, sides[level])
    return out
