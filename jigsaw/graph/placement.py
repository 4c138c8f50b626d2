"""Where k pipelines go on a node of n scheduling devices: the shapes the policies place by.

    colocated      every pipeline on every device              jigsaw's default, serial, muxserve
    paired         two pipelines on each equal group of devices                            static
    split          each pipeline alone on its own equal group     two jobs on one node, unshared
    disaggregated  rollouts on the first half, reference and training on the second      rollmux
    shared-pool    each pipeline its own rollout devices, one training pool for all         hrrs
    crossed        rollouts and trainings on opposite halves, every other pipeline swapped
                   (asynchronous pipelines: one's training beside the other's rollout, §5.3)

A placement is one (rollout devices, training devices) pair per pipeline, devices in DP rank
order.  Each shape is a pure function of (k, n); one that cannot hold k pipelines on n devices
raises ValueError saying why.  A baseline's shape is part of what it is; jigsaw runs on any
(`Jigsaw.shapes`), and the simulator tries each for a few steps to choose (sim/placement.py).
Live pipelines bring their own placement.  `groupings` cuts pipelines into groups that share
(of a node: `jigsaw advise`; of a group of nodes: the cluster layer).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

Placement = tuple[tuple[int, ...], tuple[int, ...]]
"""(rollout devices, training devices) of one pipeline."""


def colocated(k: int, devices: int) -> list[Placement]:
    every = tuple(range(devices))
    return [(every, every)] * k


def paired(k: int, devices: int) -> list[Placement]:
    """Two pipelines share every device; more go in pairs onto equal groups of devices."""
    groups = (k + 1) // 2
    if groups > devices:
        raise ValueError(f"{k} pipelines need {groups} devices (two per device), the node has {devices}")
    per = devices // groups
    return [(g, g) for g in (tuple(range((i // 2) * per, (i // 2 + 1) * per)) for i in range(k))]


def split(k: int, devices: int) -> list[Placement]:
    """Each pipeline on a group of its own, the groups as equal as the devices allow (the
    first ones one device larger where k does not divide n)."""
    if k > devices:
        raise ValueError(f"{k} pipelines need {k} devices (one group each), the node has {devices}")
    out, start = [], 0
    for i in range(k):
        size = devices // k + (1 if i < devices % k else 0)
        group = tuple(range(start, start + size))
        out.append((group, group))
        start += size
    return out


def disaggregated(k: int, devices: int) -> list[Placement]:
    """Every rollout on the first half of the devices, every reference and training on the
    other half (RollMux's pools; one device leaves training none)."""
    half = max(1, devices // 2)
    return [(tuple(range(half)), tuple(range(half, devices)))] * k


def shared_pool(k: int, devices: int) -> list[Placement]:
    """Each pipeline's rollout on devices of its own in the first half (shared round-robin
    when there are fewer than pipelines), reference and training on the second half (PlexRL)."""
    pool = tuple(range(devices // 2, devices)) or (0,)
    own = max(1, (devices // 2) // k)
    return [(tuple((i * own + j) % max(1, devices // 2) for j in range(own)), pool) for i in range(k)]


def crossed(k: int, devices: int) -> list[Placement]:
    """Pipeline i's rollout on one half and its training on the other, the halves swapped for
    every other pipeline: each device runs one pipeline's rollout beside another's training
    (JigsawRL §5.3's asynchronous setting).  One device: both halves are it."""
    half = max(1, devices // 2)
    a, b = tuple(range(half)), tuple(range(half, devices)) or tuple(range(half))
    return [(a, b) if i % 2 == 0 else (b, a) for i in range(k)]


SHAPES: dict[str, Callable[[int, int], list[Placement]]] = {
    "colocated": colocated, "paired": paired, "split": split, "disaggregated": disaggregated,
    "shared-pool": shared_pool, "crossed": crossed}
"""Every shape by name, jigsaw's default first (crossed is tried only for asynchronous
pipelines, sim/placement.py: it is rollmux's shape, alternated)."""


def shape(name: str) -> Callable[[int, int], list[Placement]]:
    if name not in SHAPES:
        raise ValueError(f"unknown placement {name!r}; choose from {', '.join(SHAPES)}")
    return SHAPES[name]


def distinct(names: tuple[str, ...], k: int, devices: int) -> dict[str, list[Placement] | str]:
    """Each named shape's placement of k pipelines on `devices`, or why it cannot hold them;
    a shape that places them exactly as an earlier one did is left out (paired is colocated
    for two pipelines)."""
    out: dict[str, list[Placement] | str] = {}
    for name in names:
        try:
            got = shape(name)(k, devices)
        except ValueError as exc:
            out[name] = str(exc)
            continue
        if got not in out.values():
            out[name] = got
    return out


def groupings(count: int, max_group: int) -> Iterator[tuple[tuple[int, ...], ...]]:
    """Every way to cut pipelines 0..count-1 into groups of at most `max_group` (1 or 2), each
    once, groups in order of their first pipeline: which pipelines share a node (sim/advise.py)
    or a group of nodes (cluster/placement.py)."""
    if max_group not in (1, 2):
        raise ValueError(f"groups of 1 or 2 pipelines are placed, not {max_group}")

    def cut(left: tuple[int, ...]) -> Iterator[tuple[tuple[int, ...], ...]]:
        if not left:
            yield ()
            return
        head, rest = left[0], left[1:]
        for tail in cut(rest):
            yield ((head,), *tail)
        if max_group == 2:
            for k, other in enumerate(rest):
                for tail in cut(rest[:k] + rest[k + 1:]):
                    yield ((head, other), *tail)

    yield from cut(tuple(range(count)))
