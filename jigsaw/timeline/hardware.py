"""What a trace's devices are, for labels: GPUs (SM share) or CPU cores (core share).

    node data "partitioner" == "cpu"  ┐
    grant data "partition" kind "cpu" ├─► Hardware(device="CPU", share="core share", cores)
    a device sku starting with "CPU"  ┘      (cores: the sku's "-<n>c", else the partitions' cores)
    none of these (the simulator)       ─► GPU: Hardware(device="GPU", share="SM share")
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from jigsaw.trace import Trace


@dataclass(frozen=True, slots=True)
class Hardware:
    """What the devices are, for labels: GPUs split by SM share, or CPUs split by cores."""

    device: str = "GPU"
    """'GPU' or 'CPU': rows read 'GPU 0'."""
    share: str = "SM share"
    """What a grant's sm_frac is a share of."""
    cores: int | None = None
    """Cores of one CPU device, when the trace says."""

    def count(self, n: int) -> str:
        """'2 GPUs', '1 CPU (2 cores)'."""
        cores = f" ({self.cores} cores{' each' if n != 1 else ''})" if self.cores else ""
        return f"{n} {self.device}{'' if n == 1 else 's'}{cores}"


GPU = Hardware()


def hardware(trace: Trace) -> Hardware:
    """CPU when the daemon's partitioner is "cpu", a grant holds a "cpu" partition, or a device
    sku (node or pipeline data "device") starts with "CPU"; GPU otherwise (the simulator)."""
    cpu, cores, skus = False, set(), []
    for e in trace.events:
        data = e.data if isinstance(e.data, dict) else {}
        part = data.get("partition")
        if e.event == "node":
            cpu |= data.get("partitioner") == "cpu"
            skus.append(_sku(data))
        elif e.event == "pipeline":
            skus.append(data.get("device"))
        elif e.event == "grant" and isinstance(part, dict) and part.get("kind") == "cpu":
            cpu = True
            listed = part.get("cores")
            cores |= {c for c in listed if isinstance(c, int)} if isinstance(listed, list) else set()
    named = [s for s in skus if isinstance(s, str) and s.upper().startswith("CPU")]
    if not (cpu or named):
        return GPU
    sized = [int(m.group(1)) for s in named if (m := re.search(r"-(\d+)c$", s))]
    return Hardware(device="CPU", share="core share", cores=max(sized, default=len(cores) or None))


def _sku(node: dict):
    """The node's device sku: data "device", or the grid's ("grid": {"device": {"sku": ...}})."""
    grid = node.get("grid")
    device = grid.get("device") if isinstance(grid, dict) else node.get("device")
    return device.get("sku") if isinstance(device, dict) else device
