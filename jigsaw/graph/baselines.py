"""The baselines a user can run instead of jigsaw, live (`jigsaw daemon --policy`) or simulated.

    View (graphs, progress, node, grid) ─► policy.plan(view) ─► Plan
    placement(k, gpus) ─► which GPUs each pipeline's rollout and training use (the simulator
                          places pipelines by it; live pipelines bring their own placement)

    serial    verl: each pipeline alone on all GPUs, whole steps back to back
    split     each pipeline alone on its own equal group of GPUs, whole devices: two jobs on
              one node with nothing shared (each verl job given its half); live, where the
              pipelines' own placements share a device, one sub-stage holds it at a time,
              first come first served
    static    an equal split a user sets up by hand (MPS percentages, a fixed green-context
              or core split): each pipeline holds half of every device it uses, SMs and
              memory, for the whole run, whatever the other half does; no migration
    muxserve  JigsawRL §5.1 "JigsawRL-MuxServe": rollouts of different pipelines share GPUs
              under a static SM split; reference and training run exclusively, one at a time
    rollmux   RollMux §4 (paper 000): disaggregated rollout / training pools, phases
              round-robin (FIFO per pool), long-tail consolidation at 80% of samples done
    hrrs      PlexRL §4 (paper 004): each job keeps its rollout GPUs; its reference and
              training requests queue on a shared training pool ordered by the highest
              response ratio 1 + wait / estimated time (non-preemptive)

Memory: each sub-stage's need (SubStage.mem_bytes) decides whether it fits its grant; the grid
prices the grant from its feasible points (`_need_frac`, SlowdownGrid's feasibility by need).
Up front, given what every pipeline needs (policy.Needs), `static` refuses a sub-stage larger
than its share and `muxserve` two rollouts that cannot hold their least need together
(`refusal`), instead of failing at the first plan that meets them.

Baselines keep a little state between calls (whose turn it is, what was consolidated).
RollPacker's tail batching is not a node policy: it changes which prompts a pipeline runs
(`jigsaw sim --tailbatch`), and combines with any of these.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from jigsaw.graph.placement import Placement, colocated, disaggregated, paired, shared_pool, split
from jigsaw.graph.plan import Assignment, Migration, PipelineState, Plan
from jigsaw.graph.policy import Needs, PipelineNeeds, View
from jigsaw.graph.substage import SubStage, SubStageKind, grant_need_bytes

GIB = 2**30

# ---------------------------------------------------------------- shared helpers

def _frontier(ps: PipelineState) -> list[SubStage]:
    return list(ps.graph.frontier(ps.done, ps.running))


def _device(ps: PipelineState, s: SubStage) -> int | None:
    return ps.devices[s.dp_rank] if s.kind.on_device else None


def _need_frac(s: SubStage, cap_bytes: int) -> float:
    """Its need over the device's memory, for the grid's feasibility by need."""
    return grant_need_bytes(s.kind, s.mem_bytes) / cap_bytes


def _rollout_need_bytes(p: PipelineNeeds) -> int:
    return max((b for k, b in p.mem_bytes.items() if SubStageKind(k).is_rollout), default=0)


@dataclass
class _Builder:
    """Accumulates exclusive (whole-device) grants and starts for one plan."""

    view: View
    busy: dict[int, str] = field(default_factory=dict)
    assignments: list[Assignment] = field(default_factory=list)
    started: list[str] = field(default_factory=list)
    kinds: dict[str, str] = field(default_factory=dict)
    """Kind of every granted sub-stage (to check two that must share a device)."""
    needs: dict[str, float] = field(default_factory=dict)
    """`_need_frac` of every granted sub-stage."""

    def __post_init__(self) -> None:
        for ps in self.view.pipelines:
            for sid in ps.running:
                s = ps.graph[sid]
                # A worker waiting on a tool still owns its GPU: whole-GPU policies do not
                # lend it out (its engine stays loaded with the waiting requests' KV cache).
                d = ps.devices[s.dp_rank] if s.kind is SubStageKind.TOOL else _device(ps, s)
                if d is not None:
                    self.busy[d] = ps.graph.pipeline

    def keep_running(self, ps: PipelineState) -> None:
        for sid in ps.running:
            d = _device(ps, ps.graph[sid])
            if d is not None:
                self._grant(ps, sid, d)

    def start(self, ps: PipelineState, s: SubStage) -> None:
        d = _device(ps, s)
        if d is not None:
            self.busy[d] = ps.graph.pipeline
            self._grant(ps, s.id, d)
        self.started.append(s.id)

    def _grant(self, ps: PipelineState, sid: str, d: int) -> None:
        self.kinds[sid] = ps.graph[sid].kind.value
        self.needs[sid] = _need_frac(ps.graph[sid], self.view.node.mem_bytes)
        self.assignments.append(Assignment(substage=sid, pipeline=ps.graph.pipeline, device=d, sm_frac=1.0,
                                           mem_bytes=self.view.node.mem_bytes, slowdown=1.0))

    def free(self, devices) -> bool:
        return all(d not in self.busy for d in devices)

    def plan(self, migrations=()) -> Plan:
        return Plan(time_s=self.view.time_s, started=tuple(self.started), assignments=self._shared(),
                    migrations=tuple(migrations))

    def _shared(self) -> tuple[Assignment, ...]:
        """Engines that cannot pause (urgent) may land on a device already granted: they
        time-share its SMs and split its memory."""
        count: dict[int, int] = {}
        for a in self.assignments:
            count[a.device] = count.get(a.device, 0) + 1
        half = self.view.node.mem_bytes // 2
        for d in {a.device for a in self.assignments if count[a.device] > 1}:
            x, y = (u.substage for u in self.assignments if u.device == d)
            a, b = self.kinds[x], self.kinds[y]
            if self.view.model.shared(a, b, 0.5, need_frac_a=self.needs[x], need_frac_b=self.needs[y]) is None:
                raise ValueError(f"{a} and {b} of two pipelines must share device {d} (the placement puts both "
                                 "there) and do not fit in half its memory each")
        return tuple(replace(a, mem_bytes=half) if count[a.device] > 1 else a for a in self.assignments)


def _first_come(view: View, b: _Builder) -> None:
    """Start what is ready on devices that are free, whole devices, pipelines in the order
    they became ready: a gang only when all its devices are free (urgent engines go on)."""
    order = sorted(range(len(view.pipelines)), key=lambda i: view.progress[i].ready_since_s)
    for i in order:
        ps = view.pipelines[i]
        ready = _frontier(ps)
        for s in ready:
            if not s.kind.on_device:
                b.started.append(s.id)
            elif s.kind.collective:
                devs = {ps.devices[x.dp_rank] for x in ps.graph if x.kind is s.kind and x.step == s.step}
                if b.free(devs) and s.id not in b.started:
                    for x in [x for x in ready if x.kind is s.kind]:
                        b.start(ps, x)
            elif s.id in ps.urgent or b.free([_device(ps, s)]):
                b.start(ps, s)


# ---------------------------------------------------------------- policies

@dataclass
class Serial:
    """verl: one job holds the node for a whole step, then the next one's turn (both sides of
    an asynchronous job hold it together: its turn passes when neither runs)."""

    name: str = "serial"
    separable: bool = False
    turn: str | None = None
    turn_step: int = -1

    def placement(self, k: int, gpus: int) -> list[Placement]:
        return colocated(k, gpus)

    def plan(self, view: View) -> Plan:
        jobs = {ps.graph.pipeline: pr.job or ps.graph.pipeline for ps, pr in zip(view.pipelines, view.progress)}
        steps: dict[str, int] = {}
        for ps, pr in zip(view.pipelines, view.progress):
            steps[jobs[ps.graph.pipeline]] = max(steps.get(jobs[ps.graph.pipeline], -1), pr.step)
        b = _Builder(view)
        if self.turn not in steps or (steps[self.turn] > self.turn_step and not self._busy(view, jobs, self.turn)):
            self._next_turn(list(steps), steps)
        for ps in view.pipelines:
            b.keep_running(ps)
            mine = jobs[ps.graph.pipeline] == self.turn
            for s in _frontier(ps):  # another pipeline's request past max-wait starts too: the node promised it
                if s.id in ps.aged or (mine and (s.kind.on_device is False or b.free([_device(ps, s)])
                                                 or s.id in ps.urgent)):
                    b.start(ps, s)
        return b.plan()

    @staticmethod
    def _busy(view: View, jobs: dict[str, str], job: str) -> bool:
        return any(ps.running for ps in view.pipelines if jobs[ps.graph.pipeline] == job)

    def _next_turn(self, jobs: list[str], steps: dict[str, int]) -> None:
        if self.turn in jobs:
            nxt = jobs[(jobs.index(self.turn) + 1) % len(jobs)]
        else:
            nxt = jobs[0]
        self.turn, self.turn_step = nxt, steps[nxt]


@dataclass
class Split:
    """Each pipeline alone on its own equal group of devices (module docstring)."""

    name: str = "split"
    separable: bool = True

    def placement(self, k: int, gpus: int) -> list[Placement]:
        try:
            return split(k, gpus)
        except ValueError as exc:
            raise ValueError(f"split: {exc}") from exc

    def plan(self, view: View) -> Plan:
        b = _Builder(view)
        for ps in view.pipelines:
            b.keep_running(ps)
        _first_come(view, b)
        return b.plan()


@dataclass
class Static:
    """Half of each device per pipeline, every stage, the whole run (module docstring)."""

    name: str = "static"
    separable: bool = True
    share_frac: float = 0.5
    """SM and memory share of each pipeline on each device it uses (two per device at most)."""

    def placement(self, k: int, gpus: int) -> list[Placement]:
        """Two pipelines share every device; more go in pairs onto equal groups of devices."""
        try:
            return paired(k, gpus)
        except ValueError as exc:
            raise ValueError(f"static: {exc}") from exc

    def plan(self, view: View) -> Plan:
        """Each job's half runs one sub-stage at a time (both sides of an asynchronous job,
        where they share a device, take turns in their job's half)."""
        units: dict[int, list[tuple[PipelineState, SubStage]]] = {}
        started: list[str] = []
        jobs = [pr.job or ps.graph.pipeline for ps, pr in zip(view.pipelines, view.progress)]
        held: dict[str, set[int]] = {job: set() for job in jobs}
        for ps, job in zip(view.pipelines, jobs):  # what runs holds its half first
            for sid in ps.running:
                if (d := _device(ps, ps.graph[sid])) is not None:
                    held[job].add(d)
                    units.setdefault(d, []).append((ps, ps.graph[sid]))
        for ps, job in zip(view.pipelines, jobs):
            for s in _frontier(ps):
                d = _device(ps, s)
                if d is None:
                    started.append(s.id)
                elif d not in held[job] or s.id in ps.urgent:  # its half holds one sub-stage at a time
                    held[job].add(d)
                    units.setdefault(d, []).append((ps, s))
                    started.append(s.id)
        assignments = [a for d, us in units.items() for a in self._grants(view, d, us)]
        return Plan(time_s=view.time_s, started=tuple(started), assignments=tuple(assignments))

    def refusal(self, needs: Needs) -> str | None:
        """Refused before the run where a sub-stage needs more than its share of a device:
        every stage keeps its share for the whole run, so it would fail at its first plan."""
        for p in needs.pipelines:
            for kind, need_bytes in p.mem_bytes.items():
                if why := self._over_share(f"{kind} of {p.name}", need_bytes, needs.device_mem_bytes):
                    return why
        return None

    def _over_share(self, what: str, need_bytes: int, cap_bytes: int) -> str | None:
        share_bytes = self.share_frac * cap_bytes
        if need_bytes <= share_bytes:
            return None
        return (f"static: {what} needs {need_bytes / GIB:.1f} GiB; its share of a device is "
                f"{share_bytes / GIB:.1f} GiB ({self.share_frac:.0%} of {cap_bytes / GIB:.1f} GiB)")

    def _grants(self, view: View, d: int, units: list[tuple[PipelineState, SubStage]]) -> list[Assignment]:
        """Each unit its fixed share; the slowdown beside the other half's unit, or alone."""
        share, cap = self.share_frac, view.node.mem_bytes
        for _, s in units:
            # A rollout engine sizes its KV pool to its half (what a user of a static split
            # sets: SGLang's mem_fraction_static); the grid prices the smaller pool below.
            if not s.kind.is_rollout and (why := self._over_share(f"{s.id} on device {d}", s.mem_bytes, cap)):
                raise ValueError(why)
        kinds = [s.kind.value for _, s in units]
        if len(units) > 2:
            raise ValueError(f"static: {len(units)} sub-stages on device {d}; a device holds two halves")
        slow = view.model.actual(*((k, share, share, _need_frac(s, cap)) for k, (_, s) in zip(kinds, units)))
        if slow is None or not all(math.isfinite(x) for x in slow):
            raise ValueError(f"static: {' and '.join(kinds)} cannot run at {share:.0%} of device {d} "
                             "(the slowdown grid has no feasible point there)")
        return [Assignment(substage=s.id, pipeline=ps.graph.pipeline, device=d, sm_frac=share,
                           mem_bytes=int(share * cap), slowdown=x) for (ps, s), x in zip(units, slow)]


