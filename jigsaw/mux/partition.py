"""Partitioner protocol: the scheduler's budgets → partitions a worker can bind to.

    Plan.assignments of one device ─► Partitioner.apply(device, {substage: sm_frac})
                                   ─► {substage: descriptor}  (sent inside each Grant)

The GPU partitioner (green contexts, `mux/green.py`) and the CPU one (core sets and
thread counts, `mux/cpu.py`) implement it in their own issues.  `NullPartitioner` keeps
budgets advisory: the daemon schedules and the workers see their SM share, but nothing
on the device enforces it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol


class Partitioner(Protocol):
    def apply(self, device: int, budgets: Mapping[str, float]) -> Mapping[str, dict[str, str]]:
        """Partition `device` so each sub-stage gets its SM share; describe each part."""
        ...


class NullPartitioner:
    """Advisory budgets: no device-side enforcement (the default until a real one is set)."""

    def apply(self, device: int, budgets: Mapping[str, float]) -> Mapping[str, dict[str, str]]:
        return {sid: {"kind": "advisory", "sm_frac": f"{frac:g}"} for sid, frac in budgets.items()}
