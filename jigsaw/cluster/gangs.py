"""Gangs that span nodes, admitted whole or not at all: the controller's pure state.

    node daemon ─ ready(gang, node, members) ─►┐  "I could start my part of this gang now"
                ─ withdraw(gang, node) ───────►│  (it holds nothing while it waits)
                ─ done(gang) ─────────────────►│
    controller  ─ leave(node) ────────────────►│  a node lost: its gangs are refused
                ─ overdue(now, wait_s) ───────►│  a live member that never asks, while free
                                               ▼
    Gates.admit() ─► every gang whose members are all ready, oldest first, each member's
                     readiness for its other gangs consumed: that node's part starts now
    Gates.take(node) ─► (admitted gangs, refused gangs with the reason) for that node, once

A member alive but silent about a gang (its part runs without its daemon: the worker there
fell open, or cannot reach it) would hold the others' parts forever: once every missing member
has been free (in no admitted gang) for `wait_s` since the gang was first asked for, the gang
is refused, to every member (one that has yet to ask remembers it: runtime/spanning.py).  A
refused part is decided by its own node alone; the collective itself still meets its other ranks.

Why no deadlock, whatever the order requests arrive in: a node asks for a gang without holding
anything for it, so no node ever waits holding what another gang needs; a gang starts on all of
its nodes at once or on none.  A gang refused (a member left) is run by no node: each other
member falls open for that piece (its own node decides it alone), and nothing is lost.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(kw_only=True, slots=True)
class _Gang:
    members: frozenset[str]
    seq: int
    since_s: float
    """When its first member asked."""
    ready: set[str] = field(default_factory=set)


@dataclass(kw_only=True, slots=True)
class Gates:
    """Cross-node gangs waiting for their members, and what each node has yet to be told."""

    waiting: dict[str, _Gang] = field(default_factory=dict)
    running: dict[str, frozenset[str]] = field(default_factory=dict)
    """Admitted gangs by id: their members, until done."""
    told: dict[str, list[tuple[str, str]]] = field(default_factory=dict)
    """Per node: (gang, "" if admitted else why refused), not yet taken."""
    lost: set[str] = field(default_factory=set)
    free_since_s: dict[str, float] = field(default_factory=dict)
    """Per node: when its last admitted gang ended (it was busy until then)."""
    _seq: int = 0

    def ready(self, gang: str, node: str, members: frozenset[str], now_s: float = 0.0) -> None:
        """`node` could start its part of `gang` (over `members`) now."""
        if node not in members:
            raise ValueError(f"node {node!r} is not a member of gang {gang!r} ({sorted(members)})")
        if gang in self.running:  # its admission crossed this offer on the way: told already
            return
        g = self.waiting.get(gang)
        if g is None:
            g = self.waiting[gang] = _Gang(members=members, seq=self._seq, since_s=now_s)
            self._seq += 1
        elif g.members != members:
            raise ValueError(f"gang {gang!r}: {node} says members {sorted(members)}, another said "
                             f"{sorted(g.members)}")
        if members & self.lost:
            self._refuse(gang, f"node(s) {sorted(members & self.lost)} left the cluster")
            return
        g.ready.add(node)

    def withdraw(self, gang: str, node: str) -> None:
        """`node` can no longer start `gang` now (it started other work): it asks again later."""
        g = self.waiting.get(gang)
        if g is not None:
            g.ready.discard(node)

    def admit(self) -> list[str]:
        """Admit every gang all of whose members are ready, oldest first; a node's readiness
        for its other waiting gangs is consumed by the one admitted (it asks again)."""
        out = []
        for gang, g in sorted(self.waiting.items(), key=lambda item: item[1].seq):
            if g.ready != g.members:
                continue
            del self.waiting[gang]
            self.running[gang] = g.members
            for node in g.members:
                self.told.setdefault(node, []).append((gang, ""))
                for other in self.waiting.values():
                    other.ready.discard(node)
            out.append(gang)
        return out

    def done(self, gang: str, now_s: float = 0.0) -> None:
        for node in self.running.pop(gang, ()):
            self.free_since_s[node] = now_s

    def overdue(self, now_s: float, wait_s: float) -> list[str]:
        """Refuse every gang some member has asked for whose missing members have all been free
        for `wait_s` since it was first asked for: they are alive (else they would have left)
        and not about to ask (see the module docstring)."""
        busy = {n for members in self.running.values() for n in members}
        late = []
        for gang, g in self.waiting.items():
            missing = g.members - g.ready
            if g.ready and missing and not missing & busy and all(
                    now_s - max(g.since_s, self.free_since_s.get(n, g.since_s)) >= wait_s for n in missing):
                late.append((gang, missing))
        for gang, missing in late:
            self._refuse(gang, f"node(s) {sorted(missing)} did not ask for their part within {wait_s:g} s")
        return [gang for gang, _ in late]

    def leave(self, node: str) -> list[str]:
        """A node left (its daemon or raylet lost): every waiting gang with it is refused to
        its other members.  Running gangs stay with their other members, who see the loss
        themselves (a collective fails); the node's untaken messages are dropped."""
        self.lost.add(node)
        self.told.pop(node, None)
        refused = [gang for gang, g in self.waiting.items() if node in g.members]
        for gang in refused:
            self._refuse(gang, f"node {node!r} left the cluster")
        return refused

    def rejoin(self, node: str) -> None:
        self.lost.discard(node)

    def take(self, node: str) -> list[tuple[str, str]]:
        """What `node` has yet to be told: (gang, "") admitted, (gang, why) refused."""
        return self.told.pop(node, [])

    def _refuse(self, gang: str, why: str) -> None:
        g = self.waiting.pop(gang)
        for member in g.members - self.lost:
            self.told.setdefault(member, []).append((gang, why))