@dataclass
class MuxServe:
    """Rollouts share GPUs at a static SM split; reference and training exclusive, serialized."""

    name: str = "muxserve"
    separable: bool = False
    sm_frac: float = 0.5
    """Static SM share of the first rollout on a device (MuxServe fixes the split per group)."""

    def placement(self, k: int, gpus: int) -> list[Placement]:
        return colocated(k, gpus)

    def refusal(self, needs: Needs) -> str | None:
        """Refused before the run where two pipelines' rollouts meet on a device and cannot
        hold their least need together: the rollouts sharing a GPU that MuxServe is about
        would never form (and an urgent engine beside the other could not be granted)."""
        cap = needs.device_mem_bytes
        for i, a in enumerate(needs.pipelines):
            for b in needs.pipelines[i + 1:]:
                need_a, need_b = _rollout_need_bytes(a), _rollout_need_bytes(b)
                if set(a.rollout_devices) & set(b.rollout_devices) and need_a + need_b > cap:
                    return (f"muxserve: the rollouts of {a.name} ({need_a / GIB:.1f} GiB) and {b.name} "
                            f"({need_b / GIB:.1f} GiB) share its devices and do not fit together in one "
                            f"({cap / GIB:.1f} GiB)")
        return None

    def plan(self, view: View) -> Plan:
        occ: dict[int, list[tuple[PipelineState, str]]] = {}
        held: dict[int, set[str]] = {}  # device -> pipelines with a worker waiting on a tool there
        for ps in view.pipelines:
            for sid in ps.running:
                s = ps.graph[sid]
                if (d := _device(ps, s)) is not None:
                    occ.setdefault(d, []).append((ps, sid))
                elif s.kind is SubStageKind.TOOL:
                    held.setdefault(ps.devices[s.dp_rank], set()).add(ps.graph.pipeline)
        started: list[str] = []
        gang_waits = False  # a waiting training stage blocks new rollouts, or it would starve
        order = sorted(range(len(view.pipelines)), key=lambda i: view.progress[i].ready_since_s)
        for ps in (view.pipelines[i] for i in order):
            ready = _frontier(ps)
            gang = [s for s in ready if s.kind.collective]
            if gang:
                devs = [ps.devices[s.dp_rank] for s in gang]
                if not gang_waits and not any(occ.get(d) or held.get(d, set()) - {ps.graph.pipeline} for d in devs):
                    for s, d in zip(gang, devs):
                        occ[d] = [(ps, s.id)]
                        started.append(s.id)
                else:
                    gang_waits = True
            for s in (s for s in ready if not s.kind.collective):
                d = _device(ps, s)
                if d is None:
                    started.append(s.id)
                elif s.id in ps.urgent or (not gang_waits and self._room(view, occ.get(d, []), held.get(d, ()), ps, s)):
                    occ.setdefault(d, []).append((ps, s.id))
                    started.append(s.id)
        assignments = [a for d, units in occ.items() for a in self._grants(view, d, units)]
        return Plan(time_s=view.time_s, started=tuple(started), assignments=tuple(assignments))

    def _room(self, view: View, units: list, holders, ps: PipelineState, s: SubStage) -> bool:
        """A rollout may join one rollout of another pipeline if both fit in memory at the
        static split; nothing joins a gang, and another pipeline's tool wait keeps a place."""
        others = len(units) + len(set(holders) - {ps.graph.pipeline})
        if others != 1 or not units:  # an empty device, a full one, or one place held
            return others <= 1
        other, sid = units[0]
        return (other is not ps and other.graph[sid].kind.is_rollout
                and bool(self._splits(view, (other, sid), (ps, s.id))))

    def _splits(self, view: View, a, b) -> list[tuple[float, float, float, float]]:
        """Grid points at the static split (a at `sm_frac`) where both fit in memory."""
        (pa, ia), (pb, ib) = a, b
        ka, kb, cap = pa.graph[ia], pb.graph[ib], view.node.mem_bytes
        return [o for o in view.model.pair_options(ka.kind.value, kb.kind.value)
                if abs(o[0] - self.sm_frac) < 1e-9 and ka.mem_bytes <= o[1] * cap and kb.mem_bytes <= (1 - o[1]) * cap]

    def _grants(self, view: View, d: int, units: list) -> list[Assignment]:
        cap = view.node.mem_bytes
        if len(units) == 1:
            ps, sid = units[0]
            return [Assignment(substage=sid, pipeline=ps.graph.pipeline, device=d, sm_frac=1.0, mem_bytes=cap,
                               slowdown=1.0)]
        if len(units) != 2:
            raise RuntimeError(f"muxserve put {len(units)} sub-stages on device {d}")
        (pa, a), (pb, b) = units
        fits = self._splits(view, units[0], units[1])
        ka, kb = pa.graph[a], pb.graph[b]
        if not fits:  # a worker back from a tool beside a gang: the best split the grid allows
            fits = [o for o in view.model.pair_options(ka.kind.value, kb.kind.value)
                    if ka.mem_bytes <= o[1] * cap and kb.mem_bytes <= (1 - o[1]) * cap]
        if not fits:  # an urgent engine whose need no grid level holds beside its partner's
            fits = self._by_need(view, ka, kb)
        if not fits:
            raise RuntimeError(f"muxserve: {a} and {b} do not fit together on device {d}")
        sm, mem, sa, sb = min(fits, key=lambda o: max(o[2], o[3]))
        return [Assignment(substage=a, pipeline=pa.graph.pipeline, device=d, sm_frac=sm, mem_bytes=int(mem * cap),
                           slowdown=sa),
                Assignment(substage=b, pipeline=pb.graph.pipeline, device=d, sm_frac=1 - sm,
                           mem_bytes=int((1 - mem) * cap), slowdown=sb)]

    def _by_need(self, view: View, ka: SubStage, kb: SubStage) -> list[tuple[float, float, float, float]]:
        """The split off the grid's levels where no level holds both (two engines expecting 45%
        each fit 50/50, which levels 0.2..0.8 lack; an engine that ran into its whole grant):
        each side its hard need (a rollout's is none: its KV pool follows its grant), what is
        left in proportion to what each expects to hold, at the static SM split, priced by the
        grid by need."""
        cap = view.node.mem_bytes
        need_a, need_b = _need_frac(ka, cap), _need_frac(kb, cap)
        left = 1.0 - need_a - need_b
        if left < 0:
            return []
        expect = ka.mem_bytes + kb.mem_bytes
        mem = need_a + left * (ka.mem_bytes / expect if expect else 0.5)
        got = view.model.pair(ka.kind.value, kb.kind.value, self.sm_frac, mem, need_frac_a=need_a, need_frac_b=need_b)
        return [] if got is None else [(self.sm_frac, mem, *got)]


