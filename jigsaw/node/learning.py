"""Where each grant ran on the grid, for the learner (mux/model/learned.py): NodeState's side.

    every decision, and every finish (a partner leaving changes the survivor's point)
        note(now, pipelines) ─► per running device sub-stage, when its point changes:
            (time, entry, predicted rate)   entry = (kind, partner or None, sm level, mem level)
    finish(r)  ─► close ─► Segments (wall seconds at each point) + reference exclusive seconds
               ─► GridLearner.observe ─► Learned (entry or None, the plan's error) ─► NodeState swaps
                  in learner.refined() for the next decision

The reference is a number the node did not compute from the grid: the requester's own
estimate (Admit.expected_s), the static graph's duration, or the pipeline's own rate alone
(AloneRates: seconds per unit of the work its Done reports, from its grants of that kind that
ran their whole life alone at one point).  At the normalisation point (alone on the whole
device) wall time is exclusive time by definition; alone at a smaller share it is exclusive
time × that alone entry's current value, so a pair is learned against its kind alone at the
same share (where a node never runs anything on a whole device: the CPU demo's two pipelines).
A grant is never evidence about the point its own reference was measured at.
Where nothing ever runs alone (the CPU demo's two pipelines, always side by side), the log
asks for it: a pipeline with no rate of a kind alone and no other reference runs its next
grants of that kind as probes (PipelineState.alone: the scheduler starts nothing beside one but
urgent pieces), at most LearnConfig.probes_per_kind of them.  Without a
reference a grant is not evidence: the ledger's work is wall time over the predicted slowdown,
so comparing it with the prediction would only check the grid against itself.  A grant that
began before it asked (its head start ran under no grant), or that took over a migration's
requests, is skipped.
Replicas of a gang at different points run at the slowest one's pace: none of them is
evidence about its own point.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter, deque
from dataclasses import dataclass

from jigsaw.mux.model.learned import Entry, GridLearner, Segment

SNAP_FRAC = 0.01
"""A memory budget this close to a level is at it (budgets are bytes, levels fractions)."""
HISTORY = 4096
"""Learned records kept (the bench's error curve; bounded for a daemon that runs for weeks)."""
UNIT = {"rollout_prefill": "num_tokens", "rollout_decode": "num_steps", "rollout_tail": "num_steps",
        "reference": "num_tokens", "training": "num_tokens"}
"""The work a kind's exclusive time scales with, as its Done reports it (SubStage field)."""


class AloneRates:
    """Per (pipeline, alone entry), wall seconds per unit of work (UNIT) of its grants that ran
    wholly there; known once it has `min_samples` (the median: a slow start-up or two moves
    nothing)."""

    def __init__(self, window: int, min_samples: int):
        self.window, self.min_samples = window, min_samples
        self._rates: dict[tuple[str, Entry], deque[float]] = {}

    def note(self, key: tuple[str, Entry], units: float, wall_s: float) -> None:
        if units > 0 and wall_s > 0:
            self._rates.setdefault(key, deque(maxlen=self.window)).append(wall_s / units)

    def rate(self, key: tuple[str, Entry]) -> float | None:
        """Wall seconds per unit there, or None (too few grants)."""
        rates = self._rates.get(key)
        return statistics.median(rates) if rates is not None and len(rates) >= self.min_samples else None

    def known(self, pipeline: str, kind: str) -> bool:
        """Has `pipeline` a rate of `kind` alone at some point?"""
        return any(p == pipeline and e[0] == kind and len(r) >= self.min_samples
                   for (p, e), r in self._rates.items())


@dataclass(frozen=True, kw_only=True, slots=True)
class Learned:
    """One finished grant with a reference, and how far off the plan was."""

    t_s: float
    pipeline: str
    sid: str
    entry: Entry | None
    """The entry it was evidence about; None: none (the learner's `skipped` says why)."""
    error_log: float
    """log(predicted work / true work) over its life: the plan's error for it (0: exact)."""


class GrantLog:
    """Each running device sub-stage's points on the grid since it started."""

    def __init__(self, learner: GridLearner):
        self.learner = learner
        self._points: dict[tuple[str, str], list[tuple[float, Entry | None, float]]] = {}
        self._tainted: set[tuple[str, str]] = set()
        self.history: deque[Learned] = deque(maxlen=HISTORY)
        self.rates = AloneRates(learner.config.window, learner.config.min_samples)
        self._probing: set[tuple[str, str]] = set()
        self.probed: Counter[tuple[str, str]] = Counter()
        """Probes started per (pipeline, kind)."""
        self._unitless: set[tuple[str, str]] = set()
        """(pipeline, kind)s whose Done reported no unit of work: no rate, no probe."""
        self.last_probe: tuple[str, str, bool] | None = None
        """(pipeline, sid, whether it ran wholly alone) of the last probe that ended."""

    def probes(self, p) -> frozenset[str]:
        """The sub-stages of LivePipeline `p` that run alone (PipelineState.alone): its running
        probes, and its waiting device sub-stages that would be one (`_wants`)."""
        if p.static is not None or not self.learner.config.probes_per_kind:
            return frozenset()
        return frozenset([sid for sid in p.running if (p.name, sid) in self._probing]
                         + [sid for sid, w in p.waiting.items() if self._wants(p.name, w.kind, w.expected_s, w.work_s)])

    def _wants(self, pipeline: str, kind, expected_s: float | None, head_start_s: float) -> bool:
        """A probe: a device kind with a unit of work, no estimate of its own, no head start
        (its work must all run under its grant), no rate of the pipeline's alone yet, probes
        of it left; never a rollout piece, whose next regime asks the moment it ends (urgent,
        it would start beside whatever runs)."""
        return (kind.on_device and not kind.is_rollout and expected_s is None and head_start_s <= 0.0
                and kind.value in UNIT
                and (pipeline, kind.value) not in self._unitless
                and self.probed[(pipeline, kind.value)] < self.learner.config.probes_per_kind
                and not self.rates.known(pipeline, kind.value))

    def note(self, now_s: float, pipelines) -> None:
        """Where every running device sub-stage of `pipelines` (LivePipeline) runs now."""
        by_device: dict[int, list] = {}
        for p in pipelines:
            for r in p.running.values():
                if r.on_device:
                    by_device.setdefault(r.device, []).append((p, r))
        points = {}
        for group in by_device.values():
            for p, r in group:
                partner = next((o.kind.value for q, o in group if o is not r), None) if len(group) == 2 else None
                entry = self._entry(r.kind.value, partner, r.budget) if len(group) <= 2 else None
                points[(p.name, r.sid)] = (entry, r.rate, p, r)
        self._unpace(points)
        for key, (entry, rate, p, r) in points.items():
            head_s = r.paces[0][1] if r.paces else 0.0
            if key not in self._points and key not in self._probing and p.static is None and self._wants(
                    p.name, r.kind, r.expected_s, head_s):
                self._probing.add(key)  # started as a probe (the plan saw what _wants says now)
                self.probed[(p.name, r.kind.value)] += 1
            log = self._points.setdefault(key, [])
            if not log or log[-1][1:] != (entry, rate):
                log.append((now_s, entry, rate))

    def taint(self, pipeline: str, sid: str) -> None:
        """`sid` took on work it was not asked with (a migration's target)."""
        self._tainted.add((pipeline, sid))

    def forget(self, pipeline: str, sid: str) -> None:
        self._points.pop((pipeline, sid), None)
        self._tainted.discard((pipeline, sid))
        self._probing.discard((pipeline, sid))

    def close(self, p, r, now_s: float, done=None) -> Learned | None:
        """Running `r` of LivePipeline `p` finished at `now_s` (`done`: the finished SubStage,
        its numbers as its Done reported them): offered to the learner if it has a reference;
        what was recorded of it, else None."""
        key = (p.name, r.sid)
        log, tainted = self._points.pop(key, None), key in self._tainted
        self._tainted.discard(key)
        segments = [Segment(entry=e, wall_s=max(0.0, t1 - t0), slowdown=1.0 / rate)
                    for (t0, e, rate), t1 in zip(log or [], [t for t, _, _ in (log or [])[1:]] + [now_s])]
        fresh = not (r.paces and r.paces[0][1] > 0.0) and not tainted  # all its work ran under these grants
        units = float(getattr(done, UNIT.get(r.kind.value, ""), 0) or 0) if done is not None else 0.0
        if done is not None and units <= 0 and r.on_device:
            self._unitless.add((p.name, r.kind.value))
        at, wall_s = self._alone_at(segments)
        if fresh and at is not None:
            self.rates.note((p.name, at), units, wall_s)
        if key in self._probing:
            self._probing.discard(key)
            self.last_probe = (p.name, r.sid, fresh and at is not None)
        reference, exact = (r.expected_s, None) if r.expected_s is not None else (
            (p.static[r.sid].duration_s, None) if p.static is not None and r.sid in p.static
            else self._reference(p.name, r.kind.value, segments, units, own=at))
        why = ("not on a device" if not r.on_device else "no reference" if reference is None
               else "head start" if r.paces and r.paces[0][1] > 0.0 else "took on requests" if tainted
               else "never noted" if not log else "")
        if why:
            self.learner.skipped[why] += 1
            return None
        got = Learned(t_s=now_s, pipeline=p.name, sid=r.sid,
                      entry=self.learner.observe(segments, reference, exact=exact),
                      error_log=math.log(max(r.work_s, 1e-12) / reference))
        self.history.append(got)
        return got

    def _alone_at(self, segments) -> tuple[Entry | None, float]:
        """(the point, wall seconds there) of a grant that ran wholly alone, most of its time
        (LearnConfig.min_share_frac) at one point: its other alone segments converted to that
        point by their alone values (a re-grant at a new share a moment after the start is
        common); (None, 0) if anything ran beside it or no point held it."""
        walls: dict[Entry, float] = {}
        for s in segments:
            if s.wall_s > 0:
                if s.entry is None or s.entry[1] is not None:
                    return None, 0.0
                walls[s.entry] = walls.get(s.entry, 0.0) + s.wall_s
        if not walls:
            return None, 0.0
        at = max(walls, key=walls.get)
        if walls[at] < self.learner.config.min_share_frac * sum(walls.values()):
            return None, 0.0
        values = {e: self.learner.value(e) for e in walls}
        if not all(math.isfinite(v) for v in values.values()):
            return None, 0.0
        return at, sum(w * values[at] / values[e] for e, w in walls.items())

    def _reference(self, pipeline: str, kind: str, segments, units: float,
                   own: Entry | None) -> tuple[float | None, Entry | None]:
        """(exclusive seconds of `units` of work, the point they were measured at) from the
        pipeline's rate alone: at the normalisation point, else alone at the share of its longest
        segment (over that entry's value); never the point `own` the grant itself ran at."""
        if units <= 0:
            return None, None
        longest = max(segments, key=lambda s: s.wall_s, default=None)
        places = [self._top(kind)]
        if longest is not None and longest.entry is not None:
            places.append((kind, None, longest.entry[2], longest.entry[3]))
        for place in places:
            rate = self.rates.rate((pipeline, place)) if place != own else None
            if rate is not None and (value := self.learner.value(place)) < math.inf:
                return units * rate / value, place
        return None, None

    def _top(self, kind: str) -> Entry:
        """The normalisation point of `kind`: alone, every SM, the top memory level."""
        g = self.learner.base
        return kind, None, len(g.sm_levels) - 1, len(g.mem_levels) - 1

    def _entry(self, kind: str, partner: str | None, budget) -> Entry | None:
        g = self.learner.base
        i = next((n for n, x in enumerate(g.sm_levels) if abs(x - budget.sm_frac) <= 1e-6), None)
        mem = min(budget.mem_frac, g.mem_levels[-1])  # more memory than profiled prices as the top level
        j = next((n for n, x in enumerate(g.mem_levels) if abs(x - mem) <= SNAP_FRAC), None)
        if i is None or j is None or kind not in g.kinds or (partner is not None and partner not in g.kinds):
            return None
        return kind, partner, i, j

    @staticmethod
    def _unpace(points: dict) -> None:
        """Gang replicas at different points: none is evidence about its own (module docstring)."""
        gangs: dict[tuple, list] = {}
        for key, (_, _, p, r) in points.items():
            if r.kind.collective:
                gangs.setdefault((p.name, p.gang_key(r.sid)), []).append(key)
        for keys in gangs.values():
            if len({points[k][0] for k in keys}) > 1:
                for k in keys:
                    entry, rate, p, r = points[k]
                    points[k] = (None, rate, p, r)
