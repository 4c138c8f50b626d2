"""Calibrate a slowdown grid from the pipelines' own runs, so the simulator times them as they ran.

    alone run   (daemon policy `serial`: every sub-stage holds the whole device)
        └─► held time per sub-stage id                                   ─┐
    shared run  (daemon policy `static` or `jigsaw`: sub-stages on partitions)  │ same seeds ⇒
        └─► per sub-stage id: held time, and that time over the grid's      │ same ids
            slowdown for each interval (its whole-device time, as the grid sees it)
    ─► per kind k, over the ids in both runs (warm-up steps left out):
           f_k = Σ grid-exclusive(shared) / Σ held(alone)
       f_k > 1: the grid's slowdowns of k on a partition are too small, by f_k on the whole
    ─► grid': every partitioned entry of k (σ < 1: k alone on a share, k beside any partner)
       × f_k (never under the grid format's floor); the σ = 1 entries (alone on the whole
       device; unpartitioned sharing) are kept
    ─► Calibration(grid', per-kind factors and the seconds behind them)

Why: a profiled grid times kernels (`jigsaw profile`); a real pipeline adds its Python, its
threads' synchronisation and its batch shapes, and on a small CPU those decide how much a second
core is worth (the demo's training gains 1.7x from it, its tails run slower with it).  One factor per kind keeps
the grid's shape (which partner hurts more) and fixes its scale.  A kind with less matched time
than `min_matched_s` keeps its entries: a few short sub-stages are mostly grant latency.
"""

from __future__ import annotations

import copy
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

from jigsaw.graph.ids import SubStageId
from jigsaw.mux.model.slowdown import NOISE_FLOOR, SlowdownGrid
from jigsaw.sim.replay import Held, held_times
from jigsaw.trace import Trace

NOTE = "calibrated on the pipelines' own runs"
"""What a calibrated grid's source.note says (once)."""
MIN_MATCHED_S = 0.5
"""Least alone time of a kind's matched sub-stages for its factor to be applied."""


@dataclass(frozen=True, kw_only=True, slots=True)
class KindFit:
    """What the runs said about one sub-stage kind."""

    kind: str
    matched: int
    """Sub-stage ids found in both runs (warm-up steps left out)."""
    alone_s: float
    """Their held time in the alone run (whole device)."""
    shared_s: float
    """Their held time in the shared run (on partitions, beside a partner)."""
    grid_exclusive_s: float
    """The shared run's held time over the grid's slowdowns: the grid's guess of `alone_s`."""
    factor: float
    """What the kind's partitioned entries were multiplied by (1.0 where not applied)."""
    applied: bool

    @property
    def measured_x(self) -> float:
        """On a partition beside a partner over alone on the whole device, as the runs measured."""
        return self.shared_s / self.alone_s

    @property
    def grid_x(self) -> float:
        """The same ratio as the grid said it (its time-weighted slowdown over the shared run)."""
        return self.shared_s / self.grid_exclusive_s


@dataclass(frozen=True, kw_only=True, slots=True)
class Calibration:
    grid: SlowdownGrid
    """The calibrated grid (source.calibration says from what)."""
    fits: tuple[KindFit, ...]

    @property
    def factors(self) -> dict[str, float]:
        """{kind: factor} of the kinds calibrated: `replay.recorded(trace, factors=...)` reads a
        run decided with the old grid as the calibrated one times it."""
        return {f.kind: f.factor for f in self.fits if f.applied}


def calibrate(grid: SlowdownGrid, alone: list[Trace], shared: list[Trace], *, first_step: int = 1,
              min_matched_s: float = MIN_MATCHED_S, sources: tuple[str, ...] = ()) -> Calibration:
    """Scale `grid`'s partitioned entries per kind so that the shared runs' sub-stages, taken
    back to a whole device by the grid, last as long as the alone runs measured them.
    `alone[i]` and `shared[i]` must be runs of the same pipelines and seeds; `shared[i]`
    decided with `grid` (its grants carry the slowdowns this grid gave them)."""
    if not alone or len(alone) != len(shared):
        raise ValueError(f"calibration needs alone and shared runs in pairs, got {len(alone)} and {len(shared)}")
    sums: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0.0])
    for a, s in zip(alone, shared):
        for kind, (alone_s, shared_s, excl_s) in _matched(_times(a, first_step, whole=True),
                                                           _times(s, first_step, whole=False)):
            acc = sums[kind]
            acc[0] += 1
            acc[1] += alone_s
            acc[2] += shared_s
            acc[3] += excl_s
    if not sums:
        raise ValueError("the alone and shared runs have no sub-stage in common after the warm-up steps: "
                         "were they run with the same seeds and steps?")
    fits = tuple(_fit(kind, *sums[kind], min_matched_s=min_matched_s) for kind in sorted(sums))
    factors = {f.kind: f.factor for f in fits if f.applied}
    return Calibration(grid=scaled(grid, factors, sources), fits=fits)


def _times(trace: Trace, first_step: int, *, whole: bool) -> dict[str, Held]:
    times, _ = held_times(trace)
    out = {}
    for sid, t in times.items():
        if SubStageId.parse(sid).step < first_step or t.held_s <= 0:
            continue
        if whole and t.min_sm_frac < 1.0:
            raise ValueError(f"{sid} held {t.min_sm_frac:g} of a device in the alone run: an alone run is a daemon "
                             "run with --policy serial, where every sub-stage holds the whole device")
        out[sid] = t
    return out


def _matched(alone: dict[str, Held], shared: dict[str, Held]):
    for sid in alone.keys() & shared.keys():
        kind = SubStageId.parse(sid).kind
        if not kind.on_device:
            continue  # host work: the grid has no entry for it
        yield kind.value, (alone[sid].held_s, shared[sid].held_s, shared[sid].exclusive_s)


def _fit(kind: str, matched: int, alone_s: float, shared_s: float, excl_s: float, *, min_matched_s: float) -> KindFit:
    applied = alone_s >= min_matched_s and excl_s > 0
    return KindFit(kind=kind, matched=int(matched), alone_s=alone_s, shared_s=shared_s, grid_exclusive_s=excl_s,
                   factor=excl_s / alone_s if applied else 1.0, applied=applied)


def scaled(grid: SlowdownGrid, factors: Mapping[str, float], runs: tuple[str, ...] = ()) -> SlowdownGrid:
    """`grid` with every partitioned entry of each kind in `factors` multiplied by its factor
    (alone on a share, and beside every partner); `runs` says where the factors came from.  A
    grid calibrated before records the product of both calibrations' factors."""
    data = grid.to_dict()
    part = [i for i, x in enumerate(data["sm_levels"]) if x < 1.0]
    for kind, f in factors.items():
        tables = [data["alone"][kind], *data["pairs"][kind].values()]
        for table in tables:
            for i in part:
                table[i] = [None if v is None else max(NOISE_FLOOR, round(v * f, 4)) for v in table[i]]
    source = copy.deepcopy(data["source"])
    before = source.get("calibration", {})
    if NOTE not in source["note"]:
        source["note"] = f"{source['note']}; {NOTE}"
    total = dict(before.get("factors", {}))
    for kind, f in factors.items():
        total[kind] = total.get(kind, 1.0) * f
    source["calibration"] = {"factors": {k: round(v, 4) for k, v in total.items()},
                             "runs": [*before.get("runs", ()), *runs]}
    data["source"] = source
    return SlowdownGrid.from_dict(data)
