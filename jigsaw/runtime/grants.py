"""From a Decision to the Grants a daemon sends: budgets, partitions, routing, migrations.

    Decision (node/effects.py) ─► layouts of the touched devices (its holders after the plan)
        ─► Partitioner.partitions(device, layout)  (mux/partition/partitioners.py)
    ─► one Grant per admission (the answer to its Admit) and per budget change (heartbeat);
       a migration's source gets one with no budget and the order (its requests go elsewhere)
    host work that computes (Held.computes, a code tool run on this CPU), under a partitioner
       that places it (CpuPartitioner.host): a partition of the cores its device's holders
       leave free, at admission and, while it runs, whenever that changes

A partitioner that cannot express a layout leaves that device's budgets advisory: the node
keeps scheduling and the worker is told so.  Nothing here reads the node state: the
Decision says everything.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from jigsaw import protocol as pr
from jigsaw.mux.partition.partitioners import (
    Advisory,
    AdvisoryPartitioner,
    Cpu,
    CpuPartitioner,
    Green,
    GreenPartitioner,
    Partition,
)
from jigsaw.node.effects import Decision, Held

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
    hosts: tuple[tuple[Held, pr.Grant], ...] = ()
    """Every running host sub-stage that computes, not admitted by this decision, with its
    partition now (the session sends it only if it differs from what the worker holds)."""


def make(d: Decision, parts_by) -> Made:
    """Grants for the decision's admissions, budget changes and migration sources."""
    routing = d.routing
    orders = {name: tuple(pr.MigrationOrder(source=m.source, target=m.target, source_rank=m.source_rank,
                                            target_rank=m.target_rank) for m in ms)
              for name, ms in d.orders.items()}
    parts = partitions(d, parts_by)
    parts.update(host_partitions(d, parts_by))

    def grant(h: Held, req: int = 0) -> pr.Grant:
        return pr.Grant(substage=h.sid, device=h.device, sm_frac=h.budget.sm_frac if h.on_device else 0.0,
                        mem_bytes=h.mem_bytes, micro_batch=h.micro_batch, routing=routing.get(h.pipeline),
                        migrations=orders.get(h.pipeline, ()), partition=parts.get(h.sid), req=req)

    return Made(admitted=tuple(grant(x.held, x.held.owner.req if x.held.owner else 0) for x in d.admitted),
                changed=tuple(grant(h) for h in d.changed),
                moved=tuple(pr.Grant(substage=h.sid, device=h.device, sm_frac=0.0, mem_bytes=0,
                                     migrations=orders.get(h.pipeline, ())) for h in d.moved),
                hosts=tuple((h, grant(h)) for h in d.holders if h.sid in parts and not h.on_device
                            and h.sid not in {x.sid for x in d.admitted}))


def partitions(d: Decision, parts_by) -> dict[str, Partition]:
    """Partition of every sub-stage holding a touched device after the decision."""
    out: dict[str, Partition] = {}
    for device, holders in d.layout(d.touched).items():
        layout = tuple(sorted((h.sid, h.budget.sm_frac) for h in holders))
        try:
            out.update(parts_by.partitions(device, layout))
        except ValueError as exc:  # e.g. more than a pair on a device: advisory rather than stopping
            log.warning("device %d: %s; budgets there are advisory", device, exc)
            out.update({sid: Advisory() for sid, _ in layout})
    return out


def host_partitions(d: Decision, parts_by) -> dict[str, Partition]:
    """Partition of every running host sub-stage that computes, where the partitioner places
    host work (a CPU's cores); none elsewhere (a GPU's host is not its device)."""
    place = getattr(parts_by, "host", None)
    computing = [h for h in d.holders if h.computes and not h.on_device]
    if place is None or not computing:
        return {}
    layouts = d.layout({h.device for h in computing})
    return {h.sid: place(h.device, h.pipeline, tuple(sorted((x.sid, x.budget.sm_frac) for x in layouts[h.device])))
            for h in computing}


def describe(part: Partition) -> dict:
    """A partition as trace data."""
    if isinstance(part, Cpu):
        return {"kind": "cpu", "cores": list(part.cores), "threads": part.threads}
    if isinstance(part, Green):
        return {"kind": "green", "num_sms": part.num_sms, "budget": part.budget, "side": part.side}
    return {"kind": "advisory"}
