"""Partitions: what a budget is on the device, computed by pure functions in the daemon.

    the node's running sub-stages on device d after a plan ─► layout: ((substage, σ), ...)
        ─► Partitioner.partitions(d, layout) ─► {substage: Advisory | Cpu | Green}
        ─► inside each Grant (msgspec tagged union) ─► the worker's bind() (bind.py)

    Advisory()                 budgets are told to the worker, nothing enforces them
    Cpu(cores, threads)        a core set of the device's cores and one thread per core
    Green(num_sms, budget, side, levels)   side `side` of the green-context pair of level
                               `budget` (1.0: the whole device), split as `levels` split it
    CpuPartitioner.host(d, pipeline, layout) ─► Cpu: where host work that computes (a code
                               tool run on this CPU) goes: the cores the layout leaves free

The scheduler has already decided who shares a device with whom and at which share; these
functions only turn shares into concrete partitions, so they never fail on a layout the
scheduler can produce and never touch a driver (the daemon imports neither torch nor CUDA).
The CPU partitioner remembers one thing, which cores each pipeline held, so equal halves
stay where they were.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import msgspec

from jigsaw.graph.ids import SubStageId

Layout = tuple[tuple[str, float], ...]
"""The on-device sub-stages of one device and their SM shares (σ; pairs sum to 1)."""


class Advisory(msgspec.Struct, tag="advisory", frozen=True, forbid_unknown_fields=True):
    """Nothing on the device enforces the budget (the grant's SM share is advice)."""


class Cpu(msgspec.Struct, tag="cpu", frozen=True, forbid_unknown_fields=True):
    """A CPU partition: the cores the sub-stage's processes may run on."""

    cores: tuple[int, ...]
    threads: int
    """Intra-op threads: one per core."""


class Green(msgspec.Struct, tag="green", frozen=True, forbid_unknown_fields=True):
    """A green-context partition: `GreenPartitions(device, levels).pair(budget)[side]`."""

    num_sms: int
    """SMs of this side, as split_sms rounds them (the worker checks what its driver gives)."""
    budget: float
    """The pair's level σ of this side; 1.0: the whole device, on an ordinary stream."""
    side: int
    """0, or 1 for the second of two equal halves."""
    levels: tuple[float, ...]
    """Every level the daemon partitions by (the worker opens the same splits)."""


Partition = Advisory | Cpu | Green


class Partitioner(Protocol):
    kind: str

    def partitions(self, device: int, layout: Layout) -> dict[str, Partition]:
        """The partition of each sub-stage of `layout` on `device`."""
        ...


class AdvisoryPartitioner:
    """Budgets stay advice (the default until a real partitioner is chosen)."""

    kind = "advisory"

    def partitions(self, device: int, layout: Layout) -> dict[str, Partition]:
        return {sid: Advisory() for sid, _ in layout}


class CpuPartitioner:
    """This machine's cores, split evenly among the daemon's devices; a pair (σ, 1-σ) gets
    disjoint core sets (at least one core each), one alone all of them, or only its share
    when its budget is a share σ < 1 (a static split: the other half stays the partner's).

    The one state it keeps is which cores each pipeline last held on a device: where two
    core sets fit a share equally (two halves), a pipeline keeps the one it had, so its
    threads do not hop between cores each time its partner starts or ends."""

    kind = "cpu"

    def __init__(self, num_devices: int = 1, cores: Sequence[int] | None = None):
        from jigsaw.mux.partition.cpu import usable_cores

        cores = tuple(cores if cores is not None else usable_cores())
        if num_devices < 1 or len(cores) < num_devices:
            raise ValueError(f"{len(cores)} cores cannot make {num_devices} CPU devices")
        per = len(cores) // num_devices
        self.devices = [cores[d * per:(d + 1) * per] for d in range(num_devices)]
        self.last: dict[tuple[int, str], tuple[int, ...]] = {}
        """(device, pipeline) -> the cores it was last given."""

    def partitions(self, device: int, layout: Layout) -> dict[str, Partition]:
        cores = self.devices[device]
        if len(layout) > 2:
            raise ValueError(f"device {device} holds {len(layout)} sub-stages; a partition holds at most 2")
        sides = self._sides(device, cores, layout)
        for sid, got in sides.items():
            self.last[(device, _owner(sid))] = got
        return {sid: Cpu(cores=got, threads=len(got)) for sid, got in sides.items()}

    def host(self, device: int, pipeline: str, layout: Layout) -> Cpu:
        """Where host work of `pipeline` that computes runs beside `layout`: on a CPU the device
        is the host, so its processes take the cores no sub-stage of the layout holds (the
        scheduler keeps them free: SchedulerConfig.host_on_device), else the cores the pipeline
        last held (shared with a holder: the scheduler paired past its share), else all."""
        cores = self.devices[device]
        try:
            held = {c for p in self.partitions(device, layout).values() if isinstance(p, Cpu) for c in p.cores}
        except ValueError:  # more than a pair: nothing is known to be free
            held = set(cores)
        free = tuple(c for c in cores if c not in held)
        got = free or self.last.get((device, pipeline)) or cores
        return Cpu(cores=got, threads=len(got))

    def _sides(self, device: int, cores: tuple[int, ...], layout: Layout) -> dict[str, tuple[int, ...]]:
        from jigsaw.mux.partition.cpu import split_cores

        fracs = [frac for _, frac in layout]
        if len(cores) < 2 or min(fracs, default=1.0) >= 1.0:
            return {sid: cores for sid, _ in layout}  # alone on the whole device, or unpartitioned
        if len(layout) == 1:
            (sid, frac), = layout
            mine, rest = split_cores(cores, frac)
            kept = self.last.get((device, _owner(sid)))
            return {sid: rest if kept == rest and len(rest) == len(mine) else mine}
        (a, frac), (b, _) = sorted(layout, key=lambda x: (-x[1], x[0]))
        mine, theirs = split_cores(cores, frac)
        if len(mine) == len(theirs) and (self.last.get((device, _owner(a))) == theirs
                                         or self.last.get((device, _owner(b))) == mine):
            mine, theirs = theirs, mine  # equal halves: each keeps the cores it had
        return {a: mine, b: theirs}


def _owner(sid: str) -> str:
    """The pipeline of a sub-stage id; a hand-made id (no pipeline/step/rRANK/kind/n) is its own."""
    parsed = SubStageId.try_parse(sid)
    return sid if parsed is None else parsed.pipeline


class GreenPartitioner:
    """Green-context pairs by smsplit's rounding of the device's SM resource (read once from
    the driver at start-up, or given)."""

    kind = "green"

    def __init__(self, levels: Sequence[float], resource=None, device: int = 0):
        from jigsaw.mux.partition.smsplit import budget_levels

        if resource is None:
            from jigsaw.mux.partition.green_probe import probe_resource

            resource = probe_resource(device)
        self.resource, self.levels = resource, budget_levels(levels)

    def partitions(self, device: int, layout: Layout) -> dict[str, Partition]:
        from jigsaw.mux.partition.smsplit import assign_sides, split_sms

        out: dict[str, Partition] = {}
        for sid, (level, side) in assign_sides(dict(layout), self.levels).items():
            # pair(σ)[side]: the σ side first; two halves are the split's first and second part
            sms = self.resource.num_sms if level >= 1.0 else split_sms(self.resource, level)[side]
            out[sid] = Green(num_sms=sms, budget=level, side=side, levels=self.levels)
        return out
