"""SM partitions of one GPU with CUDA green contexts (the device side of an SM budget σ).

    probe(device) ─► GreenSupport (green_probe.py): the driver, the SM resource, the backend
         │
    smsplit.split_sms(resource, σ) ─► (SMs for σ, SMs for 1-σ)   pure rounding (smsplit.py)
         │
    GreenPartitions(device, fracs): ONE split per budget pair {σ, 1-σ} ─► two green contexts,
         │   one non-blocking stream each (torch.cuda.ExternalStream), opened by a backend
         │   (green_backends.py: cuda-python or torch.cuda.green_contexts)
         ├─ pair(σ) ─► (Partition σ, Partition 1-σ)   pair(1-σ) is the same two, swapped
         └─ full    ─► Partition 1.0 on an ordinary stream (the whole device)
    the daemon's descriptor (partitioners.Green) is computed by partitioners.py; a worker
    binds it with bind.py, which opens GreenPartitions in the worker's own process

Disjointness comes from the split, not from the counts: results of ONE split are disjoint,
results of two splits of the device may overlap (torch 2.15 `SMPartition.split` docstring).
So both sides of a pair come from one split, and σ and 1-σ share that split: whichever two
budgets the scheduler co-locates, (σ, 1-σ), run on disjoint SMs.

The backends only supply primitives (split the device into two SM resources, open a context
plus stream on one, close it); rounding, pairing and bookkeeping live here once, the error
mapping in green_probe.py.  Nothing imports torch or cuda-python at module level.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Self

from jigsaw.mux.partition import green_probe
from jigsaw.mux.partition.green_backends import _DriverBackend, _run_all, _TorchBackend
from jigsaw.mux.partition.green_probe import GreenContextError, GreenSupport, log, probe
from jigsaw.mux.partition.smsplit import FRAC_TOL, PARTITION_LEVELS, budget_levels, match_level, pair_key, split_sms


@dataclass(frozen=True, kw_only=True, slots=True)
class Partition:
    """One side of a budget pair: its SMs and the stream whose work runs only on them."""

    frac: float
    """The SM budget this side serves (σ, 1-σ, or 1.0 for the whole device)."""
    num_sms: int
    """SMs the driver gave the context (the ordinary stream of `full`: all of them)."""
    stream: Any
    """torch.cuda.Stream (an ExternalStream for green sides); invalid after close()."""


class GreenPartitions:
    """Disjoint green-context pairs for the budget levels of one device, plus the whole device.

    Use as a context manager, or call close(): streams and contexts are destroyed there and
    every Partition's stream is invalid afterwards (close graphs that use them first).
    Not thread-safe; one per process and device (green contexts do not cross processes).
    """

    def __init__(self, device: int = 0, fracs: Sequence[float] = PARTITION_LEVELS):
        self._levels = budget_levels(fracs)
        self._support = probe(device)
        self._torch = green_probe._import_torch()
        self._backend = _make_backend(self._torch, self._support)
        self._sides: list = []
        self._pairs: dict[float, tuple[Partition, Partition]] = {}
        self._full: Partition | None = None
        self._closed = False
        try:
            self._open_all(device)
        except BaseException:
            with contextlib.suppress(GreenContextError):  # the first error is the one to report
                self.close()
            raise

    def _open_all(self, device: int) -> None:
        torch, n = self._torch, self._support.resource.num_sms
        with torch.cuda.device(device):
            torch.cuda.synchronize()  # primary context first: cuGreenCtxCreate advises it
            for key in sorted({pair_key(level) for level in self._levels}):
                self._pairs[key] = self._open_pair(key)
            self._full = Partition(frac=1.0, num_sms=n, stream=torch.cuda.Stream(device=device))

    def _open_pair(self, frac: float) -> tuple[Partition, Partition]:
        resource = self._support.resource
        try:
            counts = split_sms(resource, frac)
        except ValueError as exc:
            raise GreenContextError(str(exc), cause="insufficient-sms") from exc
        resources = self._backend.split(counts)
        for res in resources:
            self._sides.append(self._backend.open(res))
        a, b = self._sides[-2:]
        if a.num_sms + b.num_sms > resource.num_sms or min(a.num_sms, b.num_sms) < 1:
            raise GreenContextError(f"split {counts} came back as {a.num_sms} + {b.num_sms} SMs of "
                                    f"{resource.num_sms}: not two disjoint partitions", cause="driver-error")
        if (a.num_sms, b.num_sms) != counts:
            log.info("budget %g: asked for %s SMs, the driver gave (%d, %d)", frac, counts, a.num_sms, b.num_sms)
        return (Partition(frac=frac, num_sms=a.num_sms, stream=a.stream),
                Partition(frac=round(1.0 - frac, 12), num_sms=b.num_sms, stream=b.stream))

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def fracs(self) -> tuple[float, ...]:
        """Budget levels held, closed under complement: (0.25,) holds 0.25 and 0.75."""
        return self._levels

    @property
    def support(self) -> GreenSupport:
        return self._support

    @property
    def full(self) -> Partition:
        """The whole device on an ordinary stream (budget 1.0)."""
        self._alive()
        if self._full is None:
            raise RuntimeError("GreenPartitions has no full-device partition (construction failed)")
        return self._full

    def pair(self, frac: float) -> tuple[Partition, Partition]:
        """(the σ side, the 1-σ side); pair(1-σ) is the same two partitions swapped."""
        self._alive()
        level = match_level(frac, self._levels)
        if level is None:
            raise ValueError(f"no partition pair for budget {frac!r}; this device holds {self._levels}")
        first, second = self._pairs[pair_key(level)]
        return (first, second) if level <= 0.5 + FRAC_TOL else (second, first)

    def by_budget(self) -> dict[float, Partition]:
        """{σ: pair(σ)[0]} for every level plus {1.0: full}; the 0.5 partner is pair(0.5)[1]."""
        return {level: self.pair(level)[0] for level in self._levels} | {1.0: self.full}

    def close(self) -> None:
        """Drain and destroy every stream and context (idempotent); raise the first failure."""
        if self._closed:
            return
        self._closed = True
        sides, self._sides, self._pairs, self._full = self._sides, [], {}, None
        _run_all([functools.partial(self._backend.close, side) for side in reversed(sides)])

    def _alive(self) -> None:
        if self._closed:
            raise RuntimeError("GreenPartitions is closed")


def _make_backend(torch: Any, support: GreenSupport):
    if support.backend == "torch":
        return _TorchBackend(torch, support)
    return _DriverBackend(torch, green_probe._import_driver(), support)
