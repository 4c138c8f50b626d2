"""What the scheduler needs from a slowdown model: the seam between graph/ and mux/, typed.

    mux.model.slowdown.SlowdownGrid ──is a──► SlowdownModel   (the node's grid: a profile or a prior)
    mux.model.pairing.PairView      ──is a──► PairPricing     (two different models side by side)
    mux.model.pairing.PairGrids     ──is a──► PairModels      (a node whose pipelines run several)
        └─► View.model / View.pairs (policy.py), schedule(), Context (context.py), NodeState

graph/ never imports mux/: it states here what it calls, and mux's classes provide it
(tests/unit/test_seams.py checks they do).  Kinds are `SubStageKind` values.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class DeviceSpec(Protocol):
    """The device a model describes (mux.model.slowdown.DeviceInfo)."""

    sku: str
    mem_bytes: int
    peak_flops: float


@runtime_checkable
class PairPricing(Protocol):
    """Slowdowns of sub-stage kinds alone and side by side on one device."""

    kinds: tuple[str, ...]
    sm_levels: tuple[float, ...]
    """SM shares a sub-stage may hold (1.0: every SM, alone or unpartitioned)."""
    mem_levels: tuple[float, ...]
    """Memory shares a sub-stage may hold."""

    def alone(self, kind: str, sm_frac: float, mem_frac: float, *, need_frac: float | None = None) -> float:
        """Slowdown of `kind` alone with this share of the SMs and memory; with its memory need
        (over the device's), whether it fits is decided by the need, not by the grid's levels."""
        ...

    def pair(self, kind_a: str, kind_b: str, sm_frac_a: float, mem_frac_a: float, *,
             need_frac_a: float | None = None, need_frac_b: float | None = None) -> tuple[float, float] | None:
        """(s_a, s_b) with B holding the complement (σ = 1.0: both share every SM); None when
        either side does not fit its memory (by its need, where given)."""
        ...

    def pair_options(self, kind_a: str, kind_b: str) -> tuple[tuple[float, float, float, float], ...]:
        """Every partitioned point where both fit, as (σ_a, m_a, s_a, s_b)."""
        ...

    def actual(self, *units: tuple) -> tuple[float, ...] | None:
        """Slowdowns of what really shares a device: one (kind, σ, m) alone, or two; a unit may
        carry a 4th element, its memory need over the device's (None: unknown)."""
        ...


@runtime_checkable
class SlowdownModel(PairPricing, Protocol):
    """A node's slowdown grid: every pair of kinds priced, and the device it describes."""

    device: DeviceSpec

    def shared(self, kind_a: str, kind_b: str, mem_frac_a: float, *, need_frac_a: float | None = None,
               need_frac_b: float | None = None) -> tuple[float, float] | None:
        """(s_a, s_b) sharing every SM unpartitioned (as under MPS), A holding `mem_frac_a`."""
        ...


@runtime_checkable
class PairModels(Protocol):
    """Per ordered pair of a node's pipelines, how the two slow each other as deployed."""

    def between(self, a: str, b: str) -> PairPricing:
        """Pipeline a's kinds (first axis) beside pipeline b's."""
        ...

    def deployment_class(self, name: str) -> int | None:
        """Pipelines of one class run one deployment (the same view); None: unknown here."""
        ...
