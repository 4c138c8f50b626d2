"""How long a live rollout tail still runs: mean residual life of response lengths.

    finished requests' turn lengths (observed, past steps) ─► ResidualLength.observe()
    live tail: tokens generated so far by each active request
        ─► steps_left(generated) = E[max over requests of (L − g | L > g)]

A tail ends when its last request does.  Its prediction from the previous step says how
long tails usually last; once a tail has outlived that, "predicted − elapsed" says it
is about to end, which is the wrong guess for long-tailed lengths: the longer a request
has run, the longer it is expected to keep running.  The engine knows what each active
request has generated, and finished requests show the length distribution, so the
conditional expectation costs a binary search.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

import numpy as np


class ResidualLength:
    """Empirical turn-length distribution of one pipeline, over its most recent steps."""

    def __init__(self, *, max_tokens: int, window_steps: int = 4):
        self.max_tokens = max_tokens
        self._steps: deque[np.ndarray] = deque(maxlen=window_steps)
        self._sorted = np.empty(0)
        self._suffix = np.zeros(1)

    def observe(self, turn_lengths: Iterable[int]) -> None:
        """Add one step's finished turns (generated tokens per turn)."""
        self._steps.append(np.asarray(list(turn_lengths), dtype=float))
        self._sorted = np.sort(np.concatenate(list(self._steps)))
        # suffix[i] = sum of sorted[i:], so the mean of lengths above g is one lookup.
        self._suffix = np.concatenate([np.cumsum(self._sorted[::-1])[::-1], [0.0]])

    @property
    def known(self) -> bool:
        return self._sorted.size > 0

    def residual(self, generated: float) -> float:
        """E[L − g | L > g]; past every observed length, half the way to the cap."""
        i = int(np.searchsorted(self._sorted, generated, side="right"))
        n = self._sorted.size - i
        if n == 0:
            return max(1.0, (self.max_tokens - generated) / 2)
        return self._suffix[i] / n - generated

    def steps_left(self, generated: Iterable[float], grid_points: int = 128) -> float:
        """Expected decode steps until the last of these requests ends its turn:
        E[max_i R_i] = ∫ 1 − Π_i P(R_i ≤ x) dx over x in [0, cap], the residuals R_i
        independent (the max of the expectations would say a batch ends with its
        typical request, which underestimates a tail by about half)."""
        g = np.fromiter(generated, dtype=float)
        if g.size == 0:
            return 0.0
        xs = np.linspace(0.0, float(self.max_tokens), grid_points)
        n = self._sorted.size
        over = n - np.searchsorted(self._sorted, g, side="right")  # observed lengths above each g
        beyond = n - np.searchsorted(self._sorted, g[:, None] + xs[None, :], side="right")
        # P(R_i <= x) per request (rows); past every observed length: uniform up to the cap.
        cdf = np.where(over[:, None] > 0, 1.0 - beyond / np.maximum(over, 1)[:, None],
                       np.clip(xs[None, :] / np.maximum(1.0, self.max_tokens - g)[:, None], 0.0, 1.0))
        above = 1.0 - np.prod(cdf, axis=0)
        return float(np.sum((above[1:] + above[:-1]) * 0.5 * np.diff(xs)))
