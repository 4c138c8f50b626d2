"""What a decision does to the node, as data: the one description every effect side acts on.

    NodeState.apply (state.py) changes the ledger, then snapshots it ─► Decision
        admitted   requests that start now (answer their Admit, start their engine)
        changed    running sub-stages whose budget changed
        moved      migration sources the plan ended (their owners hand their requests over)
        holders    everything running after the decision; `layout()` groups it by device
        touched    devices whose holders or budgets changed
    ─► the daemon's grants (runtime/grants.py: budgets, partitions of the touched layouts,
       routing and migration orders), the simulator's engines (sim/node.py: budgets, the
       physics of each layout), the graph executor's timeline (sim/execute.py)
    record() ─► the trace's plan event (its plan's SLO forecasts under "slo" when it has any)

Nobody reads the ledger again to act: a Decision is frozen and complete.  `overcommitted`
is the one capacity check, of the node state's layouts and of a simulator's engines alike.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Generic

from jigsaw.graph.plan import Assignment, Budget, Migration, Plan
from jigsaw.graph.substage import SubStageKind
from jigsaw.node.ledger import Owner

EPS = 1e-9


@dataclass(frozen=True, kw_only=True, slots=True)
class Held(Generic[Owner]):
    """A sub-stage running after a decision, with what acting on it needs."""

    sid: str
    pipeline: str
    kind: SubStageKind
    rank: int
    device: int
    """Its device (host work: its worker's device, holding nothing of it)."""
    budget: Budget
    mem_bytes: int = 0
    """Memory granted, as the plan gave it (its budget's `mem_frac` of the device)."""
    slowdown: float
    """The plan's prediction for its budget (1.0 alone; host work 1.0)."""
    micro_batch: int | None = None
    need_bytes: int = 0
    pids: tuple[int, ...] = ()
    owner: Owner | None = None
    computes: bool = False
    """Host work that computes on this node's CPU: on a CPU node its processes go to the cores
    no device sub-stage holds (runtime/grants.py)."""

    @property
    def on_device(self) -> bool:
        return self.kind.on_device


@dataclass(frozen=True, kw_only=True, slots=True)
class Admission(Generic[Owner]):
    held: Held[Owner]
    assignment: Assignment
    """The plan's assignment it started under (host work: a zero one)."""

    @property
    def sid(self) -> str:
        return self.held.sid


@dataclass(frozen=True, kw_only=True, slots=True)
class Decision(Generic[Owner]):
    """A plan and everything it changed (module docstring)."""

    plan: Plan
    admitted: tuple[Admission[Owner], ...] = ()
    changed: tuple[Held[Owner], ...] = ()
    """Running sub-stages whose budget the plan changed (their new budget)."""
    moved: tuple[Held[Owner], ...] = ()
    """Running sources of the plan's migrations, ended by it: their owners must be told where
    their requests go (nothing else of theirs changes)."""
    holders: tuple[Held[Owner], ...] = ()
    """Every sub-stage running after the decision, in the node's order."""
    touched: frozenset[int] = frozenset()
    """Devices whose holders or budgets changed."""
    notes: tuple[str, ...] = ()
    """What the plan got wrong and the applier did not obey (kept budgets, refused pairs)."""
    fallback: str = ""
    """Why the policy's plan was not used ("" when it was)."""
    orders: Mapping[str, tuple[Migration, ...]] = field(default_factory=dict)
    """The migrations that took place, per pipeline (what its workers are told)."""

    @property
    def routing(self) -> dict[str, tuple[float, ...]]:
        """The plan's rollout routing weights, per pipeline."""
        return {r.pipeline: r.weights for r in self.plan.routing}

    def layout(self, devices: Iterable[int] | None = None) -> dict[int, list[Held[Owner]]]:
        """What holds each device (of `devices`, default every device something holds)."""
        return layout(self.holders, devices)

    def record(self) -> dict:
        """The decision as plain data (a trace's plan event): enough to compare a replay with;
        with deadlines, "slo": [pipeline, step, deadline_s, predicted_end_s, kept, reason] each."""
        out = {"started": list(self.plan.started),
               "assignments": [[a.substage, a.device, a.sm_frac, a.mem_bytes, a.slowdown, a.micro_batch]
                               for a in self.plan.assignments],
               "decisions": list(self.plan.decisions), "fallback": self.fallback, "notes": list(self.notes)}
        if self.plan.slo:
            out["slo"] = [[f.pipeline, f.step, f.deadline_s, f.predicted_end_s, f.kept, f.reason]
                          for f in self.plan.slo]
        return out


def layout(holders: Iterable[Held], devices: Iterable[int] | None = None) -> dict[int, list[Held]]:
    """Holders on each device, in order (host work holds none)."""
    out: dict[int, list[Held]] = {d: [] for d in devices} if devices is not None else {}
    for h in holders:
        if h.on_device and (devices is None or h.device in out):
            out.setdefault(h.device, []).append(h)
    return out


def overcommitted(layouts: Mapping[int, list], budget_of=lambda h: h.budget, name_of=lambda h: h.sid) -> list[str]:
    """Devices holding more than two sub-stages, SMs or memory beyond capacity (two sides
    each given every SM are an unpartitioned pair, as under MPS)."""
    out = []
    for d, hs in sorted(layouts.items()):
        budgets = [budget_of(h) for h in hs]
        sm = sum(b.sm_frac for b in budgets)
        shared = len(hs) == 2 and all(b.sm_frac >= 1.0 - EPS for b in budgets)
        if len(hs) > 2 or (sm > 1.0 + EPS and not shared) or sum(b.mem_frac for b in budgets) > 1.0 + EPS:
            out.append(f"device {d} is overcommitted: " + ", ".join(
                f"{name_of(h)} ({b.sm_frac:.0%} SMs, {b.mem_frac:.0%} memory)" for h, b in zip(hs, budgets)))
    return out


def merged(decisions: list[Decision], plan: Plan) -> Decision:
    """Decisions of separately planned groups of pipelines as one, under their joint `plan`."""
    if len(decisions) == 1:
        return decisions[0]
    orders: dict[str, tuple[Migration, ...]] = {}
    for d in decisions:
        orders.update(d.orders)
    return Decision(plan=plan, admitted=sum((d.admitted for d in decisions), ()),
                    changed=sum((d.changed for d in decisions), ()), moved=sum((d.moved for d in decisions), ()),
                    holders=sum((d.holders for d in decisions), ()),
                    touched=frozenset().union(*(d.touched for d in decisions)),
                    notes=sum((d.notes for d in decisions), ()),
                    fallback="; ".join(d.fallback for d in decisions if d.fallback), orders=orders)
