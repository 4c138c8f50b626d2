"""CPU partitions, the CPU analogue of green contexts: which shares a core split can give.

    cpu_levels(n)          the SM levels a CPU grid can hold: the shares a split of n cores
                           really gives (k/n), so the scheduler never plans a budget the machine
                           cannot enforce
    split_cores(cores, σ)  disjoint core sets for σ and 1-σ, at least one core each
        ─► partitioners.CpuPartitioner (the daemon's descriptors) ─► bind.Binder (the worker's pin)
"""

from __future__ import annotations

import os
from collections.abc import Sequence

MAX_LEVELS = 3
"""Partition levels below 1.0 a grid carries (like 25/50/75% on a GPU)."""


def usable_cores() -> tuple[int, ...]:
    return tuple(sorted(os.sched_getaffinity(0)))


def cpu_levels(num_cores: int) -> tuple[float, ...]:
    """Shares a split of `num_cores` can give (k/n), at most MAX_LEVELS below 1.0, plus 1.0.
    One core cannot be split: two sub-stages on it time-share it, a fair half each (0.5)."""
    if num_cores == 1:
        return (0.5, 1.0)
    shares = sorted({round(k / num_cores, 4) for k in range(1, num_cores)})
    if len(shares) > MAX_LEVELS:  # keep the levels spread: first, middle, last
        shares = [shares[0], shares[len(shares) // 2], shares[-1]]
    return (*shares, 1.0)


def split_cores(cores: Sequence[int], frac: float) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Disjoint core sets for a share `frac` and its complement, one core at least each."""
    if not 0.0 < frac < 1.0:
        raise ValueError(f"a split share must be in (0, 1), got {frac}")
    if len(cores) < 2:
        raise ValueError(f"cannot split {len(cores)} core(s) into two partitions")
    k = min(max(round(frac * len(cores)), 1), len(cores) - 1)
    return tuple(cores[:k]), tuple(cores[k:])
