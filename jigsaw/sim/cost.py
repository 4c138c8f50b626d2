"""What a run costs: GPU-hours per RL step and dollars per million trained tokens.

    (devices held, seconds held, RL steps, tokens[, USD per GPU-hour]) ─► Cost
        gpu_hours            devices × seconds / 3600
        gpu_hours_per_step   gpu_hours / steps (every pipeline's steps together)
        usd_per_mtok         USD per GPU-hour × gpu_hours / (tokens / 10⁶), with a price only

A node's run holds all its devices for its makespan, whatever ran on them: that is what a user
pays for.  One pipeline's share of a shared node (the timeline's rows) is its share-weighted
device time (Σ share × seconds), so the pipelines' shares add up to what the node did.  The
tokens are the ones tokens/s counts (response tokens of the steps), so $/M tokens is the price
of the throughput the tables show.  `jigsaw sim`, `jigsaw advise` and the timeline's page all
price with `cost_of`.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, kw_only=True, slots=True)
class Cost:
    """What a run (or one pipeline's share of it) cost."""

    gpu_hours: float
    """Device-hours held (GPU-hours on a GPU node)."""
    gpu_hours_per_step: float
    """Device-hours per RL step; 0 where no step finished."""
    usd_per_mtok: float | None
    """US dollars per million tokens at the given price; None without a price or tokens."""

    def cells(self) -> tuple[str, str]:
        """The two table cells every table prints: GPU-h per step and $ per M tokens."""
        usd = "—" if self.usd_per_mtok is None else _dollars(self.usd_per_mtok)
        return f"{self.gpu_hours_per_step:.3g}", usd


def _dollars(x: float) -> str:
    return f"{x:,.2f}" if x >= 1.0 else f"{x:.3g}"  # cents and below keep three digits


def columns(device: str = "GPU") -> tuple[str, str]:
    """Headers of Cost.cells, the same in every table; `device` names what is held (a CPU
    trace never says GPU)."""
    return f"{device}-h/step", "$/M tok"


def cost_of(*, device_s: float, steps: int, tokens: int, usd_per_gpu_hour: float | None = None) -> Cost:
    """The cost of `device_s` device-seconds that did `steps` RL steps and `tokens` tokens."""
    if device_s < 0 or steps < 0 or tokens < 0:
        raise ValueError(f"cost_of needs non-negative device-seconds, steps and tokens, got {device_s}, {steps}, "
                         f"{tokens}")
    check_price(usd_per_gpu_hour)
    hours = device_s / 3600.0
    usd = None if usd_per_gpu_hour is None or tokens == 0 else usd_per_gpu_hour * hours / (tokens / 1e6)
    return Cost(gpu_hours=hours, gpu_hours_per_step=hours / steps if steps else 0.0, usd_per_mtok=usd)


def check_price(usd_per_gpu_hour: float | None) -> None:
    """A price, where given, is a positive number of dollars (a flag's value, checked before a long run)."""
    if usd_per_gpu_hour is not None and not usd_per_gpu_hour > 0:
        raise ValueError(f"--usd-per-gpu-hour must be > 0, got {usd_per_gpu_hour}")


__all__ = ["Cost", "check_price", "columns", "cost_of"]
