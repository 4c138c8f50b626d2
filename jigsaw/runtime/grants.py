"""From a Decision to the Grants a daemon sends: budgets, partitions, routing, migrations.

    Decision (graph/node.py) ─► devices whose occupants changed ─► their layouts, from the
        node state after the plan ─► Partitioner.partitions(device, layout)  (mux/partition/partitioners.py)
    ─► one Grant per admission (the answer to its Admit) and per budget change (heartbeat);
       a migration's source gets one with no budget and the order (its requests go elsewhere)

A partitioner that cannot express a layout leaves that device's budgets advisory: the node
keeps scheduling and the worker is told so.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from jigsaw.graph.ids import SubStageId
from jigsaw.graph.node import Decision, NodeState
from jigsaw.graph.plan import Assignment
from jigsaw.mux.partition.partitioners import (
    Advisory,
    AdvisoryPartitioner,
    Cpu,
    CpuPartitioner,
    Green,
    GreenPartitioner,
    Partition,
)
from jigsaw.runtime import protocol as pr

log = logging.getLogger("jigsaw.daemon")


def partitioner(kind: str, num_devices: int, levels: Sequence[float]):
    """The daemon's partitioner; a GPU one that cannot start here leaves budgets advisory."""
    if kind == "advisory":
        return AdvisoryPartitioner()
    if kind == "cpu":
        return CpuPartitioner(num_devices)
    if kind == "green":
        from jigsaw.mux.partition.green_probe import GreenContextError

        try:
            return GreenPartitioner(levels)
        except GreenContextError as exc:
            log.warning("green partitioner unavailable (%s); budgets stay advisory", exc)
            return AdvisoryPartitioner()
    raise ValueError(f"unknown partitioner {kind!r}; use advisory, green or cpu")


@dataclass(frozen=True, slots=True)
class Made:
    admitted: tuple[pr.Grant, ...]
    """In the order of Decision.admitted."""
    changed: tuple[pr.Grant, ...]
    """In the order of Decision.changed."""
    moved: tuple[pr.Grant, ...] = ()
    """In the order of Decision.moved: no budget left, and the migration orders."""


def make(d: Decision, state: NodeState, parts_by) -> Made:
    """Grants for the decision's admissions and budget changes."""
    routing = {r.pipeline: r.weights for r in d.plan.routing}
    orders: dict[str, list[pr.MigrationOrder]] = {}
    for m in d.plan.migrations:
        orders.setdefault(m.pipeline, []).append(pr.MigrationOrder(source=m.source, target=m.target,
                                                                   source_rank=m.source_rank,
                                                                   target_rank=m.target_rank))
    touched = {a.device for a in (*(x.assignment for x in d.admitted if x.running.on_device),
                                  *(a for _, a in d.changed))}
    parts = partitions(state, touched, parts_by)

    def grant(a: Assignment, req: int = 0) -> pr.Grant:
        return pr.Grant(substage=a.substage, device=a.device, sm_frac=a.sm_frac, mem_bytes=a.mem_bytes,
                        micro_batch=a.micro_batch, routing=routing.get(a.pipeline),
                        migrations=tuple(orders.get(a.pipeline, ())), partition=parts.get(a.substage), req=req)

    return Made(admitted=tuple(grant(x.assignment, x.waiting.owner.req if x.waiting.owner else 0)
                               for x in d.admitted),
                changed=tuple(grant(a) for _, a in d.changed),
                moved=tuple(pr.Grant(substage=r.sid, device=r.device, sm_frac=0.0, mem_bytes=0,
                                     migrations=tuple(orders.get(SubStageId.parse(r.sid).pipeline, ())))
                      for r in d.moved))


def partitions(state: NodeState, devices: set[int], parts_by) -> dict[str, Partition]:
    """Partition of every sub-stage running on `devices`, from the node state's layout."""
    layouts: dict[int, list[tuple[str, float]]] = {d: [] for d in devices}
    for p in state.pipelines.values():
        for r in p.running.values():
            if r.on_device and r.device in layouts:
                layouts[r.device].append((r.sid, r.budget.sm_frac))
    out: dict[str, Partition] = {}
    for device, layout in layouts.items():
        try:
            out.update(parts_by.partitions(device, tuple(sorted(layout))))
        except ValueError as exc:  # e.g. more than a pair on a device: advisory rather than stopping
            log.warning("device %d: %s; budgets there are advisory", device, exc)
            out.update({sid: Advisory() for sid, _ in layout})
    return out


def describe(part: Partition) -> dict:
    """A partition as trace data."""
    if isinstance(part, Cpu):
        return {"kind": "cpu", "cores": list(part.cores), "threads": part.threads}
    if isinstance(part, Green):
        return {"kind": "green", "num_sms": part.num_sms, "budget": part.budget, "side": part.side}
    return {"kind": "advisory"}
