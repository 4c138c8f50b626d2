"""One client's session at the daemon: its lease, and the budget changes on their way to it.

    Decision ─► changed grants ─► Session.queue(grant, now)
        a shrink is due at once (a partner starts on the cores it gives up);
        a grow waits `settle_s` (the partner's next sub-stage is usually asked for within a
        few ms: growing and shrinking back would move the worker's threads twice for nothing);
        a change back to what the worker already holds cancels what was pending
    Heartbeat(wait_s) ─► park(conn, req, until)  ─►  Session.reply(now): a Beat with the due
        changes, sent as soon as one is due (or empty once the heartbeat's time is up)

The daemon owns the sockets and the clock; this only keeps the bookkeeping, so a test can
drive it with numbers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from jigsaw import protocol as pr


def _what_binds(g: pr.Grant) -> pr.Grant:
    """The grant as its worker sees it (the request number it answers does not matter)."""
    return msgspec.structs.replace(g, req=0)


def _share(g: pr.Grant) -> tuple[float, int]:
    """How much a grant gives: its SM share, then its cores (host work computing on a CPU
    holds no share but is given cores)."""
    cores = getattr(g.partition, "cores", ())
    return g.sm_frac, len(cores)


@dataclass(slots=True)
class Session:
    pipeline: str
    last_seen: float
    """When its latest message arrived (the daemon's wall clock)."""
    holds: dict[str, pr.Grant] = field(default_factory=dict)
    """What each of its running sub-stages was last handed (its admission, or a Beat)."""
    pending: dict[str, tuple[pr.Grant, float]] = field(default_factory=dict)
    """Budget changes not handed out yet, and when each is due."""
    parked: tuple[int, int, float] | None = None
    """A heartbeat waiting for a due change: (connection, req, answer by this time)."""

    def admitted(self, g: pr.Grant) -> None:
        self.holds[g.substage] = _what_binds(g)

    def queue(self, g: pr.Grant, now_s: float, settle_s: float) -> None:
        """A re-plan changed a running sub-stage's budget (see the module docstring)."""
        held = self.holds.get(g.substage)
        if held is not None and _what_binds(g) == held:
            self.pending.pop(g.substage, None)  # back to what it holds: nothing to send
            return
        grows = held is not None and _share(g) > _share(held)
        self.pending[g.substage] = (g, now_s + settle_s if grows else now_s)

    def ended(self, substage: str) -> None:
        self.holds.pop(substage, None)
        self.pending.pop(substage, None)  # a budget change it no longer needs

    def park(self, conn: int, req: int, until_s: float) -> None:
        self.parked = (conn, req, until_s)

    def due(self, now_s: float) -> bool:
        return any(t <= now_s for _, t in self.pending.values())

    def next_due_s(self) -> float | None:
        """When the next pending change falls due (None: nothing pending)."""
        return min((t for _, t in self.pending.values()), default=None)

    def take(self, now_s: float) -> tuple[pr.Grant, ...]:
        """The changes due by `now_s`, now handed out."""
        out = tuple(g for g, t in self.pending.values() if t <= now_s)
        for g in out:
            del self.pending[g.substage]
            self.holds[g.substage] = _what_binds(g)
        return out

    def reply(self, now_s: float, *, force: bool = False) -> tuple[int, pr.Beat] | None:
        """(connection, Beat) for the parked heartbeat when a change is due, its time is up,
        or `force` (the session ends); None while it should wait on."""
        if self.parked is None:
            return None
        conn, req, until_s = self.parked
        if not (force or self.due(now_s) or until_s <= now_s):
            return None
        self.parked = None
        return conn, pr.Beat(grants=self.take(now_s), req=req)