@dataclass
class RollMux:
    """Disaggregated pools, phase-level round-robin, long-tail consolidation (RollMux §4.3-4.4)."""

    name: str = "rollmux"
    separable: bool = False
    tail_trigger_frac: float = 0.8
    """Share of samples done that makes a rollout tail-bound (RollMux §4.4: 'e.g. 80%')."""
    consolidated: set = field(default_factory=set)

    def placement(self, k: int, gpus: int) -> list[Placement]:
        return disaggregated(k, gpus)

    def plan(self, view: View) -> Plan:
        b = _Builder(view)
        for ps in view.pipelines:
            b.keep_running(ps)
        migrations = self._consolidate(view, b)
        _first_come(view, b)
        return b.plan(migrations)

    def _consolidate(self, view: View, b: _Builder) -> list[Migration]:
        """At ≥80% of samples done, move the stragglers onto a quarter of the rollout GPUs so
        the next job's rollout can start on the others (RollMux §4.4)."""
        out = []
        for ps, prog in zip(view.pipelines, view.progress):
            key = (ps.graph.pipeline, prog.step)
            if prog.stage != "rollout" or prog.rollout_done_frac < self.tail_trigger_frac or key in self.consolidated:
                continue
            live = sorted({ps.graph[sid].dp_rank for sid in ps.running if ps.graph[sid].kind.is_rollout})
            keep = max(1, len(live) // 4)
            if len(live) <= keep:
                continue
            self.consolidated.add(key)
            targets, sources = live[:keep], live[keep:]
            ids = {ps.graph[sid].dp_rank: sid for sid in ps.running if ps.graph[sid].kind.is_rollout}
            rem = {r: ps.remaining_s.get(ids[r], 0.0) for r in live}
            for n, r in enumerate(sources):
                t = targets[n % keep]
                # A decode batch's pace barely depends on its size: the merged tail takes about
                # as long as the longest of its parts (what the graph-level replay needs).
                longest = max(rem[x] for x in [t, *sources[n % keep::keep]])
                out.append(Migration(pipeline=ps.graph.pipeline, source=ids[r], target=ids[t], source_rank=r,
                                     target_rank=t, delta_s=0.0, target_remaining_s=longest))
                b.busy.pop(ps.devices[r], None)
                b.assignments = [a for a in b.assignments if a.substage != ids[r]]
        return out


@dataclass
class HRRS:
    """PlexRL: rollout on each job's own GPUs; reference / training requests share a training
    pool, ordered by highest response ratio 1 + wait / estimated time (PlexRL Alg. 1)."""

    name: str = "hrrs"
    separable: bool = False

    def placement(self, k: int, gpus: int) -> list[Placement]:
        return shared_pool(k, gpus)

    def plan(self, view: View) -> Plan:
        b = _Builder(view)
        gangs = []
        for i, ps in enumerate(view.pipelines):
            b.keep_running(ps)
            for s in _frontier(ps):
                if s.kind.collective:
                    if s.dp_rank == min(x.dp_rank for x in ps.graph if x.kind is s.kind and x.step == s.step):
                        gangs.append((i, ps, s))
                elif not s.kind.on_device or s.id in ps.urgent or b.free([_device(ps, s)]):
                    b.start(ps, s)
        for _, ps, s in sorted(gangs, key=lambda g: -self._ratio(view, g[0], g[1], g[2])):
            members = [x for x in _frontier(ps) if x.kind is s.kind and x.step == s.step]
            if b.free([_device(ps, x) for x in members]):
                for x in members:
                    b.start(ps, x)
        return b.plan()

    @staticmethod
    def _ratio(view: View, i: int, ps: PipelineState, s: SubStage) -> float:
        wait = max(0.0, view.time_s - view.progress[i].ready_since_s)
        return 1.0 + wait / max(s.duration_s, 1e-6)
