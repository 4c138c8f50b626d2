"""Where a verl job's workers sit on the jigsaw node: worker i is DP rank i mod the node's devices.

    verl, n GPUs per node:  rollout replica i and trainer rank i share GPU i (tensor parallel 1)
    jigsaw daemon, D devices:  DP rank r runs on device r
        ─► replica i's regimes are DP rank i % D's rollout sub-stages (serving.py)
        ─► a trainer stage is a gang: one sub-stage per DP rank, holding the trainer ranks placed
           there (trainer.py); the scheduler starts a gang whole, on all of its devices

With as many devices as replicas (one per GPU, or one per core on a CPU) every replica is a DP
worker of its own, and tails can move between them.  With fewer, replicas share a DP rank: the
daemon then sees their regimes as one worker's pieces, one after the other.
"""

from __future__ import annotations

from collections.abc import Sequence

STATUS_TIMEOUT_S = 2.0


def node_devices(client) -> int:
    """The DP ranks the job's grants come for: its daemon's device count (1 when there is no
    daemon: the job runs unscheduled); placed across nodes (an Across), every node's devices,
    rank r on the node of the r-th (runtime/across.py)."""
    from jigsaw.runtime.across import Across
    from jigsaw.runtime.client import status

    if isinstance(client, Across):
        return client.devices
    if client.endpoint and (st := status(client.endpoint, STATUS_TIMEOUT_S)) is not None and st.devices:
        return int(st.devices)
    return 1


def dp_rank(worker: int, devices: int) -> int:
    return worker % max(1, devices)


def gang_members(pids: Sequence[int], devices: int) -> list[tuple[int, tuple[int, ...]]]:
    """(DP rank, the processes of the workers placed there) for worker i = pids[i]."""
    ranks: dict[int, list[int]] = {}
    for i, pid in enumerate(pids):
        ranks.setdefault(dp_rank(i, devices), []).append(pid)
    return [(rank, tuple(ps)) for rank, ps in sorted(ranks.items())]
